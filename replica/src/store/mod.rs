//! The on-disk replica: a live head file plus a chain of read-only snapshot files.
//!
//! # Data model
//!
//! Every layer (the head and each snapshot) is a sparse file the size of the volume. A read
//! of a block returns the newest layer in the head's chain that holds data for it, or zeros.
//! Writes go to the head. A snapshot freezes the head and opens a new empty head whose parent
//! it is. Layers form a tree (a revert starts a new branch); only the head's chain is read.
//!
//! # In memory
//!
//! Two extent maps, in 4 KiB blocks, built from `SEEK_DATA`/`SEEK_HOLE` at open:
//! - `head_extents`: the blocks the head holds (updated by every write and unmap);
//! - `below`: for every block some snapshot in the chain holds, the newest such snapshot
//!   (changes only with snapshot operations and rebuild writes).
//!
//! A read consults `head_extents`, then `below`. Memory grows with the number of separately
//! written ranges, not with the volume size.
//!
//! # Unmap over snapshot data
//!
//! Unmap punches holes in the head. Where `below` says an older snapshot still holds data,
//! a hole would let that data show through, so zeros are written to the head there instead:
//! the range then reads as zeros from the head, and stays so across reopen (a written zero
//! block is data to `SEEK_DATA`). This costs space only where snapshots hold data.
//!
//! # Concurrency
//!
//! I/O holds the shared side of `gate` while it runs; operations that change the structure
//! (snapshot create, revert, expand, merge chunks into the head, close) take the exclusive
//! side, so they see no write half done. Control operations are serialised by `ops`. The
//! extent maps sit behind a short-held `RwLock` never held across an await.
//!
//! # Checksums
//!
//! Every data block of every layer has a CRC32C in the layer's checksum file (`sums.rs`:
//! layout, commit points, what open does after a crash). Reads check every block they return
//! from a layer against it and report the blocks that fail ([`Replica::read_verified`]);
//! `integrity.rs` has the rest: settling after a crash, computing the sums of a replica made
//! before checksums, scrubbing, and the stored sums that catch-up and rebuilds compare and
//! carry.
//!
//! # Crash safety
//!
//! See `meta.rs` (the commit point of every structural change), `regions.rs` (the
//! write-ahead dirty-region record and the flush number) and `sums.rs` (checksums).

mod extent;
mod fsops;
mod health;
mod identity;
mod integrity;
mod meta;
mod regions;
mod snapshot;
mod sums;
mod sumsync;

#[cfg(test)]
mod integrity_tests;
#[cfg(test)]
mod tests;

pub use extent::ExtentMap;
pub use integrity::{BadBlock, LayerData, ScrubReport};
pub use meta::LayerId;
pub use sumsync::SUMS_SYNC_INTERVAL;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use bytes::Bytes;
use zebu_proto::sums::BlockSums;

use crate::error::{ReplicaError, Result};
use crate::io::{AlignedBuf, CacheMode, DataFile, IoEngine};
use crate::pathtime::Step;
use meta::{LayerMeta, META_FILE, META_TMP, Meta, REGIONS_FILE, layer_path};
use regions::Regions;
use sums::{CLEAN_CLOSE, SumFile, id_from_sum_name, sum_path};

/// Block size of the data path; I/O not aligned to it is read-modify-write.
pub const BLOCK_SIZE: u64 = 4096;
/// The largest single read, write or unmap-with-zeroing chunk accepted.
pub const MAX_IO: u64 = 32 << 20;
/// Merges, unmaps and rebuild copies move data in chunks of at most this size, so I/O that
/// waits behind one waits for one chunk only.
const CHUNK: u64 = 1 << 20;
/// Staged checksum pages up to which a flush writes them back inline (`Replica::sync_sums`).
const INLINE_WRITE_BACK: usize = 16;

/// One layer as [`Replica::info`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    pub id: u64,
    /// Snapshot name; empty for the head.
    pub name: String,
    /// Parent layer id, 0 for none.
    pub parent: u64,
    pub head: bool,
    pub user_created: bool,
    pub data_bytes: u64,
    /// RFC 3339.
    pub created: String,
    pub labels: BTreeMap<String, String>,
    pub size: u64,
    /// A rebuild is still writing it.
    pub incomplete: bool,
    /// Written by a rebuild.
    pub rebuilt: bool,
}

/// A snapshot of a replica's state for `Info`.
#[derive(Debug, Clone)]
pub struct ReplicaInfo {
    pub replica_id: String,
    pub volume_uuid: Option<String>,
    pub size: u64,
    pub generation: u64,
    pub epoch: u64,
    pub epoch_members: Vec<String>,
    pub flush_number: u64,
    /// The head's chain from the oldest layer to the head, then layers off the chain.
    pub layers: Vec<LayerInfo>,
    pub region_size: u64,
    pub region_count: u64,
    /// Regions written since the last flush.
    pub dirty_regions: Vec<u64>,
    /// Data bytes in layers whose checksums are not computed yet.
    pub unverified_bytes: u64,
    /// Blocks whose checksum was taken from their data when settling after a crash.
    pub adopted_blocks: u64,
    /// Blocks found failing their checksum since open.
    pub corrupt_found: u64,
}

/// What a read returns: the data, and the blocks of it that failed their checksum.
#[derive(Debug, Clone)]
pub struct ReadOutcome {
    pub data: Bytes,
    /// Indices of the 4 KiB blocks (counted from the block holding the read's first byte)
    /// whose data does not match its stored checksum, ascending.
    pub corrupt: Vec<u32>,
}

/// One resolved piece of a read: the layer it comes from, and its checksums when they are
/// to be trusted (`None`: the layer is unverified).
#[derive(Clone)]
struct Piece {
    id: LayerId,
    file: Arc<DataFile>,
    sums: Option<Arc<SumFile>>,
}

/// How a layer written by a rebuild ([`Replica::write_layer`]) is described.
#[derive(Debug, Clone, Default)]
pub struct LayerSpec {
    pub name: String,
    /// Parent snapshot name; empty for none.
    pub parent: String,
    pub user_created: bool,
    pub created: String,
    pub labels: BTreeMap<String, String>,
    pub size: u64,
}

