//! The data stream: hello and fencing, then requests executed concurrently.
//!
//! ```text
//!   client ──hello(g)──►  accept_generation(g) under the write guard
//!          ◄──id 0 OK──   (or the stream ends: FAILED_PRECONDITION / UNAVAILABLE)
//!   client ──req id n──►  reader loop ── permit (≤ MAX_IN_FLIGHT) ── spawn ──► store
//!          ◄──resp id n── ◄────────────── mpsc ◄──────────────────────────────┘
//! ```
//!
//! The reader loop also watches the fence; when a higher generation is accepted or the
//! replica closes, it stops reading and ends the stream with an error status once the
//! requests already running have answered. A bad request is answered with a non-OK
//! [`DataStatus`]; only a broken transport (or an oversized message, which the transport
//! cannot skip) ends the stream.
//!
//! Both transports run the same request type: a gRPC message is converted into the frames
//! [`Request`] (`zebu_proto::frames`) and [`run_op`] answers it with a [`Response`], which
//! goes back as a gRPC message or a frame, translated for the client's protocol version (a
//! version 1 client gets IO_ERROR where a version 3 client gets CORRUPT).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};
use zebu_proto::frames::{Request, RequestOp, Response};
use zebu_proto::ids::RequestId;
use zebu_proto::numbers::Generation;
use zebu_proto::replica as pb;
use zebu_proto::replica::data_request::Op;

use super::convert::{DataStatus, data_status_of};
use super::{Fence, MAX_BYTES_IN_FLIGHT, MAX_IN_FLIGHT, MAX_IO_BYTES, MAX_MESSAGE_BYTES, Shared};
use crate::ReplicaError;
use crate::pathtime::Step;

/// How long a new stream may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

type Tx = mpsc::Sender<Result<pb::DataResponse, Status>>;

/// Starts serving one data stream; the returned stream is the response half.
pub(super) fn start(
    shared: Arc<Shared>,
    inbound: Streaming<pb::DataRequest>,
) -> ReceiverStream<Result<pb::DataResponse, Status>> {
    // Room for every request in flight plus the hello and a final error.
    let (tx, rx) = mpsc::channel(MAX_IN_FLIGHT + 2);
    let span = info_span!(parent: &shared.span, "data", generation = tracing::field::Empty);
    tokio::spawn(run(shared, inbound, tx).instrument(span));
    ReceiverStream::new(rx)
}

async fn run(shared: Arc<Shared>, mut inbound: Streaming<pb::DataRequest>, tx: Tx) {
    let (version, generation, closes) = match hello(&shared, &mut inbound).await {
        Ok(accepted) => accepted,
        Err(status) => {
            info!(code = ?status.code(), "data stream refused: {}", status.message());
            let _ = tx.send(Err(status)).await;
            return;
        }
    };
    tracing::Span::current().record("generation", generation);
    info!("data stream accepted");
    if tx
        .send(Ok(pb::DataResponse::from(Response::ok(RequestId::HELLO))))
        .await
        .is_err()
    {
        return;
    }

    let mut fence = shared.fence.subscribe();
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    // The port's budget, shared with every other stream (module docs of `server`).
    let byte_budget = shared.in_flight.clone();
    let end: Option<Status> = loop {
        if let Some(why) = fenced(*fence.borrow_and_update(), generation, closes) {
            break Some(why);
        }
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("invariant: the semaphore is never closed"),
            _ = fence.changed() => continue,
        };
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(req)) => {
                    // Requests in flight finish on their own, so this wait always ends.
                    let bytes = byte_budget
                        .clone()
                        .acquire_many_owned(budget_units(&req))
                        .await
                        .expect("invariant: the semaphore is never closed");
                    let permit = (permit, bytes);
                    let task = execute(shared.clone(), version, generation, closes, req, tx.clone(), permit);
                    tokio::spawn(task.in_current_span());
                }
                Ok(None) => break None,
                Err(status) => break Some(transport_error(status)),
            },
            _ = fence.changed() => continue,
        }
    };
    // Answer the requests still running before the final status, so no answer is lost.
    let _ = permits.acquire_many(MAX_IN_FLIGHT as u32).await;
    match end {
        Some(status) => {
            info!(code = ?status.code(), "data stream ended: {}", status.message());
            let _ = tx.send(Err(status)).await;
        }
        None => info!("data stream closed by the client"),
    }
}

