//! `zebu-controllers`: level-triggered loops that read the store and write it towards what
//! `spec` asks for, one per kind.
//!
//! Each controller is a **pure** `decide(&World, &Object) -> Vec<Action>` plus a thin
//! `apply`: [`volume`] (replicas, engine, attach, detach, heal, replacement, salvage, delete,
//! status), [`node`] (heartbeats lost), [`gc`] (engines and replicas of volumes that are
//! gone), [`scrub`] (the scrub schedule, and finished scrubs recorded in their volumes). A
//! pass loads a [`World`] from the store once, decides every object from it, and applies the
//! actions; the decisions are unit-tested without processes or a store
//! ([`cases`] holds table tests that run the same against a world built directly and one
//! loaded from any store backend). Node agents (`zebu-agent`) turn Replica and Engine
//! objects into processes.
//!
//! Every decision is written to the store before anyone acts on it, and every pass decides
//! from the store alone, so a manager killed between any two steps carries on after a
//! restart: a Replica object created just before a crash is counted and not created again.
//!
//! [`run`] wakes on every change of the kinds it reads (one resumable watch per kind) and at
//! least every second (for timeouts).
//!
//! **One manager or many.** On one host a single manager runs every controller
//! ([`Role::Sole`]). In a cluster every node's manager runs them ([`Role::Member`]) and the
//! work is shared out: each volume is reconciled by exactly one manager, its owner
//! ([`ownership`]); the node controller and orphan collection are cluster singletons, run
//! by the manager that holds the cluster Lease. What a member knows of the cluster's
//! managers (presence from node Leases, whether it may act, whether it leads) comes from the
//! manager process through [`Membership`].

pub mod backup;
pub mod backup_jobs;
pub mod cases;
pub mod changes;
pub mod engine_status;
pub mod gc;
pub mod node;
pub mod ownership;
pub mod presence;
pub mod recurring;
pub mod scrub;
pub mod standby;
pub mod volume;
mod world;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use zebu_types::resources::Volume;
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Kind, Store};

pub use ownership::{OwnerAction, Role};
pub use presence::{Presence, PresenceMap, PresenceSource};
pub use volume::VolumeApplier;
pub use world::{World, WorldError};

const PERIOD: Duration = Duration::from_secs(1);

/// What a cluster member's controllers learn from the manager's Leases, asked at the start of
/// every pass.
pub trait Membership: Send + Sync {
    /// Whether this manager may act: it renewed its own node Lease within the renew
    /// deadline. A manager that may not act decides nothing, so that by the time others see
    /// its Lease expire it has stopped.
    fn may_act(&self) -> bool;
    /// Every node's presence, from the Leases as this manager last observed them.
    fn presence(&self) -> PresenceMap;
    /// Whether this manager runs the cluster singletons now (it holds the cluster Lease,
    /// and renewed it within the renew deadline).
    fn leads(&self) -> bool;
    /// Whether this manager has observed the node Leases for a whole Lease duration, so
    /// that a node missing from both its Leases and its Nodes is known not to exist
    /// ([`World::leases_settled`]). No by default: absence alone is no evidence.
    fn leases_settled(&self) -> bool {
        false
    }
}

/// The controllers of one manager, with what they remember between passes.
pub struct Controllers {
    store: Arc<dyn Store>,
    volumes: VolumeApplier,
    role: Role,
    membership: Option<Arc<dyn Membership>>,
    /// Whether the last pass was skipped for want of the own Lease (logged on change).
    fenced: bool,
    scrubs: scrub::ScrubScheduler,
}

