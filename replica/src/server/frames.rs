//! The data stream over data frames (`zebu_proto::frames`): one connection per stream, on the
//! replica's gRPC port (the accept loop in `listen.rs` sends a connection here when its first
//! byte is the frames magic) or on its local socket (a Unix socket for clients on this host,
//! named in every hello answer; `listen.rs`).
//!
//! ```text
//!   socket ─► FrameReader ─► connection task ─────────────────────────────────────► socket
//!              (BytesMut,     hello → data::accept (shared with gRPC)        (every answer
//!               cancel-safe)  requests → FuturesUnordered of data::run_op,    ready goes out
//!                             ≤ MAX_IN_FLIGHT and MAX_BYTES_IN_FLIGHT,        in one vectored
//!                             permits held until the answer is written        write)
//! ```
//!
//! Requests run concurrently inside the connection task (a `FuturesUnordered`, not a task
//! each: polling them in one task saves a spawn and a wake-up per request) and are answered
//! in completion order, by the same task: it starts every request already received, gathers
//! every answer already done, and writes them together (`serve_requests` says why there is
//! no separate writer task). Hello, fencing
//! and execution are the gRPC stream's own functions (`data::accept`, `data::fenced`,
//! `data::run_op`), so both transports refuse, fence and answer identically: a higher
//! generation accepted on either ends streams of both kinds, and a close ends them all.
//!
//! Every protocol version is spoken, each connection in its client's: from version 2 on, a
//! read of a hole (the store returns `frames::zeros`) is answered with the ZEROS flag and no
//! payload; from version 3 on, writes may carry block sums, reads may be answered CORRUPT,
//! and ping is an op (`frames::Batch` translates answers for older clients). A hello naming a
//! critical extension this build does not know is refused.
//!
//! When the stream is fenced or the replica closes, the task stops reading, lets the requests
//! already running answer, sends an END response with the reason and closes the connection.
//! Malformed input (bad magic, unknown op, reserved bits, a length over the frame limit, EOF
//! in the middle of a frame) cannot be skipped: the connection ends the same way, with a log
//! line and an END saying what was wrong; other connections are not affected. A read or write
//! over `MAX_IO_BYTES` that frames correctly is answered INVALID by `run_op`, as on gRPC.

use std::fmt::Display;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Code, Status};
use tracing::{Instrument, debug, info, info_span};
use zebu_proto::auth;
use zebu_proto::frames::{
    self, Batch, Decoded, FrameError, Hello, REQUEST_HEADER_LEN, Request, RequestHeader, RequestOp,
    Response,
};
use zebu_proto::ids::RequestId;
use zebu_proto::replica as pb;

use super::data;
use super::{MAX_IN_FLIGHT, Shared};
use crate::io::{AlignedBuf, ConnectionLoad, IO_ALIGN, LoadGuard};
use crate::pathtime::{PathTimes, Step};

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// Least room made in the read buffer before each read, so small frames arrive many at once.
const READ_CHUNK: usize = 64 << 10;
/// Writes with at least this much payload (and a length the I/O alignment divides) are read
/// straight into memory aligned for direct I/O, which the store then writes without copying.
const DIRECT_PAYLOAD_MIN: usize = 64 << 10;
/// Most answers gathered into one vectored write (keeps the iovec count well under IOV_MAX).
const MAX_BATCH: usize = 128;

/// An answer, the budget its request holds until the answer is on the socket, and the
/// step that measures the way onto the socket with the moment it starts (`pathtime.rs`).
type Answer = (Response, Option<Permits>, Option<(Step, Instant)>);
type Permits = (OwnedSemaphorePermit, OwnedSemaphorePermit);

#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    #[error("connection ended in the middle of a frame ({0} bytes buffered)")]
    Truncated(usize),
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves one frames connection, given as its two halves (TCP or the local socket), until it
/// ends; never panics on its input.
pub(super) async fn serve<R, W>(shared: Arc<Shared>, rd: R, wr: W, peer: impl Display)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let span =
        info_span!(parent: &shared.span, "frames", %peer, generation = tracing::field::Empty);
    run(shared, rd, wr).instrument(span).await;
}

