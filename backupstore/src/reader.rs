//! Restores: every chunk downloaded once, in large ranged reads, several in flight, handed
//! to the caller in ascending volume order.
//!
//! A restore plan is built from the manifest's pages: the distinct chunks in the order of
//! their first offset, each with every offset it goes to (a chunk repeated in the volume is
//! downloaded once and delivered with all its offsets). Consecutive chunks that lie back to
//! back in one pack are read with one ranged GET (up to [`RestoreOptions::max_read`]), and
//! [`RestoreOptions::concurrency`] reads are in flight while the caller writes what came.
//! Memory: the plan (about 150 bytes per chunk of the backup while it is built, ~150 MiB for
//! a full TiB; a plan per page would bound it further) plus `concurrency × max_read`.
//!
//! Every blob is decompressed and checked against its hash before it is handed on; a blob
//! that fails is an error naming the pack object, the chunk hash and its volume offset, and
//! no later item is delivered.
//!
//! An incremental restore ([`crate::BackupStore::restore_diff`]) plans only the chunks that
//! differ between two backups and adds [`RestoreItem::Zero`] for chunks that became holes:
//! what a standby volume holding backup A must write to hold backup B.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

use crate::blob;
use crate::error::{BackupError, Result};
use crate::ids::{ChunkHash, FamilyId, PackId};
use crate::index::FamilyIndex;
use crate::manifest::{Manifest, PageRef};
use crate::map::Page;
use crate::pack;
use crate::target::Target;

/// How a restore reads.
#[derive(Clone, Copy, Debug)]
pub struct RestoreOptions {
    /// Ranged reads in flight.
    pub concurrency: usize,
    /// Largest ranged read.
    pub max_read: u64,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self {
            concurrency: 4,
            max_read: 16 << 20,
        }
    }
}

/// One thing to write into the restored volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreItem {
    /// This chunk's bytes at each of these offsets (ascending; usually one).
    Data { offsets: Vec<u64>, data: Bytes },
    /// This range is now a hole (only from [`crate::BackupStore::restore_diff`]).
    Zero { offset: u64, len: u64 },
}

/// What a restore read.
#[derive(Debug, Default)]
pub struct RestoreCounters {
    pub chunks: AtomicU64,
    pub bytes: AtomicU64,
    pub reads: AtomicU64,
    pub downloaded: AtomicU64,
}

/// A snapshot of [`RestoreCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// Distinct chunks downloaded and verified.
    pub chunks: u64,
    /// Bytes delivered (a chunk at two offsets counts twice).
    pub bytes: u64,
    /// Ranged GETs of packs.
    pub reads: u64,
    /// Bytes downloaded.
    pub downloaded: u64,
}

/// Reads one blob by hash (map pages, parents' pages).
pub(crate) async fn fetch_blob(
    target: &Target,
    family: &FamilyId,
    index: &FamilyIndex,
    hash: &ChunkHash,
) -> Result<Bytes> {
    let (p, e) = index
        .locate(hash)
        .ok_or_else(|| BackupError::CorruptObject {
            object: format!("families/{family}"),
            reason: format!("blob {hash} is in no pack"),
        })?;
    let key = pack::pack_key(target, family, p.id);
    let stored = target
        .get_range(&key, e.offset..e.offset + u64::from(e.stored_len))
        .await?;
    let (codec, raw_len, h) = (e.codec, e.raw_len, *hash);
    let object = target.rel(&key).to_string();
    tokio::task::spawn_blocking(move || {
        blob::decode(&stored, codec, raw_len, &h).map_err(|reason| BackupError::CorruptChunk {
            object,
            hash: h,
            offset: 0,
            reason,
        })
    })
    .await?
}

/// Reads and checks a manifest's page.
pub(crate) async fn fetch_page(
    target: &Target,
    m: &Manifest,
    index: &FamilyIndex,
    p: &PageRef,
) -> Result<Page> {
    let raw = fetch_blob(target, &m.family, index, &p.hash).await?;
    let page = Page::decode(
        &format!("map page {} of backup {}/{}", p.index, m.family, m.name),
        &raw,
    )?;
    if page.0.len() != p.chunks as usize {
        return Err(BackupError::CorruptObject {
            object: format!("backup {}/{}", m.family, m.name),
            reason: format!(
                "page {} holds {} chunks, the manifest says {}",
                p.index,
                page.0.len(),
                p.chunks
            ),
        });
    }
    Ok(page)
}

