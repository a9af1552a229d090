//! The accept loop: one port for gRPC and for data frames.
//!
//! Every accepted connection gets TCP_NODELAY (without it, small answers such as a write's
//! OK wait for the peer's delayed ACK: up to 40 ms per request), then a task peeks at its
//! first byte. An HTTP/2 client always opens with the preface `PRI * HTTP/2.0`; a frames
//! client opens with `frames::MAGIC`, whose first byte is `Z`. Frames connections are served
//! by `frames::serve`; every other connection is handed to tonic, as before, which refuses
//! what is not HTTP/2. Peeking happens in the connection's own task, so a client that
//! connects and sends nothing holds up nobody (it is dropped after [`FIRST_BYTE_TIMEOUT`]).
//!
//! TLS (an option: `ReplicaServer::with_tls`, `zebu_proto::tls`): every accepted connection
//! first completes a TLS handshake, within [`FIRST_BYTE_TIMEOUT`], and the first *decrypted*
//! byte chooses between frames and gRPC, as above. A client that does not start a handshake
//! (a plaintext frames or gRPC client) fails it at its first bytes and is dropped: nothing of
//! what it sent is read as a request. The local socket stays plaintext (module docs of
//! `zebu_proto::tls`).
//!
//! The local socket: beside the port, the server listens on a Unix socket in the abstract
//! namespace (no file, gone with the process), named `zebu-replica.<pid>.<random>`, and
//! serves data frames only there. Every hello answer carries its name, so a client on this
//! host (an engine told that this replica is local, `--local-host`) can open its data streams
//! there: same protocol, same fencing, without the TCP stack (measured through the engine:
//! 9-15 % less CPU per 4 KiB request at queue depth 32; no change at queue depth 1, where
//! wake-ups dominate; benches/README.md, "The local socket"). The name is random, so
//! a client in another network namespace, where it does not exist, falls back to TCP and can
//! never reach another replica by it. If it cannot be bound, the replica serves TCP only.

use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::{Instrument, debug, info, info_span, warn};
use zebu_proto::frames::MAGIC;
use zebu_proto::tls::{TlsAcceptor, server::TlsStream};

use super::{ReplicaServer, frames};

/// How long a new connection may take to send its first byte.
const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(30);

/// HTTP/2 flow control of the gRPC port, for what clients send to it: a restore or a rebuild
/// streams whole layers into `WriteLayer` in 4 MiB messages. With the defaults (64 KiB
/// windows, 16 KiB frames) a 4 MiB message is 256 frames and 64 window updates. What a
/// connection may have buffered here is bounded by the connection window.
const GRPC_STREAM_WINDOW: u32 = 4 << 20;
const GRPC_CONNECTION_WINDOW: u32 = 8 << 20;
const GRPC_MAX_FRAME: u32 = 1 << 20;

