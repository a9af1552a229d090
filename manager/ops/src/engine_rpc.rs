//! Every call the manager makes to an engine's control API (`zebu_proto::engine`), each
//! bounded by a timeout so a hung engine cannot stall a node agent, a controller or a user's
//! request. This module is the only place in the manager that speaks to engines: operations
//! ([`crate::Ops`]), the controllers and the node agent all come through here.

use std::time::Duration;

use zebu_proto::engine as pb;
use zebu_proto::engine::engine_client::EngineClient;

const RPC_TIMEOUT: Duration = Duration::from_secs(3);
/// A snapshot quiesces I/O and asks every replica to freeze its head;
/// deleting one merges layers. Both take longer than a status call.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum EngineRpcError {
    #[error("engine at {addr}: cannot connect: {source}")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The engine answered with an error; `code` says whose mistake it was (the engine
    /// refuses what cannot be done now with `FailedPrecondition`).
    #[error("engine at {addr}: {call} failed: {message}")]
    Call {
        addr: String,
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("engine at {addr}: {call} timed out after {secs} s")]
    Timeout {
        addr: String,
        call: &'static str,
        secs: u64,
    },
}

async fn connect(addr: &str) -> Result<EngineClient<tonic::transport::Channel>, EngineRpcError> {
    let fut = EngineClient::connect(format!("http://{addr}"));
    match tokio::time::timeout(RPC_TIMEOUT, fut).await {
        Ok(r) => r.map_err(|source| EngineRpcError::Connect {
            addr: addr.to_string(),
            source,
        }),
        Err(_) => Err(EngineRpcError::Timeout {
            addr: addr.to_string(),
            call: "connect",
            secs: RPC_TIMEOUT.as_secs(),
        }),
    }
}

async fn bounded<T>(
    addr: &str,
    call: &'static str,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, EngineRpcError> {
    bounded_by(RPC_TIMEOUT, addr, call, fut).await
}

async fn bounded_by<T>(
    limit: Duration,
    addr: &str,
    call: &'static str,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, EngineRpcError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(EngineRpcError::Call {
            addr: addr.to_string(),
            call,
            code: s.code(),
            message: s.message().to_string(),
        }),
        Err(_) => Err(EngineRpcError::Timeout {
            addr: addr.to_string(),
            call,
            secs: limit.as_secs(),
        }),
    }
}

pub async fn info(addr: &str) -> Result<pb::VolumeInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded(addr, "Info", c.info(pb::InfoRequest {})).await
}

/// Add (or re-add) a replica; the engine brings it in sync in the background.
pub async fn replica_add(addr: &str, replica: &str) -> Result<pb::VolumeInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::ReplicaAddRequest {
        address: replica.to_string(),
    };
    bounded(addr, "ReplicaAdd", c.replica_add(req)).await
}

pub async fn replica_remove(addr: &str, replica: &str) -> Result<pb::VolumeInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::ReplicaRemoveRequest {
        address: replica.to_string(),
    };
    bounded(addr, "ReplicaRemove", c.replica_remove(req)).await
}

/// The engine's current or last rebuild.
pub async fn rebuild_status(addr: &str) -> Result<pb::RebuildStatusResponse, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded(
        addr,
        "RebuildStatus",
        c.rebuild_status(pb::RebuildStatusRequest {}),
    )
    .await
}

/// Take a snapshot of the volume on every replica.
pub async fn snapshot_create(addr: &str, name: &str) -> Result<pb::Snapshots, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::SnapshotCreateRequest {
        name: name.to_string(),
        labels: Default::default(),
    };
    bounded_by(
        SNAPSHOT_TIMEOUT,
        addr,
        "SnapshotCreate",
        c.snapshot_create(req),
    )
    .await
}

/// The volume's snapshots (and its live head), oldest first.
pub async fn snapshot_list(addr: &str) -> Result<pb::Snapshots, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded(
        addr,
        "SnapshotList",
        c.snapshot_list(pb::SnapshotListRequest {}),
    )
    .await
}

/// Delete a snapshot (its data merges into its child).
pub async fn snapshot_delete(addr: &str, name: &str) -> Result<pb::Snapshots, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::SnapshotDeleteRequest {
        name: name.to_string(),
    };
    bounded_by(
        SNAPSHOT_TIMEOUT,
        addr,
        "SnapshotDelete",
        c.snapshot_delete(req),
    )
    .await
}

/// Make a snapshot the volume's data again (every replica drops its head and starts a new
/// one on the snapshot). The engine quiesces I/O; clients that cached data would not know,
/// which is why ops asks for a volume without a frontend.
pub async fn snapshot_revert(addr: &str, name: &str) -> Result<pb::Snapshots, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::SnapshotRevertRequest {
        name: name.to_string(),
    };
    bounded_by(
        SNAPSHOT_TIMEOUT,
        addr,
        "SnapshotRevert",
        c.snapshot_revert(req),
    )
    .await
}

/// Grow the volume on every replica, then for the frontends.
pub async fn expand(addr: &str, size: u64) -> Result<pb::VolumeInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded_by(
        SNAPSHOT_TIMEOUT,
        addr,
        "Expand",
        c.expand(pb::ExpandRequest { size }),
    )
    .await
}

/// The first control protocol version with scrubs (`ScrubStart`/`ScrubStop`/`ScrubStatus`).
pub const SCRUB_PROTOCOL_VERSION: u32 = 2;

/// Start a background scrub of the whole volume (`rate`: data bytes per second over every
/// replica, 0 for the engine's default); refused while one runs.
pub async fn scrub_start(addr: &str, rate: u64) -> Result<pb::ScrubInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    let req = pb::ScrubStartRequest {
        rate_bytes_per_second: rate,
    };
    bounded(addr, "ScrubStart", c.scrub_start(req)).await
}

/// Stop the running scrub, if any.
pub async fn scrub_stop(addr: &str) -> Result<pb::ScrubInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded(addr, "ScrubStop", c.scrub_stop(pb::ScrubStopRequest {})).await
}

/// The engine's current or last scrub, and its last finished one.
pub async fn scrub_status(addr: &str) -> Result<pb::ScrubInfo, EngineRpcError> {
    let mut c = connect(addr).await?;
    bounded(
        addr,
        "ScrubStatus",
        c.scrub_status(pb::ScrubStatusRequest {}),
    )
    .await
}
