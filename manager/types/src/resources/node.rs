//! Node: a host (or, on one host, a simulated host with its own loopback address).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::volume::is_zero;
use super::{Condition, condition, condition_is_true, resource};
use crate::names::ZONE_LABEL;
use crate::size::ByteSize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskSpec {
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(default = "yes")]
    pub allow_scheduling: bool,
    /// Bytes kept free for everything else on the filesystem.
    #[serde(default)]
    pub storage_reserved: ByteSize,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// The address replicas and engines on this node listen on (127.0.0.x when several nodes
    /// share one host).
    pub address: String,
    #[serde(default)]
    pub disks: BTreeMap<String, DiskSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(default = "yes")]
    pub allow_scheduling: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    pub storage_maximum: ByteSize,
    pub storage_available: ByteSize,
    /// Sum of the sizes of replicas placed on the disk.
    pub storage_scheduled: ByteSize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disk_status: BTreeMap<String, DiskStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<String>,
}

resource!(
    /// A host (or, on one host, a simulated host with its own loopback address).
    Node,
    NodeSpec,
    NodeStatus
);

impl Node {
    pub fn zone(&self) -> Option<&str> {
        self.metadata.labels.get(ZONE_LABEL).map(String::as_str)
    }
    pub fn is_ready(&self) -> bool {
        condition_is_true(&self.status.conditions, condition::READY)
    }
}
