//! The engine's side of the replica protocol.
//!
//! [`DataPath`] is all the replicator needs of a replica's data path: one call per request
//! (the frames [`Request`], which both transports carry: read, write with block sums, unmap,
//! flush, ping), many in flight, answered with a [`Response`] or the [`PathError`] its status
//! means. [`GrpcDataPath`] implements it over the gRPC data
//! stream of `replica.proto`: one bidirectional stream per replica, requests written to a
//! bounded queue (so a slow replica slows the volume a little instead of growing a backlog),
//! responses matched to their requests by id as they come, in any order.
//! [`super::FramedDataPath`] implements it over data frames on plain TCP (the default; much
//! less CPU per request than HTTP/2); [`DataTransport`] picks one, [`open_data_path`] opens
//! it.
//!
//! Control RPCs (info, snapshots, epochs, layer sync) use the generated tonic client
//! directly: they are rare and not on the data path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use zebu_proto::auth::Secret;
use zebu_proto::frames::{self, Request, RequestOp, Response, VolumeClaim};
use zebu_proto::ids::RequestId;
use zebu_proto::numbers::{FlushNumber, Generation};
use zebu_proto::replica as pb;
use zebu_proto::replica::data_request::Op;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_proto::sums::BlockSums;

use crate::blockdev::BoxFuture;

/// Requests queued to one replica before senders wait.
const QUEUE_DEPTH: usize = 256;

/// Which transport carries the data path to the replicas (control RPCs are always gRPC).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DataTransport {
    /// Data frames on plain TCP, on the replica's port ([`super::FramedDataPath`]).
    #[default]
    Frames,
    /// The gRPC `Data` stream ([`GrpcDataPath`]).
    Grpc,
}

impl std::fmt::Display for DataTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataTransport::Frames => "frames",
            DataTransport::Grpc => "grpc",
        })
    }
}

impl std::str::FromStr for DataTransport {
    type Err = super::UnknownTransport;
    fn from_str(s: &str) -> Result<DataTransport, super::UnknownTransport> {
        match s {
            "frames" => Ok(DataTransport::Frames),
            "grpc" => Ok(DataTransport::Grpc),
            other => Err(super::UnknownTransport(other.to_string())),
        }
    }
}

/// Opens the data path to the replica at `addr` over `transport` and presents
/// `generation`; `channel` is the replica's gRPC channel (used by the gRPC transport).
/// `local`: the replica runs on this host (frames then use its local socket if it has one).
/// `claim` names the volume in the hello; a replica of another volume refuses it.
pub async fn open_data_path(
    transport: DataTransport,
    addr: &str,
    channel: Channel,
    generation: Generation,
    claim: &VolumeClaim,
    timeout: Duration,
    local: bool,
) -> Result<std::sync::Arc<dyn DataPath>, PathError> {
    Ok(match transport {
        DataTransport::Frames => std::sync::Arc::new(
            super::FramedDataPath::open_for(addr, generation, Some(claim), timeout, local).await?,
        ),
        DataTransport::Grpc => std::sync::Arc::new(
            GrpcDataPath::open_for(channel, generation, Some(claim), timeout).await?,
        ),
    })
}

/// Why a request to a replica failed. Every kind but [`PathError::Corrupt`] on a read makes
/// the replica ERR.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PathError {
    #[error("the replica refused the request: {0}")]
    Refused(String),
    /// The request is wrong for this replica (INVALID: out of range, too large): the
    /// replica is healthy and the request changed nothing.
    #[error("the replica refused the request as invalid: {0}")]
    Invalid(String),
    #[error("I/O error on the replica: {0}")]
    Io(String),
    #[error("the replica's disk is full: {0}")]
    NoSpace(String),
    #[error("the connection to the replica is gone: {0}")]
    Disconnected(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// Blocks (4 KiB, counted from the request's first block) that fail the checksum the
    /// replica stored with them; `data` is what a read found (protocol version 3).
    #[error("{} block(s) fail their checksum on the replica: {message}", blocks.len())]
    Corrupt {
        message: String,
        blocks: Vec<u32>,
        data: Bytes,
    },
}

impl PathError {
    /// The replica answered and refused the request itself (INVALID or NO_SPACE): it is
    /// healthy, and unchanged by the request. (A fenced or closed replica's UNAVAILABLE is
    /// not one: that replica cannot serve this engine any more.)
    pub fn is_refusal(&self) -> bool {
        matches!(self, PathError::Invalid(_) | PathError::NoSpace(_))
    }
}

