//! Snapshot operations (create, delete by merging, revert, purge), expand, and the layer
//! access a rebuild needs (list extents, read a layer, write a layer).
//!
//! Every operation here holds `ops`, changes files first and commits with one metadata
//! write (see `meta.rs`), so a crash leaves it either done or not done:
//! - create: fsync the old head and its checksums, create the new head file, commit.
//!   Undone: the new file is a stray that `open` deletes.
//! - delete (merge S into its child C): copy S's data into C where C has none, fsync C,
//!   commit (C's parent becomes S's parent), delete S's file. A crash before the commit
//!   leaves S in place and C holding some of S's blocks, which read the same through either
//!   layer: nothing visible changed.
//! - revert: mark every region dirty, create the new head, commit, delete the old head.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use super::meta::{LayerMeta, now_rfc3339};
use zebu_proto::sums::BlockSums;

use super::{
    BLOCK_SIZE, CHUNK, ExtentMap, LayerId, LayerSpec, Replica, blocking, blocks, create_layer_file,
    fsops, index_below, io_err,
};
use crate::error::{ReplicaError, Result};
use crate::io::{AlignedBuf, CacheMode, DataFile};

/// Deletes a layer's data and checksum files (after the metadata stopped naming it).
async fn remove_layer_files(dir: &std::path::Path, id: LayerId) -> Result<()> {
    let paths = [super::layer_path(dir, id), super::sum_path(dir, id)];
    blocking("remove layer files", move || {
        for path in &paths {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                // A checksum file that was never made (a layer of format 1, removed before
                // its upgrade) is not an error.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ReplicaError::io(format!("remove {}", path.display()), e)),
            }
        }
        Ok(())
    })
    .await
}

