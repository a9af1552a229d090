//! What the node staged for one volume: `<state-dir>/volumes/<volume>.json`.
//!
//! Layout: one JSON object ([`Staged`]). Commit point: the rename of `<file>.tmp` onto
//! `<file>` after the temporary file's fsync, followed by an fsync of the directory. A
//! crash before the rename leaves the old state (or none) and a stray `.tmp`, which the
//! next save overwrites; after it, the new state. Stage writes it after the device is
//! attached and before anything is mounted; unstage removes it after the device is given
//! back, so a crash in between leaves a state that the retried unstage completes.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::attach::Attachment;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Staged {
    pub volume: String,
    pub staging_path: PathBuf,
    pub block: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    pub attachment: Attachment,
}

impl Staged {
    pub fn load(path: &Path) -> std::io::Result<Option<Staged>> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_state_loads_back_and_a_missing_one_is_none() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("v.json");
        assert_eq!(Staged::load(&p).expect("load"), None);
        let s = Staged {
            volume: "v".into(),
            staging_path: "/staging/v".into(),
            block: false,
            fs_type: Some("ext4".into()),
            attachment: Attachment::Iscsi {
                portal: "127.0.0.1:3260".into(),
                iqn: "iqn.2025-01.io.zebu:v".into(),
                lun: 1,
                device: "/dev/sdb".into(),
            },
        };
        s.save(&p).expect("save");
        assert_eq!(Staged::load(&p).expect("load"), Some(s));
        std::fs::write(&p, b"{not json").expect("write");
        assert!(
            Staged::load(&p).is_err(),
            "a damaged state is an error, never None"
        );
    }
}
