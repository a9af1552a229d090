//! One iSCSI connection in the full feature phase (RFC 7143 §11).
//!
//! Each connection has one reader task (this module's [`run`] loop), which also drives the
//! connection's running SCSI commands, and one writer task:
//!
//! ```text
//!   socket ──> reader ──push──> running commands ──┐
//!                 │  (R2T, NOP-In, TMF, Reject)     ├──> mpsc ──> writer ──writev──> socket
//!                 └─────────────────────────────────┘
//! ```
//! The reader checks CmdSN, gathers Data-Out (immediate, unsolicited and solicited via R2T)
//! for writes, and starts the command once all its data is in. Commands run concurrently and
//! answer in any order. They are futures in a [`FuturesUnordered`] polled by the reader
//! rather than spawned tasks: a command spends nearly all its time waiting for the device,
//! and a task per command cost an allocation plus a cross-thread wake-up at start and at
//! completion (profiles of 4 KiB reads showed futex wake/wait as the largest cost). When the
//! connection ends, the reader finishes its running commands before it returns, so no device
//! I/O of this connection is left behind. The writer is the only place that stamps StatSN, ExpCmdSN and
//! MaxCmdSN into outgoing PDUs, so StatSN always increases in wire order.
//!
//! CmdSN window: ExpCmdSN and the number of window-holding commands in flight are packed
//! into one atomic so the writer always sees a consistent pair. MaxCmdSN =
//! ExpCmdSN + QUEUE_DEPTH - 1 - in_flight, which never decreases: a new command raises
//! ExpCmdSN and in_flight together, a completion lowers in_flight.
//!
//! Write data budget: a write whose data arrives in Data-Out PDUs gets a buffer of its full
//! length before the data is in. Without a bound, QUEUE_DEPTH commands of MAX_DATA_OUT each
//! would let one initiator make us allocate 1 GiB and never send the data. Each connection
//! has a [`WRITE_BUDGET`] of buffered write bytes (a semaphore in KiB); a write that does not
//! fit is answered TASK SET FULL at once, which initiators retry later, and the budget is
//! given back when the command completes or its connection ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::io::AsyncWrite;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tracing::{debug, info, warn};

use super::Target;
use super::login::{Params, QUEUE_DEPTH, SessionKind, TARGET_MRDSL, parse_keys, push_key};
use super::pdu::{Bhs, PduError, PduReader, RESERVED_TAG, ReadOutcome, encode, op, reject};
use super::scsi::{MAX_DATA_OUT, Reply};
use super::sense::{Sense, status};

/// Write data one connection may hold in buffers while it waits for Data-Out (bytes).
/// 64 MiB is 64 commands of 1 MiB, well above what a queue of 1 MiB writes at the depth
/// Linux and QEMU use needs.
pub const WRITE_BUDGET: usize = 64 << 20;
const BUDGET_UNIT: usize = 1024;

/// LUN 1 in single-level peripheral device addressing.
pub const LUN1: u64 = 0x0001_0000_0000_0000;

/// How the writer fills the StatSN field of an outgoing PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sn {
    /// A response: carries the next StatSN, which then advances.
    Advance,
    /// Carries the current StatSN without advancing it (R2T).
    Current,
    /// StatSN is reserved (Data-In without status).
    Reserved,
}

pub enum Out {
    Pdu {
        bhs: Bhs,
        data: Bytes,
        sn: Sn,
    },
    /// Flush everything queued so far and close the connection.
    Close,
}

/// Cancellation state of a running command, shared with task management.
///
/// A flag plus a [`Notify`] rather than a channel: every command creates one, and only the
/// rare task management request ever waits on it.
struct TaskCtl {
    aborted: AtomicBool,
    done: AtomicBool,
    finished: Notify,
}

impl TaskCtl {
    fn complete(&self) {
        self.done.store(true, Ordering::Release);
        self.finished.notify_waiters();
    }

    async fn wait_done(&self) {
        let notified = self.finished.notified();
        tokio::pin!(notified);
        // Registered before the flag is checked, so a completion in between still wakes us.
        notified.as_mut().enable();
        if !self.done.load(Ordering::Acquire) {
            notified.await;
        }
    }
}

/// State shared by the reader, the writer and command tasks of one connection.
pub struct Conn {
    target: Arc<Target>,
    tx: mpsc::UnboundedSender<Out>,
    /// ExpCmdSN in the high 32 bits, window-holding commands in flight in the low 32.
    window: AtomicU64,
    tasks: std::sync::Mutex<HashMap<u32, Arc<TaskCtl>>>,
    params: Params,
    /// Buffered write data, in BUDGET_UNIT permits (see the module docs).
    write_budget: Arc<Semaphore>,
}