/// Reads the hello and accepts its generation; returns the version spoken and the generation
/// with the close count it saw.
async fn hello(
    shared: &Shared,
    inbound: &mut Streaming<pb::DataRequest>,
) -> Result<(u32, u64, u64), Status> {
    let first = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
        Err(_) => return Err(Status::deadline_exceeded("no hello within 30 s")),
        Ok(Err(status)) => return Err(transport_error(status)),
        Ok(Ok(None)) => return Err(Status::invalid_argument("stream ended before the hello")),
        Ok(Ok(Some(req))) => req,
    };
    let Some(Op::Hello(hello)) = first.op else {
        return Err(Status::invalid_argument(
            "the first message of a data stream must be a hello",
        ));
    };
    let v = hello.protocol_version;
    let claim = match hello.volume_uuid.as_str() {
        "" => None,
        u if zebu_proto::frames::valid_volume_uuid(u) => Some(zebu_proto::frames::VolumeClaim {
            uuid: u.to_string(),
            adopt: hello.adopt_volume,
        }),
        u => {
            return Err(Status::invalid_argument(format!(
                "bad hello: volume uuid {u:?} is not 1-64 letters, digits and dashes"
            )));
        }
    };
    accept(
        shared,
        v,
        pb::MIN_PROTOCOL_VERSION..=pb::PROTOCOL_VERSION,
        hello.generation,
        claim,
    )
    .await
    .map(|(g, c)| (v, g, c))
}

/// Accepts a data stream's hello, whatever its transport: checks the protocol version
/// against the versions the transport speaks, checks the volume the hello names against the
/// replica's (before anything else, so a stranger fences nothing; `Replica::claim_volume`),
/// refuses a generation lower than the accepted one or implausibly far above it, persists
/// and announces a higher one (which fences older streams of every transport).
/// Returns the generation with the close count it saw, for [`fenced`].
pub(super) async fn accept(
    shared: &Shared,
    version: u32,
    speaks: std::ops::RangeInclusive<u32>,
    g: u64,
    claim: Option<zebu_proto::frames::VolumeClaim>,
) -> Result<(u64, u64), Status> {
    if !speaks.contains(&version) {
        return Err(Status::failed_precondition(format!(
            "protocol version {version} is not supported; this replica speaks versions {} to {}",
            speaks.start(),
            speaks.end()
        )));
    }
    {
        let current = shared.current().await?;
        current
            .replica
            .claim_volume(claim.as_ref())
            .await
            .map_err(super::to_status)?;
    }
    {
        // Another stream of the accepted generation (engines may open several): nothing to
        // persist or fence, so don't hold back the I/O in flight with the write guard.
        let state = shared.state.read().await;
        if state.replica.is_some() && g == state.generation {
            return Ok((g, state.closes));
        }
    }
    let mut state = shared.state.write().await;
    let Some(replica) = state.replica.clone() else {
        return Err(Status::unavailable("the replica is closed"));
    };
    if g < state.generation {
        return Err(stale(g, state.generation));
    }
    if let Err(e) = Generation(state.generation).accepts(Generation(g)) {
        return Err(Status::invalid_argument(e.to_string()));
    }
    if let Err(e) = replica.accept_generation(g).await {
        return Err(match e {
            crate::ReplicaError::StaleGeneration { offered, accepted } => stale(offered, accepted),
            e => super::to_status(e),
        });
    }
    if g > state.generation {
        info!(
            old = state.generation,
            new = g,
            "generation raised: older data streams end"
        );
        state.generation = g;
        shared.fence.send_modify(|f| f.generation = g);
    }
    Ok((g, state.closes))
}

