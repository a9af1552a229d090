//! Deletion and garbage collection, safe while backups run.
//!
//! Deleting a backup deletes its manifest and nothing else. Packs are removed by GC, one
//! family at a time, in two passes separated by a safety margin:
//!
//! 1. **Condemn.** GC computes the live blobs (every map page a manifest names, and every
//!    chunk those pages name). A pack older than the margin with no live blob is condemned;
//!    a pack whose live part is below `repack_below` of its size has its live blobs copied
//!    (verified) into new packs and is then condemned too. The condemned pack ids are written
//!    in one `gc/condemned-ID.json` object; the server's time of that put is the
//!    condemnation's time `T`. Nothing is deleted in this pass.
//! 2. **Delete.** A later run deletes the packs of a condemnation once it is at least the
//!    margin old *and* no live writer session started before `T` (plus two seconds for
//!    timestamp granularity), re-checking first, against the manifests of that moment, that
//!    every live blob of the pack has a copy in a pack that stays.
//!
//! # Why a concurrent backup cannot lose a chunk
//!
//! A writer creates its session marker before it reads anything ([`crate::session`]), then
//! reads the condemnations and never deduplicates against a condemned pack. Take a pack P
//! condemned at `T` and a writer W that references a blob b of P in its manifest:
//!
//! - If W started after `T`, it saw the condemnation and did not take b from P by dedup; it
//!   can only reference b through its parent's pages, and then the parent was committed
//!   when W started. If the parent existed at the condemning pass, b was live then and P was
//!   not condemned unless b had been copied elsewhere first. If the parent was committed
//!   later, its writer started before `T` (it is covered by the next case) or dedup'ed from a
//!   healthy pack.
//! - If W started before `T`, its marker blocks the deletion as long as it is live. GC lists
//!   the markers *before* the manifests: if W's marker is gone, W committed before the
//!   listing, so the manifest listing that follows shows W's manifest, b is live, and P is
//!   kept unless b has a copy elsewhere. W's marker stops being live only if W stopped
//!   refreshing it for longer than the ttl, and W refuses to commit after half the ttl
//!   without a refresh.
//!
//! So a pack is deleted only when no manifest that exists or can still be committed needs it.
//! The margin adds a second guard (packs younger than it are never condemned, so a writer's
//! fresh packs are safe even before its manifest exists) and keeps the decision away from
//! races of a few seconds; the two passes make every deletion rest on a second, fresh look
//! at the manifests and sessions.
//!
//! # Memory
//!
//! The family index and the live set (one hash per live blob). Manifests and pages are read
//! one at a time; nothing is held per backup beyond its page hashes.
//!
//! # The lease
//!
//! One GC per family at a time holds `gc/lease-GEN.json`. A GC takes generation `g+1` with a
//! create-only put (so of two only one wins) and keeps it only if generation `g` is expired
//! by the server's clock (its holder did not renew it within its ttl); otherwise it removes
//! its own key and reports [`GcOutcome::Busy`], which is an answer, not an error: another GC
//! is doing the work. A holder renews between phases and stops (with [`BackupError::LeaseLost`])
//! if it could not renew within half the ttl.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::blob::{self, EncodedBlob};
use crate::error::{BackupError, Result};
use crate::ids::{ChunkHash, FamilyId, PackId};
use crate::index::FamilyIndex;
use crate::manifest::Manifest;
use crate::map::Page;
use crate::pack::{self, PackLimits, PackSink};
use crate::session::{SessionBody, SessionTimes};
use crate::target::Target;

/// Timestamps of S3 listings have a granularity; a session started this close to a
/// condemnation counts as started before it.
const SLACK_MS: i64 = 2_000;

/// How GC decides.
#[derive(Clone, Copy, Debug)]
pub struct GcOptions {
    /// Packs younger than this are never condemned; condemnations younger than this are not
    /// carried out. It must exceed the longest pause of a writer between writing a pack and
    /// its session's heartbeats (the session ttl covers the rest).
    pub margin: Duration,
    /// Repack a pack whose live bytes are below this fraction of its size.
    pub repack_below: f64,
    /// Lease ttl.
    pub lease_ttl: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            margin: Duration::from_secs(3600),
            repack_below: 0.5,
            lease_ttl: Duration::from_secs(600),
        }
    }
}

/// What a GC run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests: usize,
    pub live_blobs: usize,
    pub packs: usize,
    /// Packs condemned by this run (the first pass).
    pub condemned: usize,
    /// Of those, packs repacked (their live blobs copied into `repack_packs` new packs).
    pub repacked: usize,
    pub repack_packs: usize,
    /// Packs deleted by this run (the second pass of earlier condemnations).
    pub deleted: usize,
    pub deleted_bytes: u64,
    /// Condemned packs whose deletion waits (margin not reached, or a live session older).
    pub waiting: usize,
    /// Condemned packs that turned out live again and were kept.
    pub kept_live: usize,
    pub live_sessions: usize,
    pub expired_sessions_removed: usize,
    pub staged_uploads_removed: usize,
}