async fn run<R, W>(shared: Arc<Shared>, rd: R, mut wr: W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut reader = FrameReader {
        rd,
        buf: BytesMut::with_capacity(READ_CHUNK),
        direct: None,
        budget: shared.receiving.clone(),
        receiving: None,
    };
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, reader.hello()).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return info!("frames connection dropped before its hello: {e}"),
        Err(_) => return info!("frames connection dropped: no hello within {HELLO_TIMEOUT:?}"),
    };
    // The extensions this replica knows (frames.rs in proto: "Hello extensions").
    let claim = frames::VolumeClaim::from_extensions(&hello.extensions);
    let known = [frames::EXT_VOLUME, auth::EXT_AUTH];
    let accepted = match (hello.extensions.unknown_critical(&known), claim) {
        (Some(kind), _) => Err(Status::invalid_argument(format!(
            "the hello asks for critical extension {kind:#06x}, which this replica does not know"
        ))),
        (None, Err(e)) => Err(Status::invalid_argument(format!("bad hello: {e}"))),
        (None, Ok(claim)) => {
            // Authenticated before the generation is looked at: a client without the secret
            // fences nothing.
            match authenticate(&shared, &hello, claim.as_ref(), &mut reader, &mut wr).await {
                Ok(()) => {
                    data::accept(
                        &shared,
                        hello.version,
                        frames::MIN_VERSION..=frames::VERSION,
                        hello.generation,
                        claim,
                    )
                    .await
                }
                Err(status) => Err(status),
            }
        }
    };
    let (generation, closes) = match accepted {
        Ok(a) => a,
        Err(status) => {
            info!(code = ?status.code(), "frames stream refused: {}", status.message());
            let refusal = Response {
                end: true,
                ..Response::failed(RequestId::HELLO, frame_status(&status), status.message())
            };
            let _ = write_one(&mut wr, &refusal).await;
            return;
        }
    };
    tracing::Span::current().record("generation", generation);
    // The answer names the replica's local socket, where a client on this host may open its
    // streams instead (frames.rs in proto: "The local socket").
    let welcome = Response {
        message: shared.local_socket.get().cloned().unwrap_or_default(),
        ..Response::ok(RequestId::HELLO)
    };
    if let Err(e) = write_one(&mut wr, &welcome).await {
        return info!("frames connection lost at the hello answer: {e}");
    }
    info!("frames stream accepted");

    let end = serve_requests(
        &shared,
        hello.version,
        generation,
        closes,
        &mut reader,
        &mut wr,
    )
    .await;
    if let Some(why) = &end {
        info!("frames stream ended: {}", why.message);
        if let Err(e) = write_one(&mut wr, why).await {
            debug!("frames connection: writing the END notice failed: {e}");
        }
    } else {
        info!("frames stream closed by the client");
    }
    if let Err(e) = wr.shutdown().await {
        debug!("frames connection: shutdown failed: {e}");
    }
}

/// Answers gathered for one vectored write, with the budget their requests hold until the
/// answers are on the socket.
struct Outbox {
    batch: Batch,
    held: Vec<Option<Permits>>,
    /// The answers whose way onto the socket is measured.
    timed: Vec<(Step, Instant)>,
    /// A write failed: nobody will read answers any more; they are dropped from now on.
    gone: bool,
}

impl Outbox {
    fn push(&mut self, (resp, permits, timed): Answer) {
        if !self.gone {
            self.batch.push_response(&resp);
        }
        self.held.push(permits);
        self.timed.extend(timed);
    }

    fn full(&self) -> bool {
        self.batch.frames() >= MAX_BATCH
    }

    /// Sends what is gathered (one vectored write, or a few if the socket takes less), then
    /// releases the budget of those requests. TCP_NODELAY is set on accept, so the answers
    /// leave at once.
    async fn send<W: AsyncWrite + Unpin>(&mut self, wr: &mut W, times: &PathTimes) {
        if !self.gone
            && !self.batch.is_empty()
            && let Err(e) = self.batch.write_to(wr).await
        {
            // The requests still running finish (a store operation is never dropped
            // halfway); their answers are dropped.
            debug!("frames connection lost ({e}); finishing the requests in flight");
            self.gone = true;
        }
        let now = Instant::now();
        for (step, since) in self.timed.drain(..) {
            times.add(step, now.saturating_duration_since(since));
        }
        self.batch.clear();
        self.held.clear();
    }
}

