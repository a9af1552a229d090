//! The transmission phase of one connection: one task that reads requests, runs them and
//! writes their replies.
//!
//! ```text
//!   socket ──► input buffer ──parse──► running requests ──► device
//!     ▲                                (FuturesUnordered)
//!     └──── writev ◄── reply queue ◄──────────┘  as each one completes
//! ```
//!
//! Why one task and no channel: a 4 KiB request costs the device a few µs, and the earlier
//! design (a reader task, a task spawned per request, an mpsc channel to a writer task) paid
//! a task allocation plus two cross-thread wake-ups per request on top of that; profiles of
//! 4 KiB random I/O showed the scheduler and futex wake/wait, not the device, as the largest
//! cost. Here the connection's task polls the socket and every running request itself:
//! requests are futures in a [`FuturesUnordered`], replies are appended to a queue that is
//! written with one `writev` per wake-up (header and read data without copying the data),
//! and a completion wakes only this task.
//!
//! Requests still run concurrently and reply in whatever order they finish; the client
//! matches replies by cookie. Overlapping writes are ordered by the device (the replicator's
//! range lock), not here.
//!
//! Input: requests are read into one [`BytesMut`]; a WRITE's payload is split off it as a
//! [`Bytes`] without copying, so many small writes share one allocation.
//!
//! Budget: every request costs the bytes it makes the engine hold (the write data, the read
//! data of its reply, the zeros a `NO_HOLE` WRITE_ZEROES has in flight at once) plus one
//! unit, in [`BUDGET_UNIT`]s. The cost is taken when the request header is parsed, before
//! its payload is read, from two budgets:
//!
//! - the export's shared budget (all connections of one volume,
//!   [`super::NbdConfig::max_volume_inflight_bytes`]) while the request runs, that is while
//!   the device holds its data; it is given back as soon as the request completes;
//! - the connection's own budget ([`super::NbdConfig::max_inflight_bytes`]) until its reply
//!   is on the socket (or dropped).
//!
//! So read data waiting for a client that does not read its replies counts against that
//! connection only: it stops that connection's reading, and nobody else's. Two or three
//! clients that pipeline 1 MiB reads and never read an answer hold their own budgets and
//! leave the export's budget to the clients that read. A connection whose client takes not
//! one byte of its queued replies for [`super::NbdConfig::reply_timeout`] is dropped (with a
//! log line), so what it holds comes back; a reader that is merely slow keeps its connection
//! (the kernel's count of unacknowledged bytes tells them apart, see `sockio::StallWatch`). A request
//! larger than a budget takes the whole budget. While the budget is short the connection
//! stops reading from the socket, so the input buffer is bounded as well.
//!
//! What the engine holds for the NBD server is therefore bounded by the export's budget (data
//! the device is working on) plus, per connection, its own budget (replies waiting for the
//! client), times at most [`super::NbdConfig::max_connections`] connections.
//!
//! The connection ends on NBD_CMD_DISC, EOF, a framing error (bad magic, a WRITE payload
//! over the limit: the byte stream can no longer be trusted), a write error on the socket,
//! replies left unread past the reply timeout, or server shutdown. In every case reading
//! stops, requests already started finish and their replies are sent if the socket still
//! works, and then the socket closes; after a shutdown a client that reads nothing at all is
//! given a short grace (5 s) instead of the whole reply timeout, so it cannot hold the
//! engine's shutdown up. Errors on one connection never touch another.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};

use super::NbdError;
use super::wire::*;
use crate::blockdev::{BlockDevice, BlockError};
use crate::sockio::{SHUTDOWN_GRACE, StallWatch};

/// Budget granularity: one unit per KiB in flight, plus one per request.
pub const BUDGET_UNIT: u64 = 1024;

/// The input buffer asks the socket for at least this much at a time, so a burst of small
/// requests is parsed from one read.
const READ_CHUNK: usize = 64 * 1024;

/// Below this much room the buffer is grown (or renewed) before reading.
const MIN_READ: usize = 1024;

/// Read data up to this size is copied into the reply queue's contiguous buffer; larger
/// data goes to `writev` as its own slice. Copying 4 KiB is cheaper than an extra iovec
/// and a reference count.
const COPY_MAX: usize = 4096;

