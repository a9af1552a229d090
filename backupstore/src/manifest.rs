//! Manifests, and the layout of the whole store.
//!
//! # Store layout (keys under the target's prefix)
//!
//! ```text
//! zebu-backupstore.json                       format marker (create-only, never rewritten)
//! families/FAMILY/packs/PACKID.pack           packs: blobs + index (see crate::pack)
//! families/FAMILY/backups/NAME.manifest       one manifest per backup (JSON, below)
//! families/FAMILY/sessions/SESSIONID.json     a running writer's marker (see crate::gc)
//! families/FAMILY/gc/condemned-ID.json        packs a GC pass found dead (see crate::gc)
//! families/FAMILY/gc/lease-GEN.json           the GC lease of the family (see crate::gc)
//! ```
//!
//! A family (a volume, its clones and restores) is the unit of deduplication and of GC: its
//! packs hold every blob its backups reference, and nothing outside the family refers to them.
//!
//! # Manifest (JSON)
//!
//! The backup's identity (family, name, volume, snapshot, parent, labels, created time), its
//! volume size and chunk size, statistics, and `pages`: the hash of each non-empty chunk-map
//! page by page index (see [`crate::map`]). Its size is about 80 bytes per GiB of volume, not
//! per chunk, and it never repeats a parent's block list: unchanged pages are shared by hash.
//!
//! # Commit point
//!
//! A backup exists exactly when its manifest does. The writer uploads every pack (blobs and
//! map pages) first, waits until all are complete, and then puts the manifest with a
//! create-only put ([`crate::target::Target::put_create`]). Before that put nothing lists the
//! backup; a crash before it leaves only packs (reused by a retry, else removed by GC); a
//! crash after it leaves a complete backup. An existing manifest is never overwritten:
//! deleting a backup deletes its manifest and nothing else.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{BackupError, Result};
use crate::ids::{BackupName, ChunkHash, FamilyId};

/// The manifest format this build writes and the newest it reads.
pub const FORMAT: u32 = 1;

/// One backup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub family: FamilyId,
    pub name: BackupName,
    /// The volume backed up (informational: restores may go to any volume).
    pub volume: String,
    /// The snapshot it was read from.
    pub snapshot: String,
    /// The backup this one was made incrementally from, if any.
    pub parent: Option<BackupName>,
    pub volume_size: u64,
    pub chunk_size: u64,
    pub page_chunks: u64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Milliseconds since the Unix epoch, by the writer's clock.
    pub created_unix_ms: u64,
    pub stats: BackupStats,
    /// Non-empty chunk-map pages, ascending by index.
    pub pages: Vec<PageRef>,
}

/// A chunk-map page of a manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRef {
    pub index: u64,
    pub hash: ChunkHash,
    /// Chunks in the page.
    pub chunks: u32,
}

/// What a backup holds and what making it cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupStats {
    /// Non-hole chunks in the backup.
    pub chunks: u64,
    /// Their bytes (uncompressed).
    pub bytes: u64,
    /// Chunks handed to the writer (changed since the parent).
    pub chunks_given: u64,
    /// Of those, all-zero ones (stored as holes).
    pub zero_chunks: u64,
    /// Of those, chunks the store already had (deduplicated, nothing uploaded).
    pub dedup_chunks: u64,
    /// New blobs uploaded (data and map pages).
    pub new_blobs: u64,
    /// Their stored (compressed) bytes.
    pub new_stored_bytes: u64,
    /// Packs uploaded.
    pub packs: u64,
}

impl Manifest {
    /// The number of chunk slots of the volume.
    pub fn chunk_count(&self) -> u64 {
        self.volume_size.div_ceil(self.chunk_size)
    }

    pub(crate) fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec_pretty(self).expect("invariant: a manifest serialises"))
    }

    pub(crate) fn from_bytes(object: &str, b: &[u8]) -> Result<Self> {
        #[derive(Deserialize)]
        struct Version {
            format: u32,
        }
        let corrupt = |e: serde_json::Error| BackupError::CorruptObject {
            object: object.to_string(),
            reason: e.to_string(),
        };
        let v: Version = serde_json::from_slice(b).map_err(corrupt)?;
        if v.format > FORMAT {
            return Err(BackupError::UnsupportedFormat {
                object: object.to_string(),
                found: v.format,
                supported: FORMAT,
            });
        }
        let m: Self = serde_json::from_slice(b).map_err(corrupt)?;
        let sane = m.chunk_size > 0
            && m.page_chunks > 0
            && m.pages.windows(2).all(|w| w[0].index < w[1].index)
            && m.pages
                .last()
                .is_none_or(|p| p.index * m.page_chunks < m.chunk_count());
        if !sane {
            return Err(BackupError::CorruptObject {
                object: object.to_string(),
                reason: "inconsistent page list".into(),
            });
        }
        Ok(m)
    }
}

/// The key of a manifest, relative to the store root.
pub fn manifest_rel(family: &FamilyId, name: &BackupName) -> String {
    format!("families/{family}/backups/{name}.manifest")
}
