//! [`BackupStore`]: the entry point that ties target, index, writer, reader and GC together.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::blob::Codec;
use crate::error::{BackupError, Result};
use crate::gc::{self, GcOptions, GcOutcome};
use crate::ids::{BackupName, FamilyId, PackId};
use crate::index::{self, FamilyIndex};
use crate::manifest::{self, Manifest};
use crate::pack::PackLimits;
use crate::reader::{self, ManifestDiff, RestoreOptions};
use crate::restore::{Plan, RestoreStream};
use crate::session::{Session, SessionTimes};
use crate::target::{Target, TargetConfig};
use crate::writer::{BackupSpec, BackupWriter, WriterSettings};

/// The chunk size of new backups: 1 MiB.
///
/// Why 1 MiB: a chunk is the unit an incremental backup reads and uploads, so small random
/// writes (a database's) cost a chunk each; at 1 MiB, 2,000 random 4 KiB writes over 4 GiB
/// touch ~1.5 GiB of chunks, at 4 MiB almost all of it. Below 1 MiB the per-chunk costs grow
/// (index memory ~100 bytes per chunk, a map entry of 36 bytes per chunk, more hashing calls
/// and smaller compression windows) while packs keep the object count independent of it.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;

const CONFIG_KEY: &str = "zebu-backupstore.json";

/// Settings of a store handle.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Where family index caches live; `None` keeps no cache (every open reads every pack
    /// index once).
    pub cache_dir: Option<PathBuf>,
    pub chunk_size: u64,
    pub codec: Codec,
    /// Hashing/compression workers of a writer.
    pub workers: usize,
    pub packs: PackLimits,
    pub sessions: SessionTimes,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            cache_dir: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            codec: Codec::Zstd,
            workers: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 8),
            packs: PackLimits::default(),
            sessions: SessionTimes::default(),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct StoreConfig {
    format: u32,
}

/// A backup store on one target.
///
/// Cheap to share (`Arc` inside); every method takes `&self`.
#[derive(Clone)]
pub struct BackupStore {
    target: Arc<Target>,
    opts: StoreOptions,
}

/// What the objects of a store add up to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    pub objects: u64,
    pub bytes: u64,
    pub packs: u64,
    pub manifests: u64,
}

impl BackupStore {
    /// Opens (and checks) the target, creating the store's format marker on first use.
    pub async fn open(cfg: &TargetConfig, opts: StoreOptions) -> Result<Self> {
        let target = Target::open(cfg).await?;
        let key = target.key(CONFIG_KEY);
        let body = match target.get(&key).await? {
            Some(b) => b,
            None => {
                let b = Bytes::from(
                    serde_json::to_vec(&StoreConfig {
                        format: manifest::FORMAT,
                    })
                    .expect("invariant: serialises"),
                );
                target.put_create(&key, b.clone()).await?;
                target.get(&key).await?.unwrap_or(b)
            }
        };
        let c: StoreConfig =
            serde_json::from_slice(&body).map_err(|e| BackupError::CorruptObject {
                object: CONFIG_KEY.into(),
                reason: e.to_string(),
            })?;
        if c.format > manifest::FORMAT {
            return Err(BackupError::UnsupportedFormat {
                object: CONFIG_KEY.into(),
                found: c.format,
                supported: manifest::FORMAT,
            });
        }
        if opts.chunk_size == 0 || opts.chunk_size > 16 << 20 {
            return Err(BackupError::InvalidInput(
                "chunk size must be 1 byte to 16 MiB".into(),
            ));
        }
        Ok(Self {
            target: Arc::new(target),
            opts,
        })
    }

    /// The target.
    pub fn target(&self) -> &Target {
        &self.target
    }

    fn cache_for(&self, family: &FamilyId) -> Option<PathBuf> {
        self.opts
            .cache_dir
            .as_ref()
            .map(|d| index::cache_path(d, self.target.url(), family))
    }