/// Snapshot names end up in logs, file listings and URLs: keep them plain.
fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(ReplicaError::Invalid(format!(
            "snapshot name {name:?} must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

impl Replica {
    pub async fn snapshot_create(
        &self,
        name: &str,
        user_created: bool,
        labels: BTreeMap<String, String>,
    ) -> Result<()> {
        validate_name(name)?;
        let _ops = self.ops.lock().await;
        self.check_open()?;
        if self.meta().snapshot(name).is_some() {
            return Err(ReplicaError::SnapshotExists(name.to_string()));
        }
        let _g = self.gate.write().await;
        let old_head = self.chain().head;
        // The frozen layer's checksums are durable from the moment it exists (`sums.rs`), and
        // so are those of every flush so far: it may be recorded (`sumsync.rs`).
        self.sync_head().await?;
        self.regions.complete_flush(self.regions.flushed()).await?;
        let size = self.size();
        let (dir, new_id) = (self.dir.clone(), LayerId(self.meta().next_layer_id + 1));
        let cache = self.io.cache();
        let (new_file, new_sums) = blocking("create head", move || {
            create_layer_file(&dir, new_id, size, cache)
        })
        .await?;
        let name = name.to_string();
        self.commit_meta(|m| {
            let id = m.alloc_layer_id();
            debug_assert_eq!(id, new_id);
            let now = now_rfc3339();
            let old = m.layer_mut(old_head).expect("invariant: head in meta");
            old.name = Some(name.clone());
            old.user_created = user_created;
            old.labels = labels;
            old.created = now.clone();
            m.layers.push(LayerMeta {
                id,
                name: None,
                parent: Some(old_head),
                user_created: false,
                created: now,
                labels: BTreeMap::new(),
                size,
                incomplete: false,
                rebuilt: false,
                unverified: false,
            });
            m.head = id;
            Ok(())
        })
        .await?;
        let mut c = self.chain_mut();
        let frozen = std::mem::take(&mut c.head_extents);
        for (r, ()) in frozen.iter() {
            c.below.insert(r, old_head);
        }
        c.data_bytes.insert(old_head, frozen.covered() * BLOCK_SIZE);
        c.files.insert(new_id, new_file);
        c.sums.insert(new_id, new_sums);
        c.head = new_id;
        let n = c.rank.len();
        c.rank.insert(new_id, n);
        tracing::info!(snapshot = %name, layer = new_id.0, "snapshot created");
        Ok(())
    }

    pub async fn snapshot_delete(&self, name: &str) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        self.delete_locked(name).await
    }

    async fn delete_locked(&self, name: &str) -> Result<()> {
        let (s, children) = {
            let m = self.meta();
            let s = m
                .snapshot(name)
                .ok_or_else(|| ReplicaError::UnknownSnapshot(name.to_string()))?;
            (s.clone(), m.children(s.id))
        };
        match children.as_slice() {
            [] => {}
            [child] => self.merge(&s, *child).await?,
            many => {
                return Err(ReplicaError::Invalid(format!(
                    "snapshot {name:?} has {} child layers (a revert branched from it); delete the branch first",
                    many.len()
                )));
            }
        }
        let child = children.first().copied();
        self.commit_meta(|m| {
            if let Some(c) = child {
                m.layer_mut(c).expect("invariant: child in meta").parent = s.parent;
            }
            m.layers.retain(|l| l.id != s.id);
            Ok(())
        })
        .await?;
        self.rebuild_index().await?;
        {
            let mut c = self.chain_mut();
            c.files.remove(&s.id);
            c.sums.remove(&s.id);
            c.unverified.remove(&s.id);
        }
        remove_layer_files(&self.dir, s.id).await?;
        tracing::info!(snapshot = %name, "snapshot deleted");
        Ok(())
    }

    /// Copies the data of snapshot `s` into `child` wherever `child` has none, then makes
    /// `child` durable.
    async fn merge(&self, s: &LayerMeta, child: LayerId) -> Result<()> {
        let (from, to, into_head) = {
            let c = self.chain();
            (c.piece(s.id), c.piece(child), child == c.head)
        };
        let to_sums = self.chain().sums[&child].clone();
        let (s_file, c_file) = (from.file.clone(), to.file.clone());
        let sf = s_file.clone();
        let extents = blocking("scan snapshot", move || super::scan(&sf, u64::MAX)).await?;
        let mut child_has: ExtentMap<()> = if into_head {
            ExtentMap::new() // consulted under the gate instead, since the head changes
        } else {
            let cf = c_file.clone();
            let e = blocking("scan child", move || super::scan(&cf, u64::MAX)).await?;
            e.into_iter().fold(ExtentMap::new(), |mut m, r| {
                m.insert(blocks(&r), ());
                m
            })
        };
        for ext in extents {
            let mut at = ext.start;
            while at < ext.end {
                let chunk = at..(at + CHUNK).min(ext.end);
                at = chunk.end;
                // Into the head: exclusive gate per chunk, so no write lands between the check
                // and the copy; I/O waits for one chunk at most. Elsewhere the shared gate, so a
                // read that finds a block failing its checksum and looks again with the
                // exclusive gate sees no copy half done.
                let _g = if into_head {
                    Ok(self.gate.write().await)
                } else {
                    Err(self.gate.read().await)
                };
                self.check_open()?;
                let gaps: Vec<Range<u64>> = {
                    let c = self.chain();
                    let map = if into_head {
                        &c.head_extents
                    } else {
                        &child_has
                    };
                    map.segments(blocks(&chunk))
                        .into_iter()
                        .filter(|(_, v)| v.is_none())
                        .map(|(r, _)| r)
                        .collect()
                };
                for gap in gaps {
                    let bytes = super::to_bytes(gap.clone());
                    self.copy_range(&from, &c_file, &to_sums, bytes).await?;
                    if into_head {
                        self.chain_mut().head_extents.insert(gap, ());
                    } else {
                        child_has.insert(gap, ());
                    }
                }
            }
        }
        let (data, sums) = tokio::join!(self.io.sync(&c_file), self.sync_sums(&to_sums));
        data.map_err(io_err("fdatasync merge target"))?;
        sums.map_err(io_err("fdatasync the merge target's checksums"))
    }

    /// Copies `r` of layer `from` into `to`, checksums first (`sums.rs`): `from`'s stored
    /// sums when it has them, so a block that fails its checksum stays detectably bad in its
    /// new layer; computed from the data when `from` is unverified.
    async fn copy_range(
        &self,
        from: &super::Piece,
        to: &Arc<DataFile>,
        to_sums: &Arc<super::SumFile>,
        r: Range<u64>,
    ) -> Result<()> {
        let len = (r.end - r.start) as usize;
        let buf = self
            .io
            .read_at(&from.file, r.start, AlignedBuf::for_overwrite(len))
            .await
            .map_err(io_err(format!(
                "read {len} bytes at {} for a merge",
                r.start
            )))?;
        let sums = match &from.sums {
            Some(f) => {
                self.read_sums(f, r.start / BLOCK_SIZE, len / BLOCK_SIZE as usize)
                    .await?
            }
            None => BlockSums::of(&buf).expect("invariant: merges copy whole blocks"),
        };
        to_sums
            .write(r.start / BLOCK_SIZE, &sums)
            .map_err(io_err(format!(
                "write checksums at {} for a merge",
                r.start
            )))?;
        self.io
            .write_at(to, r.start, buf)
            .await
            .map_err(io_err(format!(
                "write {len} bytes at {} for a merge",
                r.start
            )))?;
        Ok(())
    }

    /// Rebuilds the extent indexes from the files after the chain changed shape.
    ///
    /// Only the snapshot part is rebuilt: writes to the head go on meanwhile (a merge into a
    /// snapshot, a rebuilt layer), and replacing the head's extents with a scan taken before
    /// such a write completed would lose it from the index. The caller holds `ops`, so no
    /// other operation changes the snapshot layers at the same time.
    async fn rebuild_index(&self) -> Result<()> {
        let meta = self.meta().clone();
        let files = self.chain().files.clone();
        let fresh = blocking("rebuild index", move || index_below(&meta, &files)).await?;
        let mut c = self.chain_mut();
        c.below = fresh.below;
        c.data_bytes = fresh.data_bytes;
        c.rank = fresh.rank;
        Ok(())
    }

    /// Makes the named snapshot the parent of a new, empty head; the old head is discarded.
    /// The engine stops the frontend first; I/O in flight is drained.
    pub async fn snapshot_revert(&self, name: &str) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let s = self
            .meta()
            .snapshot(name)
            .ok_or_else(|| ReplicaError::UnknownSnapshot(name.to_string()))?
            .id;
        let _g = self.gate.write().await;
        // Everything may read differently afterwards: mark it before anything changes.
        self.regions.mark_all_dirty(self.io.times()).await?;
        let size = self.size();
        let old_head = self.chain().head;
        let (dir, new_id) = (self.dir.clone(), LayerId(self.meta().next_layer_id + 1));
        let cache = self.io.cache();
        let (new_file, new_sums) = blocking("create head", move || {
            create_layer_file(&dir, new_id, size, cache)
        })
        .await?;
        self.commit_meta(|m| {
            let id = m.alloc_layer_id();
            m.layers.retain(|l| l.id != old_head);
            m.layers.push(LayerMeta {
                id,
                name: None,
                parent: Some(s),
                user_created: false,
                created: now_rfc3339(),
                labels: BTreeMap::new(),
                size,
                incomplete: false,
                rebuilt: false,
                unverified: false,
            });
            m.head = id;
            Ok(())
        })
        .await?;
        {
            // The gate is held: no write is in flight, so the head can be swapped here.
            let mut c = self.chain_mut();
            c.files.insert(new_id, new_file);
            c.sums.insert(new_id, new_sums);
            c.files.remove(&old_head);
            c.sums.remove(&old_head);
            c.unverified.remove(&old_head);
            c.head = new_id;
            c.head_extents = ExtentMap::new();
        }
        self.rebuild_index().await?;
        remove_layer_files(&self.dir, old_head).await?;
        tracing::info!(snapshot = %name, "reverted");
        Ok(())
    }

    /// Deletes every system snapshot that can be merged (one with at most one child).
    pub async fn snapshot_purge(&self) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        loop {
            let next = {
                let m = self.meta();
                m.layers
                    .iter()
                    .filter(|l| !l.user_created && l.id != m.head && m.children(l.id).len() <= 1)
                    .find_map(|l| l.name.clone())
            };
            let Some(name) = next else { return Ok(()) };
            self.delete_locked(&name).await?;
        }
    }

    /// Whether [`Replica::expand`] to `new_size` would succeed as far as can be known without
    /// changing anything: the size is valid, and the filesystem takes a (sparse) file that
    /// long, which a probe file shows (ext4 refuses files above 16 TiB with EFBIG).
    pub async fn expand_check(&self, new_size: u64) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        self.check_new_size(new_size)?;
        let probe = self.dir.join(EXPAND_PROBE);
        blocking("probe the filesystem's file size limit", move || {
            let r = std::fs::File::create(&probe).and_then(|f| f.set_len(new_size));
            let _ = std::fs::remove_file(&probe);
            r.map_err(|e| too_large(new_size, e))
        })
        .await
    }

    fn check_new_size(&self, new_size: u64) -> Result<()> {
        let size = self.size();
        if new_size < size || !new_size.is_multiple_of(BLOCK_SIZE) {
            return Err(ReplicaError::Invalid(format!(
                "new size {new_size} must be a multiple of {BLOCK_SIZE} and not below the current {size}"
            )));
        }
        // The region record keeps one number per region in memory and on disk, at the region
        // size chosen at creation: bounded, so a huge expansion cannot take all memory.
        let rs = self.regions.region_size();
        let limit = rs.saturating_mul(MAX_GROWN_REGIONS);
        if new_size > limit {
            return Err(ReplicaError::Invalid(format!(
                "new size {new_size} is above {limit} bytes, the most a replica with regions of \
                 {rs} bytes can grow to"
            )));
        }
        Ok(())
    }

    /// Grows the volume to `new_size` bytes (a multiple of the block size).
    pub async fn expand(&self, new_size: u64) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        self.check_new_size(new_size)?;
        let size = self.size();
        if new_size == size {
            return Ok(());
        }
        let _g = self.gate.write().await;
        let head = self.chain().head_file();
        blocking("grow head", move || {
            // A size the filesystem refuses changes nothing: the refusal is the request's.
            head.file()
                .set_len(new_size)
                .map_err(|e| too_large(new_size, e))?;
            head.file().sync_all().map_err(io_err("grow head"))
        })
        .await?;
        self.regions.grow(new_size)?;
        self.commit_meta(|m| {
            m.size = new_size;
            let h = m.head;
            m.layer_mut(h).expect("invariant: head in meta").size = new_size;
            Ok(())
        })
        .await?;
        self.size
            .store(new_size, std::sync::atomic::Ordering::Release);
        tracing::info!(from = size, to = new_size, "expanded");
        Ok(())
    }

    pub(super) fn layer_id(&self, layer: Option<&str>) -> Result<LayerId> {
        match layer {
            None | Some("") => Ok(self.meta().head),
            Some(n) => self
                .meta()
                .snapshot(n)
                .map(|l| l.id)
                .ok_or_else(|| ReplicaError::UnknownSnapshot(n.to_string())),
        }
    }

    /// Data extents of a layer (`None` = head) within `range`, in bytes, block aligned.
    pub async fn list_extents(
        &self,
        layer: Option<&str>,
        range: Range<u64>,
    ) -> Result<Vec<Range<u64>>> {
        self.check_open()?;
        let id = self.layer_id(layer)?;
        let (is_head, file) = {
            let c = self.chain();
            (id == c.head, c.files[&id].clone())
        };
        if is_head {
            let c = self.chain();
            return Ok(c
                .head_extents
                .segments(blocks(&(range.start / BLOCK_SIZE * BLOCK_SIZE..range.end)))
                .into_iter()
                .filter(|(_, v)| v.is_some())
                .map(|(r, _)| super::to_bytes(r))
                .collect());
        }
        blocking("list extents", move || {
            fsops::data_extents(file.file(), range, BLOCK_SIZE)
                .map_err(io_err("scan layer extents"))
        })
        .await
    }

    /// Ensures the snapshot layer described by `spec` exists (see `WriteLayerRequest` in the
    /// proto): an existing one must have the same parent; a new one is inserted in the head's
    /// chain as the parent of the layer whose parent is `spec.parent` now.
    pub async fn begin_layer(&self, spec: &LayerSpec) -> Result<()> {
        validate_name(&spec.name)?;
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let (existing, parent, child) = {
            let m = self.meta();
            let parent = if spec.parent.is_empty() {
                None
            } else {
                Some(
                    m.snapshot(&spec.parent)
                        .ok_or_else(|| ReplicaError::UnknownSnapshot(spec.parent.clone()))?
                        .id,
                )
            };
            let child = m
                .chain()
                .into_iter()
                .find(|id| m.layer(*id).is_some_and(|l| l.parent == parent));
            (m.snapshot(&spec.name).map(|l| l.parent), parent, child)
        };
        if let Some(p) = existing {
            return if p == parent {
                Ok(())
            } else {
                Err(ReplicaError::Invalid(format!(
                    "snapshot {:?} exists with another parent than {:?}",
                    spec.name, spec.parent
                )))
            };
        }
        let child = child.ok_or_else(|| {
            ReplicaError::Invalid(format!(
                "no layer in the head's chain has parent {:?}",
                spec.parent
            ))
        })?;
        let size = if spec.size == 0 {
            self.size()
        } else {
            spec.size.min(self.size())
        };
        let (dir, id) = (self.dir.clone(), LayerId(self.meta().next_layer_id + 1));
        // Direct I/O whatever the head's cache mode: a layer written here is a whole snapshot
        // streamed in large pieces (a restore, a rebuild), read later as every snapshot layer
        // is (`DataFile::open_read_only`, direct too). Through the page cache, a restore of
        // 2 GiB into three replicas put 6 GiB of dirty pages through reclaim and writeback,
        // and cost the replicas twice the CPU when the page cache was already full
        // (benches/README.md, "Layers written with direct I/O").
        let (file, sums) = blocking("create layer", move || {
            create_layer_file(&dir, id, size, CacheMode::Direct)
        })
        .await?;
        let spec = spec.clone();
        self.commit_meta(|m| {
            let new = m.alloc_layer_id();
            m.layer_mut(child).expect("invariant: child in meta").parent = Some(new);
            m.layers.push(LayerMeta {
                id: new,
                name: Some(spec.name.clone()),
                parent,
                user_created: spec.user_created,
                created: if spec.created.is_empty() {
                    now_rfc3339()
                } else {
                    spec.created.clone()
                },
                labels: spec.labels.clone(),
                size,
                incomplete: true,
                rebuilt: true,
                unverified: false,
            });
            Ok(())
        })
        .await?;
        {
            let mut c = self.chain_mut();
            c.files.insert(id, file);
            c.sums.insert(id, sums);
        }
        // Ranks shift: the new layer sits below `child`. It holds no data yet.
        self.rebuild_index().await
    }

    /// Writes rebuild (or repair) data into snapshot `name` (created by `begin_layer`), with
    /// the checksums the source stores for it (`sums`: none, the target computes them).
    /// Every block not listed in `corrupt` (blocks that failed their checksum on the source,
    /// copied as they are) must match its sum: a copy damaged on the way is refused with
    /// nothing written.
    pub async fn write_layer(
        &self,
        name: &str,
        offset: u64,
        data: Bytes,
        sums: Option<BlockSums>,
        corrupt: &[u32],
    ) -> Result<()> {
        check_aligned(offset, data.len() as u64)?;
        let sums = match sums {
            None => BlockSums::of(&data).expect("invariant: aligned and not empty"),
            Some(s) => {
                if s.len() as u64 * BLOCK_SIZE != data.len() as u64 {
                    return Err(ReplicaError::Invalid(format!(
                        "{} checksums for {} bytes of layer data at {offset}",
                        s.len(),
                        data.len()
                    )));
                }
                let damaged: Vec<u64> = s
                    .mismatches(&data)
                    .into_iter()
                    .filter(|i| !corrupt.contains(i))
                    .map(|i| offset + u64::from(i) * BLOCK_SIZE)
                    .collect();
                if !damaged.is_empty() {
                    return Err(ReplicaError::ChecksumMismatch {
                        offset,
                        length: data.len() as u64,
                        blocks: damaged,
                    });
                }
                s
            }
        };
        let _ops = self.ops.lock().await;
        // Shared: a read that looks again with the exclusive gate sees no copy half done.
        let _g = self.gate.read().await;
        self.check_open()?;
        let id = self.layer_id(Some(name))?;
        self.check_layer_range(id, offset, data.len() as u64)?;
        let (file, sum_file) = {
            let c = self.chain();
            (c.files[&id].clone(), c.sums[&id].clone())
        };
        let len = data.len();
        sum_file
            .write(offset / BLOCK_SIZE, &sums)
            .map_err(io_err(format!(
                "write {} checksums of {id} at {offset}",
                sums.len()
            )))?;
        self.io
            .write_bytes_at(&file, offset, data)
            .await
            .map_err(io_err(format!("write {len} bytes of {id} at {offset}")))?;
        let mut c = self.chain_mut();
        if let Some(&rank) = c.rank.get(&id) {
            let ranks = c.rank.clone();
            c.below
                .fill_under(blocks(&(offset..offset + len as u64)), id, |old| {
                    ranks[&old] < rank
                });
        }
        Ok(())
    }

    /// Makes a rebuilt layer durable.
    pub async fn finish_layer(&self, name: &str) -> Result<()> {
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let id = self.layer_id(Some(name))?;
        let (file, sums) = {
            let c = self.chain();
            (c.files[&id].clone(), c.sums[&id].clone())
        };
        let (d, s) = tokio::join!(self.io.sync(&file), self.sync_sums(&sums));
        d.map_err(io_err(format!("fdatasync {id}")))?;
        s.map_err(io_err(format!("fdatasync the checksums of {id}")))?;
        let f = file.clone();
        let incomplete = self.meta().layer(id).is_some_and(|l| l.incomplete);
        if incomplete {
            self.commit_meta(|m| {
                m.layer_mut(id)
                    .expect("invariant: layer in meta")
                    .incomplete = false;
                Ok(())
            })
            .await?;
        }
        let bytes: u64 = blocking("scan layer", move || super::scan(&f, u64::MAX))
            .await?
            .iter()
            .map(|r| r.end - r.start)
            .sum();
        self.chain_mut().data_bytes.insert(id, bytes);
        Ok(())
    }
}

