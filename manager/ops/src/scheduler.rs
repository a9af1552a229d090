//! Replica placement: a pure function from the cluster's state to disks.
//!
//! [`schedule`] takes the nodes (with their disks and last reported
//! capacity), every existing replica, the volume and the settings, and
//! returns where `count` new replicas of the volume go — or a
//! [`ScheduleError`] that says exactly why not. It does no I/O, so every rule
//! is unit-tested here and the caller (a controller) decides when to run it.
//!
//! For each new replica, in turn:
//!
//! 1. **Filter disks.** The node must be Ready and allow scheduling and carry
//!    every tag in `nodeSelector`; the disk must allow scheduling, have
//!    reported its capacity, and carry every tag in `diskSelector`. Capacity
//!    has two tests, as in Longhorn:
//!    - *over-provisioning*: the sizes of all replicas on the disk (existing
//!      and placed in this call) plus this one may not exceed
//!      `(storageMaximum - storageReserved) × over-provisioning %`; replicas
//!      are thin, so this bounds promises, not bytes;
//!    - *minimal available*: the bytes actually free now
//!      (`storageAvailable - storageReserved`) must be at least
//!      `storageMaximum × minimal-available %`, so a nearly full disk takes no
//!      new replicas whatever was promised.
//! 2. **Hard anti-affinity** (node, zone, disk — each hard unless its "soft"
//!    setting is on) removes disks whose node / zone / disk already holds a
//!    replica of this volume.
//! 3. **Rank** what is left, best first: the attach node when data locality
//!    is best-effort and no replica is there yet (an explicit request beats
//!    spreading), then a new zone, a new node, a new disk (soft
//!    anti-affinity), then the most schedulable space left, then names (so
//!    the result is deterministic).
//!
//! Nodes without a zone label count as one zone named "".

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use zebu_types::resources::{DataLocality, Node, Replica, Volume};
use zebu_types::settings::Settings;
use zebu_types::size::ByteSize;

/// Where one new replica goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    pub disk: String,
    /// The disk's path on the node; the replica directory goes under it.
    pub disk_path: String,
}

/// Everything the scheduler looks at.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleRequest<'a> {
    pub volume: &'a Volume,
    pub nodes: &'a [Node],
    /// Every replica of every volume (for disk usage and anti-affinity).
    pub replicas: &'a [Replica],
    pub settings: &'a Settings,
    /// How many new replicas to place.
    pub count: u32,
}

/// Why replica `replica` (1-based among the volume's replicas) of `volume`
/// cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("cannot schedule replica {replica} of volume {volume}: there are no nodes")]
    NoNodes { volume: String, replica: u32 },
    #[error(
        "cannot schedule replica {replica} of volume {volume}: {nodes} nodes, hard node anti-affinity needs {needed}{}",
        unusable_suffix(unusable)
    )]
    NotEnoughNodes {
        volume: String,
        replica: u32,
        nodes: usize,
        needed: u32,
        /// Why the other nodes and disks could not be used.
        unusable: Vec<String>,
    },
    #[error(
        "cannot schedule replica {replica} of volume {volume}: {zones} zones, hard zone anti-affinity needs {needed}{}",
        unusable_suffix(unusable)
    )]
    NotEnoughZones {
        volume: String,
        replica: u32,
        zones: usize,
        needed: u32,
        unusable: Vec<String>,
    },
    #[error(
        "cannot schedule replica {replica} of volume {volume}: {disks} usable disks, hard disk anti-affinity needs {needed}{}",
        unusable_suffix(unusable)
    )]
    NotEnoughDisks {
        volume: String,
        replica: u32,
        disks: usize,
        needed: u32,
        unusable: Vec<String>,
    },
    #[error(
        "cannot schedule replica {replica} of volume {volume}: no disk has {size} available under {over_provisioning}% over-provisioning: {}",
        reasons.join("; ")
    )]
    NoDiskFits {
        volume: String,
        replica: u32,
        size: ByteSize,
        over_provisioning: u64,
        reasons: Vec<String>,
    },
}

