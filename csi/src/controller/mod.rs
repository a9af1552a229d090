//! The CSI Controller service, over the manager's REST API (the typed client of
//! `zebu-manager`), so it works against `zebu up` on one host and a cluster's manager
//! alike, with the same rules as the `zebu` CLI: every decision is the ops layer's.
//!
//! **Quick answers.** A call never blocks for minutes: it asks the manager for the change,
//! then waits for the result at most the call budget (`--call-budget`, default 10 s, below
//! the sidecars' own timeouts). When the work is not done by then (an engine still
//! starting, a clone still copying) it answers `Aborted` with what it waits for, and the
//! sidecar calls again; the repeated call finds the work under way (every call is
//! idempotent) and waits again. Longhorn's plugin instead polls for up to 90 s inside one
//! call.
//!
//! **Publish** attaches the volume's engine on the node with the frontend this controller
//! was started for (`--attach iscsi` → the iSCSI target, `--attach nbdfuse` → NBD), and
//! answers the portal and IQN (or the NBD URI) in the publish context, with `frontend`
//! saying which. A volume published to another node is `FailedPrecondition`; unpublishing
//! it (also from a node that is down: the new engine's generation fences the old one) lets
//! the next publish go ahead.

mod convert;

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Request, Response, Status};
use zebu_manager::client::{Client, ClientError};
use zebu_proto::csi;
use zebu_proto::csi::controller_service_capability::rpc::Type as Cap;
use zebu_proto::csi::volume_content_source::Type as Source;
use zebu_types::names::FROM_BACKUP_ANNOTATION;
use zebu_types::requests::backup::{CreateBackup, RestoreBackup};
use zebu_types::requests::{AttachVolume, CreateSnapshot, CreateVolume, DataSource, ExpandVolume};
use zebu_types::resources::{Backup, BackupState, Frontend, RestoreState, Volume, VolumeState};
use zebu_types::size::ByteSize;

use crate::caps;
use crate::names::{self, CSI_NAME_ANNOTATION, SnapshotRef};
use crate::node::attach::AttachMode;
use crate::node::{TOPOLOGY_NODE_KEY, TOPOLOGY_ZONE_KEY};
use crate::params::{Params, SnapshotParams, SnapshotType};
pub use convert::{DEFAULT_SIZE, FS_TYPE_ANNOTATION, MKFS_PARAMS_ANNOTATION, api_status};
use convert::{
    csi_backup_snapshot, csi_snapshot, csi_volume, fits, page, publish_context, published_node,
    size_for,
};
use zebu_ops::{DATA_SOURCE_ANNOTATION, Population, SNAPSHOT_NAME_ANNOTATION};

const POLL: Duration = Duration::from_millis(50);

/// On a Backup taken for a CSI snapshot (VolumeSnapshotClass `type: backup`): the CSI name it
/// was taken for (its Zebu form when the CSI name is longer than a label value may be). A
/// repeated CreateSnapshot checks it, and DeleteSnapshot deletes the snapshot such a backup
/// took of its volume along with it; a backup without it (`zebu backup create`, a recurring
/// job) is never answered for another CSI name, and its snapshot is left alone.
pub const CSI_BACKUP_LABEL: &str = "csi.zebu.io/name";

fn csi_label_value(csi_name: &str) -> String {
    if csi_name.len() <= 63 {
        csi_name.to_string()
    } else {
        names::label_for(csi_name)
    }
}

/// Whether backup `b` was taken for a CSI snapshot and took its own snapshot of the volume
/// (named as the backup), which is then the plugin's to delete.
fn csi_took_snapshot(b: &Backup) -> bool {
    b.spec.labels.contains_key(CSI_BACKUP_LABEL) && b.spec.snapshot == b.metadata.name
}

/// The message of a backup that will not become ready.
fn backup_failed(b: &Backup) -> String {
    format!(
        "backup {} of volume {} failed: {}",
        b.metadata.name,
        b.spec.volume,
        if b.status.error.is_empty() {
            "no error recorded"
        } else {
            b.status.error.as_str()
        }
    )
}

pub struct ControllerService {
    client: Client,
    attach: AttachMode,
    budget: Duration,
}

fn required<'a>(v: &'a str, what: &str) -> Result<&'a str, Status> {
    if v.is_empty() {
        Err(Status::invalid_argument(format!("{what} is required")))
    } else {
        Ok(v)
    }
}

fn is_not_found(e: &ClientError) -> bool {
    matches!(e, ClientError::Api { status, .. } if status.as_u16() == 404)
}

impl ControllerService {
    pub fn new(client: Client, attach: AttachMode, budget: Duration) -> Self {
        ControllerService {
            client,
            attach,
            budget,
        }
    }

    fn frontend(&self) -> Frontend {
        match self.attach {
            AttachMode::Iscsi => Frontend::Iscsi,
            AttachMode::Nbdfuse => Frontend::Nbd,
        }
    }

