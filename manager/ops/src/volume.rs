//! Volume operations: create, get, list, watch, attach, detach, expand, delete.
//!
//! Rules, once for every caller:
//! - A new volume's name is a DNS-1123 label; every other call refuses (400) a name no store
//!   could hold instead of looking it up, so `a/../b` never reaches a path or a lookup.
//! - A size is whole 4 KiB blocks (the frontends expose 4 KiB sectors), more than 0.
//! - A volume that can never be placed (more replicas than nodes under hard anti-affinity,
//!   bigger than any disk) is refused at create with the scheduler's reason, instead of a
//!   volume stuck in `creating`. The controller schedules for real afterwards.
//! - Attach records the node in `spec.nodeId` (and `disableFrontend` for maintenance); a
//!   volume attached elsewhere must be detached first. Detach clears both.
//! - Attach may choose the frontend (recorded in the spec; the CSI plugin picks the one its
//!   nodes use). A volume attached with another frontend must be detached first. A volume
//!   still being filled from its data source (`populate`) cannot be attached: `Aborted`.
//! - Expand grows an attached volume through its engine, then records the size; a detached
//!   volume is grown by an engine started without a frontend for the call (`maintenance`).
//! - A volume from a snapshot or a clone (`dataSource`) is created detached, then filled by
//!   a copy of the snapshot's layers into its replicas (`populate`); a clone first takes a
//!   snapshot of its source (`clone-<hash of the clone's name>`).
//! - A volume that no disk can hold is `OutOfRange`; one that cannot be placed for another
//!   reason (too few nodes) is `InvalidArgument`.

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use zebu_types::names::{MAINTENANCE_ANNOTATION, VOLUME_FINALIZER};
use zebu_types::requests::{AttachVolume, CreateSnapshot, CreateVolume, DataSource, ExpandVolume};
use zebu_types::resources::{
    Engine, EngineState, Node, RebuildState, Replica, Setting, Volume, VolumeSpec,
};
use zebu_types::secrets::{SECRET_NAME_ANNOTATION, VOLUME_UUID_ANNOTATION, VolumeIdentity};
use zebu_types::settings::Settings;
use zebu_types::size::ByteSize;
use zebu_types::store::{ListParams, StoreError, TypedStore, WatchEvent, WatchStream, from_value};
use zebu_types::{Kind, ResourceVersion, Store, validate_label, validate_object_name};

use crate::populate::{DATA_SOURCE_ANNOTATION, POPULATION_ANNOTATION, Population};
use crate::scheduler::{ScheduleError, ScheduleRequest, schedule};
use crate::snapshot::snapshot_record_name;
use crate::{Ops, OpsError, OpsResult, engine_rpc};

/// Volumes must be whole 4 KiB blocks: the frontends expose 4 KiB sectors.
pub const VOLUME_ALIGNMENT: u64 = 4096;
pub const MAX_REPLICAS: u32 = 20;
/// Read-modify-write attempts before an edit gives up on a volume that keeps changing.
const EDIT_ATTEMPTS: usize = 10;

/// One change a volume watch reports.
#[derive(Debug, Clone, PartialEq)]
pub enum VolumeChange {
    /// The current state (first), or the state after a watch had to start over.
    Added(Volume),
    Modified(Volume),
    /// The volume is gone; nothing follows.
    Deleted(Volume),
}

/// Refuse a name no store could hold, naming what it was meant to be.
pub(crate) fn check_name(what: &str, name: &str) -> OpsResult<()> {
    validate_object_name(name).map_err(|e| OpsError::invalid(format!("{what} {e}")))
}

fn check_size(size: ByteSize) -> OpsResult<()> {
    if size.bytes() == 0 {
        return Err(OpsError::invalid("size must be greater than 0"));
    }
    if !size.bytes().is_multiple_of(VOLUME_ALIGNMENT) {
        return Err(OpsError::invalid(format!(
            "size {} is not a multiple of 4 KiB",
            size.bytes()
        )));
    }
    Ok(())
}

impl Ops {
    pub async fn settings(&self) -> OpsResult<Settings> {
        Ok(Settings::from_objects(
            &self.store.list_as::<Setting>().await?,
        )?)
    }

