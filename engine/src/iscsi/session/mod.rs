//! One iSCSI connection in the full feature phase (RFC 7143 §11).
//!
//! One task per connection reads PDUs, drives the connection's running SCSI commands and
//! writes every response itself:
//!
//! ```text
//!   socket ──► input buffer ──parse──► handle ──► running commands ──► device
//!     ▲                                 │          (FuturesUnordered)
//!     │                                 │ R2T, NOP-In, TMF, Reject,      │ Data-In,
//!     │                                 ▼ Text, Logout                   ▼ SCSI Response
//!     └────────── writev ◄──────────── out queue (StatSN stamped here) ◄─┘
//! ```
//!
//! Why one task: a 4 KiB command costs the device a few µs, and the earlier design (a reader
//! task that also polled the commands, an unbounded channel to a writer task that stamped
//! StatSN and wrote) paid a channel send and a wake-up of the writer, often on the other
//! core, for every response. The NBD server (`nbd::transmission`) lost the same cost and
//! doubled its IOPS. Here the connection's task waits with one `select!` for whichever
//! comes first: the socket becoming readable (more PDUs), a command completing, or the
//! socket becoming writable while responses are queued. Whatever is ready is handled, and
//! everything queued goes out in one `writev` per wake-up. Measured on the example target
//! over a file (benches/README.md, "iSCSI: one task per connection"; a shared, loaded
//! machine): CPU per request fell from 6.5–6.8 to 5.6–5.9 µs for 4 KiB random reads at QD 32
//! and from 530–730 to 455–550 µs for 1 MiB reads, 4 KiB writes stayed within noise; the
//! session code is now ~3 % of the target's CPU, the rest is system calls (page cache,
//! TCP).
//!
//! Input: PDUs are read into one [`BytesMut`] and cut off it by [`Framing::parse`]; data
//! segments (immediate data, Data-Out, NOP-Out pings) are zero-copy slices of it, so a
//! 4 KiB write with immediate data reaches the device without a copy. A write whose data
//! comes in several Data-Out PDUs is gathered into its own buffer (one copy: the device
//! takes one contiguous [`Bytes`]).
//!
//! Output: [`OutQueue`] keeps responses in wire order; headers and data up to 4 KiB are
//! copied into one contiguous buffer, larger Data-In is written from the device's buffer.
//! StatSN, ExpCmdSN and MaxCmdSN are stamped when a PDU is queued, which is wire order, so
//! StatSN strictly increases on the wire and MaxCmdSN never decreases.
//!
//! Commands run concurrently and answer in any order. They are futures in a
//! [`FuturesUnordered`] polled by this task rather than spawned tasks: a task per command
//! cost an allocation plus a cross-thread wake-up at start and at completion. When the
//! connection ends (Logout, EOF, a framing error, a write error, server shutdown), reading
//! stops, the running commands finish their device I/O, their responses are written if the
//! socket still works, and then the socket closes.
//!
//! CmdSN window: MaxCmdSN = ExpCmdSN + QUEUE_DEPTH - 1 - in_flight, where in_flight counts
//! non-immediate SCSI commands accepted and not yet completed. A new command raises ExpCmdSN
//! and in_flight together, a completion lowers in_flight, so MaxCmdSN never decreases.
//! Commands outside the window are dropped without a response.
//!
//! Immediate commands take no CmdSN and so are outside the window: RFC 7143 (Command
//! Numbering and Acknowledging) asks a target to handle at least one immediate command per
//! connection at a time. This one holds up to [`IMMEDIATE_DEPTH`]
//! immediate SCSI commands (waiting for Data-Out or running); one more is answered TASK SET
//! FULL at once, holding nothing. TASK SET FULL rather than a Reject (reason 0x06, "too many
//! immediate commands"): it is the SCSI layer's own "no resources now, retry later", which
//! every initiator's SCSI midlayer retries, and it is what the write budget answers too;
//! closing the connection would punish the other commands on it. Task management requests
//! waiting for aborted commands to finish are bounded likewise ([`MAX_PENDING_TMFS`]; more are
//! answered "function rejected").
//!
//! Files: this one has the connection loop, the CmdSN window, the budgets and the command
//! intake (SCSI commands, Data-Out and R2T, NOP, Text, Logout); `response.rs` builds the
//! answers to commands (Data-In, SCSI Response, residuals) and `tmf.rs` handles task
//! management.
//!
//! Task management: a command's completion and an abort are both handled by this task, so
//! an abort finds the command either still running (it is marked aborted and will complete
//! silently) or already answered (its response is ahead of the TMF response on the wire).
//! The TMF response waits until every aborted command has finished its device I/O, so
//! nothing it does can land after the initiator reuses the blocks.
//!
//! Budgets (what one initiator can make us hold): every command costs its own state
//! ([`CMD_COST`]) as well as its data, so a flood of commands that carry no data is bounded
//! like a flood of large ones.
//! - Write data: a write whose data arrives in Data-Out PDUs gets a buffer of its full
//!   length before the data is in. Without a bound, QUEUE_DEPTH commands of MAX_DATA_OUT
//!   each would let one initiator make us allocate 1 GiB and never send the data. Each
//!   connection has a [`WRITE_BUDGET`] for such writes, each charged its length plus
//!   CMD_COST; a write that does not fit is answered TASK SET FULL at once, which initiators
//!   retry later, and the budget is given back when the command completes, is aborted, or
//!   its connection ends.
//! - Responses: every started command costs the larger of its expected transfer length and
//!   what its CDB makes the device read or buffer ([`scsi::buffer_bytes`]: a READ with a
//!   small EDTL still reads what its CDB asks), plus CMD_COST, until its response is queued;
//!   queued bytes count until written. While the sum is at or over
//!   [`OUT_BUDGET`], no further PDU is parsed or read, so an initiator that sends READs and
//!   does not read the answers stops being read itself (TCP flow control then stops it) and
//!   the memory it costs is bounded by OUT_BUDGET plus one command. Running commands
//!   always complete on their own, so this wait cannot deadlock. Pending writes waiting for
//!   Data-Out are not charged here (they have WRITE_BUDGET), or waiting could starve their
//!   own data. A connection whose initiator takes not one byte of its queued responses for
//!   [`super::IscsiConfig::response_timeout`] is closed, with a log line, so an initiator
//!   that never reads cannot keep its budgets and its connection slot for good; one that
//!   reads slowly keeps its connection (the kernel's count of unacknowledged bytes tells
//!   them apart).

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::Target;
use super::login::{Params, QUEUE_DEPTH, SessionKind, TARGET_MRDSL};
use super::pdu::{
    BHS_LEN, Bhs, Frame, Framing, MAX_IOVECS, OutQueue, PduError, RESERVED_TAG, op, reject,
};
use super::scsi::{self, MAX_DATA_OUT, Reply};
use super::sense::{Sense, status};
use super::text::{self, TextExchange, TextStep, take_ttt};
use crate::sockio::{SHUTDOWN_GRACE, StallWatch};
use response::execute;
use tmf::PendingTmf;

