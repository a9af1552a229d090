//! The standby controller: keeps each standby (disaster-recovery) volume holding the newest
//! completed backup of its source, one increment at a time, and activates it when asked
//! (DESIGN §6; the operations are in `zebu-ops`' `standby` module).
//!
//! Per standby volume and pass, from the store and its job files alone (so a manager killed
//! at any point carries on after a restart):
//!
//! 1. A `zebu-backup-run` restore attempt of this volume is looked at first: running, its
//!    progress is recorded; done, the backup its job file names becomes `restored` (with
//!    `restoredAt` and its layer), and the job is forgotten; failed, it is retried up to
//!    [`MAX_ATTEMPTS`](crate::backup::MAX_ATTEMPTS) times per backup, or the restore is
//!    `error` for a permanent failure.
//! 2. Otherwise, if the source has a completed backup newer than `restored` (of the same
//!    family), an attempt restores it: whole into the bottom layer for the first, else as
//!    the difference from `restored` into a new layer on top of `restored`'s (the replicas
//!    write only the chunks that changed, and zeros where the new backup has a hole over
//!    old data). Like any restore it waits for every replica to run and no engine.
//! 3. Nothing newer: the restore is `completed`. If activation was asked for, `activatedAt`
//!    and `standby: false` are recorded, then the standby and activation annotations are
//!    removed (in that order: a crash in between finds the status written and only removes
//!    the annotations), and the volume is a normal one.
//!
//! The order "newer" is the Backup objects' creation (then name), which is the order the
//! source's backups were taken in this cluster and the order the target's poll found them
//! in another. An increment needs its base's manifest in the target: a standby whose
//! `restored` backup was deleted from the target meanwhile cannot take the next increment
//! and reports it as an `error` naming the backup.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use zebu_backup::job::{JobKind, JobSpec, RestoreJob, read_json};
use zebu_ops::backup::job_target_ref;
use zebu_ops::standby::{family_of_backup, newest_backup_of, standby_source};
use zebu_types::names::{
    BACKUP_FAMILY_ANNOTATION, STANDBY_ACTIVATE_ANNOTATION, STANDBY_FROM_ANNOTATION,
};
use zebu_types::resources::{
    Backup, BackupTarget, DEFAULT_BACKUP_TARGET, Engine, Replica, ReplicaState, RestoreState,
    Volume, VolumeRestoreStatus,
};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Kind, Store};

use crate::backup::{BackupConfig, MAX_ATTEMPTS};
use crate::backup_jobs::{Attempt, Jobs, wait_for_work};
use crate::changes::{Changes, Wake};

const PERIOD: Duration = Duration::from_secs(1);

fn standby_job(volume: &str) -> String {
    format!("standby-{volume}")
}

/// The addresses of a volume's running replicas.
fn running_replicas(volume: &str, replicas: &[Replica]) -> Vec<String> {
    let mut addrs: Vec<String> = replicas
        .iter()
        .filter(|r| {
            r.spec.volume == volume
                && !r.metadata.is_deleting()
                && r.status.state == ReplicaState::Running
        })
        .filter_map(|r| r.status.address.clone())
        .collect();
    addrs.sort();
    addrs
}

/// The standby controller and its job processes.
pub struct StandbyController {
    store: Arc<dyn Store>,
    cfg: BackupConfig,
    jobs: Jobs,
}

impl StandbyController {
    pub fn new(store: Arc<dyn Store>, cfg: BackupConfig) -> Self {
        let jobs = Jobs::new(cfg.work_dir.join("jobs"));
        StandbyController { store, cfg, jobs }
    }

    /// One pass over every standby volume.
    pub async fn pass(&mut self) -> Result<(), StoreError> {
        let volumes = self.store.list_as::<Volume>().await?;
        if !volumes.iter().any(|v| standby_source(v).is_some()) {
            return Ok(());
        }
        let target = self
            .store
            .get_as::<BackupTarget>(DEFAULT_BACKUP_TARGET)
            .await?;
        let backups = self.store.list_as::<Backup>().await?;
        let replicas = self.store.list_as::<Replica>().await?;
        let engines = self.store.list_as::<Engine>().await?;
        for v in volumes.iter().filter(|v| standby_source(v).is_some()) {
            if let Err(e) = self
                .follow(v, target.as_ref(), &backups, &replicas, &engines)
                .await
            {
                tracing::warn!(volume = %v.metadata.name, "standby controller: {e}");
            }
        }
        Ok(())
    }

