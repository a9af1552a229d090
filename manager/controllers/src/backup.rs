//! The backup controller: carries out Backup objects, restores of volumes created from a
//! backup, deletions of backups from the target, the target's poll and GC (DESIGN §6).
//!
//! It runs once per cluster (on one host, in `zebu up`), apart from the volume controllers'
//! pass, because its work is slow (uploads) and must not hold up theirs. Each pass reads the
//! store and decides from it and from the job files alone, so a manager killed at any point
//! carries on after a restart:
//!
//! - **Where the upload runs**: in a `zebu-backup-run` process per attempt
//!   ([`crate::backup_jobs`]), which reads the snapshot from the replicas directly (it needs
//!   neither the engine nor the manager) and commits the backup with its manifest, last.
//!   A process killed mid-backup leaves no manifest, so no backup is listed; its state is a
//!   report that says `running` with no process behind it, and the next pass starts a new
//!   attempt (up to [`MAX_ATTEMPTS`]), which deduplicates against what the killed one
//!   uploaded; GC removes the rest once the killed session's marker expires.
//! - **Incremental**: an attempt names as parent the volume's newest completed backup of
//!   the same family; the process reads only the layers above the parent's snapshot if that
//!   snapshot is still in the chain, and the whole snapshot otherwise (dedup still uploads
//!   only new chunks).
//! - **Restore**: once every replica of a volume created from a backup runs (and it has no
//!   engine), an attempt writes the backup into all of them as one snapshot layer; the volume
//!   can be attached when its `status.restore.state` is `completed`.
//! - **Delete**: kills an attempt still running, deletes the manifest from the target, then
//!   drops the finalizer. The data only that backup referenced goes at the next GC.
//! - **Poll**: every `pollInterval` the target's manifests are listed; a backup found there
//!   without an object (a new cluster pointed at an old bucket) gets a `completed` object;
//!   the target's `Available` condition says whether it answers.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use zebu_backup::job::TargetRef;
use zebu_backup::job::{BackupJob, JobKind, JobReport, JobSpec, ParentRef, RestoreJob};
use zebu_backupstore::Manifest;
use zebu_ops::backup::{job_target_ref, open_target_of};
use zebu_types::names::{BACKUP_FAMILY_ANNOTATION, BACKUP_FINALIZER, FROM_BACKUP_ANNOTATION};
use zebu_types::resources::{
    Backup, BackupSpec, BackupState, BackupStatus, BackupTarget, ConditionStatus, Engine, Replica,
    ReplicaMode, ReplicaState, RestoreState, Volume, VolumeRestoreStatus, set_condition,
};
use zebu_types::size::ByteSize;
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Kind, Store};

use crate::Membership;
use crate::backup_jobs::{Attempt, Jobs, wait_for_work};
use crate::changes::{Changes, Wake};

/// Attempts of one backup or restore before it is `error`.
pub const MAX_ATTEMPTS: u32 = 5;
/// The wait after a backup's first failed attempt; it doubles with each further one.
pub const RETRY_BASE: Duration = Duration::from_secs(2);
/// The longest wait between two attempts.
pub const RETRY_CAP: Duration = Duration::from_secs(60);

/// How long to wait after `attempts` failed attempts: [`RETRY_BASE`] doubled per attempt
/// after the first, at most [`RETRY_CAP`].
pub fn retry_backoff(attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(16);
    RETRY_BASE.saturating_mul(1 << doublings).min(RETRY_CAP)
}
const PERIOD: Duration = Duration::from_secs(1);
/// What wakes the controller before its period ends (besides one of its jobs exiting): a
/// backup or a volume to restore created or deleted, a target set, a replica that came up (a
/// restore waits for them). Backups and volumes wake it by their specs only: it writes their
/// status (progress) itself on every pass.
const WATCHED: [(Kind, Wake); 4] = [
    (Kind::Backup, Wake::Spec),
    (Kind::Volume, Wake::Spec),
    (Kind::BackupTarget, Wake::Spec),
    (Kind::Replica, Wake::Any),
];

