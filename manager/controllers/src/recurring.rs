//! The recurring controller: runs each RecurringJob when its schedule says, and keeps the
//! newest `retain` of the snapshots or backups it took per volume (the operations and the
//! schedule grammar are in `zebu-ops`' `recurring` module).
//!
//! It is a cluster singleton: on one host the one manager runs it; in a cluster every
//! manager runs the loop but only the one that holds the cluster Lease
//! ([`Membership::leads`]) acts, so a job runs once per cluster. Each pass decides from the
//! store alone (`status.nextRunAt`, the labelled backups), so a manager killed at any point,
//! or a new leader, carries on without running a job twice for one slot:
//!
//! - **Due**: `nextRunAt` is computed and recorded when a job is first seen, and again
//!   after each slot; a slot is run (or skipped) once `nextRunAt` has passed.
//! - **One run at a time**: a backup job's run is under way while a backup it took is
//!   `pending` or `in-progress`; a slot that comes meanwhile is skipped (counted in
//!   `status.skipped`), not queued. Snapshots are taken within the pass.
//! - **Run**: for each of the job's volumes (at most `concurrency` at once), a backup
//!   (`create_backup`, which snapshots the volume) or a snapshot, named `<job>-rj<time>`,
//!   labelled with the job. A volume that cannot be snapshotted now (no engine can be
//!   started, being deleted) is reported in `status.lastError` and tried at the next slot.
//! - **Retention**, every pass: of the completed backups a job took of a volume, all but the
//!   newest `retain` are deleted through the normal delete path (the manifest leaves the
//!   target, GC takes the data), and so are its failed ones; the snapshot each deleted
//!   backup took is deleted too when the volume is attached (an engine is at hand). For a
//!   snapshot job, its snapshots beyond the newest `retain`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use zebu_ops::recurring::{Schedule, labels_for, made_by, new_name, snapshots_made_by, volumes_of};
use zebu_ops::{Ops, OpsError};
use zebu_types::Store;
use zebu_types::requests::CreateSnapshot;
use zebu_types::requests::backup::CreateBackup;
use zebu_types::resources::{
    Backup, BackupState, RecurringJob, RecurringJobStatus, RecurringTask, Snapshot, Volume,
};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::time::{format_rfc3339, now_rfc3339, parse_rfc3339};

use crate::Membership;

const PERIOD: Duration = Duration::from_secs(1);

/// The recurring controller.
pub struct RecurringController {
    store: Arc<dyn Store>,
    ops: Ops,
}

impl RecurringController {
    pub fn new(store: Arc<dyn Store>) -> Self {
        let ops = Ops::new(store.clone());
        RecurringController { store, ops }
    }

    /// One pass over every job.
    pub async fn pass(&self) -> Result<(), StoreError> {
        let jobs = self.store.list_as::<RecurringJob>().await?;
        if jobs.is_empty() {
            return Ok(());
        }
        let volumes = self.store.list_as::<Volume>().await?;
        for job in jobs.iter().filter(|j| !j.metadata.is_deleting()) {
            if let Err(e) = self.job(job, &volumes).await {
                tracing::warn!(job = %job.metadata.name, "recurring controller: {e}");
            }
        }
        Ok(())
    }

