//! Backup, BackupTarget and RecurringJob: backups of snapshots to a target outside the
//! cluster, and the schedules that take snapshots and backups (DESIGN §6). A volume being
//! restored from a backup, or following a source's backups as a standby, carries a
//! [`VolumeRestoreStatus`] in its status.
//!
//! A backup's state machine (one writer: the backup controller, which checks every change
//! with [`BackupState::can_become`] and logs it):
//!
//! ```text
//!   Pending ──node chosen──▶ InProgress ──manifest committed──▶ Completed
//!      │                      │    ▲                              │
//!      │                      │    └─ runner died: retry ─┐       │
//!      │                      ▼                           │       │
//!      └────────────────────▶ Error ◀── attempts spent ───┘       │
//!   any state ──deletionTimestamp──▶ Deleting ──manifest gone──▶ (object removed)
//! ```
//!
//! A backup is `Completed` exactly when its manifest exists in the target (the store's
//! commit point); a backup found in the target without an object (a new cluster pointed at
//! an old bucket) is created `Completed` by the target's poll.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::volume::is_zero;
use super::{Condition, resource};
use crate::size::ByteSize;

// ------------------------------------------------------------- backup target

/// The one target `zebu backup target set` configures.
pub const DEFAULT_BACKUP_TARGET: &str = "default";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetSpec {
    /// `s3://BUCKET@REGION/PREFIX` or `file:///PATH`.
    pub url: String,
    /// Where the target's credentials are: a Kubernetes Secret's name in a cluster; on one
    /// host, a file of `AWS_ACCESS_KEY_ID=...` lines. Without it, the standard AWS variables
    /// of the manager's process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<String>,
    /// How often the target's list of backups is read again, in seconds.
    #[serde(default = "default_poll_interval")]
    pub poll_interval: u64,
    /// How often GC runs over the target, in seconds (0: only on demand).
    #[serde(default = "default_gc_interval")]
    pub gc_interval: u64,
    /// GC's safety margin in seconds: no pack younger than this is condemned, no
    /// condemnation younger than this is carried out.
    #[serde(default = "default_gc_margin")]
    pub gc_margin: u64,
    /// How long a backup's session marker protects its packs without a heartbeat, in
    /// seconds (a killed backup's packs wait this long before GC may take them).
    #[serde(default = "default_session_ttl")]
    pub session_ttl: u64,
}

fn default_poll_interval() -> u64 {
    300
}
fn default_gc_interval() -> u64 {
    3600
}
fn default_gc_margin() -> u64 {
    3600
}
fn default_session_ttl() -> u64 {
    600
}

impl BackupTargetSpec {
    /// A target at `url` with every other setting at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            credential_secret: None,
            poll_interval: default_poll_interval(),
            gc_interval: default_gc_interval(),
            gc_margin: default_gc_margin(),
            session_ttl: default_session_ttl(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetStatus {
    /// The target answered the last time it was read.
    #[serde(default)]
    pub available: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_synced_at: Option<String>,
    /// Backups in the target when it was last read.
    #[serde(default)]
    pub backups: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_gc_at: Option<String>,
    /// What the last GC did, in one line.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_gc: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

resource!(
    /// Where backups go.
    BackupTarget,
    BackupTargetSpec,
    BackupTargetStatus
);

// -------------------------------------------------------------------- backup

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupSpec {
    pub volume: String,
    /// The snapshot whose data is backed up.
    pub snapshot: String,
    /// The BackupTarget it goes to.
    pub backup_target: String,
    /// Stored with the backup, shown when listing the target.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum BackupState {
    #[default]
    Pending,
    InProgress,
    /// Its manifest is written: the backup exists.
    Completed,
    Error,
    Deleting,
}

impl BackupState {
    pub fn as_str(self) -> &'static str {
        match self {
            BackupState::Pending => "pending",
            BackupState::InProgress => "in-progress",
            BackupState::Completed => "completed",
            BackupState::Error => "error",
            BackupState::Deleting => "deleting",
        }
    }

    /// The transitions of the diagram in the module docs (a state may always stay).
    pub fn can_become(self, next: BackupState) -> bool {
        use BackupState::*;
        self == next
            || matches!(
                (self, next),
                (Pending, InProgress | Error | Completed)
                    | (InProgress, InProgress | Completed | Error)
                    | (_, Deleting)
            )
    }
}

impl fmt::Display for BackupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    pub state: BackupState,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    /// Percent of the planned chunks read, 0 to 100.
    #[serde(default)]
    pub progress: u8,
    /// Where the backup is in its target, once completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_created_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_created_at: Option<String>,
    /// The volume's size when the snapshot was taken.
    #[serde(default)]
    pub volume_size: ByteSize,
    /// Bytes uploaded (after deduplication and compression).
    #[serde(default)]
    pub uploaded: ByteSize,
    /// The backup's data: the volume's bytes at the snapshot, holes left out.
    #[serde(default)]
    pub size: ByteSize,
    /// Bytes read from the replica.
    #[serde(default)]
    pub read: ByteSize,
    /// Bytes planned to read and done so far (the progress bar's rate and ETA).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub bytes_total: u64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub bytes_done: u64,
    /// Objects the backup added to the target.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub objects: u64,
    /// Wall time of the upload, in milliseconds.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub duration_ms: u64,
    /// The deduplication family in the target (the source volume's, for a restored one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub family: String,
    /// The backup this one is incremental to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The node whose agent runs the upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Upload attempts so far, each recorded here before its process is started (a killed
    /// one is retried).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub attempts: u32,
    /// The id of the latest attempt (its job and its session in the target carry it),
    /// recorded before its process starts.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// When the next attempt may start (RFC 3339), while a failed one waits out its backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at: Option<String>,
    /// The last attempt's error.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

pub(crate) fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}
pub(crate) fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

resource!(
    /// A backup of one snapshot of a volume.
    Backup,
    BackupSpec,
    BackupStatus
);

// --------------------------------------------------------- restore of a volume

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum RestoreState {
    /// Waiting for the volume's replicas, or for the next backup to follow.
    #[default]
    Pending,
    InProgress,
    /// The wanted backup is in every replica (a standby keeps following).
    Completed,
    /// Failed for good (a corrupt backup, a backup too large): the volume is unusable.
    Error,
}

impl RestoreState {
    pub fn as_str(self) -> &'static str {
        match self {
            RestoreState::Pending => "pending",
            RestoreState::InProgress => "in-progress",
            RestoreState::Completed => "completed",
            RestoreState::Error => "error",
        }
    }
}

