//! Reading backups: blobs and map pages by hash, a backup's whole chunk map, the difference
//! between two backups, and the options and items of a restore (the restore itself is
//! [`crate::restore`]: reads planned per pack, streamed, handed on in volume order).
//!
//! An incremental restore ([`crate::BackupStore::restore_diff`]) plans only the chunks that
//! differ between two backups and adds [`RestoreItem::Zero`] for chunks that became holes:
//! what a standby volume holding backup A must write to hold backup B.

use std::collections::HashMap;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::blob;
use crate::error::{BackupError, Result};
use crate::ids::{ChunkHash, FamilyId};
use crate::index::FamilyIndex;
use crate::manifest::{Manifest, PageRef};
use crate::map::Page;
use crate::pack;
use crate::target::Target;

/// How a restore reads. Memory: about `buffer + concurrency × 2 × chunk size` (plus, rarely,
/// what the earliest running read holds beyond `buffer`, at most `max_read`); see
/// [`crate::restore`]. It does not grow with the backup.
#[derive(Clone, Copy, Debug)]
pub struct RestoreOptions {
    /// Ranged reads in flight.
    pub concurrency: usize,
    /// Largest ranged read, in bytes of a pack. A read is streamed and decoded blob by blob,
    /// so its size costs no memory: the default takes a whole pack in one read.
    pub max_read: u64,
    /// Bytes of blobs not needed that a read may span to join the blobs on either side (one
    /// request instead of two; the bytes are downloaded and dropped). The default, 4 MiB,
    /// costs about what a request's own latency does at 100 MiB/s. An incremental restore
    /// wants about half of each older pack's chunks, scattered: at 1 MiB it made 199 ranged
    /// reads for the 4 GiB case and waited 9.9 s for a server that copies the whole object
    /// for every ranged read (moto); at 4 MiB, 54 reads, 16 % more bytes and 1.7 s
    /// (benches/README.md, "Layers written with direct I/O").
    pub max_gap: u64,
    /// Decoded chunks held while they wait for their turn in volume order.
    pub buffer: u64,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self {
            concurrency: 4,
            max_read: 80 << 20,
            max_gap: 4 << 20,
            buffer: 64 << 20,
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
    /// Of those, bytes of blobs not needed that reads spanned to join needed ones.
    pub skipped: u64,
    /// The most bytes of decoded chunks held at once (see [`RestoreOptions::buffer`]).
    pub peak_held: u64,
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
