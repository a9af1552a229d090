//! StorageClass parameters (CreateVolume's `parameters`), checked and resolved.
//!
//! | key | value | becomes |
//! |---|---|---|
//! | `numberOfReplicas` | 1..=20 | the Volume's `numberOfReplicas` |
//! | `staleReplicaTimeout` | whole number, the Volume's unit | its `staleReplicaTimeout` |
//! | `dataLocality` | `disabled`, `best-effort` | its `dataLocality` |
//! | `diskSelector`, `nodeSelector` | tags, comma-separated | its selectors |
//! | `fsType` | `ext4`, `xfs` | the filesystem NodeStage makes (volume context) |
//! | `mkfsParams` | extra `mkfs` arguments, space-separated | passed to mkfs (volume context) |
//! | `fromBackup` | a backup's name (`zebu backup ls`) | the volume is a restore of it (the manager's `POST /v1/backups/{name}/restore`), of the backup's size unless the request asks for more (less is OutOfRange); a backup still uploading is Aborted until it is committed |
//! | `csi.storage.k8s.io/*` | anything | ignored (the provisioner's own metadata) |
//!
//! Anything else is refused with InvalidArgument naming the key, so a typo in a
//! StorageClass fails the first PVC instead of being silently ignored. What was resolved
//! is recorded on the Volume as `csi.zebu.io/<key>` annotations and in the volume context.
//!
//! VolumeSnapshotClass parameters (CreateSnapshot's `parameters`, [`SnapshotParams`]):
//!
//! | key | value | becomes |
//! |---|---|---|
//! | `type` | `snapshot` (the default) | a snapshot inside the volume, on its replicas; id `<volume>/<snapshot>` |
//! | `type` | `backup` | a backup of the volume to the backup target (`zebu backup target set`): a new snapshot, uploaded; id `backup:<backup>`, `readyToUse` once the upload is committed. A PVC from it restores it (as `fromBackup` does) |
//! | `csi.storage.k8s.io/*` | anything | ignored (the snapshotter's own metadata) |
//!
//! Anything else is refused with InvalidArgument naming the key or the value.

use std::collections::{BTreeMap, HashMap};

use zebu_types::requests::CreateVolume;
use zebu_types::resources::DataLocality;

/// The filesystems NodeStage can make.
pub const FILESYSTEMS: &[&str] = &["ext4", "xfs"];
/// The filesystem of a mount volume when neither the capability nor the StorageClass names
/// one.
pub const DEFAULT_FS: &str = "ext4";

/// The manager refuses more (its own check); refused here first so the message names the
/// parameter.
const MAX_REPLICAS: u32 = 20;

/// Volume context keys (what NodeStage reads).
pub const CTX_FS_TYPE: &str = "fsType";
pub const CTX_MKFS_PARAMS: &str = "mkfsParams";

const KNOWN: &[&str] = &[
    "numberOfReplicas",
    "staleReplicaTimeout",
    "dataLocality",
    "diskSelector",
    "nodeSelector",
    "fsType",
    "mkfsParams",
    "fromBackup",
];

/// Parameters as CreateVolume resolved them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Params {
    pub number_of_replicas: Option<u32>,
    pub stale_replica_timeout: Option<u64>,
    pub data_locality: Option<DataLocality>,
    pub disk_selector: Vec<String>,
    pub node_selector: Vec<String>,
    pub fs_type: Option<String>,
    pub mkfs_params: Option<String>,
    /// Restore this backup into the new volume.
    pub from_backup: Option<String>,
}

/// A parameter that cannot be used, with the key it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("StorageClass parameter {key:?}: {reason}")]
pub struct ParamError {
    pub key: String,
    pub reason: String,
}

