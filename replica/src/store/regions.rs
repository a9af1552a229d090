//! Per-region flush bookkeeping: what the engine compares to reconcile replicas cheaply.
//!
//! The volume is cut into regions (16 MiB by default, larger for volumes over 16 TiB so
//! there are at most 2^20). A region is the unit of the write-ahead mark (below), so its size
//! trades the cost of marking (one fdatasync for the first write to a region in a look-ahead
//! window) against what the engine must compare after a crash; the engine compares regions
//! block by block and copies only blocks that differ, so large regions cost reads, not copies. For each region the replica keeps `last_flush[r]`: the number of the
//! flush that covers the latest write to it. With `flushed` the number of the last completed
//! flush, region `r` is *dirty* (written since the last flush, so possibly different on
//! another replica) exactly when `last_flush[r] > flushed`, and "regions written since flush
//! F" are those with `last_flush[r] > F`: what a replica that stopped at flush F may lack.
//!
//! # File layout (`regions.dat`, little-endian)
//!
//! ```text
//! page 0, page 1   header slots: magic "ZEBUREGN", version u32, seq u64, flushed u64,
//!                  region_size u64, region_count u64, crc32c u32 over the fields before it
//! page 2 ..        last_flush[r] as u64, 512 regions per 4 KiB page
//! ```
//!
//! # Commit points
//!
//! - Write-ahead: before a write tagged with flush number `t` is issued to the layer file,
//!   `last_flush[r] >= t` must be on disk for every region it touches. If it is not, the
//!   page holding `last_flush[r]` is set to `t + LOOKAHEAD`, written and fdatasync'ed first.
//!   So a region whose data may have changed on disk is always marked dirty on disk, whatever
//!   the crash. Writes that need a page persisted at the same moment share one fdatasync
//!   (group commit); writes to regions already marked cost nothing.
//! - The look-ahead: marking a region `ahead` flushes ahead means a database that writes
//!   the same regions and flushes after every commit pays one extra fdatasync per `ahead`
//!   flushes instead of one per flush. The price is that a region counts as dirty (to be
//!   reconciled after a crash) for up to `ahead` flushes after its last write: more regions
//!   to compare, never a missed one. `ahead` follows the flush rate: about as many flushes as
//!   the replica saw in the last second ([`AHEAD_WINDOW`], measured over each
//!   [`RATE_WINDOW`]), never fewer than [`LOOKAHEAD`]
//!   nor more than [`MAX_LOOKAHEAD`]. So the bound is in time: a region counts as dirty for
//!   about a second of flushes after its last write, whether flushes come every 30 s (a
//!   filesystem: 16 flushes) or after every 4 KiB write (a database at QD 1: ~1,000). A
//!   fixed 16 made random commits over more than 16 regions (a 1 GiB volume has 64) pay a
//!   mark fdatasync on most writes: the region came back after its mark had run out.
//! - Renewal: when a write must commit a page of marks anyway, the other regions on that page
//!   whose marks are still live (at or above the write's tag: written within the look-ahead)
//!   are marked as far ahead as the new mark, in the same commit. Without it, a database
//!   writing randomly over a few dozen regions paid one commit per region per look-ahead
//!   window, each in a write's path (measured: ~14 % of QD 1 writes, ~750 µs each, on release
//!   binaries); with it, one commit renews them all. It only makes regions that were written
//!   recently count as dirty a window longer: more to compare after a crash, never less.
//! - Flush: after every write tagged with a flush number ≤ F has completed and the layer
//!   files *and their checksum files* were fdatasync'ed, the header slot with the lower `seq`
//!   is overwritten with `flushed = F`. A flush whose layer data is durable but whose
//!   checksums are synced later (`sumsync.rs`) counts in memory at once
//!   ([`Regions::note_flush`]) and reaches the header only after its checksums are durable,
//!   so after a power cut the regions it covered are still dirty on disk and their sums are
//!   settled from their data at open (`sums.rs`). It is not fdatasync'ed on its own: the flush number on disk may only
//!   ever be *lower* than the truth (it is written after the data is durable), and a lower
//!   one only makes more regions count as dirty and a catch-up compare more. So a flush costs
//!   the layer files' fdatasync and nothing more; the next mark's fdatasync of this file
//!   carries the header along. `open` takes the valid slot with the higher `seq`, so a torn
//!   header write leaves the previous flush number, which is conservative too.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::{ReplicaError, Result};
use crate::pathtime::{PathTimes, Step};

