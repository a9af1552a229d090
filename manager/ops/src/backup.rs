//! Backup operations: the backup target, backups of volumes, their deletion and checking,
//! and volumes restored from them (DESIGN §6).
//!
//! The operations only check and record; the backup controller (`zebu-controllers`'
//! `backup` module) carries them out with `zebu-backup-run` processes:
//!
//! - **Target**: `set_backup_target` opens the target (real requests, bounded by
//!   [`TARGET_CHECK_TIMEOUT`]) before recording it, so a malformed URL, a missing bucket,
//!   refused credentials or an unreachable endpoint is one clear error at once, not a
//!   target that fails later. One target, [`DEFAULT_BACKUP_TARGET`].
//! - **Create**: a Backup object (state `pending`, held by [`BACKUP_FINALIZER`]). Without a
//!   snapshot named, one is taken now through the volume's engine, named after the backup,
//!   so the backup is of the volume as it was when asked for while I/O goes on.
//! - **Delete**: marks the Backup deleting; the controller deletes its manifest from the
//!   target (GC later takes the data no backup references), then the finalizer goes.
//! - **Restore**: a new volume created with [`FROM_BACKUP_ANNOTATION`]; it may not be
//!   attached until the controller has written the backup into its replicas.
//! - **Verify**: reads every chunk of the backup from the target here, checking each hash.
//! - **GC**: [`Ops::backup_gc`] runs one GC pass over every family now, here (the store's
//!   per-family lease keeps two GCs from working at once wherever they run); the backup
//!   controller runs the same [`gc_target`] every `gcInterval`, as a cluster singleton.

use std::collections::BTreeMap;
use std::time::Duration;

use zebu_backup::job::TargetRef;
use zebu_backupstore::{BackupError, BackupName, BackupStore, FamilyId, GcOptions, StoreOptions};
use zebu_types::Store;
use zebu_types::names::{BACKUP_FAMILY_ANNOTATION, BACKUP_FINALIZER, FROM_BACKUP_ANNOTATION};
use zebu_types::requests::CreateVolume;
use zebu_types::requests::backup::{
    CreateBackup, GcReportLine, RestoreBackup, SetBackupTarget, VerifyReport,
};
use zebu_types::resources::{
    Backup, BackupSpec, BackupState, BackupTarget, BackupTargetSpec, DEFAULT_BACKUP_TARGET,
    RestoreState, Volume,
};
use zebu_types::size::ByteSize;
use zebu_types::store::{SecretLookup, StoreError, TypedStore};
use zebu_types::{Kind, validate_label};

use crate::volume::check_name;
use crate::{Ops, OpsError, OpsResult};

/// How long checking a target may take before `set_backup_target` gives up.
pub const TARGET_CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// The deduplication family of a volume's backups.
pub fn family_of(v: &Volume) -> String {
    v.metadata
        .annotations
        .get(BACKUP_FAMILY_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| v.metadata.name.clone())
}

/// What a job process needs to reach a target: the URL and, on one host, the credentials
/// file the target names (a Kubernetes Secret is resolved into such a file by the manager).
pub fn target_ref(t: &BackupTargetSpec) -> TargetRef {
    TargetRef {
        url: t.url.clone(),
        credentials: t.credential_secret.as_ref().map(Into::into),
    }
}

/// The checked `AWS_*` pairs of the credential Secret a target names, on a store that
/// keeps Secrets (a cluster); `None` where it keeps none (one host: the name is a file's
/// path) or the target names no credentials. Every failure is one line naming the Secret
/// and the namespace, never a value.
pub async fn secret_credentials(
    store: &dyn Store,
    t: &BackupTargetSpec,
) -> Result<Option<Vec<(String, String)>>, String> {
    let Some(name) = t.credential_secret.as_deref() else {
        return Ok(None);
    };
    match store.secret(name).await {
        Ok(SecretLookup::NotServed) => Ok(None),
        Ok(SecretLookup::Missing) => Err(format!(
            "the backup target's credential Secret {name:?} does not exist in namespace {}",
            store.namespace()
        )),
        Ok(SecretLookup::Found(data)) => zebu_backup::target::checked_secret_pairs(name, &data)
            .map(Some)
            .map_err(|e| e.to_string()),
        Err(e) => Err(format!(
            "the backup target's credential Secret {name:?}: {}",
            error_chain(&e)
        )),
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = s.source();
    }
    parts.join(": ")
}

