//! iSCSI target frontend (RFC 7143, SPC-4, SBC-3).
//!
//! One target per volume, named `iqn.2025-01.io.zebu:<volume>`, with the volume as LUN 1
//! in portal group 1. The target sees the volume only as a [`BlockDevice`].
//!
//! Layout of the module tree:
//! - [`pdu`]: PDU framing, digests, vectored writes;
//! - [`login`] and [`chap`]: the login phase (None / CHAP / mutual CHAP, parameter negotiation);
//! - [`session`]: the full feature phase of one connection, one task each (CmdSN window,
//!   Data-Out/R2T, Data-In, task management, Text/SendTargets, NOP, Logout, Reject);
//! - [`text`]: text longer than one PDU (login and Text responses split with the C bit);
//! - [`scsi`], [`pages`] and [`sense`]: SCSI command execution.
//!
//! What initiators can make the target hold is bounded: each connection's commands and
//! buffers by its session's budgets (see [`session`]), the login text by
//! [`login::MAX_LOGIN_TEXT`] and the login timeout, and the connections themselves by
//! [`IscsiConfig::max_connections`]. One session's backlog never holds back another's.
//!
//! ```no_run
//! # async fn demo() -> Result<(), zebu_engine::iscsi::IscsiError> {
//! use std::sync::Arc;
//! use zebu_engine::blockdev::MemDevice;
//! use zebu_engine::iscsi::{IscsiConfig, IscsiServer};
//! let cfg = IscsiConfig::new("127.0.0.1:0".parse().expect("addr"), "vol");
//! let server = IscsiServer::bind(cfg, Arc::new(MemDevice::new(1 << 20))).await?;
//! println!("listening on {}", server.local_addr());
//! server.serve(std::future::pending()).await
//! # }
//! ```

pub mod chap;
pub mod login;
pub mod pages;
pub mod pdu;
pub mod scsi;
pub mod sense;
pub mod session;
pub mod text;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tracing::{Instrument, info, info_span, warn};

use crate::blockdev::BlockDevice;
pub use chap::Chap;

/// IQN prefix; the volume name follows the colon.
pub const IQN_PREFIX: &str = "iqn.2025-01.io.zebu";
/// A login that takes longer than this is abandoned (protects against idle sockets).
const LOGIN_TIMEOUT: Duration = Duration::from_secs(30);

pub fn target_iqn(volume: &str) -> String {
    format!("{IQN_PREFIX}:{volume}")
}

/// What to serve and how.
#[derive(Clone, Debug)]
pub struct IscsiConfig {
    pub listen: SocketAddr,
    pub volume: String,
    /// CHAP required from initiators of normal sessions, when set.
    pub chap: Option<Chap>,
    /// Connections served at once, logging in or logged in; more are closed as soon as they
    /// are accepted. Each may hold a session's budgets (see [`session`]), so this bounds the
    /// target's memory with them.
    pub max_connections: usize,
    /// A connection whose queued responses make no progress at all (not one byte taken by
    /// the initiator) for this long is closed, so what it holds comes back.
    pub response_timeout: Duration,
}

