//! The CSI Node service: stage (attach, mkfs when blank, mount), publish (bind mount),
//! unpublish, unstage (unmount, detach), expand, stats, info.
//!
//! Every call on one volume holds that volume's lock, so a retried call never runs beside
//! the first. What a volume's staging did is kept in `<state-dir>/volumes/<volume>.json`
//! (written atomically before the call answers), so unstage gives back exactly the device
//! it got, even after the plugin restarted. Each call is idempotent: staging a staged
//! volume, unstaging an unstaged one, publishing a published target or unpublishing a
//! missing one all succeed.

pub mod attach;
pub mod mounts;
mod state;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::Mutex;
use tonic::{Request, Response, Status};
use zebu_proto::csi;
use zebu_proto::csi::node_service_capability::rpc::Type as NodeCap;
use zebu_proto::csi::volume_capability::AccessType;

use crate::caps;
use crate::params::{CTX_FS_TYPE, CTX_MKFS_PARAMS, DEFAULT_FS, FILESYSTEMS};
use attach::{AttachError, AttachMode, Attachment};
use state::Staged;

/// The topology key of a node (what GetCapacity and the provisioner see).
pub const TOPOLOGY_NODE_KEY: &str = "topology.zebu.io/node";
/// The topology key of a zone (Kubernetes' well-known one).
pub const TOPOLOGY_ZONE_KEY: &str = "topology.kubernetes.io/zone";

/// How the node service is set up.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    pub zone: Option<String>,
    pub attach: AttachMode,
    /// Where the plugin keeps its state and nbdfuse mounts.
    pub state_dir: PathBuf,
    pub max_volumes: i64,
}

pub struct NodeService {
    cfg: NodeConfig,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl NodeService {
    pub fn new(cfg: NodeConfig) -> std::io::Result<Self> {
        std::fs::create_dir_all(cfg.state_dir.join("volumes"))?;
        std::fs::create_dir_all(cfg.state_dir.join("fuse"))?;
        Ok(NodeService {
            cfg,
            locks: Mutex::new(HashMap::new()),
        })
    }

    async fn lock(&self, volume: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self
            .locks
            .lock()
            .await
            .entry(volume.to_string())
            .or_default()
            .clone();
        m.lock_owned().await
    }

    fn state_path(&self, volume: &str) -> PathBuf {
        self.cfg
            .state_dir
            .join("volumes")
            .join(format!("{volume}.json"))
    }
}

fn attach_status(e: AttachError) -> Status {
    match e {
        AttachError::Context { .. } | AttachError::Multipath { .. } => {
            Status::failed_precondition(e.to_string())
        }
        AttachError::Tool { .. } | AttachError::Device { .. } => Status::internal(e.to_string()),
    }
}

fn io_status(what: &str, path: &Path, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

fn required<'a>(v: &'a str, what: &str) -> Result<&'a str, Status> {
    if v.is_empty() {
        Err(Status::invalid_argument(format!("{what} is required")))
    } else {
        Ok(v)
    }
}

/// A staging or target path must be absolute: it is handed to `mount`.
fn absolute(p: &str, what: &str) -> Result<PathBuf, Status> {
    let path = PathBuf::from(p);
    if !path.is_absolute() {
        return Err(Status::invalid_argument(format!(
            "{what} {p:?} is not an absolute path"
        )));
    }
    Ok(path)
}

