//! Writing a backup: chunks in, packs out, the manifest last.
//!
//! ```text
//! put_chunk ──► [jobs, bounded] ──► N workers: zero? hash, in the index? compress
//!                                        │
//!                                        ▼
//!                          [results, bounded] ──► packer: dedup within the session,
//!                                                 append to the open pack, upload parts
//!                                                 (≤ `uploads` in flight), close full packs
//! commit: drain ─► build changed map pages (parent's pages for the rest) ─► close packs,
//!         wait for every upload ─► session still live? ─► create-only put of the manifest
//! ```
//!
//! Memory is bounded by the channels (about `2 × workers` chunks), the open pack's part
//! buffer and the parts uploading (`(uploads + 1) × part_size`), and the map of changed slots
//! (40 bytes per changed chunk). Nothing waits for the network per chunk: a chunk the family
//! index knows is recorded by hash and never uploaded or asked about.
//!
//! A writer that dies before `commit` leaves whole packs no manifest references. A retry
//! lists them like any other pack and deduplicates against them, so it uploads only what the
//! dead writer had not finished; if no retry comes, GC removes them after its margin.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;

use crate::blob::{self, BlobKind, Codec, EncodedBlob};
use crate::error::{BackupError, Result};
use crate::ids::{BackupName, ChunkHash, FamilyId};
use crate::index::FamilyIndex;
use crate::manifest::{self, BackupStats, Manifest, PageRef};
use crate::map::{PAGE_CHUNKS, Page};
use crate::pack::{PackLimits, PackSink, WrittenPack};
use crate::reader;
use crate::session::Session;
use crate::target::Target;

/// What a backup is of.
#[derive(Clone, Debug)]
pub struct BackupSpec {
    pub family: FamilyId,
    pub name: BackupName,
    /// The volume's name (recorded, not interpreted).
    pub volume: String,
    /// The snapshot read (recorded, not interpreted).
    pub snapshot: String,
    pub volume_size: u64,
    /// The backup this one is incremental to: every chunk not given to the writer keeps the
    /// parent's content. Without a parent, chunks not given are holes.
    pub parent: Option<BackupName>,
    pub labels: BTreeMap<String, String>,
}

/// Live figures of a running backup (for a progress bar).
#[derive(Clone, Copy, Debug, Default)]
pub struct WriterProgress {
    pub chunks_given: u64,
    pub bytes_given: u64,
    pub dedup_chunks: u64,
    pub zero_chunks: u64,
    pub stored_bytes: u64,
}

#[derive(Default)]
struct Counters {
    chunks_given: AtomicU64,
    bytes_given: AtomicU64,
    dedup_chunks: AtomicU64,
    zero_chunks: AtomicU64,
    stored_bytes: AtomicU64,
}

struct Job {
    /// Order of hand-over: the packer appends in this order, so chunks handed over in
    /// volume order lie back to back in packs and a restore reads them in large ranges.
    seq: u64,
    slot: u64,
    data: Bytes,
}

enum Processed {
    Zero { slot: u64 },
    Known { slot: u64, hash: ChunkHash },
    New { slot: u64, blob: EncodedBlob },
}

struct PackerOut {
    sink: PackSink,
    /// `None`: the chunk is now a hole.
    changes: BTreeMap<u64, Option<ChunkHash>>,
    session_blobs: HashSet<ChunkHash>,
}

/// Writer settings (from [`crate::StoreOptions`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriterSettings {
    pub chunk_size: u64,
    pub codec: Codec,
    pub workers: usize,
    pub limits: PackLimits,
}

/// A backup being written. Hand it chunks, then [`Self::commit`] (or drop it to abandon).
pub struct BackupWriter {
    target: Arc<Target>,
    spec: BackupSpec,
    parent: Option<Manifest>,
    index: Arc<FamilyIndex>,
    session: Option<Session>,
    settings: WriterSettings,
    jobs: Option<mpsc::Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    packer: Option<JoinHandle<Result<PackerOut>>>,
    zeros: Vec<Range<u64>>,
    counters: Arc<Counters>,
    cache: Option<std::path::PathBuf>,
    next_seq: u64,
}