/// Opens the target `t` describes, its credentials from the Secret it names where `store`
/// keeps Secrets (see [`secret_credentials`]), else as [`target_ref`] says.
pub async fn open_target_of(
    store: &dyn Store,
    t: &BackupTargetSpec,
) -> Result<BackupStore, String> {
    match secret_credentials(store, t).await? {
        Some(pairs) => {
            let cfg = zebu_backupstore::TargetConfig::with_settings(
                t.url.clone(),
                zebu_backup::target::settings_from_pairs(&pairs),
            );
            open_config(&t.url, cfg).await
        }
        None => open_target(&target_ref(t)).await,
    }
}

/// The reference a job process (`zebu-backup-run`) opens `t` with: where `store` keeps
/// Secrets, the Secret's pairs are written to `dir/<secret>.env` (mode 0600, rewritten each
/// time, so a changed Secret counts from the next job on) and the reference names that
/// file; else [`target_ref`].
pub async fn job_target_ref(
    store: &dyn Store,
    t: &BackupTargetSpec,
    dir: &std::path::Path,
) -> Result<TargetRef, String> {
    let (Some(pairs), Some(name)) = (
        secret_credentials(store, t).await?,
        t.credential_secret.as_deref(),
    ) else {
        return Ok(target_ref(t));
    };
    // A Secret's name is a DNS subdomain: no '/' and no "..", so it stays in `dir`.
    if name.contains('/') || name.starts_with('.') {
        return Err(format!(
            "credential Secret name {name:?} is not a valid name"
        ));
    }
    let path = dir.join(format!("{name}.env"));
    zebu_backup::target::write_credentials_file(&path, &pairs)
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(TargetRef {
        url: t.url.clone(),
        credentials: Some(path),
    })
}

/// Opens a target, every failure one line; used by the operations and the controller.
pub async fn open_target(t: &TargetRef) -> Result<BackupStore, String> {
    let cfg = zebu_backup::target::config(t).map_err(|e| e.to_string())?;
    open_config(&t.url, cfg).await
}

async fn open_config(
    url: &str,
    cfg: zebu_backupstore::TargetConfig,
) -> Result<BackupStore, String> {
    match tokio::time::timeout(
        TARGET_CHECK_TIMEOUT,
        BackupStore::open(&cfg, StoreOptions::default()),
    )
    .await
    {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "backup target {url}: no answer within {} s",
            TARGET_CHECK_TIMEOUT.as_secs()
        )),
    }
}

/// One GC pass over every family of the target, with the target's margin. Safe beside
/// running backups and beside another GC (the store's per-family lease makes a second one
/// answer `Busy`), so it may run wherever it is asked for.
pub async fn gc_target(store: &BackupStore, t: &BackupTargetSpec) -> GcReportLine {
    let opts = GcOptions {
        margin: Duration::from_secs(t.gc_margin),
        ..GcOptions::default()
    };
    let done = |summary: String, ok: bool| GcReportLine {
        at: zebu_types::time::now_rfc3339(),
        summary,
        ok,
    };
    let families = match store.families().await {
        Ok(f) => f,
        Err(e) => return done(format!("cannot list families: {e}"), false),
    };
    let mut lines = Vec::new();
    let mut ok = true;
    for f in families {
        match store.gc(&f, opts).await {
            Ok(o) => lines.push(format!("{}: {o:?}", f.as_str())),
            Err(e) => {
                ok = false;
                lines.push(format!("{}: {e}", f.as_str()));
            }
        }
    }
    if lines.is_empty() {
        lines.push("no families".into());
    }
    tracing::info!(ok, "backup GC: {}", lines.join("; "));
    done(lines.join("; "), ok)
}

/// Refuses to attach a volume whose restore has not finished (its replicas do not hold the
/// backup yet, and a client's writes would be overwritten by it).
pub(crate) fn refuse_while_restoring(v: &Volume) -> OpsResult<()> {
    let Some(backup) = v.metadata.annotations.get(FROM_BACKUP_ANNOTATION) else {
        return Ok(());
    };
    let state = v.status.restore.as_ref().map(|r| r.state);
    if state == Some(RestoreState::Completed) {
        return Ok(());
    }
    let name = &v.metadata.name;
    Err(OpsError::precondition(
        name,
        match (state, v.status.restore.as_ref()) {
            (Some(RestoreState::Error), Some(r)) => {
                format!(
                    "volume {name:?}: the restore of backup {backup} failed: {}",
                    r.error
                )
            }
            (_, Some(r)) => format!(
                "volume {name:?} is being restored from backup {backup} ({}%); attach it when that is done",
                r.progress
            ),
            _ => format!(
                "volume {name:?} is being restored from backup {backup}; attach it when that is done"
            ),
        },
    ))
}

