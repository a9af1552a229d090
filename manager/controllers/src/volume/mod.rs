//! The Volume controller: [`decide`] what one volume needs from the world alone (pure, no
//! I/O), then [`VolumeApplier::apply`] it.
//!
//! For every volume, in this order:
//!
//! 1. **Delete** (deletionTimestamp set): delete the Engine objects; when they are gone,
//!    delete the Replica objects (their agents stop the processes and remove the
//!    directories, then drop the finalizers); when those are gone, drop the volume's
//!    finalizer and the volume goes. Objects on a node that is not Ready are removed by
//!    force (finalizers dropped): no agent is there to do it.
//! 2. **Replace stale replicas, wait first**: a replica whose node has been not Ready for
//!    longer than the volume's `staleReplicaTimeout` (or whose node is gone) is marked
//!    [`SUPERSEDED_LABEL`] and stops counting, so step 3 schedules a new one on another node
//!    and the heal step adds it to the engine (a full rebuild). Only when the replacement is
//!    RW in the engine (or, detached, running) is the old one deleted. The engine then drops
//!    its address as one no Replica owns. A node "not Ready" is one whose *manager* is gone;
//!    its processes may still run (they are supervised apart from the manager), so a replica
//!    that the running engine reports RW or WO is not stale, wherever its node's manager
//!    is.
//! 3. **Schedule**: fewer live replicas than `numberOfReplicas` → place the missing ones
//!    (the scheduler in `zebu-ops`) and create their Replica objects.
//! 4. **Attach / detach**: `spec.nodeId` set and no engine → once the replicas run, create
//!    the Engine object on that node with their addresses; an engine on another node, with
//!    another frontend, or not wanted → delete it.
//! 5. **Heal** a running engine: a replica that runs but that the engine has as ERR (or not
//!    at all) is added back (the engine catches it up or rebuilds it); addresses the engine
//!    has that no replica owns are removed; Engine and Replica objects follow the size the
//!    engine serves after an expansion. While the engine's node has no manager (its Lease
//!    expired; the engine keeps serving), the volume's owner observes the engine over its
//!    control API instead of that node's agent ([`Action::ObserveEngine`]), so healing
//!    goes on.
//! 6. **Salvage**: an engine that refuses to start because no replica can be shown current,
//!    or that is faulted (every replica failed) while every replica process runs, is started
//!    again with `--salvage`.
//! 7. **Status**: state, robustness, endpoint, the replica summary, and
//!    `observedGeneration`.
//!
//! ```text
//!  creating ──replicas running──▶ detached ◀──────────────┐
//!                                   │ nodeId set           │ engine gone
//!                                   ▼                      │
//!                               attaching ──engine ready──▶ attached ──nodeId unset──▶ detaching
//! ```
//!
//! Every decision is written to the store before anyone acts on it (the controller creates
//! a Replica object; the agent starts its process; the Salvaging condition is written
//! before the faulted engine is deleted), and every pass decides from a fresh world. So a
//! manager killed between any two actions decides the same after a restart and carries on.

mod apply;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use zebu_ops::scheduler::{ScheduleRequest, schedule};
use zebu_types::names::SUPERSEDED_LABEL;
use zebu_types::resources::{
    ConditionStatus, Engine, EngineSpec, EngineState, EngineVolumeState, RebuildState, Replica,
    ReplicaMode, ReplicaState, Robustness, Volume, VolumeReplicaSummary, VolumeState, VolumeStatus,
    condition, condition_is_true, set_condition_at,
};
use zebu_types::size::ByteSize;

use crate::World;

pub use apply::VolumeApplier;