impl BackupWriter {
    pub(crate) fn start(
        target: Arc<Target>,
        spec: BackupSpec,
        parent: Option<Manifest>,
        index: FamilyIndex,
        session: Session,
        settings: WriterSettings,
        cache: Option<std::path::PathBuf>,
    ) -> Self {
        let index = Arc::new(index);
        let counters = Arc::new(Counters::default());
        let workers_n = settings.workers.max(1);
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(workers_n);
        let (out_tx, out_rx) = mpsc::channel::<(u64, Processed)>(workers_n);
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let workers = (0..workers_n)
            .map(|_| {
                let (jobs_rx, out_tx, index) = (jobs_rx.clone(), out_tx.clone(), index.clone());
                let codec = settings.codec;
                tokio::spawn(async move {
                    loop {
                        let job = jobs_rx.lock().await.recv().await;
                        let Some(job) = job else { break };
                        let index = index.clone();
                        let seq = job.seq;
                        let processed =
                            tokio::task::spawn_blocking(move || process(job, &index, codec)).await;
                        let Ok(p) = processed else { break };
                        if out_tx.send((seq, p)).await.is_err() {
                            break;
                        }
                    }
                })
            })
            .collect();
        drop(out_tx);
        let sink = PackSink::new(target.clone(), spec.family.clone(), settings.limits);
        let packer = tokio::spawn(run_packer(out_rx, sink, counters.clone()));
        Self {
            target,
            spec,
            parent,
            index,
            session: Some(session),
            settings,
            jobs: Some(jobs_tx),
            workers,
            packer: Some(packer),
            zeros: Vec::new(),
            counters,
            cache,
            next_seq: 0,
        }
    }

    /// The chunk size: offsets given to [`Self::put_chunk`] are multiples of it.
    pub fn chunk_size(&self) -> u64 {
        self.settings.chunk_size
    }

    /// The backup being written.
    pub fn spec(&self) -> &BackupSpec {
        &self.spec
    }

    /// Figures so far.
    pub fn progress(&self) -> WriterProgress {
        let c = &self.counters;
        WriterProgress {
            chunks_given: c.chunks_given.load(Ordering::Relaxed),
            bytes_given: c.bytes_given.load(Ordering::Relaxed),
            dedup_chunks: c.dedup_chunks.load(Ordering::Relaxed),
            zero_chunks: c.zero_chunks.load(Ordering::Relaxed),
            stored_bytes: c.stored_bytes.load(Ordering::Relaxed),
        }
    }

    /// Hands over one whole chunk: `offset` a multiple of the chunk size, `data` the chunk's
    /// bytes (shorter only for the volume's last chunk). Returns once the chunk is queued;
    /// waits while the pipeline is full. All-zero chunks are recorded as holes.
    pub async fn put_chunk(&mut self, offset: u64, data: Bytes) -> Result<()> {
        let cs = self.settings.chunk_size;
        let size = self.spec.volume_size;
        if !offset.is_multiple_of(cs)
            || offset >= size
            || data.len() as u64 != cs.min(size - offset)
        {
            return Err(BackupError::InvalidInput(format!(
                "backup {}/{}: a chunk must start at a multiple of {cs} below {size} and be whole; got {} bytes at offset {offset}",
                self.spec.family,
                self.spec.name,
                data.len()
            )));
        }
        self.counters.chunks_given.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_given
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let tx = self
            .jobs
            .as_ref()
            .ok_or_else(|| BackupError::InvalidInput("writer already finished".into()))?;
        let seq = self.next_seq;
        self.next_seq += 1;
        if tx
            .send(Job {
                seq,
                slot: offset / cs,
                data,
            })
            .await
            .is_err()
        {
            return Err(self.pipeline_error().await);
        }
        Ok(())
    }

    /// Records a chunk-aligned range as a hole now (unmapped since the parent). The end may
    /// be the volume's end. See [`crate::plan_chunks`] for turning unmaps into such ranges.
    pub fn put_zero(&mut self, range: Range<u64>) -> Result<()> {
        let cs = self.settings.chunk_size;
        let size = self.spec.volume_size;
        if !range.start.is_multiple_of(cs)
            || (!range.end.is_multiple_of(cs) && range.end != size)
            || range.end > size
            || range.start > range.end
        {
            return Err(BackupError::InvalidInput(format!(
                "backup {}/{}: zero range {range:?} is not chunk-aligned within the volume ({size} bytes, chunks of {cs})",
                self.spec.family, self.spec.name
            )));
        }
        if range.start < range.end {
            self.zeros.push(range.start / cs..range.end.div_ceil(cs));
        }
        Ok(())
    }

    async fn pipeline_error(&mut self) -> BackupError {
        self.jobs = None;
        match self.packer.take() {
            Some(h) => match h.await {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => BackupError::Task("backup pipeline stopped".into()),
                Err(e) => e.into(),
            },
            None => BackupError::Task("backup pipeline stopped".into()),
        }
    }

    /// Waits for every upload, writes the map pages and then the manifest. The backup exists
    /// from the moment this returns `Ok`.
    pub async fn commit(mut self) -> Result<Manifest> {
        match self.commit_inner().await {
            Ok(m) => Ok(m),
            Err(e) => {
                // A refused commit leaves no marker behind (its packs wait for GC or a retry).
                if let Some(s) = self.session.take() {
                    let _ = s.end().await;
                }
                Err(e)
            }
        }
    }

