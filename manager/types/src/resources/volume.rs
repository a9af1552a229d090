//! Volume: a replicated block volume, what a person or a PersistentVolumeClaim asks for.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Condition, RebuildProgress, ReplicaMode, resource};
use crate::size::ByteSize;

/// How the attached volume is served to its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Frontend {
    /// An iSCSI target (one LUN) on the attached node.
    #[default]
    Iscsi,
    /// An NBD server on the attached node.
    Nbd,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Frontend::Iscsi => "iscsi",
            Frontend::Nbd => "nbd",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DataLocality {
    #[default]
    Disabled,
    /// Try to keep one replica on the node the volume is attached to.
    BestEffort,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSpec {
    /// Size in bytes (a whole number of 4 KiB blocks); it can grow (expand), never shrink.
    pub size: ByteSize,
    /// How many replicas (copies on different nodes) every write goes to.
    pub number_of_replicas: u32,
    /// How the attached volume is served.
    #[serde(default)]
    pub frontend: Frontend,
    /// Node tags a replica's node must all carry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_selector: Vec<String>,
    /// Disk tags a replica's disk must all carry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_selector: Vec<String>,
    #[serde(default)]
    pub data_locality: DataLocality,
    /// Seconds a failed replica is kept for reuse before it is replaced.
    #[serde(default = "default_stale_replica_timeout")]
    pub stale_replica_timeout: u64,
    /// The node the volume should be attached to; `None` means detached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// Attach without a frontend (maintenance): the engine runs and talks to the replicas,
    /// but serves no client. Snapshot revert needs it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disable_frontend: bool,
}

fn default_stale_replica_timeout() -> u64 {
    2880
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum VolumeState {
    #[default]
    Creating,
    Detached,
    Attaching,
    Attached,
    Detaching,
    Deleting,
}

impl VolumeState {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Creating => "creating",
            VolumeState::Detached => "detached",
            VolumeState::Attaching => "attaching",
            VolumeState::Attached => "attached",
            VolumeState::Detaching => "detaching",
            VolumeState::Deleting => "deleting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Robustness {
    Healthy,
    Degraded,
    Faulted,
    #[default]
    Unknown,
}

impl Robustness {
    pub fn as_str(self) -> &'static str {
        match self {
            Robustness::Healthy => "healthy",
            Robustness::Degraded => "degraded",
            Robustness::Faulted => "faulted",
            Robustness::Unknown => "unknown",
        }
    }
}

/// One line of a volume's replica summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicaSummary {
    pub name: String,
    pub node: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ReplicaMode>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatus {
    pub state: VolumeState,
    pub robustness: Robustness,
    /// The `metadata.generation` this status was computed for.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<VolumeReplicaSummary>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The rebuild the engine is running now, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildProgress>,
    /// For a volume created from a backup or a standby volume: what its replicas hold
    /// (written by the restore controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<Box<super::VolumeRestoreStatus>>,
    /// In a cluster: the node whose manager reconciles this volume now (one at a time; the
    /// volume controller's ownership rules). Unset on one host, where one manager does all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_id: Option<String>,
    /// The last scrub of the volume that finished (ran to its end, was stopped or failed),
    /// copied from its engine's report by the manager (see [`super::ScrubReport`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scrub: Option<Box<super::ScrubReport>>,
}

pub(crate) fn is_zero(n: &i64) -> bool {
    *n == 0
}

resource!(
    /// A replicated block volume.
    Volume,
    VolumeSpec,
    VolumeStatus
);