/// `VOLUME-YYYYMMDD-HHMMSS-XXXX` (the volume's name cut so the whole is a DNS label).
fn default_backup_name(volume: &str) -> String {
    let t = zebu_types::time::now_rfc3339().replace([':', '-'], "");
    let t = t.trim_end_matches('Z').replace('T', "-").to_lowercase();
    let t = t.split('.').next().unwrap_or_default().to_string();
    let suffix = format!("{t}-{:04x}", rand::random::<u16>());
    let room = 63 - suffix.len() - 1;
    let head: String = volume.chars().take(room).collect();
    format!("{}-{suffix}", head.trim_end_matches('-'))
}

fn target_err(message: String) -> OpsError {
    OpsError::invalid(message)
}

impl Ops {
    /// The backup target, if one is set.
    pub async fn get_backup_target(&self) -> OpsResult<BackupTarget> {
        self.store
            .get_as::<BackupTarget>(DEFAULT_BACKUP_TARGET)
            .await?
            .ok_or_else(|| {
                OpsError::precondition(
                    "",
                    "no backup target is set (zebu backup target set URL)".to_string(),
                )
            })
    }

    /// Checks the target with real requests, then records it.
    pub async fn set_backup_target(&self, req: SetBackupTarget) -> OpsResult<BackupTarget> {
        let url = req.url.trim().to_string();
        if url.is_empty() {
            return Err(OpsError::invalid("the backup target URL is empty"));
        }
        let mut spec = BackupTargetSpec::new(url);
        spec.credential_secret = req.credential_secret.filter(|s| !s.is_empty());
        if let Some(p) = req.poll_interval {
            if p == 0 {
                return Err(OpsError::invalid("pollInterval must be at least 1 s"));
            }
            spec.poll_interval = p;
        }
        if let Some(g) = req.gc_interval {
            spec.gc_interval = g;
        }
        if let Some(m) = req.gc_margin {
            spec.gc_margin = m;
        }
        if let Some(t) = req.session_ttl {
            if t < 2 {
                return Err(OpsError::invalid("sessionTtl must be at least 2 s"));
            }
            spec.session_ttl = t;
        }
        open_target_of(self.store.as_ref(), &spec)
            .await
            .map_err(target_err)?;
        for _ in 0..10 {
            let result = match self
                .store
                .get_as::<BackupTarget>(DEFAULT_BACKUP_TARGET)
                .await?
            {
                Some(mut t) => {
                    t.spec = spec.clone();
                    self.store.update_as(&t).await
                }
                None => {
                    self.store
                        .create_as(&BackupTarget::new(DEFAULT_BACKUP_TARGET, spec.clone()))
                        .await
                }
            };
            match result {
                Err(StoreError::Conflict { .. }) | Err(StoreError::AlreadyExists { .. }) => {
                    continue;
                }
                other => {
                    let t = other?;
                    tracing::info!(url = %t.spec.url, "backup target set");
                    return Ok(t);
                }
            }
        }
        Err(OpsError::Aborted {
            message: "the backup target keeps changing; try again".into(),
        })
    }

    pub async fn list_backups(&self, volume: Option<&str>) -> OpsResult<Vec<Backup>> {
        let mut all = self.store.list_as::<Backup>().await?;
        if let Some(v) = volume {
            all.retain(|b| b.spec.volume == v);
        }
        all.sort_by(|a, b| {
            (&a.metadata.creation_timestamp, &a.metadata.name)
                .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
        });
        Ok(all)
    }

    pub async fn get_backup(&self, name: &str) -> OpsResult<Backup> {
        check_name("backup", name)?;
        self.store
            .get_as::<Backup>(name)
            .await?
            .ok_or_else(|| OpsError::not_found(Kind::Backup, name))
    }