    async fn commit_inner(&mut self) -> Result<Manifest> {
        self.jobs = None;
        for w in self.workers.drain(..) {
            w.await?;
        }
        let packer = self
            .packer
            .take()
            .ok_or_else(|| BackupError::Task("backup pipeline stopped".into()))?;
        let PackerOut {
            mut sink,
            changes,
            mut session_blobs,
        } = packer.await??;
        let cs = self.settings.chunk_size;
        let chunk_count = self.spec.volume_size.div_ceil(cs);
        self.zeros.sort_by_key(|r| r.start);
        for z in &self.zeros {
            if let Some((slot, _)) = changes.range(z.clone()).find(|(_, h)| h.is_some()) {
                return Err(BackupError::InvalidInput(format!(
                    "offset {} was given both as data and as zero",
                    slot * cs
                )));
            }
        }
        // Which pages change.
        let mut touched: Vec<u64> = changes.keys().map(|s| s / PAGE_CHUNKS).collect();
        for z in &self.zeros {
            touched.extend(z.start / PAGE_CHUNKS..z.end.div_ceil(PAGE_CHUNKS));
        }
        touched.sort_unstable();
        touched.dedup();
        let parent_pages: BTreeMap<u64, PageRef> = self
            .parent
            .as_ref()
            .map(|p| p.pages.iter().map(|r| (r.index, *r)).collect())
            .unwrap_or_default();
        let mut pages: BTreeMap<u64, PageRef> = parent_pages.clone();
        // A parent of a smaller volume (the volume grew): its pages stay valid; of a larger
        // one (shrunk, unusual) drop what lies past the end.
        pages.retain(|i, _| i * PAGE_CHUNKS < chunk_count);
        let last_slot = chunk_count.saturating_sub(1);
        // Whether the volume's last (possibly short) chunk holds data, for the byte count.
        let mut last_present: Option<bool> = None;
        for pi in touched {
            let base = pi * PAGE_CHUNKS;
            let mut entries: BTreeMap<u32, ChunkHash> = match (&self.parent, parent_pages.get(&pi))
            {
                (Some(parent), Some(r)) => reader::fetch_page(&self.target, parent, &self.index, r)
                    .await?
                    .0
                    .into_iter()
                    .collect(),
                _ => BTreeMap::new(),
            };
            for z in &self.zeros {
                let (a, b) = (z.start.max(base), z.end.min(base + PAGE_CHUNKS));
                if a < b {
                    let (a, b) = ((a - base) as u32, (b - base) as u32);
                    entries.retain(|s, _| *s < a || *s >= b);
                }
            }
            for (slot, h) in changes.range(base..base + PAGE_CHUNKS) {
                let s = (slot - base) as u32;
                match h {
                    Some(h) => entries.insert(s, *h),
                    None => entries.remove(&s),
                };
            }
            entries.retain(|s, _| base + u64::from(*s) < chunk_count);
            if last_slot / PAGE_CHUNKS == pi {
                last_present = Some(entries.contains_key(&((last_slot - base) as u32)));
            }
            if entries.is_empty() {
                pages.remove(&pi);
                continue;
            }
            let page = Page(entries.into_iter().collect());
            let raw = page.encode();
            let hash = ChunkHash::of(&raw);
            if !self.index.has(&hash) && session_blobs.insert(hash) {
                let codec = self.settings.codec;
                let blob = tokio::task::spawn_blocking(move || {
                    blob::encode(BlobKind::Map, Bytes::from(raw), codec, Some(hash))
                })
                .await?;
                sink.add(&blob).await?;
            }
            pages.insert(
                pi,
                PageRef {
                    index: pi,
                    hash,
                    chunks: page.0.len() as u32,
                },
            );
        }
        let stored_bytes = sink.stored_bytes;
        let written: Vec<WrittenPack> = sink.finish().await?;
        let chunks: u64 = pages.values().map(|p| u64::from(p.chunks)).sum();
        let last_short = self.spec.volume_size % cs;
        let last_present = match (
            last_short,
            last_present,
            &self.parent,
            pages.get(&(last_slot / PAGE_CHUNKS)),
        ) {
            (0, _, _, _) | (_, _, _, None) => false,
            (_, Some(p), _, _) => p,
            // An inherited page: the parent's.
            (_, None, Some(parent), Some(r)) => {
                reader::fetch_page(&self.target, parent, &self.index, r)
                    .await?
                    .0
                    .iter()
                    .any(|(s, _)| r.index * PAGE_CHUNKS + u64::from(*s) == last_slot)
            }
            (_, None, None, Some(_)) => false,
        };
        let bytes = chunks * cs - if last_present { cs - last_short } else { 0 };
        let c = &self.counters;
        let stats = BackupStats {
            chunks,
            bytes,
            chunks_given: c.chunks_given.load(Ordering::Relaxed),
            zero_chunks: c.zero_chunks.load(Ordering::Relaxed),
            dedup_chunks: c.dedup_chunks.load(Ordering::Relaxed),
            new_blobs: written.iter().map(|p| p.entries.len() as u64).sum(),
            new_stored_bytes: stored_bytes,
            packs: written.len() as u64,
        };
        let m = Manifest {
            format: manifest::FORMAT,
            family: self.spec.family.clone(),
            name: self.spec.name.clone(),
            volume: self.spec.volume.clone(),
            snapshot: self.spec.snapshot.clone(),
            parent: self.spec.parent.clone(),
            volume_size: self.spec.volume_size,
            chunk_size: cs,
            page_chunks: PAGE_CHUNKS,
            labels: self.spec.labels.clone(),
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            stats,
            pages: pages.into_values().collect(),
        };
        let session = self
            .session
            .take()
            .ok_or_else(|| BackupError::Task("session gone".into()))?;
        session.check_alive()?;
        let key = self.target.key(&manifest::manifest_rel(&m.family, &m.name));
        if !self.target.put_create(&key, m.to_bytes()).await? {
            let _ = session.end().await;
            return Err(BackupError::BackupExists {
                family: m.family.clone(),
                name: m.name.clone(),
            });
        }
        if let Err(e) = session.end().await {
            tracing::warn!(error = %e, "backup committed; its session marker stays until GC expires it");
        }
        tracing::info!(family = %m.family, backup = %m.name, chunks = m.stats.chunks, new_blobs = m.stats.new_blobs,
            stored = m.stats.new_stored_bytes, packs = m.stats.packs, "backup committed");
        // Remember the new packs locally, so the next backup does not read their indexes.
        if let Some(path) = &self.cache {
            let index = std::mem::take(&mut self.index);
            if let Ok(mut index) = Arc::try_unwrap(index) {
                index.add_packs(&written);
                if let Err(e) = index.save(path) {
                    tracing::warn!(error = %e, "could not update the index cache");
                }
            }
        }
        Ok(m)
    }