/// The in-memory view of the layers.
struct Chain {
    head: LayerId,
    files: HashMap<LayerId, Arc<DataFile>>,
    /// Each layer's checksum file.
    sums: HashMap<LayerId, Arc<SumFile>>,
    /// Layers whose checksum files do not cover their data yet (`LayerMeta::unverified`).
    unverified: HashSet<LayerId>,
    /// Position in the head's chain, 0 = oldest. Layers off the chain are absent.
    rank: HashMap<LayerId, usize>,
    head_extents: ExtentMap<()>,
    below: ExtentMap<LayerId>,
    /// Data bytes of each snapshot (the head's come from `head_extents`).
    data_bytes: HashMap<LayerId, u64>,
}

impl Chain {
    fn head_file(&self) -> Arc<DataFile> {
        self.files[&self.head].clone()
    }

    fn head_sums(&self) -> Arc<SumFile> {
        self.sums[&self.head].clone()
    }

    fn piece(&self, id: LayerId) -> Piece {
        Piece {
            id,
            file: self.files[&id].clone(),
            sums: (!self.unverified.contains(&id)).then(|| self.sums[&id].clone()),
        }
    }

    /// The pieces of the byte range `bytes` (block aligned) and the layer each reads from
    /// (`None`: zeros). Adjacent pieces from the same layer are merged.
    fn resolve(&self, bytes: Range<u64>) -> Vec<(Range<u64>, Option<Piece>)> {
        let mut out: Vec<(Range<u64>, Option<Piece>)> = Vec::new();
        let mut push = |r: Range<u64>, id: Option<LayerId>| {
            let r = r.start * BLOCK_SIZE..r.end * BLOCK_SIZE;
            if let Some((last, lp)) = out.last_mut()
                && lp.as_ref().map(|p| p.id) == id
                && last.end == r.start
            {
                last.end = r.end;
                return;
            }
            out.push((r, id.map(|id| self.piece(id))));
        };
        for (piece, in_head) in self.head_extents.segments(blocks(&bytes)) {
            if in_head.is_some() {
                push(piece, Some(self.head));
                continue;
            }
            for (sub, layer) in self.below.segments(piece) {
                push(sub, layer);
            }
        }
        out
    }
}

/// Byte range (block aligned) to block range.
fn blocks(bytes: &Range<u64>) -> Range<u64> {
    bytes.start / BLOCK_SIZE..bytes.end.div_ceil(BLOCK_SIZE)
}

fn to_bytes(blocks: Range<u64>) -> Range<u64> {
    blocks.start * BLOCK_SIZE..blocks.end * BLOCK_SIZE
}

/// One open replica. All methods take `&self`; it is shared behind an `Arc`.
pub struct Replica {
    dir: PathBuf,
    io: IoEngine,
    size: AtomicU64,
    meta: Mutex<Meta>,
    chain: RwLock<Chain>,
    gate: tokio::sync::RwLock<()>,
    ops: tokio::sync::Mutex<()>,
    flush_lock: tokio::sync::Mutex<()>,
    regions: Regions,
    closed: AtomicBool,
    /// Blocks adopted when settling after a crash (`sums.rs`), until rewritten.
    adopted: Mutex<BTreeSet<u64>>,
    adopted_total: AtomicU64,
    corrupt_found: AtomicU64,
    /// Set when its files went away under it (`health.rs`): every request fails.
    lost: Mutex<Option<String>>,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ReplicaError {
    let what = what.into();
    move |e| ReplicaError::io(what, e)
}

/// Frees `bytes` of a layer file (they read as zeros), off the async threads.
async fn punch_hole(file: &Arc<DataFile>, bytes: Range<u64>) -> Result<()> {
    let f = file.clone();
    blocking("punch hole", move || {
        fsops::punch_hole(f.file(), bytes.clone())
            .map_err(io_err(format!("punch hole {}..{}", bytes.start, bytes.end)))
    })
    .await
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ReplicaError::io(what.to_string(), std::io::Error::other(e)))?
}

/// Creates a layer file of `size` bytes (sparse) and its empty checksum file, and makes
/// both durable.
fn create_layer_file(
    dir: &Path,
    id: LayerId,
    size: u64,
    cache: CacheMode,
) -> Result<(Arc<DataFile>, Arc<SumFile>)> {
    let path = layer_path(dir, id);
    let f = DataFile::open_as(&path, true, cache)
        .map_err(io_err(format!("create {}", path.display())))?;
    f.file()
        .set_len(size)
        .and_then(|_| f.file().sync_all())
        .map_err(io_err(format!("size {}", path.display())))?;
    let sums = create_sum_file(dir, id)?;
    Ok((Arc::new(f), sums))
}

/// Creates (or empties) the checksum file of layer `id` and makes it durable.
fn create_sum_file(dir: &Path, id: LayerId) -> Result<Arc<SumFile>> {
    let path = sum_path(dir, id);
    let s = SumFile::open(&path, true).map_err(io_err(format!("create {}", path.display())))?;
    s.data_file()
        .file()
        .set_len(0)
        .and_then(|_| s.data_file().file().sync_all())
        .map_err(io_err(format!("sync {}", path.display())))?;
    Ok(Arc::new(s))
}

/// Files a half-done `create` may leave; a directory holding only these counts as empty.
fn is_replica_leftover(name: &str) -> bool {
    name == META_TMP
        || name == REGIONS_FILE
        || name == CLEAN_CLOSE
        || name == snapshot::EXPAND_PROBE
        || LayerId::from_file_name(name).is_some()
        || id_from_sum_name(name).is_some()
}

fn random_id() -> String {
    let v: u128 = rand::random();
    format!("{v:032x}")
}

