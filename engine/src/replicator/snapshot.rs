//! Snapshot operations across the replicas, and expand.
//!
//! A snapshot is taken with I/O quiesced (the write gate held exclusively), under the same
//! name on every RW and WO replica, so all replicas freeze the same data. A replica that
//! fails it goes ERR. Delete, revert and purge are refused while a rebuild runs (they would
//! change the layers the rebuild is copying). Revert is meant for a volume whose frontend is
//! stopped: it quiesces I/O, but clients that cached data would not know it changed.

use std::collections::HashMap;
use std::time::Duration;

use zebu_proto::replica as pb;

use super::{Mode, Volume, VolumeError, rpc_error};
use crate::blockdev::BlockDevice;

/// Merges and reverts may move a lot of data.
const SNAPSHOT_OP_TIMEOUT: Duration = Duration::from_secs(3600);

impl Volume {
    /// Takes a user snapshot.
    pub async fn snapshot_create(
        &self,
        name: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), VolumeError> {
        let _ops = self.ops.lock().await;
        self.snapshot_quiesced(name, true, labels).await
    }

    /// Takes a snapshot on every RW and WO replica with I/O quiesced. The caller holds `ops`.
    pub(super) async fn snapshot_quiesced(
        &self,
        name: &str,
        user_created: bool,
        labels: HashMap<String, String>,
    ) -> Result<(), VolumeError> {
        let _g = self.gate.write().await;
        let targets = self.with_mode(&[Mode::RW, Mode::WO]);
        let results =
            futures::future::join_all(
                targets.iter().map(|r| {
                    let mut c = r.control();
                    let req = pb::SnapshotCreateRequest {
                        name: name.to_string(),
                        user_created,
                        labels: labels.clone(),
                    };
                    async move {
                        tokio::time::timeout(SNAPSHOT_OP_TIMEOUT, c.snapshot_create(req)).await
                    }
                }),
            )
            .await;
        let mut first_refusal = None;
        for (r, res) in targets.iter().zip(results) {
            match res {
                Ok(Ok(_)) => {}
                Ok(Err(s))
                    if matches!(
                        s.code(),
                        tonic::Code::InvalidArgument | tonic::Code::AlreadyExists
                    ) =>
                {
                    // The request was wrong, not the replica (bad or duplicate name).
                    first_refusal.get_or_insert_with(|| self.refusal(r, &s));
                }
                Ok(Err(s)) => self.fail(r, &format!("snapshot {name}: {}", s.message())),
                Err(_) => self.fail(r, &format!("snapshot {name}: timeout")),
            }
        }
        self.commit_membership().await?;
        if let Some(why) = first_refusal {
            return Err(why);
        }
        tracing::info!(volume = %self.name(), snapshot = name, user_created, "snapshot taken");
        Ok(())
    }

    /// The layers of an RW replica (all RW replicas have the same chain).
    pub async fn snapshot_list(&self) -> Result<Vec<pb::LayerInfo>, VolumeError> {
        let r = self.pick_reader().ok_or_else(|| self.faulted())?;
        let info = r
            .control()
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| rpc_error(self.name(), &r, "Info", &s))?;
        Ok(info.into_inner().layers)
    }

    pub async fn snapshot_delete(&self, name: &str) -> Result<(), VolumeError> {
        let name = name.to_string();
        self.on_rw("delete snapshot", false, move |mut c| {
            let name = name.clone();
            async move {
                c.snapshot_delete(pb::SnapshotDeleteRequest { name })
                    .await
                    .map(|_| ())
            }
        })
        .await
    }

    pub async fn snapshot_revert(&self, name: &str) -> Result<(), VolumeError> {
        let name = name.to_string();
        self.on_rw("revert", true, move |mut c| {
            let name = name.clone();
            async move {
                c.snapshot_revert(pb::SnapshotRevertRequest { name })
                    .await
                    .map(|_| ())
            }
        })
        .await
    }

    pub async fn snapshot_purge(&self) -> Result<(), VolumeError> {
        self.on_rw("purge", false, |mut c| async move {
            c.snapshot_purge(pb::SnapshotPurgeRequest {})
                .await
                .map(|_| ())
        })
        .await
    }

    /// Grows the volume on every RW and WO replica, then for the frontends.
    pub async fn expand(&self, size: u64) -> Result<(), VolumeError> {
        let _ops = self.ops.lock().await;
        let _g = self.gate.write().await;
        if size < self.size() {
            return Err(VolumeError::Shrink {
                volume: self.name().to_string(),
                size: self.size(),
                wanted: size,
            });
        }
        let targets = self.with_mode(&[Mode::RW, Mode::WO]);
        // Every replica is asked first, so a size one of them cannot hold is refused before
        // any of them changed (and refused is not failed: the replica is fine).
        for r in &targets {
            let check = pb::ExpandRequest {
                size,
                check_only: true,
            };
            if let Err(s) = r.control().expand(check).await {
                if matches!(
                    s.code(),
                    tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted
                ) {
                    return Err(VolumeError::ExpandRefused {
                        volume: self.name().to_string(),
                        replica: r.addr.clone(),
                        wanted: size,
                        message: s.message().to_string(),
                    });
                }
                self.fail(r, &format!("expand check: {}", s.message()));
            }
        }
        for r in self.with_mode(&[Mode::RW, Mode::WO]) {
            let req = pb::ExpandRequest {
                size,
                check_only: false,
            };
            if let Err(s) = r.control().expand(req).await {
                if s.code() == tonic::Code::InvalidArgument {
                    return Err(self.refusal(&r, &s));
                }
                self.fail(&r, &format!("expand: {}", s.message()));
            }
        }
        self.commit_membership().await?;
        self.size.store(size, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Runs a control operation on every RW replica; refused during a rebuild.
    async fn on_rw<F, Fut>(
        &self,
        what: &'static str,
        quiesce: bool,
        op: F,
    ) -> Result<(), VolumeError>
    where
        F: Fn(super::ControlClient) -> Fut,
        Fut: std::future::Future<Output = Result<(), tonic::Status>>,
    {
        let _ops = self.ops.lock().await;
        if !self.with_mode(&[Mode::WO]).is_empty() {
            return Err(VolumeError::Rebuilding {
                volume: self.name().to_string(),
                op: what,
            });
        }
        let _g = if quiesce {
            Some(self.gate.write().await)
        } else {
            None
        };
        let rw = self.with_mode(&[Mode::RW]);
        let results = futures::future::join_all(
            rw.iter()
                .map(|r| tokio::time::timeout(SNAPSHOT_OP_TIMEOUT, op(r.control()))),
        )
        .await;
        let mut refusal = None;
        for (r, res) in rw.iter().zip(results) {
            match res {
                Ok(Ok(())) => {}
                Ok(Err(s))
                    if matches!(
                        s.code(),
                        tonic::Code::NotFound | tonic::Code::InvalidArgument
                    ) =>
                {
                    refusal.get_or_insert_with(|| self.refusal(r, &s));
                }
                Ok(Err(s)) => self.fail(r, &format!("{what}: {}", s.message())),
                Err(_) => self.fail(r, &format!("{what}: timeout")),
            }
        }
        self.commit_membership().await?;
        refusal.map_or(Ok(()), Err)
    }

    /// A replica's refusal of a request (the request was wrong; the replica is fine).
    fn refusal(&self, r: &super::Replica, s: &tonic::Status) -> VolumeError {
        VolumeError::Refused {
            volume: self.name().to_string(),
            replica: r.addr.clone(),
            message: s.message().to_string(),
        }
    }
}