    /// Gives up: stops the pipeline and ends the session. Packs already uploaded stay until
    /// GC removes them (or a retry reuses them).
    pub async fn abort(mut self) -> Result<()> {
        self.jobs = None;
        if let Some(p) = self.packer.take() {
            p.abort();
        }
        match self.session.take() {
            Some(s) => s.end().await,
            None => Ok(()),
        }
    }
}

fn process(job: Job, index: &FamilyIndex, codec: Codec) -> Processed {
    if blob::is_zero(&job.data) {
        return Processed::Zero { slot: job.slot };
    }
    let hash = ChunkHash::of(&job.data);
    if index.has(&hash) {
        return Processed::Known {
            slot: job.slot,
            hash,
        };
    }
    Processed::New {
        slot: job.slot,
        blob: blob::encode(BlobKind::Data, job.data, codec, Some(hash)),
    }
}

async fn run_packer(
    mut rx: mpsc::Receiver<(u64, Processed)>,
    mut sink: PackSink,
    counters: Arc<Counters>,
) -> Result<PackerOut> {
    let mut changes = BTreeMap::new();
    let mut session_blobs = HashSet::new();
    let twice = |slot: u64| BackupError::InvalidInput(format!("chunk slot {slot} given twice"));
    // Workers finish out of order; put results back in hand-over order (the window is the
    // chunks in flight, a few per worker).
    let mut reorder: BTreeMap<u64, Processed> = BTreeMap::new();
    let mut next = 0u64;
    let mut closed = false;
    loop {
        let p = match reorder.remove(&next) {
            Some(p) => p,
            None if closed => match reorder.pop_first() {
                Some((_, p)) => p,
                None => break,
            },
            None => {
                match rx.recv().await {
                    Some((seq, p)) => {
                        reorder.insert(seq, p);
                    }
                    None => closed = true,
                }
                continue;
            }
        };
        next += 1;
        match p {
            Processed::Zero { slot } => {
                counters.zero_chunks.fetch_add(1, Ordering::Relaxed);
                if changes.insert(slot, None).is_some() {
                    return Err(twice(slot));
                }
            }
            Processed::Known { slot, hash } => {
                counters.dedup_chunks.fetch_add(1, Ordering::Relaxed);
                if changes.insert(slot, Some(hash)).is_some() {
                    return Err(twice(slot));
                }
            }
            Processed::New { slot, blob } => {
                if changes.insert(slot, Some(blob.hash)).is_some() {
                    return Err(twice(slot));
                }
                if session_blobs.insert(blob.hash) {
                    sink.add(&blob).await?;
                    counters
                        .stored_bytes
                        .store(sink.stored_bytes, Ordering::Relaxed);
                } else {
                    counters.dedup_chunks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    Ok(PackerOut {
        sink,
        changes,
        session_blobs,
    })
}
