//! Whether each node's manager is there: [`Presence`], from one of two sources.
//!
//! - **Heartbeats** (the embedded store, one host): each node agent writes `lastHeartbeat`
//!   into its Node every 2 s and the node controller turns a silence longer than
//!   `node-down-after` into `Ready=False`. Presence is read from that condition.
//! - **Leases** (a cluster): each manager renews a `coordination.k8s.io/v1` Lease
//!   `zebu-node-<name>`; a Lease not renewed for its duration means that node's manager is
//!   gone. The manager process observes the Leases and hands the controllers a
//!   [`PresenceMap`] with every pass; the node controller then writes `Ready` to match, for
//!   people and for the scheduler.
//!
//! Presence is about the *manager*. A node whose manager is gone may still run engines and
//! replicas (they are supervised apart from it, see `zebu-agent`), so nothing here says its
//! data plane is down: the volume controller asks the engine itself before it gives up on a
//! replica there.

use std::collections::BTreeMap;
use std::time::SystemTime;

use zebu_types::resources::{Node, condition};
use zebu_types::time;

/// One node's manager, as this pass sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Its manager is alive (fresh heartbeats, or a renewed Lease).
    Up,
    /// Its manager is gone, since `since` when that is known.
    Down { since: Option<SystemTime> },
}

impl Presence {
    pub fn is_up(self) -> bool {
        self == Presence::Up
    }
}

/// Node name -> presence. A node missing from the map is down since an unknown time.
pub type PresenceMap = BTreeMap<String, Presence>;

/// Where the presence of a pass came from, which decides who writes `Ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PresenceSource {
    /// The nodes' `Ready` conditions, kept by heartbeats and the node controller.
    Heartbeats,
    /// Node Leases, observed by the manager; `Ready` follows them.
    Leases,
}

/// Presence as the nodes' `Ready` conditions say (heartbeats).
pub fn from_conditions(nodes: &[Node]) -> PresenceMap {
    nodes
        .iter()
        .map(|n| {
            let p = if n.is_ready() {
                Presence::Up
            } else {
                let since = n
                    .status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == condition::READY)
                    .and_then(|c| c.last_transition_time.as_deref())
                    .and_then(time::parse_rfc3339);
                Presence::Down { since }
            };
            (n.metadata.name.clone(), p)
        })
        .collect()
}