/// `(slot, hash)` of every chunk of a backup, ascending by slot.
pub(crate) async fn load_map(
    target: &Target,
    m: &Manifest,
    index: &FamilyIndex,
) -> Result<Vec<(u64, ChunkHash)>> {
    let pages: Vec<(u64, Page)> =
        futures::stream::iter(m.pages.iter())
            .map(|p| async move {
                Ok::<_, BackupError>((p.index, fetch_page(target, m, index, p).await?))
            })
            .buffered(8)
            .try_collect()
            .await?;
    let mut out = Vec::with_capacity(pages.iter().map(|(_, p)| p.0.len()).sum());
    for (pi, page) in pages {
        out.extend(
            page.0
                .into_iter()
                .map(|(s, h)| (pi * m.page_chunks + u64::from(s), h)),
        );
    }
    Ok(out)
}

/// The chunk-level difference between two backups of one volume size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ManifestDiff {
    /// `(slot, hash)` present in `to` and absent or different in `from`.
    pub changed: Vec<(u64, ChunkHash)>,
    /// Slots holding data in `from` and a hole in `to`.
    pub zeroed: Vec<u64>,
    /// Pages skipped without reading because their hashes were equal.
    pub pages_skipped: u64,
}

/// Compares two backups page by page, reading only pages whose hashes differ.
pub(crate) async fn diff(
    target: &Target,
    from: &Manifest,
    to: &Manifest,
    index: &FamilyIndex,
) -> Result<ManifestDiff> {
    if from.chunk_size != to.chunk_size
        || from.page_chunks != to.page_chunks
        || from.family != to.family
    {
        return Err(BackupError::InvalidInput(format!(
            "backups {}/{} and {}/{} are of different families or chunk layouts",
            from.family, from.name, to.family, to.name
        )));
    }
    let a: HashMap<u64, &PageRef> = from.pages.iter().map(|p| (p.index, p)).collect();
    let b: HashMap<u64, &PageRef> = to.pages.iter().map(|p| (p.index, p)).collect();
    let mut indexes: Vec<u64> = a.keys().chain(b.keys()).copied().collect();
    indexes.sort_unstable();
    indexes.dedup();
    let mut out = ManifestDiff::default();
    for pi in indexes {
        let (pa, pb) = (a.get(&pi), b.get(&pi));
        if let (Some(x), Some(y)) = (pa, pb)
            && x.hash == y.hash
        {
            out.pages_skipped += 1;
            continue;
        }
        let old = match pa {
            Some(p) => fetch_page(target, from, index, p).await?.0,
            None => Vec::new(),
        };
        let new = match pb {
            Some(p) => fetch_page(target, to, index, p).await?.0,
            None => Vec::new(),
        };
        let old: HashMap<u32, ChunkHash> = old.into_iter().collect();
        let base = pi * to.page_chunks;
        let to_chunks = to.chunk_count();
        for (s, h) in &new {
            if old.get(s) != Some(h) {
                out.changed.push((base + u64::from(*s), *h));
            }
        }
        let new: HashMap<u32, ChunkHash> = new.into_iter().collect();
        let mut zeroed: Vec<u64> = old
            .keys()
            .filter(|s| !new.contains_key(s))
            .map(|s| base + u64::from(*s))
            .filter(|&slot| slot < to_chunks)
            .collect();
        zeroed.sort_unstable();
        out.zeroed.extend(zeroed);
    }
    Ok(out)
}

struct Member {
    hash: ChunkHash,
    at: u64,
    stored_len: u32,
    raw_len: u32,
    codec: blob::Codec,
    slots: Vec<u64>,
}

enum Op {
    Zero(Range<u64>),
    Read {
        pack: PackId,
        range: Range<u64>,
        members: Vec<Member>,
    },
}

/// A running restore. Pull items with [`Self::next`].
pub struct RestoreStream {
    inner: BoxStream<'static, Result<Vec<RestoreItem>>>,
    pending: std::collections::VecDeque<RestoreItem>,
    counters: Arc<RestoreCounters>,
    failed: bool,
}

impl RestoreStream {
    /// The next item, in ascending volume order; `None` at the end.
    pub async fn next(&mut self) -> Option<Result<RestoreItem>> {
        if self.failed {
            return None;
        }
        loop {
            if let Some(i) = self.pending.pop_front() {
                return Some(Ok(i));
            }
            match self.inner.next().await? {
                Ok(v) => self.pending.extend(v),
                Err(e) => {
                    self.failed = true;
                    return Some(Err(e));
                }
            }
        }
    }

    /// What the restore has read so far.
    pub fn stats(&self) -> RestoreStats {
        let c = &self.counters;
        RestoreStats {
            chunks: c.chunks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            downloaded: c.downloaded.load(Ordering::Relaxed),
        }
    }
}

