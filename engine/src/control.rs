//! The engine's control server: what the manager and the `zebu-engine` CLI call
//! (`engine.proto`).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use zebu_proto::engine as pb;
use zebu_proto::engine::engine_server::Engine;

use crate::blockdev::BlockDevice;
use crate::replicator::{
    Mode, RebuildKind, RebuildState, RebuildStatus, ScrubReport, ScrubState, Volume,
};

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
            .map(|r| {
                let mode = r.mode();
                pb::ReplicaStatus {
                    address: r.addr.clone(),
                    id: r.id.0.clone(),
                    mode: mode.to_string(),
                    reason: r.reason(),
                    data_path: r.data_path().to_string(),
                    replica_mode: mode_to_pb(mode) as i32,
                }
            })
            .collect();
        let rw = replicas
            .iter()
            .filter(|r| r.replica_mode() == pb::ReplicaMode::Rw)
            .count();
        let state = if rw == 0 {
            pb::VolumeState::Faulted
        } else if rw == replicas.len() {
            pb::VolumeState::Healthy
        } else {
            pb::VolumeState::Degraded
        };
        let integrity = self.volume.integrity();
        let path = self.volume.path_totals();
        let spans = |t: crate::pathtime::SpanTotals| pb::PathSpans {
            count: t.count,
            frontend_ns: t.frontend_ns,
            replicator_ns: t.replicator_ns,
            transport_ns: t.transport_ns,
        };
        pb::VolumeInfo {
            data_path: Some(pb::DataPathCounters {
                writes: Some(spans(path.writes)),
                flushes: Some(spans(path.flushes)),
                flushes_shared: path.flushes_shared,
            }),
            integrity: Some(pb::IntegrityCounters {
                corrupt_reads: integrity.corrupt_reads,
                repaired_blocks: integrity.repaired_blocks,
                unrecoverable_blocks: integrity.unrecoverable_blocks,
            }),
            protocol_version: pb::PROTOCOL_VERSION,
            name: self.volume.name().to_string(),
            size: self.volume.size(),
            generation: self.volume.generation().0,
            epoch: m.epoch.0,
            members: m.members.into_iter().map(|id| id.0).collect(),
            flush_number: self.volume.flush_number().0,
            replicas,
            frontends: self.frontends.clone(),
            state: volume_state_word(state).into(),
            volume_state: state as i32,
        }
    }

    async fn snapshots(&self) -> Result<pb::Snapshots, Status> {
        let layers = self
            .volume
            .snapshot_list()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
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

fn mode_to_pb(m: Mode) -> pb::ReplicaMode {
    match m {
        Mode::RW => pb::ReplicaMode::Rw,
        Mode::WO => pb::ReplicaMode::Wo,
        Mode::ERR => pb::ReplicaMode::Err,
    }
}

/// `VolumeInfo.state`, the word managers before protocol 3 read.
fn volume_state_word(s: pb::VolumeState) -> &'static str {
    match s {
        pb::VolumeState::Healthy => "healthy",
        pb::VolumeState::Degraded => "degraded",
        pb::VolumeState::Faulted | pb::VolumeState::Unspecified => "faulted",
    }
}

/// The rebuild tracker (`rebuild.rs`) as the protocol's message: the enums, and the words
/// of protocols 1-2 for managers that read only those.
fn rebuild_to_pb(s: RebuildStatus) -> pb::RebuildStatusResponse {
    let (rebuild_state, state, error) = match &s.state {
        RebuildState::Idle => (pb::RebuildState::Idle, "idle", String::new()),
        RebuildState::Running => (pb::RebuildState::Running, "running", String::new()),
        RebuildState::Done => (pb::RebuildState::Done, "done", String::new()),
        RebuildState::Failed(e) => (pb::RebuildState::Failed, "failed", e.to_string()),
    };
    let (rebuild_kind, kind) = match s.kind {
        _ if rebuild_state == pb::RebuildState::Idle => (pb::RebuildKind::Unspecified, ""),
        None => (pb::RebuildKind::Unspecified, ""),
        Some(RebuildKind::Full) => (pb::RebuildKind::Full, "full"),
        Some(RebuildKind::CatchUp) => (pb::RebuildKind::CatchUp, "catch-up"),
    };
    pb::RebuildStatusResponse {
        replica: s.replica,
        state: state.into(),
        kind: kind.into(),
        rebuild_state: rebuild_state as i32,
        rebuild_kind: rebuild_kind as i32,
        bytes_done: s.bytes_done,
        bytes_total: s.bytes_total,
        bytes_copied: s.bytes_copied,
        error,
    }
}

/// A refused or failed control operation: the manager and the CLI show its text.
fn bad(e: impl std::fmt::Display) -> Status {
    Status::failed_precondition(e.to_string())
}