/// The most regions a replica may have after expansions: four times what a new replica is
/// given (`regions::MAX_REGIONS`), 32 MiB of region record.
const MAX_GROWN_REGIONS: u64 = 4 * super::regions::MAX_REGIONS;

/// The probe file of [`Replica::expand_check`]; `open` deletes one a crash left.
pub(super) const EXPAND_PROBE: &str = "expand-probe.tmp";

/// A failed `set_len(size)`: EFBIG (and EINVAL) mean the filesystem cannot hold a file that
/// long, a refusal of the size rather than a failure of the replica.
fn too_large(size: u64, e: std::io::Error) -> ReplicaError {
    match e.raw_os_error() {
        Some(libc::EFBIG) | Some(libc::EINVAL) => ReplicaError::Invalid(format!(
            "the replica's filesystem cannot hold a volume of {size} bytes ({e})"
        )),
        _ => ReplicaError::io(format!("grow to {size} bytes"), e),
    }
}

pub(super) fn check_aligned(offset: u64, len: u64) -> Result<()> {
    if !offset.is_multiple_of(BLOCK_SIZE) || !len.is_multiple_of(BLOCK_SIZE) || len == 0 {
        return Err(ReplicaError::Invalid(format!(
            "layer I/O at {offset}+{len} must be a non-empty multiple of {BLOCK_SIZE} bytes"
        )));
    }
    Ok(())
}
