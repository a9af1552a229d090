//! Reading a consistent snapshot from one replica while the volume's I/O goes on, with
//! failover to another replica.
//!
//! A snapshot's layers never change while the head takes the volume's writes, so reading
//! them from a replica needs no pause of I/O. What can change them is a snapshot delete
//! (it merges a layer into its child) or a purge: [`SnapshotReader::check_unchanged`]
//! compares the chain's layer ids after the read with those before it, and a backup that
//! saw a change fails instead of committing a mix (its retry reads the merged chain).
//!
//! The reader holds one replica at a time. A window whose read fails is read again from the
//! next replica, once that replica's own chain for the snapshot (same names; its own ids and
//! extents) is loaded; every replica holds the same bytes for the snapshot, layer by layer,
//! because the engine takes snapshots on all of them and rebuilds copy layers whole. Only
//! when every replica has failed does the read fail.
//!
//! A read fails on a replica too when a block it sends fails its checksum there (bit rot,
//! which the replica marks) or does not match the CRC32C it came with: the window is then
//! read from the next replica, so a backup never stores a rotten block as good, and a block
//! bad on every replica fails the backup naming it.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::Mutex;

use crate::chain::{Chain, ChainError, resolve, union};
use crate::replica::{ReplicaError, ReplicaLink};

/// Why a snapshot cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("volume {volume}: snapshot {snapshot}: {source}")]
    Chain {
        volume: String,
        snapshot: String,
        #[source]
        source: ChainError,
    },
    #[error("volume {volume}: no replica could serve snapshot {snapshot} ({details})")]
    NoReplica {
        volume: String,
        snapshot: String,
        details: String,
    },
    #[error(
        "volume {volume}: the layers of snapshot {snapshot} changed while it was read on {replica} (a snapshot was deleted or merged); retry the backup"
    )]
    ChainChanged {
        volume: String,
        snapshot: String,
        replica: String,
    },
    #[error("volume {volume}: snapshot {snapshot}: {source}")]
    Replica {
        volume: String,
        snapshot: String,
        #[source]
        source: ReplicaError,
    },
}

/// One replica the reader uses: its link, its chain of the snapshot and the extents of each
/// of its layers.
struct Source {
    index: usize,
    link: ReplicaLink,
    chain: Chain,
    extents: Arc<Vec<Vec<Range<u64>>>>,
    /// Raised on every failover, so concurrent failures of one source fail over once.
    epoch: u64,
}

/// Reads one snapshot of one volume from its replicas.
pub struct SnapshotReader {
    volume: String,
    snapshot: String,
    addrs: Vec<String>,
    current: Mutex<Source>,
    /// The chain names every source must have (from the first source).
    names: Vec<String>,
    /// `(address, layer ids)` of every source used, for [`Self::check_unchanged`].
    used: std::sync::Mutex<Vec<(String, Vec<u64>)>>,
    bytes_read: AtomicU64,
    failovers: AtomicU64,
}

async fn load(index: usize, addr: &str, snapshot: &str) -> Result<Source, String> {
    let link = ReplicaLink::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let info = link.info().await.map_err(|e| e.to_string())?;
    if !info.open {
        return Err(format!("replica {addr} is closed"));
    }
    let chain = Chain::of(&info, snapshot).map_err(|e| format!("replica {addr}: {e}"))?;
    let mut extents = Vec::with_capacity(chain.names.len());
    for name in &chain.names {
        extents.push(link.list_extents(name).await.map_err(|e| e.to_string())?);
    }
    Ok(Source {
        index,
        link,
        chain,
        extents: Arc::new(extents),
        epoch: 0,
    })
}

impl SnapshotReader {
    /// Opens the snapshot on the first replica of `addrs` that has it whole.
    pub async fn open(
        volume: &str,
        snapshot: &str,
        addrs: &[String],
    ) -> Result<SnapshotReader, ReadError> {
        let mut problems = Vec::new();
        for (i, addr) in addrs.iter().enumerate() {
            match load(i, addr, snapshot).await {
                Ok(s) => {
                    tracing::info!(volume, snapshot, replica = %addr, layers = s.chain.names.len(), "reading the snapshot from this replica");
                    let names = s.chain.names.clone();
                    let used = vec![(addr.clone(), s.chain.ids.clone())];
                    return Ok(SnapshotReader {
                        volume: volume.to_string(),
                        snapshot: snapshot.to_string(),
                        addrs: addrs.to_vec(),
                        current: Mutex::new(s),
                        names,
                        used: std::sync::Mutex::new(used),
                        bytes_read: AtomicU64::new(0),
                        failovers: AtomicU64::new(0),
                    });
                }
                Err(why) => problems.push(why),
            }
        }
        // One clear reason when every replica says the snapshot is missing.
        if !addrs.is_empty()
            && problems
                .iter()
                .all(|p| p.contains("does not exist on the replica"))
        {
            return Err(ReadError::Chain {
                volume: volume.to_string(),
                snapshot: snapshot.to_string(),
                source: ChainError::NoSnapshot(snapshot.to_string()),
            });
        }
        Err(ReadError::NoReplica {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
            details: if problems.is_empty() {
                "the volume has no running replica".into()
            } else {
                problems.join("; ")
            },
        })
    }

