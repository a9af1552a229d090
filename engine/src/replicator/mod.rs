//! The replicator: one volume over N replicas, exposed to frontends as a [`BlockDevice`].
//!
//! # Replica modes
//!
//! ```text
//!            rebuild / catch-up done
//!     WO ───────────────────────────► RW
//!      │                               │
//!      │ error, timeout, disconnect    │ error, timeout, disconnect
//!      ▼                               ▼
//!     ERR ◄────────────────────────────┘      (ERR is final for that connection;
//!                                               a replica comes back as a new WO)
//! ```
//!
//! - A write or unmap goes to every RW and WO replica and is acknowledged when all of them
//!   answered. A replica that errs or misses the I/O timeout goes ERR at once; the operation
//!   still succeeds if at least one RW replica took it. No RW replica left: the volume is
//!   faulted and I/O fails.
//! - Before any write or flush is acknowledged after an RW replica went ERR, the surviving
//!   RW replicas record a new membership epoch naming exactly themselves
//!   ([`Volume::commit_membership`]), so the dropped replica can never be taken for current.
//! - A read goes to one RW replica (a local one first, then the least busy) and is retried on
//!   another if it fails; the failing one goes ERR.
//! - Overlapping writes are ordered by a [`RangeLock`]: a write is sent only after every
//!   earlier overlapping write completed on every replica, so all replicas apply them in the
//!   same order.
//! - Request ids come from one counter per volume.
//!
//! # Checksums
//!
//! Every write reaches the replicas with the CRC32C of each of its 4 KiB blocks, computed
//! once here from the frontend's data; the replicas store them with the data. Writes and
//! unmaps that are not 4 KiB aligned are read-modify-write here (the edge blocks read
//! verified, under the write's range lock), so replicas only ever get whole blocks with
//! their sums. A replica that finds blocks failing their sums answers a read CORRUPT;
//! `repair.rs` then reads the range from every RW replica under the range lock, returns each
//! block from a replica whose copy passes, rewrites the bad copies, and fails the read with
//! [`BlockError::Medium`] only for blocks no replica holds a good copy of. `scrub.rs` does
//! the same for every block in the background; `liveness.rs` pings idle replicas.
//!
//! # Start, errors, ids
//!
//! Which replicas an engine starts from is decided by `decide_start` (`decide.rs`), a pure
//! function of what the replicas reported (table-tested in `decide_tests.rs`); `start.rs`
//! gathers the reports and carries the decision out. Control operations (rebuild, snapshots,
//! expand, scrub, removal) fail with a [`VolumeError`] that names the volume, the replica and
//! the offset in fields; frontend I/O fails with a [`BlockError`]. Replica ids, request ids,
//! generations, epochs and flush numbers are the newtypes of `zebu_proto::ids` and
//! `zebu_proto::numbers` in the replicator's own state and calls; raw integers and strings
//! remain only in the wire messages it reads and builds (`pb::InfoResponse`, frames).

mod client;
mod decide;
mod error;
mod frames;
mod liveness;
mod rangelock;
mod rebuild;
mod repair;
mod scrub;
mod snapshot;
mod start;

pub use client::{
    ControlClient, DataPath, DataTransport, GrpcDataPath, PathError, connect_channel,
    control_client, open_data_path, set_replica_tls, set_volume_secret,
};
pub use error::{SecretAlreadySet, TlsAlreadySet, UnknownTransport, VolumeError};
pub use frames::FramedDataPath;
pub use rangelock::RangeLock;
pub use rebuild::{RebuildKind, RebuildState, RebuildStatus};
pub use repair::IntegrityCounters;
pub use scrub::{ScrubReport, ScrubState};
pub use start::{StartError, StartOptions};

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use zebu_proto::ids::{ReplicaId, RequestId};
use zebu_proto::numbers::{Epoch, FlushNumber, Generation};
use zebu_proto::replica as pb;
use zebu_proto::sums::BlockSums;

use crate::blockdev::{BlockDevice, BlockError, BoxFuture};
use crate::pathtime::{PathCounters, PathTotals};

/// The largest piece one replica request carries; larger I/O is split.
const MAX_PIECE: u64 = pb::MAX_IO_BYTES;
/// The block the checksums cover; writes and unmaps reach replicas in whole blocks.
const BLOCK: u64 = zebu_proto::sums::SUM_BLOCK_U64;

