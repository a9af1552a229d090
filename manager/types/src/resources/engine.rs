//! Engine: the one engine process of an attached volume.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::volume::is_zero;
use super::{Frontend, ReplicaMode, resource};
use crate::size::ByteSize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    pub volume: String,
    pub node: String,
    pub size: ByteSize,
    /// Replica name -> `IP:PORT`.
    #[serde(default)]
    pub replica_addresses: BTreeMap<String, String>,
    #[serde(default)]
    pub frontend: Frontend,
    /// Serve no frontend (the volume is attached for maintenance).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disable_frontend: bool,
    /// Start with `--salvage`: every replica failed, so take the best one even though it
    /// cannot be shown current (the manager's auto-salvage).
    #[serde(default)]
    pub salvage: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EngineState {
    #[default]
    Pending,
    Starting,
    Running,
    Stopped,
    Error,
}

/// The engine's own verdict on its volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EngineVolumeState {
    /// Every replica RW.
    Healthy,
    /// Some RW, some not.
    Degraded,
    /// No RW replica: I/O fails.
    Faulted,
}

impl EngineVolumeState {
    /// The word in an engine's `Info`; `None` for one no engine version uses.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "healthy" => Some(EngineVolumeState::Healthy),
            "degraded" => Some(EngineVolumeState::Degraded),
            "faulted" => Some(EngineVolumeState::Faulted),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineStatus {
    pub state: EngineState,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Where the frontend listens (`nbd://…`, an iSCSI portal and IQN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_address: Option<String>,
    /// The volume size the running engine serves, as its `Info` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<ByteSize>,
    /// Replica name -> mode, as the engine reports it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub replica_modes: BTreeMap<String, ReplicaMode>,
    /// Replica name -> pid of the replica process when this engine process was first seen
    /// taking it as RW. A replica whose pid differs has been restarted since, and the engine
    /// has not noticed yet (it does at its next I/O): its RW is stale, so the volume is not
    /// Healthy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub replica_pids: BTreeMap<String, u32>,
    /// Replica address -> mode, for addresses the engine has that no Replica object names
    /// (left over from a replaced replica).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unknown_replicas: BTreeMap<String, ReplicaMode>,
    /// The engine's own verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_state: Option<EngineVolumeState>,
    /// The generation the running engine process presented to its replicas (its `Info`):
    /// every engine start raises it and a replica refuses lower ones, so an older engine,
    /// or one a stale owner started, is fenced off the data. The same value across
    /// observations means the same engine process served throughout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_generation: Option<u64>,
    /// Why it is in `Error` (the engine's last words), or a rebuild's state.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The engine's current or last rebuild (its `RebuildStatus`); `None` while it has never
    /// rebuilt anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildProgress>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RebuildState {
    Running,
    Done,
    Failed,
}

impl RebuildState {
    /// The word in an engine's `RebuildStatus` (`idle` is no rebuild, so `None`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "running" => Some(RebuildState::Running),
            "done" => Some(RebuildState::Done),
            "failed" => Some(RebuildState::Failed),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RebuildKind {
    /// Every data extent copied.
    Full,
    /// Only the regions written while the replica was away.
    CatchUp,
}

impl RebuildKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(RebuildKind::Full),
            "catch-up" => Some(RebuildKind::CatchUp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RebuildKind::Full => "full",
            RebuildKind::CatchUp => "catch-up",
        }
    }
}

/// Progress of one rebuild, as the engine's `RebuildStatus` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RebuildProgress {
    /// The Replica being rebuilt (its address if no Replica owns it).
    pub replica: String,
    pub state: RebuildState,
    pub kind: RebuildKind,
    pub bytes_done: u64,
    pub bytes_total: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

resource!(
    /// The one engine process of an attached volume.
    Engine,
    EngineSpec,
    EngineStatus
);
