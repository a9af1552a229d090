//! The Engine and Replica controllers: an Engine or Replica whose volume no longer exists
//! (deleted before it carried a finalizer, or by force) is deleted too; a replica only once
//! no engine of its volume is left, so an engine never loses a replica under it.

use std::fmt;
use std::sync::Arc;

use zebu_types::resources::{Engine, Replica};
use zebu_types::store::StoreError;
use zebu_types::{Kind, Store};

use crate::World;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    DeleteEngine { engine: String },
    DeleteReplica { replica: String },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::DeleteEngine { engine } => write!(f, "delete orphan {engine}"),
            Action::DeleteReplica { replica } => write!(f, "delete orphan {replica}"),
        }
    }
}

/// Engine `e`: deleted when its volume is gone.
pub fn decide_engine(w: &World, e: &Engine) -> Vec<Action> {
    if w.volume(&e.spec.volume).is_some() || e.metadata.is_deleting() {
        return vec![];
    }
    vec![Action::DeleteEngine {
        engine: e.metadata.name.clone(),
    }]
}

/// Replica `r`: deleted when its volume is gone and no engine of it is left.
pub fn decide_replica(w: &World, r: &Replica) -> Vec<Action> {
    let engine_left = w.engines_of(&r.spec.volume).next().is_some();
    if w.volume(&r.spec.volume).is_some() || r.metadata.is_deleting() || engine_left {
        return vec![];
    }
    vec![Action::DeleteReplica {
        replica: r.metadata.name.clone(),
    }]
}

pub async fn apply(store: &Arc<dyn Store>, actions: Vec<Action>) -> Result<(), StoreError> {
    for action in actions {
        tracing::info!("{action}");
        let (kind, name) = match &action {
            Action::DeleteEngine { engine } => (Kind::Engine, engine),
            Action::DeleteReplica { replica } => (Kind::Replica, replica),
        };
        match store.delete(kind, name).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
