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
//! mode. Nothing about the sums is held in memory: reads and writes go through the kernel's
//! page cache, so a 1 TiB volume costs no RSS for them.
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
//! - Head writes (writes, unmap zeroing, repairs): the data is written, then its sum, both
//!   under the write's region ticket (`regions.rs`), so the region is durably marked dirty
//!   *before* either changes. (Either order would do, since every head write left half done
//!   is settled at open, below; data first means an `O_DIRECT` write that the kernel
//!   completes after a kill -9 is the common half-done case, rather than a rare window
//!   between two buffered writes. Unmap zeroing writes the sums of zeros first.) A flush fdatasyncs the head and its checksum file (in
//!   parallel) before it records the flush number: everything written before a completed
//!   flush has its data and sum on disk together. So after any crash, a head block whose sum
//!   may disagree with its data lies in a region marked dirty (written since the last
//!   durable flush).
//! - open() after an unclean stop ("settling"): for every dirty region, every data block of
//!   the head is read and checked against its sum; where they differ, the sum is taken from
//!   the data (the block was being written at the crash: it holds the old data, the new, or
//!   after a power cut a torn mix, all of which an unflushed write may leave), the block is
//!   counted as *adopted*, and the sums are fdatasync'ed before the replica serves. Adopted
//!   blocks are reported by `Checksums`, so reconcile takes such a block from a replica that
//!   did not have to adopt it. The cost: reading the head's data in regions written within
//!   the region record's look-ahead before the crash; none after a clean close.
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

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use zebu_proto::sums::BlockSums;

use super::meta::LayerId;
use crate::io::DataFile;

/// The marker of a clean close (see the module docs).
pub const CLEAN_CLOSE: &str = "clean-close";

pub fn sum_path(dir: &Path, id: LayerId) -> PathBuf {
    dir.join(format!("layer-{:06}.sum", id.0))
}

/// The layer id in a checksum file's name, if it is one.
pub fn id_from_sum_name(name: &str) -> Option<LayerId> {
    let digits = name.strip_prefix("layer-")?.strip_suffix(".sum")?;
    digits.parse().ok().map(LayerId)
}

/// One layer's checksum file.
#[derive(Debug)]
pub struct SumFile {
    /// Buffered; a `DataFile` so the I/O back end can fdatasync it like a layer.
    file: Arc<DataFile>,
}

impl SumFile {
    /// Opens (or creates, empty) the checksum file at `path`.
    pub fn open(path: &Path, create: bool) -> std::io::Result<SumFile> {
        Ok(SumFile {
            file: Arc::new(DataFile::open_buffered(path, create)?),
        })
    }

    /// The file, for `IoEngine::sync`.
    pub fn data_file(&self) -> &Arc<DataFile> {
        &self.file
    }

    fn raw(&self) -> &File {
        self.file.file()
    }

    /// The stored sums of `count` blocks from block `first`, if every byte is in the page
    /// cache (`RWF_NOWAIT`: never waits for the disk); `None` otherwise. Slots past the end
    /// of the file read as zero.
    pub fn read_cached(&self, first: u64, count: usize) -> Option<BlockSums> {
        let mut buf = vec![0u8; count * 4];
        let at = libc::off_t::try_from(first.checked_mul(4)?).ok()?;
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
                    return BlockSums::from_wire(Bytes::from(buf));
                }
                // Short: past the end of the file (zeros), or only partly cached.
                let len = self.raw().metadata().ok()?.len();
                if at.cast_unsigned().saturating_add(n as u64) >= len {
                    return BlockSums::from_wire(Bytes::from(buf));
                }
                return None;
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return None;
            }
        }
    }

    /// [`SumFile::read_cached`] that may wait for the disk (run it off the async threads).
    pub fn read_blocking(&self, first: u64, count: usize) -> std::io::Result<BlockSums> {
        let mut buf = vec![0u8; count * 4];
        let mut done = 0;
        while done < buf.len() {
            match self
                .raw()
                .read_at(&mut buf[done..], first * 4 + done as u64)
            {
                Ok(0) => break, // end of file: the rest stays zero
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(BlockSums::from_wire(Bytes::from(buf)).expect("invariant: a multiple of 4 bytes"))
    }

    /// Stores `sums` for the blocks from `first` on: one buffered `pwrite`, done inline (a
    /// copy into the page cache, like a page-cache layer write).
    pub fn write(&self, first: u64, sums: &BlockSums) -> std::io::Result<()> {
        self.raw().write_all_at(sums.as_bytes(), first * 4)
    }
}