/// A staging path must be a directory (the CO creates it; it is created here if missing).
fn staging_dir(p: &str) -> Result<PathBuf, Status> {
    let path = absolute(p, "staging_target_path")?;
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err(Status::invalid_argument(format!(
            "staging_target_path {p:?} is not a directory"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(&path).map_err(|e| io_status("creating", &path, e))?;
            Ok(path)
        }
        Err(e) => Err(io_status("reading", &path, e)),
    }
}

#[tonic::async_trait]
impl csi::node_server::Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        required(&req.staging_target_path, "staging_target_path")?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        caps::check(cap).map_err(Status::invalid_argument)?;
        let staging = staging_dir(&req.staging_target_path)?;
        let _guard = self.lock(&volume).await;
        let block = matches!(cap.access_type, Some(AccessType::Block(_)));
        let fs = match &cap.access_type {
            Some(AccessType::Mount(m)) if !m.fs_type.is_empty() => m.fs_type.clone(),
            _ => req
                .volume_context
                .get(CTX_FS_TYPE)
                .cloned()
                .unwrap_or_else(|| DEFAULT_FS.to_string()),
        };
        if !block && !FILESYSTEMS.contains(&fs.as_str()) {
            return Err(Status::invalid_argument(format!(
                "filesystem {fs:?} is not one of {}",
                FILESYSTEMS.join(", ")
            )));
        }
        let state_path = self.state_path(&volume);
        if let Some(s) =
            Staged::load(&state_path).map_err(|e| io_status("reading", &state_path, e))?
        {
            if s.staging_path != staging {
                return Err(Status::failed_precondition(format!(
                    "volume {volume} is staged at {} already, not at {}",
                    s.staging_path.display(),
                    staging.display()
                )));
            }
            if s.block != block {
                return Err(Status::failed_precondition(format!(
                    "volume {volume} is staged as a {} volume already",
                    if s.block { "block" } else { "mount" }
                )));
            }
        }
        let attachment = attach::attach(
            &volume,
            self.cfg.attach,
            &req.publish_context,
            &self.cfg.state_dir,
        )
        .await
        .map_err(attach_status)?;
        let staged = Staged {
            volume: volume.clone(),
            staging_path: staging.clone(),
            block,
            fs_type: (!block).then(|| fs.clone()),
            attachment: attachment.clone(),
        };
        // Recorded before anything is mounted: an unstage after a crash here still finds the
        // device to give back.
        staged
            .save(&state_path)
            .map_err(|e| io_status("writing", &state_path, e))?;
        let device = attachment.device().to_string();
        if block {
            tracing::info!(volume, device, "staged as a block device");
            return Ok(Response::new(csi::NodeStageVolumeResponse {}));
        }
        if let Some(m) = mounts::mounted_at(&staging)
            .map_err(|e| io_status("reading mounts for", &staging, e))?
        {
            tracing::info!(volume, device, staging = %staging.display(), source = %m.source, "already staged");
            return Ok(Response::new(csi::NodeStageVolumeResponse {}));
        }
        let found = mounts::probe_fs(&device)
            .await
            .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
        match found {
            None => {
                let params = req
                    .volume_context
                    .get(CTX_MKFS_PARAMS)
                    .cloned()
                    .unwrap_or_default();
                let t0 = std::time::Instant::now();
                mounts::mkfs(&fs, &device, &params)
                    .await
                    .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
                tracing::info!(
                    volume,
                    device,
                    fs,
                    ms = t0.elapsed().as_millis() as u64,
                    "made a filesystem on a blank volume"
                );
            }
            Some(have) if have == fs => {}
            Some(have) => {
                return Err(Status::failed_precondition(format!(
                    "volume {volume}: {device} holds {have}, not {fs}; it is never reformatted"
                )));
            }
        }
        let flags: Vec<String> = match &cap.access_type {
            Some(AccessType::Mount(m)) => m.mount_flags.clone(),
            _ => vec![],
        };
        mounts::mount(&device, &staging, Some(&fs), &flags)
            .await
            .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
        tracing::info!(volume, device, fs, staging = %staging.display(), "staged");
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        let staging = absolute(
            required(&req.staging_target_path, "staging_target_path")?,
            "staging_target_path",
        )?;
        let _guard = self.lock(&volume).await;
        let state_path = self.state_path(&volume);
        let staged = Staged::load(&state_path).map_err(|e| io_status("reading", &state_path, e))?;
        mounts::unmount_all(&staging)
            .await
            .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
        if let Some(s) = staged {
            attach::detach(&volume, &s.attachment)
                .await
                .map_err(attach_status)?;
            std::fs::remove_file(&state_path).map_err(|e| io_status("removing", &state_path, e))?;
            tracing::info!(volume, device = s.attachment.device(), "unstaged");
        }
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        required(&req.target_path, "target_path")?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        caps::check(cap).map_err(Status::invalid_argument)?;
        let staging = absolute(
            required(&req.staging_target_path, "staging_target_path")?,
            "staging_target_path",
        )?;
        let target = absolute(&req.target_path, "target_path")?;
        let _guard = self.lock(&volume).await;
        let state_path = self.state_path(&volume);
        let staged = Staged::load(&state_path)
            .map_err(|e| io_status("reading", &state_path, e))?
            .ok_or_else(|| {
                Status::failed_precondition(format!("volume {volume} is not staged on this node"))
            })?;
        if staged.staging_path != staging {
            return Err(Status::failed_precondition(format!(
                "volume {volume} is staged at {}, not at {}",
                staged.staging_path.display(),
                staging.display()
            )));
        }
        if mounts::mounted_at(&target)
            .map_err(|e| io_status("reading mounts for", &target, e))?
            .is_some()
        {
            return Ok(Response::new(csi::NodePublishVolumeResponse {}));
        }
        let read_only = req.readonly
            || cap
                .access_mode
                .as_ref()
                .is_some_and(|m| caps::read_only(m.mode));
        let source: PathBuf = if staged.block {
            // The target of a block volume is a file the device is bound onto.
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io_status("creating", parent, e))?;
            }
            if !target.exists() {
                std::fs::File::create(&target).map_err(|e| io_status("creating", &target, e))?;
            }
            PathBuf::from(staged.attachment.device())
        } else {
            std::fs::create_dir_all(&target).map_err(|e| io_status("creating", &target, e))?;
            staging.clone()
        };
        mounts::bind(&source, &target, read_only)
            .await
            .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
        tracing::info!(volume, target = %target.display(), read_only, "published");
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        let target = absolute(required(&req.target_path, "target_path")?, "target_path")?;
        let _guard = self.lock(&volume).await;
        mounts::unmount_all(&target)
            .await
            .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
        // The spec: the plugin removes the file or directory it made at the target path.
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.is_dir() => {
                std::fs::remove_dir(&target).map_err(|e| io_status("removing", &target, e))?
            }
            Ok(_) => {
                std::fs::remove_file(&target).map_err(|e| io_status("removing", &target, e))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_status("reading", &target, e)),
        }
        tracing::info!(volume, target = %target.display(), "unpublished");
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        let state_path = self.state_path(&volume);
        let staged = Staged::load(&state_path)
            .map_err(|e| io_status("reading", &state_path, e))?
            .ok_or_else(|| {
                Status::not_found(format!("volume {volume} is not staged on this node"))
            })?;
        let meta = std::fs::metadata(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Status::not_found(format!(
                "volume {volume}: {} does not exist",
                path.display()
            )),
            _ => io_status("reading", &path, e),
        })?;
        let device = staged.attachment.device().to_string();
        let device_ok = std::fs::metadata(&device).is_ok();
        let mounted =
            mounts::mounted_at(&path).map_err(|e| io_status("reading mounts for", &path, e))?;
        let condition = if !device_ok {
            csi::VolumeCondition {
                abnormal: true,
                message: format!("device {device} of volume {volume} is gone"),
            }
        } else if mounted.is_none() && staged.staging_path != path {
            csi::VolumeCondition {
                abnormal: true,
                message: format!("volume {volume} is not mounted at {}", path.display()),
            }
        } else {
            csi::VolumeCondition {
                abnormal: false,
                message: format!("device {device} attached"),
            }
        };
        let usage = if staged.block || !meta.is_dir() {
            let bytes = mounts::block_size_bytes(Path::new(&device))
                .map_err(|e| io_status("sizing", Path::new(&device), e))?;
            vec![csi::VolumeUsage {
                available: 0,
                total: bytes as i64,
                used: 0,
                unit: csi::volume_usage::Unit::Bytes as i32,
            }]
        } else {
            let s = mounts::fs_stats(&path).map_err(|e| io_status("statvfs of", &path, e))?;
            vec![
                csi::VolumeUsage {
                    available: s.available as i64,
                    total: s.total as i64,
                    used: s.used as i64,
                    unit: csi::volume_usage::Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: s.inodes_free as i64,
                    total: s.inodes as i64,
                    used: s.inodes_used as i64,
                    unit: csi::volume_usage::Unit::Inodes as i32,
                },
            ]
        };
        Ok(Response::new(csi::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(condition),
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = required(&req.volume_id, "volume_id")?.to_string();
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        let state_path = self.state_path(&volume);
        let staged = Staged::load(&state_path)
            .map_err(|e| io_status("reading", &state_path, e))?
            .ok_or_else(|| {
                Status::not_found(format!("volume {volume} is not staged on this node"))
            })?;
        if !path.exists() {
            return Err(Status::not_found(format!(
                "volume {volume}: {} does not exist",
                path.display()
            )));
        }
        let _guard = self.lock(&volume).await;
        let device = staged.attachment.device().to_string();
        match &staged.attachment {
            Attachment::Iscsi { .. } => {
                // The initiator reads the new capacity on a rescan.
                let name = device.trim_start_matches("/dev/");
                let rescan = format!("/sys/block/{name}/device/rescan");
                std::fs::write(&rescan, "1")
                    .map_err(|e| io_status("writing", Path::new(&rescan), e))?;
            }
            Attachment::Nbd { .. } => {
                let _ = crate::exec::run("losetup", &["-c", &device]).await;
            }
        }
        let bytes = mounts::block_size_bytes(Path::new(&device))
            .map_err(|e| io_status("sizing", Path::new(&device), e))?;
        let wanted = req
            .capacity_range
            .as_ref()
            .map_or(0, |c| c.required_bytes.max(0).cast_unsigned());
        if bytes < wanted {
            return Err(Status::failed_precondition(match &staged.attachment {
                Attachment::Nbd { .. } => format!(
                    "volume {volume}: {device} has {bytes} bytes, {wanted} asked; an nbdfuse attachment keeps the size it connected with: unstage and stage the volume again to see the new size"
                ),
                Attachment::Iscsi { .. } => format!(
                    "volume {volume}: {device} has {bytes} bytes after a rescan, {wanted} asked; was the volume expanded (ControllerExpandVolume)?"
                ),
            }));
        }
        if let Some(fs) = &staged.fs_type {
            mounts::grow_fs(fs, &device, &staged.staging_path)
                .await
                .map_err(|e| Status::internal(format!("volume {volume}: {e}")))?;
            tracing::info!(volume, device, bytes, fs, "filesystem grown");
        }
        Ok(Response::new(csi::NodeExpandVolumeResponse {
            capacity_bytes: bytes as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            NodeCap::StageUnstageVolume,
            NodeCap::GetVolumeStats,
            NodeCap::ExpandVolume,
            NodeCap::VolumeCondition,
            NodeCap::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| csi::NodeServiceCapability {
            r#type: Some(csi::node_service_capability::Type::Rpc(
                csi::node_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        let mut segments =
            HashMap::from([(TOPOLOGY_NODE_KEY.to_string(), self.cfg.node_id.clone())]);
        if let Some(z) = &self.cfg.zone {
            segments.insert(TOPOLOGY_ZONE_KEY.to_string(), z.clone());
        }
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.cfg.node_id.clone(),
            max_volumes_per_node: self.cfg.max_volumes,
            accessible_topology: Some(csi::Topology { segments }),
        }))
    }
}
