//! The node agent: one per node, reporting the node and running its
//! replica and engine processes (see [`crate::instances`]).
//!
//! On start the agent registers its Node (address and disks) if the store
//! does not have it yet, so a restart keeps whatever tags or scheduling flags
//! an operator set. Then, every heartbeat, it measures each disk with
//! `statvfs`, adds up the replicas the store places on it, and writes the
//! Node's status: disk capacity, `Ready`/`Schedulable` conditions and
//! `lastHeartbeat`. Writes retry on resourceVersion conflicts by re-reading.
//!
//! With `zebu up` several agents share one host; each gets its own loopback
//! address (127.0.0.10+i) and its own disk directory, so they behave like
//! separate machines to everything above them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use zebu_controllers::changes::{Changes, Wake};
use zebu_types::resources::{
    ConditionStatus, DiskSpec, DiskStatus, Node, NodeSpec, Replica, condition, set_condition,
};
use zebu_types::size::ByteSize;
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Kind, Store};

use crate::instances::Instances;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("node {node}: store: {source}")]
    Store {
        node: String,
        #[source]
        source: StoreError,
    },
    #[error("node {node}: disk {path}: {source}")]
    Disk {
        node: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What one agent needs to know about its node.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node: String,
    pub address: String,
    /// Disk name -> directory.
    pub disks: BTreeMap<String, PathBuf>,
    pub heartbeat: Duration,
    /// Where the node's processes write their stdout and stderr.
    pub log_dir: PathBuf,
    /// The instance manager's socket, when it starts the node's processes (in a cluster,
    /// so that they outlive the manager's container); `None`: the agent starts them.
    pub instance_manager: Option<PathBuf>,
    /// TLS on the node's replica ports ([`crate::tls`]); `None`: plain TCP.
    pub replica_tls: Option<crate::tls::ReplicaTls>,
}

/// Capacity of the filesystem holding `path`.
fn disk_capacity(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    let st = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    let frag = st.fragment_size();
    Ok((st.blocks() * frag, st.blocks_available() * frag))
}

pub struct NodeAgent {
    store: Arc<dyn Store>,
    cfg: AgentConfig,
    instances: Instances,
}

/// How often the agent looks at its replicas and engines when nothing wakes it sooner (a
/// process that exited shows no event).
const RECONCILE_EVERY: Duration = Duration::from_millis(500);

/// What wakes the agent sooner: a replica or engine created, removed or changed in its spec
/// (not in its status, which the agent writes itself).
const WATCHED: [(Kind, Wake); 2] = [(Kind::Replica, Wake::Spec), (Kind::Engine, Wake::Spec)];

impl NodeAgent {
    pub fn new(store: Arc<dyn Store>, cfg: AgentConfig) -> Self {
        let instances = Instances::new(
            store.clone(),
            cfg.node.clone(),
            cfg.address.clone(),
            cfg.log_dir.clone(),
        )
        .with_instance_manager(cfg.instance_manager.clone())
        .with_replica_tls(cfg.replica_tls.clone());
        NodeAgent {
            store,
            cfg,
            instances,
        }
    }

    fn err(&self, source: StoreError) -> AgentError {
        AgentError::Store {
            node: self.cfg.node.clone(),
            source,
        }
    }