/// The request loop: reads requests, runs them concurrently and answers them, all in this one
/// task; returns the END notice to send, if the stream ends for a reason other than the
/// client closing it.
///
/// Why one task: with the page cache a write or a cached read completes as soon as it is
/// polled, so a separate writer task meant a cross-task wake-up and a `writev` per request
/// (measured: 3 replicas behind one engine served 4 KiB random writes at QD 32 *slower* with
/// the page cache than with O_DIRECT). Here every request already buffered or on the socket
/// is started, every answer already done is gathered, and only then is the batch written:
/// one `read` and one `writev` carry many requests when many are in flight.
async fn serve_requests<R, W>(
    shared: &Arc<Shared>,
    version: u32,
    generation: u64,
    closes: u64,
    reader: &mut FrameReader<R>,
    wr: &mut W,
) -> Option<Response>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut fence = shared.fence.subscribe();
    let count = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    // The port's budget, shared with every other stream (module docs of `server`).
    let bytes = shared.in_flight.clone();
    let mut running = FuturesUnordered::new();
    // A request read (and when) but not started: the budget is spent until answers are
    // written.
    let mut waiting: Option<((Request, Instant, LoadGuard), u32)> = None;
    // Every request from read to answer: a flush alone in it syncs in this task.
    let load = ConnectionLoad::default();
    let mut end: Option<Response> = None;
    let mut eof = false;
    let mut out = Outbox {
        batch: Batch::for_version(version),
        held: Vec::with_capacity(MAX_BATCH),
        timed: Vec::with_capacity(MAX_BATCH),
        gone: false,
    };
    // Starts a request read off the socket, or parks it until the budget allows.
    let start = |req: Request,
                 running: &mut FuturesUnordered<_>,
                 waiting: &mut Option<((Request, Instant, LoadGuard), u32)>| {
        let units = data::request_units(&req);
        let counted = load.enter();
        match try_acquire(&count, &bytes, units) {
            Some(p) => running.push(load.scope(execute(
                shared.clone(),
                generation,
                closes,
                (req, Instant::now(), counted),
                p,
            ))),
            None => *waiting = Some(((req, Instant::now(), counted), units)),
        }
    };
    loop {
        if end.is_none()
            && let Some(why) = data::fenced(*fence.borrow_and_update(), generation, closes)
        {
            end = Some(end_notice(frame_status(&why), why.message()));
        }
        if out.gone {
            // Not started, so dropping it is safe.
            waiting = None;
        }
        // Gather everything that is ready without waiting: requests already received, and
        // answers already done (polling with a no-op waker is fine: the `select!` below
        // polls both again with the task's own waker before it sleeps).
        loop {
            let mut progress = false;
            if end.is_none() && !eof && !out.gone && waiting.is_none() && !out.full() {
                match reader.next().now_or_never() {
                    Some(Ok(Some(req))) => {
                        start(req, &mut running, &mut waiting);
                        progress = true;
                    }
                    Some(Ok(None)) => eof = true,
                    Some(Err(e)) => {
                        info!("frames connection ends on bad input: {e}");
                        eof = true;
                        end = Some(end_notice(pb::Status::Invalid, &e.to_string()));
                    }
                    None => {}
                }
            }
            if !out.full()
                && let Some(Some(answer)) = running.next().now_or_never()
            {
                out.push(answer);
                progress = true;
            }
            if !progress || out.full() {
                break;
            }
        }
        if !out.held.is_empty() {
            out.send(wr, shared.io.times()).await;
            continue;
        }
        let reading = end.is_none() && !eof && !out.gone;
        if !reading && waiting.is_none() && running.is_empty() {
            return if out.gone { None } else { end };
        }
        tokio::select! {
            biased;
            Some(answer) = running.next() => out.push(answer),
            changed = fence.changed(), if end.is_none() => {
                if changed.is_err() {
                    end = Some(end_notice(pb::Status::Unavailable, "the replica server is stopping"));
                }
            }
            permits = acquire(&count, &bytes, waiting.as_ref().map_or(1, |w| w.1)), if waiting.is_some() => {
                let (req, _) = waiting.take().expect("invariant: the branch runs only when waiting");
                running.push(load.scope(execute(shared.clone(), generation, closes, req, permits)));
            }
            next = reader.next(), if reading && waiting.is_none() => match next {
                Ok(Some(req)) => start(req, &mut running, &mut waiting),
                Ok(None) => eof = true,
                Err(e) => {
                    info!("frames connection ends on bad input: {e}");
                    eof = true;
                    end = Some(end_notice(pb::Status::Invalid, &e.to_string()));
                }
            },
        }
    }
}

fn end_notice(status: pb::Status, why: &str) -> Response {
    Response {
        end: true,
        ..Response::failed(RequestId::HELLO, status, why)
    }
}

