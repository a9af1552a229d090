//! [`FramedDataPath`]: the replica data path over data frames (`zebu_proto::frames`) on one
//! connection per replica: plain TCP to the replica's usual port, or, for a replica on this
//! host, its local Unix socket.
//!
//! ```text
//!  callers ──call()──► bounded queue ──► writer task ──writev──► socket ──► replica
//!     ▲   register id in `pending`       (drains every queued
//!     │                                   request into one Batch)
//!     └── oneshot ◄── reader task ◄── socket (answers in any order, matched by id)
//! ```
//!
//! - The queue holds [`QUEUE_DEPTH`] requests; a caller waits for room, so a slow replica
//!   slows the volume a little instead of growing a backlog (DESIGN §3).
//! - The writer takes every request queued at that moment and sends them with vectored
//!   writes: headers and small payloads are copied into one staging buffer, write payloads of
//!   16 KiB and more are sent from the caller's buffer (`frames::Batch`).
//! - The reader decodes answers as they come and completes the waiting request with the same
//!   id. An END notice, a malformed answer, EOF or any socket error breaks the connection:
//!   every pending request fails at once with [`PathError::Disconnected`] (the replicator then
//!   sets the replica ERR), and so does every later call.
//! - Connect and hello are bounded by the I/O timeout; a refused hello (stale generation,
//!   closed replica) is [`PathError::Refused`] with the replica's message.
//! - The hello asks for [`frames::VERSION`]: writes carry block sums, reads may be answered
//!   CORRUPT, ping is an op, and a hole's answer may be a ZEROS flag (decoded into the shared
//!   [`frames::zeros`]: no bytes on the wire, no allocation here). A replica of an older build
//!   refuses that version with a message naming the "protocol version" (its refusal carries
//!   no other sign of the reason); the path then says hello again one version lower, down to
//!   [`frames::MIN_VERSION`], and encodes every request for the version agreed.
//! - A replica opened as local (the replicator's `--local-host`) names its local socket in
//!   the hello answer; the path says hello there too (same version and generation) and moves
//!   its traffic to it, closing the TCP connection. If that fails, it logs why and keeps TCP.
//!   Only replicas the caller calls local use it: on a test host where every "node" is a
//!   loopback address, the others stay on TCP like the remote replicas they stand for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use zebu_proto::frames::{self, Batch, Decoded, Hello, Request, Response};
use zebu_proto::ids::RequestId;
use zebu_proto::numbers::Generation;
use zebu_proto::replica as pb;

use super::client::{DataPath, PathError};
use crate::blockdev::BoxFuture;

/// Requests queued to one replica before callers wait.
const QUEUE_DEPTH: usize = 256;
/// Most requests gathered into one vectored write (keeps the iovec count under IOV_MAX).
const MAX_BATCH: usize = 128;
/// Least room made in the read buffer before each read.
const READ_CHUNK: usize = 64 << 10;

type Waiter = oneshot::Sender<Result<Response, PathError>>;

/// What the caller side and both tasks share.
struct Conn {
    addr: String,
    /// Requests sent and not answered. `None` once the connection broke: the reason is in
    /// `broken`, and nothing is added any more.
    pending: Mutex<Option<HashMap<RequestId, Waiter>>>,
    broken: Mutex<Option<String>>,
}

impl Conn {
    /// Marks the connection broken (the first reason wins) and fails every pending request.
    /// `unexpected`: log it (a close the replicator asked for is not news).
    fn break_with(&self, why: String, unexpected: bool) {
        let waiters = {
            let mut broken = self.broken.lock().expect("invariant: broken lock");
            if broken.is_none() {
                if unexpected {
                    tracing::warn!(replica = %self.addr, "frames connection broken: {why}");
                }
                *broken = Some(why.clone());
            }
            self.pending.lock().expect("invariant: pending lock").take()
        };
        for (_, w) in waiters.into_iter().flatten() {
            let _ = w.send(Err(PathError::Disconnected(why.clone())));
        }
    }

    fn why_broken(&self) -> String {
        self.broken
            .lock()
            .expect("invariant: broken lock")
            .clone()
            .unwrap_or_else(|| "the data connection is closed".into())
    }
}