fn stale(offered: u64, accepted: u64) -> Status {
    Status::failed_precondition(format!(
        "generation {offered} is lower than the accepted generation {accepted}"
    ))
}

/// Why a stream with `generation` that started after `closes` closes may not go on.
pub(super) fn fenced(now: Fence, generation: u64, closes: u64) -> Option<Status> {
    if now.closes != closes {
        Some(Status::unavailable("the replica was closed"))
    } else if now.generation > generation {
        Some(Status::failed_precondition(format!(
            "fenced: generation {generation} was superseded by generation {}",
            now.generation
        )))
    } else {
        None
    }
}

/// Gives a transport error on the inbound stream a message that says what to do.
fn transport_error(status: Status) -> Status {
    if status.code() == Code::OutOfRange || status.code() == Code::ResourceExhausted {
        Status::resource_exhausted(format!(
            "message larger than the limit of {MAX_MESSAGE_BYTES} bytes (split the I/O): {}",
            status.message()
        ))
    } else {
        status
    }
}

/// The byte budget is counted in 4 KiB units.
const BUDGET_UNIT: u64 = 4096;
pub(super) const BUDGET_UNITS: u64 = MAX_BYTES_IN_FLIGHT / BUDGET_UNIT;

/// The share of the byte budget a request holds until it is answered: its payload (read
/// data is allocated when it runs), capped so that one oversized request cannot wait
/// forever (it is refused without allocating anyway).
fn budget_units(req: &pb::DataRequest) -> u32 {
    match &req.op {
        Some(Op::Read(r)) => units_for(r.length, 0),
        Some(Op::Write(w)) => units_for(0, w.data.len() as u64),
        _ => units_for(0, 0),
    }
}

/// [`budget_units`] of a request of either transport.
pub(super) fn request_units(req: &Request) -> u32 {
    match &req.op {
        RequestOp::Read { length, .. } => units_for(*length, 0),
        RequestOp::Write { data, .. } => units_for(0, data.len() as u64),
        _ => units_for(0, 0),
    }
}

/// `bytes` in budget units, for sizing a semaphore.
pub(super) fn units_of_bytes(bytes: u64) -> usize {
    bytes.div_ceil(BUDGET_UNIT) as usize
}

/// [`budget_units`] of a read of `read` bytes or a write of `written` bytes (whatever the
/// transport).
pub(super) fn units_for(read: u64, written: u64) -> u32 {
    let read = if read <= MAX_IO_BYTES { read } else { 0 };
    (read + written)
        .div_ceil(BUDGET_UNIT)
        .clamp(1, BUDGET_UNITS) as u32
}

fn too_large(what: &str, len: u64) -> String {
    format!("{what} of {len} bytes is larger than the limit of {MAX_IO_BYTES} bytes per request")
}

async fn execute(
    shared: Arc<Shared>,
    version: u32,
    generation: u64,
    closes: u64,
    req: pb::DataRequest,
    tx: Tx,
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
) {
    let id = req.id;
    let resp = match Request::try_from(req) {
        Ok(req) => run_op(&shared, generation, closes, req, Instant::now()).await,
        Err(e) => Response::failed(RequestId(id), DataStatus::Invalid, e.to_string()),
    };
    if resp.status != DataStatus::Ok {
        debug!(id, status = ?resp.status, "request failed: {}", resp.message);
    }
    let resp = resp.for_version(version).unwrap_or(resp);
    // The client may be gone; its requests' answers have nowhere to go.
    let _ = tx.send(Ok(pb::DataResponse::from(resp))).await;
}

