//! The Volume controller.
//!
//! Each pass, for every volume, from the store alone:
//!
//! 1. **Delete** (deletionTimestamp set): delete the Engine objects; when
//!    they are gone, delete the Replica objects (their agents stop the
//!    processes and remove the directories, then drop the finalizers); when
//!    those are gone, drop the volume's finalizer and the volume goes.
//! 2. **Replace stale replicas, wait first**: a replica whose node has been
//!    not Ready for longer than the volume's `staleReplicaTimeout` (or whose
//!    node is gone) gets the [`SUPERSEDED_LABEL`] and stops counting, so
//!    step 3 schedules a new one on another node with a fresh directory and
//!    the heal step `ReplicaAdd`s it (a full rebuild). Only when the
//!    replacement is RW in the engine (or, detached, running) is the old one
//!    deleted — by its agent if the node is back, else forcibly (finalizer
//!    dropped; the agent removes the directory as an orphan if the node ever
//!    returns). Until then the old copy still exists should the rebuild
//!    fail. The engine then drops its address as one no Replica owns.
//! 3. **Schedule**: fewer live replicas than `numberOfReplicas` → run the
//!    scheduler and create the missing Replica objects.
//! 4. **Attach / detach**: `spec.nodeId` set and no engine → once the
//!    replicas run, create the Engine object on that node with their
//!    addresses; an engine on another node or none wanted → delete it.
//! 5. **Heal** a running engine: a replica that runs but that the engine
//!    has as ERR (or not at all) is `ReplicaAdd`ed — the engine catches it up
//!    or rebuilds it; addresses the engine has that no replica owns are
//!    removed.
//! 6. **Salvage**: an engine that refuses to start because no replica can be
//!    shown current, or that is faulted (every replica failed) while every
//!    replica process runs, is started again with `--salvage`.
//! 7. **Status**: state, robustness, endpoint and the replica summary.
//!
//! ```text
//!  creating ──replicas running──▶ detached ◀──────────────┐
//!                                   │ nodeId set           │ engine gone
//!                                   ▼                      │
//!                               attaching ──engine ready──▶ attached ──nodeId unset──▶ detaching
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::engine_rpc;
use crate::instances::{ENGINE_FINALIZER, REPLICA_FINALIZER, REPLICAS_DIR};
use crate::resources::{
    ConditionStatus, Engine, EngineSpec, EngineState, Node, ObjectMeta, Replica, ReplicaMode,
    ReplicaSpec, ReplicaState, Resource, Robustness, Setting, Volume, VolumeReplicaSummary,
    VolumeState, condition_is_true, set_condition,
};
use crate::scheduler::{ScheduleRequest, schedule};
use crate::settings::Settings;
use crate::store::{Store, StoreError, TypedStore};

/// Held by every Volume until its engine and replicas are gone.
pub const VOLUME_FINALIZER: &str = "zebu.io/volume-controller";

/// Set on a replica whose node stayed down longer than the volume's
/// `staleReplicaTimeout` (value: when); it no longer counts, and goes once
/// its replacement is in sync — even if its node comes back meanwhile.
pub const SUPERSEDED_LABEL: &str = "zebu.io/superseded";

/// How long to wait between two `ReplicaAdd`s of one address.
const HEAL_BACKOFF: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {volume}: store: {source}")]
    Store {
        volume: String,
        #[source]
        source: StoreError,
    },
    #[error("settings: {0}")]
    Settings(#[from] crate::settings::SettingError),
    #[error("listing: {0}")]
    List(#[source] StoreError),
}

/// Everything one pass reads, once.
struct World {
    nodes: Vec<Node>,
    replicas: Vec<Replica>,
    engines: Vec<Engine>,
    settings: Settings,
}

pub struct VolumeController<S> {
    store: Arc<S>,
    /// (volume, replica address) -> last ReplicaAdd attempt.
    healed: HashMap<(String, String), Instant>,
}

fn engine_name(volume: &str) -> String {
    format!("{volume}-e")
}

fn replica_name(volume: &str) -> String {
    format!("{volume}-r-{:08x}", rand::random::<u32>())
}

fn mode_str(m: ReplicaMode) -> &'static str {
    match m {
        ReplicaMode::RW => "RW",
        ReplicaMode::WO => "WO",
        ReplicaMode::ERR => "ERR",
    }
}

