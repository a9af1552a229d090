//! Per-block checksums: one checksum file per layer file, and the rules that keep it
//! consistent with the data across crashes.
//!
//! # Layout
//!
//! ```text
//! layer-<id>.sum   beside layer-<id>.img: the CRC32C of block b (4 KiB) of the layer as a
//!                  little-endian u32 at byte 4·b. Sparse, like the layer: 4 bytes per
//!                  4 KiB of data (1 GiB per TiB written), nothing for holes.
//! clean-close      exists only between a clean close and the next open (see below)
//! ```
//!
//! A slot means something only where its layer holds data: a hole reads as zeros and is
//! never checked (its slot may hold anything, e.g. the sum of data later punched out). The
//! file is always buffered (small, hot, read in 4-byte pieces), whatever the layer's cache
//! mode. Only the sums of head writes since the last write-back are held in memory (below,
//! "Staged sums"; at most [`STAGE_LIMIT`] pages of 4 KiB, 16 MiB); the rest is read through
//! the kernel's page cache, so a 1 TiB volume costs no RSS for its sums.
//!
//! # Staged sums
//!
//! A head write (a write, unmap zeroing, a repair) does not write its sums into the file:
//! it *stages* them, in memory, by page of the file ([`SumFile::stage`]), after its data
//! write has completed. Staged sums reach the file (the page cache) in a write-back
//! ([`SumFile::write_back`]): at every flush before its fdatasync, before every direct write
//! into the same file ([`SumFile::write`]: merges into the head, settling, the background
//! computation of sums), at snapshot create and close (both flush the head), and in the
//! background once more than [`STAGE_LIMIT`] pages are staged. Why: a 4 KiB write used to
//! cost a second `pwrite` (4 bytes into the checksum file, under that file's inode lock, on
//! the request's thread) beside its data; measured through the engine over NBD on three
//! replicas, that was most of what checksums cost a 4 KiB random write (benches/README.md,
//! `integrity-bench.sh`). A write-back writes each page's staged slots in at most
//! `MAX_RUNS` pieces, or reads, patches and rewrites the page's span: one or two calls per
//! page of 1024 blocks instead of one per write.
//!
//! Reads see staged sums before the file's: a reader takes the staged sums of its range
//! first and reads the file after, and a write-back keeps the pages it is writing visible
//! (`Staged::writing`) until they are in the file. So a sum moves from memory to the file
//! without ever being missed by a reader; a reader can only see a sum *older* than the data
//! when a write to the same block runs at the same time, which the read's second look with
//! the exclusive gate rules out (no head write, so nothing is staged, while it is held). All
//! writes into the file go through one lock (`SumFile::writer`), and a direct write first
//! writes back what is staged, so an older sum never lands over a newer one. A write-back
//! that fails leaves its sums staged: the flush that needs them fails (so the engine fails
//! the replica), never a flush without them.
//!
//! Sums enter in one of three ways: with a write from the engine (frames SUMS, taken where
//! the data comes from, so a payload damaged on the way fails its sum on the next read); from
//! the replica's own computation (unaligned read-modify-write, zeroing, writes without sums);
//! or copied with the data (merges copy the source layer's stored sums, rebuilds carry them
//! across, so a block that was bad stays detectably bad instead of being blessed).
//!
//! # Commit points, and what open() finds after a crash
//!
//! The sums of a block and its data are two writes to two files, and the data may go through
//! io_uring (`O_DIRECT`) while the sum is a buffered `pwrite`; no order between them survives
//! every crash. So consistency comes from the flush and the region record instead:
//!
//! - Head writes (writes, unmap zeroing, repairs): the data is written, then its sums are
//!   staged (above), both under the write's region ticket (`regions.rs`), so the region is
//!   durably marked dirty *before* the data changes, and it stays dirty on disk until a
//!   flush numbered at least its mark has completed. A flush starts only once every write
//!   tagged with its number has completed (so their sums are staged), writes back the staged
//!   sums and fdatasyncs the head; the checksum file's fdatasync follows within 50 ms, and
//!   only then is the flush number recorded in the region record (`sumsync.rs`): every flush
//!   *recorded* has its data and sums on disk together, and a flush not yet recorded leaves
//!   its regions dirty on disk, so a power cut before its sums are durable is settled. So after any crash, a head block whose sum may disagree with its data lies in
//!   a region marked dirty (written since the last durable flush). What a crash leaves there:
//!   after kill -9, the data of every completed write (the page cache survives the process)
//!   and the file's older sum for each block written since the last write-back; after a power
//!   cut, any mix of old and new data and sums.
//! - open() after an unclean stop ("settling"): for every dirty region, every data block of
//!   the head is read and checked against its sum; where they differ, the sum is taken from
//!   the data (the block was being written at the crash: it holds the old data, the new, or
//!   after a power cut a torn mix, all of which an unflushed write may leave), the block is
//!   counted as *adopted*, and the sums are fdatasync'ed before the replica serves. Adopted
//!   blocks are reported by `Checksums`, so reconcile takes such a block from a replica that
//!   did not have to adopt it. The cost: reading the head's data in regions written within
//!   the region record's look-ahead before the crash; none after a clean close. Staging
//!   changes which blocks are adopted (after kill -9, every block written since the last
//!   write-back rather than only the writes in flight), not which can be: the same dirty
//!   regions are settled, and a block outside them is checked as before.
//! - A clean close fdatasyncs the head and its sums, then creates `clean-close` (fsync'ed
//!   with its directory): open() then knows every sum matches and skips settling. open()
//!   removes the marker (and fsyncs the directory) before it serves anything, so a crash after
//!   that is settled next time.
//! - Snapshot create fdatasyncs the old head's data and sums before the metadata commit
//!   that freezes it: a snapshot's sums are durable from the moment it exists.
//! - Copies into a layer (merge of a deleted snapshot, rebuild) write each block's sum before
//!   its data. A kill -9 between the two leaves a sum over a hole (never checked); the layer
//!   is fdatasync'ed, data and sums, before the metadata commit that makes it matter. A power
//!   cut before that commit may leave a copied block with data but no sum, or torn: it fails
//!   its checksum and is repaired from another replica, except where user writes made the
//!   same head region dirty, where settling adopts it (the one case a torn copy goes
//!   unnoticed; it was unnoticed before checksums existed too).
//! - Replicas made before checksums (format 1) get a checksum file per layer at their first
//!   open and every layer is marked unverified in `replica.json`; a background pass computes
//!   the sums (the head under the exclusive gate, chunk by chunk) and marks each layer
//!   verified once its sums are durable. Reads from an unverified layer are not checked;
//!   writes keep their sums current throughout.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use zebu_proto::sums::BlockSums;

