//! Replica: one copy of a volume on one disk of one node.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::resource;
use super::volume::is_zero;
use crate::size::ByteSize;

/// A replica's mode as the engine sees it: read-write, write-only while it is being
/// rebuilt, or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReplicaMode {
    RW,
    WO,
    ERR,
}

impl ReplicaMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaMode::RW => "RW",
            ReplicaMode::WO => "WO",
            ReplicaMode::ERR => "ERR",
        }
    }

    /// The mode in an engine's answer; `None` for a word no engine version uses.
    pub fn parse(s: &str) -> Option<ReplicaMode> {
        match s {
            "RW" => Some(ReplicaMode::RW),
            "WO" => Some(ReplicaMode::WO),
            "ERR" => Some(ReplicaMode::ERR),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSpec {
    pub volume: String,
    pub node: String,
    /// Disk name on the node (a key of the node's `spec.disks`).
    pub disk: String,
    /// The replica's directory.
    pub data_path: String,
    pub size: ByteSize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaState {
    #[default]
    Pending,
    Starting,
    Running,
    Stopped,
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    pub state: ReplicaState,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    /// `IP:PORT` of the replica's gRPC server while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ReplicaMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

resource!(
    /// One copy of a volume on one disk of one node.
    Replica,
    ReplicaSpec,
    ReplicaStatus
);