impl ReplicaServer {
    /// Serves gRPC and data frames on `listener` until `shutdown` completes and the gRPC
    /// connections have finished (frames connections end when the replica closes, which
    /// `zebu-replica serve` does before it signals the shutdown).
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let (grpc_tx, grpc_rx) = mpsc::channel::<std::io::Result<Conn>>(64);
        let grpc = tonic::transport::Server::builder()
            .initial_stream_window_size(Some(GRPC_STREAM_WINDOW))
            .initial_connection_window_size(Some(GRPC_CONNECTION_WINDOW))
            .max_frame_size(Some(GRPC_MAX_FRAME))
            .add_service(self.clone().into_service())
            .serve_with_incoming_shutdown(ReceiverStream::new(grpc_rx), shutdown);
        let local = self.bind_local();
        tokio::select! {
            served = grpc => served,
            () = self.accept_loop(listener, grpc_tx) => Ok(()),
            () = self.accept_local(local) => Ok(()),
        }
    }

    /// Binds the local socket and records its name for the hello answers; `None` (logged)
    /// if it cannot be bound.
    fn bind_local(&self) -> Option<UnixListener> {
        let name = format!(
            "zebu-replica.{}.{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        match UnixListener::bind(format!("\0{name}")) {
            Ok(l) => {
                let _ = self.shared.local_socket.set(format!("@{name}"));
                info!(parent: &self.shared.span, socket = %format!("@{name}"), "local socket");
                Some(l)
            }
            Err(e) => {
                warn!(parent: &self.shared.span, "no local socket (TCP only): {e}");
                None
            }
        }
    }

    /// Serves data frames on the local socket; never returns when there is none.
    async fn accept_local(&self, listener: Option<UnixListener>) {
        let Some(listener) = listener else {
            return std::future::pending().await;
        };
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!("accept on the local socket failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (rd, wr) = stream.into_split();
            tokio::spawn(frames::serve(self.shared.clone(), rd, wr, "local"));
        }
    }

    async fn accept_loop(&self, listener: TcpListener, grpc: mpsc::Sender<std::io::Result<Conn>>) {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning; the listener stays.
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if let Err(e) = stream.set_nodelay(true) {
                debug!(%peer, "cannot set TCP_NODELAY: {e}");
            }
            let shared = self.shared.clone();
            let grpc = grpc.clone();
            let tls = self.tls.clone();
            let span = info_span!(parent: &shared.span, "conn", %peer);
            tokio::spawn(
                async move {
                    match tls {
                        None => plain(shared, stream, peer, grpc).await,
                        Some(tls) => secured(shared, stream, peer, grpc, tls).await,
                    }
                }
                .instrument(span),
            );
        }
    }
}

async fn plain(
    shared: std::sync::Arc<super::Shared>,
    stream: TcpStream,
    peer: std::net::SocketAddr,
    grpc: mpsc::Sender<std::io::Result<Conn>>,
) {
    let mut first = [0u8; 1];
    match tokio::time::timeout(FIRST_BYTE_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1)) if first[0] == MAGIC[0] => {
            let (rd, wr) = stream.into_split();
            frames::serve(shared, rd, wr, peer).await;
        }
        Ok(Ok(1)) => {
            // tonic is shutting down when this fails; the connection just closes.
            let _ = grpc.send(Ok(Conn::Plain(stream))).await;
        }
        Ok(Ok(_)) => debug!("connection closed before its first byte"),
        Ok(Err(e)) => debug!("connection failed before its first byte: {e}"),
        Err(_) => debug!("no first byte within {FIRST_BYTE_TIMEOUT:?}; dropped"),
    }
}

/// [`plain`] after a TLS handshake: the first decrypted byte chooses.
async fn secured(
    shared: std::sync::Arc<super::Shared>,
    stream: TcpStream,
    peer: std::net::SocketAddr,
    grpc: mpsc::Sender<std::io::Result<Conn>>,
    tls: TlsAcceptor,
) {
    let first = async {
        let s = tls
            .accept(stream)
            .await
            .map_err(|e| format!("TLS handshake failed (a client without TLS?): {e}"))?;
        let mut s = BufReader::new(s);
        let first = s
            .fill_buf()
            .await
            .map_err(|e| format!("connection failed before its first byte: {e}"))?
            .first()
            .copied();
        Ok::<_, String>((s, first))
    };
    match tokio::time::timeout(FIRST_BYTE_TIMEOUT, first).await {
        Ok(Ok((s, Some(b)))) if b == MAGIC[0] => {
            let (rd, wr) = tokio::io::split(s);
            frames::serve(shared, rd, wr, peer).await;
        }
        Ok(Ok((s, Some(_)))) => {
            let _ = grpc.send(Ok(Conn::Tls(Box::new(s)))).await;
        }
        Ok(Ok((_, None))) => debug!("connection closed before its first byte"),
        Ok(Err(why)) => info!("{why}"),
        Err(_) => debug!("no TLS handshake and first byte within {FIRST_BYTE_TIMEOUT:?}; dropped"),
    }
}

/// A connection handed to tonic: plain TCP, or TLS with the first byte still buffered.
pub(super) enum Conn {
    Plain(TcpStream),
    Tls(Box<BufReader<TlsStream<TcpStream>>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Conn::Plain(s) => s.connect_info(),
            Conn::Tls(s) => s.get_ref().get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