fn unusable_suffix(unusable: &[String]) -> String {
    if unusable.is_empty() {
        String::new()
    } else {
        format!(" (not usable: {})", unusable.join("; "))
    }
}

#[derive(Debug, Clone)]
struct Candidate<'a> {
    node: &'a Node,
    disk: &'a str,
    path: &'a str,
    zone: &'a str,
    /// Bytes still schedulable under over-provisioning after this replica.
    headroom: u64,
}

struct Tags<'a>(&'a [String]);

impl fmt::Display for Tags<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}]", self.0.join(", "))
    }
}

/// Place `req.count` new replicas of `req.volume`; see the module docs.
pub fn schedule(req: &ScheduleRequest<'_>) -> Result<Vec<Placement>, ScheduleError> {
    let volume = &req.volume.metadata.name;
    let size = req.volume.spec.size.bytes();
    let s = req.settings;
    let mine: Vec<&Replica> = req
        .replicas
        .iter()
        .filter(|r| &r.spec.volume == volume && r.metadata.deletion_timestamp.is_none())
        .collect();
    let existing = mine.len() as u32;
    let needed_total = existing + req.count;

    // Bytes scheduled per (node, disk), including replicas placed below.
    let mut scheduled: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in req.replicas {
        *scheduled
            .entry((r.spec.node.clone(), r.spec.disk.clone()))
            .or_default() += r.spec.size.bytes();
    }
    let zone_of = |node: &str| {
        req.nodes
            .iter()
            .find(|n| n.metadata.name == node)
            .and_then(Node::zone)
            .unwrap_or("")
            .to_string()
    };
    let mut used_nodes: BTreeSet<String> = mine.iter().map(|r| r.spec.node.clone()).collect();
    let mut used_zones: BTreeSet<String> = mine.iter().map(|r| zone_of(&r.spec.node)).collect();
    let mut used_disks: BTreeSet<(String, String)> = mine
        .iter()
        .map(|r| (r.spec.node.clone(), r.spec.disk.clone()))
        .collect();
    let attach_node = req.volume.spec.node_id.as_deref().or(req
        .volume
        .status
        .current_node
        .as_deref());

    let mut placements = Vec::new();
    for i in 0..req.count {
        let replica = existing + i + 1;
        if req.nodes.is_empty() {
            return Err(ScheduleError::NoNodes {
                volume: volume.clone(),
                replica,
            });
        }
        let (fitting, reasons) = fitting_disks(req, &scheduled, size);
        if fitting.is_empty() {
            return Err(ScheduleError::NoDiskFits {
                volume: volume.clone(),
                replica,
                size: ByteSize(size),
                over_provisioning: s.storage_over_provisioning_percentage,
                reasons,
            });
        }
        let mut allowed = fitting.clone();
        if !s.replica_soft_anti_affinity {
            allowed.retain(|c| !used_nodes.contains(&c.node.metadata.name));
            if allowed.is_empty() {
                let nodes: BTreeSet<_> = fitting.iter().map(|c| &c.node.metadata.name).collect();
                return Err(ScheduleError::NotEnoughNodes {
                    volume: volume.clone(),
                    replica,
                    nodes: nodes.len(),
                    needed: needed_total,
                    unusable: reasons,
                });
            }
        }
        if !s.replica_zone_soft_anti_affinity {
            allowed.retain(|c| !used_zones.contains(c.zone));
            if allowed.is_empty() {
                let zones: BTreeSet<_> = fitting.iter().map(|c| c.zone).collect();
                return Err(ScheduleError::NotEnoughZones {
                    volume: volume.clone(),
                    replica,
                    zones: zones.len(),
                    needed: needed_total,
                    unusable: reasons,
                });
            }
        }
        if !s.replica_disk_soft_anti_affinity {
            allowed.retain(|c| {
                !used_disks.contains(&(c.node.metadata.name.clone(), c.disk.to_string()))
            });
            if allowed.is_empty() {
                return Err(ScheduleError::NotEnoughDisks {
                    volume: volume.clone(),
                    replica,
                    disks: fitting.len(),
                    needed: needed_total,
                    unusable: reasons,
                });
            }
        }
        let want_local = req.volume.spec.data_locality == DataLocality::BestEffort
            && attach_node.is_some_and(|a| !used_nodes.contains(a));
        let best = allowed
            .iter()
            .min_by_key(|c| {
                let name = &c.node.metadata.name;
                let local = want_local && attach_node == Some(name.as_str());
                (
                    !local,
                    used_zones.contains(c.zone),
                    used_nodes.contains(name),
                    used_disks.contains(&(name.clone(), c.disk.to_string())),
                    Reverse(c.headroom),
                    name.clone(),
                    c.disk,
                )
            })
            .expect("invariant: allowed is not empty here");
        let node = best.node.metadata.name.clone();
        *scheduled
            .entry((node.clone(), best.disk.to_string()))
            .or_default() += size;
        used_nodes.insert(node.clone());
        used_zones.insert(best.zone.to_string());
        used_disks.insert((node.clone(), best.disk.to_string()));
        placements.push(Placement {
            node,
            disk: best.disk.to_string(),
            disk_path: best.path.to_string(),
        });
    }
    Ok(placements)
}