mod response;
mod tmf;

/// Write data one connection may hold in buffers while it waits for Data-Out (bytes).
/// 64 MiB is 64 commands of 1 MiB, well above what a queue of 1 MiB writes at the depth
/// Linux and QEMU use needs.
pub const WRITE_BUDGET: usize = 64 << 20;

/// Response bytes one connection may have in flight (running commands' transfer lengths
/// plus queued, unwritten output) before it stops reading (see the module docs). 16 MiB
/// covers 32 reads of 512 KiB, what the Linux initiator queues by default.
pub const OUT_BUDGET: u64 = 16 << 20;

/// What a command costs a budget on top of its data: its response header and sense data,
/// and its own state (the command, its entry in the task or pending-write table, its future
/// while it runs: a few hundred bytes, rounded up).
pub const CMD_COST: u64 = 1024;

/// Immediate SCSI commands one connection holds at once (waiting for Data-Out or running);
/// more get TASK SET FULL. Real initiators do not send SCSI commands immediate (Linux marks
/// only task management and NOP-Out so), so this only has to be above the RFC's one.
pub const IMMEDIATE_DEPTH: u32 = 32;

/// Task management requests one connection may have waiting for aborted commands to finish;
/// more are answered "function rejected" at once. An initiator has a handful at most (one
/// per LUN reset or abort it escalates to).
pub const MAX_PENDING_TMFS: usize = 16;

/// The input buffer asks the socket for at least this much at a time, so a burst of small
/// PDUs is parsed from one read.
const READ_CHUNK: usize = 64 * 1024;