use super::meta::LayerId;
use crate::io::DataFile;

/// The marker of a clean close (see the module docs).
pub const CLEAN_CLOSE: &str = "clean-close";

/// Sums per page of the checksum file (4 KiB of slots: the sums of 4 MiB of data).
const SLOTS: usize = 1024;
/// Staged pages beyond which a write-back starts in the background (module docs: "Staged
/// sums"): 16 MiB of memory at most, nearly all of the time far less.
pub const STAGE_LIMIT: usize = 4096;
/// Runs of staged slots in one page up to which a write-back writes each run on its own;
/// above it, the page's span is read, patched and written whole (two calls, not many).
const MAX_RUNS: usize = 4;

pub fn sum_path(dir: &Path, id: LayerId) -> PathBuf {
    dir.join(format!("layer-{:06}.sum", id.0))
}

/// The layer id in a checksum file's name, if it is one.
pub fn id_from_sum_name(name: &str) -> Option<LayerId> {
    let digits = name.strip_prefix("layer-")?.strip_suffix(".sum")?;
    digits.parse().ok().map(LayerId)
}

/// Staged sums of one page of the checksum file: the slots set, and their values.
#[derive(Clone)]
struct StagedPage {
    sums: [u32; SLOTS],
    set: [u64; SLOTS / 64],
}

