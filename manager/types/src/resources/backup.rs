//! Backup, BackupTarget and RecurringJob: backups of snapshots to a target outside the
//! cluster, and the schedules that take snapshots and backups. Their controllers come with
//! the backup work (DESIGN §6); the types come now so that stores, CRDs and ops agree on them.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::volume::is_zero;
use super::{Condition, resource};
use crate::size::ByteSize;

// ------------------------------------------------------------- backup target

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupTargetSpec {
    /// `s3://bucket/prefix` or `file:///path`.
    pub url: String,
    /// The Secret (Kubernetes) or the file (one host) holding the target's credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<String>,
    /// How often the target's list of backups is read again, in seconds.
    #[serde(default = "default_poll_interval")]
    pub poll_interval: u64,
}

fn default_poll_interval() -> u64 {
    300
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

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    pub state: BackupState,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    /// Percent of the snapshot's data read, 0 to 100.
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
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

resource!(
    /// A backup of one snapshot of a volume.
    Backup,
    BackupSpec,
    BackupStatus
);

// ------------------------------------------------------------- recurring job

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RecurringTask {
    /// Take a snapshot; keep the newest `retain`.
    Snapshot,
    /// Take a snapshot and back it up; keep the newest `retain` backups.
    Backup,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecurringJobSpec {
    pub task: RecurringTask,
    /// When, as a five-field cron expression (`0 3 * * *`), in UTC.
    pub cron: String,
    /// How many of its snapshots or backups to keep per volume.
    pub retain: u32,
    /// How many volumes it works on at once.
    #[serde(default = "one")]
    pub concurrency: u32,
    /// Volumes carrying one of these groups (label `zebu.io/recurring-job-group.<g>`) run it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

resource!(
    /// A schedule of snapshots or backups.
    RecurringJob,
    RecurringJobSpec,
    RecurringJobStatus
);
