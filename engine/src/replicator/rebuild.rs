//! Bringing a replica (back) into the volume while I/O goes on.
//!
//! Two ways, chosen from what the replica holds:
//!
//! - **Catch-up**, for a former member that returns with its data intact (it was a member of
//!   an epoch, and its snapshot chain equals the volume's): it joins as WO, then every region
//!   that may differ — written on any RW replica after the last flush the returning replica
//!   completed, or dirty on the returning replica itself — is compared block by block
//!   (CRC32C of each 4 KiB) and only differing blocks are copied. Each region is copied under
//!   the write range lock, so no write lands between the read from the source and the write
//!   to the target. The region record lives on the replicas' disks, so this works across an
//!   engine restart.
//! - **Full rebuild**, for a replica that was never a member (epoch 0: fresh, or a rebuild
//!   that was interrupted): it joins as WO, a system snapshot freezes all existing data on
//!   every replica, then each layer of the source's chain is streamed (data extents only)
//!   into the target, oldest first. Layers the target already finished in an earlier,
//!   interrupted rebuild are skipped, so a rebuild resumes instead of starting over. If the
//!   source fails, another RW replica takes over.
//!
//! Either way, a flush then aligns the target's flush number and it becomes RW in a new
//! epoch. A replica that fits neither (a stale former member whose chain differs) is refused
//! with the reason: it must be given a fresh directory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use zebu_proto::numbers::FlushNumber;
use zebu_proto::replica as pb;

use super::start::{chain_names, is_local};
use super::{
    Mode, Replica, Volume, VolumeError, connect_channel, control_client, open_data_path, rpc_error,
    written_ranges,
};
use crate::blockdev::BlockDevice;

/// Control operations that move data (merges, layer copies) get this long.
const LONG_TIMEOUT: Duration = Duration::from_secs(3600);

/// Where the volume's rebuild tracker is. One rebuild runs at a time; a new one may start
/// once the last one ended, either way:
///
/// ```text
///   Idle ──start──► Running ──ok──► Done
///                     │   ▲           │
///                  error  └──start────┤
///                     ▼               │
///                   Failed ──start────┘
/// ```
///
/// The control server maps it to `engine.proto`'s `RebuildState` (and the words of protocols
/// 1-2) at its edge; nothing inside the engine compares words.
#[derive(Debug, Clone, Default)]
pub enum RebuildState {
    /// No rebuild since the engine started.
    #[default]
    Idle,
    Running,
    Done,
    /// The rebuild ended with this error; the replica was failed (ERR) or never joined.
    Failed(Arc<VolumeError>),
}

impl RebuildState {
    pub fn is_running(&self) -> bool {
        matches!(self, RebuildState::Running)
    }
}

/// How the replica is being brought in sync (see the module docs), known once it joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildKind {
    /// Every layer of the source's chain copied (a replica that was never a member).
    Full,
    /// Only the regions that may differ compared and copied (a former member).
    CatchUp,
}

/// What `rebuild-status` shows.
#[derive(Debug, Clone, Default)]
pub struct RebuildStatus {
    /// The address of the replica being (or last) rebuilt; empty while idle.
    pub replica: String,
    pub state: RebuildState,
    /// `None` until the replica joined (and while idle).
    pub kind: Option<RebuildKind>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Bytes actually sent to the target.
    pub bytes_copied: u64,
}

impl Volume {
    fn set_status(&self, f: impl FnOnce(&mut RebuildStatus)) {
        f(&mut self.rebuild.lock().expect("invariant: rebuild lock"));
    }

    /// Adds the replica at `addr` and brings it in sync in the background; progress shows in
    /// [`Volume::rebuild_status`]. Fails at once, changing nothing, if the replica cannot
    /// join: unreachable or not answering, not a replica (another service's port), another
    /// volume's, of another size, a member already (issue 18: `replica add` of an address
    /// where nothing listens answered OK before, and failed only in the status).
    pub async fn start_rebuild(self: &Arc<Self>, addr: &str) -> Result<(), Arc<VolumeError>> {
        let now = self.rebuild_status();
        if now.state.is_running() {
            return Err(Arc::new(VolumeError::RebuildRunning {
                volume: self.name().to_string(),
                replica: now.replica,
            }));
        }
        if let Some(r) = self
            .replicas()
            .into_iter()
            .find(|r| r.addr == addr && r.mode() != Mode::ERR)
        {
            return Err(Arc::new(self.already_member(&r)));
        }
        // Asked before anything changes: a failed replica that still does not answer stays
        // listed as ERR, and the tracker keeps the last rebuild's outcome.
        self.probe_target(addr).await.map_err(Arc::new)?;
        // Running from here on, so a client polling the status right after this call sees
        // this rebuild and not the one before.
        self.set_status(|s| {
            *s = RebuildStatus {
                replica: addr.to_string(),
                state: RebuildState::Running,
                ..RebuildStatus::default()
            }
        });
        let v = self.clone();
        let owned = addr.to_string();
        tokio::spawn(async move { v.rebuild(&owned).await });
        Ok(())
    }

