//! The family index: every blob of a family's packs by hash, with a local cache file.
//!
//! A writer asks it whether a chunk exists (deduplication without one request per chunk), a
//! reader where a chunk is, GC what each pack holds. It is built from the pack indexes (one
//! suffix read per pack) and cached in a local file, so a later open lists the packs (one
//! request per thousand) and reads only the indexes of packs it has not seen. A cache that is
//! missing, damaged or of another format is ignored and rebuilt; entries of packs that are no
//! longer listed are dropped, so a stale cache can cost reads, never a wrong answer.
//!
//! # Cache file layout (`CACHE_DIR/TARGET-HASH/FAMILY.idx`, little-endian)
//!
//! ```text
//! magic "ZEBUFIDX", version u32, pack count u32,
//! per pack: id u128 | size u64 | entry count u32 | entries (crate::pack layout, 56 bytes each)
//! crc32c u32 of everything before it
//! ```
//!
//! Written to a temporary file, fsync'ed and renamed over the old one: a crash leaves the old
//! cache or the new one, and a torn file fails its crc and is rebuilt.
//!
//! Memory: about 100 bytes per blob (1 MiB chunks: ~100 MiB per TiB of unique data).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path as FsPath, PathBuf};

use futures::{StreamExt, TryStreamExt};

use crate::error::{BackupError, Result};
use crate::ids::{ChunkHash, FamilyId, PackId};
use crate::pack::{self, ENTRY_LEN, IndexEntry, WrittenPack};
use crate::target::Target;

const MAGIC: &[u8; 8] = b"ZEBUFIDX";
const VERSION: u32 = 1;

/// One pack as the index knows it.
#[derive(Clone, Debug)]
pub struct PackMeta {
    pub id: PackId,
    pub size: u64,
    /// Server time of the upload, ms since the epoch (0 for packs this process just wrote).
    pub last_modified_ms: i64,
    /// Named by a GC condemnation: never deduplicated against, read only as a last resort.
    pub condemned: bool,
    pub entries: Vec<IndexEntry>,
}

/// Every blob of one family's packs.
#[derive(Debug, Default)]
pub struct FamilyIndex {
    packs: Vec<PackMeta>,
    by_hash: HashMap<ChunkHash, (u32, u32)>,
    /// Pack index reads the last load needed (the cache answered the rest).
    pub fetched: usize,
}

/// Where the cache of a family lives.
pub fn cache_path(cache_dir: &FsPath, target_url: &str, family: &FamilyId) -> PathBuf {
    let h = blake3::hash(target_url.as_bytes()).to_hex();
    cache_dir
        .join(&h.as_str()[..16])
        .join(format!("{family}.idx"))
}

impl FamilyIndex {
    /// Lists the family's packs and builds the index, reading the cache and then the indexes of
    /// packs the cache lacks (8 at a time). Packs in `condemned` are marked.
    pub async fn load(
        target: &Target,
        family: &FamilyId,
        cache: Option<&FsPath>,
        condemned: &HashSet<PackId>,
    ) -> Result<Self> {
        let listed: Vec<(PackId, u64, i64)> = target
            .list(&format!("families/{family}/packs"))
            .await?
            .into_iter()
            .filter_map(|m| {
                pack::pack_id_of(target.rel(&m.location))
                    .map(|id| (id, m.size, m.last_modified.timestamp_millis()))
            })
            .collect();
        let mut cached = cache.map(read_cache).unwrap_or_default();
        let mut packs = Vec::with_capacity(listed.len());
        let mut missing = Vec::new();
        for (id, size, lm) in listed {
            match cached.remove(&id) {
                Some((s, entries)) if s == size => packs.push(PackMeta {
                    id,
                    size,
                    last_modified_ms: lm,
                    condemned: condemned.contains(&id),
                    entries,
                }),
                _ => missing.push((id, size, lm)),
            }
        }
        let dropped = !cached.is_empty();
        let fetched = missing.len();
        let fetched_packs: Vec<PackMeta> = futures::stream::iter(missing)
            .map(|(id, size, lm)| async move {
                let key = pack::pack_key(target, family, id);
                let entries = pack::read_index(target, &key, size).await?;
                Ok::<_, BackupError>(PackMeta {
                    id,
                    size,
                    last_modified_ms: lm,
                    condemned: condemned.contains(&id),
                    entries,
                })
            })
            .buffer_unordered(8)
            .try_collect()
            .await?;
        packs.extend(fetched_packs);
        let mut idx = Self {
            packs,
            by_hash: HashMap::new(),
            fetched,
        };
        idx.rebuild_map();
        if let Some(path) = cache
            && (fetched > 0 || dropped)
            && let Err(e) = idx.save(path)
        {
            tracing::warn!(error = %e, "could not write the index cache (it will be rebuilt next time)");
        }
        Ok(idx)
    }

