//! One restore: a backup written into every replica of a volume that no engine serves, as
//! one snapshot layer, then a membership epoch naming the replicas that hold it.
//!
//! Why into the replicas and not through an engine: a volume being restored (or a standby
//! volume) must not be used, so it has no engine; the replicas of a detached volume run, and
//! `WriteLayer` is how rebuilds fill a replica's layers. Each chunk is downloaded once (the
//! store's [`RestoreStream`](zebu_backupstore::RestoreStream): large ranged reads, several in
//! flight, every chunk checked against its hash) and sent to every replica; chunks the
//! backup does not hold are holes and are never written, and neither are the zero 4 KiB
//! blocks inside the chunks it holds when the layer is the bottom of its chain (nothing
//! below it for zeros to hide: a chunk that holds 4 KiB of data and 1 MiB - 4 KiB of zeros is
//! written as 4 KiB). A standby volume catching up from
//! backup A (layer `base_layer`) to backup B writes only the chunks that differ, and zeros
//! where B has a hole and A had data (a layer's zeros hide what older layers hold).
//!
//! The commit point is per replica: a layer is complete only when its `WriteLayer` stream
//! ends normally; a failure (a chunk that fails its hash, a download that breaks) aborts
//! every stream, which leaves the layer marked incomplete on each replica, so nothing is
//! taken as good. After the streams, `SetEpoch(top + 1, members)` is recorded on the
//! replicas that completed: an engine started later takes exactly those as current and
//! rebuilds any other (one that failed here, or a replacement created meanwhile), the rule
//! the engine keeps for replicas that miss writes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use zebu_backupstore::{
    BackupError, BackupName, FamilyId, RestoreItem, RestoreOptions, StoreOptions,
};
use zebu_proto::replica as pb;

use crate::backup_job::zeros;
use crate::job::{JobSpec, RestoreJob};
use crate::replica::{ReplicaError, ReplicaLink};
use crate::report::{JobFailure, Reporter};

/// Messages queued per replica: a slow replica slows the restore, it does not grow memory
/// (at most `QUEUE × WRITE_PIECE` per replica, the pieces shared between replicas).
const QUEUE: usize = 8;
/// The largest piece of zeros sent in one message.
const ZERO_PIECE: u64 = 1 << 20;
/// Consecutive chunks are sent to the replicas as one `WriteLayer` message of up to this
/// many bytes: a replica writes each message with one direct write, one message at a time,
/// so the size of a message is the size of its only write in flight. 1 MiB messages ran
/// the restore at a fraction of `nbdcopy`'s rate into the same replicas. 4 MiB ones leave
/// the restore waiting for the replicas about 12 of its 17 s (4 GiB case, 3 replicas), and
/// 12 MiB ones were measured no faster (10 of 17 s) for 1.7 times the peak RSS (366 MiB
/// against 204: every replica's gRPC stream encodes its own copy of a message).
const WRITE_PIECE: usize = 4 << 20;

/// The replicas' block: the unit of the zero blocks a restore leaves unwritten.
const BLOCK: usize = 4096;

/// The runs of `data` (whole [`BLOCK`]s, the last one possibly short) that are not all zeros.
fn nonzero_runs(data: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, block) in data.chunks(BLOCK).enumerate() {
        // Random data shows itself in its first bytes; only blocks that start with zeros
        // are scanned whole.
        let head = &block[..block.len().min(16)];
        if head.iter().all(|&b| b == 0) && zebu_backupstore::blob::is_zero(block) {
            continue;
        }
        let start = i * BLOCK;
        let end = start + block.len();
        match runs.last_mut() {
            Some(r) if r.end == start => r.end = end,
            _ => runs.push(start..end),
        }
    }
    runs
}

/// Consecutive chunk bytes gathered into one message (see [`WRITE_PIECE`]).
#[derive(Default)]
struct Batch {
    offset: u64,
    buf: Vec<u8>,
}

