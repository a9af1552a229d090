//! The cluster singletons that run beside the controllers' pass: the backup controller
//! (backups, restores, deletions from the target, the target's poll and backup GC, with their
//! `zebu-backup-run` jobs), the standby controller (DR volumes following their source's
//! backups) and the recurring controller (RecurringJobs' schedules and retention). On one
//! host `zebu up` runs them for good; in a cluster exactly one manager may, the one that
//! holds the cluster Lease, so each is started when this manager starts leading and stopped
//! when it stops.
//!
//! **Why two managers never run it at once.** [`Membership::leads`] turns false once the
//! cluster Lease has not been renewed for the renew deadline, which is 5 s shorter than the
//! Lease's duration that another manager waits before it takes the Lease over (see
//! [`super::lease`]). This loop asks every [`CHECK`] and then stops the controller between
//! two of its passes, so a pass that ends within the remaining margin is the last one.
//!
//! An upload process the old leader started is not killed when it stops leading (the
//! controller has no such step, and the process needs no manager to finish): the new leader,
//! which does not see the old one's job files, may start another attempt of the same backup
//! beside it, as it would after the old leader's node died. The attempts deduplicate against
//! each other's chunks, and the manifest, written last, is the commit point.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use zebu_controllers::Membership;

/// How often leadership is looked at.
pub const CHECK: Duration = Duration::from_millis(500);

/// Run `start(stop)` while `membership` leads, until `stop` turns true: started when it
/// starts leading, told to stop (and awaited) when it no longer does, started again when it
/// leads again.
pub async fn run_while_leading<F, Fut>(
    what: &'static str,
    membership: Arc<dyn Membership>,
    start: F,
    mut stop: watch::Receiver<bool>,
) where
    F: Fn(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut running: Option<(watch::Sender<bool>, JoinHandle<()>)> = None;
    loop {
        let leads = membership.leads();
        if leads && running.is_none() {
            tracing::info!("{what}: started (this manager holds the cluster Lease)");
            let (tx, rx) = watch::channel(false);
            running = Some((tx, tokio::spawn(start(rx))));
        } else if !leads && let Some((tx, task)) = running.take() {
            tracing::info!("{what}: stopping (this manager no longer holds the cluster Lease)");
            finish(what, tx, task).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(CHECK) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            break;
        }
    }
    if let Some((tx, task)) = running {
        finish(what, tx, task).await;
    }
}

async fn finish(what: &'static str, tx: watch::Sender<bool>, task: JoinHandle<()>) {
    // The task may have ended already (a panic): then there is nobody to tell.
    let _ = tx.send(true);
    if let Err(e) = task.await {
        tracing::warn!("{what}: task failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use zebu_controllers::PresenceMap;

    use super::*;

    struct Flag(AtomicBool);
    impl Membership for Flag {
        fn may_act(&self) -> bool {
            true
        }
        fn presence(&self) -> PresenceMap {
            PresenceMap::new()
        }
        fn leads(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Started only while leading, stopped when the lead is lost, started again when it
    /// comes back; never two at once.
    #[tokio::test]
    async fn runs_only_while_leading() {
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let live = Arc::new(AtomicU32::new(0));
        let starts = Arc::new(AtomicU32::new(0));
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = {
            let live = live.clone();
            let starts = starts.clone();
            tokio::spawn(run_while_leading(
                "test singleton",
                flag.clone(),
                move |mut stop| {
                    let live = live.clone();
                    starts.fetch_add(1, Ordering::SeqCst);
                    async move {
                        assert_eq!(live.fetch_add(1, Ordering::SeqCst), 0, "two at once");
                        while !*stop.borrow() {
                            let _ = stop.changed().await;
                        }
                        live.fetch_sub(1, Ordering::SeqCst);
                    }
                },
                stop_rx,
            ))
        };
        let settle = || tokio::time::sleep(CHECK * 3);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (0, 0)
        );
        flag.0.store(true, Ordering::SeqCst);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (1, 1)
        );
        flag.0.store(false, Ordering::SeqCst);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (1, 0)
        );
        flag.0.store(true, Ordering::SeqCst);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (2, 1)
        );
        stop_tx.send(true).expect("send");
        task.await.expect("supervisor");
        assert_eq!(live.load(Ordering::SeqCst), 0, "stopped with the manager");
    }
}
