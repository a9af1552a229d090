//! The engine's control server: what the manager and the `zebu-engine` CLI call
//! (`engine.proto`).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use zebu_proto::engine as pb;
use zebu_proto::engine::engine_server::Engine;

use crate::blockdev::BlockDevice;
use crate::replicator::{Mode, Volume};

/// Serves one volume's control API.
pub struct ControlService {
    volume: Arc<Volume>,
    frontends: Vec<pb::Frontend>,
}

impl ControlService {
    pub fn new(volume: Arc<Volume>, frontends: Vec<pb::Frontend>) -> ControlService {
        ControlService { volume, frontends }
    }

    pub fn into_server(self) -> zebu_proto::engine::engine_server::EngineServer<ControlService> {
        zebu_proto::engine::engine_server::EngineServer::new(self)
    }

    async fn info(&self) -> pb::VolumeInfo {
        let m = self.volume.membership().await;
        let replicas: Vec<pb::ReplicaStatus> = self
            .volume
            .replicas()
            .iter()
            .map(|r| pb::ReplicaStatus {
                address: r.addr.clone(),
                id: r.id.clone(),
                mode: r.mode().to_string(),
                reason: r.reason(),
                data_path: r.data_path().to_string(),
            })
            .collect();
        let rw = replicas.iter().filter(|r| r.mode == "RW").count();
        let state = if rw == 0 {
            "faulted"
        } else if rw == replicas.len() {
            "healthy"
        } else {
            "degraded"
        };
        pb::VolumeInfo {
            protocol_version: pb::PROTOCOL_VERSION,
            name: self.volume.name().to_string(),
            size: self.volume.size(),
            generation: self.volume.generation(),
            epoch: m.epoch,
            members: m.members,
            flush_number: self.volume.flush_number(),
            replicas,
            frontends: self.frontends.clone(),
            state: state.into(),
        }
    }

    async fn snapshots(&self) -> Result<pb::Snapshots, Status> {
        let layers = self
            .volume
            .snapshot_list()
            .await
            .map_err(Status::unavailable)?;
        let names: std::collections::HashMap<u64, String> =
            layers.iter().map(|l| (l.id, l.name.clone())).collect();
        Ok(pb::Snapshots {
            snapshots: layers
                .into_iter()
                .map(|l| pb::Snapshot {
                    parent: names.get(&l.parent).cloned().unwrap_or_default(),
                    name: l.name,
                    user_created: l.user_created,
                    created: l.created,
                    data_bytes: l.data_bytes,
                    labels: l.labels,
                    head: l.head,
                })
                .collect(),
        })
    }
}

fn bad(e: String) -> Status {
    Status::failed_precondition(e)
}

#[tonic::async_trait]
impl Engine for ControlService {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::VolumeInfo>, Status> {
        Ok(Response::new(ControlService::info(self).await))
    }

    async fn replica_add(
        &self,
        r: Request<pb::ReplicaAddRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        let addr = r.into_inner().address;
        if addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "replica address {addr:?} is not host:port"
            )));
        }
        self.volume.start_rebuild(&addr).await.map_err(bad)?;
        Ok(Response::new(ControlService::info(self).await))
    }

    async fn replica_remove(
        &self,
        r: Request<pb::ReplicaRemoveRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.volume
            .remove_replica(&r.into_inner().address)
            .await
            .map_err(bad)?;
        Ok(Response::new(ControlService::info(self).await))
    }

    async fn snapshot_create(
        &self,
        r: Request<pb::SnapshotCreateRequest>,
    ) -> Result<Response<pb::Snapshots>, Status> {
        let r = r.into_inner();
        self.volume
            .snapshot_create(&r.name, r.labels)
            .await
            .map_err(bad)?;
        Ok(Response::new(self.snapshots().await?))
    }

    async fn snapshot_list(
        &self,
        _: Request<pb::SnapshotListRequest>,
    ) -> Result<Response<pb::Snapshots>, Status> {
        Ok(Response::new(self.snapshots().await?))
    }

    async fn snapshot_delete(
        &self,
        r: Request<pb::SnapshotDeleteRequest>,
    ) -> Result<Response<pb::Snapshots>, Status> {
        self.volume
            .snapshot_delete(&r.into_inner().name)
            .await
            .map_err(bad)?;
        Ok(Response::new(self.snapshots().await?))
    }

    async fn snapshot_revert(
        &self,
        r: Request<pb::SnapshotRevertRequest>,
    ) -> Result<Response<pb::Snapshots>, Status> {
        self.volume
            .snapshot_revert(&r.into_inner().name)
            .await
            .map_err(bad)?;
        Ok(Response::new(self.snapshots().await?))
    }

    async fn snapshot_purge(
        &self,
        _: Request<pb::SnapshotPurgeRequest>,
    ) -> Result<Response<pb::Snapshots>, Status> {
        self.volume.snapshot_purge().await.map_err(bad)?;
        Ok(Response::new(self.snapshots().await?))
    }

    async fn expand(
        &self,
        r: Request<pb::ExpandRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.volume.expand(r.into_inner().size).await.map_err(bad)?;
        Ok(Response::new(ControlService::info(self).await))
    }

    async fn rebuild_status(
        &self,
        _: Request<pb::RebuildStatusRequest>,
    ) -> Result<Response<pb::RebuildStatusResponse>, Status> {
        let s = self.volume.rebuild_status();
        let state = if s.state.is_empty() {
            "idle".to_string()
        } else {
            s.state
        };
        Ok(Response::new(pb::RebuildStatusResponse {
            replica: s.replica,
            state,
            kind: s.kind,
            bytes_done: s.bytes_done,
            bytes_total: s.bytes_total,
            bytes_copied: s.bytes_copied,
            error: s.error,
        }))
    }
}

/// Whether any replica is still rebuilding (for logs and tests).
pub fn rebuilding(v: &Volume) -> bool {
    v.replicas().iter().any(|r| r.mode() == Mode::WO)
}
