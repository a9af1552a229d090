//! Engine start: find the current replicas, reconcile them, serve.
//!
//! 1. Ask every given replica for its Info. The highest membership epoch any reachable
//!    replica records, with the members it names, says who was current when the last
//!    engine stopped. The reachable replicas are provably current only when every member
//!    of that epoch is reachable and at that epoch. Otherwise the engine refuses to start
//!    and names each replica and why, unless an operator (or the manager) asked for a
//!    salvage: then it proceeds with the members it has, and says so in the log. That
//!    decision, and the identity check below, is [`decide_start`] (`decide.rs`): a pure
//!    function of the replicas' reports, with a table test of its cases.
//! 2. A new generation (the highest any replica accepted, plus one) fences every older
//!    engine: a replica refuses data streams of lower generations from then on.
//!    Opening the data paths presents it, and a replica answers that hello only after every
//!    request of an older engine's streams has finished; only then are the flush numbers read
//!    again, since a flush of a killed engine may still complete until that point.
//! 3. The current replicas may differ only in regions written since the oldest flush any of
//!    them completed (the replicas keep that record on disk, see `regions.rs` of the
//!    replica). Those regions are compared block by block (the stored CRC32C of each 4 KiB)
//!    and each block that differs is copied to the others from the replica with the highest
//!    flush number, unless that replica had to adopt the block's checksum from its data when
//!    it opened after a crash (`sums.rs` of the replica: the block was being written, or is
//!    damaged, and it cannot tell which) and another replica did not: that one's copy wins.
//!    Then one flush makes them all durable and equal, and a new epoch is recorded.
//! 4. Replicas that are reachable but not current are left out; the caller rebuilds them.
//!
//! Before all this, the volume's identity (issue 18): the engine's uuid is the one it was
//! given, else the one its replicas record (they must agree), else a new one (the first
//! start of a volume, or of replicas made before identity existed). A replica that records
//! another uuid is not this volume's: it is named in the log and the error, never probed for
//! currency, fenced, rebuilt or written. Every hello names the uuid; the current replicas'
//! hellos at start ask them to adopt it if they record none (the upgrade path: see
//! `identity.rs` of the replica).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tonic::transport::Channel;
use zebu_proto::replica as pb;

use zebu_proto::frames::VolumeClaim;
use zebu_proto::ids::ReplicaId;
use zebu_proto::numbers::{Epoch, FlushNumber, Generation};
use zebu_proto::sums::BlockSums;

use super::decide::{
    Reason, Report, Reported, StartInput, UuidChoice, decide_start, reconcile_plan,
};
use super::{
    BLOCK, Membership, Mode, PathError, RangeLock, RebuildStatus, Replica, Volume, VolumeConfig,
    VolumeError, connect_channel, control_client, open_data_path, rpc_error, written_ranges,
};

/// How an engine starts.
#[derive(Debug, Clone)]
pub struct StartOptions {
    pub config: VolumeConfig,
    /// Replica addresses (`host:port`).
    pub replicas: Vec<String>,
    /// Proceed with the best replicas available even when they cannot be shown current.
    pub salvage: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("volume {volume}: no replica is reachable ({details})")]
    NoneReachable { volume: String, details: String },
    #[error(
        "volume {volume}: the reachable replicas cannot be shown current ({details}); bring the \
         missing replicas back, or start with --salvage to proceed with the best available"
    )]
    NotProvablyCurrent { volume: String, details: String },
    #[error(
        "volume {volume}: its replicas record different volume uuids ({details}); give the \
         engine --volume-uuid, or remove the replicas that are not this volume's"
    )]
    Identity { volume: String, details: String },
    /// Salvage or not, no reachable replica is current at the highest epoch they record.
    #[error(
        "volume {volume}: no reachable replica is current ({details}); there is nothing to \
         serve or salvage from"
    )]
    AllStale { volume: String, details: String },
    #[error("volume {volume}: {source}")]
    Exhausted {
        volume: String,
        #[source]
        source: zebu_proto::numbers::CounterError,
    },
    #[error("volume {volume}: replica {addr}: {why}")]
    Replica {
        volume: String,
        addr: String,
        why: String,
    },
    /// Making the current replicas equal, or recording that, failed.
    #[error("volume {volume}: {step}: {source}")]
    Reconcile {
        volume: String,
        step: &'static str,
        #[source]
        source: Box<VolumeError>,
    },
}

/// What one replica told us at start.
struct Probe {
    addr: String,
    channel: Channel,
    info: pb::InfoResponse,
}

