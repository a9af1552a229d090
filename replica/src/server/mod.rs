//! The replica's server: serves one replica directory (`zebu.replica.v1.Replica`) over gRPC,
//! and its data stream also as data frames (`zebu_proto::frames`) on the same port
//! ([`ReplicaServer::serve`] tells them apart by the first byte; see `listen.rs`) and on a
//! local Unix socket for clients on the same host.
//!
//! # State and locking
//!
//! One [`ReplicaServer`] owns the directory, the [`IoEngine`] and a [`State`] behind a tokio
//! `RwLock`: the open [`Replica`] (or none after `Close`), the highest data-stream
//! generation accepted, and a count of closes. Every data request and control RPC runs
//! under a *read* guard, so many run at once. The three things that change who may do I/O
//! take the *write* guard: a data stream's `hello` with a higher generation, `Close` and
//! `Open`. Because tokio's lock is fair, taking the write guard waits for every request in
//! flight and holds back new ones, which makes fencing strict: once a stream with
//! generation `g` has its hello answered, no request of an older stream touches the store
//! again (each request re-checks the generation under its guard and is answered
//! `UNAVAILABLE` instead).
//!
//! Open data streams learn about fencing and closes through a `watch` channel carrying
//! `(generation, closes)`; a stream whose generation was superseded, or that started
//! before a close, ends with an error status (gRPC) or an END frame (frames). Both transports
//! share the hello, fencing and execution code (`data.rs`), so a generation accepted on one
//! fences streams of the other.
//!
//! # Limits
//!
//! gRPC messages are limited to [`MAX_MESSAGE_BYTES`] both ways; a larger message ends the
//! stream that carried it (the transport cannot skip it) with `RESOURCE_EXHAUSTED`, and the
//! server keeps serving other streams. One read or write moves at most [`MAX_IO_BYTES`];
//! larger ones are answered `STATUS_INVALID`. A data stream executes at most
//! [`MAX_IN_FLIGHT`] requests and [`MAX_BYTES_IN_FLIGHT`] of payload at once and stops
//! reading its input beyond that, so a flood is back-pressured by HTTP/2 flow control
//! instead of filling memory. Byte budgets are the port's, not each stream's: all streams
//! together hold at most [`PORT_BYTES_IN_FLIGHT`] of payload, and frames connections at
//! most [`PORT_BYTES_RECEIVING`] of write payload still arriving, taken before its buffer
//! is allocated (issue 18: eight connections each holding a partly sent 16 MiB write took
//! 132 MB before).

mod convert;
mod data;
mod frames;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod layer;
mod listen;

pub use convert::{DataStatus, code_of, data_status_of, info_to_pb, to_status};

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::{OwnedRwLockReadGuard, RwLock, watch};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, Span, info, info_span};
use zebu_proto::auth::{GRPC_AUTH_HEADER, ReplayGuard, Secret, now_secs};
use zebu_proto::replica as pb;
use zebu_proto::replica::replica_server::{Replica as ReplicaRpc, ReplicaServer as ReplicaSvc};

use crate::io::IoEngine;
use crate::store::{Replica, ReplicaInfo};

pub use zebu_proto::replica::{MAX_IO_BYTES, MAX_MESSAGE_BYTES};
/// Requests one data stream executes at once.
pub const MAX_IN_FLIGHT: usize = 256;
/// The most payload one request may count against the port's budget (a larger one is
/// refused without allocating anyway); see [`PORT_BYTES_IN_FLIGHT`] for the budget itself.
pub const MAX_BYTES_IN_FLIGHT: u64 = 128 << 20;
/// Read and write payload all data streams of the port hold at once (requests running or
/// answered but not yet sent): one budget across connections, so more connections do not
/// mean more memory.
pub const PORT_BYTES_IN_FLIGHT: u64 = 256 << 20;
/// Write payload being received (its header read, its data not all there) on all frames
/// connections at once. A connection takes its share *before* the buffer for the payload is
/// allocated, so clients that send headers and trickle (or never send) their data hold at
/// most this much memory, however many connections they open.
pub const PORT_BYTES_RECEIVING: u64 = 32 << 20;
/// Size of the chunks `ReadLayer` streams.
pub const LAYER_CHUNK_BYTES: u64 = 1 << 20;
/// The largest range one `Scrub` call verifies.
pub const MAX_SCRUB_BYTES: u64 = 64 << 20;

