//! Controllers: level-triggered loops that read the store and write it
//! towards what `spec` asks for.
//!
//! - [`volume`]: the Volume controller. It owns Replica and Engine
//!   *objects* (schedules and creates replicas, creates and deletes the
//!   engine on attach and detach, deletes everything behind a finalizer on
//!   delete, heals and replaces replicas, salvages) and the volume's status.
//! - [`node`]: marks a Node not Ready when its heartbeats stop.
//!
//! Node agents ([`crate::instances`]) turn the objects into processes.
//!
//! Every decision is written to the store before anyone acts on it (the
//! controller creates a Replica object; the agent starts its process), and
//! every pass recomputes from the store alone. So a manager killed between
//! any two steps re-reads the same state after restart and carries on: a
//! Replica object created just before a crash is counted and not created
//! again; an engine object already there is not created twice.
//!
//! [`run`] wakes on every store change (so a replica dying shows in the
//! volume's robustness at once) and at least every second (for timeouts).

pub mod node;
pub mod volume;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use crate::resources::Kind;
use crate::store::Store;

const PERIOD: Duration = Duration::from_secs(1);

/// Run the controllers until `stop` turns true.
pub async fn run<S: Store>(store: Arc<S>, mut stop: watch::Receiver<bool>) {
    let mut volumes = volume::VolumeController::new(store.clone());
    let nodes = node::NodeController::new(store.clone());
    let mut events = None;
    loop {
        if events.is_none() {
            // Start watching from "now"; a pass follows, so nothing is missed.
            events = match store.list(Kind::Volume).await {
                Ok((_, rv)) => store.watch(None, rv).await.ok(),
                Err(_) => None,
            };
        }
        if let Err(e) = nodes.pass().await {
            tracing::warn!("{e}");
        }
        if let Err(e) = volumes.pass().await {
            tracing::warn!("volume controller: {e}");
        }
        let changed = async {
            match events.as_mut() {
                Some(ev) => matches!(ev.next().await, Some(Ok(_))),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ok = changed => {
                if !ok {
                    events = None; // expired or ended: watch again
                }
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
}