/// Slices per `writev`.
const MAX_IOVECS: usize = 64;

/// Zeros for `NBD_CMD_WRITE_ZEROES` with `NO_HOLE`: the range is written in chunks of this
/// size, all sharing one static buffer.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

pub struct Limits {
    pub max_payload: u32,
    /// This connection's budget, in bytes.
    pub max_inflight_bytes: u64,
    /// The export's budget shared by all its connections, in [`BUDGET_UNIT`]s; its size in
    /// units is `shared_units`.
    pub shared: Arc<Semaphore>,
    pub shared_units: u32,
    /// Queued replies that make no progress for this long end the connection.
    pub reply_timeout: Duration,
}

/// A finished request, ready to be answered.
struct Done {
    cookie: u64,
    error: u32,
    data: Option<Bytes>,
    units: u32,
}

/// Serves requests on `stream` until the connection ends. Returns `Ok` on an orderly end
/// (DISC, EOF between requests, shutdown) and the reason otherwise.
pub async fn serve_connection(
    stream: TcpStream,
    dev: Arc<dyn BlockDevice>,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let conn_units = u32::try_from((limits.max_inflight_bytes / BUDGET_UNIT).max(1))
        .unwrap_or(u32::MAX)
        .min(limits.shared_units.max(1));
    let mut c = Conn {
        size: dev.size(),
        dev: &*dev,
        stream,
        input: BytesMut::with_capacity(READ_CHUNK),
        running: FuturesUnordered::new(),
        out: ReplyQueue::default(),
        max_payload: limits.max_payload,
        conn_units,
        used_units: 0,
        shared: Budget {
            sem: limits.shared.clone(),
            held: 0,
        },
        front_units: None,
        reading: true,
        socket_ok: true,
        stall: StallWatch::new(limits.reply_timeout),
    };
    let result = c.run(shutdown).await;
    c.finish().await;
    result
}

/// Units of the export's shared budget this connection holds; given back when dropped, so
/// no path out of the connection (error, panic in a device future) can leak them.
struct Budget {
    sem: Arc<Semaphore>,
    held: u32,
}

impl Budget {
    fn try_take(&mut self, units: u32) -> bool {
        match self.sem.try_acquire_many(units) {
            Ok(p) => {
                p.forget();
                self.held += units;
                true
            }
            Err(_) => false,
        }
    }

    fn give_back(&mut self, units: u32) {
        self.held -= units;
        self.sem.add_permits(units as usize);
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        if self.held > 0 {
            self.sem.add_permits(self.held as usize);
        }
    }
}

struct Conn<'d> {
    dev: &'d dyn BlockDevice,
    size: u64,
    stream: TcpStream,
    /// Bytes read from the socket and not yet consumed by a request.
    input: BytesMut,
    running: FuturesUnordered<BoxFuture<'d, Done>>,
    out: ReplyQueue,
    max_payload: u32,
    /// This connection's budget and what it uses (running requests and unwritten replies).
    conn_units: u32,
    used_units: u32,
    shared: Budget,
    /// Units already taken for the request whose header is at the front of `input` (its
    /// payload may still be arriving).
    front_units: Option<u32>,
    /// False once no further request will be read (DISC, EOF, error, shutdown).
    reading: bool,
    /// False once a write to the socket failed: replies are dropped from then on.
    socket_ok: bool,
    /// Whether queued replies wait for a client that reads nothing.
    stall: StallWatch,
}

/// What parsing the input buffer found.
enum Parsed {
    /// Every complete request was started; more bytes are needed.
    NeedInput,
    /// The connection's own budget is short: wait for its requests to complete and their
    /// replies to be written.
    NeedOwnBudget,
    /// The export's budget is short: wait for this many units of it.
    NeedShared(u32),
    /// The client asked to disconnect.
    Disconnect,
}

