//! Verified reads that heal: what the engine does when a replica answers a read CORRUPT.
//!
//! ```text
//!   read ──► one RW replica ──OK──► data
//!                 │
//!              CORRUPT (blocks b1, b2 fail their checksum there)
//!                 ▼
//!   gate (shared) + range lock on the whole blocks: no write to them in flight or starting
//!   read the range from every RW replica ──► per block, the first copy that passes
//!   rewrite every copy that failed, with the good data and its sums ──► data
//!   a block no copy of passes ──► BlockError::Medium (never the bad bytes)
//! ```
//!
//! Why under the range lock, and why read again rather than reuse the first answer: the
//! good copy must be the block's newest content, and the repair must not overwrite a write
//! that lands after it was read. With the range lock held, no write to these blocks is in
//! flight on any replica and none starts until the repair is written, so every RW replica
//! holds the same (newest) version and the repair writes exactly that version.
//!
//! A replica that does not keep checksums (an older build) is used as a source only for
//! blocks no checking replica holds a good copy of: its data cannot be checked, so it is the
//! last resort, as every replica was before checksums. Every repair is logged with the
//! volume, replica and offset, and counted ([`IntegrityCounters`], shown in the engine's
//! `Info`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use zebu_proto::sums::BlockSums;

use super::{BLOCK, PathError, Replica, Volume, VolumeError, timed};
use crate::blockdev::BlockError;

/// What checksums found since the engine started, for `Info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IntegrityCounters {
    /// Reads a replica answered CORRUPT.
    pub corrupt_reads: u64,
    /// Blocks rewritten on a replica from a good copy (one per replica and block).
    pub repaired_blocks: u64,
    /// Blocks no replica held a good copy of, each time one was found.
    pub unrecoverable_blocks: u64,
}

/// The counters behind [`IntegrityCounters`].
#[derive(Default)]
pub(super) struct Counters {
    corrupt_reads: AtomicU64,
    repaired: AtomicU64,
    unrecoverable: AtomicU64,
}

impl Counters {
    pub(super) fn corrupt_read(&self, volume: &str, replica: &str, offset: u64, blocks: &[u32]) {
        self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        let first = offset / BLOCK * BLOCK;
        let bad: Vec<u64> = blocks
            .iter()
            .map(|&b| first + u64::from(b) * BLOCK)
            .collect();
        tracing::warn!(
            volume,
            replica,
            ?bad,
            "blocks fail their checksum on a replica; repairing"
        );
    }