/// [`DataPath`] over data frames; see the module docs.
pub struct FramedDataPath {
    conn: Arc<Conn>,
    queue: Mutex<Option<mpsc::Sender<Request>>>,
    tasks: [AbortHandle; 2],
    /// Whether the traffic runs over the replica's local socket.
    via_local: bool,
    /// The protocol version agreed in the hello.
    version: u32,
}

impl FramedDataPath {
    /// Connects to the replica at `addr` (`host:port`), sends the hello with `generation`
    /// and waits for its answer, all within `timeout`. `local`: the replica runs on this host,
    /// so its local socket is used if it names one (module docs).
    pub async fn open(
        addr: &str,
        generation: Generation,
        timeout: Duration,
        local: bool,
    ) -> Result<FramedDataPath, PathError> {
        FramedDataPath::open_for(addr, generation, None, timeout, local).await
    }

    /// [`FramedDataPath::open`] with the volume the engine serves named in the hello (its
    /// `EXT_VOLUME` extension): a replica of another volume refuses it.
    pub async fn open_for(
        addr: &str,
        generation: Generation,
        claim: Option<&frames::VolumeClaim>,
        timeout: Duration,
        local: bool,
    ) -> Result<FramedDataPath, PathError> {
        let (welcomed, rest, socket) = tokio::time::timeout(timeout, async {
            let mut version = frames::VERSION;
            loop {
                match handshake(addr, hello_for(version, generation, claim)).await {
                    // A replica of an older build: say hello again one version lower.
                    Err(e)
                        if super::client::refused_for_version(&e)
                            && version > frames::MIN_VERSION =>
                    {
                        version -= 1;
                        tracing::info!(replica = %addr, "frames: {e}; trying version {version}");
                    }
                    other => return other,
                }
            }
        })
        .await
        .map_err(|_| PathError::Timeout(timeout))??;
        let conn = Arc::new(Conn {
            addr: addr.to_string(),
            pending: Mutex::new(Some(HashMap::new())),
            broken: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let local_stream = match socket.strip_prefix('@') {
            Some(name) if local => {
                let hello = hello_for(welcomed.version, generation, claim);
                match tokio::time::timeout(timeout, hello_local(name, hello)).await {
                    Ok(Ok(s)) => Some(s),
                    Ok(Err(e)) => {
                        tracing::warn!(replica = %addr, "local socket @{name} not used (TCP instead): {e}");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(replica = %addr, "local socket @{name} not used (TCP instead): no answer within {timeout:?}");
                        None
                    }
                }
            }
            _ => None,
        };
        let via_local = local_stream.is_some();
        let version = welcomed.version;
        if version < frames::INTEGRITY_VERSION {
            tracing::warn!(replica = %addr, version, "the replica speaks frames version {version}: it keeps no block checksums, so reads from it are not verified");
        }
        let (writer, reader) = match local_stream {
            Some((s, rest)) => {
                // The replica sees the TCP connection close without a request: nothing to do.
                drop(welcomed);
                let (rd, wr) = s.into_split();
                (
                    tokio::spawn(write_requests(conn.clone(), wr, rx, version)),
                    tokio::spawn(read_answers(conn.clone(), rd, rest)),
                )
            }
            None => match welcomed.tcp {
                Stream::Tcp(s) => {
                    let (rd, wr) = s.into_split();
                    (
                        tokio::spawn(write_requests(conn.clone(), wr, rx, version)),
                        tokio::spawn(read_answers(conn.clone(), rd, rest)),
                    )
                }
                Stream::Tls(s) => {
                    let (rd, wr) = tokio::io::split(*s);
                    (
                        tokio::spawn(write_requests(conn.clone(), wr, rx, version)),
                        tokio::spawn(read_answers(conn.clone(), rd, rest)),
                    )
                }
            },
        };
        tracing::debug!(replica = %addr, generation = generation.0, via_local, version, "frames data path open");
        Ok(FramedDataPath {
            conn,
            queue: Mutex::new(Some(tx)),
            tasks: [writer.abort_handle(), reader.abort_handle()],
            via_local,
            version,
        })
    }

    async fn send(&self, req: Request) -> Result<Response, PathError> {
        let id = req.id;
        let (wtx, wrx) = oneshot::channel();
        {
            let mut pending = self.conn.pending.lock().expect("invariant: pending lock");
            let Some(map) = pending.as_mut() else {
                drop(pending);
                return Err(PathError::Disconnected(self.conn.why_broken()));
            };
            map.insert(id, wtx);
        }
        let queue = self.queue.lock().expect("invariant: queue lock").clone();
        let sent = match queue {
            Some(q) => q.send(req).await.is_ok(),
            None => false,
        };
        if !sent {
            if let Some(map) = self
                .conn
                .pending
                .lock()
                .expect("invariant: pending lock")
                .as_mut()
            {
                map.remove(&id);
            }
            return Err(PathError::Disconnected(self.conn.why_broken()));
        }
        let resp = wrx
            .await
            .map_err(|_| PathError::Disconnected(self.conn.why_broken()))??;
        super::client::answer_result(resp)
    }
}

/// A TCP connection whose hello was answered OK.
struct Welcomed {
    tcp: Stream,
    version: u32,
}

/// A TCP connection to a replica, or TLS over one (`--tls-ca`).
enum Stream {
    Tcp(TcpStream),
    Tls(Box<zebu_proto::tls::client::TlsStream<TcpStream>>),
}

/// The hello of `version` with `generation`, naming the volume from version 3 on (older
/// hellos have no extension area; a replica that belongs to a volume refuses them).
fn hello_for(version: u32, generation: Generation, claim: Option<&frames::VolumeClaim>) -> Hello {
    let mut hello = Hello::new(version, generation.0);
    if let Some(c) = claim
        && version >= frames::INTEGRITY_VERSION
    {
        hello.extensions.0.push(c.to_extension());
    }
    hello
}

/// Connects, sends `hello` and reads its answer; returns the stream, any bytes read past the
/// answer and the answer's message (the local socket's name, if any).
async fn handshake(addr: &str, hello: Hello) -> Result<(Welcomed, BytesMut, String), PathError> {
    let version = hello.version;
    let (stream, rest, message) = match super::client::replica_tls() {
        None => {
            let mut stream = TcpStream::connect(addr)
                .await
                .map_err(|e| PathError::Disconnected(format!("connect {addr}: {e}")))?;
            // Without it, a lone request waits for the replica's delayed ACK of the previous
            // one.
            stream
                .set_nodelay(true)
                .map_err(|e| PathError::Disconnected(format!("TCP_NODELAY on {addr}: {e}")))?;
            let (rest, message) = say_hello(&mut stream, addr, hello).await?;
            (Stream::Tcp(stream), rest, message)
        }
        Some(tls) => {
            let mut stream = zebu_proto::tls::connect(tls, addr)
                .await
                .map_err(|e| PathError::Disconnected(format!("connect {addr}: {e}")))?;
            let (rest, message) = say_hello(&mut stream, addr, hello).await?;
            (Stream::Tls(Box::new(stream)), rest, message)
        }
    };
    Ok((
        Welcomed {
            tcp: stream,
            version,
        },
        rest,
        message,
    ))
}

/// Connects to the local socket `@name` and says `hello` there.
async fn hello_local(name: &str, hello: Hello) -> Result<(UnixStream, BytesMut), PathError> {
    let mut stream = UnixStream::connect(format!("\0{name}"))
        .await
        .map_err(|e| PathError::Disconnected(format!("connect @{name}: {e}")))?;
    let (rest, _) = say_hello(&mut stream, &format!("@{name}"), hello).await?;
    Ok((stream, rest))
}

/// Sends `hello` on `stream` and reads its answer: returns any bytes read past it and the
/// answer's message. With the volume's secret set, this is the challenge-response of
/// `zebu_proto::auth`: the hello carries a nonce, the answer the replica's nonce and proof,
/// checked here, and a second hello the engine's proof, answered by the welcome.
async fn say_hello<S>(
    stream: &mut S,
    addr: &str,
    mut hello: Hello,
) -> Result<(BytesMut, String), PathError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let secret = super::client::volume_secret();
    let nc = zebu_proto::auth::nonce();
    if secret.is_some() && hello.version >= frames::INTEGRITY_VERSION {
        hello.extensions.0.push(frames::Extension {
            kind: zebu_proto::auth::EXT_AUTH,
            value: Bytes::copy_from_slice(&nc),
        });
    }
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let answer = hello_round(stream, addr, &hello, &mut buf).await?;
    let answer = match secret {
        Some(secret) if hello.version >= frames::INTEGRITY_VERSION => {
            let ext = frames::Extensions::decode(answer.data.clone())
                .map_err(|e| PathError::Refused(format!("{addr}: bad challenge: {e}")))?;
            let challenge = ext.get(zebu_proto::auth::EXT_AUTH).ok_or_else(|| {
                PathError::Refused(format!(
                    "{addr} did not answer the authentication challenge"
                ))
            })?;
            let volume = frames::VolumeClaim::from_extensions(&hello.extensions)
                .ok()
                .flatten()
                .map(|c| c.uuid)
                .unwrap_or_default();
            let ns = secret
                .check_server(&nc, challenge, &volume)
                .map_err(|e| PathError::Refused(format!("{addr}: {e}")))?;
            let proof = secret.client_proof(&nc, &ns, &volume, hello.version, hello.generation);
            let mut second = Hello::new(hello.version, hello.generation);
            second.extensions.0.push(frames::Extension {
                kind: zebu_proto::auth::EXT_AUTH,
                value: Bytes::copy_from_slice(&proof),
            });
            hello_round(stream, addr, &second, &mut buf).await?
        }
        _ => answer,
    };
    Ok((buf, answer.message))
}

/// Sends one hello and reads one OK answer with id 0 (bytes read past it stay in `buf`).
async fn hello_round<S>(
    stream: &mut S,
    addr: &str,
    hello: &Hello,
    buf: &mut BytesMut,
) -> Result<Response, PathError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let disconnected =
        |what: &str, e: std::io::Error| PathError::Disconnected(format!("{what} {addr}: {e}"));
    stream
        .write_all(&hello.encode())
        .await
        .map_err(|e| disconnected("hello to", e))?;
    let answer = loop {
        match frames::decode_response(buf) {
            Ok(Decoded::Frame(r)) => break r,
            Ok(Decoded::Need(_)) => {}
            Err(e) => {
                return Err(PathError::Disconnected(format!(
                    "{addr}: bad hello answer: {e}"
                )));
            }
        }
        let n = stream
            .read_buf(buf)
            .await
            .map_err(|e| disconnected("hello answer from", e))?;
        if n == 0 {
            return Err(PathError::Disconnected(format!(
                "{addr} closed the connection before answering the hello"
            )));
        }
    };
    if answer.id != RequestId::HELLO || answer.status != pb::Status::Ok {
        return Err(PathError::Refused(answer.message));
    }
    Ok(answer)
}