/// One thing the volume controller does. `Display` is a short line, as the decision tests
/// and the logs show it.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Write the volume's status.
    SetStatus(VolumeStatus),
    AddFinalizer,
    RemoveFinalizer,
    /// A new replica on this node's disk (its name and directory are picked when created).
    CreateReplica {
        node: String,
        disk: String,
        disk_path: String,
        size: ByteSize,
    },
    /// Take a replica out of the count (its node stayed down too long).
    MarkSuperseded {
        replica: String,
        at: String,
    },
    /// Delete a replica; `force` drops its finalizers too (no agent will).
    DeleteReplica {
        replica: String,
        force: bool,
    },
    /// The replica's size after its engine grew the volume.
    ResizeReplica {
        replica: String,
        size: ByteSize,
    },
    CreateEngine {
        spec: EngineSpec,
    },
    UpdateEngineSpec {
        engine: String,
        spec: EngineSpec,
    },
    DeleteEngine {
        engine: String,
        force: bool,
    },
    /// Ask the running engine to take a replica (back) in.
    ReplicaAdd {
        control: String,
        replica: String,
        address: String,
        was: Option<ReplicaMode>,
    },
    /// Ask the running engine to drop an address no replica owns.
    ReplicaRemove {
        control: String,
        address: String,
    },
    /// Read the engine's state over its control API and write it into its status: its
    /// node's agent, which normally does, is gone.
    ObserveEngine {
        engine: String,
        control: String,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::SetStatus(s) => {
                write!(f, "status {} {}", s.state.as_str(), s.robustness.as_str())?;
                if let Some(n) = &s.current_node {
                    write!(f, " on {n}")?;
                }
                if let Some(e) = &s.endpoint {
                    write!(f, " at {e}")?;
                }
                for c in &s.conditions {
                    write!(f, " {}={:?}", c.type_, c.status)?;
                }
                Ok(())
            }
            Action::AddFinalizer => f.write_str("add finalizer"),
            Action::RemoveFinalizer => f.write_str("remove finalizer"),
            Action::CreateReplica {
                node, disk, size, ..
            } => write!(f, "create replica on {node}/{disk} ({size})"),
            Action::MarkSuperseded { replica, .. } => write!(f, "supersede {replica}"),
            Action::DeleteReplica { replica, force } => {
                write!(
                    f,
                    "delete {replica}{}",
                    if *force { " by force" } else { "" }
                )
            }
            Action::ResizeReplica { replica, size } => write!(f, "resize {replica} to {size}"),
            Action::CreateEngine { spec } => {
                write!(f, "create engine on {} with", spec.node)?;
                for name in spec.replica_addresses.keys() {
                    write!(f, " {name}")?;
                }
                if spec.disable_frontend {
                    write!(f, " without frontend")?;
                }
                if spec.salvage {
                    write!(f, " salvage")?;
                }
                Ok(())
            }
            Action::UpdateEngineSpec { engine, spec } => {
                write!(f, "update {engine}: size {}", spec.size)?;
                for name in spec.replica_addresses.keys() {
                    write!(f, " {name}")?;
                }
                if spec.salvage {
                    write!(f, " salvage")?;
                }
                Ok(())
            }
            Action::DeleteEngine { engine, force } => {
                write!(
                    f,
                    "delete {engine}{}",
                    if *force { " by force" } else { "" }
                )
            }
            Action::ReplicaAdd { replica, was, .. } => write!(
                f,
                "add {replica} to the engine (was {})",
                was.map_or("absent", ReplicaMode::as_str)
            ),
            Action::ReplicaRemove { address, .. } => write!(f, "remove {address} from the engine"),
            Action::ObserveEngine { engine, .. } => write!(f, "observe {engine}"),
        }
    }
}

