//! The Node controller: a node whose agent has not written a heartbeat for the
//! `node-down-after` setting (default 10 s, read every pass so a change takes effect at
//! once) is marked `Ready=False` (reason `HeartbeatLost`), and so `Schedulable=False`. The
//! agent sets `Ready=True` again with its next heartbeat. The time of the transition is what
//! the volume controller measures a replica's staleness from.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use zebu_types::resources::{ConditionStatus, Node, condition, set_condition_at};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Store, time};

use crate::World;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    MarkNotReady { message: String },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::MarkNotReady { message } => write!(f, "not ready: {message}"),
        }
    }
}

/// What node `n` needs; see the module docs.
pub fn decide(w: &World, n: &Node) -> Vec<Action> {
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
    for action in actions {
        match action {
            Action::MarkNotReady { message } => {
                tracing::warn!(node = %n.metadata.name, "{message}: node not ready");
                let mut node = n.clone();
                let now = w.now_rfc3339();
                for c in [condition::READY, condition::SCHEDULABLE] {
                    set_condition_at(
                        &mut node.status.conditions,
                        c,
                        ConditionStatus::False,
                        "HeartbeatLost",
                        &message,
                        &now,
                    );
                }
                node.status.observed_generation = node.metadata.generation;
                match store.update_status_as(&node).await {
                    // The agent wrote a heartbeat meanwhile: it is alive.
                    Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
}