/// The snapshot names along the head's chain, oldest first.
pub(super) fn chain_names(info: &pb::InfoResponse) -> Vec<String> {
    let by_id: std::collections::HashMap<u64, &pb::LayerInfo> =
        info.layers.iter().map(|l| (l.id, l)).collect();
    let mut out = Vec::new();
    let mut at = info
        .layers
        .iter()
        .find(|l| l.head)
        .and_then(|h| by_id.get(&h.parent).copied());
    while let Some(l) = at {
        out.push(l.name.clone());
        if out.len() > info.layers.len() {
            break;
        }
        at = by_id.get(&l.parent).copied();
    }
    out.reverse();
    out
}

/// Why a replica could not be asked for its Info at start (it is then reported unreachable).
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error(transparent)]
    Connect(#[from] PathError),
    #[error("no answer to Info within {0:?}")]
    Timeout(Duration),
    /// The replica's own words.
    #[error("Info failed: {0}")]
    Info(String),
    #[error("the replica is closed")]
    Closed,
}

async fn probe(addr: &str, timeout: Duration) -> Result<Probe, ProbeError> {
    let channel = connect_channel(addr, timeout).await?;
    let mut c = control_client(channel.clone());
    let info = tokio::time::timeout(timeout, c.info(pb::InfoRequest {}))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
        .map_err(|s| ProbeError::Info(s.message().to_string()))?
        .into_inner();
    if !info.open {
        return Err(ProbeError::Closed);
    }
    Ok(Probe {
        addr: addr.to_string(),
        channel,
        info,
    })
}

