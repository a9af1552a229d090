//! The Node controller.
//!
//! With heartbeats (one host): a node whose agent has not written a heartbeat for the
//! `node-down-after` setting (default 10 s, read every pass so a change takes effect at
//! once) is marked `Ready=False` (reason `HeartbeatLost`), and so `Schedulable=False`. The
//! agent sets `Ready=True` again with its next heartbeat. The time of the transition is what
//! the volume controller measures a replica's staleness from.
//!
//! With Leases (a cluster): `Ready` follows the node's presence as this pass sees it
//! (`LeaseExpired` / `LeaseRenewed`), so `kubectl get zn` shows what the controllers decide
//! from. Only `Ready` is written; `Schedulable` stays the agent's (disks, scheduling flag).
//! The controllers run this only in the manager that leads the cluster singletons.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use zebu_types::resources::{ConditionStatus, Node, condition, set_condition_at};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Store, time};

use crate::World;
use crate::presence::PresenceSource;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    MarkNotReady {
        message: String,
    },
    /// Leases only: the node's Lease is renewed again.
    MarkReady,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::MarkNotReady { message } => write!(f, "not ready: {message}"),
            Action::MarkReady => f.write_str("ready: lease renewed"),
        }
    }
}

/// What node `n` needs; see the module docs.
pub fn decide(w: &World, n: &Node) -> Vec<Action> {
    if w.presence_source == PresenceSource::Leases {
        let up = w.presence_of(&n.metadata.name).is_up();
        // A node whose Lease this manager has not read yet keeps its Ready as it is.
        let gone = w.manager_gone(&n.metadata.name);
        return match (up, gone, n.is_ready()) {
            (true, _, false) => vec![Action::MarkReady],
            (false, true, true) => vec![Action::MarkNotReady {
                message: format!("Lease zebu-node-{} expired", n.metadata.name),
            }],
            _ => vec![],
        };
    }
    let down_after = Duration::from_secs(w.settings.node_down_after);
    let fresh = n
        .status
        .last_heartbeat
        .as_deref()
        .and_then(time::parse_rfc3339)
        .is_some_and(|t| w.now.duration_since(t).unwrap_or_default() < down_after);
    if fresh || !n.is_ready() {
        return vec![];
    }
    vec![Action::MarkNotReady {
        message: format!("no heartbeat for {} s", down_after.as_secs()),
    }]
}

pub async fn apply(
    store: &Arc<dyn Store>,
    w: &World,
    n: &Node,
    actions: Vec<Action>,
) -> Result<(), StoreError> {
    let leases = w.presence_source == PresenceSource::Leases;
    for action in actions {
        let mut node = n.clone();
        let now = w.now_rfc3339();
        match action {
            Action::MarkNotReady { message } => {
                tracing::warn!(node = %n.metadata.name, "{message}: node Ready -> not ready");
                let (reason, which): (_, &[&str]) = if leases {
                    ("LeaseExpired", &[condition::READY])
                } else {
                    ("HeartbeatLost", &[condition::READY, condition::SCHEDULABLE])
                };
                for c in which {
                    set_condition_at(
                        &mut node.status.conditions,
                        c,
                        ConditionStatus::False,
                        reason,
                        &message,
                        &now,
                    );
                }
            }
            Action::MarkReady => {
                tracing::info!(node = %n.metadata.name, "lease renewed: node not ready -> Ready");
                set_condition_at(
                    &mut node.status.conditions,
                    condition::READY,
                    ConditionStatus::True,
                    "LeaseRenewed",
                    "",
                    &now,
                );
            }
        }
        node.status.observed_generation = node.metadata.generation;
        match store.update_status_as(&node).await {
            // The agent wrote its status meanwhile: the next pass decides again.
            Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