/// Serial number arithmetic (RFC 1982) on 32-bit sequence numbers.
pub fn sn_lt(a: u32, b: u32) -> bool {
    a != b && b.wrapping_sub(a) < 0x8000_0000
}

impl Conn {
    fn exp_max(&self) -> (u32, u32) {
        let v = self.window.load(Ordering::Acquire);
        let exp = (v >> 32) as u32;
        let in_flight = v as u32;
        (
            exp,
            exp.wrapping_add(QUEUE_DEPTH - 1).wrapping_sub(in_flight),
        )
    }

    fn send(&self, bhs: Bhs, data: Bytes, sn: Sn) {
        // A closed channel means the connection is going away; the PDU has nobody to reach.
        let _ = self.tx.send(Out::Pdu { bhs, data, sn });
    }

    fn reject(&self, rejected: &Bhs, reason: u8) {
        let mut b = Bhs::new(op::REJECT);
        b.0[1] = 0x80;
        b.0[2] = reason;
        b.set_itt(RESERVED_TAG);
        b.set_data_len(rejected.0.len());
        self.send(b, Bytes::copy_from_slice(&rejected.0), Sn::Advance);
    }

    /// Checks the CmdSN of a non-SCSI request and consumes it. Immediate requests do not
    /// consume a CmdSN.
    fn accept_cmd_sn(&self, bhs: &Bhs) -> bool {
        if bhs.immediate() {
            return true;
        }
        let (exp, _) = self.exp_max();
        if bhs.cmd_sn() != exp {
            return false;
        }
        self.window.fetch_add(1 << 32, Ordering::AcqRel);
        true
    }

    /// Like [`Self::accept_cmd_sn`] for SCSI commands, which also hold a window slot until
    /// they complete. Returns Some(holds_slot) when accepted.
    fn accept_scsi(&self, bhs: &Bhs) -> Option<bool> {
        if bhs.immediate() {
            return Some(false);
        }
        let (exp, max) = self.exp_max();
        let sn = bhs.cmd_sn();
        if sn != exp || sn_lt(max, sn) {
            return None;
        }
        self.window.fetch_add((1 << 32) + 1, Ordering::AcqRel);
        Some(true)
    }