impl Volume {
    /// Starts a volume on `opts.replicas`; see the module comment. Returns the volume and the
    /// addresses of replicas that are not current (to rebuild).
    pub async fn start(opts: StartOptions) -> Result<(Arc<Volume>, Vec<String>), StartError> {
        let volume = opts.config.name.clone();
        let timeout = opts.config.io_timeout;
        let probes: Vec<Result<Probe, ProbeError>> =
            futures::future::join_all(opts.replicas.iter().map(|a| probe(a, timeout))).await;
        let reports: Vec<(String, Report)> = opts
            .replicas
            .iter()
            .zip(&probes)
            .map(|(addr, p)| (addr.clone(), report_of(p)))
            .collect();
        let decision = decide_start(&StartInput {
            volume: &volume,
            given_uuid: opts.config.volume_uuid.as_deref(),
            size: opts.config.size,
            salvage: opts.salvage,
            replicas: &reports,
        })?;
        for &i in &decision.foreign {
            if let Some(Report::Open(r)) = reports.get(i).map(|(_, r)| r) {
                tracing::error!(%volume, "{}: replica {} belongs to volume {}, not to this volume; left alone",
                    reports[i].0, r.id, r.volume_uuid);
            }
        }
        match &decision.reason {
            Reason::Salvage { .. } => tracing::warn!(%volume, "{}", decision.reason),
            r => tracing::info!(%volume, "start: {r}"),
        }
        let uuid = match &decision.uuid {
            UuidChoice::Given(u) | UuidChoice::Recorded(u) => u.clone(),
            UuidChoice::New => {
                let u = new_volume_uuid();
                tracing::info!(%volume, uuid = %u, "no replica records a volume uuid: the volume is now {u}");
                u
            }
        };
        let mut probes: Vec<Option<Probe>> = probes.into_iter().map(Result::ok).collect();
        let current: Vec<Probe> = decision
            .current
            .iter()
            .filter_map(|&i| probes[i].take())
            .collect();
        let top = decision.epoch;
        let (current, mut stale_addrs) = settle_chains(&volume, current).await?;
        stale_addrs.extend(decision.stale.iter().map(|&i| reports[i].0.clone()));
        stale_addrs.extend(decision.absent.iter().map(|&i| reports[i].0.clone()));
        let generation = decision.generation;
        // The current replicas are this volume's members: one that records no volume (made
        // before identity existed) adopts this uuid.
        let claim = VolumeClaim {
            uuid: uuid.clone(),
            adopt: true,
        };
        let mut replicas = Vec::new();
        for p in &current {
            let local = is_local(&p.addr, &opts.config.local_hosts);
            let data = open_data_path(
                opts.config.data_transport,
                &p.addr,
                p.channel.clone(),
                generation,
                &claim,
                timeout,
                local,
            )
            .await
            .map_err(|e| StartError::Replica {
                volume: volume.clone(),
                addr: p.addr.clone(),
                why: e.to_string(),
            })?;
            replicas.push(Arc::new(Replica {
                addr: p.addr.clone(),
                id: ReplicaId::from(p.info.replica_id.as_str()),
                mode: Mutex::new((Mode::RW, "current at start".into())),
                data,
                control: control_client(p.channel.clone()),
                inflight: AtomicUsize::new(0),
                local,
                zero_fill_unmaps: AtomicBool::new(false),
            }));
        }
        // Fenced now (module docs, step 2): the flush numbers cannot move any more.
        let mut current = current;
        for p in &mut current {
            let mut c = control_client(p.channel.clone());
            p.info = tokio::time::timeout(timeout, c.info(pb::InfoRequest {}))
                .await
                .map_err(|_| StartError::Replica {
                    volume: volume.clone(),
                    addr: p.addr.clone(),
                    why: format!("no answer to Info within {timeout:?}"),
                })?
                .map_err(|s| StartError::Replica {
                    volume: volume.clone(),
                    addr: p.addr.clone(),
                    why: format!("Info failed: {}", s.message()),
                })?
                .into_inner();
        }
        let flush = current
            .iter()
            .map(|p| p.info.flush_number)
            .max()
            .unwrap_or(0);
        let v = Arc::new(Volume {
            uuid: uuid.clone(),
            size: AtomicU64::new(opts.config.size),
            config: opts.config,
            generation,
            replicas: RwLock::new(replicas),
            next_id: AtomicU64::new(1),
            ranges: RangeLock::new(),
            gate: tokio::sync::RwLock::new(()),
            membership: tokio::sync::Mutex::new(Membership {
                epoch: top,
                members: Vec::new(),
            }),
            membership_dirty: AtomicBool::new(true),
            flush_number: AtomicU64::new(flush),
            flush_lock: tokio::sync::Mutex::new(()),
            flush_tickets: AtomicU64::new(0),
            flush_covered: AtomicU64::new(0),
            path: Default::default(),
            rebuild: Mutex::new(RebuildStatus::default()),
            ops: tokio::sync::Mutex::new(()),
            integrity: Default::default(),
            scrub: Default::default(),
        });
        let failed = |step: &'static str| {
            let volume = volume.clone();
            move |e: VolumeError| StartError::Reconcile {
                volume,
                step,
                source: Box::new(e),
            }
        };
        v.reconcile(&current).await.map_err(failed("reconcile"))?;
        v.flush_all().await.map_err(|e| failed("flush")(e.into()))?;
        v.commit_membership()
            .await
            .map_err(|e| failed("recording the epoch")(e.into()))?;
        v.start_liveness();
        tracing::info!(%volume, %uuid, generation = generation.0, replicas = v.replicas().len(), ?stale_addrs, "volume started");
        Ok((v, stale_addrs))
    }

    /// Makes the current replicas identical in every region that may differ.
    async fn reconcile(&self, current: &[Probe]) -> Result<(), VolumeError> {
        if current.len() < 2 {
            return Ok(());
        }
        let reps = self.replicas();
        let flush_of = |r: &Replica| {
            FlushNumber(
                current
                    .iter()
                    .find(|p| p.addr == r.addr)
                    .map_or(0, |p| p.info.flush_number),
            )
        };
        let plan = reconcile_plan(&reps.iter().map(|r| flush_of(r)).collect::<Vec<_>>());
        let size = self.size.load(std::sync::atomic::Ordering::Acquire);
        let all: Vec<&Replica> = reps.iter().map(|r| r.as_ref()).collect();
        let ranges = written_ranges(self.name(), &all, plan.since, size).await?;
        if ranges.is_empty() {
            return Ok(());
        }
        // The preferred source first (`decide.rs`).
        let order: Vec<Arc<Replica>> = plan.order.iter().map(|&i| reps[i].clone()).collect();
        let mut copied = 0u64;
        for r in &ranges {
            let mut at = r.start;
            while at < r.end {
                let n = RECONCILE_PIECE.min(r.end - at);
                copied += self.reconcile_piece(&order, at, n).await?;
                at += n;
            }
        }
        tracing::info!(volume = %self.config.name, ranges = ranges.len(), copied, source = %order[0].addr,
            "reconciled regions written since flush {}", plan.since.0);
        Ok(())
    }

    /// Makes every replica in `order` (preferred source first) hold the same data in
    /// `at..at+n`; returns the bytes copied.
    async fn reconcile_piece(
        &self,
        order: &[Arc<Replica>],
        at: u64,
        n: u64,
    ) -> Result<u64, VolumeError> {
        let mut views = Vec::with_capacity(order.len());
        for r in order {
            views.push(self.sums_and_adopted(r, at, n).await?);
        }
        let blocks = (n / BLOCK) as usize;
        if views.iter().any(|(s, _)| s.len() != blocks) {
            return Err(VolumeError::SumsLength {
                volume: self.name().to_string(),
                offset: at,
                length: n,
            });
        }
        // (winner, target) -> blocks to copy.
        let mut copies: std::collections::BTreeMap<(usize, usize), Vec<usize>> = Default::default();
        for i in 0..blocks {
            let first = views[0].0[i];
            if views.iter().all(|(s, _)| s[i] == first) {
                continue;
            }
            let winner = if views[0].1.contains(&(i as u32)) {
                views
                    .iter()
                    .position(|(_, adopted)| !adopted.contains(&(i as u32)))
                    .unwrap_or(0)
            } else {
                0
            };
            for (t, (s, _)) in views.iter().enumerate() {
                if s[i] != views[winner].0[i] {
                    copies.entry((winner, t)).or_default().push(i);
                }
            }
        }
        let mut copied = 0;
        for ((w, t), idx) in copies {
            let (source, target) = (&order[w], &order[t]);
            let mut k = 0;
            while k < idx.len() {
                let mut j = k + 1;
                while j < idx.len() && idx[j] == idx[j - 1] + 1 {
                    j += 1;
                }
                let (first, count) = (idx[k], j - k);
                let off = at + first as u64 * BLOCK;
                let len = count as u64 * BLOCK;
                let want = &views[w].0[first..first + count];
                let data = self.read_source(source, target, off, len, want).await?;
                let sums = BlockSums::from_crcs(want.iter().copied());
                target
                    .data
                    .write(self.next_id(), off, data, Some(sums))
                    .await
                    .map_err(|e| self.path_error(target, e))?;
                copied += len;
                k = j;
            }
        }
        Ok(copied)
    }
}

