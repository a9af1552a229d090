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
//!   [`MAINTENANCE_ANNOTATION`](zebu_types::names::MAINTENANCE_ANNOTATION)
//!   (`revert:<snapshot>:<token>`), waits for the engine, reverts, and detaches again,
//!   whether the revert worked or not. The engine is the only thing that
//!   talks to the replicas, so there is no revert without one. If the manager stops in the
//!   middle, the volume stays attached without a frontend, with the annotation saying why;
//!   `zebu volume detach` ends it, and attach refuses to add a frontend while it is held.

use std::time::Duration;

use zebu_proto::engine as pb;
use zebu_types::Kind;
use zebu_types::names::VOLUME_LABEL;
use zebu_types::requests::{CreateSnapshot, SnapshotInfo};
use zebu_types::resources::{Engine, EngineState, Snapshot, SnapshotSpec, SnapshotStatus};
use zebu_types::size::ByteSize;
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::validate_label;

use crate::volume::check_name;
use crate::{Ops, OpsError, OpsResult, engine_rpc};

/// On a Snapshot record: the snapshot's name in its volume's layer chain (the record is
/// named `<volume>.<snapshot>`).
pub const SNAPSHOT_NAME_ANNOTATION: &str = "zebu.io/snapshot";

/// The name of the Snapshot record of `snapshot` of `volume`: a volume name and a snapshot
/// name are DNS-1123 labels, so this is a valid subdomain and no two pairs share it.
pub fn snapshot_record_name(volume: &str, snapshot: &str) -> String {
    format!("{volume}.{snapshot}")
}

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
    fn engine_err(volume: &str) -> impl FnOnce(engine_rpc::EngineRpcError) -> OpsError {
        let volume = volume.to_string();
        move |source| OpsError::Engine { volume, source }
    }

    /// The volume's snapshots: the running engine's list, or, for a detached volume (no
    /// engine to ask, and none is started for a read), its Snapshot records, oldest first.
    /// Every snapshot is taken and deleted through this layer, which keeps the records, so
    /// the two agree on what a person asked for; labels live only in the layer chain.
    ///
    /// A detached volume may have an engine for a moment: one started for a snapshot or a
    /// revert, on its way out. It is asked if it answers; if it has gone by then, the
    /// records answer (found by `cli_up`: a list right after a snapshot of a detached volume
    /// failed with "not attached").
    pub async fn list_snapshots(&self, volume: &str) -> OpsResult<Vec<SnapshotInfo>> {
        let v = self.get_volume(volume).await?;
        let detached = v.spec.node_id.is_none();
        let control = self
            .running_engine(volume)
            .await?
            .and_then(|e| e.status.control_address);
        match control {
            Some(control) => match engine_rpc::snapshot_list(&control).await {
                Ok(s) => Ok(snapshot_items(s)),
                Err(_) if detached => self.snapshot_records_of(volume).await,
                Err(e) => Err(Self::engine_err(volume)(e)),
            },
            None if detached => self.snapshot_records_of(volume).await,
            None => Err(OpsError::precondition(
                volume,
                format!("volume {volume:?} is attaching: its engine is not running yet, try again"),
            )),
        }
    }

    /// A detached volume's snapshots, from its Snapshot records, oldest first.
    async fn snapshot_records_of(&self, volume: &str) -> OpsResult<Vec<SnapshotInfo>> {
        let mut records = self.list_snapshot_records(Some(volume)).await?;
        records.sort_by(|a, b| a.status.creation_time.cmp(&b.status.creation_time));
        Ok(records
            .into_iter()
            .map(|r| SnapshotInfo {
                name: r
                    .metadata
                    .annotations
                    .get(SNAPSHOT_NAME_ANNOTATION)
                    .cloned()
                    .unwrap_or_else(|| r.metadata.name.clone()),
                parent: r.status.parent.unwrap_or_default(),
                user_created: r.status.user_created,
                created: r.status.creation_time.unwrap_or_default(),
                data_bytes: r.status.size.0,
                labels: Default::default(),
            })
            .collect())
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
        let s = self
            .with_engine(volume, "snapshot", |control| async move {
                engine_rpc::snapshot_create(&control, &snapshot)
                    .await
                    .map_err(Self::engine_err(volume))
                    .map(|s| (snapshot, s))
            })
            .await;
        let (snapshot, s) = s?;
        tracing::info!(volume, snapshot = %snapshot, "snapshot taken");
        let items = snapshot_items(s);
        self.record_snapshot(volume, &snapshot, &items).await?;
        Ok(items)
    }

    /// Delete a snapshot, on the running engine or on one started for it (detached).
    pub async fn delete_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> OpsResult<Vec<SnapshotInfo>> {
        check_name("snapshot", snapshot)?;
        let s = self
            .with_engine(volume, "snapshot-delete", |control| async move {
                engine_rpc::snapshot_delete(&control, snapshot)
                    .await
                    .map_err(Self::engine_err(volume))
            })
            .await;
        let items = match s {
            Ok(s) => snapshot_items(s),
            // Gone from the replicas already (a delete repeated after the manager stopped
            // before removing the record): the record goes too.
            Err(OpsError::Engine { source, .. }) if matches!(&source, engine_rpc::EngineRpcError::Call { code, .. } if *code == tonic::Code::NotFound) =>
            {
                self.forget_snapshot(volume, snapshot).await?;
                return Err(OpsError::Engine {
                    volume: volume.to_string(),
                    source,
                });
            }
            Err(e) => return Err(e),
        };
        tracing::info!(volume, snapshot, "snapshot deleted");
        self.forget_snapshot(volume, snapshot).await?;
        // The deleted snapshot's child now sits on its parent: the records that a detached
        // volume's listing reads follow the chain.
        for r in self.list_snapshot_records(Some(volume)).await? {
            let Some(info) = r
                .metadata
                .annotations
                .get(SNAPSHOT_NAME_ANNOTATION)
                .and_then(|n| items.iter().find(|i| &i.name == n))
            else {
                continue;
            };
            let parent = (!info.parent.is_empty()).then(|| info.parent.clone());
            if r.status.parent != parent {
                let mut updated = r;
                updated.status.parent = parent;
                // The delete is done: a record left with its old parent costs only a stale
                // parent in a detached volume's listing, not the delete.
                if let Err(e) = self.store.update_status_as(&updated).await {
                    tracing::warn!(volume, record = %updated.metadata.name, error = %e, "snapshot record's parent not refreshed");
                }
            }
        }
        Ok(items)
    }

    /// The Snapshot records of `volume` (every volume's with `None`): what the ops layer
    /// took, readable without an engine.
    pub async fn list_snapshot_records(&self, volume: Option<&str>) -> OpsResult<Vec<Snapshot>> {
        if let Some(v) = volume {
            check_name("volume", v)?;
        }
        Ok(self
            .store
            .list_as::<Snapshot>()
            .await?
            .into_iter()
            .filter(|s| volume.is_none_or(|v| s.spec.volume == v))
            .collect())
    }

    /// The record of one snapshot, if the ops layer took it.
    pub async fn snapshot_record(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> OpsResult<Option<Snapshot>> {
        check_name("volume", volume)?;
        check_name("snapshot", snapshot)?;
        Ok(self
            .store
            .get_as::<Snapshot>(&snapshot_record_name(volume, snapshot))
            .await?)
    }

    /// Write (or refresh) the record of `snapshot` from the engine's list after taking it.
    async fn record_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        items: &[SnapshotInfo],
    ) -> OpsResult<()> {
        let Some(info) = items.iter().find(|i| i.name == snapshot) else {
            return Err(OpsError::precondition(
                volume,
                format!(
                    "volume {volume:?}: the engine took snapshot {snapshot:?} but does not list it"
                ),
            ));
        };
        let size = self.get_volume(volume).await?.spec.size;
        let name = snapshot_record_name(volume, snapshot);
        let mut record = Snapshot::new(
            name.clone(),
            SnapshotSpec {
                volume: volume.to_string(),
            },
        );
        record
            .metadata
            .labels
            .insert(VOLUME_LABEL.into(), volume.to_string());
        record
            .metadata
            .annotations
            .insert(SNAPSHOT_NAME_ANNOTATION.into(), snapshot.to_string());
        let status = SnapshotStatus {
            ready_to_use: true,
            observed_generation: 0,
            creation_time: Some(info.created.clone()),
            parent: (!info.parent.is_empty()).then(|| info.parent.clone()),
            user_created: info.user_created,
            size: ByteSize(info.data_bytes),
            volume_size: Some(size),
            error: String::new(),
        };
        let stored = match self.store.get_as::<Snapshot>(&name).await? {
            Some(old) => old,
            None => match self.store.create_as(&record).await {
                Ok(r) => r,
                Err(StoreError::AlreadyExists { .. }) => {
                    self.store.get_as::<Snapshot>(&name).await?.ok_or_else(|| {
                        OpsError::aborted(format!(
                            "snapshot record {name:?} keeps changing; try again"
                        ))
                    })?
                }
                Err(e) => return Err(e.into()),
            },
        };
        let mut updated = stored;
        updated.status = status;
        self.store.update_status_as(&updated).await?;
        Ok(())
    }

    async fn forget_snapshot(&self, volume: &str, snapshot: &str) -> OpsResult<()> {
        match self
            .store
            .delete(Kind::Snapshot, &snapshot_record_name(volume, snapshot))
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Remove the records of every snapshot of a volume that is being deleted (its
    /// snapshots go with its replicas).
    pub(crate) async fn forget_snapshots_of(&self, volume: &str) -> OpsResult<()> {
        for s in self.list_snapshot_records(Some(volume)).await? {
            match self.store.delete(Kind::Snapshot, &s.metadata.name).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
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
        crate::standby::refuse_standby(&self.get_volume(volume).await?, "be reverted")?;
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
        let token = format!("revert:{snapshot}:{:08x}", rand::random::<u32>());
        let node = self.claim_maintenance(volume, &token).await?;
        tracing::info!(volume, node = %node, snapshot, "attached without a frontend to revert");
        let result = match self.wait_maintenance_engine(volume).await {
            Ok(engine) => self.revert_with(volume, &engine, snapshot).await,
            Err(e) => Err(e),
        };
        self.release_maintenance(volume, &token, "revert").await;
        result
    }

    /// The volume's running engine without a frontend, once it is there.
    pub(crate) async fn wait_maintenance_engine(&self, volume: &str) -> OpsResult<Engine> {
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