/// Disks that can take one more replica of `size` bytes, and a reason for
/// every disk (or node) that cannot.
fn fitting_disks<'a>(
    req: &ScheduleRequest<'a>,
    scheduled: &BTreeMap<(String, String), u64>,
    size: u64,
) -> (Vec<Candidate<'a>>, Vec<String>) {
    let s = req.settings;
    let spec = &req.volume.spec;
    let mut fitting = Vec::new();
    let mut reasons = Vec::new();
    for node in req.nodes {
        let n = &node.metadata.name;
        if !node.is_ready() {
            reasons.push(format!("{n} is not ready"));
            continue;
        }
        if !node.spec.allow_scheduling {
            reasons.push(format!("{n} has scheduling disabled"));
            continue;
        }
        if !spec
            .node_selector
            .iter()
            .all(|t| node.spec.tags.contains(t))
        {
            reasons.push(format!(
                "{n} is tagged {}, volume needs node tags {}",
                Tags(&node.spec.tags),
                Tags(&spec.node_selector)
            ));
            continue;
        }
        if node.spec.disks.is_empty() {
            reasons.push(format!("{n} has no disks"));
        }
        for (d, disk) in &node.spec.disks {
            if !disk.allow_scheduling {
                reasons.push(format!("{n}/{d} has scheduling disabled"));
                continue;
            }
            if !spec.disk_selector.iter().all(|t| disk.tags.contains(t)) {
                reasons.push(format!(
                    "{n}/{d} is tagged {}, volume needs disk tags {}",
                    Tags(&disk.tags),
                    Tags(&spec.disk_selector)
                ));
                continue;
            }
            let Some(status) = node.status.disk_status.get(d) else {
                reasons.push(format!("{n}/{d} has not reported its capacity"));
                continue;
            };
            let max = status.storage_maximum.bytes();
            let reserved = disk.storage_reserved.bytes();
            let usable = max.saturating_sub(reserved);
            let limit = (u128::from(usable) * u128::from(s.storage_over_provisioning_percentage)
                / 100) as u64;
            let used = scheduled.get(&(n.clone(), d.clone())).copied().unwrap_or(0);
            let left = limit.saturating_sub(used);
            if size > left {
                reasons.push(format!(
                    "{n}/{d} has {} of {} schedulable left",
                    ByteSize(left).approx(),
                    ByteSize(limit).approx()
                ));
                continue;
            }
            let free = status.storage_available.bytes().saturating_sub(reserved);
            let min_free =
                (u128::from(max) * u128::from(s.storage_minimal_available_percentage) / 100) as u64;
            if free < min_free {
                reasons.push(format!(
                    "{n}/{d} has {} free of {}, below the {}% minimum",
                    ByteSize(free).approx(),
                    ByteSize(max).approx(),
                    s.storage_minimal_available_percentage
                ));
                continue;
            }
            fitting.push(Candidate {
                node,
                disk: d,
                path: &disk.path,
                zone: node.zone().unwrap_or(""),
                headroom: left - size,
            });
        }
    }
    (fitting, reasons)
}

#[cfg(test)]
mod tests;