/// The outcome of asking for a GC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GcOutcome {
    Done(GcReport),
    /// Another GC holds the family's lease; nothing was done.
    Busy {
        holder: String,
        generation: u64,
    },
}

#[derive(Serialize, Deserialize)]
struct LeaseBody {
    holder: String,
    ttl_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct Condemnation {
    packs: Vec<String>,
}

struct Lease {
    key: object_store::path::Path,
    body: Bytes,
    ttl: Duration,
    renewed: Instant,
    /// Server time of the last renewal, ms.
    server_ms: i64,
}

fn lease_gen(rel: &str) -> Option<u64> {
    rel.rsplit('/')
        .next()?
        .strip_prefix("lease-")?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

async fn acquire(
    target: &Target,
    family: &FamilyId,
    ttl: Duration,
    holder: &str,
) -> Result<Result<Lease, (String, u64)>> {
    let gc_dir = format!("families/{family}/gc");
    let mut leases: Vec<(u64, object_store::ObjectMeta)> = target
        .list(&gc_dir)
        .await?
        .into_iter()
        .filter_map(|m| Some((lease_gen(target.rel(&m.location))?, m)))
        .collect();
    leases.sort_by_key(|(g, _)| *g);
    let next = leases.last().map_or(1, |(g, _)| g + 1);
    let key = target.key(&format!("{gc_dir}/lease-{next:020}.json"));
    let body = Bytes::from(
        serde_json::to_vec(&LeaseBody {
            holder: holder.to_string(),
            ttl_ms: ttl.as_millis() as u64,
        })
        .expect("invariant: serialises"),
    );
    if !target.put_create(&key, body.clone()).await? {
        return Ok(Err(("another GC taking the lease".into(), next)));
    }
    let ours = target
        .head(&key)
        .await?
        .ok_or_else(|| BackupError::Task("lease vanished".into()))?;
    let now = ours.last_modified.timestamp_millis();
    if let Some((g, prev)) = leases.last() {
        let prev_body: Option<LeaseBody> = target
            .get(&prev.location)
            .await?
            .and_then(|b| serde_json::from_slice(&b).ok());
        let prev_ttl = prev_body
            .as_ref()
            .map_or(ttl.as_millis() as i64, |b| b.ttl_ms as i64);
        if prev.last_modified.timestamp_millis() + prev_ttl > now {
            target.delete(&key).await?;
            return Ok(Err((
                prev_body.map_or_else(|| "unknown".into(), |b| b.holder),
                *g,
            )));
        }
        tracing::info!(%family, generation = g, "gc lease expired: taking it over");
    }
    for (_, m) in &leases {
        target.delete(&m.location).await?;
    }
    Ok(Ok(Lease {
        key,
        body,
        ttl,
        renewed: Instant::now(),
        server_ms: now,
    }))
}

impl Lease {
    async fn renew(&mut self, target: &Target, family: &FamilyId) -> Result<()> {
        if self.renewed.elapsed() > self.ttl / 2 {
            return Err(BackupError::LeaseLost {
                family: family.clone(),
                by: 0,
            });
        }
        target.put(&self.key, self.body.clone()).await?;
        if let Some(m) = target.head(&self.key).await? {
            self.server_ms = m.last_modified.timestamp_millis();
        }
        self.renewed = Instant::now();
        Ok(())
    }
}

/// Runs one GC pass over a family.
pub(crate) async fn run(
    target: Arc<Target>,
    family: &FamilyId,
    opts: GcOptions,
    sessions_cfg: SessionTimes,
    limits: PackLimits,
    cache: Option<&std::path::Path>,
) -> Result<GcOutcome> {
    let holder = format!("pid {} on {}", std::process::id(), hostname());
    let mut lease = match acquire(&target, family, opts.lease_ttl, &holder).await? {
        Ok(l) => l,
        Err((holder, generation)) => {
            tracing::info!(%family, %holder, generation, "gc skipped: another GC holds the family's lease");
            return Ok(GcOutcome::Busy { holder, generation });
        }
    };
    let result = run_locked(
        &target,
        family,
        opts,
        sessions_cfg,
        limits,
        cache,
        &mut lease,
    )
    .await;
    if let Err(e) = target.delete(&lease.key).await {
        tracing::warn!(%family, error = %e, "could not release the gc lease (it expires by itself)");
    }
    result.map(GcOutcome::Done)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

async fn run_locked(
    target: &Arc<Target>,
    family: &FamilyId,
    opts: GcOptions,
    sessions_cfg: SessionTimes,
    limits: PackLimits,
    cache: Option<&std::path::Path>,
    lease: &mut Lease,
) -> Result<GcReport> {
    let mut report = GcReport::default();
    let now = lease.server_ms;
    let margin_ms = opts.margin.as_millis() as i64;
    // Sessions first, then manifests (see the module docs for why this order).
    let mut live_starts: Vec<i64> = Vec::new();
    for m in target.list(&format!("families/{family}/sessions")).await? {
        let age = now - m.last_modified.timestamp_millis();
        let body: Option<SessionBody> = target
            .get(&m.location)
            .await?
            .and_then(|b| serde_json::from_slice(&b).ok());
        // Each writer is judged by the ttl it keeps to; a marker without one by ours.
        let ttl = body
            .as_ref()
            .and_then(|b| b.ttl_ms)
            .map_or(sessions_cfg.ttl.as_millis() as i64, |t| t as i64);
        if age > 2 * ttl {
            target.delete(&m.location).await?;
            report.expired_sessions_removed += 1;
        } else if age <= ttl {
            // A marker whose start is not recorded yet counts as the oldest possible.
            live_starts.push(body.and_then(|b| b.started_ms).unwrap_or(i64::MIN));
        }
    }
    report.live_sessions = live_starts.len();
    let mut page_hashes: HashSet<ChunkHash> = HashSet::new();
    let mut pages_of: Vec<(String, Vec<crate::manifest::PageRef>)> = Vec::new();
    for m in target.list(&format!("families/{family}/backups")).await? {
        let rel = target.rel(&m.location).to_string();
        if !rel.ends_with(".manifest") {
            continue;
        }
        let Some(b) = target.get(&m.location).await? else {
            continue;
        };
        let man = Manifest::from_bytes(&rel, &b)?;
        report.manifests += 1;
        let fresh: Vec<_> = man
            .pages
            .iter()
            .filter(|p| page_hashes.insert(p.hash))
            .copied()
            .collect();
        pages_of.push((rel, fresh));
    }
    let mut condemnations: Vec<(object_store::path::Path, i64, Vec<PackId>)> = Vec::new();
    for m in target.list(&format!("families/{family}/gc")).await? {
        let rel = target.rel(&m.location);
        if !rel
            .rsplit('/')
            .next()
            .is_some_and(|n| n.starts_with("condemned-"))
        {
            continue;
        }
        let Some(b) = target.get(&m.location).await? else {
            continue;
        };
        let c: Condemnation =
            serde_json::from_slice(&b).map_err(|e| BackupError::CorruptObject {
                object: rel.to_string(),
                reason: e.to_string(),
            })?;
        let packs = c.packs.iter().filter_map(|s| PackId::from_hex(s)).collect();
        condemnations.push((
            m.location.clone(),
            m.last_modified.timestamp_millis(),
            packs,
        ));
    }
    let condemned: HashSet<PackId> = condemnations
        .iter()
        .flat_map(|(_, _, p)| p.iter().copied())
        .collect();
    let index = FamilyIndex::load(target, family, cache, &condemned).await?;
    report.packs = index.packs().len();
    // The live set: pages, then the chunks they name. A page that cannot be read stops GC:
    // without it liveness is unknown, and unknown means keep.
    let mut live: HashSet<ChunkHash> = page_hashes.clone();
    for (rel, pages) in pages_of {
        for p in pages {
            let raw = crate::reader::fetch_blob(target, family, &index, &p.hash)
                .await
                .map_err(|e| BackupError::CorruptObject {
                    object: rel.clone(),
                    reason: format!(
                        "map page {} unreadable ({e}); gc stopped, nothing deleted",
                        p.index
                    ),
                })?;
            live.extend(Page::decode(&rel, &raw)?.0.into_iter().map(|(_, h)| h));
        }
    }
    report.live_blobs = live.len();
    lease.renew(target, family).await?;

    // Pass 2: carry out old enough, unblocked condemnations.
    let mut deleting: HashSet<PackId> = HashSet::new();
    let mut done_markers = Vec::new();
    for (key, t, packs) in &condemnations {
        let old_enough = now - t >= margin_ms;
        let blocked = live_starts.iter().any(|&s| s <= t + SLACK_MS);
        if old_enough && !blocked {
            deleting.extend(packs.iter().copied());
            done_markers.push(key.clone());
        } else {
            report.waiting += packs.len();
        }
    }
    let by_id: HashMap<PackId, &crate::index::PackMeta> =
        index.packs().iter().map(|p| (p.id, p)).collect();
    let needed: HashSet<ChunkHash> = deleting
        .iter()
        .filter_map(|id| by_id.get(id))
        .flat_map(|p| {
            p.entries
                .iter()
                .filter(|e| live.contains(&e.hash))
                .map(|e| e.hash)
        })
        .collect();
    let mut elsewhere: HashSet<ChunkHash> = HashSet::new();
    if !needed.is_empty() {
        for p in index.packs().iter().filter(|p| !deleting.contains(&p.id)) {
            elsewhere.extend(
                p.entries
                    .iter()
                    .filter(|e| needed.contains(&e.hash))
                    .map(|e| e.hash),
            );
        }
    }
    for id in &deleting {
        let Some(p) = by_id.get(id) else { continue };
        if p.entries
            .iter()
            .any(|e| live.contains(&e.hash) && !elsewhere.contains(&e.hash))
        {
            report.kept_live += 1;
            continue;
        }
        target.delete(&pack::pack_key(target, family, *id)).await?;
        report.deleted += 1;
        report.deleted_bytes += p.size;
    }
    for key in done_markers {
        target.delete(&key).await?;
    }
    if report.deleted > 0 {
        lease.renew(target, family).await?;
    }

    // Pass 1: condemn dead packs, repack mostly dead ones.
    let mut condemn: Vec<PackId> = Vec::new();
    let mut repack: Vec<&crate::index::PackMeta> = Vec::new();
    for p in index.packs() {
        if condemned.contains(&p.id) || now - p.last_modified_ms < margin_ms {
            continue;
        }
        let live_bytes: u64 = p
            .entries
            .iter()
            .filter(|e| live.contains(&e.hash))
            .map(|e| u64::from(e.stored_len))
            .sum();
        if live_bytes == 0 {
            condemn.push(p.id);
        } else if (live_bytes as f64) < opts.repack_below * p.size as f64 {
            repack.push(p);
        }
    }
    // A repack candidate's blobs need a copy only if no pack that stays has one.
    let repack_ids: HashSet<PackId> = repack.iter().map(|p| p.id).collect();
    let mut have: HashSet<ChunkHash> = HashSet::new();
    for p in index.packs().iter().filter(|p| {
        !repack_ids.contains(&p.id) && !condemned.contains(&p.id) && !condemn.contains(&p.id)
    }) {
        have.extend(
            p.entries
                .iter()
                .filter(|e| live.contains(&e.hash))
                .map(|e| e.hash),
        );
    }
    if !repack.is_empty() {
        let mut sink = PackSink::new(target.clone(), family.clone(), limits);
        let mut copied_from = Vec::new();
        'packs: for p in &repack {
            let key = pack::pack_key(target, family, p.id);
            let object = target.rel(&key).to_string();
            let mut blobs = Vec::new();
            for e in p
                .entries
                .iter()
                .filter(|e| live.contains(&e.hash) && !have.contains(&e.hash))
            {
                let stored = target
                    .get_range(&key, e.offset..e.offset + u64::from(e.stored_len))
                    .await?;
                let (codec, raw_len, h) = (e.codec, e.raw_len, e.hash);
                let check = stored.clone();
                let ok =
                    tokio::task::spawn_blocking(move || blob::decode(&check, codec, raw_len, &h))
                        .await?;
                if let Err(reason) = ok {
                    // Never spread or drop a damaged blob: leave the pack alone, say so.
                    tracing::error!(%family, object, hash = %e.hash, reason, "repack: corrupt blob, pack left as it is");
                    continue 'packs;
                }
                blobs.push(EncodedBlob {
                    hash: e.hash,
                    kind: e.kind,
                    codec: e.codec,
                    raw_len: e.raw_len,
                    stored,
                });
            }
            for b in &blobs {
                have.insert(b.hash);
                sink.add(b).await?;
            }
            copied_from.push(p.id);
        }
        let written = sink.finish().await?;
        report.repack_packs = written.len();
        report.repacked = copied_from.len();
        condemn.extend(copied_from);
    }
    if !condemn.is_empty() {
        let body = Condemnation {
            packs: condemn.iter().map(|p| p.to_string()).collect(),
        };
        let key = target.key(&format!(
            "families/{family}/gc/condemned-{}.json",
            PackId::random()
        ));
        target
            .put(
                &key,
                Bytes::from(serde_json::to_vec(&body).expect("invariant: serialises")),
            )
            .await?;
        report.condemned = condemn.len();
    }
    // A staged upload is abandoned only if untouched for longer than a live writer can pause.
    report.staged_uploads_removed = target.sweep_staged_uploads(
        &format!("families/{family}/packs"),
        opts.margin.max(sessions_cfg.ttl),
    )?;
    tracing::info!(%family, ?report, "gc pass done");
    Ok(report)
}
