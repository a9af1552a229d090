//! The restore engine: reads planned per pack, several in flight, streamed and decoded blob
//! by blob, handed on in ascending volume order through a bounded reorder window.
//!
//! ```text
//! chunk map ─► distinct chunks (each with every offset it goes to), in volume order = entries
//!           ─► grouped by pack, sorted by pack offset, coalesced into ranged reads
//!              (gaps ≤ max_gap bridged, ≤ max_read each; a pack mostly needed is one read)
//!           ─► reads ordered by their first entry; ≤ concurrency running
//!
//! read task: ranged GET ─► body pieces ─► one blob's bytes ─► decode + hash (blocking pool)
//!            ─► gate (bytes held ≤ buffer) ─► channel ─► RestoreStream::next
//! next():    entries[cursor] ready? hand it on, release its bytes : receive more
//! ```
//!
//! Why a reorder window: the chunks of an incremental backup alternate between the packs of
//! several backups. Reading in volume order made one small ranged GET per run of chunks
//! (863 of them for the 4 GiB case, and ~950 MiB of memory in the restore process); reading
//! in pack order makes a few large GETs but delivers chunks out of volume order. The window
//! puts them back in order so the replicas get large sequential writes, and bounds what that
//! costs: a read task may hold a decoded chunk that is not next in line only while the bytes
//! held stay within [`RestoreOptions::buffer`]; otherwise it waits (its GET's body waits in
//! the socket, held back by TCP flow control).
//!
//! Progress: every read hands its chunks over in ascending volume order (a pack whose order
//! differs from the volume's is cut into reads where it descends), the chunk at the cursor
//! always passes the gate, and a read whose first chunk is at or before the cursor is started
//! even beyond `concurrency`. So the cursor's chunk belongs to a running read whose next chunk
//! it is, and it arrives. Memory: `buffer` plus the cursor's chunk, plus per running read one
//! blob being assembled and decoded. Nothing grows with the backup but the plan: about 150
//! bytes per distinct chunk (~150 MiB per TiB of 1 MiB chunks).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use crate::blob::{self, Codec};
use crate::error::{BackupError, Result};
use crate::ids::{ChunkHash, FamilyId, PackId};
use crate::index::FamilyIndex;
use crate::manifest::Manifest;
use crate::pack;
use crate::reader::{RestoreItem, RestoreOptions, RestoreStats};
use crate::target::Target;

/// One distinct chunk to hand on.
#[derive(Clone, Debug)]
struct Want {
    hash: ChunkHash,
    /// Volume offsets it goes to, ascending (more than one when the volume repeats it).
    offsets: Vec<u64>,
    /// Where it is in its pack.
    at: u64,
    stored_len: u32,
    raw_len: u32,
    codec: Codec,
    /// Its length in the volume (the last chunk may be short).
    len: u64,
}

/// What is handed on, in ascending offset order.
#[derive(Debug)]
enum Entry {
    Chunk(Arc<Want>),
    Zero(Range<u64>),
}

impl Entry {
    fn offset(&self) -> u64 {
        match self {
            Entry::Chunk(w) => w.offsets[0],
            Entry::Zero(r) => r.start,
        }
    }
}

/// One ranged read of one pack: the entries it delivers, in pack order.
#[derive(Clone, Debug)]
pub(crate) struct PlannedRead {
    pack: PackId,
    range: Range<u64>,
    /// `(entry index, chunk)`, ascending by position in the pack.
    members: Vec<(usize, Arc<Want>)>,
}

impl PlannedRead {
    /// The read's place in the order reads start: its first (and lowest) entry.
    fn first_entry(&self) -> usize {
        self.members[0].0
    }

    #[cfg(test)]
    fn needed(&self) -> u64 {
        self.members
            .iter()
            .map(|(_, w)| u64::from(w.stored_len))
            .sum()
    }
}

/// The whole restore, before anything is read.
#[derive(Debug)]
pub(crate) struct Plan {
    entries: Vec<Entry>,
    /// In the order they start.
    reads: Vec<PlannedRead>,
}

