//! Checksums beyond the read and write paths: settling after a crash, computing the sums of
//! layers that have none (an upgraded replica), the stored sums that catch-up compares, layer
//! reads that carry and check sums (rebuilds), and the scrub of a range.
//!
//! The rules these follow (what is durable when, why settling adopts) are in `sums.rs`.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use zebu_proto::sums::{BlockSums, ZERO_BLOCK_CRC, block_crc};

use super::{
    BLOCK_SIZE, CHUNK, LayerId, Piece, Replica, blocking, blocks, fsops, io_err, to_bytes,
};
use crate::error::{ReplicaError, Result};
use crate::io::AlignedBuf;

/// Adopted blocks remembered one by one (for reconcile); a crash that leaves more than this
/// many is logged, and the rest are not reported.
const MAX_ADOPTED_TRACKED: usize = 1 << 16;

/// One layer's raw bytes with their checksums, as a rebuild copies them.
#[derive(Debug, Clone)]
pub struct LayerData {
    pub data: Bytes,
    /// One per 4 KiB block: the stored checksum where the layer holds data (computed from
    /// the data in an unverified layer), the CRC32C of zeros in its holes.
    pub sums: BlockSums,
    /// Blocks (counted from the read's offset) that fail their stored checksum.
    pub corrupt: Vec<u32>,
}

/// A block that fails its checksum, found by a scrub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBlock {
    /// Snapshot name; empty for the head.
    pub layer: String,
    pub offset: u64,
    /// The volume reads this block from that layer.
    pub visible: bool,
}

/// What [`Replica::scrub`] found in a range.
#[derive(Debug, Clone, Default)]
pub struct ScrubReport {
    pub bad: Vec<BadBlock>,
    /// The checksum of each 4 KiB block of the range as the volume reads.
    pub sums: Vec<u32>,
    pub bytes_verified: u64,
    pub bytes_unverified: u64,
}

impl Replica {
    /// After an unclean stop: takes the checksum of every head block in a dirty region whose
    /// data does not match it from the data (`sums.rs`: "settling"). Runs in `open`, before
    /// the replica is shared.
    pub(super) async fn settle(&self) -> Result<()> {
        let (head, head_sums, verified) = {
            let c = self.chain();
            (
                c.head_file(),
                c.head_sums(),
                !c.unverified.contains(&c.head),
            )
        };
        if !verified {
            return Ok(()); // the background pass computes every sum of this head
        }
        let dirty = self.regions.dirty();
        if dirty.is_empty() {
            return Ok(());
        }
        let (rs, size) = (self.regions.region_size(), self.size());
        let mut scanned = 0u64;
        let mut adopted = Vec::new();
        for r in &dirty {
            let region = r * rs..((r + 1) * rs).min(size);
            let extents: Vec<Range<u64>> = self
                .chain()
                .head_extents
                .segments(blocks(&region))
                .into_iter()
                .filter(|(_, v)| v.is_some())
                .map(|(b, _)| to_bytes(b))
                .collect();
            for ext in extents {
                let mut at = ext.start;
                while at < ext.end {
                    let n = CHUNK.min(ext.end - at);
                    let data = self
                        .io
                        .read_at(&head, at, AlignedBuf::for_overwrite(n as usize))
                        .await
                        .map_err(io_err(format!("read {n} bytes at {at} to settle")))?;
                    let stored = self
                        .read_sums(&head_sums, at / BLOCK_SIZE, (n / BLOCK_SIZE) as usize)
                        .await?;
                    let bad = stored.mismatches(&data);
                    if !bad.is_empty() {
                        let fresh = BlockSums::of(&data).expect("invariant: whole blocks");
                        head_sums
                            .write(at / BLOCK_SIZE, &fresh)
                            .map_err(io_err(format!("write checksums at {at} to settle")))?;
                        adopted.extend(bad.iter().map(|&i| at / BLOCK_SIZE + u64::from(i)));
                    }
                    scanned += n;
                    at += n;
                }
            }
        }
        if !adopted.is_empty() {
            self.sync_sums(&head_sums)
                .await
                .map_err(io_err("fdatasync settled checksums"))?;
        }
        tracing::info!(
            dir = %self.dir.display(),
            regions = dirty.len(),
            scanned,
            adopted = adopted.len(),
            "settled the checksums of regions written since the last flush (unclean stop)"
        );
        if adopted.len() > MAX_ADOPTED_TRACKED {
            tracing::warn!(
                adopted = adopted.len(),
                "more adopted blocks than are tracked; reconcile is told of the first {MAX_ADOPTED_TRACKED}"
            );
        }
        self.adopted_total
            .store(adopted.len() as u64, Ordering::Relaxed);
        self.adopted
            .lock()
            .expect("invariant: adopted lock")
            .extend(adopted.into_iter().take(MAX_ADOPTED_TRACKED));
        Ok(())
    }

