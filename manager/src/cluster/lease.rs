//! `coordination.k8s.io/v1` Leases: each node's presence, and the cluster singletons' holder.
//!
//! Two kinds of Lease, both in the namespace of the cluster's Zebu objects (`zebu-system`
//! unless `zebu manager --namespace` says otherwise: two Zebu clusters in two namespaces of
//! one Kubernetes cluster, as the tests run them, never see each other's Leases):
//!
//! - **Node Leases** `zebu-node-<name>`, held for good by that node's manager and renewed
//!   every [`RENEW_INTERVAL`]. Another manager takes a node as down once the Lease has not
//!   changed for its `leaseDurationSeconds` ([`LEASE_DURATION`]).
//! - **The cluster Lease** [`CLUSTER_LEASE`], held by one manager at a time: the one that
//!   runs the cluster singletons (the node controller, orphan collection, later backup GC and
//!   recurring jobs). Any manager takes it over once its holder stopped renewing it.
//!
//! **Time.** Expiry is measured on the observer's own monotonic clock, from the moment it
//! saw the Lease change last (its resourceVersion), never by comparing `renewTime` (written
//! with the holder's clock) with the observer's: two machines' clocks may disagree by more
//! than a Lease lasts. The price: a manager that starts takes every Lease as fresh for one
//! duration, so it notices a node that died before it started one duration late.
//!
//! **Self-fencing.** A manager acts only while its own last successful renew *began* less
//! than [`RENEW_DEADLINE`] ago. Every observer starts counting a Lease's duration no
//! earlier than the renew was written, so a manager that lost contact with the API server
//! stops acting at least `LEASE_DURATION - RENEW_DEADLINE` (5 s) before anyone else may
//! take over what it did: room for a pass already under way to finish its writes.
//!
//! **Durations** (the ones client-go's leader election uses): 15 s duration, renewed every
//! 2 s, so a Lease survives six missed renews in a row (an API server restart, a slow etcd)
//! before its node counts as down; a 10 s renew deadline for the holder. A shorter duration
//! would move volumes on every hiccup of the API server; a longer one only delays the
//! takeover of a dead manager's *control* work: its engines keep serving I/O meanwhile
//! (they run apart from the manager), so 15 s costs no I/O.
//!
//! What to do with a Lease is decided by [`decide`], a pure function table-tested below;
//! [`LeaseClient`] does the reads and writes, each with the resourceVersion it read, so two
//! managers taking over one Lease at once cannot both win.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, ListParams, PostParams};

/// The namespace of every Zebu Lease by default.
pub const NAMESPACE: &str = "zebu-system";
/// The Lease of the cluster singletons.
pub const CLUSTER_LEASE: &str = "zebu-cluster";
/// The prefix of node Lease names.
pub const NODE_LEASE_PREFIX: &str = "zebu-node-";

/// How long a Lease lasts without a renew (`leaseDurationSeconds`).
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often a holder renews.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(2);
/// How long after its last successful renew began a holder stops acting on its Lease.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);

/// The Lease of node `node`.
pub fn node_lease_name(node: &str) -> String {
    format!("{NODE_LEASE_PREFIX}{node}")
}

/// A Lease as one observer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `spec.holderIdentity`; `None` when empty (released).
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Duration,
    /// When this observer first saw the Lease at its current resourceVersion.
    pub unchanged_since: Instant,
}

impl Seen {
    /// Whether its holder's claim has run out, by this observer's clock.
    pub fn expired(&self, now: Instant) -> bool {
        self.holder.is_none()
            || now.saturating_duration_since(self.unchanged_since) >= self.duration
    }

    /// When it expired, by this observer's clock (`None` while it has not).
    pub fn expired_at(&self, now: Instant) -> Option<Instant> {
        if self.holder.is_none() {
            return Some(self.unchanged_since);
        }
        self.expired(now)
            .then(|| self.unchanged_since + self.duration)
    }
}

/// What an identity that wants a Lease does with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// There is none: create it, held by me.
    Create,
    /// I hold it: write a new `renewTime`.
    Renew,
    /// Its holder's claim ran out (or it was released): write me as holder.
    TakeOver { from: Option<String> },
    /// Another holder's claim runs: wait.
    Wait { holder: String },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Create => f.write_str("create"),
            Step::Renew => f.write_str("renew"),
            Step::TakeOver { from: None } => f.write_str("take over (released)"),
            Step::TakeOver { from: Some(h) } => write!(f, "take over from {h}"),
            Step::Wait { holder } => write!(f, "wait (held by {holder})"),
        }
    }
}