impl Batch {
    /// Appends `data` at `offset` if it continues the batch; returns the batch to send first
    /// when it does not (or when it is full).
    fn push(&mut self, offset: u64, data: &[u8]) -> Option<(u64, Bytes)> {
        let mut out = None;
        let contiguous = self.offset + self.buf.len() as u64 == offset;
        if !self.buf.is_empty() && (!contiguous || self.buf.len() + data.len() > WRITE_PIECE) {
            out = self.take();
        }
        if self.buf.is_empty() {
            self.offset = offset;
            self.buf.reserve(WRITE_PIECE.max(data.len()));
        }
        self.buf.extend_from_slice(data);
        out
    }

    fn take(&mut self) -> Option<(u64, Bytes)> {
        if self.buf.is_empty() {
            return None;
        }
        Some((self.offset, Bytes::from(std::mem::take(&mut self.buf))))
    }
}

struct Sink {
    addr: String,
    id: String,
    tx: Option<mpsc::Sender<pb::WriteLayerRequest>>,
    task: JoinHandle<Result<u64, ReplicaError>>,
    failed: Option<String>,
}

impl Sink {
    async fn send(&mut self, offset: u64, data: Bytes) {
        if self.failed.is_some() {
            return;
        }
        let msg = pb::WriteLayerRequest {
            // No sums: the chunk was checked against its backup hash; the replica computes them.
            chunk: Some(pb::LayerChunk {
                offset,
                data,
                ..Default::default()
            }),
            ..Default::default()
        };
        let ok = match &self.tx {
            Some(tx) => tx.send(msg).await.is_ok(),
            None => false,
        };
        if !ok {
            // The stream ended early: its task says why when joined.
            self.failed = Some("the WriteLayer stream ended early".into());
            self.tx = None;
        }
    }
}