/// Below this much room the input buffer is grown (or renewed) before reading.
const MIN_READ: usize = 1024;

/// LUN 1 in single-level peripheral device addressing.
pub const LUN1: u64 = 0x0001_0000_0000_0000;

/// How an outgoing PDU's StatSN field is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sn {
    /// A response: carries the next StatSN, which then advances.
    Advance,
    /// Carries the current StatSN without advancing it (R2T).
    Current,
    /// StatSN is reserved (Data-In without status).
    Reserved,
}

/// Serial number arithmetic (RFC 1982) on 32-bit sequence numbers.
pub fn sn_lt(a: u32, b: u32) -> bool {
    a != b && b.wrapping_sub(a) < 0x8000_0000
}

/// Identifies one started command for the life of the connection (ITTs are reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CmdId(u64);

/// What a command holds of the limits on how many commands a connection has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// A place in the CmdSN window (a non-immediate command).
    Window,
    /// One of the IMMEDIATE_DEPTH immediate commands.
    Immediate,
    /// Nothing: the command is answered without running.
    None,
}

/// A SCSI command as received.
struct Cmd {
    itt: u32,
    lun: u64,
    cdb: [u8; 16],
    edtl: u32,
    slot: Slot,
    /// Bytes of WRITE_BUDGET its buffered data uses, given back when the command ends.
    write_budget: usize,
    /// What it costs OUT_BUDGET while it runs (set when started).
    cost: u64,
    id: CmdId,
}

/// A finished command, ready to be answered.
struct Done {
    cmd: Cmd,
    reply: Reply,
}

/// A running command as task management sees it.
struct Task {
    id: CmdId,
    aborted: bool,
}

/// A write command still collecting Data-Out.
struct PendingWrite {
    cmd: Cmd,
    buf: BytesMut,
    /// Offset up to which R2Ts have been sent (or unsolicited data is allowed).
    requested: u32,
    outstanding_r2t: u32,
    r2t_sn: u32,
    /// DataSN the next Data-Out of the current sequence must carry.
    next_data_sn: u32,
    unsolicited_open: bool,
}

/// State of one connection, owned by its task.
struct Session<'t> {
    target: &'t Target,
    stream: TcpStream,
    /// Bytes read from the socket and not yet cut into PDUs.
    input: BytesMut,
    framing: Framing,
    params: Params,
    kind: SessionKind,
    portal: String,
    initiator: String,
    stat_sn: u32,
    exp_cmd_sn: u32,
    /// Window-holding commands accepted and not yet completed.
    in_flight: u32,
    /// Immediate SCSI commands accepted and not yet completed.
    immediate: u32,
    /// The Text Request exchange in progress, if any.
    text: Option<TextExchange>,
    writes: HashMap<u32, PendingWrite>,
    next_ttt: u32,
    running: FuturesUnordered<BoxFuture<'t, Done>>,
    /// Running commands by ITT.
    tasks: HashMap<u32, Task>,
    next_id: u64,
    tmfs: Vec<PendingTmf>,
    out: OutQueue,
    /// WRITE_BUDGET in use.
    write_buffered: usize,
    /// OUT_BUDGET taken by running commands (queued output is counted by `out`).
    running_cost: u64,
    /// False once no further PDU will be read.
    reading: bool,
    /// False once a write to the socket failed: responses are dropped from then on.
    socket_ok: bool,
    /// Whether queued responses wait for an initiator that reads nothing.
    stall: StallWatch,
}

/// Serves the full feature phase of one connection until it ends. `input` holds whatever
/// the initiator sent after its last login request.
pub async fn run(
    target: Arc<Target>,
    stream: TcpStream,
    input: BytesMut,
    login: super::login::Login,
    portal: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let params = login.params.clone();
    let mut s = Session {
        target: &target,
        stream,
        input,
        framing: Framing {
            header_digest: params.header_digest,
            data_digest: params.data_digest,
            max_data: TARGET_MRDSL as usize,
        },
        out: OutQueue::new(params.header_digest, params.data_digest),
        params,
        kind: login.kind,
        portal,
        initiator: login.initiator,
        stat_sn: login.stat_sn,
        exp_cmd_sn: login.exp_cmd_sn,
        in_flight: 0,
        immediate: 0,
        text: None,
        writes: HashMap::new(),
        next_ttt: 1,
        running: FuturesUnordered::new(),
        tasks: HashMap::new(),
        next_id: 0,
        tmfs: Vec::new(),
        write_buffered: 0,
        running_cost: 0,
        reading: true,
        socket_ok: true,
        stall: StallWatch::new(target.response_timeout),
    };
    s.serve(&mut shutdown).await;
    if s.socket_ok {
        let _ = s.stream.shutdown().await;
    }
}