/// What the controller needs from its host.
#[derive(Debug, Clone)]
pub struct BackupConfig {
    /// Job files, reports and logs; the family index cache under `cache/`.
    pub work_dir: PathBuf,
    /// The CA of the replicas' certificates when their ports speak TLS (`zebu_agent::tls`);
    /// every job connects to replicas over TLS then. `None`: plain TCP.
    pub replica_tls_ca: Option<PathBuf>,
}

impl BackupConfig {
    /// Where the job files are, which name the job processes on their command lines
    /// ([`crate::backup_jobs::kill_all_in`] finds them by it).
    pub fn jobs_dir(&self) -> PathBuf {
        self.work_dir.join("jobs")
    }

    /// Where a job's credentials go when they come from a Secret (a cluster).
    pub fn credentials_dir(&self) -> PathBuf {
        self.work_dir.join("credentials")
    }
}

/// The backup controller and what it remembers between passes.
pub struct BackupController {
    store: Arc<dyn Store>,
    cfg: BackupConfig,
    jobs: Jobs,
    last_poll: Option<Instant>,
    last_gc: Option<Instant>,
}

fn backup_job(name: &str) -> String {
    format!("backup-{name}")
}
fn restore_job(volume: &str) -> String {
    format!("restore-{volume}")
}

fn family_of_backup(b: &Backup) -> String {
    b.metadata
        .annotations
        .get(BACKUP_FAMILY_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| b.spec.volume.clone())
}

/// The addresses of a volume's running replicas, those the engine has as RW first.
fn replica_addrs(volume: &str, replicas: &[Replica], engines: &[Engine]) -> Vec<String> {
    let modes: BTreeMap<String, ReplicaMode> = engines
        .iter()
        .filter(|e| e.spec.volume == volume)
        .flat_map(|e| e.status.replica_modes.clone())
        .collect();
    let mut mine: Vec<(bool, String)> = replicas
        .iter()
        .filter(|r| {
            r.spec.volume == volume
                && !r.metadata.is_deleting()
                && r.status.state == ReplicaState::Running
        })
        .filter_map(|r| {
            let rw = modes.get(&r.metadata.name) == Some(&ReplicaMode::RW);
            r.status.address.clone().map(|a| (!rw, a))
        })
        .collect();
    mine.sort();
    mine.into_iter().map(|(_, a)| a).collect()
}

fn fill_status(s: &mut BackupStatus, r: &JobReport) {
    s.progress = r.percent();
    s.bytes_total = r.bytes_total;
    s.bytes_done = r.bytes_done;
    s.read = ByteSize(r.bytes_read);
    s.uploaded = ByteSize(r.bytes_transferred);
    s.objects = r.objects;
    s.duration_ms = Duration::try_from_secs_f64(r.elapsed_secs)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or_default();
    if let Some(b) = r.backup_bytes {
        s.size = ByteSize(b);
    }
    if let Some(v) = r.volume_size {
        s.volume_size = ByteSize(v);
    }
    if r.parent.is_some() {
        s.parent = r.parent.clone();
    }
}

impl BackupController {
    pub fn new(store: Arc<dyn Store>, cfg: BackupConfig) -> Self {
        let jobs = Jobs::new(cfg.jobs_dir());
        BackupController {
            store,
            cfg,
            jobs,
            last_poll: None,
            last_gc: None,
        }
    }

    /// One pass over the target, every backup and every volume being restored.
    pub async fn pass(&mut self) -> Result<(), StoreError> {
        let target = self
            .store
            .get_as::<BackupTarget>(zebu_types::resources::DEFAULT_BACKUP_TARGET)
            .await?;
        let backups = self.store.list_as::<Backup>().await?;
        let replicas = self.store.list_as::<Replica>().await?;
        let engines = self.store.list_as::<Engine>().await?;
        for b in &backups {
            if let Err(e) = self
                .backup(b, target.as_ref(), &backups, &replicas, &engines)
                .await
            {
                tracing::warn!(backup = %b.metadata.name, "backup controller: {e}");
            }
        }
        for v in self.store.list_as::<Volume>().await? {
            if v.metadata.annotations.contains_key(FROM_BACKUP_ANNOTATION)
                && let Err(e) = self
                    .restore(&v, target.as_ref(), &backups, &replicas, &engines)
                    .await
            {
                tracing::warn!(volume = %v.metadata.name, "restore controller: {e}");
            }
        }
        if let Some(t) = target {
            let due = self
                .last_poll
                .is_none_or(|at| at.elapsed() >= Duration::from_secs(t.spec.poll_interval));
            if due {
                self.last_poll = Some(Instant::now());
                self.poll(t).await?;
            }
        }
        Ok(())
    }