fn err(key: &str, reason: impl Into<String>) -> ParamError {
    ParamError {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn tags(key: &str, v: &str) -> Result<Vec<String>, ParamError> {
    let tags: Vec<String> = v
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    for t in &tags {
        if t.len() > 63
            || !t
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(err(
                key,
                format!("tag {t:?} is not a valid tag (at most 63 of A-Za-z0-9-_.)"),
            ));
        }
    }
    Ok(tags)
}

impl Params {
    pub fn parse(params: &HashMap<String, String>) -> Result<Params, ParamError> {
        let mut p = Params::default();
        // Sorted, so the first bad key reported is the same on every call.
        let sorted: BTreeMap<&String, &String> = params.iter().collect();
        for (key, value) in sorted {
            let v = value.trim();
            match key.as_str() {
                "numberOfReplicas" => {
                    let n: u32 = v
                        .parse()
                        .map_err(|_| err(key, format!("{v:?} is not a whole number")))?;
                    if !(1..=MAX_REPLICAS).contains(&n) {
                        return Err(err(
                            key,
                            format!("{n} is out of range 1..={}", MAX_REPLICAS),
                        ));
                    }
                    p.number_of_replicas = Some(n);
                }
                "staleReplicaTimeout" => {
                    let n: u64 = v
                        .parse()
                        .map_err(|_| err(key, format!("{v:?} is not a whole number")))?;
                    if n == 0 {
                        return Err(err(key, "must be greater than 0"));
                    }
                    p.stale_replica_timeout = Some(n);
                }
                "dataLocality" => {
                    p.data_locality = Some(match v {
                        "disabled" => DataLocality::Disabled,
                        "best-effort" => DataLocality::BestEffort,
                        _ => {
                            return Err(err(
                                key,
                                format!("{v:?} is not one of disabled, best-effort"),
                            ));
                        }
                    });
                }
                "diskSelector" => p.disk_selector = tags(key, v)?,
                "nodeSelector" => p.node_selector = tags(key, v)?,
                "fsType" => {
                    if !FILESYSTEMS.contains(&v) {
                        return Err(err(
                            key,
                            format!("{v:?} is not one of {}", FILESYSTEMS.join(", ")),
                        ));
                    }
                    p.fs_type = Some(v.to_string());
                }
                "mkfsParams" => {
                    if v.contains(['\n', '\0', ';', '|', '&', '`', '$']) {
                        return Err(err(key, "may hold only mkfs options separated by spaces"));
                    }
                    p.mkfs_params = Some(v.to_string());
                }
                "fromBackup" => {
                    zebu_types::validate_object_name(v).map_err(|e| {
                        err(
                            key,
                            format!(
                                "{v:?} is not a backup name (as `zebu backup ls` lists them): {e}"
                            ),
                        )
                    })?;
                    p.from_backup = Some(v.to_string());
                }
                k if k.starts_with("csi.storage.k8s.io/") => {}
                _ => {
                    return Err(err(
                        key,
                        format!("unknown parameter (known: {})", KNOWN.join(", ")),
                    ));
                }
            }
        }
        Ok(p)
    }

    /// Fill a create request with what was resolved.
    pub fn apply(&self, req: &mut CreateVolume) {
        req.number_of_replicas = self.number_of_replicas;
        req.stale_replica_timeout = self.stale_replica_timeout;
        req.data_locality = self.data_locality;
        req.disk_selector = self.disk_selector.clone();
        req.node_selector = self.node_selector.clone();
    }

    /// The first parameter given that a restore from a backup cannot honour (it takes the
    /// replica count only).
    pub fn not_with_from_backup(&self) -> Option<&'static str> {
        [
            ("staleReplicaTimeout", self.stale_replica_timeout.is_some()),
            ("dataLocality", self.data_locality.is_some()),
            ("diskSelector", !self.disk_selector.is_empty()),
            ("nodeSelector", !self.node_selector.is_empty()),
            ("fsType", self.fs_type.is_some()),
            ("mkfsParams", self.mkfs_params.is_some()),
        ]
        .into_iter()
        .find_map(|(k, given)| given.then_some(k))
    }

    /// What NodeStage needs, passed as the volume context.
    pub fn volume_context(&self) -> HashMap<String, String> {
        let mut ctx = HashMap::new();
        if let Some(fs) = &self.fs_type {
            ctx.insert(CTX_FS_TYPE.to_string(), fs.clone());
        }
        if let Some(m) = &self.mkfs_params {
            ctx.insert(CTX_MKFS_PARAMS.to_string(), m.clone());
        }
        ctx
    }
}

/// What a VolumeSnapshotClass's `type` asks CreateSnapshot for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SnapshotType {
    /// A snapshot inside the volume.
    #[default]
    Snapshot,
    /// A backup of the volume to the backup target.
    Backup,
}

/// VolumeSnapshotClass parameters as CreateSnapshot resolved them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotParams {
    pub r#type: SnapshotType,
}

const SNAPSHOT_KNOWN: &[&str] = &["type"];