impl Plan {
    /// Plans a restore of `chunks` (`(slot, hash)`, any order) and `zeroed` slots.
    pub(crate) fn new(
        m: &Manifest,
        index: &FamilyIndex,
        chunks: Vec<(u64, ChunkHash)>,
        zeroed: Vec<u64>,
        opts: &RestoreOptions,
    ) -> Result<Self> {
        let cs = m.chunk_size;
        let volume = m.volume_size;
        // Distinct chunks, each with all its slots.
        let mut by_hash: HashMap<ChunkHash, Vec<u64>> = HashMap::with_capacity(chunks.len());
        for (slot, h) in chunks {
            by_hash.entry(h).or_default().push(slot);
        }
        // (pack, chunk) for every distinct chunk; entries in volume order.
        let mut wants: Vec<(PackId, Want)> = Vec::with_capacity(by_hash.len());
        for (hash, mut slots) in by_hash {
            slots.sort_unstable();
            let offset = slots[0] * cs;
            let (p, e) = index
                .locate(&hash)
                .ok_or_else(|| BackupError::MissingChunk {
                    backup: format!("{}/{}", m.family, m.name),
                    hash,
                    offset,
                })?;
            wants.push((
                p.id,
                Want {
                    hash,
                    offsets: slots.iter().map(|s| s * cs).collect(),
                    at: e.offset,
                    stored_len: e.stored_len,
                    raw_len: e.raw_len,
                    codec: e.codec,
                    len: cs.min(volume.saturating_sub(offset)),
                },
            ));
        }
        let mut entries: Vec<(Option<PackId>, Entry)> = wants
            .into_iter()
            .map(|(p, w)| (Some(p), Entry::Chunk(Arc::new(w))))
            .collect();
        // Zero runs, merged.
        let mut zeroed = zeroed;
        zeroed.sort_unstable();
        let mut runs: Vec<Range<u64>> = Vec::new();
        for s in zeroed {
            let r = s * cs..((s + 1) * cs).min(volume);
            match runs.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => runs.push(r),
            }
        }
        entries.extend(runs.into_iter().map(|r| (None, Entry::Zero(r))));
        entries.sort_by_key(|(_, e)| e.offset());
        // Per pack, its chunks in pack order.
        let mut per_pack: BTreeMap<PackId, Vec<(usize, Arc<Want>)>> = BTreeMap::new();
        for (i, (p, e)) in entries.iter().enumerate() {
            if let (Some(p), Entry::Chunk(w)) = (p, e) {
                per_pack.entry(*p).or_default().push((i, w.clone()));
            }
        }
        let mut reads = Vec::new();
        for (pack, mut members) in per_pack {
            members.sort_by_key(|(_, w)| w.at);
            reads.extend(coalesce(pack, members, opts.max_gap, opts.max_read));
        }
        reads.sort_by_key(PlannedRead::first_entry);
        Ok(Self {
            entries: entries.into_iter().map(|(_, e)| e).collect(),
            reads,
        })
    }

    /// Ranged reads planned.
    pub(crate) fn read_count(&self) -> usize {
        self.reads.len()
    }
}

/// Cuts one pack's members (ascending by position) into reads: a gap of at most `max_gap`
/// bytes is read through (one request instead of two), a read spans at most `max_read` bytes
/// (a single blob longer than that is one read of its own), and a read never goes back in
/// volume order (see the module docs).
fn coalesce(
    pack: PackId,
    members: Vec<(usize, Arc<Want>)>,
    max_gap: u64,
    max_read: u64,
) -> Vec<PlannedRead> {
    let mut out: Vec<PlannedRead> = Vec::new();
    for (e, w) in members {
        let (start, end) = (w.at, w.at + u64::from(w.stored_len));
        if let Some(r) = out.last_mut()
            && start >= r.range.end
            && start - r.range.end <= max_gap
            && end - r.range.start <= max_read
            && r.members.last().is_some_and(|(last, _)| *last < e)
        {
            r.range.end = end;
            r.members.push((e, w));
            continue;
        }
        out.push(PlannedRead {
            pack,
            range: start..end,
            members: vec![(e, w)],
        });
    }
    out
}