    fn release_slot(&self) {
        self.window.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A SCSI command as received.
struct Cmd {
    itt: u32,
    lun: u64,
    cdb: [u8; 16],
    edtl: u32,
    holds_slot: bool,
    /// Share of the write budget its buffered data uses, given back when the command ends.
    budget: Option<OwnedSemaphorePermit>,
}

/// A write command still collecting Data-Out.
struct PendingWrite {
    cmd: Cmd,
    buf: BytesMut,
    /// Offset up to which R2Ts have been sent (or unsolicited data is allowed).
    requested: u32,
    outstanding_r2t: u32,
    r2t_sn: u32,
    /// TTT of the R2T the current Data-Out sequence answers (RESERVED_TAG if unsolicited).
    next_data_sn: u32,
    unsolicited_open: bool,
}

/// Per-connection reader state (owned by the reader loop only).
struct Reader {
    conn: Arc<Conn>,
    kind: SessionKind,
    writes: HashMap<u32, PendingWrite>,
    next_ttt: u32,
    portal: String,
    /// Commands started and not yet answered.
    running: FuturesUnordered<BoxFuture<'static, ()>>,
}

pub async fn run<W: AsyncWrite + Unpin + Send + 'static>(
    target: Arc<Target>,
    mut reader: PduReader<OwnedReadHalf>,
    writer: W,
    login: super::login::Login,
    portal: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    reader.header_digest = login.params.header_digest;
    reader.data_digest = login.params.data_digest;
    reader.max_data = TARGET_MRDSL as usize;
    let conn = Arc::new(Conn {
        target,
        tx,
        window: AtomicU64::new(u64::from(login.exp_cmd_sn) << 32),
        tasks: std::sync::Mutex::new(HashMap::new()),
        params: login.params.clone(),
        write_budget: Arc::new(Semaphore::new(WRITE_BUDGET / BUDGET_UNIT)),
    });
    let writer_task = tokio::spawn(write_loop(writer, rx, conn.clone(), login.stat_sn));
    let mut r = Reader {
        conn: conn.clone(),
        kind: login.kind,
        writes: HashMap::new(),
        next_ttt: 1,
        portal,
        running: FuturesUnordered::new(),
    };
    loop {
        // PduReader::read keeps partial input in its buffer, so losing the race to a
        // completing command loses no bytes.
        let outcome = tokio::select! {
            o = reader.read() => o,
            Some(()) = r.running.next(), if !r.running.is_empty() => continue,
            _ = shutdown.changed() => break,
        };
        match outcome {
            Ok(ReadOutcome::Pdu(pdu)) => {
                if !r.handle(pdu.bhs, pdu.data) {
                    break;
                }
            }
            Ok(ReadOutcome::DataDigestError(bhs)) => {
                warn!(initiator = %login.initiator, "data digest error; rejecting PDU");
                conn.reject(&bhs, reject::DATA_DIGEST);
                // The command whose data was lost cannot complete at ErrorRecoveryLevel 0.
                if bhs.opcode() == op::DATA_OUT || bhs.opcode() == op::SCSI_CMD {
                    break;
                }
            }
            Ok(ReadOutcome::Eof) => {
                debug!(initiator = %login.initiator, "connection closed by initiator");
                break;
            }
            Err(PduError::DataTooLong { len, max, bhs }) => {
                warn!(initiator = %login.initiator, len, max, "data segment too long");
                conn.reject(&bhs, reject::PROTOCOL_ERROR);
                break;
            }
            Err(e) => {
                info!(initiator = %login.initiator, error = %e, "connection ended");
                break;
            }
        }
    }
    // Commands waiting for Data-Out can never complete now; give back their slots.
    for (_, w) in r.writes.drain() {
        if w.cmd.holds_slot {
            conn.release_slot();
        }
    }
    // Running commands finish their device I/O (their answers may still reach the writer).
    while r.running.next().await.is_some() {}
    let _ = conn.tx.send(Out::Close);
    drop(r);
    drop(conn);
    let _ = writer_task.await;
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Out>,
    conn: Arc<Conn>,
    mut stat_sn: u32,
) {
    let hd = conn.params.header_digest;
    let dd = conn.params.data_digest;
    let mut scratch = BytesMut::with_capacity(16 * 1024);
    let mut bufs: Vec<Bytes> = Vec::with_capacity(64);
    let mut closing = false;
    while !closing {
        let Some(first) = rx.recv().await else { break };
        let mut next = Some(first);
        let mut batched = 0usize;
        while let Some(m) = next.take() {
            match m {
                Out::Close => {
                    closing = true;
                    break;
                }
                Out::Pdu { mut bhs, data, sn } => {
                    let (exp, max) = conn.exp_max();
                    match sn {
                        Sn::Advance => {
                            bhs.set_u32(24, stat_sn);
                            stat_sn = stat_sn.wrapping_add(1);
                        }
                        Sn::Current => bhs.set_u32(24, stat_sn),
                        Sn::Reserved => {}
                    }
                    bhs.set_u32(28, exp);
                    bhs.set_u32(32, max);
                    batched += 48 + data.len();
                    encode(&bhs, &data, hd, dd, &mut scratch, &mut bufs);
                }
            }
            if batched < 1 << 20 && bufs.len() < 60 {
                next = rx.try_recv().ok();
            }
        }
        if let Err(e) = super::pdu::write_all_bufs(&mut w, &mut bufs).await {
            debug!(error = %e, "writing to initiator failed");
            break;
        }
    }
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut w).await;
}

impl Reader {
    /// Handles one PDU; false means the connection must close.
    fn handle(&mut self, bhs: Bhs, data: Bytes) -> bool {
        match bhs.opcode() {
            op::SCSI_CMD if self.kind == SessionKind::Normal => self.scsi_cmd(bhs, data),
            op::DATA_OUT if self.kind == SessionKind::Normal => return self.data_out(bhs, data),
            op::NOP_OUT => self.nop_out(bhs, data),
            op::TASK_MGMT if self.kind == SessionKind::Normal => self.task_mgmt(bhs),
            op::TEXT_REQ => self.text(bhs, data),
            op::LOGOUT_REQ => {
                self.logout(bhs);
                return false;
            }
            op::SNACK => self.conn.reject(&bhs, reject::PROTOCOL_ERROR),
            _ => self.conn.reject(&bhs, reject::NOT_SUPPORTED),
        }
        true
    }