    pub(super) fn repaired(&self, n: u64) {
        self.repaired.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn lost(&self, n: u64) {
        self.unrecoverable.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> IntegrityCounters {
        IntegrityCounters {
            corrupt_reads: self.corrupt_reads.load(Ordering::Relaxed),
            repaired_blocks: self.repaired.load(Ordering::Relaxed),
            unrecoverable_blocks: self.unrecoverable.load(Ordering::Relaxed),
        }
    }
}

/// One replica's copy of a range, as read under the range lock.
struct Copy {
    replica: Arc<Replica>,
    data: Bytes,
    /// Per block: the copy failed its checksum there.
    bad: Vec<bool>,
}

impl Volume {
    pub fn integrity(&self) -> IntegrityCounters {
        self.integrity.snapshot()
    }

    /// Serves a read after a replica answered CORRUPT: the whole blocks covering it, read and
    /// repaired under the gate and the range lock (module docs).
    pub(super) async fn heal(&self, offset: u64, len: u64) -> Result<Bytes, BlockError> {
        let start = offset / BLOCK * BLOCK;
        let end = (offset + len).div_ceil(BLOCK) * BLOCK;
        let _g = self.gate.read().await;
        let _r = self.ranges.lock(start..end).await;
        let data = self.assemble(start, end - start).await?;
        let at = (offset - start) as usize;
        Ok(data.slice(at..at + len as usize))
    }

    /// Reads whole blocks `start..start+len` (at most one piece) verified: from one RW
    /// replica, or, if its copy fails a checksum, assembled and repaired from all of them.
    /// The caller holds the gate and the range lock.
    pub(super) async fn read_locked(&self, start: u64, len: u64) -> Result<Bytes, BlockError> {
        loop {
            let Some(r) = self.pick_reader() else {
                return Err(self.faulted());
            };
            r.inflight.fetch_add(1, Ordering::Relaxed);
            let got = tokio::time::timeout(
                self.config.io_timeout,
                r.data.read(self.next_id(), start, len),
            )
            .await;
            r.inflight.fetch_sub(1, Ordering::Relaxed);
            match got {
                Ok(Ok(data)) => return Ok(data),
                Ok(Err(PathError::Corrupt { blocks, .. })) => {
                    self.integrity
                        .corrupt_read(self.name(), &r.addr, start, &blocks);
                    return self.assemble(start, len).await;
                }
                Ok(Err(e)) => self.fail(&r, &format!("read: {e}")),
                Err(_) => self.fail(
                    &r,
                    &format!("read: no answer within {:?}", self.config.io_timeout),
                ),
            }
        }
    }

    /// Reads whole blocks from every RW replica, returns each block from a copy that passes
    /// its checksum, and rewrites the copies that failed. The caller holds the gate and the
    /// range lock.
    pub(super) async fn assemble(&self, start: u64, len: u64) -> Result<Bytes, BlockError> {
        let readers = self.with_mode(&[super::Mode::RW]);
        let n = (len / BLOCK) as usize;
        let reads = readers.iter().map(|r| {
            let (p, id, t) = (r.data.clone(), self.next_id(), self.config.io_timeout);
            async move { tokio::time::timeout(t, p.read(id, start, len)).await }
        });
        let results = futures::future::join_all(reads).await;
        let mut copies = Vec::new();
        for (r, res) in readers.iter().zip(results) {
            match res {
                Ok(Ok(data)) => copies.push(Copy {
                    replica: r.clone(),
                    data,
                    bad: vec![false; n],
                }),
                Ok(Err(PathError::Corrupt { data, blocks, .. })) if data.len() as u64 == len => {
                    let mut bad = vec![false; n];
                    for b in blocks {
                        if let Some(x) = bad.get_mut(b as usize) {
                            *x = true;
                        }
                    }
                    copies.push(Copy {
                        replica: r.clone(),
                        data,
                        bad,
                    });
                }
                Ok(Err(e)) => self.fail(r, &format!("read while repairing: {e}")),
                Err(_) => self.fail(r, "read while repairing: no answer within the I/O timeout"),
            }
        }
        if copies.is_empty() {
            self.commit_membership().await?;
            return Err(self.faulted());
        }
        // Checking replicas first; one that keeps no checksums only where none has a copy.
        let mut out = BytesMut::zeroed(len as usize);
        let mut lost = Vec::new();
        for i in 0..n {
            let pick = copies
                .iter()
                .find(|c| c.replica.verifies() && !c.bad[i])
                .or_else(|| copies.iter().find(|c| !c.replica.verifies()));
            let range = i * BLOCK as usize..(i + 1) * BLOCK as usize;
            match pick {
                Some(c) => out[range.clone()].copy_from_slice(&c.data[range]),
                None => lost.push(start + i as u64 * BLOCK),
            }
        }
        let out = out.freeze();
        let mut failed = false;
        for c in copies.iter().filter(|c| c.bad.iter().any(|&b| b)) {
            let mut i = 0;
            while i < n {
                if !c.bad[i] || lost.contains(&(start + i as u64 * BLOCK)) {
                    i += 1;
                    continue;
                }
                let first = i;
                while i < n && c.bad[i] && !lost.contains(&(start + i as u64 * BLOCK)) {
                    i += 1;
                }
                let (off, bytes) = (start + first as u64 * BLOCK, (i - first) as u64 * BLOCK);
                let data = out.slice(first * BLOCK as usize..i * BLOCK as usize);
                let sums = BlockSums::of(&data);
                let p = c.replica.data.clone();
                let id = self.next_id();
                let done = timed(
                    &c.replica,
                    Box::pin(async move { p.write(id, off, data, sums).await }),
                    self.config.io_timeout,
                )
                .await;
                match done {
                    Ok(()) => {
                        self.integrity.repaired((i - first) as u64);
                        tracing::warn!(
                            volume = %self.name(),
                            replica = %c.replica.addr,
                            offset = off,
                            length = bytes,
                            "repaired blocks that failed their checksum, from a good copy"
                        );
                    }
                    Err(e) => {
                        self.fail(&c.replica, &format!("repair write at {off}: {e}"));
                        failed = true;
                    }
                }
            }
        }
        if failed {
            self.commit_membership().await?;
        }
        if let (Some(&first), Some(&last)) = (lost.first(), lost.last()) {
            self.integrity.lost(lost.len() as u64);
            tracing::error!(
                volume = %self.name(),
                ?lost,
                replicas = ?copies.iter().map(|c| c.replica.addr.as_str()).collect::<Vec<_>>(),
                "no replica holds a good copy of these blocks: reads of them fail"
            );
            return Err(BlockError::Medium {
                offset: first,
                length: last + BLOCK - first,
                detail: format!(
                    "{} block(s) fail their checksum on every replica of volume {}",
                    lost.len(),
                    self.name()
                ),
            });
        }
        Ok(out)
    }

    /// The data of `off..off+len` on `source`, for copying to `target` (catch-up,
    /// reconcile). A block that fails its checksum on the source is taken from another RW
    /// replica whose stored checksum for it equals the source's (`want`), the same version;
    /// where none has it, the source's bad bytes are copied, with the source's sum, so the
    /// block stays detectably bad instead of being blessed.
    pub(super) async fn read_source(
        &self,
        source: &Replica,
        target: &Replica,
        off: u64,
        len: u64,
        want: &[u32],
    ) -> Result<Bytes, VolumeError> {
        let (data, blocks) = match source.data.read(self.next_id(), off, len).await {
            Ok(d) => return Ok(d),
            Err(PathError::Corrupt { data, blocks, .. }) if data.len() as u64 == len => {
                (data, blocks)
            }
            Err(e) => return Err(self.path_error(source, e)),
        };
        self.integrity
            .corrupt_read(self.name(), &source.addr, off, &blocks);
        let mut buf = data.to_vec();
        let others: Vec<Arc<Replica>> = self
            .with_mode(&[super::Mode::RW])
            .into_iter()
            .filter(|r| r.addr != source.addr && r.addr != target.addr && r.verifies())
            .collect();
        for b in blocks {
            let at = off + u64::from(b) * BLOCK;
            let Some(&sum) = want.get(b as usize) else {
                continue;
            };
            let mut found = false;
            for o in &others {
                if self.block_sums(o, at, BLOCK).await.ok().as_deref() != Some(&[sum][..]) {
                    continue;
                }
                if let Ok(good) = o.data.read(self.next_id(), at, BLOCK).await {
                    let i = b as usize * BLOCK as usize;
                    buf[i..i + BLOCK as usize].copy_from_slice(&good);
                    self.integrity.repaired(1);
                    found = true;
                    break;
                }
            }
            if !found {
                tracing::error!(volume = %self.name(), source = %source.addr, target = %target.addr, offset = at,
                    "copying a block that fails its checksum and has no good copy: it stays marked bad");
            }
        }
        Ok(Bytes::from(buf))
    }
}