    pub async fn list_volumes(&self) -> OpsResult<Vec<Volume>> {
        Ok(self.store.list_as::<Volume>().await?)
    }

    pub async fn list_nodes(&self) -> OpsResult<Vec<Node>> {
        Ok(self.store.list_as::<Node>().await?)
    }

    pub async fn get_volume(&self, name: &str) -> OpsResult<Volume> {
        check_name("volume", name)?;
        self.store
            .get_as::<Volume>(name)
            .await?
            .ok_or_else(|| OpsError::not_found(Kind::Volume, name))
    }

    /// The secret of `volume`'s replicas, from this node's file of it (issue 18); `None` for a
    /// volume made before volume secrets.
    pub async fn volume_secret(&self, volume: &str) -> OpsResult<Option<zebu_proto::auth::Secret>> {
        let v = self.get_volume(volume).await?;
        let Some(id) = VolumeIdentity::of(&v.metadata) else {
            return Ok(None);
        };
        let keeper = self.store.secrets().ok_or_else(|| {
            OpsError::precondition(
                volume,
                format!(
                    "its secret {} is kept nowhere this store knows",
                    id.secret_name
                ),
            )
        })?;
        let path = keeper.local_file(&id.secret_name).await?;
        zebu_proto::auth::Secret::load(&path)
            .map(Some)
            .map_err(|e| OpsError::precondition(volume, format!("its secret: {e}")))
    }

    pub async fn create_volume(&self, req: CreateVolume) -> OpsResult<Volume> {
        self.create_volume_annotated(req, Default::default()).await
    }

