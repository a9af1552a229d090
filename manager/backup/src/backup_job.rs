//! One backup: a snapshot read from a replica, chunks into the store, the manifest last.
//!
//! ```text
//! open target ─► manifest already there? ─yes─► done (a retry after a kill past the commit)
//!      │ no
//!      ▼
//! open the snapshot on a replica ─► parent's snapshot in its chain?
//!      │                     yes: read the layers above it (the blocks written since)
//!      │                     no:  read every layer (a full read; dedup still uploads only
//!      │                          chunks the family lacks) and write no parent
//!      ▼
//! plan whole chunks ─► windows read [`READS_IN_FLIGHT`] at a time ─► writer (hash, dedup,
//! compress, packs up) ─► chain unchanged? ─► commit (create-only manifest put)
//! ```
//!
//! Memory is bounded: `(READS_IN_FLIGHT + READY + 1) × WINDOW` of read buffers, the writer's
//! channels and its pack parts; the plan is a list of extents, not of blocks.

use std::ops::Range;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use zebu_backupstore::{
    BackupError, BackupName, BackupSpec, BackupStore, FamilyId, Manifest, StoreOptions, plan_chunks,
};

use crate::job::{BackupJob, JobReport, JobSpec};
use crate::read::{ReadError, SnapshotReader, Window};
use crate::report::{JobFailure, Reporter};

/// Bytes of the volume one read covers (a multiple of the chunk size).
pub const WINDOW: u64 = 4 << 20;
/// Window reads in flight at once.
pub const READS_IN_FLIGHT: usize = 4;
/// Windows read and waiting for the writer.
const READY: usize = 2;

impl From<ReadError> for JobFailure {
    fn from(e: ReadError) -> Self {
        let permanent = matches!(e, ReadError::Chain { .. });
        JobFailure {
            message: e.to_string(),
            permanent,
        }
    }
}

/// The report fields a committed manifest gives.
pub fn fill_from_manifest(r: &mut JobReport, m: &Manifest) {
    r.backup_bytes = Some(m.stats.bytes);
    r.volume_size = Some(m.volume_size);
    r.created_unix_ms = Some(m.created_unix_ms);
    r.parent = m.parent.as_ref().map(ToString::to_string);
}

/// Splits chunk-aligned `ranges` into windows of at most `window` bytes.
pub fn windows(ranges: &[Range<u64>], window: u64) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    for r in ranges {
        let mut at = r.start;
        while at < r.end {
            let end = (at + window).min(r.end);
            out.push(at..end);
            at = end;
        }
    }
    out
}