    async fn write_restore(&self, v: &Volume, r: VolumeRestoreStatus) -> Result<(), StoreError> {
        crate::backup::write_restore_status(self.store.as_ref(), "standby restore", v, r).await
    }

    async fn follow(
        &mut self,
        v: &Volume,
        target: Option<&BackupTarget>,
        backups: &[Backup],
        replicas: &[Replica],
        engines: &[Engine],
    ) -> Result<(), StoreError> {
        let name = v.metadata.name.clone();
        let source = standby_source(v).unwrap_or_default().to_string();
        let job = standby_job(&name);
        if v.metadata.is_deleting() {
            self.jobs.kill(&job);
            self.jobs.forget(&job);
            return Ok(());
        }
        let mut r = v
            .status
            .restore
            .as_deref()
            .cloned()
            .unwrap_or_else(|| VolumeRestoreStatus {
                standby: true,
                ..Default::default()
            });
        r.standby = true;
        let seen = self.jobs.attempt(&job);
        if !matches!(seen, Attempt::None) {
            r.attempts = r.attempts.max(1);
        }
        // The backup the attempt on disk restores (its job file), whatever the status says:
        // a manager killed between starting it and recording it must not misname it.
        let in_job = read_json::<JobSpec>(&self.jobs.job_file(&job)).and_then(|s| match s.job {
            JobKind::Restore(j) => Some(j.backup),
            JobKind::Backup(_) => None,
        });
        match seen {
            Attempt::Running(rep) => {
                r.state = RestoreState::InProgress;
                // What the attempt's start cleared, in case that write was lost to a
                // conflict: a "waiting for ..." left from before the start is stale now.
                r.error.clear();
                if let Some(b) = in_job {
                    r.backup = b;
                }
                r.progress = rep.percent();
                r.bytes_total = rep.bytes_total;
                r.bytes_done = rep.bytes_done;
                r.downloaded = rep.bytes_transferred;
                return self.write_restore(v, r).await;
            }
            Attempt::Done(rep) => {
                let applied = in_job.unwrap_or_else(|| r.backup.clone());
                r.state = RestoreState::Completed;
                r.progress = 100;
                r.bytes_total = rep.bytes_total;
                r.bytes_done = rep.bytes_total;
                r.downloaded = rep.bytes_transferred;
                r.backup = applied.clone();
                r.restored = Some(applied.clone());
                r.restored_layer = Some(applied.clone());
                r.restored_at = Some(zebu_types::time::now_rfc3339());
                r.restores += 1;
                r.attempts = 0;
                r.error.clear();
                tracing::info!(volume = %name, source = %source, backup = %applied,
                    downloaded = rep.bytes_transferred, "standby holds the backup");
                self.write_restore(v, r).await?;
                self.jobs.forget(&job);
                return Ok(());
            }
            Attempt::Failed(rep) if rep.permanent => {
                r.state = RestoreState::Error;
                r.error = rep.error;
                self.write_restore(v, r).await?;
                self.jobs.forget(&job);
                return Ok(());
            }
            Attempt::Failed(rep) => {
                r.error = rep.error;
                self.jobs.forget(&job);
            }
            Attempt::Killed(_) => {
                r.error = format!("attempt {} was killed", r.attempts);
                self.jobs.forget(&job);
            }
            Attempt::None => {}
        }
        if r.state == RestoreState::Error {
            return Ok(());
        }
        let Some(t) = target else {
            r.error = "no backup target is set".into();
            return self.write_restore(v, r).await;
        };
        let family = v
            .metadata
            .annotations
            .get(BACKUP_FAMILY_ANNOTATION)
            .cloned();
        let newest = newest_backup_of(&source, family.as_deref(), backups);
        let Some(newest) = newest.filter(|b| r.restored.as_deref() != Some(&b.metadata.name))
        else {
            if r.restored.is_none() {
                r.state = RestoreState::Pending;
                r.error = format!("waiting for a completed backup of volume {source:?}");
                return self.write_restore(v, r).await;
            }
            // Up to date.
            r.state = RestoreState::Completed;
            r.error.clear();
            if v.metadata
                .annotations
                .contains_key(STANDBY_ACTIVATE_ANNOTATION)
            {
                return self.activate(v, r).await;
            }
            return self.write_restore(v, r).await;
        };
        // A restore of a backup other than the one the attempts were counted for starts
        // counting again.
        if r.backup != newest.metadata.name {
            r.attempts = 0;
            r.backup = newest.metadata.name.clone();
        }
        if r.attempts >= MAX_ATTEMPTS {
            r.state = RestoreState::Error;
            r.error = format!("gave up after {} attempts: {}", r.attempts, r.error);
            return self.write_restore(v, r).await;
        }
        if engines.iter().any(|e| e.spec.volume == name) {
            r.error = "waiting for the volume's engine to stop".into();
            return self.write_restore(v, r).await;
        }
        let addrs = running_replicas(&name, replicas);
        if addrs.len() < v.spec.number_of_replicas as usize {
            r.error = format!(
                "waiting for the volume's replicas ({} of {} running)",
                addrs.len(),
                v.spec.number_of_replicas
            );
            return self.write_restore(v, r).await;
        }
        let secret_file = match crate::backup::job_secret_file(self.store.as_ref(), &name).await {
            Ok(f) => f,
            Err(e) => {
                r.error = e.to_string();
                return self.write_restore(v, r).await;
            }
        };
        let target =
            match job_target_ref(self.store.as_ref(), &t.spec, &self.cfg.credentials_dir()).await {
                Ok(target) => target,
                Err(e) => {
                    r.error = e;
                    return self.write_restore(v, r).await;
                }
            };
        let spec = JobSpec {
            target,
            cache_dir: Some(self.cfg.work_dir.join("cache")),
            secret_file,
            tls_ca: self.cfg.replica_tls_ca.clone(),
            job: JobKind::Restore(RestoreJob {
                family: family_of_backup(newest),
                backup: newest.metadata.name.clone(),
                base: r.restored.clone(),
                volume: name.clone(),
                replicas: addrs,
                layer: newest.metadata.name.clone(),
                base_layer: r.restored_layer.clone().unwrap_or_default(),
                volume_size: v.spec.size.bytes(),
            }),
            run_id: String::new(),
            session_ttl_secs: Some(t.spec.session_ttl),
        };
        match self.jobs.start(&job, &spec) {
            Ok(_) => {
                tracing::info!(volume = %name, backup = %newest.metadata.name,
                    base = ?r.restored, "standby restore started");
                r.attempts += 1;
                r.state = RestoreState::InProgress;
                r.progress = 0;
                r.error.clear();
            }
            Err(e) => r.error = e.to_string(),
        }
        self.write_restore(v, r).await
    }

