//! [`World`]: everything one controller pass decides from, read once.
//!
//! A pass never reads the store while deciding: it loads a world ([`World::load`], from any
//! [`Store`] backend), runs the pure `decide` functions over it, and applies their actions.
//! Tests build a world directly from objects ([`World::from_objects`]) — or write the same
//! objects into a real store and load it — and check the actions.
//!
//! Whether a node is up is its [`Presence`]: by default what its `Ready` condition says
//! (heartbeats, one host); in a cluster, what its Lease says, given with
//! [`World::with_presence`]. Every decision asks [`World::node_ready`] and
//! [`World::node_down_for`], never the condition directly, and the scheduler sees the nodes
//! with `Ready` as presence says ([`World::nodes_as_present`]).

use std::time::{Duration, SystemTime};

use zebu_types::resources::{
    ConditionStatus, Engine, Node, Replica, Setting, Volume, condition, set_condition_at,
};
use zebu_types::settings::{SettingError, Settings};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Store, time};

use crate::presence::{self, Presence, PresenceMap, PresenceSource};

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
    /// Whether each node's manager is there.
    pub presence: PresenceMap,
    pub presence_source: PresenceSource,
    /// With Leases: whether this manager has observed the node Leases for a whole Lease
    /// duration, so that a node it has seen neither as a Lease nor as a Node is known not to
    /// exist (every live manager renewed its Lease within that time, and Leases are never
    /// deleted by Zebu). Before that, such a node may just be one its caches lag behind.
    /// Always true with heartbeats, where presence comes from the Nodes themselves.
    pub leases_settled: bool,
}

impl World {
    /// Read every kind the controllers look at from `store`.
    pub async fn load(store: &dyn Store, now: SystemTime) -> Result<World, WorldError> {
        let settings = Settings::from_objects(&store.list_as::<Setting>().await?)?;
        let nodes: Vec<Node> = store.list_as().await?;
        Ok(World {
            now,
            volumes: store.list_as().await?,
            presence: presence::from_conditions(&nodes),
            presence_source: PresenceSource::Heartbeats,
            leases_settled: true,
            nodes,
            replicas: store.list_as().await?,
            engines: store.list_as().await?,
            settings,
        })
    }

    /// The same world with presence from Leases instead of the nodes' conditions.
    pub fn with_presence(mut self, presence: PresenceMap) -> World {
        self.presence = presence;
        self.presence_source = PresenceSource::Leases;
        self.leases_settled = false;
        self
    }

    /// The same world, saying whether its Lease presence is settled
    /// ([`World::leases_settled`]).
    pub fn with_leases_settled(mut self, settled: bool) -> World {
        self.leases_settled = settled;
        self
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
            presence: presence::from_conditions(&nodes),
            presence_source: PresenceSource::Heartbeats,
            leases_settled: true,
            nodes,
            replicas,
            engines,
            settings: Settings::from_objects(settings)?,
        })
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.metadata.name == name)
    }

    /// Whether `name` is a node whose manager is there.
    pub fn node_ready(&self, name: &str) -> bool {
        self.node(name).is_some() && self.presence_of(name).is_up()
    }

    pub fn presence_of(&self, name: &str) -> Presence {
        self.presence
            .get(name)
            .copied()
            .unwrap_or(Presence::Down { since: None })
    }

    /// The nodes whose managers are there, by name.
    pub fn live_nodes(&self) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .map(|n| n.metadata.name.as_str())
            .filter(|n| self.presence_of(n).is_up())
    }

    /// The nodes with `Ready` as presence says, for the scheduler: with Leases, a node whose
    /// Lease expired takes no replica even before the node controller has written that.
    pub fn nodes_as_present(&self) -> Vec<Node> {
        let now = self.now_rfc3339();
        self.nodes
            .iter()
            .map(|n| {
                let mut n = n.clone();
                let up = self.presence_of(&n.metadata.name).is_up();
                if up != n.is_ready() {
                    let status = if up {
                        ConditionStatus::True
                    } else {
                        ConditionStatus::False
                    };
                    set_condition_at(
                        &mut n.status.conditions,
                        condition::READY,
                        status,
                        "",
                        "",
                        &now,
                    );
                }
                n
            })
            .collect()
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

    /// Whether this pass knows `name`'s manager to be gone: its presence says so, or it has
    /// no presence and no Node at all (a node that no longer exists). With Leases, a node
    /// whose Node is read but whose Lease is not (yet) is not known to be gone: it may have
    /// started after this manager last read the Leases. Nor is one seen as neither, until
    /// the Leases are settled ([`World::leases_settled`]): each kind's cache lags the server
    /// on its own, so not seeing a node is no evidence that it is gone.
    pub fn manager_gone(&self, name: &str) -> bool {
        match self.presence.get(name) {
            Some(p) => !p.is_up(),
            None => self.node(name).is_none() && self.leases_settled,
        }
    }

    /// How long a node has been down; `None` while it is up or when this pass cannot say
    /// since when. With heartbeats, a node that does not exist is down for ever
    /// (`Some(MAX)`). With Leases only a Lease seen to run out counts: a node whose Lease or
    /// Node this manager has not read yet may just have started (each kind's cache lags the
    /// server on its own), and a replica superseded on such evidence would be rebuilt for
    /// nothing.
    pub fn node_down_for(&self, name: &str) -> Option<Duration> {
        if self.presence_source == PresenceSource::Heartbeats && self.node(name).is_none() {
            return Some(Duration::MAX);
        }
        match self.presence.get(name).copied() {
            None | Some(Presence::Up | Presence::Down { since: None }) => None,
            Some(Presence::Down { since: Some(t) }) => self.now.duration_since(t).ok(),
        }
    }

    /// `now` as the store writes times.
    pub fn now_rfc3339(&self) -> String {
        time::format_rfc3339(self.now)
    }
}
