//! Orders overlapping writes: a write may go out to the replicas only when no earlier write
//! that overlaps it is still pending.
//!
//! Replicas run requests concurrently, so two overlapping writes in flight at once could land
//! in different orders on different replicas and leave them different. The engine therefore
//! registers every write, unmap and catch-up copy here, in submission order, and sends it only
//! once every earlier overlapping registration has been released. Non-overlapping requests
//! never wait for each other.
//!
//! The pending set is at most the queue depth (tens to a few hundred), so a linear scan is
//! cheaper than an interval tree.
//!
//! Every write takes and releases the lock, so the common case (nothing overlaps) costs one
//! mutex section to register and one to release: the overlap check happens in the same
//! section as the registration, and a release wakes waiters only when some request is
//! actually waiting (`State::waiting`), since waking through the [`Notify`] takes its own
//! lock.

use std::ops::Range;
use std::sync::Mutex;

use tokio::sync::Notify;

#[derive(Default)]
pub struct RangeLock {
    state: Mutex<State>,
    released: Notify,
}

#[derive(Default)]
struct State {
    next: u64,
    /// (ticket, range) of every registered request, in ticket order.
    pending: Vec<(u64, Range<u64>)>,
    /// Registered requests that found an earlier overlapping one and wait for its release.
    waiting: usize,
}

impl State {
    fn blocked(&self, ticket: u64, range: &Range<u64>) -> bool {
        self.pending
            .iter()
            .take_while(|(t, _)| *t < ticket)
            .any(|(_, r)| overlaps(r, range))
    }
}

/// Holds a range until dropped.
pub struct RangeGuard<'a> {
    lock: &'a RangeLock,
    ticket: u64,
}

fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

impl RangeLock {
    pub fn new() -> RangeLock {
        RangeLock::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("invariant: range lock not poisoned")
    }

    /// Registers `range` now (fixing its place in the order) and waits until every earlier
    /// overlapping registration is released.
    pub async fn lock(&self, range: Range<u64>) -> RangeGuard<'_> {
        let ticket = {
            let mut st = self.state();
            let t = st.next;
            st.next += 1;
            // Only earlier tickets can block this one, and every one of them is in `pending`
            // before it, so the check needs no second look after the push.
            let blocked = st.blocked(t, &range);
            st.pending.push((t, range.clone()));
            if !blocked {
                return RangeGuard {
                    lock: self,
                    ticket: t,
                };
            }
            st.waiting += 1;
            t
        };
        // Dropped (a cancelled write) or returned, the guard releases the ticket; `Waiting`
        // keeps the waiter count right on both paths.
        let guard = RangeGuard { lock: self, ticket };
        let _waiting = Waiting(self);
        loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            // Registered before the check, so a release in between still wakes us.
            notified.as_mut().enable();
            if !self.state().blocked(ticket, &range) {
                return guard;
            }
            notified.await;
        }
    }

    /// Number of registered requests (waiting or running).
    pub fn pending(&self) -> usize {
        self.state().pending.len()
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.lock.state();
        if let Some(i) = st.pending.iter().position(|(t, _)| *t == self.ticket) {
            st.pending.remove(i);
        }
        let anyone_waiting = st.waiting > 0;
        drop(st);
        if anyone_waiting {
            self.lock.released.notify_waiters();
        }
    }
}

/// Counts one waiter in `State::waiting` while it lives.
struct Waiting<'a>(&'a RangeLock);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().waiting -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    proptest! {
        /// Against a naive model: with random ranges submitted in order, every request runs
        /// only after all earlier overlapping ones finished, and the final contents of a
        /// byte array written under the lock equal sequential application in submission order.
        #[test]
        fn overlapping_writes_apply_in_submission_order(
            reqs in proptest::collection::vec((0..64u64, 1..16u64), 1..40)
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
            let got = rt.block_on(async {
                let lock = Arc::new(RangeLock::new());
                let data = Arc::new(Mutex::new(vec![0u32; 80]));
                let mut tasks = Vec::new();
                for (i, (s, l)) in reqs.iter().enumerate() {
                    let (lock, data) = (lock.clone(), data.clone());
                    let r = *s..*s + *l;
                    let id = i as u32 + 1;
                    let (registered_tx, registered) = tokio::sync::oneshot::channel();
                    tasks.push(tokio::spawn(async move {
                        let fut = lock.lock(r.clone());
                        tokio::pin!(fut);
                        // The first poll registers; only then may the next request be submitted.
                        let first = futures::poll!(fut.as_mut());
                        let _ = registered_tx.send(());
                        let guard = match first {
                            std::task::Poll::Ready(g) => g,
                            std::task::Poll::Pending => fut.await,
                        };
                        // Write each byte with a yield in between, as a slow replica would.
                        for b in r.clone() {
                            data.lock().expect("data")[b as usize] = id;
                            tokio::task::yield_now().await;
                        }
                        drop(guard);
                    }));
                    registered.await.expect("registered");
                }
                for t in tasks { t.await.expect("task"); }
                data.lock().expect("data").clone()
            });
            let mut model = vec![0u32; 80];
            for (i, (s, l)) in reqs.iter().enumerate() {
                for b in *s..*s + *l { model[b as usize] = i as u32 + 1; }
            }
            prop_assert_eq!(got, model);
        }
    }

    #[tokio::test]
    async fn disjoint_ranges_do_not_wait() {
        let lock = RangeLock::new();
        let a = lock.lock(0..10).await;
        let b = lock.lock(10..20).await;
        assert_eq!(lock.pending(), 2);
        drop((a, b));
        assert_eq!(lock.pending(), 0);
    }

    #[tokio::test]
    async fn an_overlapping_request_waits_for_the_earlier_one() {
        let lock = Arc::new(RangeLock::new());
        let a = lock.lock(0..10).await;
        let done = Arc::new(AtomicUsize::new(0));
        let (l2, d2) = (lock.clone(), done.clone());
        let t = tokio::spawn(async move {
            let _b = l2.lock(5..6).await;
            d2.store(1, Ordering::SeqCst);
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(
            done.load(Ordering::SeqCst),
            0,
            "must wait for the overlapping write"
        );
        drop(a);
        t.await.expect("task");
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }
}
