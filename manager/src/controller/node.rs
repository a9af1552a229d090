//! The Node controller: a node whose agent has not written a heartbeat for
//! the `node-down-after` setting (default 10 s, read every pass so a change
//! takes effect at once) is marked `Ready=False` (reason `HeartbeatLost`),
//! and so `Schedulable=False`. The agent sets `Ready=True` again with its next
//! heartbeat. The time of the transition is what the Volume controller
//! measures a replica's staleness from.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::resources::{ConditionStatus, Node, Setting, set_condition};
use crate::settings::{SettingError, Settings};
use crate::store::{Store, StoreError, TypedStore};

#[derive(Debug, thiserror::Error)]
pub enum NodeControllerError {
    #[error("node controller: store: {0}")]
    Store(#[from] StoreError),
    #[error("node controller: {0}")]
    Settings(#[from] SettingError),
}

pub struct NodeController<S> {
    store: Arc<S>,
}

impl<S: Store> NodeController<S> {
    pub fn new(store: Arc<S>) -> Self {
        NodeController { store }
    }

    pub async fn pass(&self) -> Result<(), NodeControllerError> {
        let settings = Settings::from_objects(&self.store.list_as::<Setting>().await?)?;
        let down_after = Duration::from_secs(settings.node_down_after);
        let now = SystemTime::now();
        for mut node in self.store.list_as::<Node>().await? {
            let fresh = node
                .status
                .last_heartbeat
                .as_deref()
                .and_then(crate::time::parse_rfc3339)
                .is_some_and(|t| now.duration_since(t).unwrap_or_default() < down_after);
            if fresh || !node.is_ready() {
                continue;
            }
            tracing::warn!(node = %node.metadata.name, "no heartbeat for {} s: node not ready", down_after.as_secs());
            let msg = format!("no heartbeat for {} s", down_after.as_secs());
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
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{NodeSpec, SettingSpec, condition_is_true};
    use crate::store::EmbeddedStore;

    /// Nodes whose last heartbeat was `age` ago, all Ready.
    async fn nodes_with_heartbeats(store: &EmbeddedStore, ages: &[(&str, Duration)]) {
        for (name, age) in ages {
            let mut n = Node::new(
                *name,
                NodeSpec {
                    address: "127.0.0.1".into(),
                    disks: Default::default(),
                    tags: vec![],
                    allow_scheduling: true,
                },
            );
            n = store.create_as(&n).await.expect("create");
            for c in ["Ready", "Schedulable"] {
                set_condition(&mut n.status.conditions, c, ConditionStatus::True, "", "");
            }
            let beat = SystemTime::now() - *age;
            n.status.last_heartbeat = Some(crate::time::format_rfc3339(beat));
            store.update_status_as(&n).await.expect("status");
        }
    }

    async fn ready(store: &EmbeddedStore, name: &str) -> bool {
        let n: Node = store.get_as(name).await.expect("get").expect("node");
        assert_eq!(
            n.is_ready(),
            condition_is_true(&n.status.conditions, "Schedulable")
        );
        n.is_ready()
    }

    #[tokio::test]
    async fn a_silent_node_becomes_not_ready_after_the_default_ten_seconds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
        nodes_with_heartbeats(
            &store,
            &[
                ("old", Duration::from_secs(20 * 365 * 86400)),
                ("quiet", Duration::from_secs(12)),
                ("fresh", Duration::from_secs(1)),
            ],
        )
        .await;
        NodeController::new(store.clone())
            .pass()
            .await
            .expect("pass");
        assert!(!ready(&store, "old").await);
        assert!(!ready(&store, "quiet").await);
        assert!(ready(&store, "fresh").await);
    }

    #[tokio::test]
    async fn node_down_after_setting_is_what_the_controller_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
        nodes_with_heartbeats(
            &store,
            &[
                ("quiet", Duration::from_secs(12)),
                ("silent", Duration::from_secs(70)),
            ],
        )
        .await;
        let setting = Setting::new("node-down-after", SettingSpec { value: "60".into() });
        store.create_as(&setting).await.expect("setting");
        let controller = NodeController::new(store.clone());
        controller.pass().await.expect("pass");
        assert!(ready(&store, "quiet").await, "12 s < 60 s: still ready");
        assert!(!ready(&store, "silent").await, "70 s > 60 s");
        let n: Node = store.get_as("silent").await.expect("get").expect("node");
        let c = n.status.conditions.iter().find(|c| c.type_ == "Ready");
        assert_eq!(c.map(|c| c.message.as_str()), Some("no heartbeat for 60 s"));

        // A shorter setting takes effect on the next pass.
        let mut s: Setting = store
            .get_as("node-down-after")
            .await
            .expect("get")
            .expect("setting");
        s.spec.value = "5".into();
        store.update_as(&s).await.expect("update");
        controller.pass().await.expect("pass");
        assert!(!ready(&store, "quiet").await, "12 s > 5 s");

        // A bad stored value is an error that names it, and changes nothing.
        let mut s: Setting = store
            .get_as("node-down-after")
            .await
            .expect("get")
            .expect("setting");
        s.spec.value = "soon".into();
        store.update_as(&s).await.expect("update");
        let e = controller.pass().await.expect_err("bad value");
        assert!(e.to_string().contains("node-down-after"), "{e}");
    }
}