const MAGIC: &[u8; 8] = b"ZEBUREGN";
const VERSION: u32 = 1;
const PAGE: u64 = 4096;
const PER_PAGE: u64 = PAGE / 8;
const HEADER_PAGES: u64 = 2;
/// How many flushes ahead a region is marked at least (see the module comment).
pub const LOOKAHEAD: u64 = 16;
/// How many flushes ahead a region is marked at most.
pub const MAX_LOOKAHEAD: u64 = 4096;
/// The look-ahead is the number of flushes seen in about this long.
pub const AHEAD_WINDOW: Duration = Duration::from_secs(1);
/// The flush rate is measured over windows this long (and scaled to [`AHEAD_WINDOW`]), so
/// a database that starts flushing gets a look-ahead that fits within a tenth of a second
/// instead of paying a mark on most writes for its first second (measured: ~400 mark
/// commits in the first second of a QD 1 run on 32 regions).
pub const RATE_WINDOW: Duration = Duration::from_millis(100);
/// Default region size.
pub const DEFAULT_REGION_SIZE: u64 = 16 << 20;
/// Regions are enlarged so that no volume has more than this many.
pub const MAX_REGIONS: u64 = 1 << 20;

/// The region size for a new volume of `size` bytes.
pub fn region_size_for(size: u64) -> u64 {
    let mut rs = DEFAULT_REGION_SIZE;
    while size.div_ceil(rs) > MAX_REGIONS {
        rs *= 2;
    }
    rs
}

struct State {
    last_flush: Vec<u64>,
    flushed: u64,
    /// The flush number new writes are tagged with.
    pending: u64,
    /// Writes in flight per tag.
    in_flight: BTreeMap<u64, usize>,
    /// Pages changed in memory but not yet persisted.
    unpersisted: BTreeSet<u64>,
    /// Pages a commit has taken from `unpersisted` and not yet fdatasync'ed. A write to a
    /// region on one of these pages (or on an unpersisted one) finds its mark in memory but
    /// not yet on disk, so it waits for the commit like the write that set the mark.
    persisting: BTreeSet<u64>,
    header_seq: u64,
    /// The flush number last written to the header (`flushed` may be ahead of it: see
    /// [`Regions::note_flush`]).
    recorded: u64,
    /// How many flushes ahead new marks go (see the module comment).
    ahead: u64,
    /// Flushes started since `window_start` (to measure the flush rate).
    window_flushes: u64,
    window_start: Instant,
}

impl State {
    /// Counts a flush and, once per [`RATE_WINDOW`], sets the look-ahead from the flush rate.
    fn count_flush(&mut self, now: Instant) {
        self.window_flushes += 1;
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= RATE_WINDOW {
            // Flushes per AHEAD_WINDOW over the window just ended (a long idle spell gives a
            // low rate, so the first marks after it are short-sighted, as they should be).
            let rate = (u128::from(self.window_flushes) * AHEAD_WINDOW.as_micros()
                / elapsed.as_micros().max(1)) as u64;
            self.ahead = rate.clamp(LOOKAHEAD, MAX_LOOKAHEAD);
            self.window_flushes = 0;
            self.window_start = now;
        }
    }
}

/// The region record of one replica. Shared; all methods take `&self`.
pub struct Regions {
    file: File,
    region_size: u64,
    state: Mutex<State>,
    /// Serialises page persistence (group commit) and header writes.
    committer: tokio::sync::Mutex<()>,
    drained: Notify,
}

/// Held while a write or unmap is in flight; tells a flush when it may proceed.
pub struct WriteTicket<'a> {
    regions: &'a Regions,
    tag: u64,
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        let mut st = self.regions.lock();
        if let Some(n) = st.in_flight.get_mut(&self.tag) {
            *n -= 1;
            if *n == 0 {
                st.in_flight.remove(&self.tag);
                self.regions.drained.notify_waiters();
            }
        }
    }
}

fn header_bytes(seq: u64, flushed: u64, region_size: u64, region_count: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(PAGE as usize);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&flushed.to_le_bytes());
    b.extend_from_slice(&region_size.to_le_bytes());
    b.extend_from_slice(&region_count.to_le_bytes());
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b.resize(PAGE as usize, 0);
    b
}

