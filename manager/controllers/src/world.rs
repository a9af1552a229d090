//! [`World`]: everything one controller pass decides from, read once.
//!
//! A pass never reads the store while deciding: it loads a world ([`World::load`], from any
//! [`Store`] backend), runs the pure `decide` functions over it, and applies their actions.
//! Tests build a world directly from objects ([`World::from_objects`]) — or write the same
//! objects into a real store and load it — and check the actions.

use std::time::{Duration, SystemTime};

use zebu_types::resources::{Engine, Node, Replica, Setting, Volume, condition};
use zebu_types::settings::{SettingError, Settings};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Store, time};

#[derive(Debug, thiserror::Error)]
pub enum WorldError {
    #[error("reading the cluster: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Settings(#[from] SettingError),
}

/// The cluster as one pass sees it; every list sorted by name.
#[derive(Debug, Clone)]
pub struct World {
    /// The time the pass decides at (timeouts are measured against it).
    pub now: SystemTime,
    pub volumes: Vec<Volume>,
    pub nodes: Vec<Node>,
    pub replicas: Vec<Replica>,
    pub engines: Vec<Engine>,
    pub settings: Settings,
}

impl World {
    /// Read every kind the controllers look at from `store`.
    pub async fn load(store: &dyn Store, now: SystemTime) -> Result<World, WorldError> {
        let settings = Settings::from_objects(&store.list_as::<Setting>().await?)?;
        Ok(World {
            now,
            volumes: store.list_as().await?,
            nodes: store.list_as().await?,
            replicas: store.list_as().await?,
            engines: store.list_as().await?,
            settings,
        })
    }

    /// A world from objects as a test writes them: sorted by name, as a store lists them,
    /// and at generation 1 when they have none, as a store creates them.
    pub fn from_objects(
        now: SystemTime,
        mut volumes: Vec<Volume>,
        mut nodes: Vec<Node>,
        mut replicas: Vec<Replica>,
        mut engines: Vec<Engine>,
        settings: &[Setting],
    ) -> Result<World, WorldError> {
        volumes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        replicas.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        engines.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        for m in volumes
            .iter_mut()
            .map(|o| &mut o.metadata)
            .chain(nodes.iter_mut().map(|o| &mut o.metadata))
            .chain(replicas.iter_mut().map(|o| &mut o.metadata))
            .chain(engines.iter_mut().map(|o| &mut o.metadata))
        {
            m.generation = m.generation.max(1);
        }
        Ok(World {
            now,
            volumes,
            nodes,
            replicas,
            engines,
            settings: Settings::from_objects(settings)?,
        })
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.metadata.name == name)
    }

    pub fn node_ready(&self, name: &str) -> bool {
        self.node(name).is_some_and(Node::is_ready)
    }

    pub fn volume(&self, name: &str) -> Option<&Volume> {
        self.volumes.iter().find(|v| v.metadata.name == name)
    }

    pub fn replica(&self, name: &str) -> Option<&Replica> {
        self.replicas.iter().find(|r| r.metadata.name == name)
    }

    pub fn engine(&self, name: &str) -> Option<&Engine> {
        self.engines.iter().find(|e| e.metadata.name == name)
    }

    pub fn replicas_of<'a>(&'a self, volume: &'a str) -> impl Iterator<Item = &'a Replica> {
        self.replicas
            .iter()
            .filter(move |r| r.spec.volume == volume)
    }

    pub fn engines_of<'a>(&'a self, volume: &'a str) -> impl Iterator<Item = &'a Engine> {
        self.engines.iter().filter(move |e| e.spec.volume == volume)
    }

    /// How long a node has been not Ready; `Some(MAX)` when it does not exist, `None` while
    /// it is Ready (or when it cannot say since when).
    pub fn node_down_for(&self, name: &str) -> Option<Duration> {
        let Some(n) = self.node(name) else {
            return Some(Duration::MAX);
        };
        if n.is_ready() {
            return None;
        }
        let since = n
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .and_then(|c| c.last_transition_time.as_deref())
            .and_then(time::parse_rfc3339)?;
        self.now.duration_since(since).ok()
    }

    /// `now` as the store writes times.
    pub fn now_rfc3339(&self) -> String {
        time::format_rfc3339(self.now)
    }
}
