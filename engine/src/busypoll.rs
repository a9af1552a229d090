//! Busy polling: one thread keeps a CPU awake while the volume is busy at low queue depth.
//!
//! A request at queue depth 1 crosses four sockets (client → engine → replica → engine →
//! client), and each crossing wakes a sleeping thread. When the CPU that thread runs on has
//! gone idle, a virtual machine's vCPU has halted, and waking it costs an interprocessor
//! interrupt through the hypervisor. On the 2-vCPU test machine a TCP ping-pong between two
//! processes takes 54 µs per round trip; with a third thread calling `sched_yield` in a loop
//! it takes 18 µs, because a running CPU takes the wake-ups cheaply.
//!
//! [`BusyPoll`] is such a thread, switched on by the volume's own traffic:
//!
//! ```text
//!            a request starts, at most max_inflight in flight,
//!            and none deeper for shallow_for
//!  asleep ─────────────────────────────────────────► spinning (sched_yield loop)
//!     ▲                                                     │
//!     └──── no request started or finished for `window`, ───┘
//!           or more than max_inflight in flight
//! ```
//!
//! - It spins with `sched_yield` at nice 19, so any runnable thread on its CPU runs at once
//!   and other work is hardly slowed by it; the time it spins is counted in the engine's CPU
//!   use. At queue depth 1 that is most of one CPU
//!   while the client keeps sending (benches/README.md, "Busy polling").
//! - At higher queue depths every CPU is busy anyway: it sleeps when more than
//!   `max_inflight` requests are in flight, and a queue that drains and refills in bursts
//!   does not wake it. It never spins longer than `window` after the last request started
//!   or finished, however long a request (a flush, a dead replica) takes.
//! - [`Polled`] wraps a [`BlockDevice`] so that every request marks the volume busy.
//! - It is off unless `zebu-engine serve --busy-poll-us N` asks for it: where the replicas
//!   share the engine's CPUs (the 2-vCPU test machine), three replicas under 4 KiB random
//!   writes at queue depth 32 lost about a tenth of their IOPS with it (the queue goes
//!   shallow for tens of milliseconds at a time there), and queue depth 1 over three
//!   replicas gained nothing. One replica at queue depth 1 gains most (benches/README.md,
//!   "Busy polling and hole answers").

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::blockdev::{BlockDevice, BlockError, BoxFuture};

/// Requests in flight above which the poller sleeps (the CPUs are busy without it).
pub const MAX_INFLIGHT: usize = 4;
/// How long the queue must have stayed at most `max_inflight` deep before the poller spins.
/// 5 ms was too short: under 4 KiB random writes at queue depth 32 through NBD over three
/// replicas, the queue was seen to stay that shallow for longer (p99 latency 4–6 ms), and
/// spinning then cost that row a fifth of its IOPS (nbd-bench: 25–31k against 38–39k).
pub const SHALLOW_FOR: Duration = Duration::from_millis(50);

struct Shared {
    epoch: Instant,
    window_ns: u64,
    max_inflight: usize,
    shallow_ns: u64,
    inflight: AtomicUsize,
    /// When a request last started or finished, in ns since `epoch`.
    last_event: AtomicU64,
    /// When more than `max_inflight` requests were last in flight, in ns since `epoch`,
    /// plus one; 0 if never.
    last_deep: AtomicU64,
    asleep: AtomicBool,
    stop: AtomicBool,
    /// `sched_yield` rounds so far (tests and figures).
    rounds: AtomicU64,
    thread: OnceLock<Thread>,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn should_spin(&self) -> bool {
        let inflight = self.inflight.load(SeqCst);
        let now = self.now_ns();
        inflight <= self.max_inflight
            && now.saturating_sub(self.last_event.load(Relaxed)) < self.window_ns
            && self.shallow_for_a_while(now)
    }

    /// Whether the queue has stayed shallow for `shallow_for` ([`SHALLOW_FOR`]): a deep
    /// queue drains and fills again in bursts (at queue depth 32 through NBD, requests start at every depth
    /// from 1 to 32 about equally often), and its shallow moments are no reason to spin.
    fn shallow_for_a_while(&self, now: u64) -> bool {
        match self.last_deep.load(Relaxed) {
            0 => true,
            deep => now.saturating_sub(deep - 1) >= self.shallow_ns,
        }
    }