    async fn condemned(&self, family: &FamilyId) -> Result<HashSet<PackId>> {
        let mut out = HashSet::new();
        for m in self.target.list(&format!("families/{family}/gc")).await? {
            if !self
                .target
                .rel(&m.location)
                .rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("condemned-"))
            {
                continue;
            }
            #[derive(Deserialize)]
            struct C {
                packs: Vec<String>,
            }
            if let Some(b) = self.target.get(&m.location).await?
                && let Ok(c) = serde_json::from_slice::<C>(&b)
            {
                out.extend(c.packs.iter().filter_map(|s| PackId::from_hex(s)));
            }
        }
        Ok(out)
    }

    /// Loads a family's index (cache first).
    pub async fn family_index(&self, family: &FamilyId) -> Result<FamilyIndex> {
        let condemned = self.condemned(family).await?;
        FamilyIndex::load(
            &self.target,
            family,
            self.cache_for(family).as_deref(),
            &condemned,
        )
        .await
    }

    /// Families with anything stored.
    pub async fn families(&self) -> Result<Vec<FamilyId>> {
        Ok(self
            .target
            .list_dirs("families")
            .await?
            .into_iter()
            .filter_map(|f| FamilyId::new(f).ok())
            .collect())
    }

    /// Every backup of a family (or of all families), oldest first.
    pub async fn list_backups(&self, family: Option<&FamilyId>) -> Result<Vec<Manifest>> {
        let families = match family {
            Some(f) => vec![f.clone()],
            None => self.families().await?,
        };
        let mut out = Vec::new();
        for f in families {
            for m in self.target.list(&format!("families/{f}/backups")).await? {
                let rel = self.target.rel(&m.location).to_string();
                if !rel.ends_with(".manifest") {
                    continue;
                }
                if let Some(b) = self.target.get(&m.location).await? {
                    out.push(Manifest::from_bytes(&rel, &b)?);
                }
            }
        }
        out.sort_by(|a, b| (a.created_unix_ms, &a.name).cmp(&(b.created_unix_ms, &b.name)));
        Ok(out)
    }

    /// One backup.
    pub async fn get_backup(&self, family: &FamilyId, name: &BackupName) -> Result<Manifest> {
        let rel = manifest::manifest_rel(family, name);
        match self.target.get(&self.target.key(&rel)).await? {
            Some(b) => Manifest::from_bytes(&rel, &b),
            None => Err(BackupError::BackupNotFound {
                family: family.clone(),
                name: name.clone(),
            }),
        }
    }

    /// Deletes a backup: its manifest only (one request, no memory per block). Its chunks go
    /// when a GC finds nothing else uses them.
    pub async fn delete_backup(&self, family: &FamilyId, name: &BackupName) -> Result<()> {
        let key = self.target.key(&manifest::manifest_rel(family, name));
        if self.target.head(&key).await?.is_none() {
            return Err(BackupError::BackupNotFound {
                family: family.clone(),
                name: name.clone(),
            });
        }
        self.target.delete(&key).await?;
        tracing::info!(%family, backup = %name, "backup deleted");
        Ok(())
    }

    /// Starts writing a backup. The session is registered before anything is read, so a GC
    /// running meanwhile keeps every pack this backup may reference (see [`crate::gc`]).
    pub async fn begin_backup(&self, spec: BackupSpec) -> Result<BackupWriter> {
        if spec.volume_size == 0 {
            return Err(BackupError::InvalidInput("volume size is 0".into()));
        }
        let session = Session::start(
            self.target.clone(),
            &spec.family,
            spec.name.as_str(),
            self.opts.sessions,
        )
        .await?;
        let existing = self
            .target
            .key(&manifest::manifest_rel(&spec.family, &spec.name));
        if self.target.head(&existing).await?.is_some() {
            let _ = session.end().await;
            return Err(BackupError::BackupExists {
                family: spec.family.clone(),
                name: spec.name.clone(),
            });
        }
        let index = match self.family_index(&spec.family).await {
            Ok(i) => i,
            Err(e) => {
                let _ = session.end().await;
                return Err(e);
            }
        };
        let parent = match &spec.parent {
            None => None,
            Some(p) => match self.get_backup(&spec.family, p).await {
                Ok(m) if m.chunk_size != self.opts.chunk_size => {
                    let _ = session.end().await;
                    return Err(BackupError::InvalidInput(format!(
                        "parent {p} has chunks of {} bytes, this store writes {}",
                        m.chunk_size, self.opts.chunk_size
                    )));
                }
                Ok(m) if m.volume_size != spec.volume_size && m.volume_size % m.chunk_size != 0 => {
                    let _ = session.end().await;
                    return Err(BackupError::InvalidInput(format!(
                        "parent {p} is of a volume of {} bytes (not a multiple of the chunk size) and the volume is now {}: take a full backup",
                        m.volume_size, spec.volume_size
                    )));
                }
                Ok(m) => Some(m),
                Err(e) => {
                    let _ = session.end().await;
                    return Err(e);
                }
            },
        };
        let settings = WriterSettings {
            chunk_size: self.opts.chunk_size,
            codec: self.opts.codec,
            workers: self.opts.workers,
            limits: self.opts.packs,
        };
        tracing::info!(family = %spec.family, backup = %spec.name, parent = ?spec.parent, packs_known = index.packs().len(),
            blobs_known = index.blob_count(), index_reads = index.fetched, "backup started");
        let cache = self.cache_for(&spec.family);
        Ok(BackupWriter::start(
            self.target.clone(),
            spec,
            parent,
            index,
            session,
            settings,
            cache,
        ))
    }

    /// Restores a whole backup (into a volume that reads as zeros: holes are not written).
    pub async fn restore(&self, m: &Manifest, opts: RestoreOptions) -> Result<RestoreStream> {
        let index = self.family_index(&m.family).await?;
        let chunks = reader::load_map(&self.target, m, &index).await?;
        self.start_restore(m, &index, chunks, Vec::new(), opts)
    }

    fn start_restore(
        &self,
        m: &Manifest,
        index: &FamilyIndex,
        chunks: Vec<(u64, crate::ids::ChunkHash)>,
        zeroed: Vec<u64>,
        opts: RestoreOptions,
    ) -> Result<RestoreStream> {
        let plan = Plan::new(m, index, chunks, zeroed, &opts)?;
        tracing::info!(family = %m.family, backup = %m.name, reads = plan.read_count(), "restore planned");
        Ok(RestoreStream::start(
            self.target.clone(),
            m.family.clone(),
            plan,
            opts,
        ))
    }

    /// `(chunk slot, hash)` of every non-hole chunk of a backup, ascending (reads the map
    /// pages only).
    pub async fn chunk_map(&self, m: &Manifest) -> Result<Vec<(u64, crate::ids::ChunkHash)>> {
        let index = self.family_index(&m.family).await?;
        reader::load_map(&self.target, m, &index).await
    }

    /// What differs from `from` to `to` (same family), reading only pages whose hashes differ.
    pub async fn diff(&self, from: &Manifest, to: &Manifest) -> Result<ManifestDiff> {
        let index = self.family_index(&to.family).await?;
        reader::diff(&self.target, from, to, &index).await
    }

    /// Turns a volume holding `from` into one holding `to`: only differing chunks are
    /// downloaded; chunks that became holes come as [`reader::RestoreItem::Zero`].
    pub async fn restore_diff(
        &self,
        from: &Manifest,
        to: &Manifest,
        opts: RestoreOptions,
    ) -> Result<RestoreStream> {
        let index = self.family_index(&to.family).await?;
        let d = reader::diff(&self.target, from, to, &index).await?;
        self.start_restore(to, &index, d.changed, d.zeroed, opts)
    }

    /// Reads every chunk of a backup and checks its hash; the error names the first bad
    /// object and chunk.
    pub async fn verify(&self, m: &Manifest, opts: RestoreOptions) -> Result<reader::RestoreStats> {
        let mut s = self.restore(m, opts).await?;
        while let Some(item) = s.next().await {
            item?;
        }
        Ok(s.stats())
    }

    /// One GC pass over a family (see [`crate::gc`]).
    pub async fn gc(&self, family: &FamilyId, opts: GcOptions) -> Result<GcOutcome> {
        let cache = self.cache_for(family);
        gc::run(
            self.target.clone(),
            family,
            opts,
            self.opts.sessions,
            self.opts.packs,
            cache.as_deref(),
        )
        .await
    }

    /// Counts the store's objects (listing everything: for tests and reports).
    pub async fn usage(&self) -> Result<StoreUsage> {
        let mut u = StoreUsage::default();
        for m in self.target.list("").await? {
            let rel = self.target.rel(&m.location);
            if rel.starts_with(".probe") {
                continue;
            }
            u.objects += 1;
            u.bytes += m.size;
            if rel.ends_with(".pack") {
                u.packs += 1;
            } else if rel.ends_with(".manifest") {
                u.manifests += 1;
            }
        }
        Ok(u)
    }
}