    /// Brings the replica at `addr` in sync (waiting for a rebuild already running), keeping
    /// [`Volume::rebuild_status`] up to date. The error is the one the status shows.
    pub async fn rebuild(self: &Arc<Self>, addr: &str) -> Result<(), Arc<VolumeError>> {
        let _ops = self.ops.lock().await;
        self.set_status(|s| {
            *s = RebuildStatus {
                replica: addr.to_string(),
                state: RebuildState::Running,
                ..Default::default()
            }
        });
        let res = self.rebuild_locked(addr).await.map_err(Arc::new);
        self.set_status(|s| {
            s.state = match &res {
                Ok(()) => RebuildState::Done,
                Err(e) => RebuildState::Failed(e.clone()),
            }
        });
        match &res {
            Ok(()) => tracing::info!(volume = %self.name(), replica = %addr, "rebuild done"),
            Err(e) => tracing::warn!(volume = %self.name(), replica = %addr, "rebuild failed: {e}"),
        }
        res
    }

    /// Connects to the replica at `addr` and asks its Info (within the I/O timeout): it must
    /// answer, be this volume's (or no volume's) and of this volume's size.
    async fn probe_target(
        &self,
        addr: &str,
    ) -> Result<(tonic::transport::Channel, pb::InfoResponse), VolumeError> {
        let timeout = self.io_timeout();
        let volume = self.name().to_string();
        let channel = connect_channel(addr, timeout)
            .await
            .map_err(|source| VolumeError::Path {
                volume: volume.clone(),
                replica: addr.to_string(),
                source: Box::new(source),
            })?;
        let mut ctl = control_client(channel.clone());
        let rpc = |message: String| VolumeError::Rpc {
            volume: volume.clone(),
            replica: addr.to_string(),
            call: "Info",
            message,
        };
        let info = tokio::time::timeout(timeout, ctl.info(pb::InfoRequest {}))
            .await
            .map_err(|_| rpc(format!("no answer within {timeout:?}")))?
            .map_err(|s| rpc(s.message().to_string()))?
            .into_inner();
        if !info.volume_uuid.is_empty() && info.volume_uuid != self.uuid() {
            return Err(VolumeError::Foreign {
                volume,
                uuid: self.uuid().to_string(),
                replica: addr.to_string(),
                replica_id: info.replica_id,
                theirs: info.volume_uuid,
            });
        }
        if info.size != self.size() {
            return Err(VolumeError::SizeMismatch {
                volume,
                replica: addr.to_string(),
                size: info.size,
                volume_size: self.size(),
            });
        }
        Ok((channel, info))
    }