fn scrub_to_pb(r: ScrubReport) -> pb::ScrubReport {
    pb::ScrubReport {
        state: match r.state {
            ScrubState::Never => pb::ScrubState::Unspecified,
            ScrubState::Running => pb::ScrubState::Running,
            ScrubState::Done => pb::ScrubState::Done,
            ScrubState::Stopped => pb::ScrubState::Stopped,
            ScrubState::Failed => pb::ScrubState::Failed,
        } as i32,
        started_unix_ms: r.started_unix_ms,
        finished_unix_ms: r.finished_unix_ms,
        bytes_scanned: r.bytes_scanned,
        bytes_total: r.bytes_total,
        bytes_verified: r.bytes_verified,
        bytes_per_second: r.bytes_per_second,
        rate_limit: r.rate_limit,
        corrupt_found: r.corrupt_found,
        repaired: r.repaired,
        unrecoverable: r.unrecoverable,
        divergent: r.divergent,
        divergent_repaired: r.divergent_repaired,
        bytes_unverified: r.bytes_unverified,
        replicas: r.replicas,
        error: r.error,
    }
}

fn scrub_status(v: &Volume) -> pb::ScrubInfo {
    let (current, last) = v.scrub_status();
    pb::ScrubInfo {
        current: Some(scrub_to_pb(current)),
        last_done: last.map(scrub_to_pb),
    }
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
        Ok(Response::new(rebuild_to_pb(self.volume.rebuild_status())))
    }

    async fn scrub_start(
        &self,
        r: Request<pb::ScrubStartRequest>,
    ) -> Result<Response<pb::ScrubInfo>, Status> {
        self.volume
            .start_scrub(r.into_inner().rate_bytes_per_second)
            .map_err(bad)?;
        Ok(Response::new(scrub_status(&self.volume)))
    }

    async fn scrub_stop(
        &self,
        _: Request<pb::ScrubStopRequest>,
    ) -> Result<Response<pb::ScrubInfo>, Status> {
        self.volume.stop_scrub();
        Ok(Response::new(scrub_status(&self.volume)))
    }

    async fn scrub_status(
        &self,
        _: Request<pb::ScrubStatusRequest>,
    ) -> Result<Response<pb::ScrubInfo>, Status> {
        Ok(Response::new(scrub_status(&self.volume)))
    }
}

/// Whether any replica is still rebuilding (for logs and tests).
pub fn rebuilding(v: &Volume) -> bool {
    v.replicas().iter().any(|r| r.mode() == Mode::WO)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::replicator::VolumeError;

    /// Every state of the tracker as the protocol's enums and the words older managers read;
    /// the error travels only with a failure, the kind only once it is known.
    #[test]
    fn rebuild_states_map_to_the_protocols_enums_and_words() {
        let failure = Arc::new(VolumeError::RebuildRunning {
            volume: "v".into(),
            replica: "127.0.0.12:9".into(),
        });
        let cases = [
            (RebuildState::Idle, None, pb::RebuildState::Idle, "idle"),
            (
                RebuildState::Running,
                None,
                pb::RebuildState::Running,
                "running",
            ),
            (
                RebuildState::Running,
                Some(RebuildKind::CatchUp),
                pb::RebuildState::Running,
                "running",
            ),
            (
                RebuildState::Done,
                Some(RebuildKind::Full),
                pb::RebuildState::Done,
                "done",
            ),
            (
                RebuildState::Failed(failure.clone()),
                None,
                pb::RebuildState::Failed,
                "failed",
            ),
        ];
        for (state, kind, want, word) in cases {
            let failed = matches!(state, RebuildState::Failed(_));
            let idle = matches!(state, RebuildState::Idle);
            let got = rebuild_to_pb(RebuildStatus {
                replica: "127.0.0.12:9".into(),
                state,
                kind,
                bytes_done: 1,
                bytes_total: 2,
                bytes_copied: 3,
            });
            assert_eq!(got.rebuild_state(), want, "{got:?}");
            assert_eq!(got.state, word, "{got:?}");
            assert_eq!(got.error.is_empty(), !failed, "{got:?}");
            let (kind_enum, kind_word) = match kind {
                _ if idle => (pb::RebuildKind::Unspecified, ""),
                None => (pb::RebuildKind::Unspecified, ""),
                Some(RebuildKind::Full) => (pb::RebuildKind::Full, "full"),
                Some(RebuildKind::CatchUp) => (pb::RebuildKind::CatchUp, "catch-up"),
            };
            assert_eq!(
                (got.rebuild_kind(), got.kind.as_str()),
                (kind_enum, kind_word)
            );
            assert_eq!(
                (got.bytes_done, got.bytes_total, got.bytes_copied),
                (1, 2, 3)
            );
        }
        let got = rebuild_to_pb(RebuildStatus {
            state: RebuildState::Failed(failure),
            ..Default::default()
        });
        assert!(got.error.contains("already running"), "{got:?}");
    }
}