/// The data path to one replica: one request type, many requests in flight, answers
/// matched by id.
pub trait DataPath: Send + Sync {
    /// Sends `req` and waits for its answer; a non-OK answer is the matching [`PathError`].
    fn call(&self, req: Request) -> BoxFuture<'_, Result<Response, PathError>>;
    /// Ends the stream; requests in flight fail.
    fn close(&self);
    /// What carries the data, for status output: `frames/tcp`, `frames/local` or `grpc`.
    fn kind(&self) -> &'static str;
    /// The protocol version spoken with the replica; from
    /// [`frames::INTEGRITY_VERSION`] on, writes carry block sums, reads are checked and
    /// ping is an op.
    fn version(&self) -> u32;
}

impl dyn DataPath {
    /// Whether the replica stores and checks block checksums.
    pub fn verifies(&self) -> bool {
        self.version() >= frames::INTEGRITY_VERSION
    }

    pub async fn read(&self, id: RequestId, offset: u64, length: u64) -> Result<Bytes, PathError> {
        let resp = self
            .call(Request {
                id,
                op: RequestOp::Read { offset, length },
            })
            .await?;
        if resp.data.len() as u64 != length {
            return Err(PathError::Io(format!(
                "read of {length} bytes returned {}",
                resp.data.len()
            )));
        }
        Ok(resp.data)
    }

    /// Writes `data` with the CRC32C of its blocks (`sums`; sent only to replicas that store
    /// them).
    pub async fn write(
        &self,
        id: RequestId,
        offset: u64,
        data: Bytes,
        sums: Option<BlockSums>,
    ) -> Result<(), PathError> {
        self.call(Request {
            id,
            op: RequestOp::Write {
                offset,
                data,
                sums,
                flush: None,
            },
        })
        .await
        .map(|_| ())
    }

    /// Whether the replica takes a write and a flush as one request ([`Self::write_flush`];
    /// version 4 of either transport).
    pub fn flushes_writes(&self) -> bool {
        self.version() >= frames::FLUSH_WRITE_VERSION
    }

    /// Writes `data` as [`Self::write`] does, then flushes with `number` as
    /// [`Self::flush`] does, in one round trip; returns the durable flush number. Refused
    /// here, before anything is sent, on a path of an older version: its replica would not
    /// know the flush was asked for.
    pub async fn write_flush(
        &self,
        id: RequestId,
        offset: u64,
        data: Bytes,
        sums: Option<BlockSums>,
        number: FlushNumber,
    ) -> Result<FlushNumber, PathError> {
        if !self.flushes_writes() {
            return Err(PathError::Io(format!(
                "a write with a flush needs protocol version {}; this replica speaks {}",
                frames::FLUSH_WRITE_VERSION,
                self.version()
            )));
        }
        let resp = self
            .call(Request {
                id,
                op: RequestOp::Write {
                    offset,
                    data,
                    sums,
                    flush: Some(number.0),
                },
            })
            .await?;
        Ok(FlushNumber(resp.flush_number))
    }

    /// Deallocates (or, with `zero_fill`, writes zeros over) the range; it reads as zeros.
    pub async fn unmap(
        &self,
        id: RequestId,
        offset: u64,
        length: u64,
        zero_fill: bool,
    ) -> Result<(), PathError> {
        self.call(Request {
            id,
            op: RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            },
        })
        .await
        .map(|_| ())
    }

    /// Makes every write completed before it durable; returns the durable flush number.
    pub async fn flush(
        &self,
        id: RequestId,
        number: FlushNumber,
    ) -> Result<FlushNumber, PathError> {
        let resp = self
            .call(Request {
                id,
                op: RequestOp::Flush {
                    flush_number: number.0,
                },
            })
            .await?;
        Ok(FlushNumber(resp.flush_number))
    }

    /// A cheap request that only a replica serving requests answers: ping from version 3
    /// on, a 4 KiB read before (an older replica knows no ping).
    pub async fn ping(&self, id: RequestId) -> Result<(), PathError> {
        let op = if self.verifies() {
            RequestOp::Ping
        } else {
            RequestOp::Read {
                offset: 0,
                length: 4096,
            }
        };
        self.call(Request { id, op }).await.map(|_| ())
    }
}

/// A replica's answer as a result: OK, or the [`PathError`] its status means.
pub(super) fn answer_result(resp: Response) -> Result<Response, PathError> {
    match resp.status {
        pb::Status::Ok => Ok(resp),
        pb::Status::Invalid => Err(PathError::Invalid(resp.message)),
        pb::Status::Unavailable => Err(PathError::Refused(resp.message)),
        pb::Status::NoSpace => Err(PathError::NoSpace(resp.message)),
        pb::Status::IoError => Err(PathError::Io(resp.message)),
        pb::Status::Corrupt => Err(PathError::Corrupt {
            message: resp.message,
            blocks: resp.corrupt,
            data: resp.data,
        }),
    }
}

