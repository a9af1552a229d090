//! Standby (disaster-recovery) volumes: a volume that follows the backups of a source
//! volume as they appear in the backup target, until it is activated (DESIGN §6).
//!
//! - **Create** (`create_standby`): a new volume marked with [`STANDBY_FROM_ANNOTATION`]
//!   naming the source, in the source's deduplication family (so its own backups, once
//!   activated, share the source's chunks). The source must have a completed backup: the
//!   size defaults to that backup's volume size, and a standby with nothing to follow would
//!   be an empty volume that looks protected. The source volume need not exist in this
//!   cluster: its backups may have been found in the target by the target's poll.
//! - **Follow**: the standby controller (`zebu-controllers`' `standby` module) restores the
//!   newest completed backup whole, then each newer one as an increment on top of it (only
//!   the chunks that differ), into the volume's replicas. `status.restore` says which backup
//!   the replicas hold (`restored`) and since when (`restoredAt`).
//! - **Refused while standby**: attach, and anything that would start an engine on it
//!   (snapshots, revert, offline expansion), since a writer would change what the next
//!   increment is applied to ([`refuse_standby`]).
//! - **Activate** (`activate_standby`): marks the volume with
//!   [`STANDBY_ACTIVATE_ANNOTATION`]; the controller applies the newest backup not yet
//!   applied, records `activatedAt`, then removes both annotations. From then on it is a
//!   normal volume. Activation is done when the standby annotation is gone.

use std::collections::BTreeMap;

use zebu_types::names::{
    BACKUP_FAMILY_ANNOTATION, STANDBY_ACTIVATE_ANNOTATION, STANDBY_FROM_ANNOTATION,
};
use zebu_types::requests::CreateVolume;
use zebu_types::requests::standby::CreateStandby;
use zebu_types::resources::{Backup, BackupState, Volume};
use zebu_types::size::ByteSize;
use zebu_types::store::TypedStore;

use crate::volume::check_name;
use crate::{Ops, OpsError, OpsResult};

/// The deduplication family of a backup (its volume's name unless annotated).
pub fn family_of_backup(b: &Backup) -> String {
    b.metadata
        .annotations
        .get(BACKUP_FAMILY_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| b.spec.volume.clone())
}

/// The newest completed backup of `source` (by creation, then name), the one a standby of
/// it should hold; `family` restricts it to one deduplication family (an increment can only
/// be computed within one).
pub fn newest_backup_of<'a>(
    source: &str,
    family: Option<&str>,
    backups: &'a [Backup],
) -> Option<&'a Backup> {
    backups
        .iter()
        .filter(|b| {
            b.spec.volume == source
                && b.status.state == BackupState::Completed
                && !b.metadata.is_deleting()
                && family.is_none_or(|f| family_of_backup(b) == f)
        })
        .max_by(|x, y| {
            (&x.metadata.creation_timestamp, &x.metadata.name)
                .cmp(&(&y.metadata.creation_timestamp, &y.metadata.name))
        })
}

/// The source a standby volume follows, if it is one.
pub fn standby_source(v: &Volume) -> Option<&str> {
    v.metadata
        .annotations
        .get(STANDBY_FROM_ANNOTATION)
        .map(String::as_str)
}

/// Refuses what a standby volume may not do until activated: be attached, or get an engine
/// for an operation. `what` names the refused operation.
pub(crate) fn refuse_standby(v: &Volume, what: &str) -> OpsResult<()> {
    let Some(source) = standby_source(v) else {
        return Ok(());
    };
    let name = &v.metadata.name;
    let held = v
        .status
        .restore
        .as_ref()
        .and_then(|r| r.restored.as_ref().map(|b| (b, r.restored_at.clone())));
    let holds = match held {
        Some((b, Some(at))) => format!("it holds backup {b} since {at}"),
        Some((b, None)) => format!("it holds backup {b}"),
        None => "it holds no backup yet".to_string(),
    };
    Err(OpsError::precondition(
        name,
        format!(
            "volume {name:?} is a standby of volume {source:?} ({holds}) and cannot {what}; activate it first (zebu volume activate {name})"
        ),
    ))
}

