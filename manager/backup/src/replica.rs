//! The one place the backup data path talks to a replica process: its sync RPCs
//! (`Info`, `ListExtents`, `ReadLayer`, `WriteLayer`, `SetEpoch` in `replica.proto`).
//!
//! Every connection is made by [`ReplicaLink::connect`]; callers hold a `ReplicaLink`, never
//! a raw channel. Replica ports are authenticated (the volume's secret, issue 18): once
//! [`set_volume_secret`] gave this process the secret of the volume its job is about (one
//! `zebu-backup-run` runs one job of one volume), every call carries a fresh token of it.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use zebu_proto::replica as pb;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_proto::sums::{SUM_BLOCK, SUM_BLOCK_U64, crcs_of};

/// How long connecting and a short call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A failure talking to one replica; the address says which.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica {addr}: cannot connect: {detail}")]
    Connect { addr: String, detail: String },
    #[error("replica {addr}: {call} failed: {message}")]
    Call {
        addr: String,
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("replica {addr}: {call} timed out after {secs} s")]
    Timeout {
        addr: String,
        call: &'static str,
        secs: u64,
    },
    #[error("replica {addr}: {what}")]
    Protocol { addr: String, what: String },
    /// Blocks the replica read and found not matching their checksum (bit rot on its disk):
    /// it sends them as they are, marked, and a backup must not store them as good.
    #[error(
        "replica {addr}: layer {layer:?}: {} block(s) fail their checksum on the replica, first at byte {}",
        .offsets.len(),
        .offsets.first().copied().unwrap_or_default()
    )]
    Corrupt {
        addr: String,
        layer: String,
        /// Volume offsets of the bad 4 KiB blocks.
        offsets: Vec<u64>,
    },
}

/// The secret of the volume this process's job is about; see the module docs.
static VOLUME_SECRET: std::sync::OnceLock<zebu_proto::auth::Secret> = std::sync::OnceLock::new();

/// Sets the secret every later replica call proves; once per process (a second call, for
/// another secret, is refused: one job is one volume).
pub fn set_volume_secret(secret: zebu_proto::auth::Secret) -> Result<(), &'static str> {
    VOLUME_SECRET
        .set(secret)
        .map_err(|_| "the volume secret of this process is set already")
}

/// The CA replica certificates are checked against, when the job's cluster has TLS on the
/// replica ports (issue 18): every later connection is made over TLS.
static REPLICA_TLS: std::sync::OnceLock<zebu_proto::tls::TlsConnector> = std::sync::OnceLock::new();

/// Connects to replicas over TLS from now on, trusting what `tls` trusts; once per process.
pub fn set_replica_tls(tls: zebu_proto::tls::TlsConnector) -> Result<(), &'static str> {
    REPLICA_TLS
        .set(tls)
        .map_err(|_| "the replica TLS of this process is set already")
}

/// Adds a fresh token to every call once the process has a secret.
#[derive(Clone, Copy, Default)]
pub struct AddToken;

impl Interceptor for AddToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(secret) = VOLUME_SECRET.get() {
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

/// A connection to one replica's sync RPCs.
#[derive(Clone)]
pub struct ReplicaLink {
    addr: String,
    client: ReplicaClient<InterceptedService<Channel, AddToken>>,
}

impl std::fmt::Debug for ReplicaLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicaLink({})", self.addr)
    }
}

