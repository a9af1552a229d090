//! This manager's part in the cluster: it keeps its node Lease, contends for the cluster
//! Lease, and observes every node Lease; the controllers ask it, at the start of each pass,
//! whether they may act, whether they lead, and who is up ([`Membership`]).
//!
//! Everything the controllers are told is derived from *when* the Leases were last
//! written or seen to change, so that a manager cut off from the API server learns it is
//! cut off by time alone: no answer ever arrives to tell it.

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tokio::sync::watch;
use zebu_controllers::{Membership, Presence, PresenceMap};

use super::lease::{
    self, CLUSTER_LEASE, LEASE_DURATION, LeaseClient, LeaseError, NODE_LEASE_PREFIX,
    RENEW_DEADLINE, RENEW_INTERVAL,
};

#[derive(Debug, Default)]
struct State {
    /// When the last successful renew of the own node Lease began.
    own: Option<Instant>,
    /// When the last successful renew of the cluster Lease began (`None`: not held).
    cluster: Option<Instant>,
    presence: PresenceMap,
    /// When this manager first listed the node Leases (see [`Membership::leases_settled`]).
    observing_since: Option<Instant>,
    /// The last error, logged when it changes.
    last_error: Option<String>,
}

/// What the Lease loop learnt, for the controllers.
pub struct LeaseMembership {
    node: String,
    /// The Lease of the cluster singletons ([`CLUSTER_LEASE`]; tests that share an API
    /// server use their own).
    cluster_lease: String,
    /// The namespace of the Leases.
    namespace: String,
    state: Mutex<State>,
}

impl LeaseMembership {
    pub fn new(node: String) -> Arc<Self> {
        Self::with_cluster_lease(node, CLUSTER_LEASE.to_string())
    }

    /// A member contending for the cluster singletons under `cluster_lease`.
    pub fn with_cluster_lease(node: String, cluster_lease: String) -> Arc<Self> {
        Self::in_namespace(node, lease::NAMESPACE, cluster_lease)
    }

    /// A member whose Leases live in `namespace` (that of the Zebu objects it manages).
    pub fn in_namespace(node: String, namespace: &str, cluster_lease: String) -> Arc<Self> {
        Arc::new(LeaseMembership {
            node,
            cluster_lease,
            namespace: namespace.to_string(),
            state: Mutex::new(State::default()),
        })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere while holding it; the state is
        // plain data, still meaningful.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fresh(t: Option<Instant>) -> bool {
        t.is_some_and(|t| t.elapsed() < RENEW_DEADLINE)
    }
}

impl Membership for LeaseMembership {
    fn may_act(&self) -> bool {
        Self::fresh(self.lock().own)
    }

    fn presence(&self) -> PresenceMap {
        let s = self.lock();
        let mut p = s.presence.clone();
        // Its own presence is what it knows first-hand, not what it last read.
        if Self::fresh(s.own) {
            p.insert(self.node.clone(), Presence::Up);
        }
        p
    }

    fn leads(&self) -> bool {
        let s = self.lock();
        Self::fresh(s.own) && Self::fresh(s.cluster)
    }

    /// A whole Lease duration since the first list of the node Leases, and the own Lease
    /// fresh (so the lists since are current): every manager that exists renewed its Lease
    /// meanwhile, and Zebu never deletes one, so a node not seen by then has no manager.
    fn leases_settled(&self) -> bool {
        let s = self.lock();
        Self::fresh(s.own)
            && s.observing_since
                .is_some_and(|t| t.elapsed() >= LEASE_DURATION)
    }
}

/// Presence from the node Leases as read at `now` (`wall` being the same moment on the
/// wall clock, to say since when a node is down).
fn presence_of(
    leases: &std::collections::BTreeMap<String, lease::Read>,
    now: Instant,
    wall: SystemTime,
) -> PresenceMap {
    leases
        .iter()
        .filter_map(|(name, r)| {
            let node = name.strip_prefix(NODE_LEASE_PREFIX)?.to_string();
            let p = match r.seen.expired_at(now) {
                None => Presence::Up,
                Some(at) => Presence::Down {
                    since: wall.checked_sub(now.saturating_duration_since(at)),
                },
            };
            Some((node, p))
        })
        .collect()
}

/// One round: renew the own Lease, then (only while that holds) contend for the cluster
/// Lease, then observe every node's.
async fn round(client: &mut LeaseClient, m: &LeaseMembership) -> Result<(), LeaseError> {
    let started = Instant::now();
    let own = lease::node_lease_name(&m.node);
    let held = client.acquire_or_renew(&own, &m.node).await?;
    m.lock().own = held.then_some(started);
    if !held {
        tracing::warn!(
            lease = own,
            "another holder has this node's Lease: is a second manager running as node {}?",
            m.node
        );
    }
    let leading = held && client.acquire_or_renew(&m.cluster_lease, &m.node).await?;
    {
        let mut s = m.lock();
        let was = s.cluster.is_some();
        s.cluster = leading.then_some(started);
        if was != leading {
            if leading {
                tracing::info!(
                    node = m.node,
                    "holds the cluster Lease: runs the cluster singletons"
                );
            } else {
                tracing::info!(node = m.node, "lost the cluster Lease");
            }
        }
    }
    let leases = client.list(NODE_LEASE_PREFIX).await?;
    let p = presence_of(&leases, Instant::now(), SystemTime::now());
    let mut s = m.lock();
    s.presence = p;
    s.observing_since.get_or_insert(started);
    Ok(())
}

/// Keep this manager's Leases until `stop` turns true. Errors (an API server away, a right
/// missing) are logged when they change, and the loop goes on: a manager that cannot renew
/// stops acting by itself ([`Membership::may_act`]), and starts again once it can.
pub async fn run_leases(
    client: kube::Client,
    membership: Arc<LeaseMembership>,
    mut stop: watch::Receiver<bool>,
) {
    let mut leases = LeaseClient::in_namespace(client, &membership.namespace);
    loop {
        let result = tokio::time::timeout(RENEW_DEADLINE, round(&mut leases, &membership)).await;
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "Lease round took longer than {} s",
                RENEW_DEADLINE.as_secs()
            )),
        };
        {
            let mut s = membership.lock();
            if error != s.last_error {
                match &error {
                    Some(e) => tracing::error!(node = membership.node, "Leases: {e}"),
                    None => tracing::info!(node = membership.node, "Leases: renewing again"),
                }
                s.last_error = error;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RENEW_INTERVAL) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            return;
        }
    }
}