/// (seq, flushed, region_size, region_count) of a valid header slot.
fn parse_header(b: &[u8]) -> Option<(u64, u64, u64, u64)> {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    if b.len() < 48 || &b[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(b[44..48].try_into().expect("4 bytes"));
    if crc != crc32c::crc32c(&b[..44])
        || u32::from_le_bytes(b[8..12].try_into().expect("4")) != VERSION
    {
        return None;
    }
    Some((u64_at(12), u64_at(20), u64_at(28), u64_at(36)))
}

impl Regions {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("invariant: regions lock not poisoned")
    }

    /// Creates a fresh record (everything clean, flush number 0) at `path`.
    pub fn create(path: &Path, size: u64, region_size: u64) -> Result<Regions> {
        let ctx = |e| ReplicaError::io(format!("create {}", path.display()), e);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(ctx)?;
        let count = size.div_ceil(region_size);
        file.set_len((HEADER_PAGES + count.div_ceil(PER_PAGE)) * PAGE)
            .map_err(ctx)?;
        file.write_all_at(&header_bytes(1, 0, region_size, count), 0)
            .map_err(ctx)?;
        file.sync_all().map_err(ctx)?;
        Ok(Regions::from_parts(
            file,
            region_size,
            vec![0; count as usize],
            0,
            1,
        ))
    }

    /// Opens the record; regions for a volume grown to `size` are added (clean).
    pub fn open(path: &Path, size: u64, region_size: u64) -> Result<Regions> {
        let ctx = |e| ReplicaError::io(format!("open {}", path.display()), e);
        let corrupt = |why: &str| ReplicaError::Corrupt {
            path: path.to_owned(),
            why: why.into(),
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(ctx)?;
        // A file cut short (empty after a crash of the filesystem, or damaged) is named as
        // such, not as a read that "failed to fill whole buffer" (issue 18).
        let len = file.metadata().map_err(ctx)?.len();
        if len < HEADER_PAGES * PAGE {
            return Err(corrupt(&format!(
                "{len} bytes, shorter than its {}-byte header",
                HEADER_PAGES * PAGE
            )));
        }
        let mut hdr = vec![0u8; (HEADER_PAGES * PAGE) as usize];
        file.read_exact_at(&mut hdr, 0).map_err(ctx)?;
        let slots = [
            parse_header(&hdr[..PAGE as usize]),
            parse_header(&hdr[PAGE as usize..]),
        ];
        let (seq, flushed, rs, _) = slots
            .into_iter()
            .flatten()
            .max_by_key(|s| s.0)
            .ok_or_else(|| corrupt("no valid header slot"))?;
        if rs != region_size {
            return Err(corrupt("region size differs from replica.json"));
        }
        let count = size.div_ceil(region_size);
        let want_len = (HEADER_PAGES + count.div_ceil(PER_PAGE)) * PAGE;
        let len = file.metadata().map_err(ctx)?.len();
        if len < want_len {
            // Grown volume (or an expand interrupted by a crash): new regions are clean.
            file.set_len(want_len).map_err(ctx)?;
        }
        let mut raw = vec![0u8; (count.div_ceil(PER_PAGE) * PAGE) as usize];
        file.read_exact_at(&mut raw, HEADER_PAGES * PAGE)
            .map_err(ctx)?;
        let last_flush = raw
            .chunks_exact(8)
            .take(count as usize)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        Ok(Regions::from_parts(
            file,
            region_size,
            last_flush,
            flushed,
            seq,
        ))
    }

    fn from_parts(
        file: File,
        region_size: u64,
        last_flush: Vec<u64>,
        flushed: u64,
        seq: u64,
    ) -> Regions {
        Regions {
            file,
            region_size,
            state: Mutex::new(State {
                last_flush,
                flushed,
                pending: flushed + 1,
                in_flight: BTreeMap::new(),
                unpersisted: BTreeSet::new(),
                persisting: BTreeSet::new(),
                header_seq: seq,
                recorded: flushed,
                ahead: LOOKAHEAD,
                window_flushes: 0,
                window_start: Instant::now(),
            }),
            committer: tokio::sync::Mutex::new(()),
            drained: Notify::new(),
        }
    }

    pub fn region_size(&self) -> u64 {
        self.region_size
    }

    pub fn region_count(&self) -> u64 {
        self.lock().last_flush.len() as u64
    }

    /// The number of the last completed flush.
    pub fn flushed(&self) -> u64 {
        self.lock().flushed
    }

    /// The flush number last written to the header (at most [`Regions::flushed`]).
    pub fn recorded(&self) -> u64 {
        self.lock().recorded
    }

    /// Regions that may have been written since the last flush (a superset: see the
    /// look-ahead in the module comment).
    pub fn dirty(&self) -> Vec<u64> {
        self.written_since(self.flushed())
    }

    /// Regions that may have been written after flush `flush` completed (a superset).
    pub fn written_since(&self, flush: u64) -> Vec<u64> {
        let st = self.lock();
        (0..st.last_flush.len() as u64)
            .filter(|&r| st.last_flush[r as usize] > flush)
            .collect()
    }

    /// Registers a write or unmap of the byte range `bytes` and returns once the regions it
    /// touches are durably marked dirty. Keep the ticket until the data write has completed.
    /// A commit of marks this write had to make counts in `times` (`MarkCommit`).
    pub async fn begin_write(
        &self,
        bytes: Range<u64>,
        times: &PathTimes,
    ) -> Result<WriteTicket<'_>> {
        let need_commit = {
            let mut st = self.lock();
            let tag = st.pending;
            *st.in_flight.entry(tag).or_insert(0) += 1;
            let first = bytes.start / self.region_size;
            let last = (bytes.end.max(bytes.start + 1) - 1) / self.region_size;
            let mut need = false;
            let mark = tag + st.ahead;
            let mut renew = Vec::new();
            for r in first..=last.min(st.last_flush.len() as u64 - 1) {
                let page = r / PER_PAGE;
                if st.last_flush[r as usize] < tag {
                    st.last_flush[r as usize] = mark;
                    if st.unpersisted.insert(page) {
                        renew.push(page);
                    }
                    need = true;
                } else if st.unpersisted.contains(&page) || st.persisting.contains(&page) {
                    // Marked in memory by another write whose commit has not completed: the
                    // mark is not durable yet, so this write waits for it too.
                    need = true;
                }
            }
            // The page is written anyway: renew the marks of the other regions on it that
            // are still live (written within the look-ahead), so they do not each cost a
            // commit of their own when they run out (see "Renewal" in the module comment).
            let count = st.last_flush.len();
            for page in renew {
                let start = (page * PER_PAGE) as usize;
                for v in &mut st.last_flush[start..(start + PER_PAGE as usize).min(count)] {
                    if *v >= tag && *v < mark {
                        *v = mark;
                    }
                }
            }
            (tag, need)
        };
        let ticket = WriteTicket {
            regions: self,
            tag: need_commit.0,
        };
        if need_commit.1 {
            self.persist_pages(times).await?;
        }
        Ok(ticket)
    }

    /// Writes every unpersisted page and fdatasyncs once (group commit). A writer that
    /// finds nothing left to write waited for the committer lock behind the commit that took
    /// its pages, which has completed: its mark is durable (or, had that commit failed, its
    /// pages would be back in `unpersisted` and written here).
    async fn persist_pages(&self, times: &PathTimes) -> Result<()> {
        let _guard = self.committer.lock().await;
        let started = Instant::now();
        let pages: Vec<(u64, Vec<u8>)> = {
            let mut st = self.lock();
            let pages = std::mem::take(&mut st.unpersisted);
            st.persisting.extend(pages.iter().copied());
            pages
                .into_iter()
                .map(|p| {
                    let start = (p * PER_PAGE) as usize;
                    let end = (start + PER_PAGE as usize).min(st.last_flush.len());
                    let mut b: Vec<u8> = st.last_flush[start..end]
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    b.resize(PAGE as usize, 0);
                    (p, b)
                })
                .collect()
        };
        if pages.is_empty() {
            return Ok(()); // another writer's commit covered ours
        }
        let taken: Vec<u64> = pages.iter().map(|(p, _)| *p).collect();
        let res = match self.file.try_clone() {
            Err(e) => Err(ReplicaError::io("dup regions.dat", e)),
            Ok(file) => tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                for (p, b) in &pages {
                    file.write_all_at(b, (HEADER_PAGES + p) * PAGE)?;
                }
                file.sync_data()
            })
            .await
            .map_err(|e| ReplicaError::io("regions commit task", std::io::Error::other(e)))
            .and_then(|r| r.map_err(|e| ReplicaError::io("persist regions.dat", e))),
        };
        times.since(Step::MarkCommit, started);
        let mut st = self.lock();
        for p in &taken {
            st.persisting.remove(p);
        }
        if res.is_err() {
            // Not durable: the next write to these regions must try again.
            st.unpersisted.extend(taken);
        }
        res
    }

    /// Starts flush `number` (0: the next number): new writes get the following tag. Returns
    /// the number once every write tagged with it (or lower) has completed. The caller then
    /// makes the layer files durable and calls [`Regions::complete_flush`].
    pub async fn start_flush(&self, number: u64) -> Result<u64> {
        let number = {
            let mut st = self.lock();
            let number = if number == 0 {
                st.pending.max(st.flushed + 1)
            } else {
                number
            };
            if number <= st.flushed {
                return Err(ReplicaError::Invalid(format!(
                    "flush number {number} is not above the durable flush number {}",
                    st.flushed
                )));
            }
            // Bounded, so `number + 1` below cannot wrap and an accepted number always has a
            // successor (`numbers.rs` in proto).
            super::identity::check_flush_number(st.flushed.max(st.pending), number)?;
            // A region written under a tag above `number` stays dirty after this flush.
            st.pending = st.pending.max(number + 1);
            st.count_flush(Instant::now());
            number
        };
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lock().in_flight.range(..=number).next().is_none() {
                return Ok(number);
            }
            notified.await;
        }
    }

    /// Takes flush `number` as complete in memory (regions last written before it are clean
    /// from now on) without recording it in the header: for a flush whose layer data is
    /// durable but whose checksums are not yet (`sumsync.rs`), which records it later with
    /// [`Regions::complete_flush`].
    pub fn note_flush(&self, number: u64) {
        let mut st = self.lock();
        st.flushed = st.flushed.max(number);
    }

    /// Records flush `number` as durable (after the layer files and their checksum files
    /// were fdatasync'ed): in memory and in the header.
    pub async fn complete_flush(&self, number: u64) -> Result<()> {
        let _guard = self.committer.lock().await;
        let (seq, count) = {
            let st = self.lock();
            if number <= st.recorded {
                return Ok(()); // a concurrent flush with a higher number won
            }
            (st.header_seq + 1, st.last_flush.len() as u64)
        };
        let slot = seq % 2;
        let bytes = header_bytes(seq, number, self.region_size, count);
        // Written, not synced: a header that lags the truth after a power cut only makes more
        // regions count as dirty (see "Commit points"). The next fdatasync of this file (a
        // region mark, or a later flush's) makes it durable too. A 4 KiB write into the page
        // cache does not block for long, so it runs inline.
        self.file
            .write_all_at(&bytes, slot * PAGE)
            .map_err(|e| ReplicaError::io("write regions.dat header", e))?;
        let mut st = self.lock();
        st.header_seq = seq;
        st.recorded = number;
        st.flushed = st.flushed.max(number);
        Ok(())
    }

    /// Marks every region dirty (after a revert, which changes everything) and persists.
    pub async fn mark_all_dirty(&self, times: &PathTimes) -> Result<()> {
        {
            let mut st = self.lock();
            let tag = st.pending;
            let n = st.last_flush.len() as u64;
            st.last_flush.iter_mut().for_each(|v| *v = (*v).max(tag));
            st.unpersisted.extend(0..n.div_ceil(PER_PAGE));
        }
        self.persist_pages(times).await
    }

    /// Grows the record for a volume of `size` bytes (new regions are clean).
    pub fn grow(&self, size: u64) -> Result<()> {
        let count = size.div_ceil(self.region_size);
        let mut st = self.lock();
        if count as usize > st.last_flush.len() {
            self.file
                .set_len((HEADER_PAGES + count.div_ceil(PER_PAGE)) * PAGE)
                .and_then(|_| self.file.sync_all())
                .map_err(|e| ReplicaError::io("grow regions.dat", e))?;
            st.last_flush.resize(count as usize, 0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dirty_regions_survive_reopen_and_clear_on_flush() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let size = 64 << 20;
        let r = Regions::create(&path, size, MIB).expect("create");
        {
            let _t = r
                .begin_write(3 << 20..(3 << 20) + 4096, &T)
                .await
                .expect("write");
            let _u = r
                .begin_write((10 << 20) - 10..(10 << 20) + 10, &T)
                .await
                .expect("write");
        }
        assert_eq!(r.dirty(), vec![3, 9, 10]);
        drop(r);
        // As after a crash: the marks were persisted before the data writes.
        let r = Regions::open(&path, size, MIB).expect("open");
        assert_eq!(r.dirty(), vec![3, 9, 10]);
        let n = r.start_flush(0).await.expect("flush");
        assert_eq!(n, 1);
        r.complete_flush(n).await.expect("complete");
        // Marked LOOKAHEAD flushes ahead: still possibly dirty until flush 1 + LOOKAHEAD.
        assert_eq!(r.dirty(), vec![3, 9, 10]);
        for _ in 0..LOOKAHEAD {
            let n = r.start_flush(0).await.expect("flush");
            r.complete_flush(n).await.expect("complete");
        }
        assert!(r.dirty().is_empty());
        assert_eq!(r.written_since(0), vec![3, 9, 10]);
        assert!(r.written_since(1 + LOOKAHEAD).is_empty());
        drop(r);
        let r = Regions::open(&path, size, MIB).expect("reopen");
        assert_eq!(r.flushed(), 1 + LOOKAHEAD);
        assert!(r.dirty().is_empty());
        assert_eq!(r.written_since(0), vec![3, 9, 10]);
    }

    #[tokio::test]
    async fn flush_waits_for_writes_in_flight() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = Regions::create(&dir.path().join(REGIONS), 8 << 20, MIB).expect("create");
        let ticket = r.begin_write(0..4096, &T).await.expect("write");
        let flush = r.start_flush(0);
        tokio::pin!(flush);
        assert!(futures::poll!(flush.as_mut()).is_pending());
        // A write started after the flush began is tagged for the next flush: not waited for.
        let later = r.begin_write(4096..8192, &T).await.expect("write");
        assert!(futures::poll!(flush.as_mut()).is_pending());
        drop(ticket);
        let n = flush.await.expect("flush");
        r.complete_flush(n).await.expect("complete");
        assert_eq!(r.dirty(), vec![0], "the later write keeps region 0 dirty");
        drop(later);
    }

    /// Two writes to one unmarked region: the second finds the mark the first set in memory,
    /// and must still wait until the first one's commit has made it durable (it used to
    /// return at once and could write its data before the mark was on disk).
    #[tokio::test]
    async fn a_write_waits_for_a_mark_another_write_is_still_persisting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let r = Regions::create(&path, 8 << 20, MIB).expect("create");
        let first = r.begin_write(0..4096, &T);
        tokio::pin!(first);
        // Polled once: the mark is set in memory and its commit is under way.
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(r.lock().last_flush[0] >= 1, "the mark is set in memory");
        let second = r.begin_write(4096..8192, &T);
        tokio::pin!(second);
        assert!(
            futures::poll!(second.as_mut()).is_pending(),
            "the second write returned before the mark it relies on was durable"
        );
        let a = first.await.expect("first");
        let b = second.await.expect("second");
        // Both returned only once the mark was on disk: a reopen (as after a crash) sees it.
        let again = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(again.dirty(), vec![0]);
        drop((a, b));
        // A third write to the marked, persisted region costs nothing.
        let third = r.begin_write(8192..12288, &T);
        tokio::pin!(third);
        assert!(futures::poll!(third.as_mut()).is_ready());
    }

    #[tokio::test]
    async fn marks_are_persisted_once_per_lookahead_window() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let r = Regions::create(&path, 8 << 20, MIB).expect("create");
        for _ in 0..LOOKAHEAD - 1 {
            drop(r.begin_write(0..4096, &T).await.expect("write"));
            let n = r.start_flush(0).await.expect("flush");
            r.complete_flush(n).await.expect("complete");
        }
        // The first write's mark (1 + LOOKAHEAD) still covers the write now in flight.
        let ticket = r.begin_write(0..4096, &T).await.expect("write");
        assert!(r.lock().unpersisted.is_empty());
        assert_eq!(r.lock().last_flush[0], 1 + LOOKAHEAD);
        drop(ticket);
        // Crash now: the mark on disk still covers the last write.
        drop(r);
        let r = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(r.dirty(), vec![0]);
    }

    #[tokio::test]
    async fn marks_reach_as_far_ahead_as_a_second_of_flushes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let r = Regions::create(&path, 8 << 20, MIB).expect("create");
        let flush = || async {
            let n = r.start_flush(0).await.expect("flush");
            r.complete_flush(n).await.expect("complete");
        };
        // As if 999 flushes came in the last second: the next one ends the window.
        {
            let mut st = r.lock();
            st.window_flushes = 999;
            st.window_start -= AHEAD_WINDOW;
        }
        flush().await;
        let ahead = r.lock().ahead;
        assert!((900..=1000).contains(&ahead), "look-ahead {ahead}");
        // A database at QD 1: write, flush, over and over. One mark covers them all.
        drop(r.begin_write(0..4096, &T).await.expect("write"));
        let mark = r.lock().last_flush[0];
        assert_eq!(mark, 2 + ahead);
        for _ in 0..ahead - 1 {
            flush().await;
            drop(r.begin_write(0..4096, &T).await.expect("write"));
            assert!(r.lock().unpersisted.is_empty(), "no mark fdatasync");
        }
        assert_eq!(r.lock().last_flush[0], mark);
        // Crash: the mark on disk covers the last write.
        drop(r);
        let r = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(r.dirty(), vec![0]);
        assert_eq!(
            r.lock().ahead,
            LOOKAHEAD,
            "a reopened record starts short-sighted"
        );
        // A slow flusher (one flush in 100 s) gets the minimum back.
        {
            let mut st = r.lock();
            st.ahead = MAX_LOOKAHEAD;
            st.window_start -= 100 * AHEAD_WINDOW;
        }
        let n = r.start_flush(0).await.expect("flush");
        r.complete_flush(n).await.expect("complete");
        assert_eq!(r.lock().ahead, LOOKAHEAD);
    }

    /// A commit a write has to make anyway renews the live marks on the same page, so the
    /// other regions a database keeps writing do not each pay a commit when theirs run out.
    #[tokio::test]
    async fn a_mark_commit_renews_the_live_marks_on_its_page() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let r = Regions::create(&path, 8 << 20, MIB).expect("create");
        let flush = || async {
            let n = r.start_flush(0).await.expect("flush");
            r.complete_flush(n).await.expect("complete");
        };
        drop(r.begin_write(0..4096, &T).await.expect("write region 0"));
        let first = r.lock().last_flush[0];
        for _ in 0..LOOKAHEAD / 2 {
            flush().await;
        }
        // Region 1 is new: its commit renews region 0 (still live) to the same mark.
        drop(
            r.begin_write(MIB..MIB + 4096, &T)
                .await
                .expect("write region 1"),
        );
        let (m0, m1, m2) = {
            let st = r.lock();
            (st.last_flush[0], st.last_flush[1], st.last_flush[2])
        };
        assert_eq!(m0, m1, "region 0 renewed along with region 1");
        assert!(m0 > first);
        assert_eq!(m2, 0, "a region never written stays clean");
        // On disk too: after a crash region 0 is dirty as long as the renewed mark says.
        drop(r);
        let r = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(r.lock().last_flush[0], m0);
        assert_eq!(r.dirty(), vec![0, 1]);
    }

    /// A flush noted in memory only (its checksums not durable yet) leaves the header where
    /// it was: after a crash its regions still count as dirty.
    #[tokio::test]
    async fn a_noted_flush_reaches_the_header_only_when_completed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(REGIONS);
        let r = Regions::create(&path, 8 << 20, MIB).expect("create");
        drop(r.begin_write(0..4096, &T).await.expect("write"));
        let n = r.start_flush(0).await.expect("flush");
        r.note_flush(n);
        assert_eq!((r.flushed(), r.recorded()), (n, 0));
        let again = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(
            again.flushed(),
            0,
            "the header does not have the noted flush"
        );
        assert_eq!(again.dirty(), vec![0]);
        r.complete_flush(n).await.expect("record");
        assert_eq!(r.recorded(), n);
        let again = Regions::open(&path, 8 << 20, MIB).expect("open");
        assert_eq!(again.flushed(), n);
    }

    #[test]
    fn big_volumes_get_bigger_regions() {
        assert_eq!(region_size_for(1 << 40), 16 << 20);
        assert_eq!(region_size_for(64 << 40), 64 << 20);
    }

    const REGIONS: &str = "regions.dat";
    /// Counters nobody reads.
    static T: PathTimes = PathTimes::new();
    /// The tests reason in 1 MiB regions.
    const MIB: u64 = 1 << 20;
}