    /// [`Self::create_volume`] with annotations set at creation (a volume restored from a
    /// backup is marked so before any controller or attach sees it).
    pub(crate) async fn create_volume_annotated(
        &self,
        req: CreateVolume,
        annotations: std::collections::BTreeMap<String, String>,
    ) -> OpsResult<Volume> {
        validate_label(&req.name).map_err(|e| OpsError::invalid(format!("volume {e}")))?;
        let size = req
            .size
            .resolve()
            .map_err(|e| OpsError::invalid(e.to_string()))?;
        check_size(size)?;
        let settings = self.settings().await?;
        let replicas = req
            .number_of_replicas
            .unwrap_or(settings.default_replica_count);
        if !(1..=MAX_REPLICAS).contains(&replicas) {
            return Err(OpsError::invalid(format!(
                "numberOfReplicas {replicas} is out of range 1..={MAX_REPLICAS}"
            )));
        }
        let mut volume = Volume::new(
            req.name,
            VolumeSpec {
                size,
                number_of_replicas: replicas,
                frontend: req.frontend.unwrap_or_default(),
                node_selector: req.node_selector,
                disk_selector: req.disk_selector,
                data_locality: req.data_locality.unwrap_or_default(),
                stale_replica_timeout: req
                    .stale_replica_timeout
                    .unwrap_or(settings.stale_replica_timeout),
                node_id: None,
                disable_frontend: false,
            },
        );
        let name = volume.metadata.name.clone();
        if self.store.get_as::<Volume>(&name).await?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: Kind::Volume,
                name,
            }
            .into());
        }
        for (k, val) in req.annotations {
            if k.starts_with("zebu.io/") {
                return Err(OpsError::invalid(format!(
                    "annotation {k:?}: the zebu.io/ prefix is the manager's own"
                )));
            }
            volume.metadata.annotations.insert(k, val);
        }
        let nodes = self.store.list_as::<Node>().await?;
        // Replicas of a former volume of this name are going away.
        let others: Vec<Replica> = self
            .store
            .list_as::<Replica>()
            .await?
            .into_iter()
            .filter(|r| r.spec.volume != name)
            .collect();
        schedule(&ScheduleRequest {
            volume: &volume,
            nodes: &nodes,
            replicas: &others,
            settings: &settings,
            count: replicas,
        })
        .map_err(|e| match e {
            ScheduleError::NoDiskFits { .. } => OpsError::OutOfRange {
                volume: name.clone(),
                message: e.to_string(),
            },
            _ => OpsError::invalid(e.to_string()),
        })?;
        if let Some(source) = &req.data_source {
            let snapshot = self.resolve_data_source(&name, size, source).await?;
            volume.metadata.annotations.insert(
                DATA_SOURCE_ANNOTATION.into(),
                format!("{}/{snapshot}", source.volume),
            );
            volume.metadata.annotations.insert(
                POPULATION_ANNOTATION.into(),
                Population::Copying.to_string(),
            );
        }
        // The volume controller drops this once the engine and replicas are gone.
        volume.metadata.finalizers.push(VOLUME_FINALIZER.into());
        // Added to, not replaced: the data-source and user annotations above stay.
        volume.metadata.annotations.extend(annotations);
        let keeper = self.store.secrets();
        if let Some(k) = &keeper {
            // A leftover of a former volume of this name (none of whose processes run: the
            // volume is gone) must not be what this one's processes read.
            k.delete(&zebu_types::secrets::secret_name(&name)).await?;
            let uuid = new_volume_uuid();
            volume
                .metadata
                .annotations
                .insert(VOLUME_UUID_ANNOTATION.into(), uuid);
            volume.metadata.annotations.insert(
                SECRET_NAME_ANNOTATION.into(),
                zebu_types::secrets::secret_name(&name),
            );
        }
        let created = self.store.create_as(&volume).await?;
        if let (Some(k), Some(id)) = (&keeper, VolumeIdentity::of(&created.metadata)) {
            // After the Volume, so that in Kubernetes the Secret can be owned by it (and go
            // with it). Agents wait for it before they start the volume's processes.
            let secret = hex(&zebu_proto::auth::nonce());
            if let Err(e) = k
                .create(&id.secret_name, &created.metadata, secret.as_bytes())
                .await
            {
                tracing::warn!(volume = %name, "cannot keep the volume's secret, so the volume is not made: {e}");
                let _ = self.store.delete(Kind::Volume, &name).await;
                return Err(e.into());
            }
        }
        tracing::info!(volume = %created.metadata.name, size = %size, replicas, "volume created");
        if req.data_source.is_some() {
            self.ensure_populated(&name).await?;
        }
        Ok(created)
    }

    /// The snapshot a new volume `name` of `size` is filled from: the one named, or one
    /// taken of the source volume for it (a clone).
    async fn resolve_data_source(
        &self,
        name: &str,
        size: ByteSize,
        source: &DataSource,
    ) -> OpsResult<String> {
        check_name("source volume", &source.volume)?;
        let src = self.get_volume(&source.volume).await?;
        let snapshot = match &source.snapshot {
            Some(s) => {
                let record = self
                    .snapshot_record(&source.volume, s)
                    .await?
                    .ok_or_else(|| {
                        OpsError::not_found(
                            Kind::Snapshot,
                            &snapshot_record_name(&source.volume, s),
                        )
                    })?;
                let needed = record.status.volume_size.unwrap_or(src.spec.size);
                if size < needed {
                    return Err(OpsError::OutOfRange {
                        volume: name.to_string(),
                        message: format!(
                            "volume {name:?} of {size} is smaller than snapshot {s:?} of {:?} ({needed})",
                            source.volume
                        ),
                    });
                }
                s.clone()
            }
            None => {
                if size < src.spec.size {
                    return Err(OpsError::OutOfRange {
                        volume: name.to_string(),
                        message: format!(
                            "volume {name:?} of {size} is smaller than its source {:?} ({})",
                            source.volume, src.spec.size
                        ),
                    });
                }
                let snapshot = clone_snapshot_name(name);
                let taken = self.snapshot_record(&source.volume, &snapshot).await?;
                if taken.is_none() {
                    self.create_snapshot(
                        &source.volume,
                        CreateSnapshot {
                            name: Some(snapshot.clone()),
                        },
                    )
                    .await?;
                }
                snapshot
            }
        };
        Ok(snapshot)
    }

    /// Delete a volume: `Some` while its finalizer holds it (the controller removes the
    /// engine and replicas first), `None` once it is gone.
    pub async fn delete_volume(&self, name: &str) -> OpsResult<Option<Volume>> {
        check_name("volume", name)?;
        match self.store.delete(Kind::Volume, name).await {
            Ok(held) => {
                tracing::info!(volume = %name, "volume deleted");
                // Its snapshots live in its replicas, which go with it.
                self.forget_snapshots_of(name).await?;
                Ok(held.map(from_value).transpose()?)
            }
            Err(StoreError::NotFound { .. }) => Err(OpsError::not_found(Kind::Volume, name)),
            Err(e) => Err(e.into()),
        }
    }

    /// Read-modify-write of a volume's spec and metadata, again on resourceVersion conflicts
    /// (a controller may be writing the same object). `edit` may refuse.
    pub(crate) async fn edit_volume(
        &self,
        name: &str,
        edit: impl Fn(&mut Volume) -> OpsResult<()>,
    ) -> OpsResult<Volume> {
        for _ in 0..EDIT_ATTEMPTS {
            let mut v = self.get_volume(name).await?;
            let before = v.clone();
            edit(&mut v)?;
            if v == before {
                return Ok(v);
            }
            match self.store.update_as(&v).await {
                Err(StoreError::Conflict { .. }) => continue,
                Err(StoreError::NotFound { .. }) => {
                    return Err(OpsError::not_found(Kind::Volume, name));
                }
                other => return Ok(other?),
            }
        }
        Err(OpsError::Aborted {
            message: format!("volume {name:?} keeps changing; try again"),
        })
    }

    /// A ready node to attach to when the caller names none (on one host they are all local).
    pub(crate) async fn pick_node(&self, volume: &str) -> OpsResult<String> {
        self.store
            .list_as::<Node>()
            .await?
            .iter()
            .find(|n| n.is_ready())
            .map(|n| n.metadata.name.clone())
            .ok_or_else(|| OpsError::precondition(volume, "no ready node to attach to"))
    }

    pub async fn attach_volume(&self, name: &str, req: AttachVolume) -> OpsResult<Volume> {
        let current = self.get_volume(name).await?;
        crate::backup::refuse_while_restoring(&current)?;
        crate::standby::refuse_standby(&current, "be attached")?;
        let node = match req.node.or(current.spec.node_id.clone()) {
            Some(n) => {
                check_name("node", &n)?;
                if self.store.get_as::<Node>(&n).await?.is_none() {
                    return Err(OpsError::invalid(format!("node {n:?} does not exist")));
                }
                n
            }
            None => self.pick_node(name).await?,
        };
        let maintenance = req.maintenance;
        let frontend = req.frontend;
        let v = self
            .edit_volume(name, |v| {
                if v.metadata.is_deleting() {
                    return Err(OpsError::precondition(
                        name,
                        format!("volume {name:?} is being deleted"),
                    ));
                }
                if let Some(p) = Population::of(v)
                    && !p.is_done()
                {
                    return Err(OpsError::aborted(format!(
                        "volume {name:?} is being filled from its data source ({p}); attach it when that is done"
                    )));
                }
                if let (Some(f), Some(other)) = (frontend, v.spec.node_id.as_deref())
                    && f != v.spec.frontend
                {
                    return Err(OpsError::precondition(
                        name,
                        format!(
                            "volume {name:?} is attached to {other} with its {} frontend; detach it first to attach it with {f}",
                            v.spec.frontend
                        ),
                    ));
                }
                match v.spec.node_id.as_deref() {
                    Some(other) if other != node => Err(OpsError::precondition(
                        name,
                        format!("volume {name:?} is already attached to {other}; detach it first"),
                    )),
                    Some(_) if v.spec.disable_frontend != maintenance => {
                        Err(match v.metadata.annotations.get(MAINTENANCE_ANNOTATION) {
                            Some(why) => OpsError::precondition(
                                name,
                                format!(
                                    "volume {name:?} is held without its frontend ({why}); try again when that is done"
                                ),
                            ),
                            None => OpsError::precondition(
                                name,
                                format!(
                                    "volume {name:?} is attached to {node} {}; detach it first to attach it {}",
                                    with_frontend(v.spec.disable_frontend),
                                    with_frontend(maintenance)
                                ),
                            ),
                        })
                    }
                    _ => {
                        v.spec.node_id = Some(node.clone());
                        v.spec.disable_frontend = maintenance;
                        if let Some(f) = frontend {
                            v.spec.frontend = f;
                        }
                        Ok(())
                    }
                }
            })
            .await?;
        tracing::info!(volume = %name, node = %node, maintenance, frontend = %v.spec.frontend, "attach requested");
        Ok(v)
    }

    pub async fn detach_volume(&self, name: &str) -> OpsResult<Volume> {
        let v = self
            .edit_volume(name, |v| {
                v.spec.node_id = None;
                v.spec.disable_frontend = false;
                v.metadata.annotations.remove(MAINTENANCE_ANNOTATION);
                Ok(())
            })
            .await?;
        tracing::info!(volume = %name, "detach requested");
        Ok(v)
    }

    /// The running engine of a volume, if it has one.
    pub(crate) async fn running_engine(&self, volume: &str) -> OpsResult<Option<Engine>> {
        Ok(self.store.list_as::<Engine>().await?.into_iter().find(|e| {
            e.spec.volume == volume
                && !e.metadata.is_deleting()
                && e.status.state == EngineState::Running
                && e.status.control_address.is_some()
        }))
    }

    /// Grow an attached volume to `req.size`; see the module docs. Repeating an expansion
    /// that the engine already did (the manager stopped before recording it) records it.
    pub async fn expand_volume(&self, name: &str, req: ExpandVolume) -> OpsResult<Volume> {
        let size = req
            .size
            .resolve()
            .map_err(|e| OpsError::invalid(e.to_string()))?;
        check_size(size)?;
        let v = self.get_volume(name).await?;
        if v.metadata.is_deleting() {
            return Err(OpsError::precondition(
                name,
                format!("volume {name:?} is being deleted"),
            ));
        }
        if size < v.spec.size {
            return Err(OpsError::invalid(format!(
                "cannot shrink volume {name:?} from {} to {size}",
                v.spec.size
            )));
        }
        if v.spec.node_id.is_none() {
            // Offline: an engine started without a frontend grows the replicas.
            self.with_engine(name, "expand", |control| async move {
                engine_rpc::expand(&control, size.bytes())
                    .await
                    .map_err(|source| OpsError::Engine {
                        volume: name.to_string(),
                        source,
                    })
            })
            .await?;
            tracing::info!(volume = %name, size = %size, "detached volume expanded by an engine started for it");
            return self
                .edit_volume(name, |v| {
                    v.spec.size = v.spec.size.max(size);
                    Ok(())
                })
                .await;
        }
        let Some(engine) = self.running_engine(name).await? else {
            return Err(OpsError::aborted(format!(
                "volume {name:?} is attaching: it is expanded by its engine, which is not running yet; try again"
            )));
        };
        if engine
            .status
            .rebuild
            .as_ref()
            .is_some_and(|r| r.state == RebuildState::Running)
        {
            return Err(OpsError::precondition(
                name,
                format!("volume {name:?} has a replica rebuilding; expand it when that is done"),
            ));
        }
        if engine.status.size != Some(size) {
            let control = engine.status.control_address.clone().unwrap_or_default();
            engine_rpc::expand(&control, size.bytes())
                .await
                .map_err(|source| OpsError::Engine {
                    volume: name.to_string(),
                    source,
                })?;
            tracing::info!(volume = %name, size = %size, "volume expanded by its engine");
        }
        // The engine and replica objects follow the engine's size (the volume controller).
        self.edit_volume(name, |v| {
            v.spec.size = v.spec.size.max(size);
            Ok(())
        })
        .await
    }

    /// The volume now, and every change to it until it is deleted. A watch the store can
    /// no longer resume starts over from a fresh read, reported as `Added`.
    pub async fn watch_volume(
        &self,
        name: &str,
    ) -> OpsResult<(Volume, BoxStream<'static, OpsResult<VolumeChange>>)> {
        let volume = self.get_volume(name).await?;
        struct State {
            store: std::sync::Arc<dyn Store>,
            name: String,
            since: ResourceVersion,
            stream: Option<WatchStream>,
            done: bool,
        }
        let state = State {
            store: self.store.clone(),
            name: name.to_string(),
            since: volume.metadata.resource_version.clone(),
            stream: None,
            done: false,
        };
        let changes = stream::unfold(state, |mut st| async move {
            loop {
                if st.done {
                    return None;
                }
                if st.stream.is_none() {
                    match st.store.watch(Kind::Volume, &st.since).await {
                        Ok(s) => st.stream = Some(s),
                        Err(StoreError::Expired { .. }) => match restart(&mut st).await {
                            Ok(Some(change)) => return Some((Ok(change), st)),
                            Ok(None) => continue,
                            Err(e) => {
                                st.done = true;
                                return Some((Err(e), st));
                            }
                        },
                        Err(e) => {
                            st.done = true;
                            return Some((Err(e.into()), st));
                        }
                    }
                }
                let next = match st.stream.as_mut() {
                    Some(s) => s.next().await,
                    None => continue,
                };
                match next {
                    Some(Ok(ev)) => {
                        st.since = ev.resource_version();
                        let Some(obj) = ev.object() else { continue };
                        if zebu_types::store::object_name(obj) != st.name {
                            continue;
                        }
                        let decoded = from_value::<Volume>(obj.clone()).map_err(OpsError::from);
                        let change = match (ev, decoded) {
                            (_, Err(e)) => Err(e),
                            (WatchEvent::Added(_), Ok(v)) => Ok(VolumeChange::Added(v)),
                            (WatchEvent::Deleted(_), Ok(v)) => {
                                st.done = true;
                                Ok(VolumeChange::Deleted(v))
                            }
                            (_, Ok(v)) => Ok(VolumeChange::Modified(v)),
                        };
                        return Some((change, st));
                    }
                    Some(Err(StoreError::Expired { .. })) => {
                        st.stream = None;
                        match restart(&mut st).await {
                            Ok(Some(change)) => return Some((Ok(change), st)),
                            Ok(None) => continue,
                            Err(e) => {
                                st.done = true;
                                return Some((Err(e), st));
                            }
                        }
                    }
                    Some(Err(e)) => {
                        st.done = true;
                        return Some((Err(e.into()), st));
                    }
                    // The watch ended: resume from the last version seen.
                    None => st.stream = None,
                }
            }
        });

        /// After an expiry: list again, report the volume as it is now (or gone), and go on
        /// from the list's version.
        async fn restart(st: &mut State) -> OpsResult<Option<VolumeChange>> {
            let list = st.store.list(Kind::Volume, &ListParams::all()).await?;
            st.since = list.resource_version;
            let now = list
                .items
                .into_iter()
                .find(|o| zebu_types::store::object_name(o) == st.name);
            match now {
                Some(o) => Ok(Some(VolumeChange::Added(from_value(o)?))),
                None => {
                    st.done = true;
                    let mut gone = Volume::new(
                        st.name.clone(),
                        VolumeSpec {
                            size: ByteSize(0),
                            number_of_replicas: 0,
                            frontend: Default::default(),
                            node_selector: vec![],
                            disk_selector: vec![],
                            data_locality: Default::default(),
                            stale_replica_timeout: 0,
                            node_id: None,
                            disable_frontend: false,
                        },
                    );
                    gone.metadata.resource_version = st.since.clone();
                    Ok(Some(VolumeChange::Deleted(gone)))
                }
            }
        }
        Ok((volume, changes.boxed()))
    }
}

/// The snapshot of a source volume taken for its clone `name`: a label whatever `name` is
/// (a volume name is at most 63 characters), and the same on every retry.
fn clone_snapshot_name(name: &str) -> String {
    // FNV-1a: stable across processes and versions, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("clone-{h:016x}")
}

fn with_frontend(disabled: bool) -> &'static str {
    if disabled {
        "without its frontend"
    } else {
        "with its frontend"
    }
}

/// A new volume uuid: 16 random bytes in the 8-4-4-4-12 form of a version-4 uuid.
pub(crate) fn new_volume_uuid() -> String {
    let mut b = [0u8; 16];
    b.copy_from_slice(&zebu_proto::auth::nonce()[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}
