//! Zebu's backup store: deduplicated, compressed, verifiable backups of block volumes in an
//! S3 bucket or a directory. It knows nothing of engines, replicas or Kubernetes: the glue
//! (the manager's ops layer) reads a snapshot and feeds chunks in, or takes chunks out and
//! writes a volume.
//!
//! - [`BackupStore`] opens a target ([`TargetConfig`]: `s3://BUCKET@REGION/PREFIX` or
//!   `file:///PATH`) and lists, gets, deletes, restores, diffs, verifies and GCs backups.
//! - [`BackupWriter`] (from [`BackupStore::begin_backup`]) takes whole 1 MiB chunks of the
//!   blocks changed since a parent backup (and ranges now zero), hashes (blake3), skips
//!   chunks the family already has (a local index, not a request per chunk), compresses
//!   (zstd), packs them into ~64 MiB pack objects uploaded as they fill, and commits the
//!   backup with a create-only manifest put ([`manifest`] has the layout and commit point).
//! - [`RestoreStream`] (from [`BackupStore::restore`] / [`BackupStore::restore_diff`])
//!   hands back `(offsets, data)` in ascending offset order, each chunk downloaded once by
//!   large ranged reads planned per pack, several in flight, streamed and verified blob by
//!   blob against its hash, in memory bounded by [`RestoreOptions`] ([`restore`]).
//! - [`gc`] deletes unreferenced packs in two passes with a safety margin, safe against
//!   concurrent backups; [`plan_chunks`] turns changed and unmapped extents into the whole
//!   chunks to read.
//!
//! Formats: [`pack`] (packs and their indexes), [`map`] (chunk-map pages), [`manifest`]
//! (manifests and the store layout), [`index`] (the family index cache), [`session`]
//! (writer markers GC respects).
//!
//! ```no_run
//! # async fn demo() -> zebu_backupstore::Result<()> {
//! use zebu_backupstore::*;
//! let store = BackupStore::open(&TargetConfig::from_env("s3://backups@us-east-1/zebu"), StoreOptions::default()).await?;
//! let family = FamilyId::new("vol-a")?;
//!
//! // A full backup of a 4 MiB volume holding data in its first chunk only.
//! let mut w = store
//!     .begin_backup(BackupSpec {
//!         family: family.clone(),
//!         name: BackupName::new("b1")?,
//!         volume: "vol-a".into(),
//!         snapshot: "snap-1".into(),
//!         volume_size: 4 << 20,
//!         parent: None,
//!         labels: Default::default(),
//!     })
//!     .await?;
//! w.put_chunk(0, bytes::Bytes::from(vec![7u8; 1 << 20])).await?;
//! let b1 = w.commit().await?;
//!
//! // An incremental one: the glue knows what changed since snap-1 and what was unmapped.
//! let plan = plan_chunks(4 << 20, 1 << 20, &[(2 << 20) + 4096..(2 << 20) + 8192], &[0..(1 << 20)]);
//! let mut w = store
//!     .begin_backup(BackupSpec { name: BackupName::new("b2")?, snapshot: "snap-2".into(), parent: Some(b1.name.clone()), ..w_spec(&b1) })
//!     .await?;
//! for r in &plan.read {
//!     // read r from the snapshot, hand it over chunk by chunk
//!     # let data = bytes::Bytes::from(vec![1u8; (r.end - r.start) as usize]);
//!     for (i, c) in data.chunks(1 << 20).enumerate() {
//!         w.put_chunk(r.start + (i as u64) * (1 << 20), data.slice_ref(c)).await?;
//!     }
//! }
//! for z in &plan.zero {
//!     w.put_zero(z.clone())?;
//! }
//! let b2 = w.commit().await?;
//!
//! // Restore b2 into a fresh (zeroed) volume, sequentially.
//! let mut s = store.restore(&b2, RestoreOptions::default()).await?;
//! while let Some(item) = s.next().await {
//!     if let RestoreItem::Data { offsets, data } = item? {
//!         for o in offsets { /* write data at o */ let _ = (o, &data); }
//!     }
//! }
//! // A standby volume holding b1 catches up to b2 with only the differences.
//! let _catch_up = store.restore_diff(&b1, &b2, RestoreOptions::default()).await?;
//! # fn w_spec(m: &Manifest) -> BackupSpec { BackupSpec { family: m.family.clone(), name: m.name.clone(),
//! #   volume: m.volume.clone(), snapshot: m.snapshot.clone(), volume_size: m.volume_size, parent: None, labels: m.labels.clone() } }
//! # Ok(()) }
//! ```

pub mod blob;
pub mod error;
pub mod gc;
pub mod ids;
pub mod index;
pub mod manifest;
pub mod map;
pub mod pack;
pub mod plan;
pub mod reader;
pub mod restore;
pub mod session;
pub mod store;
pub mod target;
pub mod writer;

pub use blob::Codec;
pub use error::{BackupError, Result};
pub use gc::{GcOptions, GcOutcome, GcReport};
pub use ids::{BackupName, ChunkHash, FamilyId, PackId};
pub use manifest::{BackupStats, Manifest};
pub use pack::PackLimits;
pub use plan::{ChunkPlan, plan_chunks};
pub use reader::{ManifestDiff, RestoreItem, RestoreOptions, RestoreStats};
pub use restore::RestoreStream;
pub use session::SessionTimes;
pub use store::{BackupStore, DEFAULT_CHUNK_SIZE, StoreOptions, StoreUsage};
pub use target::{S3Settings, TargetConfig, TargetUrl};
pub use writer::{BackupSpec, BackupWriter, WriterProgress};

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
