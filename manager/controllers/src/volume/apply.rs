//! The thin half of the volume controller: carry out [`Action`]s against the store and the
//! engine, in order. Every write carries the resourceVersion the decision was made on (the
//! volume's own is followed from write to write), so a change made meanwhile by someone else
//! stops the rest of the volume's actions with a conflict, and the next pass decides again.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zebu_ops::engine_rpc;
use zebu_types::names::{
    ENGINE_FINALIZER, NODE_LABEL, REPLICA_FINALIZER, REPLICAS_DIR, SUPERSEDED_AT_ANNOTATION,
    SUPERSEDED_LABEL, VOLUME_FINALIZER, VOLUME_LABEL, engine_name,
};
use zebu_types::resources::{
    Engine, Replica, ReplicaSpec, Resource, Volume, condition, condition_is_true,
};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Kind, Store};

use super::Action;
use crate::{World, engine_status};

/// How long to wait between two `ReplicaAdd`s of one address.
const HEAL_BACKOFF: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
#[error("volume {volume}: {source}")]
pub struct ApplyError {
    pub volume: String,
    #[source]
    pub source: StoreError,
}

/// Applies volume actions; remembers, across passes, when it last asked an engine to add
/// each replica address (the only state the controller keeps outside the store: a backoff).
pub struct VolumeApplier {
    store: Arc<dyn Store>,
    healed: HashMap<(String, String), Instant>,
}

fn replica_name(volume: &str) -> String {
    format!("{volume}-r-{:08x}", rand::random::<u32>())
}

/// What a write's failure means for the rest of the volume's actions.
enum Next {
    Go,
    Stop,
}

impl VolumeApplier {
    pub fn new(store: Arc<dyn Store>) -> Self {
        VolumeApplier {
            store,
            healed: HashMap::new(),
        }
    }