/// What volume `v` needs, from the world alone; see the module docs.
pub fn decide(w: &World, v: &Volume) -> Vec<Action> {
    let name = v.metadata.name.as_str();
    let now = w.now_rfc3339();
    let mine: Vec<&Replica> = w.replicas_of(name).collect();
    let engines: Vec<&Engine> = w.engines_of(name).collect();
    let mut actions = Vec::new();
    let mut status = v.status.clone();
    status.observed_generation = v.metadata.generation;

    // 1. Delete.
    if v.metadata.is_deleting() {
        status.state = VolumeState::Deleting;
        if status != v.status {
            actions.push(Action::SetStatus(status));
        }
        for e in &engines {
            let force = !w.node_ready(&e.spec.node);
            if force || !e.metadata.is_deleting() {
                actions.push(Action::DeleteEngine {
                    engine: e.metadata.name.clone(),
                    force,
                });
            }
        }
        if !engines.is_empty() {
            return actions;
        }
        for r in &mine {
            let force = !w.node_ready(&r.spec.node);
            if force || !r.metadata.is_deleting() {
                actions.push(Action::DeleteReplica {
                    replica: r.metadata.name.clone(),
                    force,
                });
            }
        }
        if mine.is_empty() {
            actions.push(Action::RemoveFinalizer);
        }
        return actions;
    }
    if !v
        .metadata
        .has_finalizer(zebu_types::names::VOLUME_FINALIZER)
    {
        actions.push(Action::AddFinalizer);
    }

    // 2. Supersede replicas whose node has been gone too long (unless the engine still has
    // them in sync: then only the node's manager is gone).
    let timeout = Duration::from_secs(v.spec.stale_replica_timeout);
    let serving = engines
        .iter()
        .find(|e| !e.metadata.is_deleting() && e.status.state == EngineState::Running)
        .filter(|e| e.status.volume_state.is_some());
    let vouched = |r: &Replica| {
        serving.is_some_and(|e| {
            matches!(
                e.status.replica_modes.get(&r.metadata.name),
                Some(ReplicaMode::RW | ReplicaMode::WO)
            )
        })
    };
    let mut live: Vec<&Replica> = Vec::new();
    let mut superseded: Vec<&Replica> = Vec::new();
    for r in mine.iter().filter(|r| !r.metadata.is_deleting()) {
        if r.metadata.labels.contains_key(SUPERSEDED_LABEL) {
            superseded.push(r);
        } else if w.node_down_for(&r.spec.node) >= Some(timeout) && !vouched(r) {
            actions.push(Action::MarkSuperseded {
                replica: r.metadata.name.clone(),
                at: now.clone(),
            });
            superseded.push(r);
        } else {
            live.push(r);
        }
    }

    // 4 (first part). The engine that serves the volume as it is wanted.
    let wanted = v.spec.node_id.as_deref();
    let mut current: Option<&Engine> = None;
    let mut stopping = Vec::new();
    for e in engines.iter().filter(|e| !e.metadata.is_deleting()) {
        let fits = Some(e.spec.node.as_str()) == wanted
            && e.spec.disable_frontend == v.spec.disable_frontend
            && e.spec.frontend == v.spec.frontend;
        if fits && current.is_none() {
            current = Some(e);
        } else {
            stopping.push(Action::DeleteEngine {
                engine: e.metadata.name.clone(),
                force: false,
            });
        }
    }
    let engine_size = current
        .filter(|e| e.status.state == EngineState::Running)
        .and_then(|e| e.status.size);

    // 3. Schedule missing replicas.
    let missing = v.spec.number_of_replicas.saturating_sub(live.len() as u32);
    if missing > 0 {
        let nodes = w.nodes_as_present();
        let placed = schedule(&ScheduleRequest {
            volume: v,
            nodes: &nodes,
            replicas: &w.replicas,
            settings: &w.settings,
            count: missing,
        });
        match placed {
            Ok(placements) => {
                let size = engine_size.map_or(v.spec.size, |s| s.max(v.spec.size));
                for p in placements {
                    actions.push(Action::CreateReplica {
                        node: p.node,
                        disk: p.disk,
                        disk_path: p.disk_path,
                        size,
                    });
                }
                set_condition_at(
                    &mut status.conditions,
                    condition::SCHEDULED,
                    ConditionStatus::True,
                    "",
                    "",
                    &now,
                );
            }
            Err(e) => set_condition_at(
                &mut status.conditions,
                condition::SCHEDULED,
                ConditionStatus::False,
                "ReplicaSchedulingFailure",
                &e.to_string(),
                &now,
            ),
        }
    }

    // After an expansion, the objects follow the size (the engine's, or the volume's once
    // ops recorded it), so restarts of the replicas and of the engine ask for that size.
    let target = engine_size.map_or(v.spec.size, |s| s.max(v.spec.size));
    for r in live.iter().chain(&superseded) {
        if r.spec.size < target {
            actions.push(Action::ResizeReplica {
                replica: r.metadata.name.clone(),
                size: target,
            });
        }
    }

    // 4. Attach / detach.
    actions.extend(stopping);
    if let Some(e) = current
        && e.status.state == EngineState::Running
        && !w.node_ready(&e.spec.node)
        && let Some(control) = e.status.control_address.clone()
    {
        actions.push(Action::ObserveEngine {
            engine: e.metadata.name.clone(),
            control,
        });
    }
    let running: BTreeMap<String, String> = live
        .iter()
        .filter(|r| r.status.state == ReplicaState::Running)
        .filter_map(|r| Some((r.metadata.name.clone(), r.status.address.clone()?)))
        .collect();
    let salvaging = condition_is_true(&v.status.conditions, condition::SALVAGING);
    match (wanted, current) {
        (Some(node), None) => {
            let some_failed = live.iter().any(|r| r.status.state == ReplicaState::Error);
            let all_up = running.len() == live.len() && !live.is_empty();
            if engines.is_empty() && !running.is_empty() && (all_up || some_failed) {
                actions.push(Action::CreateEngine {
                    spec: EngineSpec {
                        volume: name.to_string(),
                        node: node.to_string(),
                        size: v.spec.size,
                        replica_addresses: running.clone(),
                        frontend: v.spec.frontend,
                        disable_frontend: v.spec.disable_frontend,
                        salvage: salvaging,
                    },
                });
            }
        }
        (Some(_), Some(e)) => tend_engine(
            w,
            e,
            target,
            &live,
            &running,
            salvaging,
            &mut status,
            &mut actions,
        ),
        (None, _) => {}
    }

    // 2b. Remove superseded replicas once their replacements are in sync.
    if !superseded.is_empty() && live.len() as u32 >= v.spec.number_of_replicas {
        let in_sync = match current.filter(|e| e.status.state == EngineState::Running) {
            Some(e) => live
                .iter()
                .all(|r| e.status.replica_modes.get(&r.metadata.name) == Some(&ReplicaMode::RW)),
            None => current.is_none() && running.len() == live.len(),
        };
        if in_sync {
            for r in &superseded {
                actions.push(Action::DeleteReplica {
                    replica: r.metadata.name.clone(),
                    force: !w.node_ready(&r.spec.node),
                });
            }
        }
    }

    // 7. Status.
    let engine = current.filter(|e| e.status.state == EngineState::Running);
    let served = |e: &Engine| e.status.endpoint.is_some() || e.spec.disable_frontend;
    status.state = match (wanted, engine, engines.is_empty()) {
        (Some(_), Some(e), _) if served(e) => VolumeState::Attached,
        (Some(_), _, _) => VolumeState::Attaching,
        (None, _, false) => VolumeState::Detaching,
        (None, _, true) if live.is_empty() || running.len() < live.len() => {
            if v.status.state == VolumeState::Creating {
                VolumeState::Creating
            } else {
                VolumeState::Detached
            }
        }
        (None, _, true) => VolumeState::Detached,
    };
    // RW in the engine, and still the process the engine took as RW (a replica restarted
    // since is out of sync until the engine sees it).
    let all_rw = |e: &Engine| {
        live.iter().all(|r| {
            let name = &r.metadata.name;
            e.status.replica_modes.get(name) == Some(&ReplicaMode::RW)
                && e.status
                    .replica_pids
                    .get(name)
                    .is_none_or(|p| r.status.pid == Some(*p))
        })
    };
    let full = live.len() as u32 >= v.spec.number_of_replicas;
    status.robustness = match engine {
        Some(e) => match e.status.volume_state {
            Some(EngineVolumeState::Faulted) => Robustness::Faulted,
            Some(EngineVolumeState::Healthy)
                if all_rw(e) && full && running.len() == live.len() =>
            {
                Robustness::Healthy
            }
            Some(_) => Robustness::Degraded,
            None => Robustness::Unknown,
        },
        None if running.is_empty() => Robustness::Unknown,
        None if running.len() == live.len() && full => Robustness::Healthy,
        None => Robustness::Degraded,
    };
    status.replicas = live
        .iter()
        .map(|r| VolumeReplicaSummary {
            name: r.metadata.name.clone(),
            node: r.spec.node.clone(),
            mode: engine.and_then(|e| e.status.replica_modes.get(&r.metadata.name).copied()),
        })
        .collect();
    status.endpoint = match engine {
        Some(e) if status.state == VolumeState::Attached => e.status.endpoint.clone(),
        _ => None,
    };
    status.rebuild = engine
        .and_then(|e| e.status.rebuild.clone())
        .filter(|r| r.state == RebuildState::Running);
    status.current_node = engine.map(|e| e.spec.node.clone());
    // Against what this pass already wrote (a salvage writes its decision first).
    let written = actions
        .iter()
        .rev()
        .find_map(|a| match a {
            Action::SetStatus(s) => Some(s),
            _ => None,
        })
        .unwrap_or(&v.status);
    if status != *written {
        actions.push(Action::SetStatus(status));
    }
    actions
}