/// Whether a hello refusal says the replica does not speak the version asked for (an older
/// build's refusal carries no other sign of the reason).
pub(super) fn refused_for_version(e: &PathError) -> bool {
    matches!(e, PathError::Refused(why) if why.contains("protocol version"))
}

type Pending = Arc<Mutex<HashMap<RequestId, oneshot::Sender<pb::DataResponse>>>>;

/// [`DataPath`] over the gRPC data stream.
pub struct GrpcDataPath {
    tx: Mutex<Option<mpsc::Sender<pb::DataRequest>>>,
    pending: Pending,
    closed: Arc<AtomicBool>,
    version: u32,
}

/// Opens a channel to a replica at `addr` (`host:port`). No per-request timeout is set on
/// the channel: data requests get the I/O timeout from the replicator, and control RPCs that
/// move data (merges, layer copies) get their own, longer ones at the call site.
pub async fn connect_channel(addr: &str, timeout: Duration) -> Result<Channel, PathError> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| PathError::Disconnected(format!("bad address {addr}: {e}")))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(true);
    // Over TLS with `--tls-ca`: HTTP/2 inside the TLS stream, every reconnect through the
    // handshake again (`zebu_proto::tls::grpc_channel`, shared with the manager's clients).
    let connected = zebu_proto::tls::grpc_channel(endpoint, addr, replica_tls(), timeout).await;
    connected.map_err(|e| {
        let why = std::error::Error::source(&e).map_or_else(String::new, |s| format!(": {s}"));
        PathError::Disconnected(format!("connect {addr}: {e}{why}"))
    })
}

/// The CA replicas' certificates are checked against, once [`set_replica_tls`] gave it.
static REPLICA_TLS: std::sync::OnceLock<zebu_proto::tls::TlsConnector> = std::sync::OnceLock::new();

/// Connects to every replica over TLS from now on (`zebu_proto::tls`), trusting the
/// certificates `connector` trusts; once only.
pub fn set_replica_tls(
    connector: zebu_proto::tls::TlsConnector,
) -> Result<(), super::TlsAlreadySet> {
    REPLICA_TLS.set(connector).map_err(|_| super::TlsAlreadySet)
}

pub(super) fn replica_tls() -> Option<&'static zebu_proto::tls::TlsConnector> {
    REPLICA_TLS.get()
}

/// The volume's secret, once [`set_volume_secret`] gave it. Process-wide because one engine
/// process serves one volume; every gRPC call and frames hello to a replica then proves it
/// (`zebu_proto::auth`).
static VOLUME_SECRET: std::sync::OnceLock<Secret> = std::sync::OnceLock::new();

/// Sets the volume's secret for every replica connection of this process; once only.
pub fn set_volume_secret(secret: Secret) -> Result<(), super::SecretAlreadySet> {
    VOLUME_SECRET
        .set(secret)
        .map_err(|_| super::SecretAlreadySet)
}

pub(super) fn volume_secret() -> Option<&'static Secret> {
    VOLUME_SECRET.get()
}

/// Adds a fresh token to every gRPC call when the volume has a secret.
#[derive(Clone, Copy, Default)]
pub struct AddToken;

impl Interceptor for AddToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(secret) = volume_secret() {
            let token = secret.grpc_token(zebu_proto::auth::now_secs());
            let value = token
                .parse()
                .map_err(|_| tonic::Status::internal("invariant: a hex token is ASCII"))?;
            req.metadata_mut()
                .insert(zebu_proto::auth::GRPC_AUTH_HEADER, value);
        }
        Ok(req)
    }
}

/// A replica's gRPC client as the engine uses it: authenticated when the volume has a secret.
pub type ControlClient = ReplicaClient<InterceptedService<Channel, AddToken>>;

/// A control client with the message limits the replica uses.
pub fn control_client(channel: Channel) -> ControlClient {
    ReplicaClient::with_interceptor(channel, AddToken)
        .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(pb::MAX_MESSAGE_BYTES)
}

impl GrpcDataPath {
    /// Opens the data stream and presents `generation` in the newest protocol version, or in
    /// an older one (3, then 1) to a replica of an older build that refuses it; fails if the
    /// replica refuses the generation.
    pub async fn open(
        channel: Channel,
        generation: Generation,
        timeout: Duration,
    ) -> Result<GrpcDataPath, PathError> {
        GrpcDataPath::open_for(channel, generation, None, timeout).await
    }