    /// Carry out `actions` for volume `v`, in order; see the module docs.
    pub async fn apply(
        &mut self,
        w: &World,
        v: &Volume,
        actions: Vec<Action>,
    ) -> Result<(), ApplyError> {
        let name = v.metadata.name.clone();
        let err = |source| ApplyError {
            volume: name.clone(),
            source,
        };
        let mut current = v.clone();
        for action in actions {
            tracing::debug!(volume = %name, "{action}");
            let next = match action {
                Action::SetStatus(status) => {
                    let salvaging = |s: &zebu_types::resources::VolumeStatus| {
                        condition_is_true(&s.conditions, condition::SALVAGING)
                    };
                    if salvaging(&status) && !salvaging(&current.status) {
                        tracing::warn!(volume = %name, "engine faulted with every replica process up: auto-salvage");
                    }
                    let prev = current.status.robustness;
                    if prev != status.robustness {
                        tracing::info!(volume = %name, "robustness {prev:?} -> {:?}", status.robustness);
                    }
                    let mut next = current.clone();
                    next.status = status;
                    match self.store.update_status_as(&next).await {
                        Ok(v) => {
                            current = v;
                            Next::Go
                        }
                        Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                            Next::Stop
                        }
                        Err(e) => return Err(err(e)),
                    }
                }
                Action::AddFinalizer | Action::RemoveFinalizer => {
                    let mut next = current.clone();
                    next.metadata.finalizers.retain(|f| f != VOLUME_FINALIZER);
                    if matches!(action, Action::AddFinalizer) {
                        next.metadata.finalizers.push(VOLUME_FINALIZER.into());
                    } else {
                        tracing::info!(volume = %name, "engine and replicas gone; removing the volume");
                        // Its secret goes with it (in Kubernetes the Secret's owner
                        // reference would take it too; deleting it here does no harm).
                        if let (Some(k), Some(id)) = (
                            self.store.secrets(),
                            zebu_types::secrets::VolumeIdentity::of(&current.metadata),
                        ) && let Err(e) = k.delete(&id.secret_name).await
                        {
                            tracing::warn!(volume = %name, "cannot delete the volume's secret: {e}");
                            return Err(err(e));
                        }
                    }
                    match self.store.update_as(&next).await {
                        Ok(v) => {
                            current = v;
                            Next::Go
                        }
                        Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                            Next::Stop
                        }
                        Err(e) => return Err(err(e)),
                    }
                }
                Action::CreateReplica {
                    node,
                    disk,
                    disk_path,
                    size,
                } => {
                    let rname = replica_name(&name);
                    let data_path = Path::new(&disk_path)
                        .join(REPLICAS_DIR)
                        .join(&rname)
                        .display()
                        .to_string();
                    let mut r = Replica::new(
                        rname.clone(),
                        ReplicaSpec {
                            volume: name.clone(),
                            node: node.clone(),
                            disk: disk.clone(),
                            data_path,
                            size,
                        },
                    );
                    own(&mut r, v, &node, REPLICA_FINALIZER);
                    self.store.create_as(&r).await.map_err(err)?;
                    tracing::info!(volume = %name, replica = %rname, node = %node, disk = %disk, "replica scheduled");
                    Next::Go
                }
                Action::MarkSuperseded { replica, at } => match w.replica(&replica) {
                    Some(r) => {
                        tracing::warn!(volume = %name, replica = %replica, node = %r.spec.node,
                            "node gone longer than staleReplicaTimeout ({} s): scheduling a replacement",
                            v.spec.stale_replica_timeout);
                        let mut marked = r.clone();
                        marked
                            .metadata
                            .labels
                            .insert(SUPERSEDED_LABEL.into(), "true".into());
                        marked
                            .metadata
                            .annotations
                            .insert(SUPERSEDED_AT_ANNOTATION.into(), at);
                        match self.store.update_as(&marked).await {
                            Ok(_) => Next::Go,
                            // Changed meanwhile: decide again on the next pass.
                            Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                                Next::Stop
                            }
                            Err(e) => return Err(err(e)),
                        }
                    }
                    None => Next::Stop,
                },
                Action::DeleteReplica { replica, force } => {
                    tracing::info!(volume = %name, replica = %replica, force, "deleting the replica");
                    self.delete::<Replica>(&replica, force).await.map_err(err)?
                }
                Action::ResizeReplica { replica, size } => match w.replica(&replica) {
                    Some(r) => {
                        tracing::info!(volume = %name, replica = %replica, size = %size, "replica follows the volume's size");
                        let mut next = r.clone();
                        next.spec.size = size;
                        match self.store.update_as(&next).await {
                            // Changed meanwhile: the next pass does it again.
                            Ok(_)
                            | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                                Next::Go
                            }
                            Err(e) => return Err(err(e)),
                        }
                    }
                    None => Next::Go,
                },
                Action::CreateEngine { spec } => {
                    let node = spec.node.clone();
                    let mut e = Engine::new(engine_name(&name), spec);
                    own(&mut e, v, &node, ENGINE_FINALIZER);
                    match self.store.create_as(&e).await {
                        Ok(_) => {
                            tracing::info!(volume = %name, node = %node, "engine created");
                            Next::Go
                        }
                        Err(StoreError::AlreadyExists { .. }) => Next::Stop,
                        Err(e) => return Err(err(e)),
                    }
                }
                Action::UpdateEngineSpec { engine, spec } => match w.engine(&engine) {
                    Some(e) => {
                        if spec.salvage && !e.spec.salvage {
                            tracing::warn!(volume = %name, "no replica can be shown current: auto-salvage");
                        }
                        let mut next = e.clone();
                        next.spec = spec;
                        match self.store.update_as(&next).await {
                            // The agent wrote its status meanwhile: the next pass does it again.
                            Ok(_)
                            | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                                Next::Go
                            }
                            Err(e) => return Err(err(e)),
                        }
                    }
                    None => Next::Go,
                },
                Action::DeleteEngine { engine, force } => {
                    tracing::info!(volume = %name, engine = %engine, force, "stopping the engine");
                    self.delete::<Engine>(&engine, force).await.map_err(err)?
                }
                Action::ReplicaAdd {
                    control,
                    replica,
                    address,
                    was,
                } => {
                    let key = (name.clone(), address.clone());
                    let recent = self
                        .healed
                        .get(&key)
                        .is_some_and(|t| t.elapsed() < HEAL_BACKOFF);
                    if !recent {
                        self.healed.insert(key, Instant::now());
                        let was = was.map_or("absent", |m| m.as_str());
                        match engine_rpc::replica_add(&control, &address).await {
                            Ok(_) => tracing::info!(volume = %name, replica = %replica, %address,
                                "replica {was} -> added back (engine catches it up)"),
                            Err(e) => tracing::info!(volume = %name, replica = %replica,
                                "ReplicaAdd not taken yet: {e}"),
                        }
                    }
                    Next::Go
                }
                Action::ObserveEngine { engine, control } => {
                    self.observe_engine(&name, &engine, &control)
                        .await
                        .map_err(err)?;
                    Next::Go
                }
                Action::ReplicaRemove { control, address } => {
                    match engine_rpc::replica_remove(&control, &address).await {
                        Ok(_) => tracing::info!(volume = %name, %address,
                            "removed a replica address no Replica owns"),
                        Err(e) => tracing::info!(volume = %name, %address, "ReplicaRemove: {e}"),
                    }
                    Next::Go
                }
            };
            if matches!(next, Next::Stop) {
                break;
            }
        }
        Ok(())
    }

    /// Ask an engine whose node has no manager how it is, and write that into its status
    /// (see [`crate::engine_status`]); its pid and endpoints stay as its agent wrote them.
    async fn observe_engine(
        &self,
        volume: &str,
        engine: &str,
        control: &str,
    ) -> Result<(), StoreError> {
        let info = engine_rpc::info(control).await;
        let rebuild = match &info {
            Ok(_) => engine_rpc::rebuild_status(control).await.ok(),
            Err(_) => None,
        };
        // Read after the engine answered; see `fold_info`.
        let replicas: Vec<Replica> = self.store.list_as().await?;
        for _ in 0..5 {
            let Some(mut e) = self.store.get_as::<Engine>(engine).await? else {
                return Ok(());
            };
            let before = e.status.volume_state;
            match &info {
                Ok(i) => engine_status::fold_info(&mut e.status, volume, i, &replicas),
                Err(why) => engine_status::fold_unreachable(&mut e.status, &why.to_string()),
            }
            if let Some(r) = rebuild
                .as_ref()
                .and_then(|r| engine_status::rebuild_progress(volume, r, &replicas))
            {
                e.status.rebuild = Some(r);
            }
            if e.status.volume_state != before {
                tracing::info!(
                    volume,
                    engine,
                    "engine observed by the volume's owner (its node has no manager): {before:?} -> {:?}",
                    e.status.volume_state
                );
            }
            match self.store.update_status_as(&e).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(()),
                // Its agent may be back and writing: read again.
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Delete an object (gone or already deleting is fine); with `force`, drop its
    /// finalizers too, for an object whose node agent is not there to do it.
    async fn delete<R: Resource>(&self, name: &str, force: bool) -> Result<Next, StoreError> {
        match self.store.delete(R::KIND, name).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        if !force {
            return Ok(Next::Go);
        }
        let Some(mut fresh) = self.store.get_as::<R>(name).await? else {
            return Ok(Next::Go);
        };
        fresh.metadata_mut().finalizers.clear();
        match self.store.update_as(&fresh).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(Next::Go),
            Err(StoreError::Conflict { .. }) => Ok(Next::Stop),
            Err(e) => Err(e),
        }
    }
}

/// Labels, owner and finalizer of an object the volume controller creates for `v`.
fn own<R: Resource>(obj: &mut R, v: &Volume, node: &str, finalizer: &str) {
    let kind_owner = v.metadata.controller_ref(Kind::Volume);
    let m = obj.metadata_mut();
    m.labels
        .insert(VOLUME_LABEL.into(), v.metadata.name.clone());
    m.labels.insert(NODE_LABEL.into(), node.to_string());
    if !kind_owner.uid.is_empty() {
        m.owner_references.push(kind_owner);
    }
    m.finalizers.push(finalizer.into());
}