impl Controllers {
    /// The only manager ([`Role::Sole`]): presence from heartbeats, every volume its own.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Controllers {
            volumes: VolumeApplier::new(store.clone()),
            scrubs: scrub::ScrubScheduler::new(store.clone()),
            store,
            role: Role::Sole,
            membership: None,
            fenced: false,
        }
    }

    /// The manager of `node` in a cluster ([`Role::Member`]).
    pub fn member(store: Arc<dyn Store>, node: String, membership: Arc<dyn Membership>) -> Self {
        Controllers {
            volumes: VolumeApplier::new(store.clone()),
            scrubs: scrub::ScrubScheduler::new(store.clone()),
            store,
            role: Role::Member { node },
            membership: Some(membership),
            fenced: false,
        }
    }

    /// One pass over every object of every kind (those this manager is responsible for).
    pub async fn pass(&mut self) -> Result<(), WorldError> {
        let mut leads = true;
        if let Some(m) = &self.membership {
            let fenced = !m.may_act();
            if fenced != self.fenced {
                if fenced {
                    tracing::warn!(
                        "own node Lease not renewed within the renew deadline: controllers stop acting until it is"
                    );
                } else {
                    tracing::info!("own node Lease renewed: controllers act again");
                }
                self.fenced = fenced;
            }
            if fenced {
                return Ok(());
            }
            leads = m.leads();
        }
        let mut w = World::load(self.store.as_ref(), SystemTime::now()).await?;
        if let Some(m) = &self.membership {
            w = w
                .with_presence(m.presence())
                .with_leases_settled(m.leases_settled());
        }
        if leads {
            for n in &w.nodes {
                if let Err(e) = node::apply(&self.store, &w, n, node::decide(&w, n)).await {
                    tracing::warn!(node = %n.metadata.name, "node controller: {e}");
                }
            }
        }
        let mut driven = Vec::new();
        for v in &w.volumes {
            let Some(v) = self.take(&w, v).await else {
                continue;
            };
            driven.push(v.clone());
            let actions = volume::decide(&w, &v);
            if let Err(e) = self.volumes.apply(&w, &v, actions).await {
                tracing::warn!("volume controller: {e}");
            }
        }
        self.scrubs.pass(&w, &driven);
        if leads {
            let orphans = w
                .engines
                .iter()
                .flat_map(|e| gc::decide_engine(&w, e))
                .chain(w.replicas.iter().flat_map(|r| gc::decide_replica(&w, r)))
                .collect();
            if let Err(e) = gc::apply(&self.store, orphans).await {
                tracing::warn!("orphan collection: {e}");
            }
        }
        Ok(())
    }

    /// The volume as this manager should drive it this pass, after any ownership write;
    /// `None` when it is not this manager's to drive (see [`ownership`]).
    async fn take(&self, w: &World, v: &Volume) -> Option<Volume> {
        let Role::Member { node: me } = &self.role else {
            return Some(v.clone());
        };
        let name = &v.metadata.name;
        let to = match ownership::decide(w, v, me) {
            OwnerAction::Drive => return Some(v.clone()),
            OwnerAction::Leave { .. } => return None,
            OwnerAction::Claim { .. } => me.clone(),
            OwnerAction::HandOff { to } => to,
        };
        let from = v.status.owner_id.as_deref().unwrap_or("none");
        let mut next = v.clone();
        next.status.owner_id = Some(to.clone());
        match self.store.update_status_as(&next).await {
            Ok(written) => {
                tracing::info!(volume = %name, "owner {from} -> {to} (decided by {me})");
                (to == *me).then_some(written)
            }
            // Someone else wrote first: decide again from what they wrote, next pass.
            Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(volume = %name, "ownership {from} -> {to}: {e}");
                None
            }
        }
    }
}

/// The kinds a pass reads: a change to any of them wakes the controllers.
const WATCHED: [Kind; 5] = [
    Kind::Volume,
    Kind::Replica,
    Kind::Engine,
    Kind::Node,
    Kind::Setting,
];

/// Run the controllers of the only manager until `stop` turns true.
pub async fn run(store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
    run_controllers(Controllers::new(store), stop).await;
}

/// Run `controllers` until `stop` turns true: a pass on every change of a kind they read,
/// and at least every second.
pub async fn run_controllers(mut controllers: Controllers, mut stop: watch::Receiver<bool>) {
    let kinds = WATCHED.map(|k| (k, changes::Wake::Any));
    let mut changes = changes::Changes::watch(controllers.store.clone(), &kinds);
    loop {
        if let Err(e) = controllers.pass().await {
            tracing::warn!("controllers: {e}");
        }
        tokio::select! {
            _ = changes.wait(PERIOD) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            break;
        }
    }
}