/// What the RwLock guards; see the module docs.
struct State {
    replica: Option<Arc<Replica>>,
    /// Highest generation a data stream has been accepted with (0: none yet).
    generation: u64,
    /// Bumped by every `Close`, so streams opened before it end and stay ended.
    closes: u64,
    /// The info at the last close, so `Info` on a closed replica still says what it is.
    last_info: Option<ReplicaInfo>,
}

/// The part of [`State`] open data streams watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fence {
    generation: u64,
    closes: u64,
}

struct Shared {
    dir: PathBuf,
    io: IoEngine,
    state: Arc<RwLock<State>>,
    fence: watch::Sender<Fence>,
    span: Span,
    /// The local socket's name (`@…`, abstract), once [`ReplicaServer::serve`] bound it.
    local_socket: std::sync::OnceLock<String>,
    /// The volume's secret: when set, only clients that prove they hold it are served
    /// (`zebu_proto::auth`).
    secret: Option<Secret>,
    /// gRPC tokens already used.
    replay: ReplayGuard,
    /// [`PORT_BYTES_IN_FLIGHT`], in `data.rs` budget units, shared by every data stream.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// [`PORT_BYTES_RECEIVING`], in the same units, shared by every frames connection.
    receiving: Arc<tokio::sync::Semaphore>,
}

/// The gRPC service of one replica directory. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct ReplicaServer {
    shared: Arc<Shared>,
    /// Set: the port serves TLS only (`zebu_proto::tls`; `listen.rs`).
    tls: Option<zebu_proto::tls::TlsAcceptor>,
}

/// A read guard on the state together with the open replica it holds.
struct Current {
    _guard: OwnedRwLockReadGuard<State>,
    replica: Arc<Replica>,
}

impl Shared {
    /// The open replica, under a read guard held as long as the result lives.
    async fn current(&self) -> Result<Current, Status> {
        let guard = self.state.clone().read_owned().await;
        match guard.replica.clone() {
            Some(replica) => Ok(Current {
                _guard: guard,
                replica,
            }),
            None => Err(Status::unavailable(format!(
                "replica {} is closed (call Open)",
                self.dir.display()
            ))),
        }
    }

    fn rpc_span(&self, rpc: &'static str) -> Span {
        info_span!(parent: &self.span, "rpc", rpc)
    }
}

impl ReplicaServer {
    /// A server for the replica in `dir`, already opened as `replica`, that serves everyone.
    pub fn new(dir: &Path, io: IoEngine, replica: Arc<Replica>) -> ReplicaServer {
        ReplicaServer::with_secret(dir, io, replica, None)
    }

    /// [`ReplicaServer::new`] that, given a secret, serves only clients proving they hold it.
    pub fn with_secret(
        dir: &Path,
        io: IoEngine,
        replica: Arc<Replica>,
        secret: Option<Secret>,
    ) -> ReplicaServer {
        let info = replica.info();
        let span = info_span!("replica", dir = %dir.display(), id = %info.replica_id);
        let fence = Fence {
            generation: info.generation,
            closes: 0,
        };
        let state = State {
            replica: Some(replica),
            generation: info.generation,
            closes: 0,
            last_info: None,
        };
        ReplicaServer {
            shared: Arc::new(Shared {
                dir: dir.to_path_buf(),
                io,
                state: Arc::new(RwLock::new(state)),
                fence: watch::Sender::new(fence),
                span,
                local_socket: std::sync::OnceLock::new(),
                secret,
                replay: ReplayGuard::default(),
                in_flight: Arc::new(tokio::sync::Semaphore::new(data::units_of_bytes(
                    PORT_BYTES_IN_FLIGHT,
                ))),
                receiving: Arc::new(tokio::sync::Semaphore::new(data::units_of_bytes(
                    PORT_BYTES_RECEIVING,
                ))),
            }),
            tls: None,
        }
    }

    /// Serves the port over TLS only, with this certificate (`zebu_proto::tls`): clients
    /// that do not start a TLS handshake are dropped.
    pub fn with_tls(mut self, acceptor: zebu_proto::tls::TlsAcceptor) -> ReplicaServer {
        self.tls = Some(acceptor);
        self
    }