impl ReplicaLink {
    /// Connects to the replica at `addr` (`host:port`).
    pub async fn connect(addr: &str) -> Result<ReplicaLink, ReplicaError> {
        let connect_err = |detail: String| ReplicaError::Connect {
            addr: addr.to_string(),
            detail,
        };
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| connect_err(format!("bad address: {e}")))?
            .connect_timeout(CALL_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(CALL_TIMEOUT)
            .keep_alive_while_idle(true)
            // Large windows: a layer streams at disk speed, not at the default 64 KiB window.
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(32 << 20));
        let connect =
            zebu_proto::tls::grpc_channel(endpoint, addr, REPLICA_TLS.get(), CALL_TIMEOUT);
        let channel = match tokio::time::timeout(CALL_TIMEOUT, connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(connect_err(e.to_string())),
            Err(_) => return Err(connect_err(format!("no answer within {CALL_TIMEOUT:?}"))),
        };
        let client = ReplicaClient::with_interceptor(channel, AddToken)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES);
        Ok(ReplicaLink {
            addr: addr.to_string(),
            client,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn call_err(&self, call: &'static str) -> impl FnOnce(tonic::Status) -> ReplicaError + '_ {
        move |s| ReplicaError::Call {
            addr: self.addr.clone(),
            call,
            code: s.code(),
            message: s.message().to_string(),
        }
    }

    async fn bounded<T>(
        &self,
        call: &'static str,
        limit: Duration,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, ReplicaError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(r) => r
                .map(tonic::Response::into_inner)
                .map_err(self.call_err(call)),
            Err(_) => Err(ReplicaError::Timeout {
                addr: self.addr.clone(),
                call,
                secs: limit.as_secs(),
            }),
        }
    }

    pub async fn info(&self) -> Result<pb::InfoResponse, ReplicaError> {
        let mut c = self.client.clone();
        self.bounded("Info", CALL_TIMEOUT, c.info(pb::InfoRequest {}))
            .await
    }

    /// A layer's own data extents (`layer` a snapshot name), sorted and disjoint.
    pub async fn list_extents(&self, layer: &str) -> Result<Vec<Range<u64>>, ReplicaError> {
        let mut c = self.client.clone();
        let req = pb::ListExtentsRequest {
            layer: layer.to_string(),
            offset: 0,
            length: 0,
        };
        // A layer of a large sparse volume can take a while to scan.
        let r = self
            .bounded("ListExtents", CALL_TIMEOUT * 6, c.list_extents(req))
            .await?;
        let mut out: Vec<Range<u64>> = r
            .extents
            .into_iter()
            .map(|e| e.offset..e.offset.saturating_add(e.length))
            .filter(|r| r.start < r.end)
            .collect();
        out.sort_by_key(|r| r.start);
        Ok(crate::chain::union(&[&out]))
    }

    /// Refuses a `ReadLayer` chunk with blocks the replica found bad, or whose data does not
    /// match the checksums it came with (damaged on the way: a replica that sends sums sends
    /// them for every block).
    fn check_layer_chunk(&self, layer: &str, msg: &pb::LayerChunk) -> Result<(), ReplicaError> {
        if !msg.corrupt.is_empty() {
            return Err(ReplicaError::Corrupt {
                addr: self.addr.clone(),
                layer: layer.to_string(),
                offsets: msg
                    .corrupt
                    .iter()
                    .map(|&b| msg.offset + u64::from(b) * SUM_BLOCK_U64)
                    .collect(),
            });
        }
        if msg.crc32c.is_empty() {
            return Ok(());
        }
        let blocks = msg.data.len().div_ceil(SUM_BLOCK);
        if msg.crc32c.len() != blocks {
            return Err(ReplicaError::Protocol {
                addr: self.addr.clone(),
                what: format!(
                    "ReadLayer of {layer:?} sent {} checksums for {blocks} blocks at {}",
                    msg.crc32c.len(),
                    msg.offset
                ),
            });
        }
        let bad = crcs_of(&msg.data)
            .zip(&msg.crc32c)
            .position(|(got, &want)| got != want);
        if let Some(i) = bad {
            return Err(ReplicaError::Protocol {
                addr: self.addr.clone(),
                what: format!(
                    "ReadLayer of {layer:?}: the block at byte {} does not match the checksum it was sent with",
                    msg.offset + i as u64 * SUM_BLOCK_U64
                ),
            });
        }
        Ok(())
    }

    /// Reads `ranges` of one layer (its own bytes, not resolved), which lie in `window`:
    /// the pieces as they came (offset, bytes; no copy) and how many bytes that was. A chunk
    /// with blocks the replica found bad, or damaged on the way, is an error (the reader then
    /// tries another replica).
    pub async fn read_layer_pieces(
        &self,
        layer: &str,
        ranges: &[Range<u64>],
        window: &Range<u64>,
    ) -> Result<(Vec<(u64, Bytes)>, u64), ReplicaError> {
        let want: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let mut c = self.client.clone();
        let req = pb::ReadLayerRequest {
            layer: layer.to_string(),
            extents: ranges
                .iter()
                .map(|r| pb::Extent {
                    offset: r.start,
                    length: r.end - r.start,
                })
                .collect(),
        };
        let mut stream = self
            .bounded("ReadLayer", CALL_TIMEOUT, c.read_layer(req))
            .await?;
        let mut got = 0u64;
        let mut pieces = Vec::new();
        // The replica streams the ranges in order, each from its start: every message must
        // begin where the last one ended (or at the next range) and stay inside its range,
        // so the pieces cover exactly what was asked, without overlaps.
        let mut todo = ranges.iter().filter(|r| r.start < r.end).cloned();
        let mut cur = todo.next();
        loop {
            let next = tokio::time::timeout(CALL_TIMEOUT * 3, stream.next()).await;
            let msg = match next {
                Err(_) => {
                    return Err(ReplicaError::Timeout {
                        addr: self.addr.clone(),
                        call: "ReadLayer",
                        secs: (CALL_TIMEOUT * 3).as_secs(),
                    });
                }
                Ok(None) => break,
                Ok(Some(m)) => m.map_err(self.call_err("ReadLayer"))?,
            };
            self.check_layer_chunk(layer, &msg)?;
            if msg.data.is_empty() {
                continue;
            }
            if cur.as_ref().is_some_and(|r| r.start == r.end) {
                cur = todo.next();
            }
            let end = msg.offset.checked_add(msg.data.len() as u64);
            match (cur.as_mut(), end) {
                (Some(r), Some(end))
                    if msg.offset == r.start && end <= r.end && end <= window.end =>
                {
                    r.start = end;
                }
                _ => {
                    return Err(ReplicaError::Protocol {
                        addr: self.addr.clone(),
                        what: format!(
                            "ReadLayer of {layer:?} sent {} bytes at {}, expected the next bytes of {:?}",
                            msg.data.len(),
                            msg.offset,
                            cur
                        ),
                    });
                }
            }
            got += msg.data.len() as u64;
            pieces.push((msg.offset, msg.data));
        }
        if got != want {
            return Err(ReplicaError::Protocol {
                addr: self.addr.clone(),
                what: format!("ReadLayer of {layer:?} sent {got} bytes of {want}"),
            });
        }
        Ok((pieces, got))
    }

    /// Streams data into a snapshot layer (created if missing, see `WriteLayerRequest`).
    /// The layer is complete on the replica only if `data` ends normally; dropping the
    /// returned future instead resets the stream and leaves the layer marked incomplete.
    pub async fn write_layer(
        &self,
        first: pb::WriteLayerRequest,
        data: impl Stream<Item = pb::WriteLayerRequest> + Send + 'static,
    ) -> Result<u64, ReplicaError> {
        let mut c = self.client.clone();
        let stream = futures::stream::once(async move { first }).chain(data);
        let r = c
            .write_layer(stream)
            .await
            .map_err(self.call_err("WriteLayer"))?;
        Ok(r.into_inner().bytes_written)
    }

    /// Records a membership epoch, durably.
    pub async fn set_epoch(
        &self,
        epoch: u64,
        members: Vec<String>,
    ) -> Result<pb::InfoResponse, ReplicaError> {
        let mut c = self.client.clone();
        self.bounded(
            "SetEpoch",
            CALL_TIMEOUT,
            c.set_epoch(pb::SetEpochRequest { epoch, members }),
        )
        .await
    }
}
