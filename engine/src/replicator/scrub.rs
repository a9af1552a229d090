//! Scrub: a background pass over the whole volume that checks every allocated block of every
//! layer on every RW replica against its checksum, compares the replicas with each other, and
//! repairs what it can, at a limited rate.
//!
//! The volume is walked in pieces of [`SCRUB_PIECE`]. For each piece:
//!
//! 1. Every RW replica that keeps checksums runs `Scrub` on it: it reads its own data (every
//!    layer's, not only what the volume reads) and reports the blocks that fail their
//!    checksums, plus the stored checksum of each block as the volume reads. The replicas do
//!    the reading and checking; nothing but the findings crosses the network.
//! 2. Bad blocks of the head, and blocks whose volume checksums differ between replicas, are
//!    looked at again under the gate and the piece's range lock (so no write is in flight):
//!    a bad head block is healed as a read would (`repair.rs`); a difference that persists
//!    under the lock is *divergence* (replicas that each pass their checksums but hold
//!    different data: a lost write, a bug), set right from the version a majority of the RW
//!    replicas hold, and only reported when there is no majority.
//! 3. Bad blocks of snapshot layers are repaired inside the layer: read from the same layer
//!    of another RW replica (`ReadLayer`, checked there), written into the damaged one's
//!    layer (`WriteLayer`, checked again on arrival). Writing them through the data path
//!    would only hide them under the head.
//!
//! Rate: pieces are paced so that the data bytes read, summed over the replicas, stay under
//! the limit (default [`DEFAULT_SCRUB_RATE`]); holes cost nearly nothing. The report (state,
//! times, progress, rate, findings) is kept for the running scrub and the last finished one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use zebu_proto::replica as pb;
use zebu_proto::sums::BlockSums;

use super::{BLOCK, Mode, PathError, Replica, Volume, VolumeError, rpc_error};
use crate::blockdev::BlockError;

/// Data bytes read per second, over all replicas, unless the caller asks otherwise.
pub const DEFAULT_SCRUB_RATE: u64 = 64 << 20;
/// The volume range one step checks (a replica's `Scrub` takes at most 64 MiB).
const SCRUB_PIECE: u64 = 8 << 20;
/// One replica's `Scrub` of a piece, or a layer repair, may take this long.
const SCRUB_RPC_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a scrub is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScrubState {
    /// No scrub since the engine started.
    #[default]
    Never,
    Running,
    Done,
    Stopped,
    Failed,
}

/// Progress and findings of one scrub.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScrubReport {
    pub state: ScrubState,
    pub started_unix_ms: i64,
    /// 0 while running.
    pub finished_unix_ms: i64,
    pub bytes_scanned: u64,
    pub bytes_total: u64,
    /// Data bytes read and checked, summed over the replicas.
    pub bytes_verified: u64,
    pub bytes_per_second: u64,
    pub rate_limit: u64,
    pub corrupt_found: u64,
    pub repaired: u64,
    pub unrecoverable: u64,
    pub divergent: u64,
    pub divergent_repaired: u64,
    pub bytes_unverified: u64,
    pub replicas: Vec<String>,
    pub error: String,
}

/// The scrub state a volume keeps.
#[derive(Default)]
pub(super) struct ScrubControl {
    current: Mutex<ScrubReport>,
    last_done: Mutex<Option<ScrubReport>>,
    stop: AtomicBool,
}