    /// The target reference of a job (its credentials resolved; see [`job_target_ref`]).
    async fn job_target(&self, t: &BackupTarget) -> Result<TargetRef, String> {
        job_target_ref(self.store.as_ref(), &t.spec, &self.cfg.credentials_dir()).await
    }

    fn spec(&self, t: &BackupTarget, target: TargetRef, job: JobKind) -> JobSpec {
        JobSpec {
            target,
            cache_dir: Some(self.cfg.work_dir.join("cache")),
            run_id: String::new(),
            session_ttl_secs: Some(t.spec.session_ttl),
            secret_file: None,
            tls_ca: self.cfg.replica_tls_ca.clone(),
            job,
        }
    }

    async fn write_status(&self, b: &Backup, status: BackupStatus) -> Result<(), StoreError> {
        if b.status == status {
            return Ok(());
        }
        if !b.status.state.can_become(status.state) {
            tracing::error!(backup = %b.metadata.name, "refused transition {} -> {}", b.status.state, status.state);
            return Ok(());
        }
        if b.status.state != status.state {
            tracing::info!(backup = %b.metadata.name, "backup {} -> {}{}", b.status.state, status.state,
                if status.error.is_empty() { String::new() } else { format!(": {}", status.error) });
        }
        let mut next = b.clone();
        next.status = status;
        match self.store.update_status_as(&next).await {
            Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn backup(
        &mut self,
        b: &Backup,
        target: Option<&BackupTarget>,
        all: &[Backup],
        replicas: &[Replica],
        engines: &[Engine],
    ) -> Result<(), StoreError> {
        let name = b.metadata.name.clone();
        let job = backup_job(&name);
        if b.metadata.is_deleting() {
            return self.delete(b, target).await;
        }
        if matches!(b.status.state, BackupState::Completed | BackupState::Error) {
            return Ok(());
        }
        let mut status = b.status.clone();
        let Some(t) = target else {
            status.error = "no backup target is set".into();
            return self.write_status(b, status).await;
        };
        let seen = self.jobs.attempt(&job);
        match seen {
            Attempt::Running(r) => {
                fill_status(&mut status, &r);
                status.state = BackupState::InProgress;
                status.next_retry_at = None;
                // A process found running that no record counts (a manager older than
                // the write-ahead record started it) is an attempt all the same.
                status.attempts = status.attempts.max(1);
                return self.write_status(b, status).await;
            }
            Attempt::Done(r) => {
                fill_status(&mut status, &r);
                status.state = BackupState::Completed;
                status.progress = 100;
                status.error.clear();
                status.next_retry_at = None;
                status.attempts = status.attempts.max(1);
                status.url = Some(format!("{}#{}/{}", t.spec.url, family_of_backup(b), name));
                self.write_status(b, status).await?;
                self.jobs.forget(&job);
                return Ok(());
            }
            Attempt::Failed(r) if r.permanent => {
                status.state = BackupState::Error;
                status.error = r.error;
                status.next_retry_at = None;
                status.attempts = status.attempts.max(1);
                self.write_status(b, status).await?;
                self.jobs.forget(&job);
                return Ok(());
            }
            // The report of an earlier run while a later one is recorded: the later one's
            // process never started (the manager stopped between record and start).
            Attempt::Failed(r) | Attempt::Killed(r)
                if !r.run_id.is_empty()
                    && !status.run_id.is_empty()
                    && r.run_id != status.run_id =>
            {
                status.error = format!(
                    "attempt {} (run {}) never started",
                    status.attempts, status.run_id
                );
            }
            Attempt::Failed(r) => {
                status.attempts = status.attempts.max(1);
                status.error = r.error;
            }
            Attempt::Killed(r) => {
                status.attempts = status.attempts.max(1);
                status.error = format!(
                    "attempt {} (run {}) was killed before it finished",
                    status.attempts,
                    if r.run_id.is_empty() {
                        "?"
                    } else {
                        r.run_id.as_str()
                    }
                );
            }
            // Recorded, but no process and no report: the manager stopped between the
            // record and the start (or the job's files were lost with its node).
            Attempt::None if status.attempts > 0 && status.error.is_empty() => {
                status.error = format!(
                    "attempt {} (run {}) left no process and no report",
                    status.attempts, status.run_id
                );
            }
            Attempt::None => {}
        }
        if status.attempts >= MAX_ATTEMPTS {
            status.state = BackupState::Error;
            status.next_retry_at = None;
            status.error = format!(
                "gave up after {} attempts: {}",
                status.attempts, status.error
            );
            return self.write_status(b, status).await;
        }
        // A failed attempt waits out its backoff before the next one.
        if status.attempts > 0 {
            let now = std::time::SystemTime::now();
            let at = status
                .next_retry_at
                .as_deref()
                .and_then(zebu_types::time::parse_rfc3339);
            match at {
                None => {
                    let next = now + retry_backoff(status.attempts);
                    status.next_retry_at = Some(zebu_types::time::format_rfc3339(next));
                    tracing::info!(backup = %name, attempts = status.attempts, next = ?status.next_retry_at,
                        error = %status.error, "backup attempt failed; retrying after a backoff");
                    return self.write_status(b, status).await;
                }
                Some(at) if at > now => return self.write_status(b, status).await,
                Some(_) => {}
            }
        }
        let addrs = replica_addrs(&b.spec.volume, replicas, engines);
        if addrs.is_empty() {
            status.error = format!(
                "volume {:?} has no running replica to read from",
                b.spec.volume
            );
            if self.store.get_as::<Volume>(&b.spec.volume).await?.is_none() {
                status.state = BackupState::Error;
                status.error = format!("volume {:?} does not exist", b.spec.volume);
            }
            return self.write_status(b, status).await;
        }
        let family = family_of_backup(b);
        // The newest completed backup of the same volume and family.
        let parent = all
            .iter()
            .filter(|p| {
                p.metadata.name != name
                    && p.spec.volume == b.spec.volume
                    && family_of_backup(p) == family
                    && p.status.state == BackupState::Completed
                    && !p.metadata.is_deleting()
                    && p.metadata.creation_timestamp <= b.metadata.creation_timestamp
            })
            .max_by(|x, y| {
                (&x.metadata.creation_timestamp, &x.metadata.name)
                    .cmp(&(&y.metadata.creation_timestamp, &y.metadata.name))
            })
            .map(|p| ParentRef {
                backup: p.metadata.name.clone(),
                snapshot: p.spec.snapshot.clone(),
            });
        // Before the attempt is recorded: a volume whose secret cannot be had starts nothing.
        let secret_file = match job_secret_file(self.store.as_ref(), &b.spec.volume).await {
            Ok(f) => f,
            Err(e) => {
                status.error = e.to_string();
                return self.write_status(b, status).await;
            }
        };
        // Credentials first: a missing or unreadable Secret is said in the status and
        // costs no attempt.
        let target_ref = match self.job_target(t).await {
            Ok(r) => r,
            Err(e) => {
                status.error = e;
                return self.write_status(b, status).await;
            }
        };
        // The write-ahead record: the attempt and its run id are in the Backup's status
        // before its process exists, so a manager killed at any point after this leaves a
        // record that `backup rm` acts on (it deletes from the target) and the next pass
        // counts. Only a record that was written lets the process start.
        let run_id = format!(
            "{name}-{}-{:08x}",
            status.attempts + 1,
            rand::random::<u32>()
        );
        status.attempts += 1;
        status.run_id = run_id.clone();
        status.state = BackupState::InProgress;
        status.next_retry_at = None;
        status.family = family.clone();
        let Some(recorded) = self.record_attempt(b, status).await? else {
            return Ok(());
        };
        let mut spec = self.spec(
            t,
            target_ref,
            JobKind::Backup(BackupJob {
                family,
                backup: name.clone(),
                volume: b.spec.volume.clone(),
                snapshot: b.spec.snapshot.clone(),
                replicas: addrs,
                parent,
                labels: b.spec.labels.clone(),
            }),
        );
        spec.run_id = run_id.clone();
        spec.secret_file = secret_file;
        if let Err(e) = self.jobs.start(&job, &spec) {
            let mut status = recorded.status.clone();
            status.error = format!("cannot start run {run_id}: {e}");
            return self.write_status(&recorded, status).await;
        }
        tracing::info!(backup = %name, run = %run_id, attempt = recorded.status.attempts, "backup attempt started");
        Ok(())
    }

    /// Writes a new attempt into the Backup's status, strictly: `None` if the object
    /// changed or went meanwhile (the next pass decides again), so no process starts
    /// without its record.
    async fn record_attempt(
        &self,
        b: &Backup,
        status: BackupStatus,
    ) -> Result<Option<Backup>, StoreError> {
        if !b.status.state.can_become(status.state) {
            tracing::error!(backup = %b.metadata.name, "refused transition {} -> {}", b.status.state, status.state);
            return Ok(None);
        }
        if b.status.state != status.state {
            tracing::info!(backup = %b.metadata.name, "backup {} -> {}", b.status.state, status.state);
        }
        let mut next = b.clone();
        next.status = status;
        match self.store.update_status_as(&next).await {
            Ok(written) => Ok(Some(written)),
            Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn delete(
        &mut self,
        b: &Backup,
        target: Option<&BackupTarget>,
    ) -> Result<(), StoreError> {
        if !b.metadata.finalizers.iter().any(|f| f == BACKUP_FINALIZER) {
            return Ok(());
        }
        let name = b.metadata.name.clone();
        let job = backup_job(&name);
        // Never started: no attempt recorded (every attempt is recorded before its process
        // starts) and no process or report on this node (one started by a manager older
        // than the write-ahead record).
        let never_started = b.status.attempts == 0
            && b.status.state != BackupState::Completed
            && matches!(self.jobs.attempt(&job), Attempt::None);
        self.jobs.kill(&job);
        if !never_started {
            let Some(t) = target else {
                tracing::warn!(backup = %name, "cannot delete the backup: no backup target is set");
                return Ok(());
            };
            let removed = match open_target_of(self.store.as_ref(), &t.spec).await {
                Ok(store) => {
                    let f = zebu_backupstore::FamilyId::new(family_of_backup(b));
                    let n = zebu_backupstore::BackupName::new(&name);
                    match (f, n) {
                        (Ok(f), Ok(n)) => match store.delete_backup(&f, &n).await {
                            Ok(()) | Err(zebu_backupstore::BackupError::BackupNotFound { .. }) => {
                                Ok(())
                            }
                            Err(e) => Err(e.to_string()),
                        },
                        _ => Ok(()),
                    }
                }
                Err(e) => Err(e),
            };
            if let Err(e) = removed {
                tracing::warn!(backup = %name, "cannot delete the backup from the target yet: {e}");
                return Ok(());
            }
        }
        self.jobs.forget(&job);
        let mut next = b.clone();
        next.metadata.finalizers.retain(|f| f != BACKUP_FINALIZER);
        match self.store.update_as(&next).await {
            Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => {
                tracing::info!(backup = %name, "backup deleted from the target");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn write_restore(&self, v: &Volume, r: VolumeRestoreStatus) -> Result<(), StoreError> {
        write_restore_status(self.store.as_ref(), "restore", v, r).await
    }

    async fn restore(
        &mut self,
        v: &Volume,
        target: Option<&BackupTarget>,
        backups: &[Backup],
        replicas: &[Replica],
        engines: &[Engine],
    ) -> Result<(), StoreError> {
        let name = v.metadata.name.clone();
        let job = restore_job(&name);
        let backup = v
            .metadata
            .annotations
            .get(FROM_BACKUP_ANNOTATION)
            .cloned()
            .unwrap_or_default();
        let mut r = v
            .status
            .restore
            .as_deref()
            .cloned()
            .unwrap_or_else(|| VolumeRestoreStatus {
                backup: backup.clone(),
                ..Default::default()
            });
        if v.metadata.is_deleting() {
            self.jobs.kill(&job);
            self.jobs.forget(&job);
            return Ok(());
        }
        if matches!(r.state, RestoreState::Completed | RestoreState::Error) {
            return Ok(());
        }
        let Some(t) = target else {
            r.error = "no backup target is set".into();
            return self.write_restore(v, r).await;
        };
        let seen = self.jobs.attempt(&job);
        // As for backups: a process that ran is an attempt, recorded or not.
        if !matches!(seen, Attempt::None) {
            r.attempts = r.attempts.max(1);
        }
        match seen {
            Attempt::Running(rep) => {
                r.state = RestoreState::InProgress;
                // What the attempt's start cleared, in case that write was lost to a
                // conflict: a "waiting for ..." left from before the start is stale now.
                r.error.clear();
                r.next_retry_at = None;
                r.progress = rep.percent();
                r.bytes_total = rep.bytes_total;
                r.bytes_done = rep.bytes_done;
                r.downloaded = rep.bytes_transferred;
                return self.write_restore(v, r).await;
            }
            Attempt::Done(rep) => {
                r.state = RestoreState::Completed;
                r.progress = 100;
                r.bytes_total = rep.bytes_total;
                r.bytes_done = rep.bytes_total;
                r.downloaded = rep.bytes_transferred;
                r.restored = Some(backup.clone());
                r.restored_layer = Some(backup.clone());
                r.restores += 1;
                r.error.clear();
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
            Attempt::Failed(rep) => r.error = rep.error,
            Attempt::Killed(_) => r.error = format!("attempt {} was killed", r.attempts),
            Attempt::None => {}
        }
        if r.attempts >= MAX_ATTEMPTS {
            r.state = RestoreState::Error;
            r.error = format!("gave up after {} attempts: {}", r.attempts, r.error);
            return self.write_restore(v, r).await;
        }
        // A failed attempt waits out its backoff before the next one, as a backup's does
        // (a target that is down for a minute must not use up the attempts in seconds).
        if r.attempts > 0 {
            let now = std::time::SystemTime::now();
            let at = r
                .next_retry_at
                .as_deref()
                .and_then(zebu_types::time::parse_rfc3339);
            match at {
                None => {
                    let next = now + retry_backoff(r.attempts);
                    r.next_retry_at = Some(zebu_types::time::format_rfc3339(next));
                    tracing::info!(volume = %name, backup = %backup, attempts = r.attempts, next = ?r.next_retry_at,
                        error = %r.error, "restore attempt failed; retrying after a backoff");
                    return self.write_restore(v, r).await;
                }
                Some(at) if at > now => return self.write_restore(v, r).await,
                Some(_) => {}
            }
        }
        let Some(b) = backups.iter().find(|b| b.metadata.name == backup) else {
            r.state = RestoreState::Error;
            r.error = format!("backup {backup:?} does not exist");
            return self.write_restore(v, r).await;
        };
        if engines.iter().any(|e| e.spec.volume == name) {
            r.error = "waiting for the volume's engine to stop".into();
            return self.write_restore(v, r).await;
        }
        let addrs = replica_addrs(&name, replicas, &[]);
        if addrs.len() < v.spec.number_of_replicas as usize {
            r.error = format!(
                "waiting for the volume's replicas ({} of {} running)",
                addrs.len(),
                v.spec.number_of_replicas
            );
            return self.write_restore(v, r).await;
        }
        let secret_file = match job_secret_file(self.store.as_ref(), &name).await {
            Ok(f) => f,
            Err(e) => {
                r.error = e.to_string();
                return self.write_restore(v, r).await;
            }
        };
        let target_ref = match self.job_target(t).await {
            Ok(r) => r,
            Err(e) => {
                r.error = e;
                return self.write_restore(v, r).await;
            }
        };
        let mut spec = self.spec(
            t,
            target_ref,
            JobKind::Restore(RestoreJob {
                family: family_of_backup(b),
                backup: backup.clone(),
                base: None,
                volume: name.clone(),
                replicas: addrs,
                layer: backup.clone(),
                base_layer: String::new(),
                volume_size: v.spec.size.bytes(),
            }),
        );
        spec.secret_file = secret_file;
        match self.jobs.start(&job, &spec) {
            Ok(_) => {
                r.attempts += 1;
                r.state = RestoreState::InProgress;
                r.error.clear();
                r.next_retry_at = None;
            }
            Err(e) => r.error = e.to_string(),
        }
        self.write_restore(v, r).await
    }

    /// Reads the target's backups: objects for those it lacks, the `Available` condition;
    /// and runs GC when it is due.
    async fn poll(&mut self, t: BackupTarget) -> Result<(), StoreError> {
        let mut status = t.status.clone();
        status.last_synced_at = Some(zebu_types::time::now_rfc3339());
        let listed = match open_target_of(self.store.as_ref(), &t.spec).await {
            Ok(store) => match store.list_backups(None).await {
                Ok(ms) => Ok((store, ms)),
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e),
        };
        match listed {
            Ok((store, manifests)) => {
                set_condition(
                    &mut status.conditions,
                    "Available",
                    ConditionStatus::True,
                    "Listed",
                    "",
                );
                status.backups = manifests.len() as u64;
                let known: HashMap<String, ()> = self
                    .store
                    .list_as::<Backup>()
                    .await?
                    .into_iter()
                    .map(|b| (b.metadata.name, ()))
                    .collect();
                for m in manifests
                    .iter()
                    .filter(|m| !known.contains_key(m.name.as_str()))
                {
                    self.adopt(&t, m).await?;
                }
                let gc_due = t.spec.gc_interval > 0
                    && self
                        .last_gc
                        .is_none_or(|at| at.elapsed() >= Duration::from_secs(t.spec.gc_interval));
                if gc_due {
                    self.last_gc = Some(Instant::now());
                    status.last_gc = run_gc(&store, &t).await;
                    status.last_gc_at = Some(zebu_types::time::now_rfc3339());
                }
            }
            Err(e) => {
                tracing::warn!(url = %t.spec.url, "backup target poll: {e}");
                set_condition(
                    &mut status.conditions,
                    "Available",
                    ConditionStatus::False,
                    "Unreachable",
                    &e,
                );
            }
        }
        if status != t.status {
            let mut next = t.clone();
            next.status = status;
            match self.store.update_status_as(&next).await {
                Ok(_) | Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A `completed` object for a backup found in the target.
    async fn adopt(&self, t: &BackupTarget, m: &Manifest) -> Result<(), StoreError> {
        let name = m.name.as_str().to_string();
        if zebu_types::validate_object_name(&name).is_err() {
            return Ok(());
        }
        let mut b = Backup::new(
            name.clone(),
            BackupSpec {
                volume: m.volume.clone(),
                snapshot: m.snapshot.clone(),
                backup_target: t.metadata.name.clone(),
                labels: m.labels.clone(),
            },
        );
        b.metadata.finalizers.push(BACKUP_FINALIZER.into());
        b.metadata.annotations.insert(
            BACKUP_FAMILY_ANNOTATION.into(),
            m.family.as_str().to_string(),
        );
        let created = match self.store.create_as(&b).await {
            Ok(c) => c,
            Err(StoreError::AlreadyExists { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut done = created.clone();
        done.status = BackupStatus {
            state: BackupState::Completed,
            progress: 100,
            size: ByteSize(m.stats.bytes),
            volume_size: ByteSize(m.volume_size),
            family: m.family.as_str().to_string(),
            parent: m.parent.as_ref().map(|p| p.as_str().to_string()),
            url: Some(format!("{}#{}/{}", t.spec.url, m.family.as_str(), name)),
            ..Default::default()
        };
        self.store.update_status_as(&done).await?;
        tracing::info!(backup = %name, family = %m.family.as_str(), "backup found in the target");
        Ok(())
    }
}

/// One GC pass over every family of the target, summed up in one line (see
/// [`zebu_ops::backup::gc_target`], which `zebu backup gc` runs too).
pub async fn run_gc(store: &zebu_backupstore::BackupStore, t: &BackupTarget) -> String {
    zebu_ops::backup::gc_target(store, &t.spec).await.summary
}

/// Runs the backup controller until `stop` turns true (the only manager: `zebu up`).
pub async fn run(store: Arc<dyn Store>, cfg: BackupConfig, stop: watch::Receiver<bool>) {
    run_gated(store, cfg, None, stop).await;
}

/// Runs the backup controller of one manager among several (Kubernetes): it works only
/// while this manager holds the cluster Lease ([`Membership::leads`]), so uploads are
/// started and GC runs from one manager at a time. A manager that takes over finds the
/// Backups' write-ahead records and retries what the last leader's processes left.
pub async fn run_member(
    store: Arc<dyn Store>,
    cfg: BackupConfig,
    membership: Arc<dyn Membership>,
    stop: watch::Receiver<bool>,
) {
    run_gated(store, cfg, Some(membership), stop).await;
}

async fn run_gated(
    store: Arc<dyn Store>,
    cfg: BackupConfig,
    membership: Option<Arc<dyn Membership>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = Changes::watch(store.clone(), &WATCHED);
    let mut c = BackupController::new(store, cfg);
    let mut leading = membership.is_none();
    loop {
        let leads = membership.as_ref().is_none_or(|m| m.leads());
        if leads != leading {
            tracing::info!(
                leads,
                "backup controller: cluster Lease {}",
                if leads { "held" } else { "not held" }
            );
            leading = leads;
        }
        if leads && let Err(e) = c.pass().await {
            tracing::warn!("backup controller: {e}");
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

/// Writes a volume's restore status if it changed, logging a change of state; a conflict or
/// a volume gone meanwhile is left to the next pass. Shared by restores and standbys.
pub(crate) async fn write_restore_status(
    store: &dyn Store,
    what: &str,
    v: &Volume,
    r: VolumeRestoreStatus,
) -> Result<(), StoreError> {
    if v.status.restore.as_deref() == Some(&r) {
        return Ok(());
    }
    let before = v.status.restore.as_ref().map(|x| x.state);
    if before != Some(r.state) {
        tracing::info!(volume = %v.metadata.name, backup = %r.backup, "{what} {:?} -> {}{}",
            before.map(RestoreState::as_str), r.state.as_str(),
            if r.error.is_empty() { String::new() } else { format!(": {}", r.error) });
    }
    let mut next = v.clone();
    next.status.restore = Some(Box::new(r));
    match store.update_status_as(&next).await {
        Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The secret file a job on `volume`'s replicas proves (issue 18), on this node; `None` for
/// a volume made before volume secrets. A volume that is gone has none either (its job fails
/// on its own terms).
pub(crate) async fn job_secret_file(
    store: &dyn Store,
    volume: &str,
) -> Result<Option<std::path::PathBuf>, StoreError> {
    let Some(v) = store.get_as::<Volume>(volume).await? else {
        return Ok(None);
    };
    let Some(id) = zebu_types::secrets::VolumeIdentity::of(&v.metadata) else {
        return Ok(None);
    };
    let keeper = store.secrets().ok_or_else(|| {
        StoreError::invalid(
            Some(zebu_types::Kind::Volume),
            format!(
                "volume {volume:?} names secret {} but this store keeps no secrets",
                id.secret_name
            ),
        )
    })?;
    keeper.local_file(&id.secret_name).await.map(Some)
}