/// What a restore read, shared with its read tasks.
#[derive(Debug, Default)]
struct Counters {
    chunks: AtomicU64,
    bytes: AtomicU64,
    reads: AtomicU64,
    downloaded: AtomicU64,
    skipped: AtomicU64,
    peak_held: AtomicU64,
}

/// Where read tasks wait for room in the reorder window.
#[derive(Debug)]
struct Gate {
    state: Mutex<GateState>,
    room: Notify,
    buffer: u64,
}

#[derive(Debug)]
struct GateState {
    /// Decoded bytes handed to the channel and not yet handed on by `next`.
    held: u64,
    /// The entry `next` hands on next.
    cursor: usize,
}

impl Gate {
    /// Waits until `len` more bytes may be held, or passes at once with the cursor's chunk.
    async fn enter(&self, entry: usize, len: u64, counters: &Counters) {
        loop {
            let notified = self.room.notified();
            {
                let mut s = self.state.lock().expect("invariant: gate lock");
                if entry == s.cursor || s.held + len <= self.buffer {
                    s.held += len;
                    counters.peak_held.fetch_max(s.held, Ordering::Relaxed);
                    return;
                }
            }
            notified.await;
        }
    }

    /// `len` bytes were handed on; the cursor is now `cursor`.
    fn release(&self, len: u64, cursor: usize) {
        let mut s = self.state.lock().expect("invariant: gate lock");
        s.held = s.held.saturating_sub(len);
        s.cursor = cursor;
        drop(s);
        self.room.notify_waiters();
    }

    fn set_cursor(&self, cursor: usize) {
        self.state.lock().expect("invariant: gate lock").cursor = cursor;
        self.room.notify_waiters();
    }
}

enum Msg {
    Chunk { entry: usize, data: Bytes },
    Done,
}

/// A running restore. Pull items with [`Self::next`].
pub struct RestoreStream {
    target: Arc<Target>,
    family: FamilyId,
    entries: Vec<Entry>,
    /// Reads not started yet, in the order they start.
    reads: std::iter::Peekable<std::vec::IntoIter<PlannedRead>>,
    opts: RestoreOptions,
    running: usize,
    tasks: JoinSet<Result<()>>,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    ready: HashMap<usize, Bytes>,
    cursor: usize,
    gate: Arc<Gate>,
    counters: Arc<Counters>,
    failed: bool,
}

impl RestoreStream {
    pub(crate) fn start(
        target: Arc<Target>,
        family: FamilyId,
        plan: Plan,
        opts: RestoreOptions,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let gate = Arc::new(Gate {
            state: Mutex::new(GateState { held: 0, cursor: 0 }),
            room: Notify::new(),
            buffer: opts.buffer.max(1),
        });
        Self {
            target,
            family,
            entries: plan.entries,
            reads: plan.reads.into_iter().peekable(),
            opts,
            running: 0,
            tasks: JoinSet::new(),
            tx,
            rx,
            ready: HashMap::new(),
            cursor: 0,
            gate,
            counters: Arc::new(Counters::default()),
            failed: false,
        }
    }