/// `bytes` per second of `elapsed` (a tiny elapsed counts as a millisecond).
fn per_second(bytes: u64, elapsed: Duration) -> u64 {
    let ms = elapsed.as_millis().max(1);
    u64::try_from(u128::from(bytes) * 1000 / ms).unwrap_or(u64::MAX)
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Volume {
    /// The running (or last) scrub, and the last one that finished.
    pub fn scrub_status(&self) -> (ScrubReport, Option<ScrubReport>) {
        let cur = self
            .scrub
            .current
            .lock()
            .expect("invariant: scrub lock")
            .clone();
        let last = self
            .scrub
            .last_done
            .lock()
            .expect("invariant: scrub lock")
            .clone();
        (cur, last)
    }

    /// Starts a scrub in the background at `rate` data bytes per second (0: the default);
    /// refused while one runs.
    pub fn start_scrub(self: &Arc<Self>, rate: u64) -> Result<ScrubReport, VolumeError> {
        let rate = if rate == 0 { DEFAULT_SCRUB_RATE } else { rate };
        let report = {
            let mut cur = self.scrub.current.lock().expect("invariant: scrub lock");
            if cur.state == ScrubState::Running {
                return Err(VolumeError::ScrubRunning {
                    volume: self.name().to_string(),
                });
            }
            *cur = ScrubReport {
                state: ScrubState::Running,
                started_unix_ms: unix_ms(),
                bytes_total: self.size.load(Ordering::Acquire),
                rate_limit: rate,
                ..ScrubReport::default()
            };
            cur.clone()
        };
        self.scrub.stop.store(false, Ordering::Release);
        tracing::info!(volume = %self.name(), rate, "scrub started");
        let v = self.clone();
        tokio::spawn(async move { v.run_scrub(rate).await });
        Ok(report)
    }

    /// Asks the running scrub to stop after the piece it is on.
    pub fn stop_scrub(&self) -> ScrubReport {
        self.scrub.stop.store(true, Ordering::Release);
        self.scrub_status().0
    }

    fn scrub_update(&self, f: impl FnOnce(&mut ScrubReport)) {
        f(&mut self.scrub.current.lock().expect("invariant: scrub lock"));
    }

    async fn run_scrub(self: Arc<Self>, rate: u64) {
        let began = Instant::now();
        let size = self.size.load(Ordering::Acquire);
        let before = self.integrity();
        let mut at = 0;
        let mut outcome = Ok(ScrubState::Done);
        while at < size {
            if self.scrub.stop.load(Ordering::Acquire) {
                outcome = Ok(ScrubState::Stopped);
                break;
            }
            let n = SCRUB_PIECE.min(size - at);
            match self.scrub_piece(at, n).await {
                Ok(()) => {}
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
            at += n;
            let verified = self.scrub_status().0.bytes_verified;
            let elapsed = began.elapsed();
            let due = Duration::from_secs_f64(verified as f64 / rate as f64);
            self.scrub_update(|r| {
                r.bytes_scanned = at;
                r.bytes_per_second = per_second(verified, elapsed);
            });
            if due > elapsed {
                tokio::time::sleep(due - elapsed).await;
            }
        }
        let after = self.integrity();
        let elapsed = began.elapsed();
        self.scrub_update(|r| {
            r.finished_unix_ms = unix_ms();
            r.bytes_per_second = per_second(r.bytes_verified, elapsed);
            r.repaired += after.repaired_blocks - before.repaired_blocks;
            r.unrecoverable += after.unrecoverable_blocks - before.unrecoverable_blocks;
            match &outcome {
                Ok(state) => r.state = *state,
                Err(e) => {
                    r.state = ScrubState::Failed;
                    r.error = e.to_string();
                }
            }
        });
        let (report, _) = self.scrub_status();
        tracing::info!(volume = %self.name(), state = ?report.state, scanned = report.bytes_scanned,
            verified = report.bytes_verified, rate = report.bytes_per_second,
            corrupt = report.corrupt_found, repaired = report.repaired,
            unrecoverable = report.unrecoverable, divergent = report.divergent,
            error = %report.error, "scrub finished");
        if report.state == ScrubState::Done {
            *self.scrub.last_done.lock().expect("invariant: scrub lock") = Some(report);
        }
    }

    /// Checks one piece on every RW replica and repairs what it found (module docs).
    async fn scrub_piece(&self, at: u64, n: u64) -> Result<(), VolumeError> {
        let rw: Vec<Arc<Replica>> = self
            .with_mode(&[Mode::RW])
            .into_iter()
            .filter(|r| r.verifies())
            .collect();
        if rw.is_empty() {
            return Err(VolumeError::NoVerifyingReplica {
                volume: self.name().to_string(),
            });
        }
        let calls = rw.iter().map(|r| {
            let mut c = r.control();
            let req = pb::ScrubRequest {
                offset: at,
                length: n,
            };
            async move { tokio::time::timeout(SCRUB_RPC_TIMEOUT, c.scrub(req)).await }
        });
        let results = futures::future::join_all(calls).await;
        let mut answers: Vec<(Arc<Replica>, pb::ScrubResponse)> = Vec::new();
        for (r, res) in rw.iter().zip(results) {
            match res {
                Ok(Ok(resp)) => answers.push((r.clone(), resp.into_inner())),
                // A replica of an older build: nothing to check there.
                Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {}
                Ok(Err(s)) => self.fail(r, &format!("scrub at {at}: {}", s.message())),
                Err(_) => self.fail(
                    r,
                    &format!("scrub at {at}: no answer in {SCRUB_RPC_TIMEOUT:?}"),
                ),
            }
        }
        self.commit_membership().await?;
        let mut head_bad = Vec::new();
        let mut layer_bad = Vec::new();
        self.scrub_update(|rep| {
            for (r, a) in &answers {
                rep.bytes_verified += a.bytes_verified;
                rep.bytes_unverified += a.bytes_unverified;
                if !rep.replicas.contains(&r.addr) {
                    rep.replicas.push(r.addr.clone());
                }
                for b in &a.bad {
                    rep.corrupt_found += 1;
                    if b.layer.is_empty() {
                        head_bad.push(b.offset);
                    } else {
                        layer_bad.push((r.clone(), b.layer.clone(), b.offset));
                    }
                }
            }
        });
        let blocks = (n / BLOCK) as usize;
        let differ: Vec<u64> = (0..blocks)
            .filter(|&i| {
                let mut sums = answers.iter().filter_map(|(_, a)| a.crc32c.get(i));
                let first = sums.next();
                sums.any(|s| Some(s) != first)
            })
            .map(|i| at + i as u64 * BLOCK)
            .collect();
        if !head_bad.is_empty() || !differ.is_empty() {
            head_bad.sort_unstable();
            head_bad.dedup();
            let _g = self.gate.read().await;
            let _r = self.ranges.lock(at..at + n).await;
            for &b in &head_bad {
                match self.assemble(b, BLOCK).await {
                    Ok(_) | Err(BlockError::Medium { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            for &b in &differ {
                self.settle_divergence(b).await?;
            }
        }
        for (r, layer, offset) in layer_bad {
            match self.repair_layer_block(&r, &layer, offset).await {
                Ok(()) => {
                    self.integrity.repaired(1);
                    tracing::warn!(volume = %self.name(), replica = %r.addr, layer = %layer, offset,
                        "repaired a snapshot block that failed its checksum, from a good copy");
                }
                Err(e) => {
                    self.integrity.lost(1);
                    tracing::error!(volume = %self.name(), replica = %r.addr, layer = %layer, offset,
                        "cannot repair a snapshot block that fails its checksum: {e}");
                }
            }
        }
        Ok(())
    }

    /// Looks at a block whose checksums differ between replicas again, under the range lock
    /// the caller holds; sets it right from the majority's version if there is one.
    async fn settle_divergence(&self, block: u64) -> Result<(), VolumeError> {
        let rw: Vec<Arc<Replica>> = self
            .with_mode(&[Mode::RW])
            .into_iter()
            .filter(|r| r.verifies())
            .collect();
        let mut versions: BTreeMap<u32, Vec<Arc<Replica>>> = BTreeMap::new();
        for r in &rw {
            match self.block_sums(r, block, BLOCK).await {
                Ok(s) if s.len() == 1 => versions.entry(s[0]).or_default().push(r.clone()),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(volume = %self.name(), replica = %r.addr, "checksums for divergence: {e}")
                }
            }
        }
        if versions.len() < 2 {
            return Ok(()); // a write in flight during the unlocked pass
        }
        self.scrub_update(|r| r.divergent += 1);
        let total: usize = versions.values().map(Vec::len).sum();
        let Some((&sum, winners)) = versions.iter().find(|(_, rs)| rs.len() * 2 > total) else {
            tracing::error!(volume = %self.name(), offset = block,
                versions = ?versions.iter().map(|(s, rs)| (format!("{s:08x}"), rs.iter().map(|r| r.addr.clone()).collect::<Vec<_>>())).collect::<Vec<_>>(),
                "replicas hold different data for a block and no version has a majority; left as it is");
            return Ok(());
        };
        let mut good = None;
        for w in winners {
            match w.data.read(self.next_id(), block, BLOCK).await {
                Ok(d) => {
                    good = Some(d);
                    break;
                }
                Err(PathError::Corrupt { .. }) => {}
                Err(e) => self.fail(w, &format!("read for divergence: {e}")),
            }
        }
        let Some(data) = good else {
            return Ok(());
        };
        for (s, rs) in &versions {
            if *s == sum {
                continue;
            }
            for r in rs {
                let sums = Some(BlockSums::from_crcs([sum]));
                match r
                    .data
                    .write(self.next_id(), block, data.clone(), sums)
                    .await
                {
                    Ok(()) => {
                        tracing::warn!(volume = %self.name(), replica = %r.addr, offset = block,
                        "divergent block set to the version most replicas hold")
                    }
                    Err(e) => self.fail(r, &format!("divergence repair at {block}: {e}")),
                }
            }
        }
        self.scrub_update(|r| r.divergent_repaired += 1);
        Ok(self.commit_membership().await?)
    }

    /// Rewrites one block of snapshot `layer` on `damaged` from the same layer of another RW
    /// replica whose copy passes its checksum (module docs, step 3).
    async fn repair_layer_block(
        &self,
        damaged: &Arc<Replica>,
        layer: &str,
        offset: u64,
    ) -> Result<(), VolumeError> {
        let info = damaged
            .control()
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| rpc_error(self.name(), damaged, "Info", &s))?
            .into_inner();
        let l = info
            .layers
            .iter()
            .find(|l| l.name == layer && !l.head)
            .ok_or_else(|| VolumeError::SnapshotGone {
                volume: self.name().to_string(),
                replica: damaged.addr.clone(),
                layer: layer.to_string(),
            })?
            .clone();
        let parent = info
            .layers
            .iter()
            .find(|p| p.id == l.parent)
            .map(|p| p.name.clone())
            .unwrap_or_default();
        let sources: Vec<Arc<Replica>> = self
            .with_mode(&[Mode::RW])
            .into_iter()
            .filter(|r| r.addr != damaged.addr && r.verifies())
            .collect();
        for src in sources {
            let req = pb::ReadLayerRequest {
                layer: layer.to_string(),
                extents: vec![pb::Extent {
                    offset,
                    length: BLOCK,
                }],
            };
            let mut c = src.control();
            let Ok(Ok(stream)) = tokio::time::timeout(SCRUB_RPC_TIMEOUT, c.read_layer(req)).await
            else {
                continue;
            };
            let mut stream = stream.into_inner();
            let Ok(Some(chunk)) = stream.message().await else {
                continue;
            };
            if !chunk.corrupt.is_empty() || chunk.data.len() as u64 != BLOCK {
                continue; // bad there too
            }
            let first = pb::WriteLayerRequest {
                layer: l.name.clone(),
                parent: parent.clone(),
                user_created: l.user_created,
                created: l.created.clone(),
                labels: l.labels.clone(),
                size: l.size,
                chunk: Some(chunk),
            };
            let mut d = damaged.control();
            let write = d.write_layer(tokio_stream::iter(vec![first]));
            match tokio::time::timeout(SCRUB_RPC_TIMEOUT, write).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(s)) => return Err(rpc_error(self.name(), damaged, "WriteLayer", &s)),
                Err(_) => {
                    return Err(VolumeError::Rpc {
                        volume: self.name().to_string(),
                        replica: damaged.addr.clone(),
                        call: "WriteLayer",
                        message: format!("no answer in {SCRUB_RPC_TIMEOUT:?}"),
                    });
                }
            }
        }
        Err(VolumeError::NoGoodCopy {
            volume: self.name().to_string(),
            offset,
        })
    }
}