/// A replica's mode in this engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// In sync: serves reads and writes.
    RW,
    /// Rebuilding: receives every write, serves no reads.
    WO,
    /// Dropped: gets nothing.
    ERR,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::RW => "RW",
            Mode::WO => "WO",
            Mode::ERR => "ERR",
        })
    }
}

impl Mode {
    /// Whether `self -> to` is a valid transition (see the module diagram).
    fn can_become(self, to: Mode) -> bool {
        matches!(
            (self, to),
            (Mode::WO, Mode::RW) | (Mode::WO, Mode::ERR) | (Mode::RW, Mode::ERR)
        )
    }
}

/// One replica as the engine sees it.
pub struct Replica {
    pub addr: String,
    /// The replica's own id (from its Info).
    pub id: ReplicaId,
    mode: Mutex<(Mode, String)>,
    data: Arc<dyn DataPath>,
    control: ControlClient,
    inflight: AtomicUsize,
    local: bool,
    /// Set while a full rebuild copies older layers into this replica: its unmaps must write
    /// zeros, since a hole in its head would let data copied below later show through.
    zero_fill_unmaps: AtomicBool,
}

impl Replica {
    pub fn mode(&self) -> Mode {
        self.mode.lock().expect("invariant: mode lock").0
    }

    /// Why the replica is in its mode (for ERR: what failed).
    pub fn reason(&self) -> String {
        self.mode.lock().expect("invariant: mode lock").1.clone()
    }

    pub fn control(&self) -> ControlClient {
        self.control.clone()
    }

    /// What carries its data (`frames/tcp`, `frames/local`, `grpc`).
    pub fn data_path(&self) -> &'static str {
        self.data.kind()
    }

    /// Whether the replica checks its blocks' checksums (protocol version 3).
    pub fn verifies(&self) -> bool {
        self.data.verifies()
    }

    /// Moves to `to` if the transition is valid; logs it. Returns whether it changed.
    fn transition(&self, volume: &str, to: Mode, why: &str) -> bool {
        let mut m = self.mode.lock().expect("invariant: mode lock");
        if !m.0.can_become(to) {
            return false;
        }
        tracing::warn!(volume, replica = %self.addr, "replica {}: {} -> {} ({why})", self.addr, m.0, to);
        *m = (to, why.to_string());
        if to == Mode::ERR {
            self.data.close();
        }
        true
    }
}

/// The membership last recorded on the replicas.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    pub epoch: Epoch,
    pub members: Vec<ReplicaId>,
}

/// Settings of one volume's engine.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    pub name: String,
    pub size: u64,
    /// A replica that does not answer within this is dropped (ERR).
    pub io_timeout: Duration,
    /// Addresses (host part) considered local for read preference.
    pub local_hosts: Vec<String>,
    /// How the data path reaches the replicas.
    pub data_transport: DataTransport,
    /// Compute the block checksums of every write and send them (the default). Off is for
    /// measuring what checksums cost, with replicas that keep none either.
    pub checksums: bool,
    /// The volume's uuid, from the manager (or `--volume-uuid`). Without one the engine takes
    /// the uuid its replicas record, or makes one at the first start (`start.rs`), so it is
    /// kept with the volume: on its replicas.
    pub volume_uuid: Option<String>,
}

/// A replicated volume. Implements [`BlockDevice`] for the frontends.
pub struct Volume {
    config: VolumeConfig,
    /// The volume's uuid, named in every hello (replica identity, `start.rs`).
    uuid: String,
    size: AtomicU64,
    generation: Generation,
    replicas: RwLock<Vec<Arc<Replica>>>,
    next_id: AtomicU64,
    ranges: RangeLock,
    /// Writes hold it shared; snapshot and membership-changing operations take it exclusive
    /// to quiesce I/O.
    gate: tokio::sync::RwLock<()>,
    membership: tokio::sync::Mutex<Membership>,
    membership_dirty: AtomicBool,
    flush_number: AtomicU64,
    /// Held by the flush under way; flushes that arrive meanwhile wait here and share the
    /// next one (group commit, [`Volume::flush_all`]).
    flush_lock: tokio::sync::Mutex<()>,
    /// Flush requests ever taken: each caller of [`Volume::flush_all`] takes the next ticket
    /// on arrival.
    flush_tickets: AtomicU64,
    /// The highest ticket a completed flush covers: every flush that took a ticket up to
    /// this one arrived before a flush that has since succeeded was sent.
    flush_covered: AtomicU64,
    /// The time of writes and flushes, per step (`pathtime.rs`).
    path: PathCounters,
    rebuild: Mutex<RebuildStatus>,
    /// Serialises control operations (snapshots, rebuilds, expand).
    ops: tokio::sync::Mutex<()>,
    integrity: repair::Counters,
    scrub: scrub::ScrubControl,
}