    fn nop_out(&mut self, bhs: Bhs, data: Bytes) {
        if bhs.itt() == RESERVED_TAG {
            return; // an answer to a NOP-In ping; we send none, so nothing to match
        }
        if !self.conn.accept_cmd_sn(&bhs) {
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
        let data = data.slice(..data.len().min(self.conn.params.initiator_mrdsl as usize));
        b.set_data_len(data.len());
        self.conn.send(b, data, Sn::Advance);
    }

    fn text(&mut self, bhs: Bhs, data: Bytes) {
        if !self.conn.accept_cmd_sn(&bhs) {
            return;
        }
        let mut out = Vec::new();
        for (k, v) in parse_keys(&data) {
            if k == "SendTargets" {
                let iqn = &self.conn.target.iqn;
                if v == "All" || v == *iqn || (v.is_empty() && self.kind == SessionKind::Normal) {
                    push_key(&mut out, "TargetName", iqn);
                    push_key(&mut out, "TargetAddress", &format!("{},1", self.portal));
                }
            } else {
                push_key(&mut out, &k, "NotUnderstood");
            }
        }
        let mut b = Bhs::new(op::TEXT_RESP);
        b.0[1] = 0x80;
        b.set_itt(bhs.itt());
        b.set_u32(20, RESERVED_TAG);
        b.set_data_len(out.len());
        self.conn.send(b, Bytes::from(out), Sn::Advance);
    }

    fn logout(&mut self, bhs: Bhs) {
        // A logout is answered even when its CmdSN is off: the connection ends either way.
        let _ = self.conn.accept_cmd_sn(&bhs);
        let mut b = Bhs::new(op::LOGOUT_RESP);
        b.0[1] = 0x80;
        b.set_itt(bhs.itt());
        self.conn.send(b, Bytes::new(), Sn::Advance);
    }

    fn scsi_cmd(&mut self, bhs: Bhs, data: Bytes) {
        let Some(holds_slot) = self.conn.accept_scsi(&bhs) else {
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
            holds_slot,
            budget: None,
        };
        let in_use = self.writes.contains_key(&cmd.itt)
            || self
                .conn
                .tasks
                .lock()
                .expect("invariant: lock not poisoned")
                .contains_key(&cmd.itt);
        if in_use {
            if holds_slot {
                self.conn.release_slot();
            }
            self.conn.reject(&bhs, reject::INVALID_FIELD);
            return;
        }
        if bhs.ahs_len() > 0 {
            // Extended CDBs (> 16 bytes) are not supported.
            return self.start(cmd, Bytes::new(), Some(Reply::check(Sense::INVALID_OPCODE)));
        }
        if !write || cmd.edtl == 0 {
            return self.start(cmd, Bytes::new(), None);
        }
        if u64::from(cmd.edtl) > MAX_DATA_OUT {
            // Unsolicited Data-Out for it will find no pending write and be dropped.
            return self.start(
                cmd,
                Bytes::new(),
                Some(Reply::check(Sense::INVALID_FIELD_IN_CDB)),
            );
        }
        let p = &self.conn.params;
        if data.len() > cmd.edtl as usize || data.len() > p.first_burst as usize {
            if holds_slot {
                self.conn.release_slot();
            }
            self.conn.reject(&bhs, reject::PROTOCOL_ERROR);
            return;
        }
        if data.len() == cmd.edtl as usize {
            return self.start(cmd, data, None);
        }
        let unsolicited_open = !p.initial_r2t && !bhs.final_bit();
        let unsolicited_end = if p.initial_r2t {
            data.len() as u32
        } else {
            p.first_burst.min(cmd.edtl)
        };
        let units = (cmd.edtl as usize).div_ceil(BUDGET_UNIT);
        let permit = u32::try_from(units).ok().and_then(|n| {
            self.conn
                .write_budget
                .clone()
                .try_acquire_many_owned(n)
                .ok()
        });
        let Some(permit) = permit else {
            debug!(
                itt = cmd.itt,
                edtl = cmd.edtl,
                "write budget exhausted; TASK SET FULL"
            );
            // Its unsolicited Data-Out finds no pending write and is dropped.
            return self.start(
                cmd,
                Bytes::new(),
                Some(Reply::status_only(status::TASK_SET_FULL)),
            );
        };
        let mut cmd = cmd;
        cmd.budget = Some(permit);
        let mut buf = BytesMut::with_capacity(cmd.edtl as usize);
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
        let p = &self.conn.params;
        while w.outstanding_r2t < p.max_outstanding_r2t && w.requested < w.cmd.edtl {
            let len = (w.cmd.edtl - w.requested).min(p.max_burst);
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1);
            if self.next_ttt == RESERVED_TAG {
                self.next_ttt = 1;
            }
            let mut b = Bhs::new(op::R2T);
            b.0[1] = 0x80;
            b.set_lun(w.cmd.lun);
            b.set_itt(w.cmd.itt);
            b.set_u32(20, ttt);
            b.set_u32(36, w.r2t_sn);
            b.set_u32(40, w.requested);
            b.set_u32(44, len);
            self.conn.send(b, Bytes::new(), Sn::Current);
            w.r2t_sn += 1;
            w.requested += len;
            w.outstanding_r2t += 1;
        }
    }