    /// The next item, in ascending volume order; `None` at the end.
    pub async fn next(&mut self) -> Option<Result<RestoreItem>> {
        if self.failed {
            return None;
        }
        loop {
            // Take what has come, and keep the reads going (also while the consumer is
            // faster than them, so the pipeline never drains between items).
            while let Ok(msg) = self.rx.try_recv() {
                self.take(msg);
            }
            self.start_reads();
            let entry = self.entries.get(self.cursor)?;
            match entry {
                Entry::Zero(r) => {
                    let item = RestoreItem::Zero {
                        offset: r.start,
                        len: r.end - r.start,
                    };
                    self.cursor += 1;
                    self.gate.set_cursor(self.cursor);
                    return Some(Ok(item));
                }
                Entry::Chunk(w) => {
                    if let Some(data) = self.ready.remove(&self.cursor) {
                        self.gate.release(data.len() as u64, self.cursor + 1);
                        let c = &self.counters;
                        c.chunks.fetch_add(1, Ordering::Relaxed);
                        c.bytes.fetch_add(
                            data.len() as u64 * w.offsets.len() as u64,
                            Ordering::Relaxed,
                        );
                        let item = RestoreItem::Data {
                            offsets: w.offsets.clone(),
                            data,
                        };
                        self.cursor += 1;
                        return Some(Ok(item));
                    }
                }
            }
            match self.receive().await {
                Ok(()) => {}
                Err(e) => {
                    self.failed = true;
                    self.tasks.abort_all();
                    return Some(Err(e));
                }
            }
        }
    }

    /// Starts reads while fewer than `concurrency` run, and any read the cursor has reached
    /// (see the module docs: the cursor's chunk must be in a running read).
    fn start_reads(&mut self) {
        loop {
            let due = match self.reads.peek() {
                None => return,
                Some(r) => r.first_entry() <= self.cursor,
            };
            if !due && self.running >= self.opts.concurrency.max(1) {
                return;
            }
            let read = self.reads.next().expect("invariant: peeked");
            self.running += 1;
            let job = ReadTask {
                target: self.target.clone(),
                family: self.family.clone(),
                read,
                gate: self.gate.clone(),
                tx: self.tx.clone(),
                counters: self.counters.clone(),
            };
            self.tasks.spawn(job.run());
        }
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Chunk { entry, data } => {
                self.ready.insert(entry, data);
            }
            Msg::Done => self.running -= 1,
        }
    }

    /// Waits for one message from the read tasks (or the failure of one).
    async fn receive(&mut self) -> Result<()> {
        tokio::select! {
            msg = self.rx.recv() => match msg {
                Some(msg) => self.take(msg),
                None => {
                    return Err(BackupError::Task("restore reads stopped".into()));
                }
            },
            Some(joined) = self.tasks.join_next() => match joined {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(e.into()),
            },
        }
        Ok(())
    }

    /// What the restore has read so far.
    pub fn stats(&self) -> RestoreStats {
        let c = &self.counters;
        RestoreStats {
            chunks: c.chunks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            downloaded: c.downloaded.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            peak_held: c.peak_held.load(Ordering::Relaxed),
        }
    }
}

/// One planned read, run as a task.
struct ReadTask {
    target: Arc<Target>,
    family: FamilyId,
    read: PlannedRead,
    gate: Arc<Gate>,
    tx: mpsc::UnboundedSender<Msg>,
    counters: Arc<Counters>,
}