    fn wake(&self) {
        if self.asleep.load(SeqCst)
            && self.asleep.swap(false, SeqCst)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }
}

/// The busy-polling thread of one engine; see the module docs. Dropping it stops the thread.
pub struct BusyPoll {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

impl BusyPoll {
    /// Starts the thread. `window`: how long it spins after the last request started or
    /// finished; `max_inflight`: above this many requests in flight it sleeps, and it spins
    /// again only once the queue stayed that shallow for `shallow_for`.
    pub fn start(
        window: Duration,
        max_inflight: usize,
        shallow_for: Duration,
    ) -> std::io::Result<BusyPoll> {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            window_ns: ns(window),
            max_inflight,
            shallow_ns: ns(shallow_for),
            inflight: AtomicUsize::new(0),
            last_event: AtomicU64::new(0),
            last_deep: AtomicU64::new(0),
            asleep: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            rounds: AtomicU64::new(0),
            thread: OnceLock::new(),
        });
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name("zebu-busypoll".into())
            .spawn(move || run(&s))?;
        let _ = shared.thread.set(handle.thread().clone());
        Ok(BusyPoll {
            shared,
            handle: Some(handle),
        })
    }

    /// Marks one request in flight until the returned guard drops.
    pub fn enter(&self) -> Busy {
        let s = &self.shared;
        let now = s.now_ns();
        // Stored before the count changes, so that whoever sees the new count sees the time.
        s.last_event.store(now, Relaxed);
        let n = s.inflight.fetch_add(1, SeqCst) + 1;
        if n > s.max_inflight {
            s.last_deep.store(now + 1, Relaxed);
        } else if s.shallow_for_a_while(now) {
            s.wake();
        }
        Busy {
            shared: self.shared.clone(),
        }
    }

    /// Whether the thread is spinning now (not asleep).
    pub fn spinning(&self) -> bool {
        !self.shared.asleep.load(SeqCst)
    }

    /// `sched_yield` rounds the thread has made since it started.
    pub fn rounds(&self) -> u64 {
        self.shared.rounds.load(Relaxed)
    }
}

impl Drop for BusyPoll {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        if let Some(h) = self.handle.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// One request in flight; see [`BusyPoll::enter`].
pub struct Busy {
    shared: Arc<Shared>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let s = &self.shared;
        s.last_event.store(s.now_ns(), Relaxed);
        s.inflight.fetch_sub(1, SeqCst);
    }
}

fn run(s: &Shared) {
    // Nice 19: where several engines spin on one host, or real work waits for a CPU, the
    // spinning gets about 1.5 % of a CPU's time against a nice-0 thread instead of an equal
    // share. Measured the same at queue depth 1 as at nice 0 (NBD, 1 replica: p50 56–69 µs).
    // SAFETY: plain syscalls on this thread's own id; a failure only leaves the nice at 0.
    unsafe {
        let tid = libc::id_t::try_from(libc::gettid()).unwrap_or(0);
        if libc::setpriority(libc::PRIO_PROCESS, tid, 19) != 0 {
            tracing::debug!("busy poll: cannot lower the thread's priority");
        }
    }
    while !s.stop.load(SeqCst) {
        if !s.asleep.load(SeqCst) && s.should_spin() {
            // SAFETY: sched_yield takes no arguments and touches no memory of ours.
            unsafe { libc::sched_yield() };
            s.rounds.fetch_add(1, Relaxed);
            continue;
        }
        s.asleep.store(true, SeqCst);
        // A request that started between the check above and the store saw `asleep` false
        // and did not wake us: look again before sleeping.
        if s.should_spin() {
            s.asleep.store(false, SeqCst);
            continue;
        }
        std::thread::park();
    }
}

/// A [`BlockDevice`] whose every request keeps the [`BusyPoll`] thread spinning.
pub struct Polled {
    inner: Arc<dyn BlockDevice>,
    poll: BusyPoll,
}

impl Polled {
    pub fn new(inner: Arc<dyn BlockDevice>, poll: BusyPoll) -> Polled {
        Polled { inner, poll }
    }
}