/// What `me` does with a Lease it wants, seen as `seen` (`None`: there is none) at `now`.
pub fn decide(me: &str, seen: Option<&Seen>, now: Instant) -> Step {
    let Some(s) = seen else {
        return Step::Create;
    };
    match s.holder.as_deref() {
        Some(h) if h == me => Step::Renew,
        Some(h) if !s.expired(now) => Step::Wait {
            holder: h.to_string(),
        },
        h => Step::TakeOver {
            from: h.map(str::to_string),
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another writer changed the Lease since it was read: read again.
    #[error("Lease {name}: changed by another writer since it was read")]
    Conflict { name: String },
    /// The API server refused or could not be reached; its message names the verb and the
    /// resource when RBAC refused.
    #[error("Lease {name}: {verb}: {source}")]
    Api {
        name: String,
        verb: &'static str,
        #[source]
        source: kube::Error,
    },
}

/// The Lease reads and writes of one manager, remembering when it saw each Lease change.
pub struct LeaseClient {
    api: Api<Lease>,
    namespace: String,
    /// Lease name -> (resourceVersion, first seen at it).
    versions: BTreeMap<String, (String, Instant)>,
}

/// One Lease as read: what [`decide`] needs, and the object to write back.
#[derive(Debug, Clone)]
pub struct Read {
    pub seen: Seen,
    pub lease: Lease,
}

fn api_err(name: &str, verb: &'static str, e: kube::Error) -> LeaseError {
    match &e {
        kube::Error::Api(s) if s.code == 409 => LeaseError::Conflict {
            name: name.to_string(),
        },
        _ => LeaseError::Api {
            name: name.to_string(),
            verb,
            source: e,
        },
    }
}

fn micro_now() -> Option<MicroTime> {
    k8s_openapi::jiff::Timestamp::try_from(SystemTime::now())
        .ok()
        .map(MicroTime)
}

impl LeaseClient {
    /// The Leases in [`NAMESPACE`].
    pub fn new(client: kube::Client) -> Self {
        Self::in_namespace(client, NAMESPACE)
    }

    /// The Leases in `namespace`.
    pub fn in_namespace(client: kube::Client, namespace: &str) -> Self {
        LeaseClient {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            versions: BTreeMap::new(),
        }
    }

    /// What this observer makes of `lease` now: a new resourceVersion restarts its clock.
    fn observe(&mut self, lease: Lease, now: Instant) -> Option<(String, Read)> {
        let name = lease.metadata.name.clone()?;
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        let since = match self.versions.get(&name) {
            Some((v, t)) if *v == rv => *t,
            _ => now,
        };
        self.versions.insert(name.clone(), (rv, since));
        let spec = lease.spec.clone().unwrap_or_default();
        let seen = Seen {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            duration: Duration::from_secs(
                u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
            ),
            unchanged_since: since,
        };
        Some((name, Read { seen, lease }))
    }

    /// Read one Lease (`None`: there is none).
    pub async fn get(&mut self, name: &str) -> Result<Option<Read>, LeaseError> {
        let got = self
            .api
            .get_opt(name)
            .await
            .map_err(|e| api_err(name, "get", e))?;
        let now = Instant::now();
        Ok(got.and_then(|l| self.observe(l, now)).map(|(_, r)| r))
    }

    /// Every Lease whose name starts with `prefix`, by name.
    pub async fn list(&mut self, prefix: &str) -> Result<BTreeMap<String, Read>, LeaseError> {
        let list = self
            .api
            .list(&ListParams::default())
            .await
            .map_err(|e| api_err(prefix, "list", e))?;
        let now = Instant::now();
        let out: BTreeMap<String, Read> = list
            .items
            .into_iter()
            .filter(|l| {
                l.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(prefix))
            })
            .filter_map(|l| self.observe(l, now))
            .collect();
        Ok(out)
    }

    /// Make `me` the holder of Lease `name` if [`decide`] says so; `Ok(true)` when `me`
    /// holds it after this call (it created, renewed or took it over).
    pub async fn acquire_or_renew(&mut self, name: &str, me: &str) -> Result<bool, LeaseError> {
        let read = self.get(name).await?;
        let step = decide(me, read.as_ref().map(|r| &r.seen), Instant::now());
        let duration = i32::try_from(LEASE_DURATION.as_secs()).unwrap_or(i32::MAX);
        match step {
            Step::Wait { .. } => Ok(false),
            Step::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.to_string()),
                        namespace: Some(self.namespace.clone()),
                        labels: Some(
                            [("app.kubernetes.io/part-of".to_string(), "zebu".to_string())].into(),
                        ),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(me.to_string()),
                        lease_duration_seconds: Some(duration),
                        acquire_time: micro_now(),
                        renew_time: micro_now(),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => {
                        tracing::info!(lease = name, "Lease created, held by {me}");
                        Ok(true)
                    }
                    // Someone created it meanwhile: it is theirs until it runs out.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(api_err(name, "create", e)),
                }
            }
            Step::Renew | Step::TakeOver { .. } => {
                let Some(read) = read else {
                    return Ok(false);
                };
                let mut lease = read.lease;
                let mut spec = lease.spec.take().unwrap_or_default();
                if let Step::TakeOver { from } = &step {
                    tracing::info!(
                        lease = name,
                        "taking the Lease over from {} (not renewed for {} s)",
                        from.as_deref().unwrap_or("nobody"),
                        LEASE_DURATION.as_secs()
                    );
                    spec.holder_identity = Some(me.to_string());
                    spec.acquire_time = micro_now();
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(duration);
                spec.renew_time = micro_now();
                lease.spec = Some(spec);
                // `replace` carries the resourceVersion read: a concurrent writer wins, we
                // read again next time.
                match self.api.replace(name, &PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(e) => match api_err(name, "update", e) {
                        LeaseError::Conflict { .. } => Ok(false),
                        e => Err(e),
                    },
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(holder: Option<&str>, age_secs: u64, now: Instant) -> Seen {
        Seen {
            holder: holder.map(str::to_string),
            duration: LEASE_DURATION,
            unchanged_since: now - Duration::from_secs(age_secs),
        }
    }

    #[test]
    fn lease_decisions() {
        let now = Instant::now() + Duration::from_secs(3600);
        let cases: &[(&str, Option<Seen>, &str)] = &[
            ("no Lease yet: create it", None, "create"),
            (
                "mine, fresh: renew",
                Some(seen(Some("node-1"), 1, now)),
                "renew",
            ),
            (
                "mine, even run out by my clock: renew (nobody else may have it yet)",
                Some(seen(Some("node-1"), 60, now)),
                "renew",
            ),
            (
                "another's, renewed lately: wait",
                Some(seen(Some("node-2"), 3, now)),
                "wait (held by node-2)",
            ),
            (
                "another's, one second short of the duration: wait",
                Some(seen(Some("node-2"), 14, now)),
                "wait (held by node-2)",
            ),
            (
                "another's, unchanged for the whole duration: take over",
                Some(seen(Some("node-2"), 15, now)),
                "take over from node-2",
            ),
            (
                "released (empty holder): take over at once",
                Some(seen(None, 0, now)),
                "take over (released)",
            ),
        ];
        for (name, s, want) in cases {
            let got = decide("node-1", s.as_ref(), now).to_string();
            assert_eq!(got, *want, "{name}");
        }
    }

    #[test]
    fn expiry_is_counted_from_the_last_change_seen() {
        let t0 = Instant::now();
        let s = Seen {
            holder: Some("node-2".into()),
            duration: LEASE_DURATION,
            unchanged_since: t0,
        };
        assert!(!s.expired(t0 + Duration::from_secs(14)));
        assert_eq!(s.expired_at(t0 + Duration::from_secs(14)), None);
        assert!(s.expired(t0 + Duration::from_secs(15)));
        assert_eq!(
            s.expired_at(t0 + Duration::from_secs(40)),
            Some(t0 + LEASE_DURATION)
        );
    }

    #[test]
    fn a_holder_stops_acting_before_anyone_may_take_over() {
        // The margin the module docs promise, so that a change of one constant cannot
        // silently remove it.
        const { assert!(RENEW_DEADLINE.as_secs() + 5 <= LEASE_DURATION.as_secs()) };
        const { assert!(RENEW_INTERVAL.as_secs() * 4 <= RENEW_DEADLINE.as_secs()) };
    }
}