impl StagedPage {
    fn new() -> Box<StagedPage> {
        Box::new(StagedPage {
            sums: [0; SLOTS],
            set: [0; SLOTS / 64],
        })
    }

    fn put(&mut self, slot: usize, sum: u32) {
        self.sums[slot] = sum;
        self.set[slot / 64] |= 1 << (slot % 64);
    }

    fn get(&self, slot: usize) -> Option<u32> {
        (self.set[slot / 64] & (1 << (slot % 64)) != 0).then_some(self.sums[slot])
    }

    /// The runs of set slots, ascending.
    fn runs(&self) -> Vec<std::ops::Range<usize>> {
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        for slot in 0..SLOTS {
            if self.get(slot).is_none() {
                continue;
            }
            match out.last_mut() {
                Some(r) if r.end == slot => r.end += 1,
                _ => out.push(slot..slot + 1),
            }
        }
        out
    }

    fn bytes(&self, slots: std::ops::Range<usize>) -> Vec<u8> {
        self.sums[slots]
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect()
    }
}

/// Page index → staged page.
type Pages = BTreeMap<u64, Box<StagedPage>>;

/// The sums of head writes not yet in the file (module docs: "Staged sums").
#[derive(Default)]
struct Staged {
    /// Staged since the last write-back began: the newest.
    pages: Pages,
    /// Taken by the write-back under way, until it has written them to the file.
    writing: Pages,
}

/// One layer's checksum file.
pub struct SumFile {
    /// Buffered; a `DataFile` so the I/O back end can fdatasync it like a layer.
    file: Arc<DataFile>,
    staged: Mutex<Staged>,
    /// Pages in `staged` (both maps), set under its lock whenever they change: a reader that
    /// finds 0 skips the lock, so reads of a layer with nothing staged (every snapshot, and
    /// the head after a flush) never touch it. A reader that must see a staged sum started
    /// after the write that staged it returned, so it sees this count raised too.
    staged_count: AtomicUsize,
    /// Held by every write into the file (write-backs and direct writes), so that an older
    /// sum never lands over a newer one.
    writer: Mutex<()>,
    /// A background write-back has been asked for and has not finished.
    background: AtomicBool,
    /// [`STAGE_LIMIT`], lower in tests.
    limit: usize,
}

impl std::fmt::Debug for SumFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SumFile")
            .field("file", &self.file)
            .field("staged_pages", &self.staged_pages())
            .finish()
    }
}

impl SumFile {
    /// Opens (or creates, empty) the checksum file at `path`.
    pub fn open(path: &Path, create: bool) -> std::io::Result<SumFile> {
        Ok(SumFile {
            file: Arc::new(DataFile::open_buffered(path, create)?),
            staged: Mutex::new(Staged::default()),
            staged_count: AtomicUsize::new(0),
            writer: Mutex::new(()),
            background: AtomicBool::new(false),
            limit: STAGE_LIMIT,
        })
    }

    /// The same with a lower write-back threshold (tests).
    #[cfg(test)]
    pub fn with_limit(mut self, limit: usize) -> SumFile {
        self.limit = limit;
        self
    }

    /// The file, for `IoEngine::sync` (after [`SumFile::write_back`]) and for `stat`.
    pub fn data_file(&self) -> &Arc<DataFile> {
        &self.file
    }

    fn raw(&self) -> &File {
        self.file.file()
    }