/// Runs `fut` with one request marked in flight.
fn busy<'a, T: Send + 'a>(
    poll: &BusyPoll,
    fut: BoxFuture<'a, Result<T, BlockError>>,
) -> BoxFuture<'a, Result<T, BlockError>> {
    let guard = poll.enter();
    Box::pin(async move {
        let r = fut.await;
        drop(guard);
        r
    })
}

impl BlockDevice for Polled {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        busy(&self.poll, self.inner.read(offset, len))
    }

    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        busy(&self.poll, self.inner.write(offset, data))
    }

    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        busy(&self.poll, self.inner.unmap(offset, len))
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        busy(&self.poll, self.inner.flush())
    }
}

#[cfg(test)]
mod tests {
    //! The poller's states, watched from outside: these tests wait for a state with a
    //! generous deadline (the thread must be scheduled), never for a fixed time.

    use std::time::Duration;

    use super::*;
    use crate::blockdev::MemDevice;

    const DEADLINE: Duration = Duration::from_secs(10);

    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < DEADLINE,
                "not within {DEADLINE:?}: {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn spins_while_requests_come_and_sleeps_a_window_after_the_last() {
        let p = BusyPoll::start(Duration::from_millis(30), 4, Duration::ZERO).unwrap();
        assert!(!p.spinning(), "nothing happened yet");
        assert_eq!(p.rounds(), 0);
        let g = p.enter();
        eventually("spinning after enter", || p.spinning() && p.rounds() > 0);
        drop(g);
        eventually("asleep a window after the request ended", || !p.spinning());
        let rounds = p.rounds();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(p.rounds(), rounds, "asleep means no more rounds");
        // And it comes back for the next request.
        let _g = p.enter();
        eventually("spinning again", || p.rounds() > rounds);
    }

    #[test]
    fn a_request_that_takes_long_stops_the_spin_after_the_window() {
        let p = BusyPoll::start(Duration::from_millis(20), 4, Duration::ZERO).unwrap();
        let _slow = p.enter();
        eventually("spinning", || p.rounds() > 0);
        eventually("asleep although the request is still in flight", || {
            !p.spinning()
        });
    }

    #[test]
    fn a_deep_queue_keeps_it_asleep_until_it_stayed_shallow() {
        let p = BusyPoll::start(Duration::from_millis(20), 2, Duration::from_secs(3600)).unwrap();
        let g = p.enter();
        eventually("spinning for a shallow queue", || p.rounds() > 0);
        drop(g);
        eventually("asleep after the window", || !p.spinning());
        // Three in flight: deeper than 2, so from now on shallow moments do not wake it.
        let deep: Vec<Busy> = (0..3).map(|_| p.enter()).collect();
        eventually("asleep with a deep queue", || !p.spinning());
        drop(deep);
        let rounds = p.rounds();
        let _one = p.enter();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !p.spinning(),
            "woken by a shallow moment right after a deep queue"
        );
        assert_eq!(p.rounds(), rounds);
    }

    #[test]
    fn dropping_it_stops_the_thread_even_while_spinning() {
        let p = BusyPoll::start(Duration::from_secs(3600), 4, Duration::ZERO).unwrap();
        let g = p.enter();
        eventually("spinning", || p.rounds() > 0);
        let start = Instant::now();
        drop(p);
        assert!(start.elapsed() < DEADLINE);
        drop(g); // a guard may outlive the poller
    }

    #[test]
    fn polled_device_passes_data_and_errors_through() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let poll = BusyPoll::start(Duration::from_millis(1), 4, Duration::ZERO).unwrap();
        let dev = Polled::new(Arc::new(MemDevice::new(1 << 20)), poll);
        rt.block_on(async {
            assert_eq!(dev.size(), 1 << 20);
            dev.write(4096, Bytes::from(vec![7u8; 8192])).await.unwrap();
            dev.unmap(8192, 4096).await.unwrap();
            dev.flush().await.unwrap();
            let got = dev.read(4096, 8192).await.unwrap();
            assert_eq!(&got[..4096], &[7u8; 4096][..]);
            assert_eq!(&got[4096..], &[0u8; 4096][..]);
            assert!(matches!(
                dev.read((1 << 20) - 4096, 8192).await,
                Err(BlockError::OutOfRange { .. })
            ));
        });
        assert_eq!(
            dev.poll.shared.inflight.load(SeqCst),
            0,
            "every guard dropped"
        );
    }
}