    /// Handles a Data-Out PDU; false closes the connection.
    fn data_out(&mut self, bhs: Bhs, data: Bytes) -> bool {
        let itt = bhs.itt();
        let Some(mut w) = self.writes.remove(&itt) else {
            debug!(itt, "Data-Out for no pending write dropped");
            return true;
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
            self.start(
                w.cmd,
                Bytes::new(),
                Some(Reply::check(Sense::DATA_PHASE_ERROR)),
            );
            return true;
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
            self.start(w.cmd, data, None);
            return true;
        }
        if !w.unsolicited_open {
            self.send_r2ts(&mut w);
        }
        self.writes.insert(itt, w);
        true
    }

    /// Starts a command task (or answers at once with `fail`).
    fn start(&mut self, cmd: Cmd, data: Bytes, fail: Option<Reply>) {
        let ctl = Arc::new(TaskCtl {
            aborted: AtomicBool::new(false),
            done: AtomicBool::new(false),
            finished: Notify::new(),
        });
        self.conn
            .tasks
            .lock()
            .expect("invariant: lock not poisoned")
            .insert(cmd.itt, ctl.clone());
        let conn = self.conn.clone();
        self.running.push(Box::pin(async move {
            let reply = match fail {
                Some(r) => r,
                None => execute(&conn, &cmd, data).await,
            };
            if cmd.holds_slot {
                conn.release_slot();
            }
            {
                // Queue the response and leave the task table under one lock, so task
                // management sees either a task it can still abort (and we stay silent) or
                // one whose response is already ahead of the TMF response on the wire.
                let mut tasks = conn.tasks.lock().expect("invariant: lock not poisoned");
                if !ctl.aborted.load(Ordering::Acquire) {
                    respond(&conn, &cmd, reply);
                }
                tasks.remove(&cmd.itt);
            }
            ctl.complete();
        }));
    }

    fn task_mgmt(&mut self, bhs: Bhs) {
        if !self.conn.accept_cmd_sn(&bhs) {
            return;
        }
        let function = bhs.flags() & 0x7f;
        let rtt = bhs.u32_at(20);
        let ref_cmd_sn = bhs.u32_at(32);
        let lun_ok = bhs.lun() == LUN1;
        let mut victims = Vec::new();
        let take = |itt: u32, this: &mut Reader| {
            if let Some(w) = this.writes.remove(&itt)
                && w.cmd.holds_slot
            {
                this.conn.release_slot();
            }
        };
        let response: u8 = match function {
            1 => {
                let pending = self.writes.contains_key(&rtt);
                take(rtt, self);
                let running = self
                    .conn
                    .tasks
                    .lock()
                    .expect("invariant: lock not poisoned")
                    .get(&rtt)
                    .inspect(|t| t.aborted.store(true, Ordering::Release))
                    .cloned();
                if let Some(t) = running {
                    victims.push(t);
                    0
                } else if pending {
                    0
                } else {
                    // With one connection per session every earlier command has arrived, so
                    // a task we do not know has already completed.
                    debug!(ref_cmd_sn, "ABORT TASK for an unknown task");
                    1
                }
            }
            2 | 4 | 5 if !lun_ok => 2,
            2 | 4 | 5 | 6 | 7 => {
                let itts: Vec<u32> = self.writes.keys().copied().collect();
                for itt in itts {
                    take(itt, self);
                }
                victims.extend(
                    self.conn
                        .tasks
                        .lock()
                        .expect("invariant: lock not poisoned")
                        .values()
                        .inspect(|t| t.aborted.store(true, Ordering::Release))
                        .cloned(),
                );
                0
            }
            8 => 4,
            _ => 5,
        };
        info!(
            function,
            rtt,
            response,
            aborted = victims.len(),
            "task management"
        );
        let conn = self.conn.clone();
        let itt = bhs.itt();
        let close = function == 7;
        tokio::spawn(async move {
            for v in victims {
                // The command's device I/O finishes before we report it aborted, so
                // nothing it does can land after the initiator reuses the blocks.
                v.wait_done().await;
            }
            let mut b = Bhs::new(op::TASK_MGMT_RESP);
            b.0[1] = 0x80;
            b.0[2] = response;
            b.set_itt(itt);
            conn.send(b, Bytes::new(), Sn::Advance);
            if close {
                let _ = conn.tx.send(Out::Close);
            }
        });
    }
}