/// A VolumeSnapshotClass parameter that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("VolumeSnapshotClass parameter {key:?}: {reason}")]
pub struct SnapshotParamError {
    pub key: String,
    pub reason: String,
}

impl SnapshotParams {
    pub fn parse(params: &HashMap<String, String>) -> Result<SnapshotParams, SnapshotParamError> {
        let mut p = SnapshotParams::default();
        let sorted: BTreeMap<&String, &String> = params.iter().collect();
        for (key, value) in sorted {
            let v = value.trim();
            let bad = |reason: String| SnapshotParamError {
                key: key.clone(),
                reason,
            };
            match key.as_str() {
                "type" => {
                    p.r#type = match v {
                        "snapshot" => SnapshotType::Snapshot,
                        "backup" => SnapshotType::Backup,
                        _ => {
                            return Err(bad(format!("{v:?} is not one of snapshot, backup")));
                        }
                    };
                }
                k if k.starts_with("csi.storage.k8s.io/") => {}
                _ => {
                    return Err(bad(format!(
                        "unknown parameter (known: {})",
                        SNAPSHOT_KNOWN.join(", ")
                    )));
                }
            }
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kv: &[(&str, &str)]) -> Result<Params, ParamError> {
        Params::parse(
            &kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn known_parameters_resolve() {
        let p = parse(&[
            ("numberOfReplicas", "2"),
            ("staleReplicaTimeout", "30"),
            ("dataLocality", "best-effort"),
            ("diskSelector", "ssd, fast"),
            ("nodeSelector", ""),
            ("fsType", "xfs"),
            ("mkfsParams", "-m 0"),
            ("csi.storage.k8s.io/pvc/name", "data"),
            ("fromBackup", "src-20261202-040000-ab12"),
        ])
        .expect("valid");
        assert_eq!(p.from_backup.as_deref(), Some("src-20261202-040000-ab12"));
        assert_eq!(p.number_of_replicas, Some(2));
        assert_eq!(p.stale_replica_timeout, Some(30));
        assert_eq!(p.data_locality, Some(DataLocality::BestEffort));
        assert_eq!(p.disk_selector, ["ssd", "fast"]);
        assert!(p.node_selector.is_empty());
        assert_eq!(p.volume_context()["fsType"], "xfs");
    }

    #[test]
    fn unknown_or_malformed_parameters_name_the_key() {
        let e = parse(&[("numberOfReplica", "3")]).expect_err("typo");
        assert_eq!(e.key, "numberOfReplica");
        assert!(e.to_string().contains("unknown parameter"), "{e}");
        for (k, v, says) in [
            ("numberOfReplicas", "three", "not a whole number"),
            ("numberOfReplicas", "0", "out of range"),
            ("dataLocality", "strict", "not one of"),
            ("fsType", "btrfs", "not one of ext4, xfs"),
            ("mkfsParams", "-m 0; reboot", "only mkfs options"),
            ("diskSelector", "a b", "not a valid tag"),
            ("fromBackup", "s3://b", "not a backup name"),
        ] {
            let e = parse(&[(k, v)]).expect_err(k);
            assert_eq!(e.key, k);
            assert!(e.to_string().contains(says), "{k}={v}: {e}");
        }
    }

    #[test]
    fn snapshot_class_parameters_choose_a_snapshot_or_a_backup() {
        let parse = |kv: &[(&str, &str)]| {
            SnapshotParams::parse(
                &kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        assert_eq!(parse(&[]).expect("none").r#type, SnapshotType::Snapshot);
        assert_eq!(
            parse(&[("type", "snapshot")]).expect("snapshot").r#type,
            SnapshotType::Snapshot
        );
        assert_eq!(
            parse(&[
                ("type", "backup"),
                ("csi.storage.k8s.io/volumesnapshot/name", "s1")
            ])
            .expect("backup")
            .r#type,
            SnapshotType::Backup
        );
        let e = parse(&[("type", "bakup")]).expect_err("typo in the value");
        assert_eq!(e.key, "type");
        assert!(
            e.to_string()
                .contains("\"bakup\" is not one of snapshot, backup"),
            "{e}"
        );
        let e = parse(&[("typ", "backup")]).expect_err("typo in the key");
        assert_eq!(e.key, "typ");
        assert!(e.to_string().contains("unknown parameter"), "{e}");
    }
}
