//! The bodies of backup operations (`/v1/backuptarget`, `/v1/backups`), checked by the ops
//! layer. Unknown fields are refused, as for every request.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::SizeInput;
use crate::resources::Frontend;

/// `PUT /v1/backuptarget`: where backups go.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetBackupTarget {
    /// `s3://BUCKET@REGION/PREFIX` or `file:///PATH`.
    pub url: String,
    /// A Secret's name (Kubernetes) or, on one host, a file of `AWS_*=value` lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<String>,
    /// Seconds between reads of the target's list of backups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_interval: Option<u64>,
    /// Seconds between GC runs over the target (0: only on demand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gc_interval: Option<u64>,
    /// GC's safety margin in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gc_margin: Option<u64>,
    /// How long a backup's session marker protects its packs without a heartbeat, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_ttl: Option<u64>,
}

/// What `POST /v1/backuptarget/gc` did: one line per family.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GcReportLine {
    /// When the run ended (RFC 3339).
    pub at: String,
    /// What it did, one `FAMILY: outcome` per family, `; `-separated.
    pub summary: String,
    /// Whether every family's GC answered (`Busy` counts: another GC was at it).
    pub ok: bool,
}

/// `POST /v1/backups`: back up a volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateBackup {
    pub volume: String,
    /// The snapshot to back up; `None` takes a new one (the volume must be attached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The backup's name; `None` names it after the volume and the moment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// `POST /v1/backups/{name}/restore`: a new volume holding the backup's data.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestoreBackup {
    /// The new volume's name.
    pub volume: String,
    /// Defaults to the backed-up volume's size; never smaller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeInput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Frontend>,
}

/// What `POST /v1/backups/{name}/verify` found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    pub backup: String,
    pub ok: bool,
    /// Chunks checked against their hashes.
    pub chunks: u64,
    pub bytes: u64,
    /// The first problem (names the object and the chunk).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}