async fn execute(conn: &Conn, cmd: &Cmd, data: Bytes) -> Reply {
    let lun = &conn.target.lun;
    if cmd.lun == LUN1 {
        return lun.execute(&cmd.cdb, data).await;
    }
    match cmd.cdb[0] {
        // REPORT LUNS and REQUEST SENSE work on any LUN; INQUIRY reports "no LU here".
        0xa0 | 0x03 => lun.execute(&cmd.cdb, data).await,
        0x12 => {
            let mut r = lun.execute(&cmd.cdb, data).await;
            if r.status == status::GOOD && !r.data.is_empty() && cmd.cdb[1] & 1 == 0 {
                let mut d = r.data.to_vec();
                d[0] = 0x7f;
                r.data = Bytes::from(d);
            }
            r
        }
        _ => Reply::check(Sense::LUN_NOT_SUPPORTED),
    }
}

/// Residual flags (byte 1 of SCSI Response / Data-In) and count.
fn residual(transfer_len: u64, edtl: u64) -> (u8, u32) {
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    if transfer_len > edtl {
        (0x04, clamp(transfer_len - edtl))
    } else if transfer_len < edtl {
        (0x02, clamp(edtl - transfer_len))
    } else {
        (0, 0)
    }
}

/// Sends Data-In (status in the last PDU when the command succeeded) and/or a SCSI Response.
fn respond(conn: &Conn, cmd: &Cmd, reply: Reply) {
    let edtl = u64::from(cmd.edtl);
    let (res_flags, res_count) = residual(reply.transfer_len, edtl);
    let data = reply.data.slice(..reply.data.len().min(cmd.edtl as usize));
    let mut data_sn = 0u32;
    if !data.is_empty() {
        let seg = conn.params.initiator_mrdsl as usize;
        let burst = conn.params.max_burst as usize;
        let with_status = reply.status == status::GOOD;
        let mut off = 0usize;
        while off < data.len() {
            let n = seg.min(data.len() - off).min(burst - off % burst);
            let last = off + n == data.len();
            let mut b = Bhs::new(op::DATA_IN);
            let mut flags = 0u8;
            if last || (off + n).is_multiple_of(burst) {
                flags |= 0x80;
            }
            let sn = if last && with_status {
                flags |= 0x01 | res_flags;
                b.0[3] = reply.status;
                b.set_u32(44, res_count);
                Sn::Advance
            } else {
                Sn::Reserved
            };
            b.0[1] = flags;
            b.set_itt(cmd.itt);
            b.set_u32(20, RESERVED_TAG);
            b.set_u32(36, data_sn);
            b.set_u32(40, off as u32);
            b.set_data_len(n);
            conn.send(b, data.slice(off..off + n), sn);
            data_sn += 1;
            off += n;
        }
        if with_status {
            return;
        }
    }
    let mut b = Bhs::new(op::SCSI_RESP);
    b.0[1] = 0x80 | res_flags;
    b.0[3] = reply.status;
    b.set_itt(cmd.itt);
    b.set_u32(36, data_sn);
    b.set_u32(44, res_count);
    let payload = match reply.sense {
        Some(s) => {
            let sense = s.fixed();
            let mut p = Vec::with_capacity(2 + sense.len());
            p.extend_from_slice(&(sense.len() as u16).to_be_bytes());
            p.extend_from_slice(&sense);
            Bytes::from(p)
        }
        None => Bytes::new(),
    };
    b.set_data_len(payload.len());
    conn.send(b, payload, Sn::Advance);
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

    #[test]
    fn residuals() {
        assert_eq!(residual(512, 0), (0x04, 512));
        assert_eq!(residual(512, 10000), (0x02, 9488));
        assert_eq!(residual(512, 512), (0, 0));
    }
}