fn try_acquire(count: &Arc<Semaphore>, bytes: &Arc<Semaphore>, units: u32) -> Option<Permits> {
    let c = count.clone().try_acquire_owned().ok()?;
    let b = bytes.clone().try_acquire_many_owned(units).ok()?;
    Some((c, b))
}

async fn acquire(count: &Arc<Semaphore>, bytes: &Arc<Semaphore>, units: u32) -> Permits {
    let c = count.clone().acquire_owned().await;
    let b = bytes.clone().acquire_many_owned(units).await;
    (
        c.expect("invariant: the semaphore is never closed"),
        b.expect("invariant: the semaphore is never closed"),
    )
}

async fn execute(
    shared: Arc<Shared>,
    generation: u64,
    closes: u64,
    (req, received, _counted): (Request, Instant, LoadGuard),
    permits: Permits,
) -> Answer {
    let answer_step = match req.op {
        RequestOp::Write { .. } => Some(Step::WriteAnswer),
        RequestOp::Flush { .. } => Some(Step::FlushAnswer),
        _ => None,
    };
    let answer = data::run_op(&shared, generation, closes, req, received).await;
    if answer.status != pb::Status::Ok {
        debug!(id = answer.id.0, status = ?answer.status, "request failed: {}", answer.message);
    }
    (
        answer,
        Some(permits),
        answer_step.map(|s| (s, Instant::now())),
    )
}

/// The frames status for a status that ends or refuses a gRPC stream.
/// The challenge-response of `zebu_proto::auth` ("Data frames"), when the replica has a
/// secret or the client asks for it: answers the first hello with a challenge and checks the
/// proof in the second.
async fn authenticate<R, W>(
    shared: &Shared,
    hello: &Hello,
    claim: Option<&frames::VolumeClaim>,
    reader: &mut FrameReader<R>,
    wr: &mut W,
) -> Result<(), Status>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (secret, nc) = match (&shared.secret, hello.extensions.get(auth::EXT_AUTH)) {
        (None, None) => return Ok(()),
        (None, Some(_)) => {
            return Err(Status::failed_precondition(
                "the hello asks to authenticate, but this replica was started without the \
                 volume's secret",
            ));
        }
        (Some(_), None) => {
            return Err(Status::unauthenticated(
                "this replica requires authentication: the hello carries no proof of the \
                 volume's secret (give the engine the volume's secret file)",
            ));
        }
        (Some(s), Some(nc)) => (s, nc.clone()),
    };
    if nc.len() != auth::NONCE_LEN {
        return Err(Status::invalid_argument(
            "bad hello: the auth nonce is not 32 bytes",
        ));
    }
    let volume = claim.map_or("", |c| c.uuid.as_str());
    let ns = auth::nonce();
    let challenge = frames::Extensions(vec![frames::Extension {
        kind: auth::EXT_AUTH,
        value: secret.server_challenge(&nc, &ns, volume).into(),
    }]);
    let answer = Response {
        data: challenge.encode().into(),
        ..Response::ok(RequestId::HELLO)
    };
    write_one(wr, &answer)
        .await
        .map_err(|e| Status::unavailable(format!("connection lost at the challenge: {e}")))?;
    let proof = match tokio::time::timeout(HELLO_TIMEOUT, reader.hello()).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return Err(Status::unauthenticated(format!("no proof hello: {e}"))),
        Err(_) => return Err(Status::unauthenticated("no proof within the hello timeout")),
    };
    if proof.version != hello.version || proof.generation != hello.generation {
        return Err(Status::unauthenticated(
            "the proof's hello differs from the first hello",
        ));
    }
    let p = proof
        .extensions
        .get(auth::EXT_AUTH)
        .ok_or_else(|| Status::unauthenticated("the second hello carries no proof"))?;
    secret
        .check_client(&nc, &ns, volume, hello.version, hello.generation, p)
        .map_err(|e| Status::unauthenticated(e.to_string()))
}

fn frame_status(s: &Status) -> pb::Status {
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange => pb::Status::Invalid,
        Code::ResourceExhausted => pb::Status::NoSpace,
        Code::FailedPrecondition | Code::Unavailable => pb::Status::Unavailable,
        _ => pb::Status::IoError,
    }
}

/// Reads frames off the socket. [`FrameReader::next`] is cancel-safe: bytes are only taken
/// off the buffer when a whole frame is there, so it can sit in a `select!`.
struct FrameReader<R> {
    rd: R,
    buf: BytesMut,
    /// A large write whose payload is being read into aligned memory (see
    /// [`DIRECT_PAYLOAD_MIN`]); kept here, not in a local, so `next` stays cancel-safe.
    direct: Option<DirectPayload>,
    /// The port's budget for payload still arriving (`PORT_BYTES_RECEIVING`).
    budget: Arc<Semaphore>,
    /// The share of it the write being received holds, from its header until it is whole.
    receiving: Option<OwnedSemaphorePermit>,
}

