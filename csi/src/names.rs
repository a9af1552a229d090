//! CSI names and ids, and the Zebu names behind them.
//!
//! A CSI volume name is any string the CO picks (`pvc-<uuid>`, or csi-sanity's
//! `sanity-Node-Stage-Volume-<hex>-<hex>`: upper case, long). A Zebu volume name is a DNS-1123
//! label of at most 63 characters. [`volume_name`] maps one to the other:
//!
//! - a name that is already a valid label is kept as it is (`pvc-…` stays readable);
//! - anything else is lowered, every character outside `a-z0-9-` becomes `-`, the result is
//!   cut to 46 characters and followed by `-` and 16 hex digits of a hash of the original
//!   name, so two names that differ only in what was cut or changed stay apart, and the
//!   same name maps to the same volume on every retry (the volume id *is* the volume name).
//!
//! The CSI name is also recorded on the volume ([`CSI_NAME_ANNOTATION`]): a retry checks it,
//! so a hash collision would be reported, never silently merged.
//!
//! Snapshots are named the same way inside their volume; a snapshot id is
//! `<volume>/<snapshot>` ([`SnapshotId`]). A snapshot that is a backup (VolumeSnapshotClass
//! `type: backup`) is named the same way too, as a Backup; its id is `backup:<backup>`
//! ([`SnapshotRef::Backup`]). A `:` is in no volume or snapshot name, so the two kinds of id
//! never overlap, and a backup's id does not depend on its source volume (a backup outlives
//! it). `backup:NAME` also names a backup the CSI plugin did not make (`zebu backup create`,
//! a recurring job, one found in the target), so a pre-provisioned VolumeSnapshotContent can
//! bring one in.

use std::fmt;

/// On a Volume (and a Snapshot record) created through CSI: the CSI name it was created for.
pub const CSI_NAME_ANNOTATION: &str = "csi.zebu.io/name";

/// The longest kept prefix when a name must be hashed: 46 + `-` + 16 hex = 63.
const KEPT: usize = 46;

/// FNV-1a over the bytes: stable across processes, builds and versions.
fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn is_label(s: &str) -> bool {
    zebu_types::validate_label(s).is_ok()
}

/// The Zebu name (a DNS-1123 label) for a CSI name; see the module docs.
pub fn label_for(csi_name: &str) -> String {
    if is_label(csi_name) {
        return csi_name.to_string();
    }
    let mut base: String = csi_name
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .collect();
    base.truncate(KEPT);
    let base = base.trim_matches('-');
    let hash = fnv1a(csi_name);
    if base.is_empty() {
        format!("v-{hash:016x}")
    } else {
        format!("{base}-{hash:016x}")
    }
}

/// The volume for a CSI volume name.
pub fn volume_name(csi_name: &str) -> String {
    label_for(csi_name)
}

/// A CSI volume id names a Zebu volume only when it is a valid volume name; anything else
/// names no volume (NotFound), and is never sent on to the manager.
pub fn volume_of_id(id: &str) -> Option<&str> {
    is_label(id).then_some(id)
}

/// `<volume>/<snapshot>`: a snapshot of one volume.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SnapshotId {
    pub volume: String,
    pub snapshot: String,
}

impl SnapshotId {
    /// `None` for an id this plugin never gave out (it names no snapshot).
    pub fn parse(id: &str) -> Option<SnapshotId> {
        let (volume, snapshot) = id.split_once('/')?;
        (is_label(volume) && is_label(snapshot)).then(|| SnapshotId {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        })
    }
}

/// The prefix of the snapshot id of a backup.
pub const BACKUP_ID_PREFIX: &str = "backup:";

/// What a CSI snapshot id names: a snapshot inside a volume, or a backup in the target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotRef {
    Local(SnapshotId),
    Backup(String),
}

impl SnapshotRef {
    /// `None` for an id this plugin never gave out (it names no snapshot).
    pub fn parse(id: &str) -> Option<SnapshotRef> {
        match id.strip_prefix(BACKUP_ID_PREFIX) {
            Some(b) => zebu_types::validate_object_name(b)
                .is_ok()
                .then(|| SnapshotRef::Backup(b.to_string())),
            None => SnapshotId::parse(id).map(SnapshotRef::Local),
        }
    }
}

/// The snapshot id of backup `name`.
pub fn backup_snapshot_id(name: &str) -> String {
    format!("{BACKUP_ID_PREFIX}{name}")
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.volume, self.snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_names_are_kept_and_others_map_to_stable_labels() {
        assert_eq!(volume_name("pvc-0a1b2c3d"), "pvc-0a1b2c3d");
        let long = format!("sanity-Node-Stage-Volume-{}", "ABCDEF0123".repeat(20));
        let a = volume_name(&long);
        assert!(is_label(&a), "{a}");
        assert_eq!(a.len(), 63);
        assert_eq!(
            volume_name(&long),
            a,
            "the same name maps to the same volume"
        );
        assert!(a.starts_with("sanity-node-stage-volume-abcdef"), "{a}");
        // Names that differ only beyond the kept prefix, or only in case, stay apart.
        let b = volume_name(&format!("{long}x"));
        assert_ne!(a, b);
        assert_ne!(volume_name("Data"), volume_name("DATA"));
        assert!(is_label(&volume_name("___")), "{}", volume_name("___"));
        assert!(is_label(&volume_name("-x-")));
        assert!(is_label(&volume_name("a.b/c")));
    }

    #[test]
    fn ids_that_name_nothing_are_refused_before_any_lookup() {
        assert_eq!(volume_of_id("pvc-1"), Some("pvc-1"));
        assert_eq!(volume_of_id("fake-vol-id/../x"), None);
        assert_eq!(volume_of_id(""), None);
        let s = SnapshotId::parse("vol-a/snap-b").expect("valid");
        assert_eq!(s.to_string(), "vol-a/snap-b");
        assert_eq!(SnapshotId::parse("no-slash"), None);
        assert_eq!(SnapshotId::parse("a/b/c"), None);
        assert_eq!(SnapshotId::parse("A/b"), None);
        assert_eq!(
            SnapshotRef::parse("backup:snapshot-1a2b"),
            Some(SnapshotRef::Backup("snapshot-1a2b".into()))
        );
        assert_eq!(
            SnapshotRef::parse("vol-a/snap-b"),
            Some(SnapshotRef::Local(s.clone()))
        );
        assert_eq!(backup_snapshot_id("b1"), "backup:b1");
        for bad in [
            "backup:",
            "backup:A",
            "backup:a/b",
            "backup:../x",
            "Backup:b1",
        ] {
            assert_eq!(SnapshotRef::parse(bad), None, "{bad}");
        }
    }
}