impl<'d> Conn<'d> {
    async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), NbdError> {
        let mut result = Ok(());
        let mut waiting_shared: Option<u32> = None;
        let sem = self.shared.sem.clone();
        // Armed only while replies wait for the socket; reset, not recreated, as they move.
        let stall = tokio::time::sleep(self.stall.timeout());
        tokio::pin!(stall);
        loop {
            let mut stalled = false;
            if self.reading && waiting_shared.is_none() {
                match self.parse() {
                    Ok(Parsed::NeedInput) => {}
                    Ok(Parsed::NeedOwnBudget) => stalled = true,
                    Ok(Parsed::NeedShared(units)) => {
                        // Other connections' requests give it back as they complete (ours
                        // too, and their completions wake us anyway).
                        waiting_shared = Some(units);
                    }
                    Ok(Parsed::Disconnect) => {
                        tracing::debug!("client sent DISC");
                        self.reading = false;
                    }
                    Err(e) => {
                        self.reading = false;
                        result = Err(e);
                    }
                }
            }
            let used_before = self.used_units;
            self.write_replies();
            if stalled && waiting_shared.is_none() && self.used_units < used_before {
                // Writing gave budget back that parse() was waiting for; nothing else would
                // wake us for it.
                continue;
            }
            if !self.reading && self.running.is_empty() && (self.out.is_empty() || !self.socket_ok)
            {
                return result;
            }
            let want_read = self.reading && waiting_shared.is_none() && self.wants_input();
            let want_write = self.socket_ok && !self.out.is_empty();
            let interest = crate::sockio::interest(want_read, want_write);
            let shared_want = waiting_shared.unwrap_or(0);
            if want_write {
                let deadline = self.stall.deadline(&self.stream);
                if stall.deadline() != deadline {
                    stall.as_mut().reset(deadline);
                }
            }
            tokio::select! {
                Some(done) = self.running.next(), if !self.running.is_empty() => {
                    self.queue_reply(done);
                    // Take every other request that finished meanwhile, so one writev
                    // carries all their replies.
                    while let Some(Some(done)) = self.running.next().now_or_never() {
                        self.queue_reply(done);
                    }
                }
                // Not polled when disabled, but the expression is still evaluated.
                ready = self.stream.ready(interest.unwrap_or(Interest::READABLE)),
                    if interest.is_some() =>
                {
                    match ready {
                        Ok(r) if r.is_readable() && want_read => {
                            if let Err(e) = self.read_input() {
                                self.reading = false;
                                result = Err(e);
                            }
                        }
                        // Writable: the next write_replies() goes on.
                        Ok(_) => {}
                        Err(e) => {
                            self.reading = false;
                            self.socket_ok = false;
                            result = Err(e.into());
                        }
                    }
                }
                acquired = async {
                    sem.acquire_many(shared_want).await.map(|p| p.forget())
                }, if waiting_shared.is_some() => {
                    acquired.expect("invariant: the budget semaphore is never closed");
                    // Held for the request at the front; parse() finds it in front_units.
                    self.shared.held += shared_want;
                    self.used_units += shared_want;
                    self.front_units = Some(shared_want);
                    waiting_shared = None;
                }
                _ = shutdown.wait_for(|stop| *stop), if self.reading => {
                    tracing::debug!("server shutting down: closing connection");
                    self.reading = false;
                    waiting_shared = None;
                    self.stall.shorten(SHUTDOWN_GRACE);
                }
                () = &mut stall, if want_write => {
                    if self.stall.expired(&self.stream) {
                        tracing::warn!(
                            unread_bytes = self.out.len(),
                            timeout = ?self.stall.timeout(),
                            "client left its replies unread past the reply timeout: \
                             dropping the connection"
                        );
                        self.drop_replies();
                        waiting_shared = None;
                        result = Err(NbdError::ReplyTimeout(self.stall.timeout()));
                    }
                }
            }
            if !self.socket_ok && result.is_ok() {
                result = Err(NbdError::Protocol("cannot write replies".to_owned()));
            }
        }
    }

    /// Finishes the requests still running (their device I/O must not be left behind) and
    /// closes the socket.
    async fn finish(&mut self) {
        while let Some(done) = self.running.next().await {
            self.queue_reply(done);
        }
        if self.socket_ok {
            while !self.out.is_empty() && self.socket_ok {
                self.write_replies();
                if !self.out.is_empty()
                    && self.socket_ok
                    && self.stream.ready(Interest::WRITABLE).await.is_err()
                {
                    self.socket_ok = false;
                }
            }
            let _ = self.stream.shutdown().await;
        }
    }

    /// Whether reading more bytes could let a request start.
    fn wants_input(&self) -> bool {
        match self.front_needs() {
            // A whole header and no budget taken for it: parse() is waiting for budget, so
            // its payload may not be read yet.
            Some(_) if self.front_units.is_none() => false,
            // Paid for: its payload must come in even if that took the last of the budget
            // (stopping here would wait for a completion that nothing is running to give).
            Some(n) => self.input.len() < n,
            None => self.used_units < self.conn_units && self.input.len() < READ_CHUNK,
        }
    }

    /// Bytes the request at the front of `input` needs in the buffer (header and payload),
    /// once its header is in.
    fn front_needs(&self) -> Option<usize> {
        if self.input.len() < RequestHeader::LEN {
            return None;
        }
        let command = u16::from_be_bytes([self.input[6], self.input[7]]);
        let length = u32::from_be_bytes([
            self.input[24],
            self.input[25],
            self.input[26],
            self.input[27],
        ]);
        let payload = if command == CMD_WRITE && length <= self.max_payload {
            length as usize
        } else {
            0
        };
        Some(RequestHeader::LEN + payload)
    }

    fn read_input(&mut self) -> Result<(), NbdError> {
        // Read into the room left in the buffer as long as the front request fits, so small
        // writes fill one allocation before the next is made. Otherwise make room for the
        // whole front request, or a chunk of small ones. Reserving allocates afresh only
        // when the buffer is still shared with the payloads of running writes; otherwise it
        // reuses it.
        let need = self.front_needs().unwrap_or(RequestHeader::LEN);
        let spare = self.input.capacity() - self.input.len();
        if self.input.capacity() < need || spare < MIN_READ {
            self.input
                .reserve(need.saturating_sub(self.input.len()).max(READ_CHUNK));
        }
        match self.stream.try_read_buf(&mut self.input) {
            Ok(0) => {
                if !self.input.is_empty() {
                    tracing::debug!(
                        buffered = self.input.len(),
                        "client closed in the middle of a request"
                    );
                }
                // A client that closes between requests without DISC is rude but harmless.
                self.reading = false;
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Starts every complete request in the input buffer that the budget allows.
    fn parse(&mut self) -> Result<Parsed, NbdError> {
        loop {
            if self.input.len() < RequestHeader::LEN {
                return Ok(Parsed::NeedInput);
            }
            let hb: &[u8; RequestHeader::LEN] = self.input[..RequestHeader::LEN]
                .try_into()
                .expect("invariant: slice has the header's length");
            let h = RequestHeader::parse(hb);
            if h.magic != REQUEST_MAGIC {
                // Framing is lost: the protocol says to terminate the session.
                return Err(NbdError::Protocol(format!(
                    "bad request magic {:#x}",
                    h.magic
                )));
            }
            if h.command == CMD_DISC {
                self.input.advance(RequestHeader::LEN);
                return Ok(Parsed::Disconnect);
            }
            let payload_len = match h.command {
                CMD_WRITE | CMD_READ => u64::from(h.length),
                // Written in chunks, one at a time, all from the same static zeros; what the
                // device holds at once is one chunk.
                CMD_WRITE_ZEROES if h.flags & CMD_FLAG_NO_HOLE != 0 => {
                    u64::from(h.length).min(ZEROS.len() as u64)
                }
                _ => 0,
            };
            let too_big = payload_len > u64::from(self.max_payload);
            if too_big && h.command == CMD_WRITE {
                // Skipping up to 4 GiB of payload is not worth it; a client that ignores
                // the advertised limit gets a hard disconnect, as the protocol allows.
                return Err(NbdError::Protocol(format!(
                    "WRITE of {} bytes exceeds the maximum payload {}",
                    h.length, self.max_payload
                )));
            }
            let units = match self.front_units {
                Some(u) => u,
                None => {
                    let cost = if too_big { 0 } else { payload_len };
                    let units = u32::try_from(cost / BUDGET_UNIT + 1)
                        .unwrap_or(u32::MAX)
                        .min(self.conn_units);
                    // Over this connection's budget: wait for its own replies to go out. A
                    // request alone may take all of it, or a large one could never start.
                    if self.used_units > 0 && self.used_units + units > self.conn_units {
                        return Ok(Parsed::NeedOwnBudget);
                    }
                    if !self.shared.try_take(units) {
                        return Ok(Parsed::NeedShared(units));
                    }
                    self.used_units += units;
                    self.front_units = Some(units);
                    units
                }
            };
            let need = RequestHeader::LEN
                + if h.command == CMD_WRITE {
                    h.length as usize
                } else {
                    0
                };
            if self.input.len() < need {
                return Ok(Parsed::NeedInput);
            }
            self.front_units = None;
            self.input.advance(RequestHeader::LEN);
            tracing::trace!(request = %h, "nbd request");
            if too_big {
                tracing::debug!(request = %h, "READ over the maximum payload");
                self.fail(h.cookie, NbdErrno::Inval, units);
                continue;
            }
            let in_range = h.length > 0
                && h.offset
                    .checked_add(u64::from(h.length))
                    .is_some_and(|end| end <= self.size);
            let fua = h.flags & CMD_FLAG_FUA != 0;
            let op = match h.command {
                CMD_READ if in_range => Op::Read {
                    offset: h.offset,
                    len: u64::from(h.length),
                },
                CMD_WRITE => {
                    // The payload follows the header whatever we think of the request.
                    let data = self.input.split_to(h.length as usize).freeze();
                    if in_range {
                        Op::Write {
                            offset: h.offset,
                            data,
                            fua,
                        }
                    } else {
                        Op::Fail(range_errno(h.command, h.length))
                    }
                }
                CMD_FLUSH => Op::Flush,
                CMD_TRIM if in_range => Op::Trim {
                    offset: h.offset,
                    len: u64::from(h.length),
                    fua,
                },
                CMD_WRITE_ZEROES if in_range => Op::Zero {
                    offset: h.offset,
                    len: u64::from(h.length),
                    no_hole: h.flags & CMD_FLAG_NO_HOLE != 0,
                    fua,
                },
                CMD_READ | CMD_TRIM | CMD_WRITE_ZEROES => {
                    Op::Fail(range_errno(h.command, h.length))
                }
                _ => {
                    // The command may have carried a payload we cannot know about; the
                    // protocol asks for EINVAL and we keep going, trusting the framing.
                    tracing::debug!(request = %h, "unknown command");
                    Op::Fail(NbdErrno::Inval)
                }
            };
            if let Op::Fail(errno) = op {
                tracing::debug!(request = %h, ?errno, "request refused");
                self.fail(h.cookie, errno, units);
                continue;
            }
            let dev = self.dev;
            let cookie = h.cookie;
            // The frontend's part of a write or flush (`pathtime.rs`): from here to the
            // reply being queued, less the device call.
            let parsed = std::time::Instant::now();
            let timed = match op {
                Op::Write { .. } => dev.path_counters().map(|c| &c.writes),
                Op::Flush => dev.path_counters().map(|c| &c.flushes),
                _ => None,
            };
            self.running.push(Box::pin(async move {
                let mut device = std::time::Duration::ZERO;
                let (error, data) = match op.execute(dev, &mut device).await {
                    Ok(data) => (0, data),
                    Err((errno, e)) => {
                        tracing::warn!(cookie, error = %e, "nbd request failed");
                        (errno as u32, None)
                    }
                };
                if let Some(spans) = timed {
                    spans.frontend(parsed.elapsed().saturating_sub(device));
                }
                Done {
                    cookie,
                    error,
                    data,
                    units,
                }
            }));
        }
    }

    fn fail(&mut self, cookie: u64, errno: NbdErrno, units: u32) {
        self.queue_reply(Done {
            cookie,
            error: errno as u32,
            data: None,
            units,
        });
    }

    fn queue_reply(&mut self, d: Done) {
        // The device is done with it: what is left waits for this client only, so it counts
        // against this connection alone from here on.
        self.shared.give_back(d.units);
        if !self.socket_ok {
            // Nobody to answer: give the connection's budget back too.
            self.release(d.units);
            return;
        }
        self.out
            .push(&simple_reply(d.cookie, d.error), d.data, d.units);
    }

    /// Gives back the connection's budget of replies that are written or dropped.
    fn release(&mut self, units: u32) {
        self.used_units -= units;
    }

    /// Stops answering: drops every queued reply and stops reading.
    fn drop_replies(&mut self) {
        self.socket_ok = false;
        self.reading = false;
        let units = self.out.clear();
        self.release(units);
    }

    /// Writes queued replies until the queue is empty or the socket is full.
    fn write_replies(&mut self) {
        while self.socket_ok && !self.out.is_empty() {
            let written = {
                let slices = self.out.slices();
                self.stream.try_write_vectored(&slices)
            };
            match written {
                Ok(n) => {
                    if n > 0 {
                        self.stall.progressed();
                    }
                    let units = self.out.advance(n);
                    self.release(units);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::debug!(error = %e, "writing replies failed");
                    self.drop_replies();
                }
            }
        }
    }
}

/// Replies waiting for the socket, in order. Headers and small data are appended to one
/// contiguous buffer; larger read data is kept as its own [`Bytes`] and written from there.
#[derive(Default)]
struct ReplyQueue {
    chunks: VecDeque<Bytes>,
    /// Small pieces not yet sealed into `chunks`.
    tail: BytesMut,
    /// Stream positions: bytes ever queued and ever written.
    queued: u64,
    written: u64,
    /// (stream position at the end of a reply, its budget units), in order.
    ends: VecDeque<(u64, u32)>,
}

impl ReplyQueue {
    fn is_empty(&self) -> bool {
        self.queued == self.written
    }

    /// Bytes queued and not yet written.
    fn len(&self) -> u64 {
        self.queued - self.written
    }

    fn push(&mut self, header: &[u8], data: Option<Bytes>, units: u32) {
        if self.tail.capacity() - self.tail.len() < header.len() + COPY_MAX {
            self.tail.reserve(16 * 1024);
        }
        self.tail.extend_from_slice(header);
        self.queued += header.len() as u64;
        if let Some(d) = data {
            self.queued += d.len() as u64;
            if d.len() <= COPY_MAX {
                self.tail.extend_from_slice(&d);
            } else {
                self.seal();
                self.chunks.push_back(d);
            }
        }
        self.ends.push_back((self.queued, units));
    }

    fn seal(&mut self) {
        if !self.tail.is_empty() {
            self.chunks.push_back(self.tail.split().freeze());
        }
    }

    fn slices(&mut self) -> Vec<IoSlice<'_>> {
        self.seal();
        self.chunks
            .iter()
            .take(MAX_IOVECS)
            .map(|c| IoSlice::new(c))
            .collect()
    }

    /// Consumes `n` written bytes; returns the units of the replies now fully written.
    fn advance(&mut self, n: usize) -> u32 {
        self.written += n as u64;
        let missing = crate::sockio::consume(&mut self.chunks, n);
        debug_assert_eq!(missing, 0, "written bytes were queued");
        let mut units = 0;
        while let Some(&(end, u)) = self.ends.front() {
            if end > self.written {
                break;
            }
            self.ends.pop_front();
            units += u;
        }
        units
    }

    /// Drops everything queued; returns the units of every reply dropped.
    fn clear(&mut self) -> u32 {
        self.chunks.clear();
        self.tail.clear();
        self.written = self.queued;
        self.ends.drain(..).map(|(_, u)| u).sum()
    }
}

/// The protocol's choice for a range past the end: writes report no space, reads and
/// trims an invalid argument. A zero-length request is invalid whatever the command.
fn range_errno(command: u16, length: u32) -> NbdErrno {
    match command {
        CMD_WRITE | CMD_WRITE_ZEROES if length > 0 => NbdErrno::NoSpc,
        _ => NbdErrno::Inval,
    }
}

enum Op {
    Read {
        offset: u64,
        len: u64,
    },
    Write {
        offset: u64,
        data: Bytes,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Zero {
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
    },
    Fail(NbdErrno),
}

impl Op {
    /// Runs the request; `device` gets the time spent in the device's write and flush calls.
    async fn execute(
        self,
        dev: &dyn BlockDevice,
        device: &mut std::time::Duration,
    ) -> Result<Option<Bytes>, (NbdErrno, BlockError)> {
        let fua = match self {
            Op::Read { offset, len } => {
                let data = dev.read(offset, len).await.map_err(errno)?;
                if data.len() as u64 != len {
                    // A short read would desynchronise the stream; report it instead.
                    return Err((
                        NbdErrno::Io,
                        BlockError::Io(format!(
                            "device returned {} bytes for a read of {len}",
                            data.len()
                        )),
                    ));
                }
                return Ok(Some(data));
            }
            Op::Write { offset, data, fua } => {
                // FUA: the device does the write and its flush together.
                let t = std::time::Instant::now();
                let res = if fua {
                    dev.write_fua(offset, data).await
                } else {
                    dev.write(offset, data).await
                };
                *device += t.elapsed();
                res.map_err(errno)?;
                false
            }
            Op::Flush => true,
            Op::Trim { offset, len, fua } => {
                dev.unmap(offset, len).await.map_err(errno)?;
                fua
            }
            Op::Zero {
                offset,
                len,
                no_hole,
                fua,
            } => {
                if no_hole {
                    // The client wants the blocks allocated: write real zeros.
                    let mut done = 0u64;
                    while done < len {
                        let n = (len - done).min(ZEROS.len() as u64);
                        let chunk = Bytes::from_static(&ZEROS[..n as usize]);
                        dev.write(offset + done, chunk).await.map_err(errno)?;
                        done += n;
                    }
                } else {
                    // The device reads unmapped ranges as zeros, so a hole is a valid zero.
                    dev.unmap(offset, len).await.map_err(errno)?;
                }
                fua
            }
            Op::Fail(e) => {
                return Err((e, BlockError::Io("refused".to_owned())));
            }
        };
        if fua {
            let t = std::time::Instant::now();
            let res = dev.flush().await;
            *device += t.elapsed();
            res.map_err(errno)?;
        }
        Ok(None)
    }
}

fn errno(e: BlockError) -> (NbdErrno, BlockError) {
    let n = match &e {
        BlockError::OutOfRange { .. } => NbdErrno::Inval,
        BlockError::NoSpace(_) => NbdErrno::NoSpc,
        // A faulted volume fails I/O like a dead disk; EIO is what filesystems expect.
        BlockError::Io(_) | BlockError::Unavailable(_) | BlockError::Medium { .. } => NbdErrno::Io,
    };
    (n, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_queue_releases_units_only_when_a_reply_is_fully_written() {
        let mut q = ReplyQueue::default();
        q.push(&[1; 16], Some(Bytes::from(vec![2u8; 8192])), 9);
        q.push(&[3; 16], None, 1);
        q.push(&[4; 16], Some(Bytes::from(vec![5u8; 100])), 2);
        let total = 16 + 8192 + 16 + 16 + 100;
        // Bytes come out in order, however the writes are cut.
        let mut out = Vec::new();
        let mut released = Vec::new();
        for cut in [10usize, 16, 8000, 200, 30, 84] {
            let slices = q.slices();
            let mut taken = 0;
            for s in slices {
                let n = s.len().min(cut - taken);
                out.extend_from_slice(&s[..n]);
                taken += n;
                if taken == cut {
                    break;
                }
            }
            released.push(q.advance(cut));
        }
        assert_eq!(out.len(), total);
        assert!(q.is_empty());
        let mut want = vec![1u8; 16];
        want.extend_from_slice(&[2; 8192]);
        want.extend_from_slice(&[3; 16]);
        want.extend_from_slice(&[4; 16]);
        want.extend_from_slice(&[5; 100]);
        assert_eq!(out, want);
        // Cuts end at 10, 26, 8026, 8226 (reply 1 ends at 8208, reply 2 at 8224), 8256, 8340.
        assert_eq!(released, vec![0, 0, 0, 9 + 1, 0, 2]);
    }
}