    /// The tonic service, with the message size limits set and, with a secret, every call's
    /// token checked before it runs.
    pub fn into_service(self) -> InterceptedService<ReplicaSvc<ReplicaServer>, CheckToken> {
        let check = CheckToken(self.shared.clone());
        let svc = ReplicaSvc::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        InterceptedService::new(svc, check)
    }

    /// Closes the replica (waiting for requests in flight) and ends every data stream.
    /// Idempotent: closing a closed replica does nothing.
    pub async fn close(&self) -> crate::Result<()> {
        let shared = &self.shared;
        let mut state = shared.state.write().await;
        let Some(replica) = state.replica.take() else {
            return Ok(());
        };
        state.last_info = Some(replica.info());
        state.closes += 1;
        let closes = state.closes;
        shared.fence.send_modify(|f| f.closes = closes);
        let result = replica.close().await;
        info!(parent: &shared.span, ok = result.is_ok(), "replica closed");
        result
    }

    /// Opens the replica again after [`ReplicaServer::close`]; returns its info.
    pub async fn open(&self) -> crate::Result<ReplicaInfo> {
        let shared = &self.shared;
        let mut state = shared.state.write().await;
        if let Some(replica) = &state.replica {
            return Ok(replica.info());
        }
        let replica = Replica::open(&shared.dir, shared.io.clone()).await?;
        let info = replica.info();
        state.generation = state.generation.max(info.generation);
        state.replica = Some(replica);
        state.last_info = None;
        info!(parent: &shared.span, "replica opened");
        Ok(info)
    }
}

/// Checks the gRPC token of every call when the replica has a secret (`zebu_proto::auth`);
/// a call without a valid one is refused UNAUTHENTICATED before it runs.
#[derive(Clone)]
pub struct CheckToken(Arc<Shared>);

impl Interceptor for CheckToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(secret) = &self.0.secret else {
            return Ok(req);
        };
        let token = req
            .metadata()
            .get(GRPC_AUTH_HEADER)
            .and_then(|v| v.to_str().ok());
        match secret.check_grpc_token(token, now_secs(), &self.0.replay) {
            Ok(()) => Ok(req),
            Err(e) => {
                info!(parent: &self.0.span, "gRPC call refused: {e}");
                Err(Status::unauthenticated(e.to_string()))
            }
        }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Runs `fut` (a store call) on the current replica and answers with the replica's info.
macro_rules! control {
    ($self:ident, $rpc:literal, |$r:ident| $body:expr) => {{
        let shared = $self.shared.clone();
        async move {
            let cur = shared.current().await?;
            let $r = &cur.replica;
            $body.await.map_err(to_status)?;
            Ok(Response::new(info_to_pb(cur.replica.info(), true)))
        }
        .instrument($self.shared.rpc_span($rpc))
        .await
    }};
}

#[tonic::async_trait]
impl ReplicaRpc for ReplicaServer {
    type DataStream = BoxStream<pb::DataResponse>;
    type ReadLayerStream = BoxStream<pb::LayerChunk>;

    async fn data(
        &self,
        request: Request<Streaming<pb::DataRequest>>,
    ) -> Result<Response<Self::DataStream>, Status> {
        let rx = data::start(self.shared.clone(), request.into_inner());
        Ok(Response::new(Box::pin(rx)))
    }

    async fn open(
        &self,
        _: Request<pb::OpenRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let info = ReplicaServer::open(self)
            .instrument(self.shared.rpc_span("open"))
            .await
            .map_err(to_status)?;
        Ok(Response::new(info_to_pb(info, true)))
    }