/// Builds the stream for `chunks` (`(slot, hash)`, ascending) and `zeroed` slots.
pub(crate) fn start(
    target: Arc<Target>,
    m: &Manifest,
    index: &FamilyIndex,
    chunks: Vec<(u64, ChunkHash)>,
    zeroed: Vec<u64>,
    opts: RestoreOptions,
) -> Result<RestoreStream> {
    let cs = m.chunk_size;
    let volume = m.volume_size;
    // Distinct chunks in order of first slot, with all their slots.
    let mut first: HashMap<ChunkHash, usize> = HashMap::with_capacity(chunks.len());
    let mut distinct: Vec<(ChunkHash, Vec<u64>)> = Vec::with_capacity(chunks.len());
    for (slot, h) in chunks {
        match first.get(&h) {
            Some(&i) => distinct[i].1.push(slot),
            None => {
                first.insert(h, distinct.len());
                distinct.push((h, vec![slot]));
            }
        }
    }
    drop(first);
    let mut ops: Vec<(u64, Op)> = Vec::new();
    for (h, slots) in distinct {
        let (p, e) = index.locate(&h).ok_or_else(|| BackupError::MissingChunk {
            backup: format!("{}/{}", m.family, m.name),
            hash: h,
            offset: slots[0] * cs,
        })?;
        let member = Member {
            hash: h,
            at: e.offset,
            stored_len: e.stored_len,
            raw_len: e.raw_len,
            codec: e.codec,
            slots,
        };
        let end = e.offset + u64::from(e.stored_len);
        if let Some((
            _,
            Op::Read {
                pack,
                range,
                members,
            },
        )) = ops.last_mut()
            && *pack == p.id
            && range.end == e.offset
            && end - range.start <= opts.max_read
        {
            range.end = end;
            members.push(member);
            continue;
        }
        let first_offset = member.slots[0] * cs;
        ops.push((
            first_offset,
            Op::Read {
                pack: p.id,
                range: e.offset..end,
                members: vec![member],
            },
        ));
    }
    // Zero runs, merged, placed in offset order among the reads.
    let mut zero_runs: Vec<Range<u64>> = Vec::new();
    for s in zeroed {
        let r = s * cs..((s + 1) * cs).min(volume);
        match zero_runs.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => zero_runs.push(r),
        }
    }
    ops.extend(zero_runs.into_iter().map(|r| (r.start, Op::Zero(r))));
    ops.sort_by_key(|(o, _)| *o);
    let counters = Arc::new(RestoreCounters::default());
    let family = m.family.clone();
    let ctr = counters.clone();
    let inner = futures::stream::iter(ops.into_iter().map(|(_, op)| op))
        .map(move |op| {
            let (target, family, ctr) = (target.clone(), family.clone(), ctr.clone());
            async move {
                match op {
                    Op::Zero(r) => Ok(vec![RestoreItem::Zero {
                        offset: r.start,
                        len: r.end - r.start,
                    }]),
                    Op::Read {
                        pack,
                        range,
                        members,
                    } => {
                        let key = pack::pack_key(&target, &family, pack);
                        let bytes = target.get_range(&key, range.clone()).await?;
                        ctr.reads.fetch_add(1, Ordering::Relaxed);
                        ctr.downloaded
                            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        let object = target.rel(&key).to_string();
                        let items = tokio::task::spawn_blocking(move || {
                            decode_members(&object, &bytes, range.start, members, cs, volume)
                        })
                        .await??;
                        for i in &items {
                            if let RestoreItem::Data { offsets, data } = i {
                                ctr.chunks.fetch_add(1, Ordering::Relaxed);
                                ctr.bytes.fetch_add(
                                    data.len() as u64 * offsets.len() as u64,
                                    Ordering::Relaxed,
                                );
                            }
                        }
                        Ok(items)
                    }
                }
            }
        })
        .buffered(opts.concurrency.max(1))
        .boxed();
    Ok(RestoreStream {
        inner,
        pending: Default::default(),
        counters,
        failed: false,
    })
}

fn decode_members(
    object: &str,
    bytes: &[u8],
    base: u64,
    members: Vec<Member>,
    cs: u64,
    volume: u64,
) -> Result<Vec<RestoreItem>> {
    let mut out = Vec::with_capacity(members.len());
    for m in members {
        let off = m.slots[0] * cs;
        let start = (m.at - base) as usize;
        let stored = bytes
            .get(start..start + m.stored_len as usize)
            .ok_or_else(|| BackupError::CorruptChunk {
                object: object.to_string(),
                hash: m.hash,
                offset: off,
                reason: "short read".into(),
            })?;
        let data = blob::decode(stored, m.codec, m.raw_len, &m.hash).map_err(|reason| {
            BackupError::CorruptChunk {
                object: object.to_string(),
                hash: m.hash,
                offset: off,
                reason,
            }
        })?;
        let want = cs.min(volume - off) as usize;
        if data.len() != want {
            return Err(BackupError::CorruptChunk {
                object: object.to_string(),
                hash: m.hash,
                offset: off,
                reason: format!("chunk has {} bytes, its slot {want}", data.len()),
            });
        }
        out.push(RestoreItem::Data {
            offsets: m.slots.iter().map(|s| s * cs).collect(),
            data,
        });
    }
    Ok(out)
}
