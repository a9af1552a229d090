//! The checksum file's fdatasync, taken out of the flush (issue 19).
//!
//! A flush must make every completed write durable: its data, and, so that a checksum never
//! fails on good data after a crash, its sum, or at least a way to tell that the sum may be
//! stale. The flush used to fdatasync the head and its checksum file in parallel. Measured on
//! release binaries with three replicas on one disk (benches/README.md, `durable-bench.sh`),
//! each fdatasync then took ~1 ms where one stream of three plain files took ~0.3 ms: the
//! disk's cache flushes are what a flush waits for, and each replica asked for two.
//!
//! Now a flush writes the staged sums back into the checksum file (the page cache: after
//! kill -9 they are there, as the data is) and fdatasyncs the head only; it then counts as
//! complete in memory ([`Regions::note_flush`](super::regions::Regions::note_flush)) but is
//! *not* recorded in `regions.dat`'s header. A background task fdatasyncs the checksum file at
//! most every [`SUMS_SYNC_INTERVAL`] and only then records the highest flush number whose
//! sums it covers. So on disk, whatever the crash:
//!
//! - every region written after the recorded flush is marked dirty (write-ahead marks,
//!   `regions.rs`), and open settles every dirty region after an unclean stop: a block whose
//!   sum is older than its (durable) data gets its sum from the data (`sums.rs`, "Commit
//!   points"). A power cut therefore costs at most [`SUMS_SYNC_INTERVAL`] more of regions to
//!   settle and to compare, never a false checksum failure and never a lost write;
//! - the data of every acknowledged flush is durable when the flush answers, as before.
//!
//! Snapshot create and close fdatasync both files and record the flush at once. A failed
//! fdatasync of the checksum file makes the replica lost (`health.rs`): the kernel may have
//! dropped the pages, and only a rebuild restores trust in them.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Replica;

/// At most this long passes between a flush and the fdatasync of its checksums.
pub const SUMS_SYNC_INTERVAL: Duration = Duration::from_millis(50);

impl Replica {
    /// fdatasyncs the head's checksum file when flushes are waiting to be recorded, every
    /// [`SUMS_SYNC_INTERVAL`] (the engine's `IoConfig::sums_sync_interval`), until the replica is closed or dropped.
    pub(super) fn spawn_sums_sync(self: &Arc<Self>) {
        let weak: Weak<Replica> = Arc::downgrade(self);
        let every = self.io.sums_sync_interval();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(r) = weak.upgrade() else { return };
                if r.check_open().is_err() || r.lost().is_some() {
                    return;
                }
                if let Err(e) = r.sync_flushed_sums().await {
                    let _ = r.mark_lost(format!(
                        "the checksums of a flush could not be made durable: {e}"
                    ));
                    return;
                }
            }
        });
    }

    /// Makes the sums of every flush completed so far durable and records the last of them in
    /// the region record; nothing when there is nothing to record.
    pub(super) async fn sync_flushed_sums(&self) -> crate::Result<()> {
        let target = self.regions.flushed();
        if target <= self.regions.recorded() {
            return Ok(());
        }
        // Shared with I/O; a snapshot or close (exclusive) syncs and records by itself.
        let _g = self.gate.read().await;
        // A close marks the replica closed before it waits for the gate, so this task can
        // get here after it, with nothing left to do: the close syncs and records. Not an
        // error: as one, it made the replica lost and the close fail.
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        self.check_not_lost()?;
        // Every write covered by `target` had its sums written back into this file by the
        // flush that completed it (a snapshot since then synced the old head's file itself).
        let sums = self.chain().head_sums();
        self.sync_sums(&sums).await.map_err(|e| {
            crate::ReplicaError::io("write back and fdatasync the head's checksums", e)
        })?;
        self.regions.complete_flush(target).await
    }
}