    async fn write_status(
        &self,
        job: &RecurringJob,
        status: RecurringJobStatus,
    ) -> Result<(), StoreError> {
        if job.status == status {
            return Ok(());
        }
        let mut next = job.clone();
        next.status = status;
        match self.store.update_status_as(&next).await {
            Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn job(&self, job: &RecurringJob, volumes: &[Volume]) -> Result<(), StoreError> {
        let name = job.metadata.name.as_str();
        let mut status = job.status.clone();
        status.observed_generation = job.metadata.generation;
        let schedule = match Schedule::parse(&job.spec.cron) {
            Ok(s) => s,
            Err(e) => {
                status.last_error = e;
                return self.write_status(job, status).await;
            }
        };
        let now = SystemTime::now();
        let origin = job
            .metadata
            .creation_timestamp
            .as_deref()
            .and_then(parse_rfc3339)
            .unwrap_or(now);
        let targets = volumes_of(&job.spec, volumes);
        let backups = self.store.list_as::<Backup>().await?;
        let errors = self.retain(job, &targets, &backups).await?;

        let running = job.spec.task == RecurringTask::Backup
            && targets.iter().any(|v| {
                made_by(name, &v.metadata.name, &backups).iter().any(|b| {
                    !b.metadata.is_deleting()
                        && matches!(
                            b.status.state,
                            BackupState::Pending | BackupState::InProgress
                        )
                })
            });
        if !running {
            status.running_since = None;
        }
        let next = status.next_run_at.as_deref().and_then(parse_rfc3339);
        let Some(next) = next else {
            status.next_run_at = schedule.next_after(now, origin).map(format_rfc3339);
            return self.write_status(job, status).await;
        };
        if now < next {
            if !errors.is_empty() {
                status.last_error = errors.join("; ");
            }
            return self.write_status(job, status).await;
        }
        // The slot has come: run it, or skip it if the last run is still under way.
        status.next_run_at = schedule.next_after(now, origin).map(format_rfc3339);
        if running {
            status.skipped += 1;
            tracing::info!(
                job = name,
                "recurring job slot skipped: the previous run is still under way"
            );
            return self.write_status(job, status).await;
        }
        // The slot is recorded taken before the run: a manager killed during the run does
        // not run the same slot again.
        status.runs += 1;
        status.last_run_at = Some(now_rfc3339());
        if job.spec.task == RecurringTask::Backup {
            status.running_since = status.last_run_at.clone();
        }
        self.write_status(job, status.clone()).await?;
        let Some(fresh) = self.store.get_as::<RecurringJob>(name).await? else {
            return Ok(());
        };
        if fresh.status.runs != status.runs {
            // Another writer took the slot (a conflict): leave it to the next pass.
            return Ok(());
        }
        tracing::info!(
            job = name,
            task = job.spec.task.as_str(),
            volumes = targets.len(),
            "recurring job runs"
        );
        let concurrency = job.spec.concurrency.max(1) as usize;
        // Volumes in groups of `concurrency`, each group at once. (A stream with a borrowing
        // closure, `buffer_unordered`, made this future not provably `Send`, so it could
        // not be spawned.)
        let names: Vec<String> = targets.iter().map(|v| v.metadata.name.clone()).collect();
        let mut results: Vec<Result<(), String>> = Vec::with_capacity(names.len());
        for group in names.chunks(concurrency) {
            let runs: Vec<_> = group.iter().map(|n| self.run_one(job, n)).collect();
            results.extend(futures::future::join_all(runs).await);
        }
        let mut problems: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        problems.extend(errors);
        if targets.is_empty() {
            problems.push("no volume matches the job".to_string());
        }
        let mut after = fresh.status.clone();
        after.last_error = problems.join("; ");
        self.write_status(&fresh, after).await
    }

    /// Takes one backup or snapshot of `volume` for `job`.
    async fn run_one(&self, job: &RecurringJob, volume: &str) -> Result<(), String> {
        let name = new_name(&job.metadata.name);
        let r = match job.spec.task {
            RecurringTask::Backup => self
                .ops
                .create_backup(CreateBackup {
                    volume: volume.to_string(),
                    snapshot: None,
                    name: Some(name.clone()),
                    labels: labels_for(job),
                })
                .await
                .map(|_| ()),
            RecurringTask::Snapshot => self
                .ops
                .create_snapshot(
                    volume,
                    CreateSnapshot {
                        name: Some(name.clone()),
                    },
                )
                .await
                .map(|_| ()),
        };
        match r {
            Ok(()) => {
                tracing::info!(job = %job.metadata.name, volume, name, "recurring {} taken", job.spec.task.as_str());
                Ok(())
            }
            Err(e) => {
                tracing::warn!(job = %job.metadata.name, volume, "recurring {} failed: {e}", job.spec.task.as_str());
                Err(format!("volume {volume}: {e}"))
            }
        }
    }

    /// Deletes what the job took beyond its `retain` newest; the problems, one line each.
    async fn retain(
        &self,
        job: &RecurringJob,
        targets: &[&Volume],
        backups: &[Backup],
    ) -> Result<Vec<String>, StoreError> {
        let name = job.metadata.name.as_str();
        let keep = job.spec.retain as usize;
        let mut problems = Vec::new();
        match job.spec.task {
            RecurringTask::Backup => {
                for v in targets {
                    let vol = v.metadata.name.as_str();
                    let mine: Vec<&Backup> = made_by(name, vol, backups)
                        .into_iter()
                        .filter(|b| !b.metadata.is_deleting())
                        .collect();
                    let completed: Vec<&&Backup> = mine
                        .iter()
                        .filter(|b| b.status.state == BackupState::Completed)
                        .collect();
                    let surplus = completed.len().saturating_sub(keep);
                    let failed = mine.iter().filter(|b| b.status.state == BackupState::Error);
                    for b in completed
                        .iter()
                        .take(surplus)
                        .map(|b| **b)
                        .chain(failed.copied())
                    {
                        let bname = b.metadata.name.as_str();
                        match self.ops.delete_backup(bname).await {
                            Ok(_) | Err(OpsError::NotFound { .. }) => {
                                tracing::info!(job = name, volume = vol, backup = bname, state = %b.status.state,
                                    retain = keep, "recurring job deletes a backup beyond retention");
                            }
                            Err(e) => problems.push(format!("deleting backup {bname}: {e}")),
                        }
                        // Its snapshot, when this backup took it and an engine is at hand.
                        if b.spec.snapshot == b.metadata.name && v.spec.node_id.is_some() {
                            match self.ops.delete_snapshot(vol, &b.spec.snapshot).await {
                                Ok(_) | Err(OpsError::NotFound { .. }) => {}
                                Err(e) => tracing::warn!(
                                    job = name,
                                    volume = vol,
                                    "cannot delete the snapshot of backup {bname} yet: {e}"
                                ),
                            }
                        }
                    }
                }
            }
            RecurringTask::Snapshot => {
                let records = self.store.list_as::<Snapshot>().await?;
                for v in targets {
                    let vol = v.metadata.name.as_str();
                    let mine = snapshots_made_by(name, vol, &records);
                    let surplus = mine.len().saturating_sub(keep);
                    for s in mine.iter().take(surplus) {
                        match self.ops.delete_snapshot(vol, s).await {
                            Ok(_) | Err(OpsError::NotFound { .. }) => {
                                tracing::info!(job = name, volume = vol, snapshot = %s, retain = keep,
                                    "recurring job deletes a snapshot beyond retention");
                            }
                            Err(e) => problems.push(format!("deleting snapshot {s} of {vol}: {e}")),
                        }
                    }
                }
            }
        }
        Ok(problems)
    }
}

/// Runs the recurring controller until `stop` turns true; with a `membership`, only while
/// this manager leads the cluster.
pub async fn run(
    store: Arc<dyn Store>,
    membership: Option<Arc<dyn Membership>>,
    mut stop: watch::Receiver<bool>,
) {
    let c = RecurringController::new(store);
    loop {
        let leads = membership.as_ref().is_none_or(|m| m.leads() && m.may_act());
        if leads && let Err(e) = c.pass().await {
            tracing::warn!("recurring controller: {e}");
        }
        tokio::select! {
            _ = tokio::time::sleep(PERIOD) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            break;
        }
    }
}