impl Ops {
    /// A new standby volume following the backups of `req.source`.
    pub async fn create_standby(&self, req: CreateStandby) -> OpsResult<Volume> {
        check_name("volume", &req.source)?;
        self.get_backup_target().await?;
        let backups = self.store.list_as::<Backup>().await?;
        let newest = newest_backup_of(&req.source, None, &backups).ok_or_else(|| {
            OpsError::precondition(
                &req.volume,
                format!(
                    "volume {:?} has no completed backup in the target to follow (zebu backup ls {})",
                    req.source, req.source
                ),
            )
        })?;
        let backup_size = newest.status.volume_size;
        let size = match &req.size {
            Some(s) => s.resolve().map_err(|e| OpsError::invalid(e.to_string()))?,
            None if backup_size.bytes() > 0 => backup_size,
            None => {
                return Err(OpsError::invalid(format!(
                    "the size of volume {:?}'s backups is not known; give the standby a size",
                    req.source
                )));
            }
        };
        if size.bytes() < backup_size.bytes() {
            return Err(OpsError::invalid(format!(
                "size {size} is smaller than volume {:?}'s newest backup ({})",
                req.source,
                ByteSize(backup_size.bytes())
            )));
        }
        if req.volume == req.source {
            return Err(OpsError::invalid(format!(
                "volume {:?} cannot be a standby of itself",
                req.volume
            )));
        }
        let mut create = CreateVolume::new(req.volume.clone(), size);
        create.number_of_replicas = req.number_of_replicas;
        create.frontend = req.frontend;
        let annotations = BTreeMap::from([
            (STANDBY_FROM_ANNOTATION.to_string(), req.source.clone()),
            (
                BACKUP_FAMILY_ANNOTATION.to_string(),
                family_of_backup(newest),
            ),
        ]);
        let v = self.create_volume_annotated(create, annotations).await?;
        tracing::info!(volume = %req.volume, source = %req.source, "standby volume created");
        Ok(v)
    }

    /// Asks for a standby volume's activation (see the module docs); the volume as it is
    /// now. Asking again, or for a volume already activated, is not an error.
    pub async fn activate_standby(&self, name: &str) -> OpsResult<Volume> {
        check_name("volume", name)?;
        let v = self.get_volume(name).await?;
        if standby_source(&v).is_none() {
            if v.status
                .restore
                .as_ref()
                .is_some_and(|r| r.activated_at.is_some())
            {
                return Ok(v);
            }
            return Err(OpsError::precondition(
                name,
                format!("volume {name:?} is not a standby volume"),
            ));
        }
        let v = self
            .edit_volume(name, |v| {
                if v.metadata.is_deleting() {
                    return Err(OpsError::precondition(
                        name,
                        format!("volume {name:?} is being deleted"),
                    ));
                }
                if standby_source(v).is_some() {
                    v.metadata
                        .annotations
                        .insert(STANDBY_ACTIVATE_ANNOTATION.to_string(), "true".to_string());
                }
                Ok(())
            })
            .await?;
        tracing::info!(volume = %name, "standby activation requested");
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use zebu_types::resources::BackupSpec;

    use super::*;

    fn backup(name: &str, volume: &str, at: &str, state: BackupState, family: &str) -> Backup {
        let mut b = Backup::new(
            name,
            BackupSpec {
                volume: volume.into(),
                snapshot: name.into(),
                backup_target: "default".into(),
                labels: Default::default(),
            },
        );
        b.metadata.creation_timestamp = Some(at.into());
        b.metadata
            .annotations
            .insert(BACKUP_FAMILY_ANNOTATION.into(), family.into());
        b.status.state = state;
        b
    }

    #[test]
    fn a_standby_follows_the_newest_completed_backup_of_its_source_and_family() {
        use BackupState::*;
        let all = vec![
            backup("b1", "src", "2026-12-02T08:00:00Z", Completed, "src"),
            backup("b2", "src", "2026-12-02T08:01:00Z", Completed, "src"),
            backup("b3", "src", "2026-12-02T08:02:00Z", InProgress, "src"),
            backup("o1", "other", "2026-12-02T08:03:00Z", Completed, "other"),
            backup("x1", "src", "2026-12-02T08:04:00Z", Completed, "elsewhere"),
        ];
        let newest = |f| newest_backup_of("src", f, &all).map(|b| b.metadata.name.clone());
        assert_eq!(newest(Some("src")).as_deref(), Some("b2"));
        assert_eq!(newest(None).as_deref(), Some("x1"));
        assert_eq!(newest_backup_of("nobody", None, &all), None);
        let mut deleting = all.clone();
        deleting[1].metadata.deletion_timestamp = Some("2026-12-02T08:05:00Z".into());
        assert_eq!(
            newest_backup_of("src", Some("src"), &deleting).map(|b| b.metadata.name.as_str()),
            Some("b1")
        );
    }
}