    /// Create the Node if it is missing, and the disk directories; record
    /// the node's processes that died with the previous agent as stopped.
    pub async fn register(&self) -> Result<(), AgentError> {
        for path in self.cfg.disks.values() {
            std::fs::create_dir_all(path).map_err(|source| AgentError::Disk {
                node: self.cfg.node.clone(),
                path: path.clone(),
                source,
            })?;
        }
        if let Err(e) = self.instances.mark_gone_as_stopped().await {
            tracing::warn!("{e}");
        }
        if self
            .store
            .get_as::<Node>(&self.cfg.node)
            .await
            .map_err(|e| self.err(e))?
            .is_some()
        {
            return Ok(());
        }
        let disks = self
            .cfg
            .disks
            .iter()
            .map(|(name, path)| {
                let spec = DiskSpec {
                    path: path.display().to_string(),
                    tags: vec![],
                    allow_scheduling: true,
                    storage_reserved: ByteSize(0),
                };
                (name.clone(), spec)
            })
            .collect();
        let node = Node::new(
            self.cfg.node.clone(),
            NodeSpec {
                address: self.cfg.address.clone(),
                disks,
                tags: vec![],
                allow_scheduling: true,
            },
        );
        match self.store.create_as(&node).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Write one heartbeat: disk capacity and conditions.
    pub async fn heartbeat(&self) -> Result<(), AgentError> {
        let replicas: Vec<Replica> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for _ in 0..10 {
            let Some(mut node) = self
                .store
                .get_as::<Node>(&self.cfg.node)
                .await
                .map_err(|e| self.err(e))?
            else {
                // Deleted by an operator: register again on the next start only.
                return Ok(());
            };
            let mut all_ok = true;
            let mut disk_status = BTreeMap::new();
            for (name, disk) in &node.spec.disks {
                let scheduled: u64 = replicas
                    .iter()
                    .filter(|r| r.spec.node == self.cfg.node && &r.spec.disk == name)
                    .map(|r| r.spec.size.bytes())
                    .sum();
                let mut st = DiskStatus {
                    storage_scheduled: ByteSize(scheduled),
                    ..Default::default()
                };
                match disk_capacity(std::path::Path::new(&disk.path)) {
                    Ok((max, avail)) => {
                        st.storage_maximum = ByteSize(max);
                        st.storage_available = ByteSize(avail);
                        set_condition(
                            &mut st.conditions,
                            condition::READY,
                            ConditionStatus::True,
                            "",
                            "",
                        );
                    }
                    Err(e) => {
                        all_ok = false;
                        tracing::warn!(node = %self.cfg.node, disk = %name, "disk unusable: {e}");
                        set_condition(
                            &mut st.conditions,
                            condition::READY,
                            ConditionStatus::False,
                            "StatvfsFailed",
                            &e.to_string(),
                        );
                    }
                }
                disk_status.insert(name.clone(), st);
            }
            // Keep the previous disk conditions' transition times.
            for (name, st) in &mut disk_status {
                if let Some(old) = node.status.disk_status.get(name) {
                    for c in &mut st.conditions {
                        if let Some(o) = old.conditions.iter().find(|o| o.type_ == c.type_)
                            && o.status == c.status
                        {
                            c.last_transition_time = o.last_transition_time.clone();
                        }
                    }
                }
            }
            node.status.disk_status = disk_status;
            set_condition(
                &mut node.status.conditions,
                condition::READY,
                ConditionStatus::True,
                "Heartbeat",
                "",
            );
            let schedulable = all_ok && node.spec.allow_scheduling;
            set_condition(
                &mut node.status.conditions,
                condition::SCHEDULABLE,
                if schedulable {
                    ConditionStatus::True
                } else {
                    ConditionStatus::False
                },
                "",
                "",
            );
            node.status.last_heartbeat = Some(zebu_types::time::now_rfc3339());
            node.status.observed_generation = node.metadata.generation;
            match self.store.update_status_as(&node).await {
                Err(StoreError::Conflict { .. }) => continue,
                Err(StoreError::NotFound { .. }) => return Ok(()),
                other => {
                    other.map_err(|e| self.err(e))?;
                    return Ok(());
                }
            }
        }
        tracing::warn!(node = %self.cfg.node, "heartbeat lost to repeated conflicts");
        Ok(())
    }

    /// Register, then heartbeat and run the node's processes until `stop`
    /// turns true; then stop the processes (engines first).
    ///
    /// Heartbeats have a loop of their own beside the reconcile loop: a pass
    /// that waits (stopping a process that ignores SIGTERM takes the grace
    /// period) must not make the node look down to the Node controller.
    pub async fn run(self, stop: watch::Receiver<bool>) -> Result<(), AgentError> {
        self.register().await?;
        tracing::info!(node = %self.cfg.node, address = %self.cfg.address, "node agent started");
        let stopped = |mut rx: watch::Receiver<bool>, every: Duration| async move {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = rx.changed() => {}
            }
            *rx.borrow()
        };
        let heartbeats = async {
            loop {
                if let Err(e) = self.heartbeat().await {
                    tracing::warn!("heartbeat failed: {e}");
                }
                if stopped(stop.clone(), self.cfg.heartbeat).await {
                    break;
                }
            }
        };
        let processes = async {
            let mut changes = Changes::watch(self.store.clone(), &WATCHED);
            loop {
                if let Err(e) = self.instances.reconcile().await {
                    tracing::warn!("{e}");
                }
                let mut rx = stop.clone();
                tokio::select! {
                    _ = changes.wait(RECONCILE_EVERY) => {}
                    _ = rx.changed() => {}
                }
                if *rx.borrow() {
                    break;
                }
            }
        };
        tokio::join!(heartbeats, processes);
        self.instances.stop_all().await;
        tracing::info!(node = %self.cfg.node, "node agent stopped");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zebu_store::EmbeddedStore;

    #[tokio::test]
    async fn agent_registers_and_reports_real_disk_capacity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
        let disk = dir.path().join("node-1/disk-0");
        let cfg = AgentConfig {
            node: "node-1".into(),
            address: "127.0.0.10".into(),
            disks: BTreeMap::from([("disk-0".to_string(), disk.clone())]),
            heartbeat: Duration::from_millis(50),
            log_dir: dir.path().join("node-1/logs"),
            instance_manager: None,
            replica_tls: None,
        };
        let agent = NodeAgent::new(store.clone(), cfg);
        agent.register().await.expect("register");
        agent.heartbeat().await.expect("heartbeat");
        let node: Node = store.get_as("node-1").await.expect("get").expect("node");
        assert!(disk.is_dir());
        assert!(node.is_ready());
        assert_eq!(node.spec.address, "127.0.0.10");
        let st = &node.status.disk_status["disk-0"];
        let (max, _) = disk_capacity(&disk).expect("statvfs");
        assert_eq!(st.storage_maximum.bytes(), max);
        assert!(st.storage_available.bytes() > 0 && st.storage_available <= st.storage_maximum);
        // An operator's change to the spec survives a restart's register.
        let mut n = node.clone();
        n.spec.tags = vec!["ssd".into()];
        store.update_as(&n).await.expect("tag");
        agent.register().await.expect("register again");
        let node: Node = store.get_as("node-1").await.expect("get").expect("node");
        assert_eq!(node.spec.tags, ["ssd"]);
    }
}
