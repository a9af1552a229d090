//! Volume capabilities: which access modes and types a Zebu volume supports.
//!
//! A Zebu volume is one engine on one node at a time (its iSCSI target or NBD export serves
//! that node), so every single-node mode works and no multi-node mode does. Mount volumes
//! get ext4 or xfs; block volumes are the raw device.

use zebu_proto::csi;
use zebu_proto::csi::volume_capability::AccessType;
use zebu_proto::csi::volume_capability::access_mode::Mode;

use crate::params::FILESYSTEMS;

/// `Ok` when the capability can be served, else why not.
pub fn check(cap: &csi::VolumeCapability) -> Result<(), String> {
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode)
        .ok_or("volume_capability.access_mode is required")?;
    match Mode::try_from(mode) {
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter,
        ) => {}
        Ok(
            m @ (Mode::MultiNodeReaderOnly
            | Mode::MultiNodeSingleWriter
            | Mode::MultiNodeMultiWriter),
        ) => {
            return Err(format!(
                "access mode {} is not supported: a Zebu volume is served to one node at a time",
                m.as_str_name()
            ));
        }
        _ => return Err(format!("access mode {mode} is unknown")),
    }
    match &cap.access_type {
        Some(AccessType::Block(_)) => Ok(()),
        Some(AccessType::Mount(m)) => {
            if m.fs_type.is_empty() || FILESYSTEMS.contains(&m.fs_type.as_str()) {
                Ok(())
            } else {
                Err(format!(
                    "filesystem {:?} is not supported (one of {})",
                    m.fs_type,
                    FILESYSTEMS.join(", ")
                ))
            }
        }
        None => Err("volume_capability.access_type (block or mount) is required".into()),
    }
}

/// All of `caps`, or the first refusal.
pub fn check_all(caps: &[csi::VolumeCapability]) -> Result<(), String> {
    if caps.is_empty() {
        return Err("volume_capabilities is required".into());
    }
    caps.iter().try_for_each(check)
}

/// A mode that never writes.
pub fn read_only(mode: i32) -> bool {
    matches!(
        Mode::try_from(mode),
        Ok(Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
    )
}

/// Whether a volume used with `caps` needs its filesystem grown by the node after an
/// expansion (block volumes do not; unknown use is treated as a filesystem).
pub fn needs_node_expansion(cap: Option<&csi::VolumeCapability>) -> bool {
    !matches!(
        cap.and_then(|c| c.access_type.as_ref()),
        Some(AccessType::Block(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(mode: Mode, block: bool, fs: &str) -> csi::VolumeCapability {
        csi::VolumeCapability {
            access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
            access_type: Some(if block {
                AccessType::Block(Default::default())
            } else {
                AccessType::Mount(csi::volume_capability::MountVolume {
                    fs_type: fs.into(),
                    ..Default::default()
                })
            }),
        }
    }

    #[test]
    fn single_node_modes_and_our_filesystems_are_served() {
        assert!(check(&cap(Mode::SingleNodeWriter, false, "")).is_ok());
        assert!(check(&cap(Mode::SingleNodeMultiWriter, true, "")).is_ok());
        assert!(check(&cap(Mode::SingleNodeReaderOnly, false, "xfs")).is_ok());
        let e = check(&cap(Mode::MultiNodeMultiWriter, true, "")).expect_err("multi");
        assert!(e.contains("one node at a time"), "{e}");
        assert!(check(&cap(Mode::SingleNodeWriter, false, "zfs")).is_err());
        assert!(check_all(&[]).is_err());
        assert!(!needs_node_expansion(Some(&cap(
            Mode::SingleNodeWriter,
            true,
            ""
        ))));
        assert!(needs_node_expansion(None));
    }
}