    fn rebuild_map(&mut self) {
        self.by_hash.clear();
        for (pi, p) in self.packs.iter().enumerate() {
            for (ei, e) in p.entries.iter().enumerate() {
                insert(&self.packs, &mut self.by_hash, e.hash, pi as u32, ei as u32);
            }
        }
    }

    /// Adds packs this process wrote.
    pub fn add_packs(&mut self, written: &[WrittenPack]) {
        for w in written {
            let pi = self.packs.len() as u32;
            self.packs.push(PackMeta {
                id: w.id,
                size: w.size,
                last_modified_ms: 0,
                condemned: false,
                entries: w.entries.clone(),
            });
            for (ei, e) in w.entries.iter().enumerate() {
                insert(&self.packs, &mut self.by_hash, e.hash, pi, ei as u32);
            }
        }
    }

    /// Whether a writer may deduplicate against this blob (it is in a pack no GC condemned).
    pub fn has(&self, hash: &ChunkHash) -> bool {
        self.by_hash
            .get(hash)
            .is_some_and(|&(pi, _)| !self.packs[pi as usize].condemned)
    }

    /// Where a blob is (a healthy pack if any has it).
    pub fn locate(&self, hash: &ChunkHash) -> Option<(&PackMeta, &IndexEntry)> {
        let &(pi, ei) = self.by_hash.get(hash)?;
        let p = &self.packs[pi as usize];
        Some((p, &p.entries[ei as usize]))
    }

    /// Every pack.
    pub fn packs(&self) -> &[PackMeta] {
        &self.packs
    }

    /// Blobs known.
    pub fn blob_count(&self) -> usize {
        self.by_hash.len()
    }

    /// Writes the cache file atomically.
    pub fn save(&self, path: &FsPath) -> Result<()> {
        let mut b = Vec::with_capacity(
            16 + self
                .packs
                .iter()
                .map(|p| 28 + p.entries.len() * ENTRY_LEN)
                .sum::<usize>(),
        );
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        for p in &self.packs {
            b.extend_from_slice(&p.id.0.to_le_bytes());
            b.extend_from_slice(&p.size.to_le_bytes());
            b.extend_from_slice(&(p.entries.len() as u32).to_le_bytes());
            for e in &p.entries {
                e.encode(&mut b);
            }
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        let dir = path.parent().ok_or_else(|| {
            BackupError::InvalidInput(format!("cache path {} has no folder", path.display()))
        })?;
        std::fs::create_dir_all(dir).map_err(|e| BackupError::io(dir.display(), e))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&b)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            std::fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            BackupError::io(path.display(), e)
        })
    }
}

fn insert(
    packs: &[PackMeta],
    by_hash: &mut HashMap<ChunkHash, (u32, u32)>,
    hash: ChunkHash,
    pi: u32,
    ei: u32,
) {
    match by_hash.get(&hash) {
        // A healthy copy beats a condemned one.
        Some(&(old, _)) if !packs[old as usize].condemned || packs[pi as usize].condemned => {}
        _ => {
            by_hash.insert(hash, (pi, ei));
        }
    }
}

