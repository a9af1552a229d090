//! `zebu-controllers`: level-triggered loops that read the store and write it towards what
//! `spec` asks for, one per kind.
//!
//! Each controller is a **pure** `decide(&World, &Object) -> Vec<Action>` plus a thin
//! `apply`: [`volume`] (replicas, engine, attach, detach, heal, replacement, salvage, delete,
//! status), [`node`] (heartbeats lost), [`gc`] (engines and replicas of volumes that are
//! gone). A pass loads a [`World`] from the store once, decides every object from it, and
//! applies the actions; the decisions are unit-tested without processes or a store
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

pub mod cases;
pub mod gc;
pub mod node;
pub mod volume;
mod world;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, watch};
use zebu_types::store::KindWatcher;
use zebu_types::{Kind, Store};

pub use volume::VolumeApplier;
pub use world::{World, WorldError};

const PERIOD: Duration = Duration::from_secs(1);

/// The controllers of one manager, with what they remember between passes.
pub struct Controllers {
    store: Arc<dyn Store>,
    volumes: VolumeApplier,
}

impl Controllers {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Controllers {
            volumes: VolumeApplier::new(store.clone()),
            store,
        }
    }

    /// One pass over every object of every kind.
    pub async fn pass(&mut self) -> Result<(), WorldError> {
        let w = World::load(self.store.as_ref(), SystemTime::now()).await?;
        for n in &w.nodes {
            if let Err(e) = node::apply(&self.store, &w, n, node::decide(&w, n)).await {
                tracing::warn!(node = %n.metadata.name, "node controller: {e}");
            }
        }
        for v in &w.volumes {
            let actions = volume::decide(&w, v);
            if let Err(e) = self.volumes.apply(&w, v, actions).await {
                tracing::warn!("volume controller: {e}");
            }
        }
        let orphans = w
            .engines
            .iter()
            .flat_map(|e| gc::decide_engine(&w, e))
            .chain(w.replicas.iter().flat_map(|r| gc::decide_replica(&w, r)))
            .collect();
        if let Err(e) = gc::apply(&self.store, orphans).await {
            tracing::warn!("orphan collection: {e}");
        }
        Ok(())
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

/// Run the controllers until `stop` turns true.
pub async fn run(store: Arc<dyn Store>, mut stop: watch::Receiver<bool>) {
    let changed = Arc::new(Notify::new());
    let watchers: Vec<_> = WATCHED
        .into_iter()
        .map(|kind| {
            let store = store.clone();
            let changed = changed.clone();
            tokio::spawn(async move {
                let mut w = KindWatcher::new(store, kind);
                loop {
                    match w.next().await {
                        Ok(_) => changed.notify_one(),
                        Err(e) => {
                            tracing::warn!(%kind, "watch: {e}");
                            tokio::time::sleep(PERIOD).await;
                        }
                    }
                }
            })
        })
        .collect();
    let mut controllers = Controllers::new(store);
    loop {
        if let Err(e) = controllers.pass().await {
            tracing::warn!("controllers: {e}");
        }
        tokio::select! {
            _ = changed.notified() => {
                // Let a burst of writes land before the next pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ = tokio::time::sleep(PERIOD) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            break;
        }
    }
    for w in watchers {
        w.abort();
    }
}