    /// Records a backup of `req.volume` (taking a snapshot for it if none is named).
    pub async fn create_backup(&self, req: CreateBackup) -> OpsResult<Backup> {
        let v = self.get_volume(&req.volume).await?;
        if v.metadata.is_deleting() {
            return Err(OpsError::precondition(
                &req.volume,
                format!("volume {:?} is being deleted", req.volume),
            ));
        }
        let target = self.get_backup_target().await?;
        let name = match req.name {
            Some(n) => n,
            None => default_backup_name(&req.volume),
        };
        validate_label(&name).map_err(|e| OpsError::invalid(format!("backup {e}")))?;
        BackupName::new(&name).map_err(|e| OpsError::invalid(e.to_string()))?;
        for (k, val) in &req.labels {
            if k.is_empty() || k.len() > 63 || val.len() > 63 {
                return Err(OpsError::invalid(format!(
                    "backup label {k:?}={val:?} is too long or empty"
                )));
            }
        }
        if self.store.get_as::<Backup>(&name).await?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: Kind::Backup,
                name,
            }
            .into());
        }
        let snapshot = match req.snapshot {
            Some(s) => {
                check_name("snapshot", &s)?;
                s
            }
            None => {
                self.create_snapshot(
                    &req.volume,
                    zebu_types::requests::CreateSnapshot {
                        name: Some(name.clone()),
                    },
                )
                .await?;
                name.clone()
            }
        };
        let mut b = Backup::new(
            name.clone(),
            BackupSpec {
                volume: req.volume.clone(),
                snapshot: snapshot.clone(),
                backup_target: target.metadata.name.clone(),
                labels: req.labels,
            },
        );
        b.metadata.finalizers.push(BACKUP_FINALIZER.into());
        b.metadata
            .annotations
            .insert(BACKUP_FAMILY_ANNOTATION.into(), family_of(&v));
        let created = self.store.create_as(&b).await?;
        tracing::info!(backup = %name, volume = %req.volume, snapshot = %snapshot, "backup requested");
        Ok(created)
    }

    /// Deletes a backup: `Some` while its finalizer holds it (its manifest is being
    /// deleted from the target), `None` once it is gone.
    pub async fn delete_backup(&self, name: &str) -> OpsResult<Option<Backup>> {
        check_name("backup", name)?;
        match self.store.delete(Kind::Backup, name).await {
            Ok(held) => {
                tracing::info!(backup = %name, "backup delete requested");
                Ok(held.map(zebu_types::store::from_value).transpose()?)
            }
            Err(StoreError::NotFound { .. }) => Err(OpsError::not_found(Kind::Backup, name)),
            Err(e) => Err(e.into()),
        }
    }

    /// A completed backup, its family and the target it is in, opened.
    async fn completed(&self, name: &str) -> OpsResult<(Backup, BackupStore, FamilyId)> {
        let b = self.get_backup(name).await?;
        if b.status.state != BackupState::Completed {
            return Err(OpsError::precondition(
                &b.spec.volume,
                format!("backup {name:?} is {}, not completed", b.status.state),
            ));
        }
        let target = self.get_backup_target().await?;
        let store = open_target_of(self.store.as_ref(), &target.spec)
            .await
            .map_err(|e| OpsError::precondition(&b.spec.volume, e))?;
        let family = b
            .metadata
            .annotations
            .get(BACKUP_FAMILY_ANNOTATION)
            .cloned()
            .unwrap_or_else(|| b.spec.volume.clone());
        let family = FamilyId::new(family).map_err(|e| OpsError::invalid(e.to_string()))?;
        Ok((b, store, family))
    }

    /// Reads every chunk of a backup from the target and checks it.
    pub async fn verify_backup(&self, name: &str) -> OpsResult<VerifyReport> {
        let (_, store, family) = self.completed(name).await?;
        let bname = BackupName::new(name).map_err(|e| OpsError::invalid(e.to_string()))?;
        let mut report = VerifyReport {
            backup: name.to_string(),
            ..Default::default()
        };
        // On a thread and runtime of its own: the store's verify future is not `Send` for
        // every lifetime a handler's (or a spawned task's) future must be.
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let checked = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(async {
                    match store.get_backup(&family, &bname).await {
                        Ok(m) => store.verify(&m, Default::default()).await,
                        Err(e) => Err(e),
                    }
                }),
                Err(e) => Err(BackupError::InvalidInput(format!(
                    "no runtime for verify: {e}"
                ))),
            };
            let _ = tx.send(checked);
        });
        let checked = rx.await.map_err(|_| OpsError::Aborted {
            message: format!("verify of backup {name:?} stopped"),
        })?;
        match checked {
            Ok(st) => {
                report.ok = true;
                report.chunks = st.chunks;
                report.bytes = st.bytes;
            }
            Err(e) => report.error = e.to_string(),
        }
        tracing::info!(backup = name, ok = report.ok, error = %report.error, "backup verified");
        Ok(report)
    }

    /// Runs GC over the target now (`wait`), or starts it and returns at once; the outcome
    /// is recorded in the target's status (`lastGc`, `lastGcAt`) either way.
    pub async fn backup_gc(&self, wait: bool) -> OpsResult<GcReportLine> {
        let target = self.get_backup_target().await?;
        let store = open_target_of(self.store.as_ref(), &target.spec)
            .await
            .map_err(|e| OpsError::precondition("", e))?;
        let spec = target.spec.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // On a thread and runtime of its own, as verify: the store's GC future is not
        // `Send` for every lifetime a handler's future must be.
        std::thread::spawn(move || {
            let line = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(gc_target(&store, &spec)),
                Err(e) => GcReportLine {
                    at: zebu_types::time::now_rfc3339(),
                    summary: format!("no runtime for GC: {e}"),
                    ok: false,
                },
            };
            let _ = tx.send(line);
        });
        let ops = self.clone();
        // The outcome is recorded whether or not the caller waits for it.
        let recorder = tokio::spawn(async move {
            let line = rx.await.map_err(|_| OpsError::Aborted {
                message: "the GC stopped before it reported".into(),
            })?;
            if let Err(e) = ops.record_gc(&line).await {
                tracing::warn!("cannot record the GC's outcome: {e}");
            }
            Ok::<_, OpsError>(line)
        });
        if !wait {
            return Ok(GcReportLine {
                at: zebu_types::time::now_rfc3339(),
                summary: "started".into(),
                ok: true,
            });
        }
        recorder.await.map_err(|e| OpsError::Aborted {
            message: format!("the GC's task failed: {e}"),
        })?
    }

    /// Records a GC's outcome in the target's status.
    async fn record_gc(&self, line: &GcReportLine) -> OpsResult<()> {
        for _ in 0..10 {
            let Some(mut t) = self
                .store
                .get_as::<BackupTarget>(DEFAULT_BACKUP_TARGET)
                .await?
            else {
                return Ok(());
            };
            t.status.last_gc = line.summary.clone();
            t.status.last_gc_at = Some(line.at.clone());
            match self.store.update_status_as(&t).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// A new volume that the backup controller fills from backup `name`.
    pub async fn restore_backup(&self, name: &str, req: RestoreBackup) -> OpsResult<Volume> {
        let (b, store, family) = self.completed(name).await?;
        let bname = BackupName::new(name).map_err(|e| OpsError::invalid(e.to_string()))?;
        let m = store
            .get_backup(&family, &bname)
            .await
            .map_err(|e| match e {
                BackupError::BackupNotFound { .. } => OpsError::precondition(
                    &b.spec.volume,
                    format!("backup {name:?} is not in the target any more"),
                ),
                e => OpsError::precondition(&b.spec.volume, e.to_string()),
            })?;
        let size = match &req.size {
            Some(s) => s.resolve().map_err(|e| OpsError::invalid(e.to_string()))?,
            None => ByteSize(m.volume_size),
        };
        if size.bytes() < m.volume_size {
            return Err(OpsError::invalid(format!(
                "size {size} is smaller than backup {name}'s volume ({})",
                ByteSize(m.volume_size)
            )));
        }
        let mut create = CreateVolume::new(req.volume.clone(), size);
        create.number_of_replicas = req.number_of_replicas;
        create.frontend = req.frontend;
        let annotations = BTreeMap::from([
            (FROM_BACKUP_ANNOTATION.to_string(), name.to_string()),
            (BACKUP_FAMILY_ANNOTATION.to_string(), family.to_string()),
        ]);
        let v = self.create_volume_annotated(create, annotations).await?;
        tracing::info!(volume = %req.volume, backup = name, "volume created to restore a backup");
        Ok(v)
    }
}
