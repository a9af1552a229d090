//! Snapshot operations. Snapshots live in the replicas' layer chains, so every one of these
//! goes through the volume's running engine.
//!
//! **Revert** replaces the volume's data with a snapshot's, which no client may be reading
//! or writing meanwhile (it would not know its cache went stale). So:
//!
//! - attached with its frontend: refused, with what to do (detach, or attach with
//!   `--maintenance`);
//! - attached without a frontend (`zebu volume attach NAME --maintenance`): reverted by the
//!   running engine; the volume stays attached that way;
//! - detached: the operation attaches it without a frontend itself, marked with the
//!   [`MAINTENANCE_ANNOTATION`] (`revert:<snapshot>:<token>`), waits for the engine, reverts,
//!   and detaches again, whether the revert worked or not. The engine is the only thing that
//!   talks to the replicas, so there is no revert without one. If the manager stops in the
//!   middle, the volume stays attached without a frontend, with the annotation saying why;
//!   `zebu volume detach` ends it, and attach refuses to add a frontend while it is held.

use std::time::Duration;

use zebu_proto::engine as pb;
use zebu_types::names::MAINTENANCE_ANNOTATION;
use zebu_types::requests::{CreateSnapshot, SnapshotInfo};
use zebu_types::resources::{Engine, EngineState};
use zebu_types::store::TypedStore;
use zebu_types::validate_label;

use crate::volume::check_name;
use crate::{Ops, OpsError, OpsResult, engine_rpc};

/// How long a revert of a detached volume waits for its engine to start.
const MAINTENANCE_ENGINE_TIMEOUT: Duration = Duration::from_secs(120);

/// The engine's snapshots, without its live head.
fn snapshot_items(s: pb::Snapshots) -> Vec<SnapshotInfo> {
    s.snapshots
        .into_iter()
        .filter(|s| !s.head)
        .map(|s| SnapshotInfo {
            name: s.name,
            parent: s.parent,
            user_created: s.user_created,
            created: s.created,
            data_bytes: s.data_bytes,
            labels: s.labels.into_iter().collect(),
        })
        .collect()
}

impl Ops {
    /// The control address of the running engine of `volume`.
    async fn engine_control(&self, volume: &str) -> OpsResult<String> {
        self.get_volume(volume).await?;
        self.running_engine(volume)
            .await?
            .and_then(|e| e.status.control_address)
            .ok_or_else(|| {
                OpsError::precondition(
                    volume,
                    format!(
                        "volume {volume:?} is not attached: snapshots are taken by its engine (zebu volume attach {volume})"
                    ),
                )
            })
    }

    fn engine_err(volume: &str) -> impl FnOnce(engine_rpc::EngineRpcError) -> OpsError {
        let volume = volume.to_string();
        move |source| OpsError::Engine { volume, source }
    }

    pub async fn list_snapshots(&self, volume: &str) -> OpsResult<Vec<SnapshotInfo>> {
        let control = self.engine_control(volume).await?;
        let s = engine_rpc::snapshot_list(&control)
            .await
            .map_err(Self::engine_err(volume))?;
        Ok(snapshot_items(s))
    }

    pub async fn create_snapshot(
        &self,
        volume: &str,
        req: CreateSnapshot,
    ) -> OpsResult<Vec<SnapshotInfo>> {
        check_name("volume", volume)?;
        // Unnamed snapshots are named after the moment they were asked for.
        let snapshot = req.name.unwrap_or_else(|| {
            let t = zebu_types::time::now_rfc3339().replace([':', '-'], "");
            format!(
                "snap-{}",
                t.trim_end_matches('Z').replace('T', "-").to_lowercase()
            )
        });
        validate_label(&snapshot).map_err(|e| OpsError::invalid(format!("snapshot {e}")))?;
        let control = self.engine_control(volume).await?;
        let s = engine_rpc::snapshot_create(&control, &snapshot)
            .await
            .map_err(Self::engine_err(volume))?;
        tracing::info!(volume, snapshot = %snapshot, "snapshot taken");
        Ok(snapshot_items(s))
    }

    pub async fn delete_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> OpsResult<Vec<SnapshotInfo>> {
        check_name("snapshot", snapshot)?;
        let control = self.engine_control(volume).await?;
        let s = engine_rpc::snapshot_delete(&control, snapshot)
            .await
            .map_err(Self::engine_err(volume))?;
        tracing::info!(volume, snapshot, "snapshot deleted");
        Ok(snapshot_items(s))
    }