impl<'t> Session<'t> {
    async fn serve(&mut self, shutdown: &mut watch::Receiver<bool>) {
        // Armed only while responses wait for the socket; reset, not recreated, as they move.
        let stall = tokio::time::sleep(self.stall.timeout());
        tokio::pin!(stall);
        loop {
            self.parse_input();
            self.write_out();
            if self.reading && self.has_room() && self.input_has_pdu() {
                // Writing gave back budget that parsing was waiting for, and the next PDU is
                // already buffered: no socket event would wake us for it.
                continue;
            }
            if !self.reading && self.running.is_empty() && (self.out.is_empty() || !self.socket_ok)
            {
                return;
            }
            // parse_input() stopped either for want of bytes or for want of budget.
            let want_read = self.reading && self.has_room();
            let want_write = self.socket_ok && !self.out.is_empty();
            let interest = crate::sockio::interest(want_read, want_write);
            if want_write {
                let deadline = self.stall.deadline(&self.stream);
                if stall.deadline() != deadline {
                    stall.as_mut().reset(deadline);
                }
            }
            tokio::select! {
                Some(done) = self.running.next(), if !self.running.is_empty() => {
                    self.complete(done);
                    // Take every other command that finished meanwhile, so one writev
                    // carries all their responses.
                    while let Some(Some(done)) = self.running.next().now_or_never() {
                        self.complete(done);
                    }
                }
                // Not polled when disabled, but the expression is still evaluated.
                ready = self.stream.ready(interest.unwrap_or(Interest::READABLE)),
                    if interest.is_some() =>
                {
                    match ready {
                        Ok(r) if r.is_readable() && want_read => self.read_input(),
                        // Writable: the next write_out() goes on.
                        Ok(_) => {}
                        Err(e) => {
                            info!(initiator = %self.initiator, error = %e, "connection ended");
                            self.socket_failed();
                        }
                    }
                }
                _ = shutdown.wait_for(|stop| *stop), if self.reading => {
                    debug!(initiator = %self.initiator, "target shutting down: closing connection");
                    self.stop_reading();
                    self.stall.shorten(SHUTDOWN_GRACE);
                }
                () = &mut stall, if want_write => {
                    if self.stall.expired(&self.stream) {
                        warn!(
                            initiator = %self.initiator,
                            unread_bytes = self.out.pending(),
                            timeout = ?self.stall.timeout(),
                            "initiator left its responses unread past the response timeout: \
                             closing the connection"
                        );
                        self.socket_failed();
                    }
                }
            }
        }
    }

    /// Whether the response budget allows starting more commands.
    fn has_room(&self) -> bool {
        self.running_cost + (self.out.pending() as u64) < OUT_BUDGET
    }

    /// Whether a whole PDU (or a framing error) is waiting in the input buffer.
    fn input_has_pdu(&self) -> bool {
        match self.framing.frame_len(&self.input) {
            Ok(Some(n)) => self.input.len() >= n,
            Ok(None) => false,
            Err(_) => true,
        }
    }

    fn read_input(&mut self) {
        // Make room for the whole PDU at the front, or a chunk of small ones. Reserving
        // allocates afresh only while the buffer is still shared with data segments of
        // running commands; otherwise it reuses it.
        let need = self
            .framing
            .frame_len(&self.input)
            .ok()
            .flatten()
            .unwrap_or(BHS_LEN);
        let spare = self.input.capacity() - self.input.len();
        if self.input.capacity() < need || spare < MIN_READ {
            self.input
                .reserve(need.saturating_sub(self.input.len()).max(READ_CHUNK));
        }
        match self.stream.try_read_buf(&mut self.input) {
            Ok(0) => {
                if self.input.is_empty() {
                    debug!(initiator = %self.initiator, "connection closed by initiator");
                } else {
                    info!(
                        initiator = %self.initiator,
                        buffered = self.input.len(),
                        "connection ended in the middle of a PDU"
                    );
                }
                self.stop_reading();
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                info!(initiator = %self.initiator, error = %e, "connection ended");
                self.stop_reading();
            }
        }
    }