    fn staged(&self) -> MutexGuard<'_, Staged> {
        self.staged
            .lock()
            .expect("invariant: staged sums lock not poisoned")
    }

    /// Sets `staged_count` from `s` (whose lock the caller holds) and returns it.
    fn recount(&self, s: &Staged) -> usize {
        let n = s.pages.len() + s.writing.len();
        self.staged_count.store(n, Ordering::Release);
        n
    }

    /// Pages of sums staged and not yet written to the file.
    pub fn staged_pages(&self) -> usize {
        self.staged_count.load(Ordering::Acquire)
    }

    /// The staged sums of blocks `first..first+count`, as (index from `first`, sum): the
    /// newest for each block. Taken *before* the file is read (see "Staged sums" for why
    /// that order).
    fn overlay(&self, first: u64, count: usize) -> Vec<(usize, u32)> {
        if self.staged_count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let s = self.staged();
        if s.pages.is_empty() && s.writing.is_empty() {
            return Vec::new();
        }
        let end = first + count as u64;
        let mut out = Vec::new();
        let (p0, p1) = (first / SLOTS as u64, (end - 1) / SLOTS as u64);
        for map in [&s.writing, &s.pages] {
            for (&p, page) in map.range(p0..=p1) {
                let base = p * SLOTS as u64;
                let lo = first.max(base);
                let hi = end.min(base + SLOTS as u64);
                for b in lo..hi {
                    if let Some(v) = page.get((b - base) as usize) {
                        out.push(((b - first) as usize, v));
                    }
                }
            }
        }
        out
    }

    fn apply(buf: &mut [u8], overlay: &[(usize, u32)]) {
        // `writing` entries come first and `pages` (newer) after, so the last one wins.
        for &(i, v) in overlay {
            buf[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The stored sums of `count` blocks from block `first`, if every byte the file must
    /// supply is in the page cache (`RWF_NOWAIT`: never waits for the disk); `None`
    /// otherwise. Staged sums take precedence over the file; slots past the end of the file
    /// read as zero.
    pub fn read_cached(&self, first: u64, count: usize) -> Option<BlockSums> {
        if count == 0 {
            return Some(BlockSums::default());
        }
        let overlay = self.overlay(first, count);
        let mut buf = vec![0u8; count * 4];
        if overlay.len() < count {
            let at = libc::off_t::try_from(first.checked_mul(4)?).ok()?;
            if !self.pread_nowait(&mut buf, at)? {
                return None;
            }
        }
        Self::apply(&mut buf, &overlay);
        BlockSums::from_wire(Bytes::from(buf))
    }

    /// One `preadv2(RWF_NOWAIT)` of `buf` at `at`: `Some(true)` when it is all there (or
    /// past the end of the file: zeros), `Some(false)` when part of it is not cached.
    fn pread_nowait(&self, buf: &mut [u8], at: libc::off_t) -> Option<bool> {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        loop {
            // SAFETY: `iov` points at `buf`, which we own mutably for the whole call; the
            // descriptor is owned by `self.file`, alive for the call.
            let n = unsafe { libc::preadv2(self.raw().as_raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
            if n >= 0 {
                let n = usize::try_from(n).ok()?;
                if n == buf.len() {
                    return Some(true);
                }
                // Short: past the end of the file (zeros), or only partly cached.
                let len = super::fsops::size_links(self.raw()).ok()?.len;
                return Some(at.cast_unsigned().saturating_add(n as u64) >= len);
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return None;
            }
        }
    }

    /// [`SumFile::read_cached`] that may wait for the disk (run it off the async threads).
    pub fn read_blocking(&self, first: u64, count: usize) -> std::io::Result<BlockSums> {
        let overlay = self.overlay(first, count);
        let mut buf = vec![0u8; count * 4];
        if overlay.len() < count {
            self.pread_all(&mut buf, first * 4)?;
        }
        Self::apply(&mut buf, &overlay);
        Ok(BlockSums::from_wire(Bytes::from(buf)).expect("invariant: a multiple of 4 bytes"))
    }

    /// Reads `buf.len()` bytes at `at`; past the end of the file the rest stays zero.
    fn pread_all(&self, buf: &mut [u8], at: u64) -> std::io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.raw().read_at(&mut buf[done..], at + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Keeps `sums` for the blocks from `first` on in memory, to reach the file at the next
    /// write-back (a flush, or the background one once more than [`STAGE_LIMIT`] pages are
    /// staged). Only for head writes made under a region ticket: what a crash loses of them
    /// is settled at open (module docs). `true`: the caller should start a background
    /// write-back ([`SumFile::write_back`], then [`SumFile::background_done`]).
    #[must_use]
    pub fn stage(&self, first: u64, sums: &BlockSums) -> bool {
        let mut s = self.staged();
        let (end, mut it) = (first + sums.len() as u64, sums.iter());
        let mut b = first;
        while b < end {
            let p = b / SLOTS as u64;
            let page_end = ((p + 1) * SLOTS as u64).min(end);
            let pg = s.pages.entry(p).or_insert_with(StagedPage::new);
            for blk in b..page_end {
                pg.put(
                    (blk % SLOTS as u64) as usize,
                    it.next().expect("invariant: one sum per block"),
                );
            }
            b = page_end;
        }
        let over = self.recount(&s) > self.limit;
        drop(s);
        over && !self.background.swap(true, Ordering::AcqRel)
    }

    /// A background write-back has been asked for and has not finished.
    pub fn background_running(&self) -> bool {
        self.background.load(Ordering::Acquire)
    }

    /// A background write-back asked for by [`SumFile::stage`] has finished.
    pub fn background_done(&self) {
        self.background.store(false, Ordering::Release);
    }

    /// Writes every staged sum into the file (the page cache; not synced). Returns the pages
    /// written. On failure the sums stay staged (a later write-back, and so the next flush,
    /// tries again, and fails the flush if it fails again).
    pub fn write_back(&self) -> std::io::Result<usize> {
        let _w = self
            .writer
            .lock()
            .expect("invariant: sum writer lock not poisoned");
        self.write_back_locked()
    }

    fn write_back_locked(&self) -> std::io::Result<usize> {
        let pages = {
            let mut s = self.staged();
            if s.pages.is_empty() {
                return Ok(0);
            }
            let taken = std::mem::take(&mut s.pages);
            s.writing = taken;
            // Cloned out so that readers keep seeing them in `writing` until they are in
            // the file (the writer lock keeps `writing` ours meanwhile).
            s.writing
                .iter()
                .map(|(&p, pg)| (p, pg.clone()))
                .collect::<Vec<_>>()
        };
        let n = pages.len();
        let res = pages.iter().try_for_each(|(p, pg)| self.write_page(*p, pg));
        let mut s = self.staged();
        let written = std::mem::take(&mut s.writing);
        if res.is_ok() {
            self.recount(&s);
        } else {
            // Back to staged, under anything staged since (newer).
            for (p, pg) in written {
                match s.pages.get_mut(&p) {
                    None => {
                        s.pages.insert(p, pg);
                    }
                    Some(newer) => {
                        for slot in 0..SLOTS {
                            if newer.get(slot).is_none()
                                && let Some(v) = pg.get(slot)
                            {
                                newer.put(slot, v);
                            }
                        }
                    }
                }
            }
            self.recount(&s);
        }
        res.map(|()| n)
    }

    /// Writes the set slots of one staged page: each run on its own when there are few,
    /// else the span from the first to the last, read and patched first.
    fn write_page(&self, p: u64, pg: &StagedPage) -> std::io::Result<()> {
        let base = p * (SLOTS as u64) * 4;
        let runs = pg.runs();
        if runs.len() <= MAX_RUNS {
            for r in runs {
                self.raw()
                    .write_all_at(&pg.bytes(r.clone()), base + r.start as u64 * 4)?;
            }
            return Ok(());
        }
        let span = runs[0].start..runs[runs.len() - 1].end;
        let mut buf = vec![0u8; span.len() * 4];
        self.pread_all(&mut buf, base + span.start as u64 * 4)?;
        for r in runs {
            let at = (r.start - span.start) * 4;
            buf[at..at + r.len() * 4].copy_from_slice(&pg.bytes(r));
        }
        self.raw().write_all_at(&buf, base + span.start as u64 * 4)
    }

    /// Stores `sums` for the blocks from `first` on in the file now: one buffered `pwrite`,
    /// done inline (a copy into the page cache). Staged sums are written back first, so none
    /// of them can later land over these.
    pub fn write(&self, first: u64, sums: &BlockSums) -> std::io::Result<()> {
        let _w = self
            .writer
            .lock()
            .expect("invariant: sum writer lock not poisoned");
        self.write_back_locked()?;
        self.raw().write_all_at(sums.as_bytes(), first * 4)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Everything the file holds, as sums (zeros past its end).
    fn file_sums(f: &SumFile, blocks: u64) -> Vec<u32> {
        let mut buf = vec![0u8; blocks as usize * 4];
        f.pread_all(&mut buf, 0).expect("read file");
        buf.chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Stage(u64, Vec<u32>),
        Write(u64, Vec<u32>),
        WriteBack,
    }

    /// Blocks over three pages and a bit, so runs cross page edges and pages fill.
    const BLOCKS: u64 = 3 * SLOTS as u64 + 100;

    fn op() -> impl Strategy<Value = Op> {
        let run = (0..BLOCKS).prop_flat_map(|first| {
            let most = (BLOCKS - first).min(2 * SLOTS as u64) as usize;
            (Just(first), prop::collection::vec(any::<u32>(), 1..=most))
        });
        prop_oneof![
            6 => run.clone().prop_map(|(f, v)| Op::Stage(f, v)),
            1 => run.prop_map(|(f, v)| Op::Write(f, v)),
            1 => Just(Op::WriteBack),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None,
            ..ProptestConfig::default() })]

        /// Against a map of the newest sum of each block: reads (cached and blocking) always
        /// give the newest, staged or not, and after a write-back the file alone does.
        #[test]
        fn staged_and_written_sums_read_back_as_the_newest(ops in prop::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let f = SumFile::open(&dir.path().join("t.sum"), true).expect("open").with_limit(2);
            let mut model: HashMap<u64, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Stage(first, v) => {
                        let s = BlockSums::from_crcs(v.iter().copied());
                        if f.stage(first, &s) {
                            // What a background write-back would do, done here.
                            f.write_back().expect("write back");
                            f.background_done();
                        }
                        for (i, x) in v.into_iter().enumerate() {
                            model.insert(first + i as u64, x);
                        }
                    }
                    Op::Write(first, v) => {
                        f.write(first, &BlockSums::from_crcs(v.iter().copied())).expect("write");
                        for (i, x) in v.into_iter().enumerate() {
                            model.insert(first + i as u64, x);
                        }
                    }
                    Op::WriteBack => {
                        f.write_back().expect("write back");
                        prop_assert_eq!(f.staged_pages(), 0);
                        let want: Vec<u32> =
                            (0..BLOCKS).map(|b| model.get(&b).copied().unwrap_or(0)).collect();
                        prop_assert_eq!(file_sums(&f, BLOCKS), want);
                    }
                }
                let want: Vec<u32> =
                    (0..BLOCKS).map(|b| model.get(&b).copied().unwrap_or(0)).collect();
                prop_assert_eq!(f.read_blocking(0, BLOCKS as usize).expect("read").to_vec(), want.clone());
                if let Some(got) = f.read_cached(0, BLOCKS as usize) {
                    prop_assert_eq!(got.to_vec(), want.clone());
                }
                // A range that starts and ends inside pages.
                prop_assert_eq!(
                    f.read_blocking(1000, 1100).expect("read").to_vec(),
                    want[1000..2100].to_vec()
                );
            }
        }
    }

    #[test]
    fn staging_asks_for_a_background_write_back_once_over_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = SumFile::open(&dir.path().join("t.sum"), true)
            .expect("open")
            .with_limit(2);
        let one = BlockSums::from_crcs([7]);
        assert!(!f.stage(0, &one));
        assert!(!f.stage(SLOTS as u64, &one));
        assert_eq!(file_sums(&f, 1), vec![0], "staged, not in the file");
        assert!(
            f.stage(2 * SLOTS as u64, &one),
            "a third page: over the limit"
        );
        assert!(
            !f.stage(3 * SLOTS as u64, &one),
            "asked for once until it is done"
        );
        assert!(f.background_running());
        assert_eq!(f.write_back().expect("write back"), 4);
        f.background_done();
        assert_eq!(f.staged_pages(), 0);
        assert_eq!(file_sums(&f, 3 * SLOTS as u64 + 1)[3 * SLOTS], 7);
    }
}