/// What a probe found, for [`decide_start`].
fn report_of(p: &Result<Probe, ProbeError>) -> Report {
    match p {
        Err(why) => Report::Unreachable(why.to_string()),
        Ok(p) => Report::Open(Reported {
            id: ReplicaId::from(p.info.replica_id.as_str()),
            volume_uuid: p.info.volume_uuid.clone(),
            size: p.info.size,
            epoch: Epoch(p.info.epoch),
            members: p
                .info
                .epoch_members
                .iter()
                .map(|m| ReplicaId::from(m.as_str()))
                .collect(),
            generation: Generation(p.info.generation),
        }),
    }
}

/// A random (version 4) UUID in its usual text form.
pub fn new_volume_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Blocks reconcile compares at a time.
const RECONCILE_PIECE: u64 = 16 << 20;

impl Volume {
    /// The stored checksum of each block of a range on one replica, and the blocks (indices)
    /// it adopted when it opened after a crash.
    async fn sums_and_adopted(
        &self,
        r: &Replica,
        offset: u64,
        len: u64,
    ) -> Result<(Vec<u32>, Vec<u32>), VolumeError> {
        let resp = r
            .control()
            .checksums(pb::ChecksumsRequest {
                offset,
                length: len,
                block_size: BLOCK,
            })
            .await
            .map_err(|s| rpc_error(self.name(), r, "Checksums", &s))?
            .into_inner();
        Ok((resp.crc32c, resp.adopted))
    }
}

/// Current replicas must have the same snapshot chain. One that lacks only the newest
/// snapshot of the others (an engine died while taking it, after I/O was quiesced) gets it;
/// any other difference makes a replica stale.
async fn settle_chains(
    volume: &str,
    current: Vec<Probe>,
) -> Result<(Vec<Probe>, Vec<String>), StartError> {
    let longest = current
        .iter()
        .map(|p| chain_names(&p.info))
        .max_by_key(|c| c.len())
        .unwrap_or_default();
    // How the newest snapshot was taken, to take it again the same way where it is missing.
    let template = longest.last().and_then(|name| {
        current
            .iter()
            .flat_map(|p| p.info.layers.iter())
            .find(|l| &l.name == name)
            .cloned()
    });
    let mut keep = Vec::new();
    let mut stale = Vec::new();
    for mut p in current {
        let names = chain_names(&p.info);
        if names == longest {
            keep.push(p);
        } else if names.len() + 1 == longest.len() && longest.starts_with(&names) {
            let t = template.clone().unwrap_or_default();
            tracing::warn!(volume, replica = %p.addr, snapshot = %t.name, "completing a snapshot an earlier engine left half taken");
            let mut c = control_client(p.channel.clone());
            let req = pb::SnapshotCreateRequest {
                name: t.name,
                user_created: t.user_created,
                labels: t.labels,
            };
            match c.snapshot_create(req).await {
                Ok(info) => {
                    p.info = info.into_inner();
                    keep.push(p);
                }
                Err(s) => {
                    tracing::warn!(volume, replica = %p.addr, "cannot complete the snapshot: {}", s.message());
                    stale.push(p.addr);
                }
            }
        } else {
            tracing::warn!(volume, replica = %p.addr, ?names, ?longest, "snapshot chain differs; treating the replica as stale");
            stale.push(p.addr);
        }
    }
    if keep.is_empty() {
        return Err(StartError::NotProvablyCurrent {
            volume: volume.into(),
            details: "no two replicas agree on the snapshot chain".into(),
        });
    }
    Ok((keep, stale))
}

pub(super) fn is_local(addr: &str, local_hosts: &[String]) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    local_hosts.iter().any(|h| h == host)
}
