//! The Node controller: a node whose agent has not written a heartbeat for
//! `down_after` is marked `Ready=False` (reason `HeartbeatLost`), and so
//! `Schedulable=False`. The agent sets `Ready=True` again with its next
//! heartbeat. The time of the transition is what the Volume controller
//! measures a replica's staleness from.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::resources::{ConditionStatus, Node, set_condition};
use crate::store::{Store, StoreError, TypedStore};

pub struct NodeController<S> {
    store: Arc<S>,
    down_after: Duration,
}

impl<S: Store> NodeController<S> {
    pub fn new(store: Arc<S>, down_after: Duration) -> Self {
        NodeController { store, down_after }
    }

    pub async fn pass(&self) -> Result<(), StoreError> {
        let now = SystemTime::now();
        for mut node in self.store.list_as::<Node>().await? {
            let fresh = node
                .status
                .last_heartbeat
                .as_deref()
                .and_then(crate::time::parse_rfc3339)
                .is_some_and(|t| now.duration_since(t).unwrap_or_default() < self.down_after);
            if fresh || !node.is_ready() {
                continue;
            }
            tracing::warn!(node = %node.metadata.name, "no heartbeat for {} s: node not ready", self.down_after.as_secs());
            let msg = format!("no heartbeat for {} s", self.down_after.as_secs());
            set_condition(
                &mut node.status.conditions,
                "Ready",
                ConditionStatus::False,
                "HeartbeatLost",
                &msg,
            );
            set_condition(
                &mut node.status.conditions,
                "Schedulable",
                ConditionStatus::False,
                "HeartbeatLost",
                &msg,
            );
            match self.store.update_status_as(&node).await {
                // The agent wrote a heartbeat meanwhile: it is alive.
                Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{NodeSpec, condition_is_true};
    use crate::store::EmbeddedStore;

    #[tokio::test]
    async fn a_silent_node_becomes_not_ready_and_a_fresh_one_stays_ready() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
        for (name, beat) in [
            ("old", "2000-01-01T00:00:00Z".to_string()),
            ("new", crate::time::now_rfc3339()),
        ] {
            let mut n = Node::new(
                name,
                NodeSpec {
                    address: "127.0.0.1".into(),
                    disks: Default::default(),
                    tags: vec![],
                    allow_scheduling: true,
                },
            );
            n = store.create_as(&n).await.expect("create");
            set_condition(
                &mut n.status.conditions,
                "Ready",
                ConditionStatus::True,
                "",
                "",
            );
            n.status.last_heartbeat = Some(beat);
            store.update_status_as(&n).await.expect("status");
        }
        NodeController::new(store.clone(), Duration::from_secs(10))
            .pass()
            .await
            .expect("pass");
        let old: Node = store.get_as("old").await.expect("get").expect("old");
        let new: Node = store.get_as("new").await.expect("get").expect("new");
        assert!(!old.is_ready());
        assert!(!condition_is_true(&old.status.conditions, "Schedulable"));
        assert!(new.is_ready());
    }
}