/// A volume created from a backup, or a standby volume: what its replicas hold.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestoreStatus {
    pub state: RestoreState,
    /// The backup being restored (or last restored).
    pub backup: String,
    /// The last backup the replicas hold whole, and its layer (a standby's next increment
    /// goes on top of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_layer: Option<String>,
    /// When the replicas came to hold `restored` whole (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_at: Option<String>,
    /// A standby volume's activation: when it left standby mode (it can be attached since).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activated_at: Option<String>,
    /// Backups restored so far (a standby's increments count).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub restores: u32,
    /// Following a source volume's backups until activated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby: bool,
    #[serde(default)]
    pub progress: u8,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub bytes_total: u64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub bytes_done: u64,
    /// Bytes downloaded by the current or last restore.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub downloaded: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub attempts: u32,
    /// When the next attempt may start (RFC 3339), while a failed one waits out its backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

// ------------------------------------------------------------- recurring job

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RecurringTask {
    /// Take a snapshot; keep the newest `retain`.
    Snapshot,
    /// Take a snapshot and back it up; keep the newest `retain` backups.
    Backup,
}

impl RecurringTask {
    pub fn as_str(self) -> &'static str {
        match self {
            RecurringTask::Snapshot => "snapshot",
            RecurringTask::Backup => "backup",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecurringJobSpec {
    pub task: RecurringTask,
    /// When: a five-field cron expression (`0 3 * * *`, UTC), a six-field one whose first
    /// field is seconds (`*/10 * * * * *`), `@hourly` / `@daily`, or `@every 30s` (also
    /// `5m`, `2h`: a fixed interval from the job's creation).
    pub cron: String,
    /// How many of its snapshots or backups to keep per volume.
    pub retain: u32,
    /// How many volumes it works on at once.
    #[serde(default = "one")]
    pub concurrency: u32,
    /// Volumes carrying one of these groups (label `zebu.io/recurring-job-group.<g>`) run it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    /// These volumes run it too, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
    /// Volumes whose labels match this selector (`tier=gold`) run it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Labels given to the snapshots and backups it takes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecurringJobStatus {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_run_at: Option<String>,
    /// The run under way: the backups or snapshots it started are not all done yet (a
    /// job's next run waits for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<String>,
    /// Runs skipped because the previous one was still under way.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub skipped: u64,
    /// Runs started so far.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub runs: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_error: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

resource!(
    /// A schedule of snapshots or backups.
    RecurringJob,
    RecurringJobSpec,
    RecurringJobStatus
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completed_backup_never_goes_back_to_work() {
        use BackupState::*;
        assert!(Pending.can_become(InProgress));
        assert!(InProgress.can_become(Completed));
        assert!(Completed.can_become(Deleting));
        assert!(Error.can_become(Deleting));
        assert!(!Completed.can_become(InProgress));
        assert!(!Completed.can_become(Error));
        assert!(!Error.can_become(InProgress));
        assert!(!Deleting.can_become(Completed));
    }
}
