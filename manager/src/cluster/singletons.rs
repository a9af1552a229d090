//! The cluster singletons that run beside the controllers' pass: the backup controller
//! (backups, restores, deletions from the target, the target's poll and backup GC, with their
//! `zebu-backup-run` jobs), the standby controller (DR volumes following their source's
//! backups) and the recurring controller (RecurringJobs' schedules and retention). On one
//! host `zebu up` runs them for good; in a cluster exactly one manager may, the one that
//! holds the cluster Lease, so each is started when this manager starts leading and stopped
//! when it stops.
//!
//! **Why two managers never run one at once.** [`Membership::leads`] turns false once the
//! cluster Lease has not been renewed for the renew deadline, which is 5 s shorter than the
//! Lease's duration that another manager waits before it takes the Lease over (see
//! [`super::lease`]). This loop asks every [`CHECK`] and then stops the singleton within
//! [`FINISH_WITHIN`] (told to stop between two passes, aborted if a pass hangs, as it does
//! against an API server that no longer answers), well inside that margin.
//!
//! **The job processes go with the lead.** An upload or restore process the old leader
//! started needs no manager to go on, so on its own it would outlive the lead: the new
//! leader, which does not see the old one's job files, would start another attempt of the
//! same backup beside it, two writers of one restore into the same replicas. So when the
//! lead is lost, the singleton's `on_lost` ([`kill_jobs`] for the backup controllers) kills
//! every job process of this manager at once, and again once the singleton has stopped (a
//! pass that was under way may have started one meanwhile). The attempt it killed is
//! recorded (write-ahead) in the Backup's status, so the new leader counts it and retries.
//!
//! A manager that *stops* (SIGTERM, an upgrade) keeps its job processes: it does not give
//! up the Lease either, and if it comes back within the Lease's duration it finds them again
//! by their command lines. A manager killed with -9 cannot kill anything; its processes run
//! on beside the new leader's attempt (the attempts deduplicate each other's chunks, and
//! the manifest, written last with a create-only put, is the commit point).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use zebu_controllers::Membership;

/// How often leadership is looked at.
pub const CHECK: Duration = Duration::from_millis(500);
/// How long a singleton told to stop may take to end before it is aborted.
pub const FINISH_WITHIN: Duration = Duration::from_secs(2);

/// The `on_lost` of the backup and standby controllers: kill every job process whose job
/// file is in `jobs_dir` (this manager's, see [`zebu_controllers::backup_jobs::kill_all_in`]).
pub fn kill_jobs(what: &'static str, jobs_dir: std::path::PathBuf) -> impl Fn() + Send + Sync {
    move || {
        let killed = zebu_controllers::backup_jobs::kill_all_in(&jobs_dir);
        if !killed.is_empty() {
            tracing::warn!(
                ?killed,
                "{what}: killed this manager's job processes (the cluster Lease is lost; the next leader retries their attempts)"
            );
        }
    }
}

/// Run `start(stop)` while `membership` leads, until `stop` turns true: started when it
/// starts leading; when it no longer does, `on_lost()` is called, the singleton is told to
/// stop (aborted after [`FINISH_WITHIN`]) and `on_lost()` is called again; started again
/// when it leads again. When `stop` turns true the singleton is stopped the same way but
/// without `on_lost` (see the module docs).
pub async fn run_while_leading<F, Fut, L>(
    what: &'static str,
    membership: Arc<dyn Membership>,
    start: F,
    on_lost: L,
    mut stop: watch::Receiver<bool>,
) where
    F: Fn(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
    L: Fn(),
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
            on_lost();
            finish(what, tx, task).await;
            on_lost();
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

async fn finish(what: &'static str, tx: watch::Sender<bool>, mut task: JoinHandle<()>) {
    // The task may have ended already (a panic): then there is nobody to tell.
    let _ = tx.send(true);
    let ended = match tokio::time::timeout(FINISH_WITHIN, &mut task).await {
        Ok(ended) => ended,
        Err(_) => {
            tracing::warn!(
                "{what}: did not stop within {} s (a pass waiting on an API server that does not answer?): aborted",
                FINISH_WITHIN.as_secs()
            );
            task.abort();
            (&mut task).await
        }
    };
    if let Err(e) = ended
        && !e.is_cancelled()
    {
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

    /// Started only while leading, stopped when the lead is lost (its `on_lost` called
    /// before and after), started again when it comes back; never two at once; stopped
    /// with the manager without `on_lost`.
    #[tokio::test]
    async fn runs_only_while_leading() {
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let live = Arc::new(AtomicU32::new(0));
        let starts = Arc::new(AtomicU32::new(0));
        let lost = Arc::new(AtomicU32::new(0));
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = {
            let live = live.clone();
            let starts = starts.clone();
            let lost = lost.clone();
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
                move || {
                    lost.fetch_add(1, Ordering::SeqCst);
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
        assert_eq!(lost.load(Ordering::SeqCst), 0);
        flag.0.store(false, Ordering::SeqCst);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (1, 0)
        );
        assert_eq!(lost.load(Ordering::SeqCst), 2, "on_lost before and after");
        flag.0.store(true, Ordering::SeqCst);
        settle().await;
        assert_eq!(
            (starts.load(Ordering::SeqCst), live.load(Ordering::SeqCst)),
            (2, 1)
        );
        stop_tx.send(true).expect("send");
        task.await.expect("supervisor");
        assert_eq!(live.load(Ordering::SeqCst), 0, "stopped with the manager");
        assert_eq!(
            lost.load(Ordering::SeqCst),
            2,
            "no on_lost when the manager stops"
        );
    }

    /// A singleton whose pass hangs (an API server that stopped answering) is aborted
    /// within FINISH_WITHIN of the lead being lost, so `on_lost` runs its second time well
    /// inside the margin before another manager may take over.
    #[tokio::test]
    async fn a_hung_singleton_is_aborted_when_the_lead_is_lost() {
        let flag = Arc::new(Flag(AtomicBool::new(true)));
        let lost = Arc::new(std::sync::Mutex::new(Vec::<std::time::Instant>::new()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = {
            let lost = lost.clone();
            tokio::spawn(run_while_leading(
                "hung singleton",
                flag.clone(),
                |_stop| std::future::pending::<()>(),
                move || lost.lock().expect("lock").push(std::time::Instant::now()),
                stop_rx,
            ))
        };
        tokio::time::sleep(CHECK * 2).await;
        let at = std::time::Instant::now();
        flag.0.store(false, Ordering::SeqCst);
        tokio::time::sleep(CHECK * 2 + FINISH_WITHIN).await;
        let calls = lost.lock().expect("lock").clone();
        assert_eq!(calls.len(), 2, "on_lost before and after the abort");
        assert!(calls[0] - at <= CHECK * 2, "first on_lost at once");
        assert!(
            calls[1] - at <= CHECK * 2 + FINISH_WITHIN,
            "second on_lost after the abort, within FINISH_WITHIN"
        );
        stop_tx.send(true).expect("send");
        tokio::time::timeout(CHECK * 4, task)
            .await
            .expect("supervisor ends")
            .expect("supervisor");
    }
}