    /// A write replaced these blocks: they are no longer adopted.
    pub(super) fn forget_adopted(&self, bytes: Range<u64>) {
        if self.adopted_total.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut a = self.adopted.lock().expect("invariant: adopted lock");
        let gone: Vec<u64> = a.range(blocks(&bytes)).copied().collect();
        for b in gone {
            a.remove(&b);
        }
    }

    /// Blocks of `offset..offset+len` (indices from `offset`) adopted when settling.
    pub fn adopted_in(&self, offset: u64, len: u64) -> Vec<u32> {
        if self.adopted_total.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let first = offset / BLOCK_SIZE;
        self.adopted
            .lock()
            .expect("invariant: adopted lock")
            .range(blocks(&(offset..offset + len)))
            .map(|&b| (b - first) as u32)
            .collect()
    }

    /// Starts the background pass that computes the checksums of unverified layers.
    pub(super) fn spawn_sum_builder(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(r) = weak.upgrade() else { return };
                let next = r.meta().layers.iter().find(|l| l.unverified).map(|l| l.id);
                let Some(id) = next else {
                    tracing::info!(dir = %r.dir.display(), "every layer's checksums are computed");
                    return;
                };
                match r.build_layer_sums(id).await {
                    Ok(()) => {}
                    Err(ReplicaError::Closed) => return,
                    Err(e) => {
                        // The layer stays unverified; the next open tries again.
                        tracing::warn!(dir = %r.dir.display(), layer = id.0, "computing checksums failed: {e}");
                        return;
                    }
                }
            }
        });
    }

    /// Computes and stores the checksum of every data block of layer `id`, then marks it
    /// verified once the sums are durable. Chunk by chunk under `ops` (no merge or rebuild
    /// write meanwhile) and the gate (exclusive for the head, so no write interleaves).
    async fn build_layer_sums(&self, id: LayerId) -> Result<()> {
        let (file, sums, is_head) = {
            let c = self.chain();
            match (c.files.get(&id), c.sums.get(&id)) {
                (Some(f), Some(s)) => (f.clone(), s.clone(), c.head == id),
                _ => return Ok(()),
            }
        };
        let extents = if is_head {
            self.chain()
                .head_extents
                .iter()
                .map(|(r, ())| to_bytes(r))
                .collect()
        } else {
            let f = file.clone();
            blocking("scan layer", move || super::scan(&f, u64::MAX)).await?
        };
        let mut done = 0u64;
        for ext in extents {
            let mut at = ext.start;
            while at < ext.end {
                let n = CHUNK.min(ext.end - at);
                let _ops = self.ops.lock().await;
                let _g = if self.chain().head == id {
                    Ok(self.gate.write().await)
                } else {
                    Err(self.gate.read().await)
                };
                self.check_open()?;
                if !self.chain().files.contains_key(&id) {
                    return Ok(()); // deleted or reverted away meanwhile
                }
                let data = self
                    .io
                    .read_at(&file, at, AlignedBuf::for_overwrite(n as usize))
                    .await
                    .map_err(io_err(format!("read {n} bytes of {id} at {at}")))?;
                sums.write(
                    at / BLOCK_SIZE,
                    &BlockSums::of(&data).expect("invariant: whole blocks"),
                )
                .map_err(io_err(format!("write checksums of {id} at {at}")))?;
                done += n;
                at += n;
            }
        }
        self.sync_sums(&sums)
            .await
            .map_err(io_err(format!("fdatasync the checksums of {id}")))?;
        let _ops = self.ops.lock().await;
        self.check_open()?;
        if self.meta().layer(id).is_none() {
            return Ok(());
        }
        self.commit_meta(|m| {
            if let Some(l) = m.layer_mut(id) {
                l.unverified = false;
            }
            Ok(())
        })
        .await?;
        self.chain_mut().unverified.remove(&id);
        tracing::info!(dir = %self.dir.display(), layer = id.0, bytes = done, "checksums computed; reads from this layer are verified");
        Ok(())
    }

    /// The checksum of every 4 KiB block of a block-aligned range as the volume reads: the
    /// stored ones, the CRC32C of zeros for holes, computed from the data in unverified
    /// layers. No data is read for verified layers: this compares replicas, it does not check
    /// them (reads and scrubs do).
    async fn volume_sums(&self, range: Range<u64>) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(((range.end - range.start) / BLOCK_SIZE) as usize);
        let mut at = range.start;
        while at < range.end {
            let n = CHUNK.min(range.end - at);
            let _g = self.gate.read().await;
            self.check_open()?;
            let pieces = self.chain().resolve(at..at + n);
            for (r, p) in pieces {
                let count = ((r.end - r.start) / BLOCK_SIZE) as usize;
                match p {
                    None => out.extend(std::iter::repeat_n(ZERO_BLOCK_CRC, count)),
                    Some(Piece {
                        sums: Some(sums), ..
                    }) => out.extend(
                        self.read_sums(&sums, r.start / BLOCK_SIZE, count)
                            .await?
                            .iter(),
                    ),
                    Some(p) => {
                        let data = self
                            .io
                            .read_at(
                                &p.file,
                                r.start,
                                AlignedBuf::for_overwrite(count * BLOCK_SIZE as usize),
                            )
                            .await
                            .map_err(io_err(format!(
                                "read {} bytes at {}",
                                r.end - r.start,
                                r.start
                            )))?;
                        out.extend(data.chunks(BLOCK_SIZE as usize).map(block_crc));
                    }
                }
            }
            at += n;
        }
        Ok(out)
    }

    /// CRC32C of every `block`-byte piece of `offset..offset+len` as the volume reads (see
    /// `volume_sums`; pieces larger than 4 KiB combine their blocks' sums). Catch-up and
    /// reconcile compare these to copy only the blocks that differ.
    pub async fn checksums(&self, offset: u64, len: u64, block: u64) -> Result<Vec<u32>> {
        let block = if block == 0 { BLOCK_SIZE } else { block };
        if !block.is_multiple_of(BLOCK_SIZE)
            || !offset.is_multiple_of(block)
            || !len.is_multiple_of(block)
        {
            return Err(ReplicaError::Invalid(format!(
                "checksum range {offset}+{len} must be aligned to the checksum block {block}, a multiple of {BLOCK_SIZE}"
            )));
        }
        self.check_io(offset, len.max(1), false)?;
        let sums = self.volume_sums(offset..offset + len).await?;
        if block == BLOCK_SIZE {
            return Ok(sums);
        }
        let per = (block / BLOCK_SIZE) as usize;
        Ok(sums
            .chunks(per)
            .map(|c| {
                c.iter().skip(1).fold(c[0], |acc, &s| {
                    crc32c::crc32c_combine(acc, s, BLOCK_SIZE as usize)
                })
            })
            .collect())
    }

    /// Raw bytes of one layer (`None`: the head; zeros in its holes, not resolved through the
    /// chain) with their checksums, checked: what a rebuild copies. `offset` and `len` must
    /// be block aligned.
    pub async fn read_layer(
        &self,
        layer: Option<&str>,
        offset: u64,
        len: u64,
    ) -> Result<LayerData> {
        self.check_open()?;
        super::snapshot::check_aligned(offset, len)?;
        let id = self.layer_id(layer)?;
        self.check_layer_range(id, offset, len)?;
        let mut got = self.read_layer_once(id, offset, len, false).await?;
        if !got.corrupt.is_empty() {
            // As in `read_verified`: look again with no write or copy in flight.
            got = self.read_layer_once(id, offset, len, true).await?;
            self.corrupt_found
                .fetch_add(got.corrupt.len() as u64, Ordering::Relaxed);
        }
        Ok(got)
    }

    async fn read_layer_once(
        &self,
        id: LayerId,
        offset: u64,
        len: u64,
        exclusive: bool,
    ) -> Result<LayerData> {
        let _g = if exclusive {
            Ok(self.gate.write().await)
        } else {
            Err(self.gate.read().await)
        };
        self.check_open()?;
        let (piece, is_head) = {
            let c = self.chain();
            if !c.files.contains_key(&id) {
                return Err(ReplicaError::Invalid(format!("{id} no longer exists")));
            }
            (c.piece(id), c.head == id)
        };
        let data = self
            .io
            .read_at(&piece.file, offset, AlignedBuf::for_overwrite(len as usize))
            .await
            .map_err(io_err(format!("read {len} bytes of {id} at {offset}")))?;
        let extents = self
            .layer_extents(&piece, is_head, offset..offset + len)
            .await?;
        let count = (len / BLOCK_SIZE) as usize;
        let mut sums = vec![ZERO_BLOCK_CRC; count];
        let mut corrupt = Vec::new();
        for ext in extents {
            let (i, j) = (
                ((ext.start - offset) / BLOCK_SIZE) as usize,
                ((ext.end - offset) / BLOCK_SIZE) as usize,
            );
            let bytes = &data[i * BLOCK_SIZE as usize..j * BLOCK_SIZE as usize];
            match &piece.sums {
                Some(f) => {
                    let stored = self.read_sums(f, ext.start / BLOCK_SIZE, j - i).await?;
                    corrupt.extend(stored.mismatches(bytes).into_iter().map(|k| k + i as u32));
                    sums[i..j].copy_from_slice(&stored.to_vec());
                }
                None => {
                    for (k, c) in bytes.chunks(BLOCK_SIZE as usize).enumerate() {
                        sums[i + k] = block_crc(c);
                    }
                }
            }
        }
        corrupt.sort_unstable();
        Ok(LayerData {
            data: data.into_bytes(),
            sums: BlockSums::from_crcs(sums),
            corrupt,
        })
    }

    /// The data extents of one layer within `range` (bytes, block aligned).
    async fn layer_extents(
        &self,
        piece: &Piece,
        is_head: bool,
        range: Range<u64>,
    ) -> Result<Vec<Range<u64>>> {
        if is_head {
            return Ok(self
                .chain()
                .head_extents
                .segments(blocks(&range))
                .into_iter()
                .filter(|(_, v)| v.is_some())
                .map(|(b, _)| to_bytes(b))
                .collect());
        }
        let f = piece.file.clone();
        blocking("list extents", move || {
            fsops::data_extents(f.file(), range, BLOCK_SIZE).map_err(io_err("scan layer extents"))
        })
        .await
    }

    /// Verifies every data block of every layer in `offset..offset+len` (block aligned)
    /// against its stored checksum, and returns the volume's checksums of the range for
    /// comparison with other replicas. Holds `ops`, so no snapshot operation or rebuild
    /// write changes the layers meanwhile; head writes go on, and a head block that fails is
    /// looked at again with the exclusive gate, as reads do.
    pub async fn scrub(&self, offset: u64, len: u64) -> Result<ScrubReport> {
        super::snapshot::check_aligned(offset, len)?;
        self.check_io(offset, len, false)?;
        let _ops = self.ops.lock().await;
        self.check_open()?;
        let range = offset..offset + len;
        let mut report = ScrubReport {
            sums: self.volume_sums(range.clone()).await?,
            ..ScrubReport::default()
        };
        let layers: Vec<(LayerId, String)> = {
            let m = self.meta();
            m.layers
                .iter()
                .map(|l| (l.id, l.name.clone().unwrap_or_default()))
                .collect()
        };
        for (id, name) in layers {
            let (piece, is_head) = {
                let c = self.chain();
                (c.piece(id), c.head == id)
            };
            let extents = self.layer_extents(&piece, is_head, range.clone()).await?;
            let bytes: u64 = extents.iter().map(|r| r.end - r.start).sum();
            if piece.sums.is_none() {
                report.bytes_unverified += bytes;
                continue;
            }
            for ext in extents {
                let mut at = ext.start;
                while at < ext.end {
                    let n = CHUNK.min(ext.end - at);
                    let got = self
                        .read_layer(
                            Some(&name).filter(|n| !n.is_empty()).map(|n| n.as_str()),
                            at,
                            n,
                        )
                        .await?;
                    for i in got.corrupt {
                        let block = at + u64::from(i) * BLOCK_SIZE;
                        let visible = self
                            .chain()
                            .resolve(block..block + BLOCK_SIZE)
                            .first()
                            .and_then(|(_, p)| p.as_ref().map(|p| p.id))
                            == Some(id);
                        report.bad.push(BadBlock {
                            layer: name.clone(),
                            offset: block,
                            visible,
                        });
                    }
                    report.bytes_verified += n;
                    at += n;
                }
            }
        }
        if !report.bad.is_empty() {
            tracing::warn!(dir = %self.dir.display(), offset, len, bad = report.bad.len(), "scrub found blocks failing their checksum");
        }
        Ok(report)
    }
}