    /// Handles every complete PDU in the input buffer that the response budget allows.
    fn parse_input(&mut self) {
        while self.reading && self.has_room() {
            match self.framing.parse(&mut self.input) {
                Ok(None) => return,
                Ok(Some(Frame::Pdu(pdu))) => {
                    if !self.handle(pdu.bhs, pdu.data) {
                        self.stop_reading();
                    }
                }
                Ok(Some(Frame::DataDigestError(bhs))) => {
                    warn!(initiator = %self.initiator, "data digest error; rejecting PDU");
                    self.reject(&bhs, reject::DATA_DIGEST);
                    // The command whose data was lost cannot complete at ErrorRecoveryLevel 0.
                    if bhs.opcode() == op::DATA_OUT || bhs.opcode() == op::SCSI_CMD {
                        self.stop_reading();
                    }
                }
                Err(PduError::DataTooLong { len, max, bhs }) => {
                    warn!(initiator = %self.initiator, len, max, "data segment too long");
                    self.reject(&bhs, reject::PROTOCOL_ERROR);
                    self.stop_reading();
                }
                Err(e) => {
                    info!(initiator = %self.initiator, error = %e, "connection ended");
                    self.stop_reading();
                }
            }
        }
    }

    fn stop_reading(&mut self) {
        self.reading = false;
        // Commands waiting for Data-Out can never complete now; give back their slots.
        for (_, w) in std::mem::take(&mut self.writes) {
            self.release(&w.cmd);
        }
    }

    fn socket_failed(&mut self) {
        self.socket_ok = false;
        self.stop_reading();
        self.out.clear();
    }