impl<S: Store> VolumeController<S> {
    pub fn new(store: Arc<S>) -> Self {
        VolumeController {
            store,
            healed: HashMap::new(),
        }
    }

    pub async fn pass(&mut self) -> Result<(), VolumeError> {
        let volumes: Vec<Volume> = self.store.list_as().await.map_err(VolumeError::List)?;
        let world = World {
            nodes: self.store.list_as().await.map_err(VolumeError::List)?,
            replicas: self.store.list_as().await.map_err(VolumeError::List)?,
            engines: self.store.list_as().await.map_err(VolumeError::List)?,
            settings: Settings::from_objects(
                &self
                    .store
                    .list_as::<Setting>()
                    .await
                    .map_err(VolumeError::List)?,
            )?,
        };
        for v in &volumes {
            if let Err(e) = self.reconcile(v, &world).await {
                tracing::warn!(volume = %v.metadata.name, "{e}");
            }
        }
        self.collect_orphans(&volumes, &world).await;
        Ok(())
    }

    fn err(volume: &str) -> impl FnOnce(StoreError) -> VolumeError {
        let volume = volume.to_string();
        move |source| VolumeError::Store { volume, source }
    }

    /// Delete an object; gone or already deleting is fine.
    async fn delete<R: Resource>(&self, volume: &str, name: &str) -> Result<(), VolumeError> {
        match self.store.delete(R::KIND, name).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(Self::err(volume)(e)),
        }
    }

    /// Drop every finalizer of an object whose node agent is gone.
    async fn force_remove<R: Resource>(&self, volume: &str, obj: &R) -> Result<(), VolumeError> {
        self.delete::<R>(volume, obj.name()).await?;
        let Some(mut fresh) = self
            .store
            .get_as::<R>(obj.name())
            .await
            .map_err(Self::err(volume))?
        else {
            return Ok(());
        };
        fresh.metadata_mut().finalizers.clear();
        match self.store.update_as(&fresh).await {
            Ok(_) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => Ok(()),
            Err(e) => Err(Self::err(volume)(e)),
        }
    }

    async fn reconcile(&mut self, v: &Volume, w: &World) -> Result<(), VolumeError> {
        let name = v.metadata.name.as_str();
        let mine: Vec<&Replica> = w
            .replicas
            .iter()
            .filter(|r| r.spec.volume == name)
            .collect();
        let engines: Vec<&Engine> = w.engines.iter().filter(|e| e.spec.volume == name).collect();
        let node_ready = |n: &str| w.nodes.iter().any(|x| x.metadata.name == n && x.is_ready());

        if v.metadata.deletion_timestamp.is_some() {
            self.set_state(name, |s| s.state = VolumeState::Deleting)
                .await?;
            for e in &engines {
                if !node_ready(&e.spec.node) {
                    self.force_remove(name, *e).await?;
                } else {
                    self.delete::<Engine>(name, &e.metadata.name).await?;
                }
            }
            if !engines.is_empty() {
                return Ok(());
            }
            for r in &mine {
                if !node_ready(&r.spec.node) {
                    self.force_remove(name, *r).await?;
                } else {
                    self.delete::<Replica>(name, &r.metadata.name).await?;
                }
            }
            if !mine.is_empty() {
                return Ok(());
            }
            tracing::info!(volume = %name, "engine and replicas gone; removing the volume");
            return self.drop_volume_finalizer(name).await;
        }
        if !v.metadata.finalizers.iter().any(|f| f == VOLUME_FINALIZER) {
            let mut with = v.clone();
            with.metadata.finalizers.push(VOLUME_FINALIZER.into());
            match self.store.update_as(&with).await {
                Ok(_) | Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(Self::err(name)(e)),
            }
        }

        // 2. Replicas whose node has been gone too long are superseded: a
        //    label, written before anything else happens, takes them out of
        //    the count so step 3 schedules a replacement elsewhere; they are
        //    removed only once the replacement is in sync.
        let timeout = Duration::from_secs(v.spec.stale_replica_timeout);
        let mut live: Vec<&Replica> = Vec::new();
        let mut superseded: Vec<&Replica> = Vec::new();
        for r in mine
            .iter()
            .filter(|r| r.metadata.deletion_timestamp.is_none())
        {
            if r.metadata.labels.contains_key(SUPERSEDED_LABEL) {
                superseded.push(r);
            } else if self.node_gone_for(w, &r.spec.node) >= Some(timeout) {
                tracing::warn!(volume = %name, replica = %r.metadata.name, node = %r.spec.node,
                    "node gone longer than staleReplicaTimeout ({} s): scheduling a replacement", timeout.as_secs());
                let mut marked = (*r).clone();
                marked
                    .metadata
                    .labels
                    .insert(SUPERSEDED_LABEL.into(), crate::time::now_rfc3339());
                match self.store.update_as(&marked).await {
                    Ok(_) => superseded.push(r),
                    // Changed meanwhile: decide again on the next pass.
                    Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                        return Ok(());
                    }
                    Err(e) => return Err(Self::err(name)(e)),
                }
            } else {
                live.push(r);
            }
        }

        // 3. Schedule missing replicas.
        let missing = v.spec.number_of_replicas.saturating_sub(live.len() as u32);
        if missing > 0 {
            self.schedule(v, w, missing).await?;
        }

        // 4. Engine.
        let wanted = v.spec.node_id.as_deref();
        let mut current: Option<&Engine> = None;
        for e in &engines {
            if e.metadata.deletion_timestamp.is_some() {
                continue;
            }
            if Some(e.spec.node.as_str()) == wanted {
                current = Some(e);
            } else {
                tracing::info!(volume = %name, node = %e.spec.node, "stopping the engine (detach)");
                self.delete::<Engine>(name, &e.metadata.name).await?;
            }
        }
        let running: BTreeMap<String, String> = live
            .iter()
            .filter(|r| r.status.state == ReplicaState::Running)
            .filter_map(|r| Some((r.metadata.name.clone(), r.status.address.clone()?)))
            .collect();
        let salvaging = condition_is_true(&v.status.conditions, "Salvaging");
        match (wanted, current) {
            (Some(node), None) => {
                let some_failed = live.iter().any(|r| r.status.state == ReplicaState::Error);
                let all_up = running.len() == live.len() && !live.is_empty();
                if engines.is_empty() && !running.is_empty() && (all_up || some_failed) {
                    let mut e = Engine::new(
                        engine_name(name),
                        EngineSpec {
                            volume: name.to_string(),
                            node: node.to_string(),
                            size: v.spec.size,
                            replica_addresses: running.clone(),
                            frontend: v.spec.frontend,
                            salvage: salvaging,
                        },
                    );
                    e.metadata.finalizers.push(ENGINE_FINALIZER.into());
                    match self.store.create_as(&e).await {
                        Ok(_) => {
                            tracing::info!(volume = %name, node, replicas = ?running, "engine created")
                        }
                        Err(StoreError::AlreadyExists { .. }) => {}
                        Err(err) => return Err(Self::err(name)(err)),
                    }
                }
            }
            (Some(_), Some(e)) => self.tend_engine(v, e, &live, &running, salvaging).await?,
            (None, _) => {}
        }

        // 2b. Remove superseded replicas once their replacements are in
        //     sync: every live replica RW in the running engine, or, with
        //     no engine, every live replica running.
        if !superseded.is_empty() && live.len() as u32 >= v.spec.number_of_replicas {
            let in_sync = match current.filter(|e| e.status.state == EngineState::Running) {
                Some(e) => live.iter().all(|r| {
                    e.status.replica_modes.get(&r.metadata.name) == Some(&ReplicaMode::RW)
                }),
                None => current.is_none() && running.len() == live.len(),
            };
            if in_sync {
                for r in &superseded {
                    tracing::info!(volume = %name, replica = %r.metadata.name, node = %r.spec.node,
                        "replacement in sync: removing the superseded replica");
                    if node_ready(&r.spec.node) {
                        // Its agent stops the process and removes the files.
                        self.delete::<Replica>(name, &r.metadata.name).await?;
                    } else {
                        // No agent to do it; the directory goes when the node
                        // comes back (it is then named by no Replica).
                        self.force_remove(name, *r).await?;
                    }
                }
            }
        }

        // 7. Status.
        let engine = current.filter(|e| e.status.state == EngineState::Running);
        let state = match (wanted, engine, engines.is_empty()) {
            (Some(_), Some(e), _) if e.status.endpoint.is_some() => VolumeState::Attached,
            (Some(_), _, _) => VolumeState::Attaching,
            (None, _, false) => VolumeState::Detaching,
            (None, _, true) if live.is_empty() || running.len() < live.len() => {
                if v.status.state == VolumeState::Creating {
                    VolumeState::Creating
                } else {
                    VolumeState::Detached
                }
            }
            (None, _, true) => VolumeState::Detached,
        };
        // RW in the engine, and still the process the engine took as RW
        // (a replica restarted since is out of sync until the engine sees it).
        let all_rw = |e: &Engine| {
            live.iter().all(|r| {
                let name = &r.metadata.name;
                e.status.replica_modes.get(name) == Some(&ReplicaMode::RW)
                    && e.status
                        .replica_pids
                        .get(name)
                        .is_none_or(|p| r.status.pid == Some(*p))
            })
        };
        let full = live.len() as u32 >= v.spec.number_of_replicas;
        let robustness = match engine {
            Some(e) => match e.status.volume_state.as_deref() {
                Some("faulted") => Robustness::Faulted,
                Some("healthy") if all_rw(e) && full && running.len() == live.len() => {
                    Robustness::Healthy
                }
                Some(_) => Robustness::Degraded,
                None => Robustness::Unknown,
            },
            None if running.is_empty() => Robustness::Unknown,
            None if running.len() == live.len() && full => Robustness::Healthy,
            None => Robustness::Degraded,
        };
        let summary: Vec<VolumeReplicaSummary> = live
            .iter()
            .map(|r| VolumeReplicaSummary {
                name: r.metadata.name.clone(),
                node: r.spec.node.clone(),
                mode: engine.and_then(|e| e.status.replica_modes.get(&r.metadata.name).copied()),
            })
            .collect();
        let endpoint = engine.and_then(|e| e.status.endpoint.clone());
        let rebuild = engine
            .and_then(|e| e.status.rebuild.clone())
            .filter(|r| r.state == "running");
        let current_node = engine.map(|e| e.spec.node.clone());
        let prev = v.status.robustness;
        if prev != robustness {
            tracing::info!(volume = %name, "robustness {prev:?} -> {robustness:?}");
        }
        self.set_state(name, |s| {
            s.state = state;
            s.robustness = robustness;
            s.endpoint = if state == VolumeState::Attached {
                endpoint.clone()
            } else {
                None
            };
            s.current_node = current_node.clone();
            s.replicas = summary.clone();
            s.rebuild = rebuild.clone();
        })
        .await
    }

    /// How long a node has been not Ready; `Some(MAX)` when it does not exist.
    fn node_gone_for(&self, w: &World, node: &str) -> Option<Duration> {
        let Some(n) = w.nodes.iter().find(|n| n.metadata.name == node) else {
            return Some(Duration::MAX);
        };
        if n.is_ready() {
            return None;
        }
        let since = n
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .and_then(|c| c.last_transition_time.as_deref())
            .and_then(crate::time::parse_rfc3339)?;
        SystemTime::now().duration_since(since).ok()
    }

    async fn schedule(&self, v: &Volume, w: &World, count: u32) -> Result<(), VolumeError> {
        let name = v.metadata.name.as_str();
        let placed = schedule(&ScheduleRequest {
            volume: v,
            nodes: &w.nodes,
            replicas: &w.replicas,
            settings: &w.settings,
            count,
        });
        let placements = match placed {
            Ok(p) => p,
            Err(e) => {
                let msg = e.to_string();
                if !v
                    .status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Scheduled" && c.message == msg)
                {
                    tracing::warn!(volume = %name, "{msg}");
                }
                return self
                    .set_state(name, |s| {
                        set_condition(
                            &mut s.conditions,
                            "Scheduled",
                            ConditionStatus::False,
                            "ReplicaSchedulingFailure",
                            &msg,
                        );
                    })
                    .await;
            }
        };
        for p in placements {
            let rname = replica_name(name);
            let data_path = std::path::Path::new(&p.disk_path)
                .join(REPLICAS_DIR)
                .join(&rname)
                .display()
                .to_string();
            let mut r = Replica::new(
                rname.clone(),
                ReplicaSpec {
                    volume: name.to_string(),
                    node: p.node.clone(),
                    disk: p.disk.clone(),
                    data_path,
                    size: v.spec.size,
                },
            );
            r.metadata = ObjectMeta {
                finalizers: vec![REPLICA_FINALIZER.into()],
                ..r.metadata
            };
            self.store.create_as(&r).await.map_err(Self::err(name))?;
            tracing::info!(volume = %name, replica = %rname, node = %p.node, disk = %p.disk, "replica scheduled");
        }
        self.set_state(name, |s| {
            set_condition(
                &mut s.conditions,
                "Scheduled",
                ConditionStatus::True,
                "",
                "",
            );
        })
        .await
    }

    /// Keep an existing engine fed: addresses while it is down, heal and
    /// salvage while it is up.
    async fn tend_engine(
        &mut self,
        v: &Volume,
        e: &Engine,
        live: &[&Replica],
        running: &BTreeMap<String, String>,
        salvaging: bool,
    ) -> Result<(), VolumeError> {
        let name = v.metadata.name.as_str();
        if e.status.state != EngineState::Running {
            // Restarts use the replicas as they are now.
            let mut spec = e.spec.clone();
            if !running.is_empty() {
                spec.replica_addresses = running.clone();
            }
            let every_replica_runs = running.len() == live.len() && !live.is_empty();
            if e.status.state == EngineState::Error
                && e.status.message.contains("--salvage")
                && every_replica_runs
                && !spec.salvage
            {
                tracing::warn!(volume = %name, "no replica can be shown current: auto-salvage");
                spec.salvage = true;
            }
            if spec != e.spec {
                let mut updated = e.clone();
                updated.spec = spec;
                match self.store.update_as(&updated).await {
                    Ok(_) | Err(StoreError::Conflict { .. }) => {}
                    Err(err) => return Err(Self::err(name)(err)),
                }
            }
            return Ok(());
        }
        let Some(control) = e.status.control_address.as_deref() else {
            return Ok(());
        };
        match e.status.volume_state.as_deref() {
            Some("faulted") if running.len() == live.len() && !salvaging => {
                // Every replica failed but every process runs: start over
                // and let the engine take the best one.
                tracing::warn!(volume = %name, "engine faulted with every replica process up: auto-salvage");
                self.set_state(name, |s| {
                    set_condition(
                        &mut s.conditions,
                        "Salvaging",
                        ConditionStatus::True,
                        "AllReplicasFailed",
                        "",
                    );
                })
                .await?;
                return self.delete::<Engine>(name, &e.metadata.name).await;
            }
            Some("healthy" | "degraded") if salvaging => {
                self.set_state(name, |s| {
                    set_condition(
                        &mut s.conditions,
                        "Salvaging",
                        ConditionStatus::False,
                        "",
                        "",
                    );
                })
                .await?;
            }
            _ => {}
        }
        // Heal: running replicas the engine has failed or does not have.
        for r in live {
            let Some(addr) = running.get(&r.metadata.name) else {
                continue;
            };
            let mode = e.status.replica_modes.get(&r.metadata.name).copied();
            if matches!(mode, Some(ReplicaMode::RW | ReplicaMode::WO)) {
                continue;
            }
            let key = (name.to_string(), addr.clone());
            if self
                .healed
                .get(&key)
                .is_some_and(|t| t.elapsed() < HEAL_BACKOFF)
            {
                continue;
            }
            self.healed.insert(key, Instant::now());
            let was = mode.map_or("absent", mode_str);
            match engine_rpc::replica_add(control, addr).await {
                Ok(_) => {
                    tracing::info!(volume = %name, replica = %r.metadata.name, %addr, "replica {was} -> added back (engine catches it up)")
                }
                Err(err) => {
                    tracing::info!(volume = %name, replica = %r.metadata.name, "ReplicaAdd not taken yet: {err}")
                }
            }
        }
        // Addresses no replica owns any more (a replaced replica).
        for (addr, mode) in &e.status.unknown_replicas {
            if *mode == ReplicaMode::RW && running.is_empty() {
                continue;
            }
            match engine_rpc::replica_remove(control, addr).await {
                Ok(_) => {
                    tracing::info!(volume = %name, %addr, "removed a replica address no Replica owns")
                }
                Err(err) => tracing::info!(volume = %name, %addr, "ReplicaRemove: {err}"),
            }
        }
        Ok(())
    }

    async fn set_state(
        &self,
        name: &str,
        edit: impl Fn(&mut crate::resources::VolumeStatus),
    ) -> Result<(), VolumeError> {
        for _ in 0..20 {
            let Some(mut v) = self
                .store
                .get_as::<Volume>(name)
                .await
                .map_err(Self::err(name))?
            else {
                return Ok(());
            };
            let before = v.status.clone();
            edit(&mut v.status);
            if v.status == before {
                return Ok(());
            }
            match self.store.update_status_as(&v).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(Self::err(name)(e)),
            }
        }
        Ok(())
    }

    async fn drop_volume_finalizer(&self, name: &str) -> Result<(), VolumeError> {
        for _ in 0..20 {
            let Some(mut v) = self
                .store
                .get_as::<Volume>(name)
                .await
                .map_err(Self::err(name))?
            else {
                return Ok(());
            };
            v.metadata.finalizers.retain(|f| f != VOLUME_FINALIZER);
            match self.store.update_as(&v).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(Self::err(name)(e)),
            }
        }
        Ok(())
    }

    /// Engines and replicas whose volume no longer exists (e.g. deleted
    /// before it carried a finalizer) are deleted too.
    async fn collect_orphans(&self, volumes: &[Volume], w: &World) {
        let exists = |n: &str| volumes.iter().any(|v| v.metadata.name == n);
        for e in w.engines.iter().filter(|e| !exists(&e.spec.volume)) {
            if e.metadata.deletion_timestamp.is_none() {
                let _ = self
                    .delete::<Engine>(&e.spec.volume, &e.metadata.name)
                    .await;
            }
        }
        let engine_left = |vol: &str| w.engines.iter().any(|e| e.spec.volume == vol);
        for r in w.replicas.iter().filter(|r| !exists(&r.spec.volume)) {
            if r.metadata.deletion_timestamp.is_none() && !engine_left(&r.spec.volume) {
                let _ = self
                    .delete::<Replica>(&r.spec.volume, &r.metadata.name)
                    .await;
            }
        }
    }
}
