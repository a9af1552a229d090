//! The engine's side of the replica protocol.
//!
//! [`DataPath`] is all the replicator needs of a replica's data path: read, write, unmap and
//! flush with request ids, many in flight. [`GrpcDataPath`] implements it over the gRPC data
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
use tonic::transport::{Channel, Endpoint};
use zebu_proto::replica as pb;
use zebu_proto::replica::data_request::Op;
use zebu_proto::replica::replica_client::ReplicaClient;

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
    type Err = String;
    fn from_str(s: &str) -> Result<DataTransport, String> {
        match s {
            "frames" => Ok(DataTransport::Frames),
            "grpc" => Ok(DataTransport::Grpc),
            other => Err(format!(
                "unknown data transport '{other}' (use frames or grpc)"
            )),
        }
    }
}

/// Opens the data path to the replica at `addr` over `transport` and presents
/// `generation`; `channel` is the replica's gRPC channel (used by the gRPC transport).
/// `local`: the replica runs on this host (frames then use its local socket if it has one).
pub async fn open_data_path(
    transport: DataTransport,
    addr: &str,
    channel: Channel,
    generation: u64,
    timeout: Duration,
    local: bool,
) -> Result<std::sync::Arc<dyn DataPath>, PathError> {
    Ok(match transport {
        DataTransport::Frames => std::sync::Arc::new(
            super::FramedDataPath::open(addr, generation, timeout, local).await?,
        ),
        DataTransport::Grpc => {
            std::sync::Arc::new(GrpcDataPath::open(channel, generation, timeout).await?)
        }
    })
}

/// Why a request to a replica failed. Every kind makes the replica ERR.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PathError {
    #[error("the replica refused the request: {0}")]
    Refused(String),
    #[error("I/O error on the replica: {0}")]
    Io(String),
    #[error("the replica's disk is full: {0}")]
    NoSpace(String),
    #[error("the connection to the replica is gone: {0}")]
    Disconnected(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// The data path to one replica.
pub trait DataPath: Send + Sync {
    fn read(&self, id: u64, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, PathError>>;
    fn write(&self, id: u64, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), PathError>>;
    /// Deallocates (or, with `zero_fill`, writes zeros over) the range; it reads as zeros.
    fn unmap(
        &self,
        id: u64,
        offset: u64,
        len: u64,
        zero_fill: bool,
    ) -> BoxFuture<'_, Result<(), PathError>>;
    /// Makes every write completed before it durable; returns the durable flush number.
    fn flush(&self, id: u64, number: u64) -> BoxFuture<'_, Result<u64, PathError>>;
    /// Ends the stream; requests in flight fail.
    fn close(&self);
    /// What carries the data, for status output: `frames/tcp`, `frames/local` or `grpc`.
    fn kind(&self) -> &'static str;
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<pb::DataResponse>>>>;

/// [`DataPath`] over the gRPC data stream.
pub struct GrpcDataPath {
    tx: Mutex<Option<mpsc::Sender<pb::DataRequest>>>,
    pending: Pending,
    closed: Arc<AtomicBool>,
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
    endpoint
        .connect()
        .await
        .map_err(|e| PathError::Disconnected(format!("connect {addr}: {e}")))
}

/// A control client with the message limits the replica uses.
pub fn control_client(channel: Channel) -> ReplicaClient<Channel> {
    ReplicaClient::new(channel)
        .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(pb::MAX_MESSAGE_BYTES)
}

impl GrpcDataPath {
    /// Opens the data stream and presents `generation`; fails if the replica refuses it.
    pub async fn open(
        channel: Channel,
        generation: u64,
        timeout: Duration,
    ) -> Result<GrpcDataPath, PathError> {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let hello = pb::DataRequest {
            id: 0,
            op: Some(Op::Hello(pb::DataHello {
                protocol_version: pb::PROTOCOL_VERSION,
                generation,
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
                let waiter = p.lock().expect("invariant: pending lock").remove(&resp.id);
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
        })
    }

    async fn call(&self, id: u64, op: Op) -> Result<pb::DataResponse, PathError> {
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
            Some(tx) => tx.send(pb::DataRequest { id, op: Some(op) }).await.is_ok(),
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
        match pb::Status::try_from(resp.status).unwrap_or(pb::Status::IoError) {
            pb::Status::Ok => Ok(resp),
            pb::Status::Invalid | pb::Status::Unavailable => Err(PathError::Refused(resp.message)),
            pb::Status::NoSpace => Err(PathError::NoSpace(resp.message)),
            pb::Status::IoError | pb::Status::Corrupt => Err(PathError::Io(resp.message)),
        }
    }
}

impl Drop for GrpcDataPath {
    fn drop(&mut self) {
        self.close();
    }
}

impl DataPath for GrpcDataPath {
    fn read(&self, id: u64, offset: u64, length: u64) -> BoxFuture<'_, Result<Bytes, PathError>> {
        Box::pin(async move {
            let resp = self
                .call(id, Op::Read(pb::ReadOp { offset, length }))
                .await?;
            if resp.data.len() as u64 != length {
                return Err(PathError::Io(format!(
                    "read of {length} bytes returned {}",
                    resp.data.len()
                )));
            }
            Ok(resp.data)
        })
    }

    fn write(&self, id: u64, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), PathError>> {
        Box::pin(async move {
            self.call(
                id,
                Op::Write(pb::WriteOp {
                    offset,
                    data,
                    crc32c: Vec::new(),
                }),
            )
            .await
            .map(|_| ())
        })
    }

    fn unmap(
        &self,
        id: u64,
        offset: u64,
        length: u64,
        zero_fill: bool,
    ) -> BoxFuture<'_, Result<(), PathError>> {
        Box::pin(async move {
            self.call(
                id,
                Op::Unmap(pb::UnmapOp {
                    offset,
                    length,
                    zero_fill,
                }),
            )
            .await
            .map(|_| ())
        })
    }

    fn flush(&self, id: u64, number: u64) -> BoxFuture<'_, Result<u64, PathError>> {
        Box::pin(async move {
            let resp = self
                .call(
                    id,
                    Op::Flush(pb::FlushOp {
                        flush_number: number,
                    }),
                )
                .await?;
            Ok(resp.flush_number)
        })
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