    /// Writes queued output until it is all out or the socket is full.
    fn write_out(&mut self) {
        while self.socket_ok && !self.out.is_empty() {
            let written = {
                let mut iov = [IoSlice::new(&[]); MAX_IOVECS];
                let n = self.out.io_slices(&mut iov);
                self.stream.try_write_vectored(&iov[..n])
            };
            match written {
                Ok(0) => {
                    debug!(initiator = %self.initiator, "initiator stopped accepting data");
                    self.socket_failed();
                }
                Ok(n) => {
                    self.stall.progressed();
                    self.out.advance(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    debug!(initiator = %self.initiator, error = %e, "writing to initiator failed");
                    self.socket_failed();
                }
            }
        }
    }

    fn max_cmd_sn(&self) -> u32 {
        self.exp_cmd_sn
            .wrapping_add(QUEUE_DEPTH - 1)
            .wrapping_sub(self.in_flight)
    }

    /// Stamps the sequence numbers into `bhs` (in queue order, which is wire order).
    fn stamp(&mut self, bhs: &mut Bhs, sn: Sn) {
        match sn {
            Sn::Advance => {
                bhs.set_u32(24, self.stat_sn);
                self.stat_sn = self.stat_sn.wrapping_add(1);
            }
            Sn::Current => bhs.set_u32(24, self.stat_sn),
            Sn::Reserved => {}
        }
        bhs.set_u32(28, self.exp_cmd_sn);
        bhs.set_u32(32, self.max_cmd_sn());
    }

    /// Queues a PDU whose data segment is shared with its owner (large ones are not copied).
    fn send(&mut self, mut bhs: Bhs, data: &Bytes, sn: Sn) {
        if !self.socket_ok {
            return;
        }
        self.stamp(&mut bhs, sn);
        self.out.push(&bhs, data);
    }

    /// Queues a PDU with a small data segment, copied.
    fn send_copy(&mut self, mut bhs: Bhs, data: &[u8], sn: Sn) {
        if !self.socket_ok {
            return;
        }
        self.stamp(&mut bhs, sn);
        self.out.push_copy(&bhs, data);
    }

    fn reject(&mut self, rejected: &Bhs, reason: u8) {
        let mut b = Bhs::new(op::REJECT);
        b.0[1] = 0x80;
        b.0[2] = reason;
        b.set_itt(RESERVED_TAG);
        b.set_data_len(rejected.0.len());
        self.send_copy(b, &rejected.0, Sn::Advance);
    }

    /// Checks the CmdSN of a non-SCSI request and consumes it. Immediate requests do not
    /// consume a CmdSN.
    fn accept_cmd_sn(&mut self, bhs: &Bhs) -> bool {
        if bhs.immediate() {
            return true;
        }
        if bhs.cmd_sn() != self.exp_cmd_sn {
            return false;
        }
        self.exp_cmd_sn = self.exp_cmd_sn.wrapping_add(1);
        true
    }

    /// Like [`Self::accept_cmd_sn`] for SCSI commands, which also hold a window slot (or one
    /// of the immediate ones) until they complete. Returns the slot taken when accepted:
    /// [`Slot::None`] for an immediate command over IMMEDIATE_DEPTH.
    fn accept_scsi(&mut self, bhs: &Bhs) -> Option<Slot> {
        if bhs.immediate() {
            if self.immediate >= IMMEDIATE_DEPTH {
                return Some(Slot::None);
            }
            self.immediate += 1;
            return Some(Slot::Immediate);
        }
        let sn = bhs.cmd_sn();
        if sn != self.exp_cmd_sn || sn_lt(self.max_cmd_sn(), sn) {
            return None;
        }
        self.exp_cmd_sn = self.exp_cmd_sn.wrapping_add(1);
        self.in_flight += 1;
        Some(Slot::Window)
    }

    /// Gives back the slot and write budget of a command that ends.
    fn release(&mut self, cmd: &Cmd) {
        match cmd.slot {
            Slot::Window => self.in_flight -= 1,
            Slot::Immediate => self.immediate -= 1,
            Slot::None => {}
        }
        self.write_buffered -= cmd.write_budget;
    }

    /// Handles one PDU; false means the connection must close.
    fn handle(&mut self, bhs: Bhs, data: Bytes) -> bool {
        match bhs.opcode() {
            op::SCSI_CMD if self.kind == SessionKind::Normal => self.scsi_cmd(bhs, data),
            op::DATA_OUT if self.kind == SessionKind::Normal => self.data_out(bhs, data),
            op::NOP_OUT => self.nop_out(bhs, data),
            op::TASK_MGMT if self.kind == SessionKind::Normal => self.task_mgmt(bhs),
            op::TEXT_REQ => self.text(bhs, data),
            op::LOGOUT_REQ => {
                self.logout(bhs);
                return false;
            }
            op::SNACK => self.reject(&bhs, reject::PROTOCOL_ERROR),
            _ => self.reject(&bhs, reject::NOT_SUPPORTED),
        }
        true
    }

    fn nop_out(&mut self, bhs: Bhs, data: Bytes) {
        if bhs.itt() == RESERVED_TAG {
            return; // an answer to a NOP-In ping; we send none, so nothing to match
        }
        if !self.accept_cmd_sn(&bhs) {
            debug!(
                cmd_sn = bhs.cmd_sn(),
                "NOP-Out outside the CmdSN window ignored"
            );
            return;
        }
        let mut b = Bhs::new(op::NOP_IN);
        b.0[1] = 0x80;
        b.0[8..16].copy_from_slice(&bhs.0[8..16]);
        b.set_itt(bhs.itt());
        b.set_u32(20, RESERVED_TAG);
        let data = data.slice(..data.len().min(self.params.initiator_mrdsl as usize));
        b.set_data_len(data.len());
        self.send(b, &data, Sn::Advance);
    }

    fn text(&mut self, bhs: Bhs, data: Bytes) {
        if !self.accept_cmd_sn(&bhs) {
            return;
        }
        let (iqn, portal, kind) = (&self.target.iqn, &self.portal, self.kind);
        let step = text::step(
            &mut self.text,
            (bhs.itt(), bhs.u32_at(20), bhs.flags() & 0x40 != 0),
            &data,
            self.params.initiator_mrdsl as usize,
            &mut self.next_ttt,
            |request| text::answer(request, iqn, portal, kind),
        );
        match step {
            TextStep::Respond {
                data,
                final_bit,
                cont,
                ttt,
            } => {
                let mut b = Bhs::new(op::TEXT_RESP);
                b.0[1] = if final_bit { 0x80 } else { 0 } | if cont { 0x40 } else { 0 };
                b.set_itt(bhs.itt());
                b.set_u32(20, ttt);
                b.set_data_len(data.len());
                self.send(b, &data, Sn::Advance);
            }
            TextStep::Reject(reason) => {
                debug!(initiator = %self.initiator, reason, "Text Request rejected");
                self.reject(&bhs, reason);
            }
        }
    }

    fn logout(&mut self, bhs: Bhs) {
        // A logout is answered even when its CmdSN is off: the connection ends either way.
        let _ = self.accept_cmd_sn(&bhs);
        let mut b = Bhs::new(op::LOGOUT_RESP);
        b.0[1] = 0x80;
        b.set_itt(bhs.itt());
        self.send_copy(b, &[], Sn::Advance);
    }

    fn scsi_cmd(&mut self, bhs: Bhs, data: Bytes) {
        let Some(slot) = self.accept_scsi(&bhs) else {
            debug!(
                cmd_sn = bhs.cmd_sn(),
                "SCSI command outside the CmdSN window ignored"
            );
            return;
        };
        let flags = bhs.flags();
        let write = flags & 0x20 != 0;
        let mut cdb = [0u8; 16];
        cdb.copy_from_slice(&bhs.0[32..48]);
        let cmd = Cmd {
            itt: bhs.itt(),
            lun: bhs.lun(),
            cdb,
            edtl: bhs.u32_at(20),
            slot,
            write_budget: 0,
            cost: 0,
            id: CmdId(0),
        };
        if self.writes.contains_key(&cmd.itt) || self.tasks.contains_key(&cmd.itt) {
            self.release(&cmd);
            self.reject(&bhs, reject::INVALID_FIELD);
            return;
        }
        if slot == Slot::None {
            debug!(
                initiator = %self.initiator,
                itt = cmd.itt,
                "immediate commands at their limit; TASK SET FULL"
            );
            // Any unsolicited Data-Out for it finds no pending write and is dropped.
            return self.answer(cmd, Reply::status_only(status::TASK_SET_FULL));
        }
        if bhs.ahs_len() > 0 {
            // Extended CDBs (> 16 bytes) are not supported.
            return self.answer(cmd, Reply::check(Sense::INVALID_OPCODE));
        }
        if !write || cmd.edtl == 0 {
            return self.start(cmd, Bytes::new());
        }
        if u64::from(cmd.edtl) > MAX_DATA_OUT {
            // Unsolicited Data-Out for it will find no pending write and be dropped.
            return self.answer(cmd, Reply::check(Sense::INVALID_FIELD_IN_CDB));
        }
        let p = &self.params;
        if data.len() > cmd.edtl as usize || data.len() > p.first_burst as usize {
            self.release(&cmd);
            self.reject(&bhs, reject::PROTOCOL_ERROR);
            return;
        }
        if data.len() == cmd.edtl as usize {
            return self.start(cmd, data);
        }
        let unsolicited_open = !p.initial_r2t && !bhs.final_bit();
        let unsolicited_end = if p.initial_r2t {
            data.len() as u32
        } else {
            p.first_burst.min(cmd.edtl)
        };
        let edtl = cmd.edtl as usize;
        // The command's own state counts too, or writes that carry no data (EDTL 1) would
        // cost next to nothing each and grow the tables without end.
        let charge = edtl + CMD_COST as usize;
        if self.write_buffered + charge > WRITE_BUDGET {
            debug!(
                itt = cmd.itt,
                edtl = cmd.edtl,
                "write budget exhausted; TASK SET FULL"
            );
            // Its unsolicited Data-Out finds no pending write and is dropped.
            return self.answer(cmd, Reply::status_only(status::TASK_SET_FULL));
        }
        self.write_buffered += charge;
        let mut cmd = cmd;
        cmd.write_budget = charge;
        let mut buf = BytesMut::with_capacity(edtl);
        buf.extend_from_slice(&data);
        let mut w = PendingWrite {
            requested: if unsolicited_open {
                unsolicited_end
            } else {
                data.len() as u32
            },
            cmd,
            buf,
            outstanding_r2t: 0,
            r2t_sn: 0,
            next_data_sn: 0,
            unsolicited_open,
        };
        if !unsolicited_open {
            self.send_r2ts(&mut w);
        }
        self.writes.insert(w.cmd.itt, w);
    }

    fn send_r2ts(&mut self, w: &mut PendingWrite) {
        let (max_r2t, max_burst) = (self.params.max_outstanding_r2t, self.params.max_burst);
        while w.outstanding_r2t < max_r2t && w.requested < w.cmd.edtl {
            let len = (w.cmd.edtl - w.requested).min(max_burst);
            let ttt = take_ttt(&mut self.next_ttt);
            let mut b = Bhs::new(op::R2T);
            b.0[1] = 0x80;
            b.set_lun(w.cmd.lun);
            b.set_itt(w.cmd.itt);
            b.set_u32(20, ttt);
            b.set_u32(36, w.r2t_sn);
            b.set_u32(40, w.requested);
            b.set_u32(44, len);
            self.send_copy(b, &[], Sn::Current);
            w.r2t_sn += 1;
            w.requested += len;
            w.outstanding_r2t += 1;
        }
    }

    /// Handles a Data-Out PDU.
    fn data_out(&mut self, bhs: Bhs, data: Bytes) {
        let itt = bhs.itt();
        let Some(mut w) = self.writes.remove(&itt) else {
            debug!(itt, "Data-Out for no pending write dropped");
            return;
        };
        let ttt = bhs.u32_at(20);
        let data_sn = bhs.u32_at(36);
        let offset = bhs.u32_at(40);
        let received = w.buf.len() as u32;
        let end = u64::from(offset) + data.len() as u64;
        let unsolicited = ttt == RESERVED_TAG;
        let valid = offset == received
            && end <= u64::from(w.requested)
            && data_sn == w.next_data_sn
            && (unsolicited == w.unsolicited_open);
        if !valid {
            // The command cannot be completed correctly; fail it and drop the rest of its
            // Data-Out (they find no pending write). Keeping the connection lets the other
            // commands on it finish.
            warn!(
                itt,
                offset, received, data_sn, "Data-Out out of sequence; failing the command"
            );
            return self.answer(w.cmd, Reply::check(Sense::DATA_PHASE_ERROR));
        }
        w.buf.extend_from_slice(&data);
        w.next_data_sn += 1;
        if bhs.final_bit() {
            w.next_data_sn = 0;
            if unsolicited {
                w.unsolicited_open = false;
                // Anything the unsolicited burst did not cover is requested by R2T.
                w.requested = w.buf.len() as u32;
            } else {
                w.outstanding_r2t = w.outstanding_r2t.saturating_sub(1);
            }
        }
        if w.buf.len() as u32 >= w.cmd.edtl {
            let data = w.buf.split().freeze();
            return self.start(w.cmd, data);
        }
        if !w.unsolicited_open {
            self.send_r2ts(&mut w);
        }
        self.writes.insert(itt, w);
    }

    /// Starts a command with all its data in.
    fn start(&mut self, mut cmd: Cmd, data: Bytes) {
        cmd.id = CmdId(self.next_id);
        self.next_id += 1;
        cmd.cost = u64::from(cmd.edtl).max(scsi::buffer_bytes(&cmd.cdb)) + CMD_COST;
        self.running_cost += cmd.cost;
        self.tasks.insert(
            cmd.itt,
            Task {
                id: cmd.id,
                aborted: false,
            },
        );
        let target = self.target;
        self.running.push(Box::pin(async move {
            let reply = execute(target, &cmd, data).await;
            Done { cmd, reply }
        }));
    }

    /// Answers a command that never ran (refused before it could start).
    fn answer(&mut self, cmd: Cmd, reply: Reply) {
        self.release(&cmd);
        self.respond(&cmd, reply);
    }

    fn complete(&mut self, done: Done) {
        let Done { cmd, reply } = done;
        self.running_cost -= cmd.cost;
        // The slot goes back first, so the response already carries the larger MaxCmdSN.
        self.release(&cmd);
        let task = self.tasks.remove(&cmd.itt);
        debug_assert!(task.as_ref().is_some_and(|t| t.id == cmd.id));
        if !task.is_some_and(|t| t.aborted) {
            self.respond(&cmd, reply);
        }
        if !self.tmfs.is_empty() {
            for t in &mut self.tmfs {
                t.victims.retain(|v| *v != cmd.id);
            }
            self.answer_tmfs();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_number_compare_wraps() {
        assert!(sn_lt(1, 2));
        assert!(!sn_lt(2, 1));
        assert!(sn_lt(u32::MAX, 0));
        assert!(!sn_lt(5, 5));
    }
}
