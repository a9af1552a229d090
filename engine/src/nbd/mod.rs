//! NBD server: exposes one [`BlockDevice`] as one NBD export.
//!
//! Speaks the newstyle fixed handshake ([`handshake`]) and simple replies in the
//! transmission phase ([`transmission`]); structured replies, TLS and metadata contexts are
//! refused with `NBD_REP_ERR_UNSUP`, which every client handles by falling back.
//!
//! ```no_run
//! # async fn demo() -> Result<(), zebu_engine::nbd::NbdError> {
//! use std::sync::Arc;
//! use zebu_engine::blockdev::MemDevice;
//! use zebu_engine::nbd::{NbdConfig, NbdServer};
//!
//! let cfg = NbdConfig::new("127.0.0.1:0".parse().unwrap(), "vol1");
//! let server = NbdServer::bind(cfg, Arc::new(MemDevice::new(64 << 20))).await?;
//! println!("nbd://{}/vol1", server.local_addr());
//! server.run(std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! # What the export advertises, and why
//!
//! - Block sizes: minimum 1 (the device accepts any alignment, doing read-modify-write
//!   itself, so clients need not do their own), preferred 4096 (the replica's sector: smaller
//!   or unaligned I/O costs a read-modify-write on every replica), maximum payload 32 MiB.
//!   32 MiB is the limit the protocol tells clients to assume when a server says nothing,
//!   so clients that ignore `NBD_INFO_BLOCK_SIZE` still stay inside it, and it bounds the
//!   buffer one request can pin.
//! - `NBD_FLAG_CAN_MULTI_CONN`: the protocol allows it only if a FLUSH on any connection
//!   makes durable every write completed (replied to) on every connection before the flush.
//!   All connections share one [`BlockDevice`] and its `flush` contract is "make every write
//!   acknowledged before it durable" — for the replicator, a flush goes to every replica and
//!   covers everything they acknowledged — and a write is replied to only after the device
//!   acknowledged it. So a completed write on connection A is covered by a flush on B.
//! - `SEND_FLUSH`, `SEND_FUA`, `SEND_TRIM`, `SEND_WRITE_ZEROES`: a FUA write is the
//!   device's `write_fua` (for the replicator, the write and a flush in one request to each
//!   replica); a FUA trim or write-zeroes is the operation followed by a device flush. Both
//!   make more durable than FUA needs (everything acknowledged before, not only this).
//!
//! Each connection gets one task (see [`transmission`]); a malformed request closes at most
//! its own connection. Bytes in flight are capped per connection and per export, and the
//! export serves at most [`NbdConfig::max_connections`] connections, so the engine's memory
//! does not grow with the number or the size of requests clients queue, nor with the number
//! of clients. Replies a client leaves unread count against its own connection only, so one
//! client cannot starve the others (see the budget section of [`transmission`]).

pub mod handshake;
pub mod transmission;
pub mod wire;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::blockdev::BlockDevice;
use handshake::{ExportInfo, Outcome};
use wire::*;

/// Largest READ or WRITE payload accepted; advertised as the maximum block size.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Advertised preferred block size (the replica sector size).
pub const PREFERRED_BLOCK: u32 = 4096;

/// Errors of the NBD server and of single connections.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("socket I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("handshake timed out after {0:?}")]
    HandshakeTimeout(Duration),
    #[error("replies left unread for {0:?}")]
    ReplyTimeout(Duration),
}

/// How to serve an export.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    /// Address to listen on; port 0 picks a free port (see [`NbdServer::local_addr`]).
    pub listen: SocketAddr,
    /// The export name clients must ask for (the volume name).
    pub export_name: String,
    /// A client that has not finished the handshake by then is disconnected, so idle
    /// half-open connections cannot pile up.
    pub handshake_timeout: Duration,
    /// Request and reply bytes one connection may have in flight before it stops reading:
    /// requests running and replies not yet taken by its client.
    pub max_inflight_bytes: u64,
    /// Bytes of running requests (the device holds their data) for all connections of the
    /// export together (one volume). Replies waiting for their client do not count here,
    /// only against their own connection, so clients that do not read cannot take it.
    pub max_volume_inflight_bytes: u64,
    /// A connection whose queued replies make no progress at all (not one byte taken by the
    /// client) for this long is dropped, so what it holds comes back.
    pub reply_timeout: Duration,
    /// Connections served at once; more are closed as soon as they are accepted. Each may
    /// hold `max_inflight_bytes`, so this bounds the server's memory with the budgets.
    pub max_connections: usize,
}

impl NbdConfig {
    pub fn new(listen: SocketAddr, export_name: impl Into<String>) -> NbdConfig {
        NbdConfig {
            listen,
            export_name: export_name.into(),
            handshake_timeout: Duration::from_secs(30),
            // 16 MiB keeps a queue of 1 MiB writes at the depth Linux and fio use (8-16)
            // busy, and is thousands of 4 KiB requests. The engine's peak RSS must stay under
            // 64 MiB with 1 MiB requests at QD 32: the data in flight is held here and again
            // while the replicator sends it, so the volume-wide cap is what bounds that.
            max_inflight_bytes: 16 << 20,
            max_volume_inflight_bytes: 24 << 20,
            // Long enough for a client paused for a while (a VM being migrated, a debugger),
            // short enough that a client that never reads gives its budget back.
            reply_timeout: Duration::from_secs(60),
            // Far above what one volume's clients open (QEMU 1, nbdcopy 4 by default) and
            // small enough that 16 connections of 16 MiB stay a bounded amount of memory.
            max_connections: 16,
        }
    }
}