/// Runs a restore job; see the module docs.
pub async fn run(spec: &JobSpec, job: &RestoreJob, rep: &Reporter) -> Result<(), JobFailure> {
    let opts = StoreOptions {
        cache_dir: spec.cache_dir.clone(),
        ..StoreOptions::default()
    };
    let store = crate::target::open(&spec.target, opts).await.map_err(|e| {
        match e.downcast::<BackupError>() {
            Ok(b) => JobFailure::from(b),
            Err(e) => JobFailure::permanent(format!("{e:#}")),
        }
    })?;
    let family = FamilyId::new(&job.family)?;
    let m = store
        .get_backup(&family, &BackupName::new(&job.backup)?)
        .await?;
    if m.volume_size > job.volume_size {
        return Err(JobFailure::permanent(format!(
            "backup {} is of a {}-byte volume; volume {} has only {} bytes",
            job.backup, m.volume_size, job.volume, job.volume_size
        )));
    }
    let base = match &job.base {
        Some(b) => Some(store.get_backup(&family, &BackupName::new(b)?).await?),
        None => None,
    };
    // Every replica that answers; one that does not is left out of the epoch.
    let mut links = Vec::new();
    let mut top_epoch = 0;
    let mut problems = Vec::new();
    for addr in &job.replicas {
        match ReplicaLink::connect(addr).await {
            Ok(l) => match l.info().await {
                Ok(info) if info.size != job.volume_size => problems.push(format!(
                    "replica {addr} has size {}, the volume {}",
                    info.size, job.volume_size
                )),
                Ok(info) => {
                    top_epoch = top_epoch.max(info.epoch);
                    links.push((l, info.replica_id));
                }
                Err(e) => problems.push(e.to_string()),
            },
            Err(e) => problems.push(e.to_string()),
        }
    }
    if links.is_empty() {
        return Err(JobFailure::transient(format!(
            "volume {}: no replica to restore into ({})",
            job.volume,
            problems.join("; ")
        )));
    }
    let ropts = RestoreOptions::default();
    let mut stream = match &base {
        Some(b) => store.restore_diff(b, &m, ropts).await?,
        None => store.restore(&m, ropts).await?,
    };
    let created = layer_time(m.created_unix_ms);
    let mut sinks: Vec<Sink> = links
        .into_iter()
        .map(|(link, id)| {
            let (tx, rx) = mpsc::channel(QUEUE);
            let first = pb::WriteLayerRequest {
                layer: job.layer.clone(),
                parent: job.base_layer.clone(),
                user_created: false,
                created: created.clone(),
                labels: BTreeMap::from([("zebu.io/backup".to_string(), job.backup.clone())])
                    .into_iter()
                    .collect(),
                size: job.volume_size,
                chunk: None,
            };
            let addr = link.addr().to_string();
            let task =
                tokio::spawn(async move { link.write_layer(first, ReceiverStream::new(rx)).await });
            Sink {
                addr,
                id,
                tx: Some(tx),
                task,
                failed: None,
            }
        })
        .collect();
    let total = m.stats.bytes;
    rep.update(|r| {
        r.bytes_total = total;
        r.volume_size = Some(m.volume_size);
    });
    let mut done = 0u64;
    let mut written = 0u64;
    let mut zero_skipped = 0u64;
    // At the bottom of the chain a zero block needs no write (module docs); above a base
    // layer its zeros must hide what the base holds there.
    let skip_zero_blocks = job.base_layer.is_empty();
    let mut batch = Batch::default();
    // Where the time goes: waiting for the store (download, decode) or for the replicas.
    let (mut wait_store, mut wait_replicas) = (Duration::ZERO, Duration::ZERO);
    loop {
        let t = Instant::now();
        let next = stream.next().await;
        wait_store += t.elapsed();
        let t = Instant::now();
        let item = match next {
            None => {
                if let Some((o, d)) = batch.take() {
                    for s in &mut sinks {
                        s.send(o, d.clone()).await;
                    }
                }
                wait_replicas += t.elapsed();
                break;
            }
            Some(Ok(i)) => i,
            Some(Err(e)) => {
                // Abort the streams while their senders are alive: the replicas see a reset,
                // not an end, and keep the layer incomplete.
                for s in &sinks {
                    s.task.abort();
                }
                for s in &mut sinks {
                    s.tx = None;
                }
                tracing::error!(volume = %job.volume, backup = %job.backup, "restore failed; the layer stays incomplete on every replica: {e}");
                return Err(e.into());
            }
        };
        match item {
            RestoreItem::Data { offsets, data } => {
                let runs: Vec<std::ops::Range<usize>> = if skip_zero_blocks {
                    nonzero_runs(&data)
                } else {
                    std::iter::once(0..data.len()).collect()
                };
                let run_bytes: usize = runs.iter().map(|r| r.len()).sum();
                for o in offsets {
                    for r in &runs {
                        if let Some((bo, bd)) = batch.push(o + r.start as u64, &data[r.clone()]) {
                            for s in &mut sinks {
                                s.send(bo, bd.clone()).await;
                            }
                        }
                    }
                    done += data.len() as u64;
                    written += run_bytes as u64;
                    zero_skipped += (data.len() - run_bytes) as u64;
                }
            }
            RestoreItem::Zero { offset, len } => {
                if let Some((bo, bd)) = batch.take() {
                    for s in &mut sinks {
                        s.send(bo, bd.clone()).await;
                    }
                }
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(ZERO_PIECE);
                    for s in &mut sinks {
                        s.send(at, zeros(n as usize)).await;
                    }
                    at += n;
                }
                written += len;
            }
        }
        wait_replicas += t.elapsed();
        if sinks.iter().all(|s| s.failed.is_some()) {
            break;
        }
        let st = stream.stats();
        rep.update(|r| {
            r.bytes_done = done.min(total);
            r.bytes_transferred = st.downloaded;
            r.bytes_written = written;
        });
    }
    let st = stream.stats();
    // End the streams normally: each replica makes its layer durable and complete. All
    // of them first, so that the replicas' fdatasyncs run at the same time.
    let t = Instant::now();
    for s in &mut sinks {
        s.tx = None;
    }
    let mut good = Vec::new();
    for s in sinks {
        match s.task.await {
            Ok(Ok(_)) if s.failed.is_none() => good.push((s.addr, s.id)),
            Ok(Ok(_)) => problems.push(format!(
                "replica {}: {}",
                s.addr,
                s.failed.unwrap_or_default()
            )),
            Ok(Err(e)) => problems.push(e.to_string()),
            Err(e) => problems.push(format!("replica {}: {e}", s.addr)),
        }
    }
    let wait_finish = t.elapsed();
    if good.is_empty() {
        return Err(JobFailure::transient(format!(
            "volume {}: no replica took the restore ({})",
            job.volume,
            problems.join("; ")
        )));
    }
    if !problems.is_empty() {
        tracing::warn!(volume = %job.volume, "restored into {} of {} replicas; the others will be rebuilt: {}", good.len(), job.replicas.len(), problems.join("; "));
    }
    let members: Vec<String> = good.iter().map(|(_, id)| id.clone()).collect();
    let epoch = top_epoch + 1;
    for (addr, _) in &good {
        let link = ReplicaLink::connect(addr)
            .await
            .map_err(|e| JobFailure::transient(e.to_string()))?;
        link.set_epoch(epoch, members.clone())
            .await
            .map_err(|e| JobFailure::transient(e.to_string()))?;
    }
    rep.update(|r| {
        r.bytes_done = total;
        r.bytes_transferred = st.downloaded;
        r.bytes_written = written;
        r.backup_bytes = Some(m.stats.bytes);
        r.created_unix_ms = Some(m.created_unix_ms);
        r.replicas = members.clone();
    });
    tracing::info!(volume = %job.volume, backup = %job.backup, incremental = base.is_some(), chunks = st.chunks,
        downloaded = st.downloaded, reads = st.reads, skipped = st.skipped, written, zero_skipped, peak_held = st.peak_held,
        peak_rss = crate::report::peak_rss_bytes().unwrap_or(0), cpu_ms = crate::report::cpu_ms().unwrap_or(0), replicas = members.len(), epoch,
        wait_store_ms = wait_store.as_millis() as u64, wait_replicas_ms = wait_replicas.as_millis() as u64,
        wait_finish_ms = wait_finish.as_millis() as u64, "restore done");
    Ok(())
}