impl Replica {
    /// Creates a replica of `size` bytes in `dir` (made if missing; must not hold one).
    pub async fn create(dir: &Path, size: u64, io: IoEngine) -> Result<Arc<Replica>> {
        if size == 0 || !size.is_multiple_of(BLOCK_SIZE) {
            return Err(ReplicaError::Invalid(format!(
                "size {size} is not a positive multiple of {BLOCK_SIZE}"
            )));
        }
        let d = dir.to_owned();
        blocking("create replica", move || {
            std::fs::create_dir_all(&d).map_err(io_err(format!("create {}", d.display())))?;
            if d.join(META_FILE).exists() {
                return Err(ReplicaError::Invalid(format!(
                    "{} already holds a replica",
                    d.display()
                )));
            }
            for e in std::fs::read_dir(&d).map_err(io_err(format!("list {}", d.display())))? {
                let e = e.map_err(io_err(format!("list {}", d.display())))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if !is_replica_leftover(&name) {
                    return Err(ReplicaError::NotAReplica {
                        dir: d.clone(),
                        why: format!("it contains {name:?}"),
                    });
                }
                std::fs::remove_file(e.path()).map_err(io_err(format!("remove {name}")))?;
            }
            let region_size = regions::region_size_for(size);
            Regions::create(&d.join(REGIONS_FILE), size, region_size)?;
            let head = LayerId(1);
            create_layer_file(&d, head, size, CacheMode::Page)?;
            let meta = Meta {
                format_version: meta::FORMAT_VERSION,
                replica_id: random_id(),
                volume_uuid: None,
                size,
                region_size,
                generation: 0,
                epoch: 0,
                epoch_members: Vec::new(),
                head,
                next_layer_id: 1,
                layers: vec![LayerMeta {
                    id: head,
                    name: None,
                    parent: None,
                    user_created: false,
                    created: meta::now_rfc3339(),
                    labels: BTreeMap::new(),
                    size,
                    incomplete: false,
                    rebuilt: false,
                    unverified: false,
                }],
            };
            meta.store(&d) // commit point: the replica exists from here on
        })
        .await?;
        tracing::info!(dir = %dir.display(), size, "replica created");
        Replica::open(dir, io).await
    }

    /// Opens `dir`, or creates a replica of `size` there when `dir` is missing or empty.
    /// Fails with `SizeMismatch` when it holds a replica of another size, and `NotAReplica`
    /// when it holds something else.
    pub async fn open_or_create(dir: &Path, size: u64, io: IoEngine) -> Result<Arc<Replica>> {
        if dir.join(META_FILE).exists() {
            let r = Replica::open(dir, io).await?;
            if r.size() != size {
                return Err(ReplicaError::SizeMismatch {
                    dir: dir.to_owned(),
                    found: r.size(),
                    wanted: size,
                });
            }
            return Ok(r);
        }
        if dir.exists() && !dir.is_dir() {
            return Err(ReplicaError::NotAReplica {
                dir: dir.to_owned(),
                why: "it is not a directory".into(),
            });
        }
        Replica::create(dir, size, io).await
    }

    /// Opens the replica in `dir`, repairing what a crash left half done: files the metadata
    /// does not name are deleted, a head longer than the volume (an interrupted expand) is cut
    /// back, a format-1 directory gets checksum files (`sums.rs`), and after an unclean stop
    /// the checksums of regions written since the last flush are settled.
    pub async fn open(dir: &Path, io: IoEngine) -> Result<Arc<Replica>> {
        let d = dir.to_owned();
        let (cache, checksums) = (io.cache(), io.checksums());
        let opened = blocking("open replica", move || open_files(&d, cache, checksums)).await?;
        let Opened {
            meta,
            chain,
            regions,
            clean,
        } = opened;
        tracing::info!(
            dir = %dir.display(),
            size = meta.size,
            layers = meta.layers.len(),
            head_extents = chain.head_extents.len(),
            below_extents = chain.below.len(),
            flushed = regions.flushed(),
            clean,
            backend = %io.backend(),
            "replica opened"
        );
        let unverified = !chain.unverified.is_empty();
        let replica = Arc::new(Replica {
            dir: dir.to_owned(),
            io,
            size: AtomicU64::new(meta.size),
            meta: Mutex::new(meta),
            chain: RwLock::new(chain),
            gate: tokio::sync::RwLock::new(()),
            ops: tokio::sync::Mutex::new(()),
            flush_lock: tokio::sync::Mutex::new(()),
            regions,
            closed: AtomicBool::new(false),
            adopted: Mutex::new(BTreeSet::new()),
            adopted_total: AtomicU64::new(0),
            corrupt_found: AtomicU64::new(0),
            lost: Mutex::new(None),
        });
        replica.spawn_file_watch();
        replica.spawn_sums_sync();
        if !checksums {
            tracing::warn!(dir = %dir.display(), "checksums are off: nothing read is verified, and every layer's checksums are computed anew when they are on again");
        } else {
            if !clean {
                replica.settle().await?;
            }
            if unverified {
                replica.spawn_sum_builder();
            }
        }
        Ok(replica)
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().expect("invariant: meta lock not poisoned")
    }