    /// Ends standby mode: the status first, then the annotations (see the module docs).
    async fn activate(&self, v: &Volume, mut r: VolumeRestoreStatus) -> Result<(), StoreError> {
        let name = &v.metadata.name;
        r.standby = false;
        if r.activated_at.is_none() {
            r.activated_at = Some(zebu_types::time::now_rfc3339());
        }
        self.write_restore(v, r.clone()).await?;
        let Some(mut next) = self.store.get_as::<Volume>(name).await? else {
            return Ok(());
        };
        if next
            .status
            .restore
            .as_ref()
            .and_then(|x| x.activated_at.as_ref())
            .is_none()
        {
            // The status write lost a race; the next pass does it again.
            return Ok(());
        }
        next.metadata.annotations.remove(STANDBY_FROM_ANNOTATION);
        next.metadata
            .annotations
            .remove(STANDBY_ACTIVATE_ANNOTATION);
        match self.store.update_as(&next).await {
            Ok(_) => {
                tracing::info!(volume = %name, backup = ?r.restored, "standby volume activated");
                Ok(())
            }
            Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Runs the standby controller until `stop` turns true.
pub async fn run(store: Arc<dyn Store>, cfg: BackupConfig, mut stop: watch::Receiver<bool>) {
    // A new backup of the source (made here, or found on the target by the backup
    // controller's poll), a standby created or activated, a replica that came up; by spec
    // for the volumes, whose status it writes itself.
    let watched = [
        (Kind::Backup, Wake::Spec),
        (Kind::Volume, Wake::Spec),
        (Kind::Replica, Wake::Any),
    ];
    let mut changes = Changes::watch(store.clone(), &watched);
    let mut c = StandbyController::new(store, cfg);
    loop {
        if let Err(e) = c.pass().await {
            tracing::warn!("standby controller: {e}");
        }
        tokio::select! {
            _ = wait_for_work(&mut c.jobs, &mut changes, PERIOD) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            break;
        }
    }
}
