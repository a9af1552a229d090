//! The replica's metadata file, `replica.json`, and how it is written.
//!
//! Layout of a replica directory:
//!
//! ```text
//! replica.json        this metadata (JSON, see `Meta`)
//! layer-<id>.img      one sparse file per layer (the head and every snapshot), named by a
//!                     layer id that is never reused
//! layer-<id>.sum      the CRC32C of each 4 KiB block of that layer (see `sums.rs`)
//! regions.dat         per-region flush bookkeeping (see `regions.rs`)
//! clean-close         present only between a clean close and the next open (`sums.rs`)
//! ```
//!
//! Format versions: 1 had no checksum files; 2 has one per layer, and a layer whose sums are
//! not computed yet is marked `unverified`. `open` upgrades a format-1 directory in place
//! (checksum files created, every layer unverified, format 2 committed) and a background
//! pass computes the sums; a build that knows only format 1 refuses format 2, which is what
//! keeps it from writing data without sums into a replica that trusts them.
//!
//! Commit point: every change of the chain, the generation or the epoch is one atomic
//! replacement of `replica.json`: write `replica.json.tmp`, fsync it, rename it over
//! `replica.json`, fsync the directory. A crash before the rename leaves the old metadata
//! (and maybe a stray `.tmp` and layer files it does not name, which `open` deletes); a crash
//! after it leaves the new one. Layer files are created and made durable *before* the
//! metadata that names them, and deleted only *after* the metadata that stops naming them;
//! a layer's checksum file is created, and deleted, together with it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ReplicaError, Result};

pub const META_FILE: &str = "replica.json";
pub const META_TMP: &str = "replica.json.tmp";
pub const REGIONS_FILE: &str = "regions.dat";
/// Version of the directory format this build writes (see the module docs).
pub const FORMAT_VERSION: u32 = 2;
/// The format before checksum files, which `open` upgrades.
pub const FORMAT_WITHOUT_SUMS: u32 = 1;

/// Identifies a layer file within one replica. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LayerId(pub u64);

impl LayerId {
    pub fn file_name(self) -> String {
        format!("layer-{:06}.img", self.0)
    }

    /// The id in a layer file name, if it is one.
    pub fn from_file_name(name: &str) -> Option<LayerId> {
        let digits = name.strip_prefix("layer-")?.strip_suffix(".img")?;
        digits.parse().ok().map(LayerId)
    }
}

impl std::fmt::Display for LayerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {}", self.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMeta {
    pub id: LayerId,
    /// Snapshot name; `None` for the head.
    pub name: Option<String>,
    pub parent: Option<LayerId>,
    pub user_created: bool,
    /// RFC 3339 creation time.
    pub created: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Volume size when the layer was created.
    pub size: u64,
    /// Set while a rebuild is still writing the layer (between `begin_layer` and
    /// `finish_layer`): its data cannot be trusted yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incomplete: bool,
    /// Created by a rebuild (`begin_layer`) rather than by a snapshot of this replica.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rebuilt: bool,
    /// Its checksum file does not cover its data yet (an upgraded format-1 replica, or a
    /// checksum file found missing): reads from it are not verified until a background pass
    /// has computed the sums (`sums.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unverified: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub format_version: u32,
    pub replica_id: String,
    /// The uuid of the volume this replica belongs to; absent in replicas made before volume
    /// identity and in fresh ones until the first engine says hello (`Replica::claim_volume`).
    /// A build without the field keeps reading the file (serde skips unknown fields), but
    /// drops it at its next metadata change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_uuid: Option<String>,
    pub size: u64,
    pub region_size: u64,
    /// Highest engine generation accepted (fencing).
    pub generation: u64,
    pub epoch: u64,
    pub epoch_members: Vec<String>,
    pub head: LayerId,
    pub next_layer_id: u64,
    /// Every layer, in no particular order.
    pub layers: Vec<LayerMeta>,
}

impl Meta {
    pub fn layer(&self, id: LayerId) -> Option<&LayerMeta> {
        self.layers.iter().find(|l| l.id == id)
    }

    pub fn layer_mut(&mut self, id: LayerId) -> Option<&mut LayerMeta> {
        self.layers.iter_mut().find(|l| l.id == id)
    }

    pub fn snapshot(&self, name: &str) -> Option<&LayerMeta> {
        self.layers.iter().find(|l| l.name.as_deref() == Some(name))
    }