/// Keep an existing engine fed: addresses while it is down, heal and salvage while it is up.
#[allow(clippy::too_many_arguments)]
fn tend_engine(
    w: &World,
    e: &Engine,
    size: ByteSize,
    live: &[&Replica],
    running: &BTreeMap<String, String>,
    salvaging: bool,
    status: &mut VolumeStatus,
    actions: &mut Vec<Action>,
) {
    if e.status.state != EngineState::Running {
        // Restarts use the replicas as they are now.
        let mut spec = e.spec.clone();
        if !running.is_empty() {
            spec.replica_addresses = running.clone();
        }
        spec.size = spec.size.max(size);
        let every_replica_runs = running.len() == live.len() && !live.is_empty();
        if e.status.state == EngineState::Error
            && e.status.message.contains("--salvage")
            && every_replica_runs
        {
            // No replica can be shown current: auto-salvage.
            spec.salvage = true;
        }
        if spec != e.spec {
            actions.push(Action::UpdateEngineSpec {
                engine: e.metadata.name.clone(),
                spec,
            });
        }
        return;
    }
    let Some(control) = e.status.control_address.clone() else {
        return;
    };
    match e.status.volume_state {
        Some(EngineVolumeState::Faulted) if running.len() == live.len() && !salvaging => {
            // Every replica failed but every process runs: start over and let the engine
            // take the best one. The decision is recorded before the engine goes.
            set_condition_at(
                &mut status.conditions,
                condition::SALVAGING,
                ConditionStatus::True,
                "AllReplicasFailed",
                "",
                &w.now_rfc3339(),
            );
            actions.push(Action::SetStatus(status.clone()));
            actions.push(Action::DeleteEngine {
                engine: e.metadata.name.clone(),
                force: false,
            });
            return;
        }
        Some(EngineVolumeState::Healthy | EngineVolumeState::Degraded) if salvaging => {
            set_condition_at(
                &mut status.conditions,
                condition::SALVAGING,
                ConditionStatus::False,
                "",
                "",
                &w.now_rfc3339(),
            );
        }
        _ => {}
    }
    // Heal: running replicas the engine has failed or does not have.
    for r in live {
        let Some(addr) = running.get(&r.metadata.name) else {
            continue;
        };
        let mode = e.status.replica_modes.get(&r.metadata.name).copied();
        if matches!(mode, Some(ReplicaMode::RW | ReplicaMode::WO)) {
            continue;
        }
        actions.push(Action::ReplicaAdd {
            control: control.clone(),
            replica: r.metadata.name.clone(),
            address: addr.clone(),
            was: mode,
        });
    }
    // Addresses no replica owns any more (a replaced replica).
    for (addr, mode) in &e.status.unknown_replicas {
        if *mode == ReplicaMode::RW && running.is_empty() {
            continue;
        }
        actions.push(Action::ReplicaRemove {
            control: control.clone(),
            address: addr.clone(),
        });
    }
    if e.spec.size < size {
        let mut spec = e.spec.clone();
        spec.size = size;
        actions.push(Action::UpdateEngineSpec {
            engine: e.metadata.name.clone(),
            spec,
        });
    }
}

#[cfg(test)]
mod tests;