    /// [`GrpcDataPath::open`] naming the volume in the hello (version 3; a version 1 hello
    /// carries no volume, and a replica that belongs to one refuses it).
    pub async fn open_for(
        channel: Channel,
        generation: Generation,
        claim: Option<&VolumeClaim>,
        timeout: Duration,
    ) -> Result<GrpcDataPath, PathError> {
        // Newest first; a replica of an older build refuses a version it does not know, and
        // gets the next one down: 3 (checksums, the volume's name), then 1 (neither).
        let tries = [
            (pb::PROTOCOL_VERSION, claim),
            (frames::INTEGRITY_VERSION, claim),
            (pb::MIN_PROTOCOL_VERSION, None),
        ];
        let mut result = Err(PathError::Refused("no protocol version to try".into()));
        for (i, attempt) in tries.into_iter().enumerate() {
            if i > 0
                && let Err(e) = &result
            {
                tracing::info!("gRPC data stream: {e}; trying version {}", attempt.0);
            }
            result = GrpcDataPath::open_in(channel.clone(), generation, timeout, attempt).await;
            match &result {
                Err(e) if refused_for_version(e) => continue,
                _ => break,
            }
        }
        result
    }

    async fn open_in(
        channel: Channel,
        generation: Generation,
        timeout: Duration,
        (version, claim): (u32, Option<&VolumeClaim>),
    ) -> Result<GrpcDataPath, PathError> {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let hello = pb::DataRequest {
            id: 0,
            op: Some(Op::Hello(pb::DataHello {
                protocol_version: version,
                generation: generation.0,
                volume_uuid: claim.map(|c| c.uuid.clone()).unwrap_or_default(),
                adopt_volume: claim.is_some_and(|c| c.adopt),
            })),
        };
        tx.send(hello)
            .await
            .map_err(|_| PathError::Disconnected("stream closed before hello".into()))?;
        let mut client = control_client(channel);
        let call = async {
            let mut inbound = client
                .data(ReceiverStream::new(rx))
                .await
                .map_err(|s| PathError::Refused(s.message().to_string()))?
                .into_inner();
            match inbound.message().await {
                Ok(Some(r)) if r.status == pb::Status::Ok as i32 => Ok(inbound),
                Ok(Some(r)) => Err(PathError::Refused(r.message)),
                Ok(None) => Err(PathError::Disconnected(
                    "stream ended before the hello answer".into(),
                )),
                Err(s) => Err(PathError::Refused(s.message().to_string())),
            }
        };
        let mut inbound = tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| PathError::Timeout(timeout))??;
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let (p, c) = (pending.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok(Some(resp)) = inbound.message().await {
                let waiter = p
                    .lock()
                    .expect("invariant: pending lock")
                    .remove(&RequestId(resp.id));
                if let Some(w) = waiter {
                    let _ = w.send(resp);
                }
            }
            c.store(true, Ordering::Release);
            // Dropping the senders fails every request still waiting.
            p.lock().expect("invariant: pending lock").clear();
        });
        Ok(GrpcDataPath {
            tx: Mutex::new(Some(tx)),
            pending,
            closed,
            version,
        })
    }

    async fn send(&self, req: Request) -> Result<Response, PathError> {
        let id = req.id;
        let msg = pb::DataRequest::from(req.for_version(self.version));
        let (wtx, wrx) = oneshot::channel();
        self.pending
            .lock()
            .expect("invariant: pending lock")
            .insert(id, wtx);
        if self.closed.load(Ordering::Acquire) {
            self.pending
                .lock()
                .expect("invariant: pending lock")
                .remove(&id);
            return Err(PathError::Disconnected("data stream ended".into()));
        }
        let tx = self.tx.lock().expect("invariant: tx lock").clone();
        let sent = match tx {
            Some(tx) => tx.send(msg).await.is_ok(),
            None => false,
        };
        if !sent {
            self.pending
                .lock()
                .expect("invariant: pending lock")
                .remove(&id);
            return Err(PathError::Disconnected("data stream closed".into()));
        }
        let resp = wrx
            .await
            .map_err(|_| PathError::Disconnected("data stream ended".into()))?;
        answer_result(Response::from(resp))
    }
}

impl Drop for GrpcDataPath {
    fn drop(&mut self) {
        self.close();
    }
}

impl DataPath for GrpcDataPath {
    fn call(&self, req: Request) -> BoxFuture<'_, Result<Response, PathError>> {
        Box::pin(self.send(req))
    }

    fn version(&self) -> u32 {
        self.version
    }

    fn kind(&self) -> &'static str {
        "grpc"
    }

    fn close(&self) {
        self.tx.lock().expect("invariant: tx lock").take();
        self.closed.store(true, Ordering::Release);
        self.pending
            .lock()
            .expect("invariant: pending lock")
            .clear();
    }
}