    /// The whole rebuild of one replica; see the module comment. The caller holds `ops`.
    async fn rebuild_locked(self: &Arc<Self>, addr: &str) -> Result<(), VolumeError> {
        if let Some(r) = self.replicas().into_iter().find(|r| r.addr == addr) {
            if r.mode() != Mode::ERR {
                return Err(self.already_member(&r));
            }
            self.replicas
                .write()
                .expect("invariant: replicas lock")
                .retain(|x| x.addr != addr);
        }
        let timeout = self.io_timeout();
        let volume = self.name().to_string();
        let (channel, info) = self.probe_target(addr).await?;
        let source = self.pick_reader().ok_or_else(|| self.faulted())?;
        let src_info = source
            .control()
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| rpc_error(&volume, &source, "Info", &s))?
            .into_inner();
        let was_member = info.epoch > 0 && info.epoch_members.contains(&info.replica_id);
        let catch_up = was_member && chain_names(&info) == chain_names(&src_info);
        if was_member && !catch_up {
            return Err(VolumeError::OlderLineage {
                volume,
                replica: addr.to_string(),
                epoch: info.epoch,
                theirs: chain_names(&info),
                ours: chain_names(&src_info),
            });
        }
        // Join as WO with no write in flight, so every write after this reaches it.
        let local = is_local(addr, &self.config.local_hosts);
        // Not adopt: a replica that records no volume is taken only if fresh (the replica's
        // `identity.rs`), so a former member of an unknown volume is never written.
        let claim = zebu_proto::frames::VolumeClaim {
            uuid: self.uuid().to_string(),
            adopt: false,
        };
        let data = open_data_path(
            self.config.data_transport,
            addr,
            channel.clone(),
            self.generation(),
            &claim,
            timeout,
            local,
        )
        .await
        .map_err(|source| VolumeError::Path {
            volume: volume.clone(),
            replica: addr.to_string(),
            source: Box::new(source),
        })?;
        let target = Arc::new(Replica {
            addr: addr.to_string(),
            id: zebu_proto::ids::ReplicaId::from(info.replica_id.as_str()),
            mode: std::sync::Mutex::new((
                Mode::WO,
                if catch_up {
                    "catching up"
                } else {
                    "rebuilding"
                }
                .into(),
            )),
            data,
            control: control_client(channel),
            inflight: AtomicUsize::new(0),
            local,
            zero_fill_unmaps: std::sync::atomic::AtomicBool::new(!catch_up),
        });
        {
            let _g = self.gate.write().await;
            self.add_replica(target.clone());
        }
        self.set_status(|s| {
            s.kind = Some(if catch_up {
                RebuildKind::CatchUp
            } else {
                RebuildKind::Full
            })
        });
        let res = if catch_up {
            self.catch_up(&target, FlushNumber(info.flush_number)).await
        } else {
            self.full_rebuild(&target).await
        };
        if let Err(e) = res {
            self.fail(&target, &format!("rebuild: {e}"));
            return Err(e);
        }
        self.flush_all().await?;
        if target.mode() != Mode::WO {
            return Err(VolumeError::FailedDuringRebuild {
                volume,
                replica: addr.to_string(),
                reason: target.reason(),
            });
        }
        {
            let _g = self.gate.write().await;
            target.transition(self.name(), Mode::RW, "rebuild complete");
            target.zero_fill_unmaps.store(false, Ordering::Release);
            self.membership_dirty.store(true, Ordering::Release);
        }
        Ok(self.commit_membership().await?)
    }

    fn already_member(&self, r: &Replica) -> VolumeError {
        VolumeError::AlreadyMember {
            volume: self.name().to_string(),
            replica: r.addr.clone(),
            mode: r.mode(),
        }
    }

    async fn catch_up(&self, target: &Arc<Replica>, since: FlushNumber) -> Result<(), VolumeError> {
        let mut from: Vec<&Replica> = Vec::new();
        let rw = self.with_mode(&[Mode::RW]);
        from.extend(rw.iter().map(|r| r.as_ref()));
        from.push(target);
        let ranges = written_ranges(self.name(), &from, since, self.size()).await?;
        self.set_status(|s| s.bytes_total = ranges.iter().map(|r| r.end - r.start).sum());
        for range in ranges {
            // Piece by piece, so writes to the range wait for one piece at most.
            let mut at = range.start;
            while at < range.end {
                let len = (16 << 20).min(range.end - at);
                let _lock = self.ranges.lock(at..at + len).await;
                let source = self.pick_reader().ok_or_else(|| self.faulted())?;
                let copied = self.copy_differing(&source, target, at, len).await?;
                self.set_status(|s| {
                    s.bytes_copied += copied;
                    s.bytes_done += len;
                });
                at += len;
            }
        }
        Ok(())
    }

    async fn full_rebuild(&self, target: &Arc<Replica>) -> Result<(), VolumeError> {
        let name = format!("rebuild-{:08x}", rand::random::<u32>());
        self.snapshot_quiesced(&name, false, Default::default())
            .await?;
        if target.mode() != Mode::WO {
            return Err(VolumeError::RebuildSnapshot {
                volume: self.name().to_string(),
                replica: target.addr.clone(),
                reason: target.reason(),
            });
        }
        loop {
            let source = self.pick_reader().ok_or_else(|| self.faulted())?;
            match self.copy_layers(&source, target).await {
                Ok(()) => return Ok(()),
                Err(CopyError::Source(e)) => {
                    // Another RW replica takes over; finished layers are not copied again.
                    self.fail(&source, &format!("rebuild source: {e}"));
                }
                Err(CopyError::Target(failure)) => {
                    return Err(VolumeError::LayerCopy {
                        volume: self.name().to_string(),
                        replica: target.addr.clone(),
                        message: failure.to_string(),
                    });
                }
            }
        }
    }

    async fn copy_layers(
        &self,
        source: &Arc<Replica>,
        target: &Arc<Replica>,
    ) -> Result<(), CopyError> {
        let src = source
            .control()
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| CopyError::Source(CopyFailure::info(&s)))?
            .into_inner();
        let dst = target
            .control()
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| CopyError::Target(CopyFailure::info(&s)))?
            .into_inner();
        let chain = chain_names(&src);
        let layer =
            |info: &pb::InfoResponse, n: &str| info.layers.iter().find(|l| l.name == n).cloned();
        let total: u64 = chain
            .iter()
            .filter_map(|n| layer(&src, n))
            .map(|l| l.data_bytes)
            .sum();
        self.set_status(|s| {
            s.bytes_total = total;
            s.bytes_done = 0;
        });
        let mut parent = String::new();
        for name in &chain {
            let l = layer(&src, name).ok_or_else(|| {
                CopyError::Source(CopyFailure::Vanished {
                    layer: name.clone(),
                })
            })?;
            let done = layer(&dst, name).is_some_and(|d| d.rebuilt && !d.incomplete);
            if !done {
                self.copy_layer(source, target, &l, &parent).await?;
            }
            self.set_status(|s| s.bytes_done += l.data_bytes);
            parent = name.clone();
        }
        Ok(())
    }

    /// Streams one layer's data extents from `source` into `target`.
    async fn copy_layer(
        &self,
        source: &Arc<Replica>,
        target: &Arc<Replica>,
        l: &pb::LayerInfo,
        parent: &str,
    ) -> Result<(), CopyError> {
        let mut src = source.control();
        let mut reader = tokio::time::timeout(
            LONG_TIMEOUT,
            src.read_layer(pb::ReadLayerRequest {
                layer: l.name.clone(),
                extents: vec![],
            }),
        )
        .await
        .map_err(|_| {
            CopyError::Source(CopyFailure::Stalled {
                call: "ReadLayer",
                layer: l.name.clone(),
                after: LONG_TIMEOUT,
            })
        })?
        .map_err(|s| CopyError::Source(CopyFailure::rpc("ReadLayer", &l.name, &s)))?
        .into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::WriteLayerRequest>(4);
        let first = pb::WriteLayerRequest {
            layer: l.name.clone(),
            parent: parent.to_string(),
            user_created: l.user_created,
            created: l.created.clone(),
            labels: l.labels.clone(),
            size: l.size,
            chunk: None,
        };
        tx.send(first).await.map_err(|_| {
            CopyError::Target(CopyFailure::StreamClosed {
                layer: l.name.clone(),
            })
        })?;
        let mut dst = target.control();
        let writer = tokio::spawn(async move {
            dst.write_layer(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        });
        let mut source_err = None;
        // A source that stops sending (hung, partitioned) must not stall the rebuild forever.
        let stall = self.io_timeout() * 4;
        loop {
            let chunk = match tokio::time::timeout(stall, reader.next()).await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(_) => {
                    source_err = Some(CopyFailure::Stalled {
                        call: "ReadLayer",
                        layer: l.name.clone(),
                        after: stall,
                    });
                    break;
                }
            };
            match chunk {
                Ok(c) => {
                    let n = c.data.len() as u64;
                    let msg = pb::WriteLayerRequest {
                        chunk: Some(c),
                        ..Default::default()
                    };
                    if tx.send(msg).await.is_err() {
                        break; // the writer failed; its error is reported below
                    }
                    self.set_status(|s| s.bytes_copied += n);
                }
                Err(s) => {
                    source_err = Some(CopyFailure::rpc("ReadLayer", &l.name, &s));
                    break;
                }
            }
        }
        if let Some(e) = source_err {
            drop(tx);
            writer.abort();
            return Err(CopyError::Source(e));
        }
        drop(tx);
        writer
            .await
            .map_err(|source| {
                CopyError::Target(CopyFailure::Task {
                    layer: l.name.clone(),
                    source,
                })
            })?
            .map_err(|s| CopyError::Target(CopyFailure::rpc("WriteLayer", &l.name, &s)))?;
        Ok(())
    }
}

