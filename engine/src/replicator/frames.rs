//! [`FramedDataPath`]: the replica data path over data frames (`zebu_proto::frames`) on one
//! plain TCP connection per replica, to the replica's usual port.
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
//! - The hello asks for [`frames::VERSION`], whose answers may carry a hole as a ZEROS flag
//!   (decoded into the shared [`frames::zeros`]: no bytes on the wire, no allocation here).
//!   A replica of an older build refuses that version with a message naming the "protocol
//!   version" (its refusal carries no other sign of the reason); the path then says hello
//!   again in [`frames::MIN_VERSION`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use zebu_proto::frames::{self, Batch, Decoded, Hello, Request, RequestOp, Response};
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
    pending: Mutex<Option<HashMap<u64, Waiter>>>,
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
}

impl FramedDataPath {
    /// Connects to the replica at `addr` (`host:port`), sends the hello with `generation`
    /// and waits for its answer, all within `timeout`.
    pub async fn open(
        addr: &str,
        generation: u64,
        timeout: Duration,
    ) -> Result<FramedDataPath, PathError> {
        let (stream, rest) = tokio::time::timeout(timeout, async {
            match handshake(addr, generation, frames::VERSION).await {
                // A replica of an older build: say hello again in its version.
                Err(PathError::Refused(why)) if why.contains("protocol version") => {
                    tracing::info!(replica = %addr, "frames: {why}; using version {}", frames::MIN_VERSION);
                    handshake(addr, generation, frames::MIN_VERSION).await
                }
                other => other,
            }
        })
        .await
        .map_err(|_| PathError::Timeout(timeout))??;
        let (rd, wr) = stream.into_split();
        let conn = Arc::new(Conn {
            addr: addr.to_string(),
            pending: Mutex::new(Some(HashMap::new())),
            broken: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let writer = tokio::spawn(write_requests(conn.clone(), wr, rx));
        let reader = tokio::spawn(read_answers(conn.clone(), rd, rest));
        tracing::debug!(replica = %addr, generation, "frames data path open");
        Ok(FramedDataPath {
            conn,
            queue: Mutex::new(Some(tx)),
            tasks: [writer.abort_handle(), reader.abort_handle()],
        })
    }

    async fn call(&self, id: u64, op: RequestOp) -> Result<Response, PathError> {
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
            Some(q) => q.send(Request { id, op }).await.is_ok(),
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
        match resp.status {
            pb::Status::Ok => Ok(resp),
            pb::Status::Invalid | pb::Status::Unavailable => Err(PathError::Refused(resp.message)),
            pb::Status::NoSpace => Err(PathError::NoSpace(resp.message)),
            pb::Status::IoError => Err(PathError::Io(resp.message)),
        }
    }
}

/// Connects, sends the hello in `version` and reads its answer; returns the stream and any
/// bytes read past the answer.
async fn handshake(
    addr: &str,
    generation: u64,
    version: u32,
) -> Result<(TcpStream, BytesMut), PathError> {
    let disconnected =
        |what: &str, e: std::io::Error| PathError::Disconnected(format!("{what} {addr}: {e}"));
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| disconnected("connect", e))?;
    // Without it, a lone request waits for the replica's delayed ACK of the previous one.
    stream
        .set_nodelay(true)
        .map_err(|e| disconnected("TCP_NODELAY on", e))?;
    let hello = Hello {
        version,
        generation,
    };
    stream
        .write_all(&hello.encode())
        .await
        .map_err(|e| disconnected("hello to", e))?;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let answer = loop {
        match frames::decode_response(&mut buf) {
            Ok(Decoded::Frame(r)) => break r,
            Ok(Decoded::Need(_)) => {}
            Err(e) => {
                return Err(PathError::Disconnected(format!(
                    "{addr}: bad hello answer: {e}"
                )));
            }
        }
        let n = stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| disconnected("hello answer from", e))?;
        if n == 0 {
            return Err(PathError::Disconnected(format!(
                "{addr} closed the connection before answering the hello"
            )));
        }
    };
    if answer.id != 0 || answer.status != pb::Status::Ok {
        return Err(PathError::Refused(answer.message));
    }
    Ok((stream, buf))
}