/// Sends every queued request, many per vectored write, until the queue closes or the
/// socket fails.
async fn write_requests<W: AsyncWrite + Unpin>(
    conn: Arc<Conn>,
    mut wr: W,
    mut rx: mpsc::Receiver<Request>,
    version: u32,
) {
    let mut batch = Batch::for_version(version);
    while let Some(req) = rx.recv().await {
        batch.push_request(&req);
        while batch.frames() < MAX_BATCH {
            let Ok(req) = rx.try_recv() else { break };
            batch.push_request(&req);
        }
        if let Err(e) = batch.write_to(&mut wr).await {
            conn.break_with(format!("sending to {}: {e}", conn.addr), true);
            return;
        }
        batch.clear();
    }
    let _ = wr.shutdown().await;
}

/// Completes waiting requests with their answers until the connection ends; then fails the
/// rest.
async fn read_answers<R: AsyncRead + Unpin>(conn: Arc<Conn>, mut rd: R, mut buf: BytesMut) {
    let why = loop {
        match frames::decode_response(&mut buf) {
            Ok(Decoded::Frame(resp)) if resp.end => {
                break format!("{} ended the data stream: {}", conn.addr, resp.message);
            }
            Ok(Decoded::Frame(resp)) => {
                let waiter = conn
                    .pending
                    .lock()
                    .expect("invariant: pending lock")
                    .as_mut()
                    .and_then(|m| m.remove(&resp.id));
                match waiter {
                    Some(w) => {
                        let _ = w.send(Ok(resp));
                    }
                    // Its caller gave up (timeout) and the replica answered anyway.
                    None => {
                        tracing::debug!(replica = %conn.addr, id = resp.id.0, "answer to no pending request")
                    }
                }
                continue;
            }
            Ok(Decoded::Need(total)) => {
                buf.reserve(total.saturating_sub(buf.len()).max(READ_CHUNK));
            }
            Err(e) => break format!("{} sent a malformed answer: {e}", conn.addr),
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) => break format!("{} closed the connection", conn.addr),
            Ok(_) => {}
            Err(e) => break format!("reading from {}: {e}", conn.addr),
        }
    };
    conn.break_with(why, true);
}