/// Which side of a layer copy failed: a source failure moves the copy to another source, a
/// target failure ends the rebuild.
enum CopyError {
    Source(CopyFailure),
    Target(CopyFailure),
}

/// Why one side of a layer copy failed; text from a replica is kept as it wrote it.
#[derive(Debug, thiserror::Error)]
enum CopyFailure {
    #[error("Info: {message}")]
    Info { message: String },
    #[error("{call} {layer}: {message}")]
    Rpc {
        call: &'static str,
        layer: String,
        message: String,
    },
    #[error("{call} {layer}: no data for {after:?}")]
    Stalled {
        call: &'static str,
        layer: String,
        after: Duration,
    },
    #[error("layer {layer} vanished from the source")]
    Vanished { layer: String },
    #[error("WriteLayer {layer}: the stream closed")]
    StreamClosed { layer: String },
    #[error("WriteLayer {layer}: the writing task failed: {source}")]
    Task {
        layer: String,
        #[source]
        source: tokio::task::JoinError,
    },
}

impl CopyFailure {
    fn info(s: &tonic::Status) -> CopyFailure {
        CopyFailure::Info {
            message: s.message().to_string(),
        }
    }

    fn rpc(call: &'static str, layer: &str, s: &tonic::Status) -> CopyFailure {
        CopyFailure::Rpc {
            call,
            layer: layer.to_string(),
            message: s.message().to_string(),
        }
    }
}