impl ReadTask {
    async fn run(self) -> Result<()> {
        let key = pack::pack_key(&self.target, &self.family, self.read.pack);
        let object = self.target.rel(&key).to_string();
        let range = self.read.range.clone();
        let mut body = self.target.get_range_stream(&key, range.clone()).await?;
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        // `piece` holds body bytes from pack offset `pos` on.
        let mut piece = Bytes::new();
        let mut pos = range.start;
        let short = |hash: ChunkHash, offset: u64| BackupError::CorruptChunk {
            object: object.clone(),
            hash,
            offset,
            reason: format!("the ranged read {range:?} ended early"),
        };
        for (entry, w) in &self.read.members {
            // Skip the gap before this blob.
            while pos < w.at {
                if piece.is_empty() {
                    piece = next_piece(&mut body, &self.counters)
                        .await?
                        .ok_or_else(|| short(w.hash, w.offsets[0]))?;
                }
                let n = (w.at - pos).min(piece.len() as u64) as usize;
                let _ = piece.split_to(n);
                pos += n as u64;
                self.counters.skipped.fetch_add(n as u64, Ordering::Relaxed);
            }
            // The blob's bytes: a slice of one piece when it lies in one, else gathered.
            let want = w.stored_len as usize;
            let stored = if piece.len() >= want {
                piece.split_to(want)
            } else {
                let mut buf = BytesMut::with_capacity(want);
                while buf.len() < want {
                    if piece.is_empty() {
                        piece = next_piece(&mut body, &self.counters)
                            .await?
                            .ok_or_else(|| short(w.hash, w.offsets[0]))?;
                    }
                    let n = (want - buf.len()).min(piece.len());
                    buf.extend_from_slice(&piece.split_to(n));
                }
                buf.freeze()
            };
            pos += want as u64;
            let (w2, object2) = (w.clone(), object.clone());
            let data = tokio::task::spawn_blocking(move || decode(&object2, stored, &w2)).await??;
            self.gate
                .enter(*entry, data.len() as u64, &self.counters)
                .await;
            if self
                .tx
                .send(Msg::Chunk {
                    entry: *entry,
                    data,
                })
                .is_err()
            {
                return Ok(()); // the stream was dropped
            }
        }
        // The body must end here (and a drained body lets the connection be reused).
        while let Some(extra) = next_piece(&mut body, &self.counters).await? {
            if !piece.is_empty() || !extra.is_empty() {
                return Err(BackupError::CorruptObject {
                    object,
                    reason: format!("the ranged read {range:?} sent more bytes than asked"),
                });
            }
        }
        let _ = self.tx.send(Msg::Done);
        Ok(())
    }
}

async fn next_piece(
    body: &mut futures::stream::BoxStream<'static, Result<Bytes>>,
    counters: &Counters,
) -> Result<Option<Bytes>> {
    match body.next().await {
        None => Ok(None),
        Some(Err(e)) => Err(e),
        Some(Ok(b)) => {
            counters
                .downloaded
                .fetch_add(b.len() as u64, Ordering::Relaxed);
            Ok(Some(b))
        }
    }
}

/// Decompresses and checks one blob against its hash and its slot's length.
fn decode(object: &str, stored: Bytes, w: &Want) -> Result<Bytes> {
    let corrupt = |reason: String| BackupError::CorruptChunk {
        object: object.to_string(),
        hash: w.hash,
        offset: w.offsets[0],
        reason,
    };
    let data = blob::decode_bytes(stored, w.codec, w.raw_len, &w.hash).map_err(corrupt)?;
    if data.len() as u64 != w.len {
        return Err(corrupt(format!(
            "chunk has {} bytes, its slot {}",
            data.len(),
            w.len
        )));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(at: u64, len: u32, offset: u64) -> Arc<Want> {
        Arc::new(Want {
            hash: ChunkHash([at as u8; 32]),
            offsets: vec![offset],
            at,
            stored_len: len,
            raw_len: len,
            codec: Codec::Raw,
            len: u64::from(len),
        })
    }

    #[test]
    fn coalescing_bridges_small_gaps_and_caps_the_read_size() {
        let p = PackId(7);
        let mib = 1u64 << 20;
        // Blobs of 1 MiB at 16, 16+1M, (gap of 1 MiB) 16+3M, (gap of 3 MiB) 16+7M.
        let members: Vec<_> = [0u64, 1, 3, 7]
            .iter()
            .enumerate()
            .map(|(i, k)| (i, want(16 + k * mib, mib as u32, k * mib)))
            .collect();
        let reads = coalesce(p, members.clone(), mib, 64 * mib);
        let ranges: Vec<_> = reads.iter().map(|r| r.range.clone()).collect();
        assert_eq!(ranges, vec![16..16 + 4 * mib, 16 + 7 * mib..16 + 8 * mib]);
        // No gap allowed: three reads; a cap of 2 MiB: the first two blobs only together.
        assert_eq!(coalesce(p, members.clone(), 0, 64 * mib).len(), 3);
        let capped = coalesce(p, members, 64 * mib, 2 * mib);
        assert_eq!(capped.len(), 3);
        assert_eq!(capped[0].members.len(), 2);
        assert_eq!(capped[0].needed(), 2 * mib);
    }
}