/// Runs a backup job; see the module docs.
pub async fn run(spec: &JobSpec, job: &BackupJob, rep: &Reporter) -> Result<(), JobFailure> {
    let opts = StoreOptions {
        cache_dir: spec.cache_dir.clone(),
        sessions: spec.session_times(),
        ..StoreOptions::default()
    };
    let store = crate::target::open(&spec.target, opts).await.map_err(|e| {
        match e.downcast::<BackupError>() {
            Ok(b) => JobFailure::from(b),
            Err(e) => JobFailure::permanent(format!("{e:#}")),
        }
    })?;
    let family = FamilyId::new(&job.family)?;
    let name = BackupName::new(&job.backup)?;
    match store.get_backup(&family, &name).await {
        Ok(m) => {
            tracing::info!(backup = %name, "the backup already exists (committed by an earlier attempt)");
            rep.update(|r| fill_from_manifest(r, &m));
            return Ok(());
        }
        Err(BackupError::BackupNotFound { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let reader = SnapshotReader::open(&job.volume, &job.snapshot, &job.replicas).await?;
    let size = reader.size().await;
    // The parent counts only if its snapshot is still below ours and its manifest exists.
    let mut parent = None;
    let mut changed = None;
    if let Some(p) = &job.parent {
        match (
            reader.extents_since(Some(&p.snapshot)).await,
            store
                .get_backup(&family, &BackupName::new(&p.backup)?)
                .await,
        ) {
            (Some(c), Ok(m)) if m.volume_size <= size => {
                parent = Some(m.name.clone());
                changed = Some(c);
            }
            (c, m) => tracing::info!(
                backup = %name, parent = %p.backup,
                snapshot_in_chain = c.is_some(), parent_found = m.is_ok(),
                "the parent cannot be used: reading the whole snapshot"
            ),
        }
    }
    let changed = match changed {
        Some(c) => c,
        None => reader.extents_since(None).await.unwrap_or_default(),
    };
    let cs = zebu_backupstore::DEFAULT_CHUNK_SIZE;
    let plan = plan_chunks(size, cs, &changed, &[]);
    let total = plan.read_bytes();
    tracing::info!(backup = %name, volume = %job.volume, snapshot = %job.snapshot, size, parent = ?parent,
        changed_bytes = changed.iter().map(|r| r.end - r.start).sum::<u64>(), read_plan = total, "backup planned");
    rep.update(|r| {
        r.bytes_total = total;
        r.volume_size = Some(size);
        r.parent = parent.as_ref().map(ToString::to_string);
    });
    let mut w = store
        .begin_backup(BackupSpec {
            family: family.clone(),
            name: name.clone(),
            volume: job.volume.clone(),
            snapshot: job.snapshot.clone(),
            volume_size: size,
            parent,
            labels: job.labels.clone(),
        })
        .await?;
    let wins = windows(&plan.read, WINDOW.max(cs) / cs * cs);
    let reader_ref = &reader;
    // The replica's reads run beside the writer, not in turns with it: a producer keeps
    // `READS_IN_FLIGHT` window reads going and queues what came (at most `READY` windows),
    // while the loop below hands chunks to the writer. Both are futures of this task.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<(Range<u64>, Window), ReadError>>(READY);
    let produce = async move {
        let mut reads = futures::stream::iter(wins.into_iter().map(|win| async move {
            let data = reader_ref.read(win.clone()).await?;
            Ok::<_, ReadError>((win, data))
        }))
        .buffered(READS_IN_FLIGHT);
        while let Some(r) = reads.next().await {
            let failed = r.is_err();
            if tx.send(r).await.is_err() || failed {
                break;
            }
        }
    };
    let mut done = 0u64;
    // Where the time goes: waiting for the replica's reads or for the writer (hash,
    // compress, upload: it takes a chunk only when its pipeline has room).
    let (mut wait_reads, mut wait_writer) = (Duration::ZERO, Duration::ZERO);
    let consume = async {
        // Owned here: a writer that fails drops it, which stops the producer.
        let mut rx = rx;
        loop {
            let t = Instant::now();
            let Some(next) = rx.recv().await else {
                break;
            };
            wait_reads += t.elapsed();
            let t = Instant::now();
            let (win, data) = next.map_err(JobFailure::from)?;
            for at in (win.start..win.end).step_by(cs as usize) {
                w.put_chunk(at, data.slice(at..(at + cs).min(win.end)))
                    .await?;
            }
            wait_writer += t.elapsed();
            done += win.end - win.start;
            let p = w.progress();
            rep.update(|r| {
                r.bytes_done = done;
                r.bytes_read = reader.bytes_read();
                r.bytes_transferred = p.stored_bytes;
            });
        }
        Ok::<(), JobFailure>(())
    };
    let ((), consumed) = futures::join!(produce, consume);
    if let Err(e) = consumed {
        let _ = w.abort().await;
        return Err(e);
    }
    if let Err(e) = reader.check_unchanged().await {
        let _ = w.abort().await;
        return Err(JobFailure::transient(e.to_string()));
    }
    let t = Instant::now();
    let m = w.commit().await?;
    let wait_commit = t.elapsed();
    rep.update(|r| {
        fill_from_manifest(r, &m);
        r.bytes_done = total;
        r.bytes_read = reader.bytes_read();
        r.bytes_transferred = m.stats.new_stored_bytes;
        // The packs and the manifest (map pages travel inside packs).
        r.objects = m.stats.packs + 1;
    });
    tracing::info!(backup = %name, bytes_read = reader.bytes_read(), uploaded = m.stats.new_stored_bytes,
        packs = m.stats.packs, failovers = reader.failovers(), peak_rss = crate::report::peak_rss_bytes().unwrap_or(0), cpu_ms = crate::report::cpu_ms().unwrap_or(0), wait_reads_ms = wait_reads.as_millis() as u64,
        wait_writer_ms = wait_writer.as_millis() as u64, wait_commit_ms = wait_commit.as_millis() as u64, "backup done");
    Ok(())
}

/// Whether a backup exists in the store (for a caller that only has the job).
pub async fn exists(store: &BackupStore, family: &str, backup: &str) -> Result<bool, JobFailure> {
    let (f, n) = (FamilyId::new(family)?, BackupName::new(backup)?);
    match store.get_backup(&f, &n).await {
        Ok(_) => Ok(true),
        Err(BackupError::BackupNotFound { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `Bytes` of zeros, shared.
pub fn zeros(len: usize) -> Bytes {
    static ZEROS: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    let z = ZEROS.get_or_init(|| Bytes::from(vec![0u8; 1 << 20]));
    if len <= z.len() {
        z.slice(..len)
    } else {
        Bytes::from(vec![0u8; len])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_ranges_in_order() {
        let w = windows(&[0..(10 << 20), (20 << 20)..(21 << 20)], 4 << 20);
        assert_eq!(
            w,
            vec![
                0..(4 << 20),
                (4 << 20)..(8 << 20),
                (8 << 20)..(10 << 20),
                (20 << 20)..(21 << 20)
            ]
        );
    }
}