    /// The snapshot's layer names, oldest first.
    pub fn layer_names(&self) -> &[String] {
        &self.names
    }

    /// The snapshot's size.
    pub async fn size(&self) -> u64 {
        self.current.lock().await.chain.size
    }

    /// Bytes received from replicas so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// How many times the reader moved to another replica.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// The byte ranges holding data in the snapshot, and, when `since` is an older snapshot
    /// of the same chain, only those written after it (the extents of the layers above it).
    /// `None` when `since` is not in the chain (deleted, or on another branch): the caller
    /// then reads everything.
    pub async fn extents_since(&self, since: Option<&str>) -> Option<Vec<Range<u64>>> {
        let s = self.current.lock().await;
        let from = match since {
            None => 0,
            Some(old) => s.chain.position(old)? + 1,
        };
        let lists: Vec<&[Range<u64>]> = s.extents[from..].iter().map(Vec::as_slice).collect();
        Some(union(&lists))
    }

    /// The snapshot's bytes in `window` (zeros where no layer holds data).
    pub async fn read(&self, window: Range<u64>) -> Result<Window, ReadError> {
        let mut failures = Vec::new();
        for _ in 0..=self.addrs.len() {
            let (link, names, extents, epoch, index) = {
                let s = self.current.lock().await;
                (
                    s.link.clone(),
                    s.chain.names.clone(),
                    s.extents.clone(),
                    s.epoch,
                    s.index,
                )
            };
            match read_window(&link, &names, &extents, window.clone()).await {
                Ok((data, n)) => {
                    self.bytes_read.fetch_add(n, Ordering::Relaxed);
                    return Ok(data);
                }
                Err(e) => {
                    tracing::warn!(volume = %self.volume, snapshot = %self.snapshot, replica = %link.addr(), "read failed: {e}");
                    failures.push(e.to_string());
                    self.fail_over(epoch, index, &mut failures).await?;
                }
            }
        }
        Err(ReadError::NoReplica {
            volume: self.volume.clone(),
            snapshot: self.snapshot.clone(),
            details: failures.join("; "),
        })
    }