impl Drop for FramedDataPath {
    fn drop(&mut self) {
        self.close();
    }
}

impl DataPath for FramedDataPath {
    fn call(&self, req: Request) -> BoxFuture<'_, Result<Response, PathError>> {
        Box::pin(self.send(req))
    }

    fn version(&self) -> u32 {
        self.version
    }

    fn kind(&self) -> &'static str {
        if self.via_local {
            "frames/local"
        } else {
            "frames/tcp"
        }
    }

    fn close(&self) {
        self.queue.lock().expect("invariant: queue lock").take();
        for t in &self.tasks {
            t.abort();
        }
        self.conn
            .break_with("the data path was closed".into(), false);
    }
}

#[cfg(test)]
mod tests {
    //! [`FramedDataPath`] against a scripted fake replica on loopback: matching by id, a
    //! refused hello, and every pending request failing at once when the connection breaks.

    use std::time::Instant;

    use tokio::net::TcpListener;
    use zebu_proto::sums::BlockSums;

    use bytes::Bytes;
    use zebu_proto::frames::RequestOp;
    use zebu_proto::ids::RequestId;
    use zebu_proto::numbers::FlushNumber;

    use super::*;

    const T: Duration = Duration::from_secs(5);

    /// A fake replica: accepts one connection, checks the hello, answers it with `hello`,
    /// then collects `take` requests and hands the socket and them to `then`.
    async fn fake<F, Fut>(hello: Response, take: usize, then: F) -> String
    where
        F: FnOnce(TcpStream, Vec<Request>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let hello_in = read_hello(&mut s).await;
            assert_eq!(hello_in.version, frames::VERSION);
            assert_eq!(hello_in.generation, 7);
            answer(&mut s, std::slice::from_ref(&hello)).await;
            let mut buf = BytesMut::new();
            let mut reqs = Vec::new();
            while reqs.len() < take {
                match frames::decode_request(&mut buf).unwrap() {
                    Decoded::Frame(r) => reqs.push(r),
                    Decoded::Need(_) => {
                        assert!(s.read_buf(&mut buf).await.unwrap() > 0, "client hung up");
                    }
                }
            }
            then(s, reqs).await;
        });
        addr
    }

    /// Reads a client's hello off `s`, whatever its version.
    async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> Hello {
        let mut buf = BytesMut::new();
        loop {
            match frames::decode_hello(&mut buf).unwrap() {
                Decoded::Frame(h) => {
                    assert!(buf.is_empty(), "nothing follows a hello before its answer");
                    return h;
                }
                Decoded::Need(_) => assert!(s.read_buf(&mut buf).await.unwrap() > 0),
            }
        }
    }

    async fn answer(s: &mut TcpStream, resps: &[Response]) {
        let mut b = Batch::default();
        for r in resps {
            b.push_response(r);
        }
        b.write_to(s).await.unwrap();
    }

    #[tokio::test]
    async fn answers_in_reverse_order_reach_their_requests() {
        let addr = fake(Response::ok(RequestId(0)), 3, |mut s, reqs| async move {
            let mut resps: Vec<Response> = reqs
                .iter()
                .map(|r| match &r.op {
                    RequestOp::Read { length, .. } => Response {
                        data: Bytes::from(vec![r.id.0 as u8; *length as usize]),
                        ..Response::ok(r.id)
                    },
                    RequestOp::Flush { flush_number } => Response {
                        flush_number: *flush_number,
                        ..Response::ok(r.id)
                    },
                    _ => Response::failed(r.id, pb::Status::NoSpace, "full"),
                })
                .collect();
            resps.reverse();
            answer(&mut s, &resps).await;
            // Hold the connection until the client is done.
            let _ = s.read(&mut [0u8; 1]).await;
        })
        .await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        let (a, b, c) = tokio::join!(
            p.read(RequestId(11), 0, 4096),
            p.flush(RequestId(12), FlushNumber(99)),
            p.write(RequestId(13), 0, Bytes::from(vec![1u8; 4096]), None)
        );
        assert_eq!(a.unwrap(), Bytes::from(vec![11u8; 4096]));
        assert_eq!(b.unwrap(), FlushNumber(99));
        assert!(matches!(c, Err(PathError::NoSpace(m)) if m == "full"));
    }

    /// A fake replica that answers every read as soon as it arrives, with the request id in
    /// every byte; it reports on `eof` when the client's side of the connection ends.
    async fn echo(eof: tokio::sync::oneshot::Sender<()>) -> String {
        echo_with(Response::ok(RequestId(0)), eof).await
    }

    /// [`echo`] with `hello` as the hello's answer.
    async fn echo_with(hello: Response, eof: tokio::sync::oneshot::Sender<()>) -> String {
        fake(hello, 0, |mut s, _| async move {
            let mut buf = BytesMut::new();
            loop {
                match frames::decode_request(&mut buf).unwrap() {
                    Decoded::Frame(r) => {
                        let RequestOp::Read { length, .. } = r.op else {
                            panic!("only reads here")
                        };
                        let resp = Response {
                            data: Bytes::from(vec![r.id.0 as u8; length as usize]),
                            ..Response::ok(r.id)
                        };
                        answer(&mut s, &[resp]).await;
                    }
                    Decoded::Need(_) => match s.read_buf(&mut buf).await {
                        Ok(n) if n > 0 => {}
                        _ => break,
                    },
                }
            }
            let _ = eof.send(());
        })
        .await
    }

    /// Requests one at a time and in bursts on one connection all get their own answers;
    /// close ends the connection at once, while the path object still exists.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sequential_and_burst_requests_get_their_answers_and_close_ends_the_connection() {
        let (eof_tx, eof_rx) = tokio::sync::oneshot::channel();
        let addr = echo(eof_tx).await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        let mut id = 0u64;
        for round in 0..3 {
            for _ in 0..20 {
                id += 1;
                let got = p.read(RequestId(id), 0, 512).await.unwrap();
                assert_eq!(
                    got,
                    Bytes::from(vec![id as u8; 512]),
                    "round {round} id {id}"
                );
            }
            let ids: Vec<u64> = (id + 1..=id + 64).collect();
            id += 64;
            let reads = ids.iter().map(|&i| p.read(RequestId(i), 0, 4096));
            for (i, got) in ids.iter().zip(futures::future::join_all(reads).await) {
                assert_eq!(got.unwrap(), Bytes::from(vec![*i as u8; 4096]), "id {i}");
            }
        }
        p.close();
        tokio::time::timeout(T, eof_rx)
            .await
            .expect("the replica sees the connection end right after close")
            .expect("fake finished");
        assert!(matches!(
            p.read(RequestId(999), 0, 512).await,
            Err(PathError::Disconnected(_))
        ));
    }

    /// Version 3: writes carry their block sums, a CORRUPT answer reaches the caller with its
    /// blocks and data, and ping is an op.
    #[tokio::test]
    async fn writes_carry_sums_and_corrupt_answers_name_their_blocks() {
        let addr = fake(Response::ok(RequestId(0)), 3, |mut s, reqs| async move {
            let mut resps = Vec::new();
            for r in &reqs {
                match &r.op {
                    RequestOp::Write { data, sums, .. } => {
                        assert_eq!(sums.as_ref(), BlockSums::of(data).as_ref(), "sums sent");
                        resps.push(Response::ok(r.id));
                    }
                    RequestOp::Read { length, .. } => resps.push(Response {
                        data: Bytes::from(vec![9u8; *length as usize]),
                        corrupt: vec![1],
                        ..Response::failed(r.id, pb::Status::Corrupt, "block 1 fails")
                    }),
                    RequestOp::Ping => resps.push(Response::ok(r.id)),
                    other => panic!("unexpected {other:?}"),
                }
            }
            answer(&mut s, &resps).await;
            let _ = s.read(&mut [0u8; 1]).await;
        })
        .await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        assert!(p.verifies());
        let data = Bytes::from(vec![1u8; 8192]);
        let (w, r, ping) = tokio::join!(
            p.write(RequestId(1), 0, data.clone(), BlockSums::of(&data)),
            p.read(RequestId(2), 0, 8192),
            p.ping(RequestId(3))
        );
        w.unwrap();
        ping.unwrap();
        match r {
            Err(PathError::Corrupt { blocks, data, .. }) => {
                assert_eq!(blocks, vec![1]);
                assert_eq!(data.len(), 8192);
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_refused_hello_carries_the_reason() {
        let refusal = Response {
            end: true,
            ..Response::failed(
                RequestId(0),
                pb::Status::Unavailable,
                "generation 7 is lower than 9",
            )
        };
        let addr = fake(refusal, 0, |_, _| async {}).await;
        match FramedDataPath::open(&addr, Generation(7), T, false).await {
            Err(PathError::Refused(m)) => assert!(m.contains("lower than 9"), "{m}"),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("a refused hello opened the path"),
        }
    }

    /// A replica of an older build refuses the hello for its version; the path says hello
    /// again one version lower on a new connection until it is accepted (here version 1) and
    /// works, with the bytes of a hole sent in full as version 1 has them.
    #[tokio::test]
    async fn a_version_1_replica_is_spoken_to_in_version_1() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let mut versions = Vec::new();
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let hello = read_hello(&mut s).await;
                versions.push(hello.version);
                if hello.version != 1 {
                    let refusal = Response {
                        end: true,
                        ..Response::failed(
                            RequestId(0),
                            pb::Status::Invalid,
                            format!(
                                "protocol version {} is not supported; this replica speaks version 1",
                                hello.version
                            ),
                        )
                    };
                    answer(&mut s, &[refusal]).await;
                    continue;
                }
                answer(&mut s, &[Response::ok(RequestId(0))]).await;
                let mut buf = BytesMut::new();
                let req = loop {
                    match frames::decode_request(&mut buf).unwrap() {
                        Decoded::Frame(r) => break r,
                        Decoded::Need(_) => assert!(s.read_buf(&mut buf).await.unwrap() > 0),
                    }
                };
                let mut b = Batch::for_version(1);
                b.push_response(&Response {
                    data: frames::zeros(4096),
                    ..Response::ok(req.id)
                });
                b.write_to(&mut s).await.unwrap();
                return (versions, s);
            }
        });
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        let data = p.read(RequestId(1), 0, 4096).await.unwrap();
        assert_eq!(data, Bytes::from(vec![0u8; 4096]));
        assert!(!frames::is_zeros(&data), "version 1 sent the bytes");
        // A write with a flush is refused before it is sent: this replica would not know
        // the flush was asked for.
        assert!(!p.flushes_writes());
        let refused = p
            .write_flush(
                RequestId(2),
                0,
                Bytes::from(vec![1u8; 4096]),
                None,
                FlushNumber(3),
            )
            .await;
        assert!(
            matches!(&refused, Err(PathError::Io(m)) if m.contains("protocol version")),
            "{refused:?}"
        );
        let (versions, _s) = server.await.unwrap();
        assert_eq!(
            versions,
            [frames::VERSION, 3, 2, 1],
            "one version lower at a time"
        );
    }

    /// A hello answer naming a local socket: a path opened as local says hello there too and
    /// moves its requests to it; opened as not local, or when nothing listens at the name, it
    /// stays on TCP and works.
    #[tokio::test]
    async fn a_local_replica_is_reached_over_its_named_socket_and_others_over_tcp() {
        let name = format!(
            "zebu-test.{}.{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let welcome = || Response {
            message: format!("@{name}"),
            ..Response::ok(RequestId(0))
        };
        let unix = tokio::net::UnixListener::bind(format!("\0{name}")).unwrap();
        let served = tokio::spawn(async move {
            let (mut s, _) = unix.accept().await.unwrap();
            let hello = read_hello(&mut s).await;
            let mut b = Batch::default();
            b.push_response(&Response::ok(RequestId(0)));
            b.write_to(&mut s).await.unwrap();
            let mut buf = BytesMut::new();
            let req = loop {
                match frames::decode_request(&mut buf).unwrap() {
                    Decoded::Frame(r) => break r,
                    Decoded::Need(_) => assert!(s.read_buf(&mut buf).await.unwrap() > 0),
                }
            };
            let mut b = Batch::default();
            b.push_response(&Response {
                data: Bytes::from(vec![0x5a; 4096]),
                ..Response::ok(req.id)
            });
            b.write_to(&mut s).await.unwrap();
            let _ = s.read(&mut [0u8; 1]).await;
            hello
        });
        // Local: the TCP side only welcomes; the request goes over the socket.
        let addr = fake(welcome(), 0, |s, _| async move {
            let mut s = s;
            let _ = s.read(&mut [0u8; 1]).await;
        })
        .await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, true)
                .await
                .unwrap(),
        );
        assert_eq!(p.kind(), "frames/local");
        assert_eq!(
            p.read(RequestId(5), 0, 4096).await.unwrap(),
            Bytes::from(vec![0x5a; 4096])
        );
        p.close();
        let hello = served.await.unwrap();
        assert_eq!((hello.version, hello.generation), (frames::VERSION, 7));

        // Not local: TCP, although a socket is named.
        let (eof_tx, _eof_rx) = tokio::sync::oneshot::channel();
        let addr = echo_with(welcome(), eof_tx).await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        assert_eq!(p.kind(), "frames/tcp");
        assert_eq!(
            p.read(RequestId(6), 0, 512).await.unwrap(),
            Bytes::from(vec![6u8; 512])
        );

        // Local, but nothing listens at the name (another host): TCP.
        let (eof_tx, _eof_rx) = tokio::sync::oneshot::channel();
        let gone = Response {
            message: "@zebu-test.nobody.listens".into(),
            ..Response::ok(RequestId(0))
        };
        let addr = echo_with(gone, eof_tx).await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, true)
                .await
                .unwrap(),
        );
        assert_eq!(p.kind(), "frames/tcp");
        assert_eq!(
            p.read(RequestId(8), 0, 512).await.unwrap(),
            Bytes::from(vec![8u8; 512])
        );
    }

    #[tokio::test]
    async fn a_broken_connection_fails_every_pending_request_at_once() {
        // The fake reads all three requests, answers none, and closes the connection.
        let addr = fake(Response::ok(RequestId(0)), 3, |s, _| async move { drop(s) }).await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        let started = Instant::now();
        let (a, b, c) = tokio::join!(
            p.read(RequestId(1), 0, 4096),
            p.write(RequestId(2), 0, Bytes::from(vec![1u8; 64 << 10]), None),
            p.unmap(RequestId(3), 0, 4096, true)
        );
        for r in [a.map(|_| ()), b, c] {
            assert!(matches!(r, Err(PathError::Disconnected(_))), "{r:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "failed only after {:?}",
            started.elapsed()
        );
        // And every later call fails at once too.
        assert!(matches!(
            p.flush(RequestId(4), FlushNumber(0)).await,
            Err(PathError::Disconnected(_))
        ));
    }

    #[tokio::test]
    async fn an_end_notice_fails_pending_requests_with_its_reason() {
        let addr = fake(Response::ok(RequestId(0)), 1, |mut s, _| async move {
            let end = Response {
                end: true,
                ..Response::failed(
                    RequestId(0),
                    pb::Status::Unavailable,
                    "fenced: generation 7 was superseded",
                )
            };
            answer(&mut s, &[end]).await;
        })
        .await;
        let p: Arc<dyn DataPath> = Arc::new(
            FramedDataPath::open(&addr, Generation(7), T, false)
                .await
                .unwrap(),
        );
        match p.read(RequestId(1), 0, 4096).await {
            Err(PathError::Disconnected(m)) => assert!(m.contains("superseded"), "{m}"),
            other => panic!("expected Disconnected, got {other:?}"),
        }
    }
}