    fn chain(&self) -> std::sync::RwLockReadGuard<'_, Chain> {
        self.chain
            .read()
            .expect("invariant: chain lock not poisoned")
    }

    fn chain_mut(&self) -> std::sync::RwLockWriteGuard<'_, Chain> {
        self.chain
            .write()
            .expect("invariant: chain lock not poisoned")
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(ReplicaError::Closed)
        } else {
            self.check_not_lost()
        }
    }

    /// Validates an I/O range; `payload` ranges (reads, writes) are also held to [`MAX_IO`].
    fn check_io(&self, offset: u64, len: u64, payload: bool) -> Result<()> {
        self.check_open()?;
        if len == 0 {
            return Err(ReplicaError::Invalid("zero length".into()));
        }
        if payload && len > MAX_IO {
            return Err(ReplicaError::Invalid(format!(
                "length {len} is over the limit of {MAX_IO} bytes"
            )));
        }
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(ReplicaError::OutOfRange {
                offset,
                length: len,
                size,
            }),
        }
    }

    /// Reads `len` bytes at `offset`, resolved through the chain (zeros where no layer has
    /// data). Any alignment; `len` > 0 and within the volume. A block that fails its checksum
    /// makes this [`ReplicaError::ChecksumMismatch`]; [`Replica::read_verified`] returns the
    /// data and the list instead.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes> {
        let got = self.read_verified(offset, len).await?;
        if got.corrupt.is_empty() {
            return Ok(got.data);
        }
        let first = offset / BLOCK_SIZE * BLOCK_SIZE;
        Err(ReplicaError::ChecksumMismatch {
            offset,
            length: len,
            blocks: got
                .corrupt
                .iter()
                .map(|&i| first + u64::from(i) * BLOCK_SIZE)
                .collect(),
        })
    }

    /// Reads as [`Replica::read`] does and checks every block against its stored checksum,
    /// returning the data and the blocks that fail.
    ///
    /// A write runs its checksum and its data as two writes, so a read between them sees one
    /// without the other: a block that fails is read again with the exclusive gate (no write
    /// in flight), and only a block that still fails is reported.
    pub async fn read_verified(&self, offset: u64, len: u64) -> Result<ReadOutcome> {
        self.check_io(offset, len, true)?;
        let start = offset / BLOCK_SIZE * BLOCK_SIZE;
        let end = (offset + len).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let mut got = {
            let _g = self.gate.read().await;
            self.check_open()?;
            self.read_aligned(start..end).await?
        };
        if !got.corrupt.is_empty() {
            let _g = self.gate.write().await;
            self.check_open()?;
            got = self.read_aligned(start..end).await?;
            if !got.corrupt.is_empty() {
                self.corrupt_found
                    .fetch_add(got.corrupt.len() as u64, Ordering::Relaxed);
                tracing::warn!(
                    dir = %self.dir.display(),
                    offset = start,
                    blocks = ?got.corrupt.iter().map(|&i| start + u64::from(i) * BLOCK_SIZE).collect::<Vec<_>>(),
                    "blocks fail their checksum"
                );
            }
        }
        if start != offset || end != offset + len {
            let at = (offset - start) as usize;
            got.data = got.data.slice(at..at + len as usize);
        }
        Ok(got)
    }

    /// Reads a block-aligned byte range through the chain and checks it. The caller holds the
    /// gate.
    async fn read_aligned(&self, range: Range<u64>) -> Result<ReadOutcome> {
        let pieces = self.chain().resolve(range.clone());
        let len = (range.end - range.start) as usize;
        if let [(_, only)] = pieces.as_slice() {
            return match only {
                // A hole: shared static zeros, which the frames server sends as a flag.
                None => Ok(ReadOutcome {
                    data: zebu_proto::frames::zeros(len),
                    corrupt: Vec::new(),
                }),
                Some(p) => {
                    let buf = self
                        .io
                        .read_at(&p.file, range.start, AlignedBuf::for_overwrite(len))
                        .await
                        .map_err(io_err(format!("read {len} bytes at {}", range.start)))?;
                    let corrupt = self.check_piece(p, range.start, &buf).await?;
                    Ok(ReadOutcome {
                        data: buf.into_bytes(),
                        corrupt,
                    })
                }
            };
        }
        let reads = pieces.iter().filter_map(|(r, p)| {
            let p = p.clone()?;
            let r = r.clone();
            Some(async move {
                let buf = self
                    .io
                    .read_at(
                        &p.file,
                        r.start,
                        AlignedBuf::for_overwrite((r.end - r.start) as usize),
                    )
                    .await
                    .map_err(io_err(format!(
                        "read {} bytes at {}",
                        r.end - r.start,
                        r.start
                    )))?;
                let corrupt = self.check_piece(&p, r.start, &buf).await?;
                Ok::<_, ReplicaError>((r, buf, corrupt))
            })
        });
        let mut out = AlignedBuf::zeroed(len);
        let mut corrupt = Vec::new();
        for (r, buf, bad) in futures::future::try_join_all(reads).await? {
            let at = (r.start - range.start) as usize;
            out[at..at + buf.len()].copy_from_slice(&buf);
            let base = ((r.start - range.start) / BLOCK_SIZE) as u32;
            corrupt.extend(bad.into_iter().map(|i| base + i));
        }
        corrupt.sort_unstable();
        Ok(ReadOutcome {
            data: out.into_bytes(),
            corrupt,
        })
    }

    /// The blocks of `data` (read from piece `p` at `offset`) that fail their stored
    /// checksums, counted from `offset`; none when the layer is unverified.
    async fn check_piece(&self, p: &Piece, offset: u64, data: &[u8]) -> Result<Vec<u32>> {
        let Some(sums) = &p.sums else {
            return Ok(Vec::new());
        };
        let stored = self
            .read_sums(sums, offset / BLOCK_SIZE, data.len() / BLOCK_SIZE as usize)
            .await?;
        Ok(stored.mismatches(data))
    }

    /// The stored checksums of `count` blocks from block `first`: inline from the page cache
    /// when they are there (nearly always: the file is small and hot), else on a blocking
    /// thread.
    async fn read_sums(&self, f: &Arc<SumFile>, first: u64, count: usize) -> Result<BlockSums> {
        if let Some(s) = f.read_cached(first, count) {
            return Ok(s);
        }
        let f = f.clone();
        blocking("read checksums", move || {
            f.read_blocking(first, count)
                .map_err(io_err(format!("read {count} checksums at block {first}")))
        })
        .await
    }

    /// Writes `data` at `offset` into the head. Any alignment; unaligned is read-modify-write.
    /// The replica computes the checksums.
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<()> {
        self.write_with_sums(offset, data, None).await
    }

    /// Writes `data` at `offset` into the head, with the CRC32C of each of its 4 KiB blocks
    /// as the sender computed them (`None`, or sums that do not cover the data exactly: the
    /// replica computes them). Stored as given, not checked here: a payload damaged on the
    /// way fails its sum on the next read, where another replica's copy can replace it.
    ///
    /// Unaligned writes are read-modify-write of the edge blocks, which must pass their
    /// checksums: a failing one makes the write [`ReplicaError::ChecksumMismatch`] with
    /// nothing written, so bad bytes are never blessed with a fresh checksum.
    pub async fn write_with_sums(
        &self,
        offset: u64,
        data: Bytes,
        sums: Option<BlockSums>,
    ) -> Result<()> {
        let len = data.len() as u64;
        self.check_io(offset, len, true)?;
        if offset.is_multiple_of(BLOCK_SIZE) && len.is_multiple_of(BLOCK_SIZE) {
            let _g = self.gate.read().await;
            self.check_open()?;
            // No copy when `data` is already aligned in memory (`write_bytes_at`).
            return self.write_aligned(offset, data, sums).await;
        }
        // Read-modify-write of the edge blocks: exclusive, so no other write to those blocks
        // can interleave between the read and the write.
        let _g = self.gate.write().await;
        self.check_open()?;
        let start = offset / BLOCK_SIZE * BLOCK_SIZE;
        let end = (offset + len).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let old = self.read_aligned(start..end).await?;
        let first = ((offset - start) / BLOCK_SIZE) as u32;
        let last = ((offset + len - 1 - start) / BLOCK_SIZE) as u32;
        // Only the edge blocks keep old bytes; the ones in between are replaced whole.
        let edges: Vec<u64> = old
            .corrupt
            .iter()
            .filter(|&&i| {
                (i == first && !offset.is_multiple_of(BLOCK_SIZE))
                    || (i == last && !(offset + len).is_multiple_of(BLOCK_SIZE))
            })
            .map(|&i| start + u64::from(i) * BLOCK_SIZE)
            .collect();
        if !edges.is_empty() {
            return Err(ReplicaError::ChecksumMismatch {
                offset,
                length: len,
                blocks: edges,
            });
        }
        let mut buf = AlignedBuf::copy_from(&old.data);
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(&data);
        self.write_aligned(start, buf.into_bytes(), None).await
    }

    /// Writes block-aligned data (offset and length; its memory need not be) to the head,
    /// then stages its checksums, which reach the checksum file by the next flush (`sums.rs`:
    /// "Staged sums", and why in that order). The caller holds the gate.
    async fn write_aligned(&self, offset: u64, data: Bytes, sums: Option<BlockSums>) -> Result<()> {
        let range = offset..offset + data.len() as u64;
        let sums = match sums {
            Some(s) if s.len() as u64 * BLOCK_SIZE == data.len() as u64 => s,
            _ if !self.io.checksums() => BlockSums::default(),
            _ => BlockSums::of(&data).expect("invariant: aligned writes are whole blocks"),
        };
        let times = self.io.times();
        let started = Instant::now();
        let _ticket = self.regions.begin_write(range.clone(), times).await?;
        let marked = Instant::now();
        times.add(Step::WriteMark, marked - started);
        let (head, head_sums) = {
            let c = self.chain();
            (c.head_file(), c.head_sums())
        };
        let len = data.len();
        if let Err(e) = self.io.write_bytes_at(&head, offset, data).await {
            self.settle_failed_write(&head, &head_sums, range).await;
            return Err(io_err(format!("write {len} bytes at {offset}"))(e));
        }
        times.since(Step::WriteData, marked);
        if self.io.checksums() {
            self.stage_head_sums(&head_sums, offset / BLOCK_SIZE, &sums);
        }
        // An overwrite of blocks the head already holds changes nothing in the index; the
        // check under the shared lock spares the exclusive one (and the map's churn) then.
        let blocks = blocks(&range);
        if !self.chain().head_extents.holds(blocks.clone(), ()) {
            self.chain_mut().head_extents.insert(blocks, ());
        }
        self.forget_adopted(range);
        Ok(())
    }

    /// After a write to the head failed part way (a full disk: some of its pages may hold the
    /// new bytes, the rest not), makes every block of `range` read back without a checksum
    /// failure, now and after a restart: a block the head did not hold before gets its hole
    /// back, so it reads as it did before the write (from a snapshot below, or zeros); a block
    /// it held gets the sum of what it holds now (its old bytes or the new ones: a failed
    /// write leaves either, and the client was told it failed). Without this, a block that
    /// took the new bytes kept the old sum, and once that block's region was flushed clean a
    /// read of it failed as corrupt on every replica whose disk had filled: a medium error
    /// for data nobody damaged. If settling fails too, the replica is lost (the engine fails
    /// it and rebuilds it): its data and sums may disagree. The caller holds the gate and
    /// the range's region ticket.
    async fn settle_failed_write(
        &self,
        head: &Arc<DataFile>,
        head_sums: &Arc<SumFile>,
        range: Range<u64>,
    ) {
        let pieces = self.chain().head_extents.segments(blocks(&range));
        for (piece, held) in pieces {
            let bytes = to_bytes(piece);
            let settled = match held {
                None => punch_hole(head, bytes.clone()).await,
                Some(()) if self.io.checksums() => {
                    let len = (bytes.end - bytes.start) as usize;
                    match self
                        .io
                        .read_at(head, bytes.start, AlignedBuf::for_overwrite(len))
                        .await
                    {
                        Ok(now) => {
                            let sums = BlockSums::of(&now)
                                .expect("invariant: whole blocks read back whole");
                            self.stage_head_sums(head_sums, bytes.start / BLOCK_SIZE, &sums);
                            Ok(())
                        }
                        Err(e) => Err(ReplicaError::io(
                            format!("read back {len} bytes at {}", bytes.start),
                            e,
                        )),
                    }
                }
                Some(()) => Ok(()),
            };
            if let Err(e) = settled {
                let _ = self.mark_lost(format!(
                    "a write failed part way at {}..{} and its blocks could not be settled: {e}",
                    bytes.start, bytes.end
                ));
                return;
            }
            tracing::info!(dir = %self.dir.display(), start = bytes.start, end = bytes.end,
                held = held.is_some(), "settled the blocks of a failed write");
        }
    }

    /// Makes the range read as zeros, freeing space in the head where no snapshot holds data
    /// under it. Partial blocks at the edges are zeroed by writing.
    pub async fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.check_io(offset, len, false)?;
        let end = offset + len;
        let inner = offset.div_ceil(BLOCK_SIZE) * BLOCK_SIZE..end / BLOCK_SIZE * BLOCK_SIZE;
        if inner.start >= inner.end {
            return self
                .write(offset, Bytes::from(vec![0u8; len as usize]))
                .await;
        }
        if offset < inner.start {
            self.write(
                offset,
                Bytes::from(vec![0u8; (inner.start - offset) as usize]),
            )
            .await?;
        }
        if inner.end < end {
            self.write(
                inner.end,
                Bytes::from(vec![0u8; (end - inner.end) as usize]),
            )
            .await?;
        }
        let _g = self.gate.read().await;
        self.check_open()?;
        self.unmap_aligned(inner).await
    }

    /// Makes the range read as zeros by writing zeros over all of it (see `UnmapOp.zero_fill`
    /// in the proto: for a replica whose older layers are still being rebuilt).
    pub async fn zero_fill(&self, offset: u64, len: u64) -> Result<()> {
        self.check_io(offset, len, false)?;
        let end = offset + len;
        let mut at = offset;
        while at < end {
            // Chunks end on block boundaries so only the first and last may be unaligned.
            let next = ((at / CHUNK) + 1) * CHUNK;
            let n = next.min(end) - at;
            self.write(at, Bytes::from(vec![0u8; n as usize])).await?;
            at += n;
        }
        Ok(())
    }

    /// Unmaps a block-aligned range of the head. The caller holds the gate.
    async fn unmap_aligned(&self, range: Range<u64>) -> Result<()> {
        let _ticket = self
            .regions
            .begin_write(range.clone(), self.io.times())
            .await?;
        let (head, head_sums, pieces) = {
            let c = self.chain();
            (
                c.head_file(),
                c.head_sums(),
                c.below.segments(blocks(&range)),
            )
        };
        self.forget_adopted(range.clone());
        for (piece, under) in pieces {
            let bytes = to_bytes(piece.clone());
            if under.is_some() {
                // A snapshot holds data here: the head must hold zeros to hide it.
                let mut at = bytes.start;
                let mut zeros = AlignedBuf::zeroed(CHUNK.min(bytes.end - at) as usize);
                while at < bytes.end {
                    let n = CHUNK.min(bytes.end - at);
                    if (zeros.len() as u64) != n {
                        zeros = AlignedBuf::zeroed(n as usize);
                    }
                    zeros = self
                        .io
                        .write_at(&head, at, zeros)
                        .await
                        .map_err(io_err(format!("zero {n} bytes at {at}")))?;
                    if self.io.checksums() {
                        let sums = BlockSums::from_crcs(std::iter::repeat_n(
                            zebu_proto::sums::ZERO_BLOCK_CRC,
                            (n / BLOCK_SIZE) as usize,
                        ));
                        self.stage_head_sums(&head_sums, at / BLOCK_SIZE, &sums);
                    }
                    at += n;
                }
                self.chain_mut().head_extents.insert(piece, ());
            } else {
                punch_hole(&head, bytes.clone()).await?;
                self.chain_mut().head_extents.remove(piece);
            }
        }
        Ok(())
    }

    /// Makes every completed write durable; returns the flush number now durable.
    /// `flush_number` 0 means "my own number + 1".
    pub async fn flush(&self, flush_number: u64) -> Result<u64> {
        self.check_open()?;
        let times = self.io.times();
        let t0 = Instant::now();
        let _f = self.flush_lock.lock().await;
        let t1 = Instant::now();
        times.add(Step::FlushLock, t1 - t0);
        let n = self.regions.start_flush(flush_number).await?;
        let t2 = Instant::now();
        times.add(Step::FlushDrain, t2 - t1);
        self.sync_head_data().await?;
        let t3 = Instant::now();
        times.add(Step::FlushSync, t3 - t2);
        // Never a durable flush over files that are gone (`health.rs`).
        self.check_head_files()?;
        let t4 = Instant::now();
        times.add(Step::FlushCheck, t4 - t3);
        if self.io.checksums() {
            // Recorded once its checksums are durable too (`sumsync.rs`).
            self.regions.note_flush(n);
        } else {
            self.regions.complete_flush(n).await?;
        }
        times.since(Step::FlushRecord, t4);
        Ok(n)
    }

    /// The flush's part of [`Replica::sync_head`]: fdatasyncs the head and writes its staged
    /// sums back into the checksum file (the page cache), in parallel; the checksum file's
    /// fdatasync follows within [`sumsync::SUMS_SYNC_INTERVAL`] (`sumsync.rs` says why that
    /// keeps every guarantee). Every write completed before this has its data durable and
    /// its sum in the page cache when it returns.
    async fn sync_head_data(&self) -> Result<()> {
        let (head, sums) = {
            let c = self.chain();
            (c.head_file(), c.head_sums())
        };
        let times = self.io.times();
        let started = Instant::now();
        let checksums = self.io.checksums();
        // Both at once: the sums' write-back is a copy into the page cache while the head's
        // fdatasync waits for the disk (`sync_waited`).
        let (sums, data) = tokio::join!(
            async {
                if !checksums {
                    return Ok(());
                }
                let r = self.write_back_sums(&sums).await;
                times.since(Step::FlushSumsSync, started);
                r
            },
            async {
                let r = self.io.sync_waited(&head).await;
                times.since(Step::FlushHeadSync, started);
                r
            }
        );
        data.map_err(io_err("fdatasync head"))?;
        sums.map_err(io_err("write back the head's checksums"))
    }

    /// fdatasyncs the head and its checksum file (its staged sums written first), in
    /// parallel (one journal commit can carry both). Every write completed before this is
    /// durable, data and sums, when it returns.
    async fn sync_head(&self) -> Result<()> {
        let (head, sums) = {
            let c = self.chain();
            (c.head_file(), c.head_sums())
        };
        let (data, sums) = tokio::join!(self.io.sync(&head), self.sync_sums(&sums));
        data.map_err(io_err("fdatasync head"))?;
        sums.map_err(io_err("write back and fdatasync the head's checksums"))
    }

    /// Writes a checksum file's staged sums into it, then fdatasyncs it: every sum stored or
    /// staged before this call is durable when it returns. The write-back is a copy into the
    /// page cache, inline when it is a few pages (one flush after a few writes), else on a
    /// blocking thread.
    async fn sync_sums(&self, sums: &Arc<SumFile>) -> std::io::Result<()> {
        self.write_back_sums(sums).await?;
        self.io.sync(sums.data_file()).await
    }

    /// Writes a checksum file's staged sums into it (the page cache), inline when they are a
    /// few pages, else on a blocking thread.
    async fn write_back_sums(&self, sums: &Arc<SumFile>) -> std::io::Result<()> {
        let staged = sums.staged_pages();
        // A background write-back holds the file's writer lock: wait for it off the async
        // threads too.
        if staged > INLINE_WRITE_BACK || sums.background_running() {
            let s = sums.clone();
            tokio::task::spawn_blocking(move || s.write_back())
                .await
                .map_err(std::io::Error::other)??;
        } else if staged > 0 {
            sums.write_back()?;
        }
        Ok(())
    }

    /// Stages the sums of a head write (`sums.rs`), and starts a background write-back when
    /// too many pages are staged.
    fn stage_head_sums(&self, head_sums: &Arc<SumFile>, first: u64, sums: &BlockSums) {
        if !head_sums.stage(first, sums) {
            return;
        }
        let (s, dir) = (head_sums.clone(), self.dir.clone());
        tokio::task::spawn_blocking(move || {
            match s.write_back() {
                Ok(pages) => {
                    tracing::debug!(dir = %dir.display(), pages, "staged checksums written back")
                }
                // They stay staged: the next flush writes them or fails.
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), "writing back staged checksums failed: {e}")
                }
            }
            s.background_done();
        });
    }

    /// Accepts an engine's generation: an error if lower than the highest accepted; a higher
    /// one is persisted before this returns.
    pub async fn accept_generation(&self, generation: u64) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let accepted = self.meta().generation;
        if generation < accepted {
            return Err(ReplicaError::StaleGeneration {
                offered: generation,
                accepted,
            });
        }
        identity::check_generation(accepted, generation)?;
        if generation > accepted {
            self.commit_meta(|m| {
                m.generation = generation;
                Ok(())
            })
            .await?;
            tracing::info!(
                generation,
                previous = accepted,
                "accepted a new engine generation"
            );
        }
        Ok(())
    }

    /// Records membership `epoch` and its members durably. Epochs never go back.
    pub async fn set_epoch(&self, epoch: u64, members: Vec<String>) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let (current, me) = {
            let m = self.meta();
            (m.epoch, m.replica_id.clone())
        };
        if epoch < current {
            return Err(ReplicaError::Invalid(format!(
                "epoch {epoch} is lower than the recorded epoch {current}"
            )));
        }
        identity::check_epoch(current, epoch)?;
        // An epoch names the current replicas; a replica recording one that leaves it out
        // would be refused as stale by the next engine, so such a request is wrong.
        if !members.contains(&me) {
            return Err(ReplicaError::Invalid(format!(
                "epoch {epoch}'s members {members:?} do not include this replica ({me})"
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = members.iter().find(|m| !seen.insert(m.as_str())) {
            return Err(ReplicaError::Invalid(format!(
                "epoch {epoch}'s members name {dup} twice"
            )));
        }
        self.commit_meta(move |m| {
            m.epoch = epoch;
            m.epoch_members = members;
            Ok(())
        })
        .await
        .map(|_| ())
    }

    /// Applies `change` to a copy of the metadata, stores it durably (the commit point), then
    /// makes it current. The caller holds `ops`.
    async fn commit_meta(&self, change: impl FnOnce(&mut Meta) -> Result<()>) -> Result<Meta> {
        let mut next = self.meta().clone();
        change(&mut next)?;
        next.validate(&self.dir.join(META_FILE))?;
        let dir = self.dir.clone();
        let stored = next.clone();
        blocking("store metadata", move || stored.store(&dir)).await?;
        *self.meta() = next.clone();
        Ok(next)
    }

    pub fn info(&self) -> ReplicaInfo {
        let meta = self.meta().clone();
        let chain = self.chain();
        let order = meta.chain();
        let mut layers: Vec<&LayerMeta> = order.iter().filter_map(|id| meta.layer(*id)).collect();
        let mut off: Vec<&LayerMeta> = meta
            .layers
            .iter()
            .filter(|l| !order.contains(&l.id))
            .collect();
        off.sort_by_key(|l| l.id);
        layers.extend(off);
        let layers = layers
            .into_iter()
            .map(|l| LayerInfo {
                id: l.id.0,
                name: l.name.clone().unwrap_or_default(),
                parent: l.parent.map_or(0, |p| p.0),
                head: l.id == meta.head,
                user_created: l.user_created,
                data_bytes: if l.id == meta.head {
                    chain.head_extents.covered() * BLOCK_SIZE
                } else {
                    chain.data_bytes.get(&l.id).copied().unwrap_or(0)
                },
                created: l.created.clone(),
                labels: l.labels.clone(),
                size: l.size,
                incomplete: l.incomplete,
                rebuilt: l.rebuilt,
            })
            .collect();
        ReplicaInfo {
            replica_id: meta.replica_id.clone(),
            volume_uuid: meta.volume_uuid.clone(),
            size: meta.size,
            generation: meta.generation,
            epoch: meta.epoch,
            epoch_members: meta.epoch_members.clone(),
            flush_number: self.regions.flushed(),
            layers,
            region_size: self.regions.region_size(),
            region_count: self.regions.region_count(),
            dirty_regions: self.regions.dirty(),
            unverified_bytes: meta
                .layers
                .iter()
                .filter(|l| l.unverified)
                .map(|l| {
                    if l.id == meta.head {
                        chain.head_extents.covered() * BLOCK_SIZE
                    } else {
                        chain.data_bytes.get(&l.id).copied().unwrap_or(0)
                    }
                })
                .sum(),
            adopted_blocks: self.adopted_total.load(Ordering::Relaxed),
            corrupt_found: self.corrupt_found.load(Ordering::Relaxed),
        }
    }

    /// Regions whose latest write is covered by a flush numbered above `flush`: what a
    /// replica that stopped after flush `flush` may lack.
    pub fn regions_written_since(&self, flush: u64) -> Vec<u64> {
        self.regions.written_since(flush)
    }

    /// Memory held by the extent indexes, in extents (for benchmarks and logs).
    pub fn index_extents(&self) -> usize {
        let c = self.chain();
        c.head_extents.len() + c.below.len()
    }

    /// Flushes and closes; every later call fails with `Closed`.
    pub async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let _g = self.gate.write().await;
        self.sync_head().await?;
        // Data and sums are durable: the last flush may be recorded (`sumsync.rs`).
        self.regions.complete_flush(self.regions.flushed()).await?;
        if let Some(why) = self.lost() {
            // Not a clean close: what is left must be settled (or replaced) at the next open.
            return Err(ReplicaError::Lost(why));
        }
        // Every sum matches its data now: the next open need not settle (`sums.rs`).
        let dir = self.dir.clone();
        blocking("mark the close clean", move || {
            let path = dir.join(CLEAN_CLOSE);
            std::fs::File::create(&path)
                .and_then(|f| f.sync_all())
                .map_err(io_err(format!("create {}", path.display())))?;
            meta::sync_dir(&dir)
        })
        .await?;
        tracing::info!(dir = %self.dir.display(), "replica closed");
        Ok(())
    }
}

/// What [`open_files`] found.
struct Opened {
    meta: Meta,
    chain: Chain,
    regions: Regions,
    /// The last close was clean: every checksum matches its data.
    clean: bool,
}

/// The blocking part of [`Replica::open`]: loads and repairs the directory, opens every file.
fn open_files(d: &Path, cache: CacheMode, checksums: bool) -> Result<Opened> {
    if !d.join(META_FILE).exists() {
        return Err(ReplicaError::NotAReplica {
            dir: d.to_owned(),
            why: format!("no {META_FILE}"),
        });
    }
    let mut meta = Meta::load(d)?;
    let mut removed = false;
    for e in std::fs::read_dir(d).map_err(io_err(format!("list {}", d.display())))? {
        let e = e.map_err(io_err(format!("list {}", d.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let stray = name == META_TMP
            || name == snapshot::EXPAND_PROBE
            || LayerId::from_file_name(&name).is_some_and(|id| meta.layer(id).is_none())
            || id_from_sum_name(&name).is_some_and(|id| meta.layer(id).is_none());
        if stray {
            tracing::info!(file = %name, "removing a file left by an interrupted operation");
            std::fs::remove_file(e.path()).map_err(io_err(format!("remove {name}")))?;
            removed = true;
        }
    }
    // Removed before anything is served, so a crash after serving settles next time.
    let clean = d.join(CLEAN_CLOSE).exists();
    if clean {
        std::fs::remove_file(d.join(CLEAN_CLOSE))
            .map_err(io_err(format!("remove {CLEAN_CLOSE}")))?;
        removed = true;
    }
    if removed {
        meta::sync_dir(d)?;
    }
    let upgrade = meta.format_version == meta::FORMAT_WITHOUT_SUMS;
    let mut changed = upgrade;
    let mut files = HashMap::new();
    let mut sums = HashMap::new();
    for l in &mut meta.layers {
        let path = layer_path(d, l.id);
        if !path.exists() {
            return Err(ReplicaError::Corrupt {
                path,
                why: format!("{} is missing", l.id),
            });
        }
        let f = DataFile::open_as(&path, false, cache)
            .map_err(io_err(format!("open {}", path.display())))?;
        files.insert(l.id, Arc::new(f));
        let spath = sum_path(d, l.id);
        let had_sums = spath.exists();
        let s = if !upgrade && had_sums {
            Arc::new(
                SumFile::open(&spath, false)
                    .map_err(io_err(format!("open {}", spath.display())))?,
            )
        } else {
            if !upgrade && !l.unverified {
                tracing::warn!(
                    layer = l.id.0,
                    "the checksum file of {} is missing: its checksums are computed again, and its reads are not verified until then",
                    l.id
                );
            }
            create_sum_file(d, l.id)?
        };
        sums.insert(l.id, s);
        // A layer whose checksum file was just made does not have its sums; without
        // checksums no layer's sums are kept from here on (`IoConfig::checksums`).
        if (upgrade || !had_sums || !checksums) && !l.unverified {
            l.unverified = true;
            changed = true;
        }
    }
    if changed {
        if upgrade {
            tracing::info!(dir = %d.display(), "upgrading a replica made before checksums: its checksums are computed in the background");
        }
        meta.format_version = meta::FORMAT_VERSION;
        meta.validate(&d.join(META_FILE))?;
        // Commit point: from here on every layer not marked unverified has a checksum file
        // that covers its data.
        meta.store(d)?;
    }
    let head = &files[&meta.head];
    let len = fsops::size_links(head.file())
        .map_err(io_err("stat head"))?
        .len;
    if len != meta.size {
        head.file()
            .set_len(meta.size)
            .map_err(io_err("resize head"))?;
    }
    let regions = Regions::open(&d.join(REGIONS_FILE), meta.size, meta.region_size)?;
    let chain = build_chain(&meta, files, sums)?;
    Ok(Opened {
        meta,
        chain,
        regions,
        clean,
    })
}

/// Builds the in-memory chain from the metadata and open layer files (scans extents).
fn build_chain(
    meta: &Meta,
    files: HashMap<LayerId, Arc<DataFile>>,
    sums: HashMap<LayerId, Arc<SumFile>>,
) -> Result<Chain> {
    let head_extents =
        scan(&files[&meta.head], meta.size)?
            .into_iter()
            .fold(ExtentMap::new(), |mut m, r| {
                m.insert(blocks(&r), ());
                m
            });
    let below = index_below(meta, &files)?;
    Ok(Chain {
        head: meta.head,
        files,
        sums,
        unverified: meta
            .layers
            .iter()
            .filter(|l| l.unverified)
            .map(|l| l.id)
            .collect(),
        rank: below.rank,
        head_extents,
        below: below.below,
        data_bytes: below.data_bytes,
    })
}

/// The part of the index that only snapshot operations change: what the snapshot layers
/// hold. Built from the (read-only) snapshot files, so it can be rebuilt while writes go on;
/// the head's extents are never rescanned while the replica is open, because writes change
/// them all the time.
struct BelowIndex {
    below: ExtentMap<LayerId>,
    data_bytes: HashMap<LayerId, u64>,
    rank: HashMap<LayerId, usize>,
}

fn index_below(meta: &Meta, files: &HashMap<LayerId, Arc<DataFile>>) -> Result<BelowIndex> {
    let order = meta.chain();
    let mut data_bytes = HashMap::new();
    let mut below = ExtentMap::new();
    // Newest snapshot first: an older layer only fills what newer ones left empty.
    for &id in order.iter().rev().skip(1) {
        let extents = scan(&files[&id], u64::MAX)?;
        data_bytes.insert(id, extents.iter().map(|r| r.end - r.start).sum());
        for r in extents {
            below.fill_under(blocks(&r), id, |_| false);
        }
    }
    for l in &meta.layers {
        if !order.contains(&l.id) {
            let extents = scan(&files[&l.id], u64::MAX)?;
            data_bytes.insert(l.id, extents.iter().map(|r| r.end - r.start).sum());
        }
    }
    let rank = order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    Ok(BelowIndex {
        below,
        data_bytes,
        rank,
    })
}

fn scan(file: &DataFile, limit: u64) -> Result<Vec<Range<u64>>> {
    fsops::data_extents(file.file(), 0..limit, BLOCK_SIZE).map_err(io_err("scan layer extents"))
}