/// A bound NBD server, not yet accepting. Bind first to learn the address, then [`run`].
///
/// [`run`]: NbdServer::run
pub struct NbdServer {
    cfg: NbdConfig,
    dev: Arc<dyn BlockDevice>,
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl NbdServer {
    pub async fn bind(cfg: NbdConfig, dev: Arc<dyn BlockDevice>) -> Result<NbdServer, NbdError> {
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| NbdError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let local_addr = listener.local_addr()?;
        Ok(NbdServer {
            cfg,
            dev,
            listener,
            local_addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Accepts connections until `shutdown` completes, then stops every connection (requests
    /// already started finish and are answered) and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), NbdError> {
        let export = Arc::new(ExportInfo {
            name: self.cfg.export_name.clone(),
            size: self.dev.size(),
            transmission_flags: TFLAG_HAS_FLAGS
                | TFLAG_SEND_FLUSH
                | TFLAG_SEND_FUA
                | TFLAG_SEND_TRIM
                | TFLAG_SEND_WRITE_ZEROES
                | TFLAG_CAN_MULTI_CONN,
            min_block: 1,
            preferred_block: PREFERRED_BLOCK,
            max_payload: MAX_PAYLOAD,
        });
        tracing::info!(
            addr = %self.local_addr,
            export = %export.name,
            size = export.size,
            "nbd server listening"
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let shared_units =
            u32::try_from((self.cfg.max_volume_inflight_bytes / transmission::BUDGET_UNIT).max(1))
                .unwrap_or(u32::MAX >> 4)
                .min(Semaphore::MAX_PERMITS as u32);
        let budget = Arc::new(Semaphore::new(shared_units as usize));
        let slots = Arc::new(Semaphore::new(
            self.cfg.max_connections.min(Semaphore::MAX_PERMITS),
        ));
        let mut refusals = crate::sockio::Refusals::default();
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                // Reap finished connections so the set does not grow without bound.
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            // Closed before the greeting: the client sees EOF at once.
                            refusals.note(peer, self.cfg.max_connections);
                            drop(stream);
                            continue;
                        };
                        let span = tracing::info_span!("nbd_conn", %peer, export = %export.name);
                        conns.spawn(
                            handle_connection(
                                stream,
                                self.dev.clone(),
                                export.clone(),
                                self.cfg.clone(),
                                (budget.clone(), shared_units),
                                stop_rx.clone(),
                                slot,
                            )
                            .instrument(span),
                        );
                    }
                    Err(e) => {
                        // Usually EMFILE or ECONNABORTED: keep serving the connections we
                        // have and retry after a pause rather than spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        tracing::info!(connections = conns.len(), "nbd server stopping");
        // Receivers may all be gone already; that is fine.
        let _ = stop_tx.send(true);
        while conns.join_next().await.is_some() {}
        Ok(())
    }
}

/// Binds and runs in one call, for callers that know their port.
pub async fn serve(
    cfg: NbdConfig,
    dev: Arc<dyn BlockDevice>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), NbdError> {
    NbdServer::bind(cfg, dev).await?.run(shutdown).await
}

async fn handle_connection(
    mut stream: TcpStream,
    dev: Arc<dyn BlockDevice>,
    export: Arc<ExportInfo>,
    cfg: NbdConfig,
    (shared, shared_units): (Arc<Semaphore>, u32),
    mut stop: watch::Receiver<bool>,
    // Held until the connection ends, whatever way it does.
    _slot: OwnedSemaphorePermit,
) {
    // Replies are small and latency-bound; Nagle would hold them back waiting for more.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
    // The size as of this connection: a volume may have been expanded since the server started.
    let export = ExportInfo {
        size: dev.size(),
        ..(*export).clone()
    };
    let negotiated = tokio::select! {
        r = tokio::time::timeout(cfg.handshake_timeout, handshake::negotiate(&mut stream, &export)) => {
            r.unwrap_or(Err(NbdError::HandshakeTimeout(cfg.handshake_timeout)))
        }
        _ = stop.wait_for(|s| *s) => Ok(Outcome::Closed),
    };
    match negotiated {
        Ok(Outcome::Transmission) => {}
        Ok(Outcome::Closed) => {
            tracing::debug!("closed during handshake");
            return;
        }
        Err(e) => {
            tracing::info!(error = %e, "handshake failed");
            return;
        }
    }
    tracing::info!("client connected");
    let limits = transmission::Limits {
        max_payload: export.max_payload,
        max_inflight_bytes: cfg.max_inflight_bytes,
        shared,
        shared_units,
        reply_timeout: cfg.reply_timeout,
    };
    match transmission::serve_connection(stream, dev, limits, stop).await {
        Ok(()) => tracing::info!("client disconnected"),
        Err(e) => tracing::warn!(error = %e, "connection closed"),
    }
}