    /// Revert `volume` to `snapshot`; see the module docs for when and how.
    pub async fn revert_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> OpsResult<Vec<SnapshotInfo>> {
        check_name("snapshot", snapshot)?;
        let v = self.get_volume(volume).await?;
        if v.metadata.is_deleting() {
            return Err(OpsError::precondition(
                volume,
                format!("volume {volume:?} is being deleted"),
            ));
        }
        match (&v.spec.node_id, v.spec.disable_frontend) {
            (Some(node), false) => Err(OpsError::precondition(
                volume,
                format!(
                    "volume {volume:?} is attached to {node} with its {} frontend: a revert would change the data under its clients; detach it first (zebu volume detach {volume}), or attach it with --maintenance",
                    v.spec.frontend
                ),
            )),
            (Some(_), true) => {
                let engine = self.wait_maintenance_engine(volume).await?;
                self.revert_with(volume, &engine, snapshot).await
            }
            (None, _) => self.revert_detached(volume, snapshot).await,
        }
    }

    async fn revert_with(
        &self,
        volume: &str,
        engine: &Engine,
        snapshot: &str,
    ) -> OpsResult<Vec<SnapshotInfo>> {
        let control = engine.status.control_address.clone().unwrap_or_default();
        let s = engine_rpc::snapshot_revert(&control, snapshot)
            .await
            .map_err(Self::engine_err(volume))?;
        tracing::info!(volume, snapshot, "volume reverted to its snapshot");
        Ok(snapshot_items(s))
    }

    /// Attach without a frontend, revert, detach; see the module docs.
    async fn revert_detached(&self, volume: &str, snapshot: &str) -> OpsResult<Vec<SnapshotInfo>> {
        let still_there = self
            .store
            .list_as::<Engine>()
            .await?
            .into_iter()
            .any(|e| e.spec.volume == volume);
        if still_there {
            return Err(OpsError::precondition(
                volume,
                format!("volume {volume:?} is still detaching; revert it when it is detached"),
            ));
        }
        let node = self.pick_node(volume).await?;
        let token = format!("revert:{snapshot}:{:08x}", rand::random::<u32>());
        self.edit_volume(volume, |v| {
            if v.spec.node_id.is_some() {
                return Err(OpsError::precondition(
                    volume,
                    format!("volume {volume:?} was attached meanwhile; try again"),
                ));
            }
            v.spec.node_id = Some(node.clone());
            v.spec.disable_frontend = true;
            v.metadata
                .annotations
                .insert(MAINTENANCE_ANNOTATION.into(), token.clone());
            Ok(())
        })
        .await?;
        tracing::info!(volume, node = %node, snapshot, "attached without a frontend to revert");
        let result = match self.wait_maintenance_engine(volume).await {
            Ok(engine) => self.revert_with(volume, &engine, snapshot).await,
            Err(e) => Err(e),
        };
        // Detach again, unless someone else took the volume over meanwhile.
        let released = self
            .edit_volume(volume, |v| {
                if v.metadata.annotations.get(MAINTENANCE_ANNOTATION) == Some(&token) {
                    v.spec.node_id = None;
                    v.spec.disable_frontend = false;
                    v.metadata.annotations.remove(MAINTENANCE_ANNOTATION);
                }
                Ok(())
            })
            .await;
        if let Err(e) = released {
            tracing::warn!(volume, "could not detach after the revert: {e}");
        }
        result
    }

    /// The volume's running engine without a frontend, once it is there.
    async fn wait_maintenance_engine(&self, volume: &str) -> OpsResult<Engine> {
        let deadline = tokio::time::Instant::now() + MAINTENANCE_ENGINE_TIMEOUT;
        loop {
            let engines = self.store.list_as::<Engine>().await?;
            let mine = engines
                .iter()
                .find(|e| e.spec.volume == volume && !e.metadata.is_deleting());
            if let Some(e) = mine
                && e.spec.disable_frontend
                && e.status.state == EngineState::Running
                && e.status.control_address.is_some()
            {
                return Ok(e.clone());
            }
            if tokio::time::Instant::now() >= deadline {
                let state = mine.map_or("no engine yet".to_string(), |e| {
                    format!("engine {:?}: {}", e.status.state, e.status.message)
                });
                return Err(OpsError::DeadlineExceeded {
                    volume: volume.to_string(),
                    message: format!(
                        "volume {volume:?}: its engine did not start without a frontend within {} s ({state})",
                        MAINTENANCE_ENGINE_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