/// RFC 3339 of a Unix time in ms (the layer's creation time: the backup's).
fn layer_time(ms: u64) -> String {
    zebu_types::time::format_rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_blocks_are_left_out_and_data_blocks_kept_whole() {
        let mut chunk = vec![0u8; 16 * BLOCK];
        chunk[BLOCK + 5] = 1; // block 1
        chunk[2 * BLOCK] = 1; // block 2, joined with 1
        chunk[6 * BLOCK - 1] = 1; // block 5: its last byte only
        chunk[15 * BLOCK] = 9; // block 15
        assert_eq!(
            nonzero_runs(&chunk),
            vec![
                BLOCK..3 * BLOCK,
                5 * BLOCK..6 * BLOCK,
                15 * BLOCK..16 * BLOCK
            ]
        );
        assert!(nonzero_runs(&vec![0u8; 8 * BLOCK]).is_empty());
        let full: Vec<u8> = (0..4 * BLOCK).map(|i| (i % 251) as u8 + 1).collect();
        assert_eq!(nonzero_runs(&full), vec![0..4 * BLOCK]);
        // A short last block counts as a block.
        let mut short = vec![0u8; BLOCK + 512];
        short[BLOCK + 100] = 3;
        assert_eq!(nonzero_runs(&short), vec![BLOCK..BLOCK + 512]);
    }

    #[test]
    fn a_batch_joins_consecutive_chunks_and_breaks_at_gaps_and_its_size() {
        let mib = 1usize << 20;
        let chunk = |b: u8| vec![b; mib];
        let mut b = Batch::default();
        let mut sent = Vec::new();
        // WRITE_PIECE / 1 MiB consecutive chunks fill one piece; the next starts another.
        let per = (WRITE_PIECE / mib) as u64;
        for i in 0..=per {
            sent.extend(b.push(i * mib as u64, &chunk(i as u8)));
        }
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].0, 0);
        assert_eq!(sent[0].1.len(), WRITE_PIECE);
        assert_eq!(sent[0].1[3 * mib], 3, "chunks keep their order");
        // A gap sends what came before it.
        let gap = b
            .push((per + 5) * mib as u64, &chunk(9))
            .expect("a gap ends the batch");
        assert_eq!((gap.0, gap.1.len()), (per * mib as u64, mib));
        assert_eq!(gap.1[0], per as u8);
        let last = b.take().expect("the rest");
        assert_eq!((last.0, last.1.len()), ((per + 5) * mib as u64, mib));
        assert!(b.take().is_none());
    }
}