/// Executes one request under a read guard, re-checking the fence first, and answers it.
/// Shared by both transports, so they fence, refuse and answer identically. `received`: when
/// the transport decoded it (the start of its `queued` step, `pathtime.rs`).
pub(super) async fn run_op(
    shared: &Shared,
    generation: u64,
    closes: u64,
    req: Request,
    received: Instant,
) -> Response {
    let id = req.id;
    let state = shared.state.read().await;
    let fence = Fence {
        generation: state.generation,
        closes: state.closes,
    };
    if let Some(why) = fenced(fence, generation, closes) {
        return Response::failed(id, DataStatus::Unavailable, why.message());
    }
    let Some(replica) = state.replica.as_ref() else {
        return Response::failed(id, DataStatus::Unavailable, "the replica is closed");
    };
    let result = match req.op {
        RequestOp::Read { offset, length } => {
            if length > MAX_IO_BYTES {
                return Response::failed(id, DataStatus::Invalid, too_large("read", length));
            }
            debug!(id = id.0, offset, length, "read");
            replica.read_verified(offset, length).await.map(|got| {
                if got.corrupt.is_empty() {
                    Response {
                        data: got.data,
                        ..Response::ok(id)
                    }
                } else {
                    Response {
                        message: format!(
                            "{} block(s) of {offset}+{length} fail their checksum",
                            got.corrupt.len()
                        ),
                        data: got.data,
                        corrupt: got.corrupt,
                        ..Response::failed(id, DataStatus::Corrupt, "")
                    }
                }
            })
        }
        RequestOp::Write {
            offset,
            data,
            sums,
            flush,
        } => {
            let len = data.len() as u64;
            if len > MAX_IO_BYTES {
                return Response::failed(id, DataStatus::Invalid, too_large("write", len));
            }
            debug!(
                id = id.0,
                offset,
                length = len,
                sums = sums.is_some(),
                flush,
                "write"
            );
            let times = shared.io.times();
            let started = Instant::now();
            times.add(Step::WriteQueued, started - received);
            let done = replica.write_with_sums(offset, data, sums).await;
            times.since(Step::WriteStore, started);
            match (done, flush) {
                (Ok(()), None) => Ok(Response::ok(id)),
                // Version 4: the flush, once the write is done, as a flush request does it
                // (it covers every write completed before it, this one with them).
                (Ok(()), Some(flush_number)) => {
                    let started = Instant::now();
                    let done = replica.flush(flush_number).await;
                    times.since(Step::FlushStore, started);
                    done.map(|n| Response {
                        flush_number: n,
                        ..Response::ok(id)
                    })
                }
                (Err(e), _) => Err(e),
            }
        }
        RequestOp::Unmap {
            offset,
            length,
            zero_fill,
        } => {
            debug!(id = id.0, offset, length, "unmap");
            let done = if zero_fill {
                replica.zero_fill(offset, length).await
            } else {
                replica.unmap(offset, length).await
            };
            done.map(|()| Response::ok(id))
        }
        RequestOp::Flush { flush_number } => {
            debug!(id = id.0, flush_number, "flush");
            let times = shared.io.times();
            let started = Instant::now();
            times.add(Step::FlushQueued, started - received);
            let done = replica.flush(flush_number).await;
            times.since(Step::FlushStore, started);
            done.map(|n| Response {
                flush_number: n,
                ..Response::ok(id)
            })
        }
        // Answered OK only by a replica that still has its files (`health.rs` in the store).
        RequestOp::Ping => replica.check_files().map(|()| Response::ok(id)),
    };
    result.unwrap_or_else(|e| {
        let status = data_status_of(&e);
        if status == DataStatus::IoError {
            warn!(id = id.0, "request failed with an I/O error: {e}");
        }
        let corrupt = match &e {
            // A write refused because its edge blocks fail their checksum: which ones.
            ReplicaError::ChecksumMismatch { offset, blocks, .. } => {
                let first = offset / crate::BLOCK_SIZE;
                blocks
                    .iter()
                    .map(|b| (b / crate::BLOCK_SIZE - first) as u32)
                    .collect()
            }
            _ => Vec::new(),
        };
        Response {
            corrupt,
            ..Response::failed(id, status, e.to_string())
        }
    })
}