struct DirectPayload {
    header: RequestHeader,
    /// The write's block sums (version 3), taken before its data.
    sums: bytes::Bytes,
    data: AlignedBuf,
    filled: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    async fn hello(&mut self) -> Result<Hello, ReadError> {
        loop {
            match frames::decode_hello(&mut self.buf)? {
                Decoded::Frame(h) => return Ok(h),
                Decoded::Need(total) => {
                    if !self.fill(total).await? {
                        return Err(ReadError::Truncated(self.buf.len()));
                    }
                }
            }
        }
    }

    /// The next request, or `None` at a clean end of the connection (between frames).
    async fn next(&mut self) -> Result<Option<Request>, ReadError> {
        loop {
            if let Some(p) = &mut self.direct {
                if p.filled == p.data.len() {
                    let p = self.direct.take().expect("invariant: checked just above");
                    self.receiving = None;
                    return Ok(Some(p.header.into_request(p.sums, p.data.into_bytes())));
                }
                // One read per poll: cancel-safe, nothing read is lost if dropped.
                let n = self.rd.read(&mut p.data[p.filled..]).await?;
                if n == 0 {
                    return Err(ReadError::Truncated(REQUEST_HEADER_LEN + p.filled));
                }
                p.filled += n;
                continue;
            }
            if let Some(head) = self.buf.first_chunk::<REQUEST_HEADER_LEN>() {
                let h = RequestHeader::decode(head)?;
                let len = h.payload_len();
                let whole = self.buf.len() >= REQUEST_HEADER_LEN + len;
                if !whole && len > 0 && self.receiving.is_none() {
                    // Before any buffer for the payload exists. Cancel-safe: the header stays
                    // in `buf` and the permit, once taken, in `self`.
                    let cap = data::units_of_bytes(super::PORT_BYTES_RECEIVING) as u32;
                    let units = data::units_for(0, len as u64).min(cap);
                    let permit = self
                        .budget
                        .clone()
                        .acquire_many_owned(units)
                        .await
                        .expect("invariant: the semaphore is never closed");
                    self.receiving = Some(permit);
                }
                let data_len = h.length as usize;
                let sums_len = h.sums_len();
                if h.is_write()
                    && !whole
                    && data_len >= DIRECT_PAYLOAD_MIN
                    && data_len.is_multiple_of(IO_ALIGN)
                {
                    // The sums (small) come first and are taken from the buffer as they are.
                    if self.buf.len() < REQUEST_HEADER_LEN + sums_len {
                        if !self.fill(REQUEST_HEADER_LEN + sums_len).await? {
                            return Err(ReadError::Truncated(self.buf.len()));
                        }
                        continue;
                    }
                    self.buf.advance(REQUEST_HEADER_LEN);
                    let sums = self.buf.split_to(sums_len).freeze();
                    // A multiple of the alignment: the buffer is exactly `data_len` long.
                    let mut data = AlignedBuf::for_overwrite(data_len);
                    let have = self.buf.len().min(data_len);
                    data[..have].copy_from_slice(&self.buf[..have]);
                    self.buf.advance(have);
                    self.direct = Some(DirectPayload {
                        header: h,
                        sums,
                        data,
                        filled: have,
                    });
                    continue;
                }
            }
            match frames::decode_request(&mut self.buf)? {
                Decoded::Frame(req) => {
                    self.receiving = None;
                    return Ok(Some(req));
                }
                Decoded::Need(total) => {
                    if !self.fill(total).await? {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Reads more, making room for a frame of `total` bytes; false at EOF between frames.
    async fn fill(&mut self, total: usize) -> Result<bool, ReadError> {
        let want = total.saturating_sub(self.buf.len()).max(READ_CHUNK);
        self.buf.reserve(want);
        if self.rd.read_buf(&mut self.buf).await? == 0 {
            if self.buf.is_empty() {
                return Ok(false);
            }
            return Err(ReadError::Truncated(self.buf.len()));
        }
        Ok(true)
    }
}

async fn write_one<W: AsyncWrite + Unpin>(wr: &mut W, resp: &Response) -> std::io::Result<()> {
    let mut b = Batch::default();
    b.push_response(resp);
    b.write_to(wr).await
}