    async fn close(
        &self,
        _: Request<pb::CloseRequest>,
    ) -> Result<Response<pb::CloseResponse>, Status> {
        ReplicaServer::close(self)
            .instrument(self.shared.rpc_span("close"))
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::CloseResponse {}))
    }

    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let state = self.shared.state.read().await;
        match (&state.replica, &state.last_info) {
            (Some(r), _) => Ok(Response::new(info_to_pb(r.info(), true))),
            (None, Some(last)) => Ok(Response::new(info_to_pb(last.clone(), false))),
            (None, None) => Err(Status::unavailable("the replica is closed")),
        }
    }

    async fn snapshot_create(
        &self,
        request: Request<pb::SnapshotCreateRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let req = request.into_inner();
        let labels = req.labels.into_iter().collect();
        control!(self, "snapshot_create", |r| r.snapshot_create(
            &req.name,
            req.user_created,
            labels
        ))
    }

    async fn snapshot_delete(
        &self,
        request: Request<pb::SnapshotDeleteRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let name = request.into_inner().name;
        control!(self, "snapshot_delete", |r| r.snapshot_delete(&name))
    }

    async fn snapshot_revert(
        &self,
        request: Request<pb::SnapshotRevertRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let name = request.into_inner().name;
        control!(self, "snapshot_revert", |r| r.snapshot_revert(&name))
    }

    async fn snapshot_purge(
        &self,
        _: Request<pb::SnapshotPurgeRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        control!(self, "snapshot_purge", |r| r.snapshot_purge())
    }

    async fn expand(
        &self,
        request: Request<pb::ExpandRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let req = request.into_inner();
        if req.check_only {
            control!(self, "expand_check", |r| r.expand_check(req.size))
        } else {
            control!(self, "expand", |r| r.expand(req.size))
        }
    }

    async fn set_epoch(
        &self,
        request: Request<pb::SetEpochRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let req = request.into_inner();
        control!(self, "set_epoch", |r| r.set_epoch(req.epoch, req.members))
    }

    async fn written_since(
        &self,
        request: Request<pb::WrittenSinceRequest>,
    ) -> Result<Response<pb::WrittenSinceResponse>, Status> {
        let flush = request.into_inner().flush;
        let current = self.shared.current().await?;
        Ok(Response::new(pb::WrittenSinceResponse {
            region_size: current.replica.info().region_size,
            regions: current.replica.regions_written_since(flush),
        }))
    }

    async fn checksums(
        &self,
        request: Request<pb::ChecksumsRequest>,
    ) -> Result<Response<pb::ChecksumsResponse>, Status> {
        let req = request.into_inner();
        if req.length > MAX_IO_BYTES * 16 {
            return Err(Status::invalid_argument(format!(
                "checksum range of {} bytes is larger than the limit of {} bytes",
                req.length,
                MAX_IO_BYTES * 16
            )));
        }
        let current = self.shared.current().await?;
        let crc32c = current
            .replica
            .checksums(req.offset, req.length, req.block_size)
            .instrument(self.shared.rpc_span("checksums"))
            .await
            .map_err(to_status)?;
        let adopted = current.replica.adopted_in(req.offset, req.length);
        Ok(Response::new(pb::ChecksumsResponse { crc32c, adopted }))
    }

    async fn scrub(
        &self,
        request: Request<pb::ScrubRequest>,
    ) -> Result<Response<pb::ScrubResponse>, Status> {
        let req = request.into_inner();
        if req.length > MAX_SCRUB_BYTES {
            return Err(Status::invalid_argument(format!(
                "scrub range of {} bytes is larger than the limit of {MAX_SCRUB_BYTES} bytes",
                req.length
            )));
        }
        let current = self.shared.current().await?;
        let r = current
            .replica
            .scrub(req.offset, req.length)
            .instrument(self.shared.rpc_span("scrub"))
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ScrubResponse {
            bad: r
                .bad
                .into_iter()
                .map(|b| pb::BadBlock {
                    layer: b.layer,
                    offset: b.offset,
                    visible: b.visible,
                })
                .collect(),
            crc32c: r.sums,
            bytes_verified: r.bytes_verified,
            bytes_unverified: r.bytes_unverified,
        }))
    }

    async fn list_extents(
        &self,
        request: Request<pb::ListExtentsRequest>,
    ) -> Result<Response<pb::ListExtentsResponse>, Status> {
        layer::list_extents(&self.shared, request.into_inner())
            .instrument(self.shared.rpc_span("list_extents"))
            .await
            .map(Response::new)
    }

    async fn read_layer(
        &self,
        request: Request<pb::ReadLayerRequest>,
    ) -> Result<Response<Self::ReadLayerStream>, Status> {
        let stream = layer::read_layer(self.shared.clone(), request.into_inner())
            .instrument(self.shared.rpc_span("read_layer"))
            .await?;
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write_layer(
        &self,
        request: Request<Streaming<pb::WriteLayerRequest>>,
    ) -> Result<Response<pb::WriteLayerResponse>, Status> {
        layer::write_layer(&self.shared, request.into_inner())
            .instrument(self.shared.rpc_span("write_layer"))
            .await
            .map(Response::new)
    }
}