/// The packs a cache file holds; empty when it is missing or damaged.
fn read_cache(path: &FsPath) -> HashMap<PackId, (u64, Vec<IndexEntry>)> {
    let Ok(b) = std::fs::read(path) else {
        return HashMap::new();
    };
    match parse_cache(&b) {
        Some(m) => m,
        None => {
            tracing::warn!(path = %path.display(), "index cache damaged: rebuilding it from the pack indexes");
            HashMap::new()
        }
    }
}

fn parse_cache(b: &[u8]) -> Option<HashMap<PackId, (u64, Vec<IndexEntry>)>> {
    if b.len() < 20 || &b[..8] != MAGIC {
        return None;
    }
    let (body, crc) = b.split_at(b.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().ok()?) {
        return None;
    }
    if u32::from_le_bytes(body[8..12].try_into().ok()?) != VERSION {
        return None;
    }
    let n = u32::from_le_bytes(body[12..16].try_into().ok()?) as usize;
    let mut at = 16;
    let mut out = HashMap::with_capacity(n);
    for _ in 0..n {
        let head = body.get(at..at + 28)?;
        let id = PackId(u128::from_le_bytes(head[..16].try_into().ok()?));
        let size = u64::from_le_bytes(head[16..24].try_into().ok()?);
        let count = u32::from_le_bytes(head[24..28].try_into().ok()?) as usize;
        at += 28;
        let raw = body.get(at..at + count * ENTRY_LEN)?;
        at += count * ENTRY_LEN;
        let entries = raw
            .chunks_exact(ENTRY_LEN)
            .map(IndexEntry::decode)
            .collect::<Option<Vec<_>>>()?;
        out.insert(id, (size, entries));
    }
    (at == body.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::{BlobKind, Codec};

    #[test]
    fn cache_round_trips_and_a_torn_cache_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x/f.idx");
        let mut idx = FamilyIndex::default();
        let e = |i: u8| IndexEntry {
            hash: ChunkHash([i; 32]),
            offset: 16,
            stored_len: 9,
            raw_len: 9,
            codec: Codec::Raw,
            kind: BlobKind::Data,
        };
        idx.add_packs(&[
            WrittenPack {
                id: PackId(1),
                size: 100,
                entries: vec![e(1), e(2)],
            },
            WrittenPack {
                id: PackId(2),
                size: 200,
                entries: vec![e(3)],
            },
        ]);
        idx.save(&path).unwrap();
        let got = read_cache(&path);
        assert_eq!(got.len(), 2);
        assert_eq!(got[&PackId(1)], (100, vec![e(1), e(2)]));
        let mut b = std::fs::read(&path).unwrap();
        let n = b.len();
        std::fs::write(&path, &b[..n - 10]).unwrap();
        assert!(read_cache(&path).is_empty());
        b[30] ^= 1;
        std::fs::write(&path, &b).unwrap();
        assert!(read_cache(&path).is_empty());
    }

    #[test]
    fn a_condemned_copy_is_never_offered_for_dedup_when_a_healthy_one_exists() {
        let e = IndexEntry {
            hash: ChunkHash([7; 32]),
            offset: 16,
            stored_len: 9,
            raw_len: 9,
            codec: Codec::Raw,
            kind: BlobKind::Data,
        };
        let mut idx = FamilyIndex::default();
        idx.packs.push(PackMeta {
            id: PackId(1),
            size: 1,
            last_modified_ms: 0,
            condemned: true,
            entries: vec![e],
        });
        idx.packs.push(PackMeta {
            id: PackId(2),
            size: 1,
            last_modified_ms: 0,
            condemned: false,
            entries: vec![e],
        });
        idx.rebuild_map();
        assert!(idx.has(&e.hash));
        assert_eq!(idx.locate(&e.hash).unwrap().0.id, PackId(2));
        idx.packs.remove(1);
        idx.rebuild_map();
        assert!(!idx.has(&e.hash), "only a condemned copy: must not dedup");
        assert!(
            idx.locate(&e.hash).is_some(),
            "but a reader may still find it"
        );
    }
}