    /// The head's chain, oldest first, head last.
    pub fn chain(&self) -> Vec<LayerId> {
        let mut out = Vec::new();
        let mut at = Some(self.head);
        while let Some(id) = at {
            if out.contains(&id) || out.len() > self.layers.len() {
                break; // a cycle; `validate` reports it
            }
            out.push(id);
            at = self.layer(id).and_then(|l| l.parent);
        }
        out.reverse();
        out
    }

    pub fn children(&self, id: LayerId) -> Vec<LayerId> {
        self.layers
            .iter()
            .filter(|l| l.parent == Some(id))
            .map(|l| l.id)
            .collect()
    }

    pub fn alloc_layer_id(&mut self) -> LayerId {
        self.next_layer_id += 1;
        LayerId(self.next_layer_id)
    }

    /// Checks the structure: the head exists and is unnamed, layer ids and snapshot names are
    /// unique, parents exist, there is no cycle.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |why: String| ReplicaError::Corrupt {
            path: path.to_owned(),
            why,
        };
        if self.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {} is not {FORMAT_VERSION}",
                self.format_version
            )));
        }
        let head = self
            .layer(self.head)
            .ok_or_else(|| bad(format!("head {} missing", self.head)))?;
        if head.name.is_some() {
            return Err(bad("the head has a snapshot name".into()));
        }
        let mut names = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        for l in &self.layers {
            if l.id.0 > self.next_layer_id {
                return Err(bad(format!("{} above next_layer_id", l.id)));
            }
            // Two entries of one id would open one file twice (issue 18: the replica then
            // waited on its own lock and blamed another process).
            if !ids.insert(l.id) {
                return Err(bad(format!("{} is listed twice", l.id)));
            }
            if l.id != self.head && l.name.is_none() {
                return Err(bad(format!("{} is neither the head nor named", l.id)));
            }
            if let Some(n) = &l.name
                && !names.insert(n.as_str())
            {
                return Err(bad(format!("snapshot name {n:?} used twice")));
            }
            if let Some(p) = l.parent
                && self.layer(p).is_none()
            {
                return Err(bad(format!("{} has missing parent {p}", l.id)));
            }
        }
        let chain = self.chain();
        if self.layer(chain[0]).and_then(|l| l.parent).is_some() {
            return Err(bad("the layer chain has a cycle".into()));
        }
        if self.region_size == 0 || !self.region_size.is_power_of_two() {
            return Err(bad(format!(
                "region size {} is not a power of two",
                self.region_size
            )));
        }
        Ok(())
    }

    pub fn load(dir: &Path) -> Result<Meta> {
        let path = dir.join(META_FILE);
        let text = std::fs::read(&path)
            .map_err(|e| ReplicaError::io(format!("read {}", path.display()), e))?;
        let meta: Meta = serde_json::from_slice(&text).map_err(|e| ReplicaError::Corrupt {
            path: path.clone(),
            why: e.to_string(),
        })?;
        if meta.format_version == FORMAT_WITHOUT_SUMS {
            // Checked as the current format; `open` upgrades it before anything else.
            let mut as_current = meta.clone();
            as_current.format_version = FORMAT_VERSION;
            as_current.validate(&path)?;
        } else {
            meta.validate(&path)?;
        }
        Ok(meta)
    }

    /// Replaces `replica.json` atomically and durably (see the module comment).
    pub fn store(&self, dir: &Path) -> Result<()> {
        let tmp = dir.join(META_TMP);
        let text = serde_json::to_vec_pretty(self).expect("invariant: Meta serialises");
        let ctx = |what: &str, e| ReplicaError::io(format!("{what} {}", tmp.display()), e);
        let mut f = File::create(&tmp).map_err(|e| ctx("create", e))?;
        f.write_all(&text).map_err(|e| ctx("write", e))?;
        f.sync_all().map_err(|e| ctx("fsync", e))?;
        drop(f);
        std::fs::rename(&tmp, dir.join(META_FILE)).map_err(|e| ctx("rename", e))?;
        sync_dir(dir)
    }
}

/// fsync a directory, making renames and creations in it durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ReplicaError::io(format!("fsync directory {}", dir.display()), e))
}

pub fn layer_path(dir: &Path, id: LayerId) -> PathBuf {
    dir.join(id.file_name())
}

/// Current time as RFC 3339 (UTC, seconds).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days(secs / 86_400);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar, using
/// 400-year eras that start on March 1st (so the leap day ends a year).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_513), (2026, 3, 1));
    }

    #[test]
    fn layer_file_names_round_trip() {
        assert_eq!(
            LayerId::from_file_name(&LayerId(42).file_name()),
            Some(LayerId(42))
        );
        assert_eq!(LayerId::from_file_name("layer-x.img"), None);
    }
}