impl IscsiConfig {
    pub fn new(listen: SocketAddr, volume: &str) -> IscsiConfig {
        IscsiConfig {
            listen,
            volume: volume.to_string(),
            chap: None,
            // A volume has one initiator (plus a short-lived discovery session now and then):
            // 16 leaves room for multipath and reconnects racing the old session's end.
            max_connections: 16,
            // Long enough for an initiator paused for a while, short enough that one that
            // never reads gives back its budgets and its connection slot.
            response_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IscsiError {
    #[error("binding iSCSI portal {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("accepting on iSCSI portal {addr}: {source}")]
    Accept {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// State shared by all connections of one target.
pub struct Target {
    pub iqn: String,
    pub lun: scsi::Lun,
    chap: Option<Chap>,
    next_tsih: AtomicU16,
    max_connections: usize,
    response_timeout: Duration,
}

impl Target {
    fn next_tsih(&self) -> u16 {
        loop {
            let t = self.next_tsih.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t;
            }
        }
    }
}

/// A bound target, ready to serve.
pub struct IscsiServer {
    listener: TcpListener,
    addr: SocketAddr,
    target: Arc<Target>,
}

impl IscsiServer {
    pub async fn bind(
        cfg: IscsiConfig,
        dev: Arc<dyn BlockDevice>,
    ) -> Result<IscsiServer, IscsiError> {
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| IscsiError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| IscsiError::Bind {
            addr: cfg.listen,
            source,
        })?;
        let iqn = target_iqn(&cfg.volume);
        let id = pages::Identity::new(&cfg.volume, &iqn);
        Ok(IscsiServer {
            listener,
            addr,
            target: Arc::new(Target {
                lun: scsi::Lun::new(dev, id),
                iqn,
                chap: cfg.chap,
                next_tsih: AtomicU16::new(1),
                max_connections: cfg.max_connections,
                response_timeout: cfg.response_timeout,
            }),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accepts connections until `shutdown` completes, then tells every connection to stop.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), IscsiError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        info!(portal = %self.addr, target = %self.target.iqn, "iSCSI target listening");
        let max = self.target.max_connections;
        let slots = Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS)));
        let mut refusals = crate::sockio::Refusals::default();
        tokio::pin!(shutdown);
        let result = loop {
            let (stream, peer) = tokio::select! {
                r = self.listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) if is_transient(&e) => {
                        warn!(error = %e, "accept failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(source) => break Err(IscsiError::Accept { addr: self.addr, source }),
                },
                _ = &mut shutdown => break Ok(()),
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                // Closed before the login: the initiator sees the connection end and retries.
                refusals.note(peer, max);
                drop(stream);
                continue;
            };
            let span = info_span!("iscsi_conn", %peer, target = %self.target.iqn);
            let conn = connection(self.target.clone(), stream, stop_rx.clone());
            tokio::spawn(
                async move {
                    conn.await;
                    drop(slot);
                }
                .instrument(span),
            );
        };
        let _ = stop_tx.send(true);
        result
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || e.raw_os_error() == Some(libc::EMFILE)
        || e.raw_os_error() == Some(libc::ENFILE)
}

/// Binds and serves until `shutdown` completes.
pub async fn serve(
    cfg: IscsiConfig,
    dev: Arc<dyn BlockDevice>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), IscsiError> {
    IscsiServer::bind(cfg, dev).await?.serve(shutdown).await
}

async fn connection(target: Arc<Target>, stream: TcpStream, shutdown: watch::Receiver<bool>) {
    // Responses are latency bound: never let Nagle hold a small status PDU back.
    let _ = stream.set_nodelay(true);
    let portal = match stream.local_addr() {
        Ok(SocketAddr::V6(a)) => format!("[{}]:{}", a.ip(), a.port()),
        Ok(a) => a.to_string(),
        Err(_) => return,
    };
    let (rd, mut wr) = stream.into_split();
    let mut reader = pdu::PduReader::new(rd, login::TARGET_MRDSL as usize);
    let next_tsih = || target.next_tsih();
    let cfg = login::LoginConfig {
        target_iqn: &target.iqn,
        chap: target.chap.as_ref(),
        next_tsih: &next_tsih,
    };
    let login =
        match tokio::time::timeout(LOGIN_TIMEOUT, login::login(&mut reader, &mut wr, &cfg)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                warn!(error = %e, "login failed");
                return;
            }
            Err(_) => {
                warn!("login timed out");
                return;
            }
        };
    info!(initiator = %login.initiator, tsih = login.tsih, kind = ?login.kind, "login complete");
    // The session reads and writes from one task, on the whole stream again.
    let (rd, input) = reader.into_inner();
    let stream = rd
        .reunite(wr)
        .expect("invariant: both halves come from the same stream");
    session::run(target.clone(), stream, input, login, portal, shutdown).await;
}