impl Volume {
    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The volume's uuid, which every replica of it records.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    pub fn io_timeout(&self) -> Duration {
        self.config.io_timeout
    }

    /// Every replica this engine knows, in every mode.
    pub fn replicas(&self) -> Vec<Arc<Replica>> {
        self.replicas
            .read()
            .expect("invariant: replicas lock")
            .clone()
    }

    /// The replicas in one of `modes`. One pass under the lock, one allocation: this runs
    /// for every write.
    fn with_mode(&self, modes: &[Mode]) -> Vec<Arc<Replica>> {
        let all = self.replicas.read().expect("invariant: replicas lock");
        let mut out = Vec::with_capacity(all.len());
        out.extend(all.iter().filter(|r| modes.contains(&r.mode())).cloned());
        out
    }

    pub async fn membership(&self) -> Membership {
        self.membership.lock().await.clone()
    }

    pub fn flush_number(&self) -> FlushNumber {
        FlushNumber(self.flush_number.load(Ordering::Acquire))
    }

    /// The write and flush time counters (`pathtime.rs`), for `Info`.
    pub fn path_totals(&self) -> PathTotals {
        self.path.totals()
    }

    /// How many requests (reads, writes, unmaps, flushes, rebuild copies) the volume has
    /// started: a count that only grows, for telling an idle volume from a busy one.
    pub fn requests_started(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    fn next_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Drops a replica (ERR). If it was RW, the membership must be recorded anew before the
    /// next acknowledgement.
    fn fail(&self, r: &Replica, why: &str) {
        let was_rw = r.mode() == Mode::RW;
        if r.transition(&self.config.name, Mode::ERR, why) && was_rw {
            self.membership_dirty.store(true, Ordering::Release);
        }
    }

    /// Records a new epoch on the RW replicas if one went ERR since the last record. Returns
    /// an error when no RW replica is left.
    pub async fn commit_membership(&self) -> Result<(), BlockError> {
        if !self.membership_dirty.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut m = self.membership.lock().await;
        while self.membership_dirty.swap(false, Ordering::AcqRel) {
            let rw = self.with_mode(&[Mode::RW]);
            if rw.is_empty() {
                return Err(self.faulted());
            }
            let epoch = m.epoch.checked_next().map_err(|e| {
                BlockError::Unavailable(format!("volume {}: {e}", self.config.name))
            })?;
            let members: Vec<ReplicaId> = rw.iter().map(|r| r.id.clone()).collect();
            let results =
                futures::future::join_all(
                    rw.iter().map(|r| {
                        let mut c = r.control();
                        let req = pb::SetEpochRequest {
                            epoch: epoch.0,
                            members: members.iter().map(|m| m.0.clone()).collect(),
                        };
                        async move {
                            tokio::time::timeout(self.config.io_timeout, c.set_epoch(req)).await
                        }
                    }),
                )
                .await;
            for (r, res) in rw.iter().zip(results) {
                match res {
                    Ok(Ok(_)) => {}
                    Ok(Err(s)) => self.fail(r, &format!("recording {epoch}: {}", s.message())),
                    Err(_) => self.fail(r, &format!("recording {epoch}: timeout")),
                }
            }
            // A failure above set the flag again: loop and record without that replica.
            if !self.membership_dirty.load(Ordering::Acquire) {
                let ids: Vec<&str> = members.iter().map(ReplicaId::as_str).collect();
                tracing::info!(volume = %self.config.name, epoch = epoch.0, members = ?ids, "membership recorded");
                *m = Membership { epoch, members };
            }
        }
        Ok(())
    }

    fn faulted(&self) -> BlockError {
        BlockError::Unavailable(format!(
            "volume {} is faulted: no RW replica left",
            self.config.name
        ))
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size && len > 0 => Ok(()),
            _ => Err(BlockError::OutOfRange {
                offset,
                length: len,
                size,
            }),
        }
    }

    /// Sends one mutating request to every RW and WO replica and applies the outcome rules.
    async fn replicate<F>(&self, what: &str, op: F) -> Result<(), BlockError>
    where
        F: Fn(&Replica, RequestId) -> BoxFuture<'static, Result<(), PathError>>,
    {
        let targets = self.with_mode(&[Mode::RW, Mode::WO]);
        if !targets.iter().any(|r| r.mode() == Mode::RW) {
            return Err(self.faulted());
        }
        let id = self.next_id();
        let timeout = self.config.io_timeout;
        let sent = std::time::Instant::now();
        // One replica (the common single-replica volume, or a degraded one): no join and
        // no vector of results to allocate per request.
        let single;
        let joined;
        let results: &mut dyn Iterator<Item = Result<(), PathError>> = if targets.len() == 1 {
            single = timed(&targets[0], op(&targets[0], id), timeout).await;
            &mut std::iter::once(single)
        } else {
            joined =
                futures::future::join_all(targets.iter().map(|r| timed(r, op(r, id), timeout)))
                    .await;
            &mut joined.into_iter()
        };
        let results: Vec<Result<(), PathError>> = results.collect();
        match what {
            "write" => self.path.writes.transport(sent.elapsed()),
            "flush" => self.path.flushes.transport(sent.elapsed()),
            _ => {}
        }
        // A request every replica refuses (out of range, too large, disk full) is the
        // request's failure, not the replicas': none of them changed, none is failed, and the
        // client gets the refusal (ENOSPC for a full disk). Only when some replica took it do
        // the others, which now lack it, go ERR. Not for a flush: after a failed fdatasync
        // the kernel may have dropped the dirty pages, so a later one that succeeds proves
        // nothing, and that replica must be rebuilt.
        if what != "flush"
            && results
                .iter()
                .all(|r| matches!(r, Err(e) if e.is_refusal()))
        {
            let first = results.into_iter().find_map(Result::err);
            return Err(match first {
                Some(PathError::NoSpace(m)) => {
                    BlockError::NoSpace(format!("volume {}: {what}: {m}", self.config.name))
                }
                Some(e) => BlockError::Io(format!("volume {}: {what}: {e}", self.config.name)),
                None => self.faulted(),
            });
        }
        let mut rw_ok = 0;
        let mut last_err = None;
        for (r, res) in targets.iter().zip(results) {
            match res {
                Ok(()) if r.mode() == Mode::RW => rw_ok += 1,
                Ok(()) => {}
                Err(e) => {
                    self.fail(r, &format!("{what}: {e}"));
                    last_err = Some(e);
                }
            }
        }
        self.commit_membership().await?;
        if rw_ok > 0 {
            Ok(())
        } else {
            Err(match last_err {
                Some(PathError::NoSpace(m)) => BlockError::NoSpace(m),
                _ => self.faulted(),
            })
        }
    }

    async fn write_piece(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        let end = offset + data.len() as u64;
        if !offset.is_multiple_of(BLOCK) || !end.is_multiple_of(BLOCK) {
            return self.write_unaligned(offset, data).await;
        }
        let _g = self.gate.read().await;
        let _r = self.ranges.lock(offset..end).await;
        self.write_blocks(offset, data).await
    }

    /// Writes whole blocks with their sums to every RW and WO replica. The caller holds the
    /// gate and the range lock.
    async fn write_blocks(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        // Taken once, where the data comes from; every replica stores the same sums.
        let sums = if self.config.checksums {
            BlockSums::of(&data)
        } else {
            None
        };
        self.replicate("write", |r, id| {
            let (p, data, sums) = (r.data.clone(), data.clone(), sums.clone());
            Box::pin(async move { p.write(id, offset, data, sums).await })
        })
        .await
    }

    /// Read-modify-write of the edge blocks of a write that is not block aligned, under the
    /// range lock of the whole blocks it touches: the edges are read verified (and healed if
    /// a replica's copy fails), so replicas only get whole blocks with their sums, and a bad
    /// edge block is never blessed with a fresh sum.
    async fn write_unaligned(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        let start = offset / BLOCK * BLOCK;
        let end = (offset + data.len() as u64).div_ceil(BLOCK) * BLOCK;
        let _g = self.gate.read().await;
        let _r = self.ranges.lock(start..end).await;
        let mut buf = bytes::BytesMut::zeroed((end - start) as usize);
        let head_partial = offset != start;
        let tail_partial = offset + data.len() as u64 != end;
        let last = end - BLOCK;
        if head_partial {
            buf[..BLOCK as usize].copy_from_slice(&self.read_locked(start, BLOCK).await?);
        }
        // A write inside one block needs that block once.
        if tail_partial && !(head_partial && last == start) {
            let at = (last - start) as usize;
            buf[at..].copy_from_slice(&self.read_locked(last, BLOCK).await?);
        }
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(&data);
        self.write_blocks(start, buf.freeze()).await
    }

    async fn unmap_piece(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let end = offset + len;
        let inner = offset.div_ceil(BLOCK) * BLOCK..end / BLOCK * BLOCK;
        if inner.start >= inner.end {
            return self
                .write_piece(offset, bytes::Bytes::from(vec![0u8; len as usize]))
                .await;
        }
        // Partial blocks at the edges read as zeros by writing zeros over them.
        if offset < inner.start {
            let n = (inner.start - offset) as usize;
            self.write_piece(offset, bytes::Bytes::from(vec![0u8; n]))
                .await?;
        }
        if inner.end < end {
            let n = (end - inner.end) as usize;
            self.write_piece(inner.end, bytes::Bytes::from(vec![0u8; n]))
                .await?;
        }
        let _g = self.gate.read().await;
        let _r = self.ranges.lock(inner.clone()).await;
        let (at, n) = (inner.start, inner.end - inner.start);
        self.replicate("unmap", |r, id| {
            let (p, zero) = (r.data.clone(), r.zero_fill_unmaps.load(Ordering::Acquire));
            Box::pin(async move { p.unmap(id, at, n, zero).await })
        })
        .await
    }

    async fn read_piece(&self, offset: u64, len: u64) -> Result<Bytes, BlockError> {
        loop {
            let Some(r) = self.pick_reader() else {
                return Err(self.faulted());
            };
            r.inflight.fetch_add(1, Ordering::Relaxed);
            let res = tokio::time::timeout(
                self.config.io_timeout,
                r.data.read(self.next_id(), offset, len),
            )
            .await;
            r.inflight.fetch_sub(1, Ordering::Relaxed);
            match res {
                Ok(Ok(data)) => return Ok(data),
                Ok(Err(PathError::Corrupt { blocks, .. })) => {
                    // The replica is fine; some of its blocks are not (repair.rs).
                    self.integrity
                        .corrupt_read(self.name(), &r.addr, offset, &blocks);
                    return self.heal(offset, len).await;
                }
                // A refused read (out of the replica's range) is the request's fault.
                Ok(Err(e)) if e.is_refusal() => {
                    return Err(BlockError::Io(format!("volume {}: read: {e}", self.name())));
                }
                Ok(Err(e)) => self.fail(&r, &format!("read: {e}")),
                Err(_) => self.fail(
                    &r,
                    &format!("read: no answer within {:?}", self.config.io_timeout),
                ),
            }
        }
    }

    /// A local RW replica first, else the RW replica with the fewest requests in flight.
    /// Runs for every read: one pass under the lock, no allocation.
    fn pick_reader(&self) -> Option<Arc<Replica>> {
        let all = self.replicas.read().expect("invariant: replicas lock");
        all.iter()
            .filter(|r| r.mode() == Mode::RW)
            .min_by_key(|r| (!r.local, r.inflight.load(Ordering::Relaxed)))
            .cloned()
    }

    /// Flushes every RW and WO replica under the next flush number: every write acknowledged
    /// before this call is durable on every replica that stays RW when it returns Ok.
    ///
    /// Group commit: one flush runs at a time; the callers that arrive while it runs wait,
    /// and the first of them to get the lock sends one flush for all of them. A caller
    /// whose ticket a completed flush covers returns at once. Why that is enough: a caller's
    /// writes were acknowledged before it took its ticket, and a flush covers every ticket
    /// taken before it was sent (the sender reads the ticket count after taking the lock,
    /// before sending), so those writes had completed on every replica before the flush
    /// reached them. A failed flush covers nobody: each waiter then tries its own.
    pub async fn flush_all(&self) -> Result<(), BlockError> {
        let started = std::time::Instant::now();
        let ticket = self.flush_tickets.fetch_add(1, Ordering::AcqRel) + 1;
        let res = self.flush_group(ticket).await;
        self.path.flushes.device_call(started.elapsed());
        res
    }

    async fn flush_group(&self, ticket: u64) -> Result<(), BlockError> {
        let f = self.flush_lock.lock().await;
        if self.flush_covered.load(Ordering::Acquire) >= ticket {
            self.path.flush_shared();
            return Ok(());
        }
        self.send_flush(&f, "flush", |r, id, number| {
            let p = r.data.clone();
            Box::pin(async move { p.flush(id, number).await.map(|_| ()) })
        })
        .await
    }

    /// Sends `op` to every replica as one flush with the next flush number, under the flush
    /// lock (`_held`), and records what it covers: every ticket taken up to here was taken
    /// before the flush is sent.
    async fn send_flush<F>(
        &self,
        _held: &tokio::sync::MutexGuard<'_, ()>,
        what: &str,
        op: F,
    ) -> Result<(), BlockError>
    where
        F: Fn(&Replica, RequestId, FlushNumber) -> BoxFuture<'static, Result<(), PathError>>,
    {
        let covers = self.flush_tickets.load(Ordering::Acquire);
        let number = self
            .flush_number()
            .checked_next()
            .map_err(|e| BlockError::Io(format!("volume {}: {e}", self.config.name)))?;
        self.replicate(what, |r, id| op(r, id, number)).await?;
        self.flush_number.store(number.0, Ordering::Release);
        self.flush_covered.fetch_max(covers, Ordering::AcqRel);
        Ok(())
    }

    /// Writes whole blocks (one piece) and flushes, in one request per replica (protocol
    /// version 4; a replica of an older build gets the write, then the flush). The write
    /// takes the gate and its range as any write does; the flush then takes the flush lock
    /// and a number as [`Volume::flush_group`] does, and covers what any flush sent at that
    /// moment covers: every write acknowledged before it (each had completed on every
    /// replica), this one with them. So callers whose flush tickets were taken before it
    /// are covered too.
    async fn write_flush_piece(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        let end = offset + data.len() as u64;
        let _g = self.gate.read().await;
        let _r = self.ranges.lock(offset..end).await;
        let sums = if self.config.checksums {
            BlockSums::of(&data)
        } else {
            None
        };
        let f = self.flush_lock.lock().await;
        self.send_flush(&f, "write+flush", |r, id, number| {
            let (p, data, sums) = (r.data.clone(), data.clone(), sums.clone());
            let then = self.next_id();
            Box::pin(async move {
                if p.flushes_writes() {
                    p.write_flush(id, offset, data, sums, number).await?;
                } else {
                    p.write(id, offset, data, sums).await?;
                    p.flush(then, number).await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// Adds a connected replica in `mode`.
    fn add_replica(&self, r: Arc<Replica>) {
        tracing::info!(volume = %self.config.name, replica = %r.addr, mode = %r.mode(), "replica added");
        self.replicas
            .write()
            .expect("invariant: replicas lock")
            .push(r);
    }

    /// Forgets a replica (it must not be RW, or the volume must keep another RW one).
    pub async fn remove_replica(&self, addr: &str) -> Result<(), VolumeError> {
        let _ops = self.ops.lock().await;
        let _g = self.gate.write().await;
        let r = self
            .replicas()
            .into_iter()
            .find(|r| r.addr == addr)
            .ok_or_else(|| VolumeError::NotMember {
                volume: self.config.name.clone(),
                replica: addr.to_string(),
            })?;
        if r.mode() == Mode::RW && self.with_mode(&[Mode::RW]).len() == 1 {
            return Err(VolumeError::LastRw {
                volume: self.config.name.clone(),
                replica: addr.to_string(),
            });
        }
        self.fail(&r, "removed by request");
        self.replicas
            .write()
            .expect("invariant: replicas lock")
            .retain(|x| x.addr != addr);
        Ok(self.commit_membership().await?)
    }

    /// Makes `target` hold what `source` holds in `start..start+len`: compares CRC32C of every
    /// 4 KiB block and copies only the runs that differ. Returns the bytes copied. The caller
    /// keeps writes out of the range (range lock, or no I/O yet).
    async fn copy_differing(
        &self,
        source: &Replica,
        target: &Replica,
        start: u64,
        len: u64,
    ) -> Result<u64, VolumeError> {
        /// Checksums are asked for this much at a time.
        const PIECE: u64 = 16 << 20;
        let mut copied = 0;
        let mut at = start;
        while at < start + len {
            let n = PIECE.min(start + len - at);
            let want = self.block_sums(source, at, n).await?;
            let have = self.block_sums(target, at, n).await?;
            if want.len() != have.len() {
                return Err(VolumeError::SumsDiffer {
                    volume: self.config.name.clone(),
                    source_replica: source.addr.clone(),
                    target: target.addr.clone(),
                    offset: at,
                    length: n,
                });
            }
            let mut i = 0;
            while i < want.len() {
                if want[i] == have[i] {
                    i += 1;
                    continue;
                }
                let first = i;
                while i < want.len()
                    && want[i] != have[i]
                    && ((i - first) as u64) < MAX_PIECE / BLOCK
                {
                    i += 1;
                }
                let (off, len) = (at + first as u64 * BLOCK, (i - first) as u64 * BLOCK);
                let data = self
                    .read_source(source, target, off, len, &want[first..i])
                    .await?;
                // The source's stored sums travel with its data, so a block that failed its
                // checksum there stays detectably bad on the target.
                let sums = BlockSums::from_crcs(want[first..i].iter().copied());
                target
                    .data
                    .write(self.next_id(), off, data, Some(sums))
                    .await
                    .map_err(|e| self.path_error(target, e))?;
                copied += len;
            }
            at += n;
        }
        Ok(copied)
    }

    pub fn rebuild_status(&self) -> RebuildStatus {
        self.rebuild
            .lock()
            .expect("invariant: rebuild lock")
            .clone()
    }
}

/// `offset..offset+len` cut at multiples of [`MAX_PIECE`], so that a piece widened to whole
/// blocks (read-modify-write, healing) still fits in one replica request.
fn pieces(offset: u64, len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity((len / MAX_PIECE + 2) as usize);
    let mut at = offset;
    while at < offset + len {
        let next = (at / MAX_PIECE + 1) * MAX_PIECE;
        let n = next.min(offset + len) - at;
        out.push((at, n));
        at += n;
    }
    out
}

/// One replica's part of a replicated request, counted in its in-flight requests and
/// bounded by the I/O timeout.
async fn timed(
    r: &Replica,
    fut: BoxFuture<'static, Result<(), PathError>>,
    timeout: Duration,
) -> Result<(), PathError> {
    r.inflight.fetch_add(1, Ordering::Relaxed);
    let res = tokio::time::timeout(timeout, fut).await;
    r.inflight.fetch_sub(1, Ordering::Relaxed);
    res.unwrap_or(Err(PathError::Timeout(timeout)))
}

/// The byte ranges that may have been written on any of `replicas` after flush `since`,
/// merged and clipped to `size`. Each replica reports regions of its own region size (they
/// may differ between replicas created by different versions).
async fn written_ranges(
    volume: &str,
    replicas: &[&Replica],
    since: FlushNumber,
    size: u64,
) -> Result<Vec<std::ops::Range<u64>>, VolumeError> {
    let mut all = Vec::new();
    for r in replicas {
        let resp = r
            .control()
            .written_since(pb::WrittenSinceRequest { flush: since.0 })
            .await
            .map_err(|s| rpc_error(volume, r, "WrittenSince", &s))?
            .into_inner();
        let rs = resp.region_size.max(4096);
        all.extend(
            resp.regions
                .iter()
                .map(|&g| (g * rs).min(size)..((g + 1) * rs).min(size)),
        );
    }
    all.retain(|r| !r.is_empty());
    all.sort_by_key(|r| r.start);
    let mut merged: Vec<std::ops::Range<u64>> = Vec::new();
    for r in all {
        match merged.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    Ok(merged)
}

/// A failed control RPC to `r` as a [`VolumeError`].
fn rpc_error(volume: &str, r: &Replica, call: &'static str, s: &tonic::Status) -> VolumeError {
    VolumeError::Rpc {
        volume: volume.to_string(),
        replica: r.addr.clone(),
        call,
        message: s.message().to_string(),
    }
}

impl Volume {
    /// CRC32C of every 4 KiB block of a range on one replica.
    async fn block_sums(
        &self,
        r: &Replica,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u32>, VolumeError> {
        let resp = r
            .control()
            .checksums(pb::ChecksumsRequest {
                offset,
                length: len,
                block_size: 4096,
            })
            .await
            .map_err(|s| rpc_error(self.name(), r, "Checksums", &s))?
            .into_inner();
        Ok(resp.crc32c)
    }

    /// A failed data-path request to `r` as a [`VolumeError`].
    fn path_error(&self, r: &Replica, source: PathError) -> VolumeError {
        VolumeError::Path {
            volume: self.config.name.clone(),
            replica: r.addr.clone(),
            source: Box::new(source),
        }
    }
}

impl BlockDevice for Volume {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            self.check_range(offset, len)?;
            let pieces = pieces(offset, len);
            if let [(at, n)] = pieces.as_slice() {
                return self.read_piece(*at, *n).await;
            }
            let mut out = bytes::BytesMut::with_capacity(len as usize);
            for (at, n) in pieces {
                out.extend_from_slice(&self.read_piece(at, n).await?);
            }
            Ok(out.freeze())
        })
    }

    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.check_range(offset, data.len() as u64)?;
            let started = std::time::Instant::now();
            let res = self.write_pieces(offset, data).await;
            self.path.writes.device_call(started.elapsed());
            res
        })
    }

    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.check_range(offset, len)?;
            // Unmap carries no payload; one request per replica whatever its size.
            self.unmap_piece(offset, len).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(self.flush_all())
    }

    /// A write of whole blocks within one piece goes to each replica with its flush in one
    /// request ([`Volume::write_flush_piece`]); any other is written, then flushed.
    fn write_fua(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            let len = data.len() as u64;
            self.check_range(offset, len)?;
            let started = std::time::Instant::now();
            let whole = offset.is_multiple_of(BLOCK) && len.is_multiple_of(BLOCK);
            let res = if whole && len > 0 && pieces(offset, len).len() == 1 {
                self.write_flush_piece(offset, data).await
            } else {
                match self.write_pieces(offset, data).await {
                    Ok(()) => self.flush_all().await,
                    Err(e) => Err(e),
                }
            };
            self.path.writes.device_call(started.elapsed());
            res
        })
    }

    fn path_counters(&self) -> Option<&PathCounters> {
        Some(&self.path)
    }
}

impl Volume {
    async fn write_pieces(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        let pieces = pieces(offset, data.len() as u64);
        if pieces.len() == 1 {
            return self.write_piece(offset, data).await;
        }
        for (at, n) in pieces {
            let from = (at - offset) as usize;
            self.write_piece(at, data.slice(from..from + n as usize))
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod piece_tests {
    use super::*;

    #[test]
    fn pieces_are_cut_at_multiples_of_the_piece_size() {
        assert_eq!(pieces(0, 4096), vec![(0, 4096)]);
        assert_eq!(
            pieces(100, MAX_PIECE),
            vec![(100, MAX_PIECE - 100), (MAX_PIECE, 100)]
        );
        let p = pieces(MAX_PIECE - 1, 2 * MAX_PIECE + 2);
        assert_eq!(p.len(), 4);
        assert_eq!(p.iter().map(|(_, n)| n).sum::<u64>(), 2 * MAX_PIECE + 2);
        for (at, n) in p {
            // Widened to whole blocks, every piece stays within one window.
            let start = at / BLOCK * BLOCK;
            let end = (at + n).div_ceil(BLOCK) * BLOCK;
            assert!(end - start <= MAX_PIECE, "{at}+{n}");
        }
    }
}
