//! Snapshot: a point-in-time, read-only state of a volume, kept in its replicas.
//!
//! The snapshot itself lives in the replicas' layer chains (the engine takes it on every
//! replica at once); this object is how a cluster names and tracks it, e.g. for a CSI
//! `VolumeSnapshot` or a backup. Its controller comes with the CSI work; the type comes now
//! so that stores, CRDs and ops agree on it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::resource;
use super::volume::is_zero;
use crate::size::ByteSize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSpec {
    /// The volume it is a snapshot of.
    pub volume: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    /// Taken on every replica of the volume.
    #[serde(default)]
    pub ready_to_use: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    /// When the engine took it (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    /// The snapshot it was taken on top of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Asked for by a person (not one the engine took for a rebuild).
    #[serde(default)]
    pub user_created: bool,
    /// Bytes of data the snapshot's layer holds.
    #[serde(default)]
    pub size: ByteSize,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

resource!(
    /// A snapshot of a volume.
    Snapshot,
    SnapshotSpec,
    SnapshotStatus
);