/// Sends every queued request, many per vectored write, until the queue closes or the
/// socket fails.
async fn write_requests(conn: Arc<Conn>, mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Request>) {
    let mut batch = Batch::default();
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
async fn read_answers(conn: Arc<Conn>, mut rd: OwnedReadHalf, mut buf: BytesMut) {
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
                        tracing::debug!(replica = %conn.addr, id = resp.id, "answer to no pending request")
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
    fn read(&self, id: u64, offset: u64, length: u64) -> BoxFuture<'_, Result<Bytes, PathError>> {
        Box::pin(async move {
            let resp = self.call(id, RequestOp::Read { offset, length }).await?;
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
            self.call(id, RequestOp::Write { offset, data })
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
                RequestOp::Unmap {
                    offset,
                    length,
                    zero_fill,
                },
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
                    RequestOp::Flush {
                        flush_number: number,
                    },
                )
                .await?;
            Ok(resp.flush_number)
        })
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
            let mut h = [0u8; frames::HELLO_LEN];
            s.read_exact(&mut h).await.unwrap();
            let hello_in = Hello::decode(&h).unwrap();
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

    async fn answer(s: &mut TcpStream, resps: &[Response]) {
        let mut b = Batch::default();
        for r in resps {
            b.push_response(r);
        }
        b.write_to(s).await.unwrap();
    }

    #[tokio::test]
    async fn answers_in_reverse_order_reach_their_requests() {
        let addr = fake(Response::ok(0), 3, |mut s, reqs| async move {
            let mut resps: Vec<Response> = reqs
                .iter()
                .map(|r| match &r.op {
                    RequestOp::Read { length, .. } => Response {
                        data: Bytes::from(vec![r.id as u8; *length as usize]),
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
        let p = FramedDataPath::open(&addr, 7, T).await.unwrap();
        let (a, b, c) = tokio::join!(
            p.read(11, 0, 4096),
            p.flush(12, 99),
            p.write(13, 0, Bytes::from(vec![1u8; 4096]))
        );
        assert_eq!(a.unwrap(), Bytes::from(vec![11u8; 4096]));
        assert_eq!(b.unwrap(), 99);
        assert!(matches!(c, Err(PathError::NoSpace(m)) if m == "full"));
    }

    /// A fake replica that answers every read as soon as it arrives, with the request id in
    /// every byte; it reports on `eof` when the client's side of the connection ends.
    async fn echo(eof: tokio::sync::oneshot::Sender<()>) -> String {
        fake(Response::ok(0), 0, |mut s, _| async move {
            let mut buf = BytesMut::new();
            loop {
                match frames::decode_request(&mut buf).unwrap() {
                    Decoded::Frame(r) => {
                        let RequestOp::Read { length, .. } = r.op else {
                            panic!("only reads here")
                        };
                        let resp = Response {
                            data: Bytes::from(vec![r.id as u8; length as usize]),
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
        let p = FramedDataPath::open(&addr, 7, T).await.unwrap();
        let mut id = 0u64;
        for round in 0..3 {
            for _ in 0..20 {
                id += 1;
                let got = p.read(id, 0, 512).await.unwrap();
                assert_eq!(
                    got,
                    Bytes::from(vec![id as u8; 512]),
                    "round {round} id {id}"
                );
            }
            let ids: Vec<u64> = (id + 1..=id + 64).collect();
            id += 64;
            let reads = ids.iter().map(|&i| p.read(i, 0, 4096));
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
            p.read(999, 0, 512).await,
            Err(PathError::Disconnected(_))
        ));
    }

    #[tokio::test]
    async fn a_refused_hello_carries_the_reason() {
        let refusal = Response {
            end: true,
            ..Response::failed(0, pb::Status::Unavailable, "generation 7 is lower than 9")
        };
        let addr = fake(refusal, 0, |_, _| async {}).await;
        match FramedDataPath::open(&addr, 7, T).await {
            Err(PathError::Refused(m)) => assert!(m.contains("lower than 9"), "{m}"),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("a refused hello opened the path"),
        }
    }

    /// A replica of an older build refuses the hello for its version; the path says hello
    /// again in version 1 on a new connection and works, with the bytes of a hole sent in
    /// full as version 1 has them.
    #[tokio::test]
    async fn a_version_1_replica_is_spoken_to_in_version_1() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let mut versions = Vec::new();
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut h = [0u8; frames::HELLO_LEN];
                s.read_exact(&mut h).await.unwrap();
                let hello = Hello::decode(&h).unwrap();
                versions.push(hello.version);
                if hello.version != 1 {
                    let refusal = Response {
                        end: true,
                        ..Response::failed(
                            0,
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
                answer(&mut s, &[Response::ok(0)]).await;
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
        let p = FramedDataPath::open(&addr, 7, T).await.unwrap();
        let data = p.read(1, 0, 4096).await.unwrap();
        assert_eq!(data, Bytes::from(vec![0u8; 4096]));
        assert!(!frames::is_zeros(&data), "version 1 sent the bytes");
        let (versions, _s) = server.await.unwrap();
        assert_eq!(versions, [frames::VERSION, 1]);
    }

    #[tokio::test]
    async fn a_broken_connection_fails_every_pending_request_at_once() {
        // The fake reads all three requests, answers none, and closes the connection.
        let addr = fake(Response::ok(0), 3, |s, _| async move { drop(s) }).await;
        let p = FramedDataPath::open(&addr, 7, T).await.unwrap();
        let started = Instant::now();
        let (a, b, c) = tokio::join!(
            p.read(1, 0, 4096),
            p.write(2, 0, Bytes::from(vec![1u8; 64 << 10])),
            p.unmap(3, 0, 4096, true)
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
            p.flush(4, 0).await,
            Err(PathError::Disconnected(_))
        ));
    }

    #[tokio::test]
    async fn an_end_notice_fails_pending_requests_with_its_reason() {
        let addr = fake(Response::ok(0), 1, |mut s, _| async move {
            let end = Response {
                end: true,
                ..Response::failed(
                    0,
                    pb::Status::Unavailable,
                    "fenced: generation 7 was superseded",
                )
            };
            answer(&mut s, &[end]).await;
        })
        .await;
        let p = FramedDataPath::open(&addr, 7, T).await.unwrap();
        match p.read(1, 0, 4096).await {
            Err(PathError::Disconnected(m)) => assert!(m.contains("superseded"), "{m}"),
            other => panic!("expected Disconnected, got {other:?}"),
        }
    }
}