    /// Moves to the next replica that has the snapshot, unless another read already did.
    async fn fail_over(
        &self,
        seen_epoch: u64,
        failed: usize,
        failures: &mut Vec<String>,
    ) -> Result<(), ReadError> {
        let mut s = self.current.lock().await;
        if s.epoch != seen_epoch {
            return Ok(());
        }
        let n = self.addrs.len();
        for step in 1..=n {
            let i = (failed + step) % n;
            let addr = &self.addrs[i];
            match load(i, addr, &self.snapshot).await {
                Ok(next) if next.chain.names == self.names => {
                    tracing::warn!(volume = %self.volume, snapshot = %self.snapshot, from = %self.addrs[failed], to = %addr, "continuing the read on another replica");
                    self.used
                        .lock()
                        .expect("invariant: used lock")
                        .push((addr.clone(), next.chain.ids.clone()));
                    let epoch = s.epoch + 1;
                    *s = next;
                    s.epoch = epoch;
                    self.failovers.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Ok(next) => failures.push(format!(
                    "replica {addr}: its chain of the snapshot is {:?}, not {:?}",
                    next.chain.names, self.names
                )),
                Err(why) => failures.push(why),
            }
        }
        Err(ReadError::NoReplica {
            volume: self.volume.clone(),
            snapshot: self.snapshot.clone(),
            details: failures.join("; "),
        })
    }

    /// Fails if a replica the read used now has other layers under the snapshot than when
    /// it started (a replica that no longer answers is skipped: it served nothing since).
    pub async fn check_unchanged(&self) -> Result<(), ReadError> {
        let used = self.used.lock().expect("invariant: used lock").clone();
        let current = self.current.lock().await.link.addr().to_string();
        for (addr, ids) in used {
            let now = match ReplicaLink::connect(&addr).await {
                Ok(l) => l.info().await,
                Err(e) => Err(e),
            };
            let info = match now {
                Ok(i) => i,
                Err(e) if addr != current => {
                    tracing::warn!(replica = %addr, "cannot re-check a replica the read left: {e}");
                    continue;
                }
                Err(e) => {
                    return Err(ReadError::Replica {
                        volume: self.volume.clone(),
                        snapshot: self.snapshot.clone(),
                        source: e,
                    });
                }
            };
            let same = Chain::of(&info, &self.snapshot).is_ok_and(|c| c.ids == ids);
            if !same {
                return Err(ReadError::ChainChanged {
                    volume: self.volume.clone(),
                    snapshot: self.snapshot.clone(),
                    replica: addr,
                });
            }
        }
        Ok(())
    }
}

/// One window of the snapshot as it came from a replica: the data pieces of its layers,
/// resolved through the chain (disjoint: each byte from the newest layer holding it), zeros
/// between them. Kept as received, so a chunk that one piece covers is handed on without a
/// copy (a replica streams whole extents in 1 MiB messages, which line up with the chunks
/// when an extent starts on a chunk boundary).
#[derive(Clone, Debug)]
pub struct Window {
    range: Range<u64>,
    /// Sorted by offset.
    pieces: Vec<(u64, Bytes)>,
}

impl Window {
    /// The bytes of `r`, a range inside the window.
    pub fn slice(&self, r: Range<u64>) -> Bytes {
        debug_assert!(self.range.start <= r.start && r.end <= self.range.end);
        // The first piece that ends after r.start.
        let first = self
            .pieces
            .partition_point(|(at, b)| at + b.len() as u64 <= r.start);
        if let Some((at, b)) = self.pieces.get(first)
            && *at <= r.start
            && r.end <= at + b.len() as u64
        {
            return b.slice((r.start - at) as usize..(r.end - at) as usize);
        }
        if self.pieces.get(first).is_none_or(|(at, _)| *at >= r.end) {
            return crate::backup_job::zeros((r.end - r.start) as usize);
        }
        let mut out = vec![0u8; (r.end - r.start) as usize];
        for (at, b) in &self.pieces[first..] {
            if *at >= r.end {
                break;
            }
            let from = r.start.max(*at);
            let to = r.end.min(at + b.len() as u64);
            out[(from - r.start) as usize..(to - r.start) as usize]
                .copy_from_slice(&b[(from - at) as usize..(to - at) as usize]);
        }
        Bytes::from(out)
    }
}

/// One window, resolved through the chain on one replica: its pieces and how many bytes
/// came over the wire.
async fn read_window(
    link: &ReplicaLink,
    names: &[String],
    extents: &[Vec<Range<u64>>],
    window: Range<u64>,
) -> Result<(Window, u64), ReplicaError> {
    let pieces = resolve(extents, window.clone());
    let mut by_layer: Vec<Vec<Range<u64>>> = vec![Vec::new(); names.len()];
    for (layer, r) in pieces {
        by_layer[layer].push(r);
    }
    let mut got = 0;
    let mut all = Vec::new();
    for (layer, ranges) in by_layer.iter().enumerate() {
        if ranges.is_empty() {
            continue;
        }
        let (pieces, n) = link
            .read_layer_pieces(&names[layer], ranges, &window)
            .await?;
        got += n;
        all.extend(pieces);
    }
    all.sort_by_key(|(at, _)| *at);
    Ok((
        Window {
            range: window,
            pieces: all,
        },
        got,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(range: Range<u64>, pieces: &[(u64, &[u8])]) -> Window {
        Window {
            range,
            pieces: pieces
                .iter()
                .map(|(at, b)| (*at, Bytes::copy_from_slice(b)))
                .collect(),
        }
    }

    /// The window's bytes the slow way: zeros, then every piece copied in.
    fn flat(w: &Window) -> Vec<u8> {
        let mut out = vec![0u8; (w.range.end - w.range.start) as usize];
        for (at, b) in &w.pieces {
            let s = (at - w.range.start) as usize;
            out[s..s + b.len()].copy_from_slice(b);
        }
        out
    }

    #[test]
    fn a_slice_one_piece_covers_is_that_piece_and_others_are_assembled_with_zeros() {
        let w = window(
            100..200,
            &[(100, &[1; 10]), (110, &[2; 10]), (150, &[3; 20])],
        );
        let whole = flat(&w);
        for start in 100..200u64 {
            for end in start + 1..=200 {
                assert_eq!(
                    w.slice(start..end),
                    whole[(start - 100) as usize..(end - 100) as usize],
                    "{start}..{end}"
                );
            }
        }
        // Covered by one piece: a view of its buffer, not a copy.
        let piece = &w.pieces[2].1;
        let s = w.slice(155..165);
        assert_eq!(s.as_ptr(), piece[5..].as_ptr());
        // No pieces at all: zeros.
        let empty = window(0..8, &[]);
        assert_eq!(empty.slice(0..8), vec![0u8; 8]);
    }
}