    /// The volume a CSI id names, `None` when there is none (or the id names nothing).
    async fn find_volume(&self, id: &str) -> Result<Option<Volume>, Status> {
        let Some(name) = names::volume_of_id(id) else {
            return Ok(None);
        };
        self.client.find_volume(name).await.map_err(api_status)
    }

    async fn volume(&self, id: &str) -> Result<Volume, Status> {
        self.find_volume(id)
            .await?
            .ok_or_else(|| Status::not_found(format!("volume {id:?} not found")))
    }

    /// Poll `volume` until `done` says so, at most the call budget; the last state seen.
    async fn wait(
        &self,
        volume: &str,
        done: impl Fn(&Volume) -> bool,
    ) -> Result<(bool, Option<Volume>), Status> {
        let deadline = tokio::time::Instant::now() + self.budget;
        loop {
            let v = self.client.find_volume(volume).await.map_err(api_status)?;
            if v.as_ref().is_some_and(&done) {
                return Ok((true, v));
            }
            if tokio::time::Instant::now() >= deadline || v.is_none() {
                return Ok((false, v));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Wait for a volume's copy from its data source; `Aborted` while it runs.
    async fn wait_populated(&self, volume: &str) -> Result<Volume, Status> {
        let state = self
            .client
            .populate_volume(volume)
            .await
            .map_err(api_status)?;
        if state.is_none() {
            return self.volume(volume).await;
        }
        let (done, v) = self
            .wait(volume, |v| Population::of(v).is_some_and(|p| p.is_done()))
            .await?;
        match (done, v) {
            (true, Some(v)) => Ok(v),
            (_, Some(v)) => Err(Status::aborted(format!(
                "volume {volume} is being filled from its data source ({}); try again",
                Population::of(&v).map_or("copying".to_string(), |p| p.to_string())
            ))),
            (_, None) => Err(Status::aborted(format!(
                "volume {volume} is gone; try again"
            ))),
        }
    }

    /// Wait for a volume's restore from its backup; `Aborted` while it runs.
    async fn wait_restored(&self, volume: &str) -> Result<Volume, Status> {
        let state = |v: &Volume| v.status.restore.as_ref().map(|r| r.state);
        let (_, v) = self
            .wait(volume, |v| {
                matches!(
                    state(v),
                    Some(RestoreState::Completed | RestoreState::Error)
                )
            })
            .await?;
        let Some(v) = v else {
            return Err(Status::aborted(format!(
                "volume {volume} is gone; try again"
            )));
        };
        match v.status.restore.as_ref() {
            Some(r) if r.state == RestoreState::Completed => Ok(v),
            Some(r) if r.state == RestoreState::Error => Err(Status::internal(format!(
                "volume {volume}: the restore of backup {} failed: {}; delete the volume",
                r.backup, r.error
            ))),
            Some(r) => Err(Status::aborted(format!(
                "volume {volume} is being restored from backup {} ({}%); try again",
                r.backup, r.progress
            ))),
            None => Err(Status::aborted(format!(
                "volume {volume} is waiting for its restore to start; try again"
            ))),
        }
    }

    /// The content source: a snapshot or a volume to copy, or (a snapshot id that names a
    /// backup) a backup to restore.
    fn data_source(
        req: &csi::CreateVolumeRequest,
    ) -> Result<(Option<DataSource>, Option<String>), Status> {
        let Some(src) = req
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref())
        else {
            return Ok((None, None));
        };
        Ok(match src {
            Source::Snapshot(s) => match SnapshotRef::parse(&s.snapshot_id) {
                Some(SnapshotRef::Local(id)) => (
                    Some(DataSource {
                        volume: id.volume,
                        snapshot: Some(id.snapshot),
                    }),
                    None,
                ),
                Some(SnapshotRef::Backup(b)) => (None, Some(b)),
                None => {
                    return Err(Status::not_found(format!(
                        "snapshot {:?} not found",
                        s.snapshot_id
                    )));
                }
            },
            Source::Volume(v) => {
                let name = names::volume_of_id(&v.volume_id).ok_or_else(|| {
                    Status::not_found(format!("source volume {:?} not found", v.volume_id))
                })?;
                (
                    Some(DataSource {
                        volume: name.to_string(),
                        snapshot: None,
                    }),
                    None,
                )
            }
        })
    }

    /// The size of a new volume that restores backup `name`, which must be completed: the
    /// backup's volume size when the request names none, else the requested size, which may
    /// not be below it (OutOfRange). A backup still uploading is Aborted (the CO calls again,
    /// as while a restore runs); one that failed or is being deleted never becomes usable
    /// (FailedPrecondition).
    async fn restore_size(
        &self,
        name: &str,
        what: &str,
        range: Option<&csi::CapacityRange>,
    ) -> Result<u64, Status> {
        let b = self
            .client
            .find_backup(name)
            .await
            .map_err(api_status)?
            .ok_or_else(|| Status::not_found(format!("{what} not found")))?;
        match b.status.state {
            BackupState::Completed => {}
            BackupState::Pending | BackupState::InProgress => {
                return Err(Status::aborted(format!(
                    "{what} is not ready yet (the upload is {}, {}% read); try again",
                    b.status.state, b.status.progress
                )));
            }
            BackupState::Error => return Err(Status::failed_precondition(backup_failed(&b))),
            BackupState::Deleting => {
                return Err(Status::failed_precondition(format!(
                    "{what} is being deleted"
                )));
            }
        }
        let need = b.status.volume_size.bytes();
        let (required, limit) = range.map_or((0, 0), |r| {
            (
                r.required_bytes.max(0).cast_unsigned(),
                r.limit_bytes.max(0).cast_unsigned(),
            )
        });
        if limit > 0 && limit < need {
            return Err(Status::out_of_range(format!(
                "capacity_range: limit_bytes {limit} is below the {need} bytes of {what}'s volume"
            )));
        }
        if required > 0 && required < need {
            return Err(Status::out_of_range(format!(
                "capacity_range: required_bytes {required} is below the {need} bytes of {what}'s volume"
            )));
        }
        if required == 0 && need > 0 {
            return Ok(need);
        }
        // (A backup whose status lacks its volume's size: the manager checks the request
        // against the manifest.)
        Ok(size_for(range)?.max(need))
    }
}

impl ControllerService {
    /// CreateSnapshot with VolumeSnapshotClass `type: backup`: a Backup named as the CSI
    /// name (a new snapshot of the volume, uploaded to the target), answered at once with
    /// `readyToUse` false while it uploads; a repeated call answers the same backup, ready
    /// once its manifest is committed.
    async fn create_backup_snapshot(
        &self,
        source: &str,
        csi_name: &str,
    ) -> Result<csi::Snapshot, Status> {
        let name = names::label_for(csi_name);
        if let Some(b) = self.client.find_backup(&name).await.map_err(api_status)? {
            return self.existing_backup_snapshot(b, source, csi_name).await;
        }
        let volume = self.volume(source).await?;
        match self.client.get_backup_target().await {
            Ok(_) => {}
            Err(ClientError::Api { status, code, .. })
                if status.as_u16() == 404
                    || status.as_u16() == 409
                    || code.as_deref() == Some("FailedPrecondition") =>
            {
                return Err(Status::failed_precondition(
                    "VolumeSnapshotClass type backup needs a backup target, and none is set (zebu backup target set URL)",
                ));
            }
            Err(e) => return Err(api_status(e)),
        }
        // A snapshot of that name left by an attempt that stopped before its Backup was
        // recorded is backed up instead of taking another.
        let taken = self
            .client
            .list_snapshot_records(Some(&volume.metadata.name))
            .await
            .map_err(api_status)?
            .items
            .iter()
            .any(|r| {
                r.metadata
                    .annotations
                    .get(SNAPSHOT_NAME_ANNOTATION)
                    .map(String::as_str)
                    == Some(name.as_str())
            });
        let create = CreateBackup {
            volume: volume.metadata.name.clone(),
            snapshot: taken.then(|| name.clone()),
            name: Some(name.clone()),
            labels: [(CSI_BACKUP_LABEL.to_string(), csi_label_value(csi_name))].into(),
        };
        let b = match self.client.create_backup(&create).await {
            Ok(b) => b,
            // Raced by a repeat of this call: its backup answers.
            Err(ClientError::Api { status, .. }) if status.as_u16() == 409 => {
                match self.client.find_backup(&name).await.map_err(api_status)? {
                    Some(b) => return self.existing_backup_snapshot(b, source, csi_name).await,
                    None => {
                        return Err(Status::aborted(format!(
                            "backup {name} of {source} is being recorded; try again"
                        )));
                    }
                }
            }
            Err(e) => return Err(api_status(e)),
        };
        tracing::info!(volume = source, backup = %name, csi_name, "backup requested for a CSI snapshot");
        Ok(csi_backup_snapshot(&b, volume.spec.size.bytes()))
    }

    /// A repeated CreateSnapshot of `type: backup`: the same backup when it was taken for
    /// this name of this volume; AlreadyExists otherwise.
    async fn existing_backup_snapshot(
        &self,
        b: Backup,
        source: &str,
        csi_name: &str,
    ) -> Result<csi::Snapshot, Status> {
        let name = &b.metadata.name;
        if b.spec.labels.get(CSI_BACKUP_LABEL) != Some(&csi_label_value(csi_name)) {
            return Err(Status::already_exists(format!(
                "backup {name} exists already and was not taken for CSI snapshot {csi_name:?}"
            )));
        }
        if b.spec.volume != source {
            return Err(Status::already_exists(format!(
                "snapshot {csi_name:?} exists already, a backup of volume {}",
                b.spec.volume
            )));
        }
        if b.metadata.is_deleting() || b.status.state == BackupState::Deleting {
            return Err(Status::aborted(format!(
                "backup {name} of {source} is being deleted; try again"
            )));
        }
        if b.status.state == BackupState::Error {
            return Err(Status::internal(format!(
                "{}; delete the VolumeSnapshot and take another",
                backup_failed(&b)
            )));
        }
        let size = match b.status.volume_size.bytes() {
            0 => self
                .client
                .find_volume(source)
                .await
                .map_err(api_status)?
                .map_or(0, |v| v.spec.size.bytes()),
            n => n,
        };
        Ok(csi_backup_snapshot(&b, size))
    }

    /// DeleteSnapshot of `backup:NAME`: the snapshot the backup took of its volume for CSI
    /// (first: once the backup is gone nothing says which one it was), then the backup from
    /// the target. OK once the backup is gone (also when it never existed); Aborted while
    /// its manifest is being deleted.
    async fn delete_backup_snapshot(&self, name: &str) -> Result<(), Status> {
        let Some(b) = self.client.find_backup(name).await.map_err(api_status)? else {
            return Ok(());
        };
        if csi_took_snapshot(&b)
            && let Some(v) = self.find_volume(&b.spec.volume).await?
            && !v.metadata.is_deleting()
        {
            let there = self
                .client
                .list_snapshot_records(Some(&v.metadata.name))
                .await
                .map_err(api_status)?
                .items
                .iter()
                .any(|r| {
                    r.metadata.annotations.get(SNAPSHOT_NAME_ANNOTATION) == Some(&b.spec.snapshot)
                });
            if there {
                match self
                    .client
                    .delete_snapshot(&v.metadata.name, &b.spec.snapshot)
                    .await
                {
                    Ok(_) => {}
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(api_status(e)),
                }
                tracing::info!(volume = %v.metadata.name, snapshot = %b.spec.snapshot, backup = name, "the snapshot a CSI backup took is deleted");
            }
        }
        if !b.metadata.is_deleting() {
            match self.client.delete_backup(name).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => return Ok(()),
                Err(e) => return Err(api_status(e)),
            }
            tracing::info!(backup = name, "backup delete requested for a CSI snapshot");
        }
        let deadline = tokio::time::Instant::now() + self.budget;
        loop {
            let Some(b) = self.client.find_backup(name).await.map_err(api_status)? else {
                tracing::info!(backup = name, "backup deleted");
                return Ok(());
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(Status::aborted(format!(
                    "backup {name} is being deleted from the target ({}); try again",
                    b.status.state
                )));
            }
            tokio::time::sleep(POLL * 4).await;
        }
    }
}

fn data_source_of(v: &Volume) -> Option<&str> {
    v.metadata
        .annotations
        .get(DATA_SOURCE_ANNOTATION)
        .map(String::as_str)
}

#[tonic::async_trait]
impl csi::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let csi_name = required(&req.name, "name")?.to_string();
        caps::check_all(&req.volume_capabilities).map_err(Status::invalid_argument)?;
        let params =
            Params::parse(&req.parameters).map_err(|e| Status::invalid_argument(e.to_string()))?;
        for c in &req.volume_capabilities {
            if let (Some(csi::volume_capability::AccessType::Mount(m)), Some(fs)) =
                (&c.access_type, &params.fs_type)
                && !m.fs_type.is_empty()
                && &m.fs_type != fs
            {
                return Err(Status::invalid_argument(format!(
                    "StorageClass parameter \"fsType\" is {fs} but the volume capability asks for {}",
                    m.fs_type
                )));
            }
        }
        let size = size_for(req.capacity_range.as_ref())?;
        let (source, source_backup) = Self::data_source(&req)?;
        if let Some(backup) = &params.from_backup
            && req
                .volume_content_source
                .as_ref()
                .is_some_and(|s| s.r#type.is_some())
        {
            return Err(Status::invalid_argument(format!(
                "StorageClass parameter \"fromBackup\" ({backup}) and a volume content source (a snapshot or a volume) cannot both give the new volume's data"
            )));
        }
        // The backup to restore: the StorageClass's, or the one a backup snapshot names.
        let backup = params.from_backup.clone().or(source_backup);
        let backup_what = |b: &str| {
            if params.from_backup.is_some() {
                format!("backup {b:?}")
            } else {
                format!("snapshot {:?}", names::backup_snapshot_id(b))
            }
        };
        if backup.is_some() {
            // A restore takes the replica count only; the rest would be silently lost.
            if let Some(key) = params.not_with_from_backup() {
                return Err(Status::invalid_argument(format!(
                    "StorageClass parameter {key:?} cannot be combined with a restore from a backup (\"fromBackup\" or a snapshot of VolumeSnapshotClass type backup), which takes numberOfReplicas only"
                )));
            }
        }
        let volume = names::volume_name(&csi_name);
        let wanted_source = source
            .as_ref()
            .map(|s| (s.volume.clone(), s.snapshot.clone()));
        let existing = self.client.find_volume(&volume).await.map_err(api_status)?;
        let v = match existing {
            Some(v) => {
                let theirs = v.metadata.annotations.get(CSI_NAME_ANNOTATION);
                if theirs.is_some_and(|n| n != &csi_name) {
                    return Err(Status::already_exists(format!(
                        "volume {volume} belongs to CSI volume {:?}, not {csi_name:?}",
                        theirs.map(String::as_str).unwrap_or_default()
                    )));
                }
                if !fits(v.spec.size.bytes(), req.capacity_range.as_ref()) {
                    return Err(Status::already_exists(format!(
                        "volume {csi_name:?} exists with {} bytes, which the requested capacity range does not allow",
                        v.spec.size.bytes()
                    )));
                }
                let has_source = data_source_of(&v).is_some();
                let same_source = match (&wanted_source, data_source_of(&v)) {
                    (None, None) => true,
                    (Some((vol, Some(snap))), Some(s)) => s == format!("{vol}/{snap}"),
                    (Some((vol, None)), Some(s)) => s.starts_with(&format!("{vol}/")),
                    _ => false,
                };
                if !same_source {
                    return Err(Status::already_exists(format!(
                        "volume {csi_name:?} exists with another content source ({})",
                        data_source_of(&v).unwrap_or("none")
                    )));
                }
                let their_backup = v
                    .metadata
                    .annotations
                    .get(FROM_BACKUP_ANNOTATION)
                    .map(String::as_str);
                if their_backup != backup.as_deref() {
                    return Err(Status::already_exists(format!(
                        "volume {csi_name:?} exists restored from {}, not from {}",
                        their_backup.map_or("no backup".to_string(), |b| format!("backup {b}")),
                        backup
                            .as_deref()
                            .map_or("no backup".to_string(), |b| format!("backup {b}"))
                    )));
                }
                if v.metadata.is_deleting() {
                    return Err(Status::aborted(format!(
                        "volume {csi_name:?} is being deleted; try again"
                    )));
                }
                if their_backup.is_some() {
                    self.wait_restored(&volume).await?
                } else if has_source {
                    self.wait_populated(&volume).await?
                } else {
                    v
                }
            }
            None if backup.is_some() => {
                let backup = backup.clone().unwrap_or_default();
                let size = self
                    .restore_size(&backup, &backup_what(&backup), req.capacity_range.as_ref())
                    .await?;
                let restore = RestoreBackup {
                    volume: volume.clone(),
                    size: Some(ByteSize(size).into()),
                    number_of_replicas: params.number_of_replicas,
                    frontend: None,
                };
                match self.client.restore_backup(&backup, &restore).await {
                    Ok(_) => {}
                    // A retry raced the first call: the volume is there now.
                    Err(ClientError::Api { status, .. }) if status.as_u16() == 409 => {}
                    Err(e) => return Err(api_status(e)),
                }
                tracing::info!(
                    volume,
                    csi_name,
                    size,
                    backup,
                    "volume created to restore a backup"
                );
                self.wait_restored(&volume).await?
            }
            None => {
                let mut create = CreateVolume::new(volume.clone(), ByteSize(size));
                params.apply(&mut create);
                create.data_source = source.clone();
                create
                    .annotations
                    .insert(CSI_NAME_ANNOTATION.into(), csi_name.clone());
                if let Some(fs) = &params.fs_type {
                    create
                        .annotations
                        .insert(FS_TYPE_ANNOTATION.into(), fs.clone());
                }
                if let Some(m) = &params.mkfs_params {
                    create
                        .annotations
                        .insert(MKFS_PARAMS_ANNOTATION.into(), m.clone());
                }
                let v = match self.client.create_volume(&create).await {
                    Ok(v) => v,
                    // A retry raced the first call: the volume is there now.
                    Err(ClientError::Api { status, .. }) if status.as_u16() == 409 => {
                        self.volume(&volume).await?
                    }
                    Err(e) => return Err(api_status(e)),
                };
                tracing::info!(volume, csi_name, size, "volume created");
                if source.is_some() {
                    self.wait_populated(&volume).await?
                } else {
                    v
                }
            }
        };
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi_volume(&v, req.volume_content_source.clone())),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        let Some(v) = self.find_volume(id).await? else {
            return Ok(Response::new(csi::DeleteVolumeResponse {}));
        };
        if let Some(node) = published_node(&v) {
            return Err(Status::failed_precondition(format!(
                "volume {id} is published to node {node}; unpublish it first"
            )));
        }
        if v.spec.node_id.is_some() {
            return Err(Status::aborted(format!(
                "volume {id} is held without its frontend by an operation (a snapshot or an expansion); try again"
            )));
        }
        match self.client.delete_volume(id).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(api_status(e)),
        }
        // Deletion is committed (the finalizer removes the replicas and their directories);
        // wait a little so a quick delete answers with the volume gone.
        let _ = self.wait(id, |_| false).await;
        tracing::info!(volume = id, "volume deleted");
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        let node = required(&req.node_id, "node_id")?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        caps::check(cap).map_err(Status::invalid_argument)?;
        let v = self.volume(id).await?;
        let nodes = self.client.list_nodes().await.map_err(api_status)?;
        if !nodes.items.iter().any(|n| n.metadata.name == node) {
            return Err(Status::not_found(format!("node {node:?} not found")));
        }
        if v.spec.node_id.is_some() && v.spec.disable_frontend {
            return Err(Status::aborted(format!(
                "volume {id} is held without its frontend by an operation (a snapshot or an expansion); try again"
            )));
        }
        if let Some(other) = published_node(&v)
            && other != node
        {
            return Err(Status::failed_precondition(format!(
                "volume {id} is published to node {other}; unpublish it there first"
            )));
        }
        let attach = AttachVolume {
            node: Some(node.to_string()),
            maintenance: false,
            frontend: Some(self.frontend()),
        };
        self.client
            .attach_volume(id, &attach)
            .await
            .map_err(api_status)?;
        let (done, last) = self
            .wait(id, |v| {
                v.status.current_node.as_deref() == Some(node) && publish_context(v).is_some()
            })
            .await?;
        let v = match (done, last) {
            (true, Some(v)) => v,
            (_, last) => {
                return Err(Status::aborted(format!(
                    "volume {id} is attaching to node {node} ({}); try again",
                    last.map_or("gone".to_string(), |v| format!(
                        "state {}{}",
                        v.status.state.as_str(),
                        v.status
                            .endpoint
                            .map(|e| format!(", endpoint {e}"))
                            .unwrap_or_default()
                    ))
                )));
            }
        };
        let ctx = publish_context(&v).unwrap_or_default();
        tracing::info!(volume = id, node, frontend = %self.frontend(), "published");
        Ok(Response::new(csi::ControllerPublishVolumeResponse {
            publish_context: ctx,
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        let Some(v) = self.find_volume(id).await? else {
            return Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}));
        };
        let Some(published) = published_node(&v).map(str::to_string) else {
            return Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}));
        };
        if !req.node_id.is_empty() && req.node_id != published {
            return Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}));
        }
        self.client.detach_volume(id).await.map_err(api_status)?;
        let nodes = self.client.list_nodes().await.map_err(api_status)?;
        let node_up = nodes
            .items
            .iter()
            .any(|n| n.metadata.name == published && n.is_ready());
        if !node_up {
            // Nothing can detach on a node that is down. The next engine's generation fences
            // the old one, so the volume may be published elsewhere at once.
            tracing::warn!(volume = id, node = %published, "unpublished from a node that is not ready");
            return Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}));
        }
        let (done, last) = self
            .wait(id, |v| {
                v.spec.node_id.is_some()
                    || matches!(
                        v.status.state,
                        VolumeState::Detached | VolumeState::Creating
                    )
            })
            .await?;
        if !done && last.is_some() {
            return Err(Status::aborted(format!(
                "volume {id} is detaching from node {published}; try again"
            )));
        }
        tracing::info!(volume = id, node = %published, "unpublished");
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities is required"));
        }
        let v = self.volume(id).await?;
        let verdict = caps::check_all(&req.volume_capabilities).and_then(|()| {
            Params::parse(&req.parameters)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        Ok(Response::new(match verdict {
            Ok(()) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: convert::volume_context(&v),
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: HashMap::new(),
                }),
                message: String::new(),
            },
            Err(why) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why,
            },
        }))
    }

    async fn list_volumes(
        &self,
        request: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let volumes = self.client.list_volumes().await.map_err(api_status)?.items;
        let items = volumes
            .into_iter()
            .filter(|v| !v.metadata.is_deleting())
            .map(|v| {
                let entry = csi::list_volumes_response::Entry {
                    volume: Some(csi_volume(&v, None)),
                    status: Some(csi::list_volumes_response::VolumeStatus {
                        published_node_ids: published_node(&v)
                            .map(str::to_string)
                            .into_iter()
                            .collect(),
                        volume_condition: Some(convert::condition(&v)),
                    }),
                };
                (v.metadata.name, entry)
            })
            .collect();
        let (entries, next_token) = page(items, &req.starting_token, req.max_entries)?;
        Ok(Response::new(csi::ListVolumesResponse {
            entries,
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        request: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let req = request.into_inner();
        Params::parse(&req.parameters).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if caps::check_all(&req.volume_capabilities).is_err() && !req.volume_capabilities.is_empty()
        {
            // The spec: capacity for capabilities the plugin cannot serve is 0.
            return Ok(Response::new(csi::GetCapacityResponse::default()));
        }
        let segments = req
            .accessible_topology
            .map(|t| t.segments)
            .unwrap_or_default();
        for k in segments.keys() {
            if k != TOPOLOGY_NODE_KEY && k != TOPOLOGY_ZONE_KEY {
                return Err(Status::invalid_argument(format!(
                    "topology key {k:?} is not one of {TOPOLOGY_NODE_KEY}, {TOPOLOGY_ZONE_KEY}"
                )));
            }
        }
        let c = self
            .client
            .capacity(
                segments.get(TOPOLOGY_NODE_KEY).map(String::as_str),
                segments.get(TOPOLOGY_ZONE_KEY).map(String::as_str),
            )
            .await
            .map_err(api_status)?;
        Ok(Response::new(csi::GetCapacityResponse {
            available_capacity: c.available.bytes() as i64,
            maximum_volume_size: Some(c.maximum_volume_size.bytes() as i64),
            minimum_volume_size: Some(4096),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        let capabilities = [
            Cap::CreateDeleteVolume,
            Cap::PublishUnpublishVolume,
            Cap::ListVolumes,
            Cap::GetCapacity,
            Cap::CreateDeleteSnapshot,
            Cap::ListSnapshots,
            Cap::CloneVolume,
            Cap::ExpandVolume,
            Cap::ListVolumesPublishedNodes,
            Cap::VolumeCondition,
            Cap::GetVolume,
            Cap::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| csi::ControllerServiceCapability {
            r#type: Some(csi::controller_service_capability::Type::Rpc(
                csi::controller_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let source = required(&req.source_volume_id, "source_volume_id")?;
        let csi_name = required(&req.name, "name")?;
        let params = SnapshotParams::parse(&req.parameters)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if params.r#type == SnapshotType::Backup {
            let snapshot = self.create_backup_snapshot(source, csi_name).await?;
            return Ok(Response::new(csi::CreateSnapshotResponse {
                snapshot: Some(snapshot),
            }));
        }
        let snap = names::label_for(csi_name);
        let records = self
            .client
            .list_snapshot_records(None)
            .await
            .map_err(api_status)?
            .items;
        let mine = |r: &zebu_types::resources::Snapshot| {
            r.metadata
                .annotations
                .get(SNAPSHOT_NAME_ANNOTATION)
                .map(String::as_str)
                == Some(snap.as_str())
        };
        if let Some(r) = records.iter().find(|r| mine(r)) {
            if let Some(b) = self.client.find_backup(&snap).await.map_err(api_status)?
                && csi_took_snapshot(&b)
                && b.spec.volume == r.spec.volume
            {
                return Err(Status::already_exists(format!(
                    "snapshot {csi_name:?} exists already, as a backup (VolumeSnapshotClass type backup) of volume {}",
                    b.spec.volume
                )));
            }
            if r.spec.volume != source {
                return Err(Status::already_exists(format!(
                    "snapshot {csi_name:?} exists already, of volume {}",
                    r.spec.volume
                )));
            }
            return Ok(Response::new(csi::CreateSnapshotResponse {
                snapshot: Some(csi_snapshot(r, &snap)),
            }));
        }
        let volume = self.volume(source).await?;
        let req = CreateSnapshot {
            name: Some(snap.clone()),
        };
        match self
            .client
            .create_snapshot(&volume.metadata.name, &req)
            .await
        {
            Ok(_) => {}
            Err(ClientError::Api { status, .. }) if status.as_u16() == 409 => {
                // Taken by a call that raced this one; its record says.
            }
            Err(e) => return Err(api_status(e)),
        }
        let record = self
            .client
            .list_snapshot_records(Some(&volume.metadata.name))
            .await
            .map_err(api_status)?
            .items
            .into_iter()
            .find(|r| mine(r))
            .ok_or_else(|| {
                Status::aborted(format!(
                    "snapshot {csi_name:?} of {source} is being taken; try again"
                ))
            })?;
        tracing::info!(volume = source, snapshot = %snap, csi_name, "snapshot taken");
        Ok(Response::new(csi::CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(&record, &snap)),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.snapshot_id, "snapshot_id")?;
        let sid = match SnapshotRef::parse(id) {
            None => return Ok(Response::new(csi::DeleteSnapshotResponse {})),
            Some(SnapshotRef::Backup(b)) => {
                self.delete_backup_snapshot(&b).await?;
                return Ok(Response::new(csi::DeleteSnapshotResponse {}));
            }
            Some(SnapshotRef::Local(sid)) => sid,
        };
        let exists = self
            .client
            .list_snapshot_records(Some(&sid.volume))
            .await
            .map_err(api_status)?
            .items
            .iter()
            .any(|r| r.metadata.annotations.get(SNAPSHOT_NAME_ANNOTATION) == Some(&sid.snapshot));
        if !exists {
            return Ok(Response::new(csi::DeleteSnapshotResponse {}));
        }
        match self
            .client
            .delete_snapshot(&sid.volume, &sid.snapshot)
            .await
        {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(api_status(e)),
        }
        tracing::info!(snapshot = %sid, "snapshot deleted");
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let wanted = if req.snapshot_id.is_empty() {
            None
        } else {
            match SnapshotRef::parse(&req.snapshot_id) {
                Some(s) => Some(s),
                None => return Ok(Response::new(csi::ListSnapshotsResponse::default())),
            }
        };
        let volume = match (&wanted, req.source_volume_id.as_str()) {
            (Some(SnapshotRef::Local(s)), _) => Some(s.volume.clone()),
            (_, "") => None,
            (_, v) => match names::volume_of_id(v) {
                Some(v) => Some(v.to_string()),
                None => return Ok(Response::new(csi::ListSnapshotsResponse::default())),
            },
        };
        let backups: Vec<Backup> = match &wanted {
            Some(SnapshotRef::Backup(b)) => self
                .client
                .find_backup(b)
                .await
                .map_err(api_status)?
                .into_iter()
                .filter(|b| volume.as_ref().is_none_or(|v| &b.spec.volume == v))
                .collect(),
            _ => {
                self.client
                    .list_backups(volume.as_deref())
                    .await
                    .map_err(api_status)?
                    .items
            }
        };
        // The snapshots backups took for CSI are those backups, not snapshots of their own.
        let taken_for_backups: std::collections::HashSet<(&str, &str)> = backups
            .iter()
            .filter(|b| csi_took_snapshot(b))
            .map(|b| (b.spec.volume.as_str(), b.spec.snapshot.as_str()))
            .collect();
        let mut items: Vec<(String, csi::list_snapshots_response::Entry)> = Vec::new();
        if !matches!(wanted, Some(SnapshotRef::Backup(_))) {
            let records = self
                .client
                .list_snapshot_records(volume.as_deref())
                .await
                .map_err(api_status)?
                .items;
            items.extend(
                records
                    .into_iter()
                    .filter(|r| {
                        req.source_volume_id.is_empty() || r.spec.volume == req.source_volume_id
                    })
                    .filter_map(|r| {
                        let snap = r
                            .metadata
                            .annotations
                            .get(SNAPSHOT_NAME_ANNOTATION)?
                            .clone();
                        if let Some(SnapshotRef::Local(w)) = &wanted
                            && w.snapshot != snap
                        {
                            return None;
                        }
                        if taken_for_backups.contains(&(r.spec.volume.as_str(), snap.as_str())) {
                            return None;
                        }
                        let entry = csi::list_snapshots_response::Entry {
                            snapshot: Some(csi_snapshot(&r, &snap)),
                        };
                        Some((format!("{}/{snap}", r.spec.volume), entry))
                    }),
            );
        }
        if !matches!(wanted, Some(SnapshotRef::Local(_))) {
            let live: Vec<&Backup> = backups
                .iter()
                .filter(|b| !b.metadata.is_deleting() && b.status.state != BackupState::Deleting)
                .collect();
            // A backup whose upload has not reported yet has no size of its own: its
            // volume's, read once for the page.
            let sizes: HashMap<String, u64> =
                if live.iter().any(|b| b.status.volume_size.bytes() == 0) {
                    self.client
                        .list_volumes()
                        .await
                        .map_err(api_status)?
                        .items
                        .into_iter()
                        .map(|v| (v.metadata.name.clone(), v.spec.size.bytes()))
                        .collect()
                } else {
                    HashMap::new()
                };
            items.extend(live.into_iter().map(|b| {
                let fallback = sizes.get(&b.spec.volume).copied().unwrap_or(0);
                let snapshot = csi_backup_snapshot(b, fallback);
                (
                    snapshot.snapshot_id.clone(),
                    csi::list_snapshots_response::Entry {
                        snapshot: Some(snapshot),
                    },
                )
            }));
        }
        let (entries, next_token) = page(items, &req.starting_token, req.max_entries)?;
        Ok(Response::new(csi::ListSnapshotsResponse {
            entries,
            next_token,
        }))
    }

    async fn get_snapshot(
        &self,
        _request: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        Err(Status::unimplemented(
            "GetSnapshot is not offered (no GET_SNAPSHOT capability)",
        ))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let size = size_for(Some(range))?;
        let v = self.volume(id).await?;
        let node_expansion_required = caps::needs_node_expansion(req.volume_capability.as_ref());
        if v.spec.size.bytes() >= size {
            return Ok(Response::new(csi::ControllerExpandVolumeResponse {
                capacity_bytes: v.spec.size.bytes() as i64,
                node_expansion_required,
            }));
        }
        let expand = ExpandVolume {
            size: ByteSize(size).into(),
        };
        let v = self
            .client
            .expand_volume(id, &expand)
            .await
            .map_err(api_status)?;
        tracing::info!(volume = id, size, "volume expanded");
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: v.spec.size.bytes() as i64,
            node_expansion_required,
        }))
    }

    async fn controller_get_volume(
        &self,
        request: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        let v = self.volume(id).await?;
        Ok(Response::new(csi::ControllerGetVolumeResponse {
            volume: Some(csi_volume(&v, None)),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: published_node(&v).map(str::to_string).into_iter().collect(),
                volume_condition: Some(convert::condition(&v)),
            }),
        }))
    }

    async fn controller_modify_volume(
        &self,
        _request: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerModifyVolume is not offered (no MODIFY_VOLUME capability)",
        ))
    }
}
