//! The bodies of user operations, as the REST API takes them and the ops layer checks them.
//!
//! They live here rather than in the ops or API crates so that every caller (the `zebu` CLI's
//! typed client, a CSI plugin, a test) builds the same values without depending on the
//! server side. Unknown fields are refused, so a typo is an error instead of a default.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

pub mod backup;
pub mod recurring;
pub mod standby;

use crate::resources::{DataLocality, Frontend};
use crate::size::{ByteSize, SizeError};

/// A size given as bytes (`10737418240`) or as text (`"10G"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum SizeInput {
    Bytes(u64),
    Text(String),
}

impl SizeInput {
    pub fn resolve(&self) -> Result<ByteSize, SizeError> {
        match self {
            SizeInput::Bytes(b) => Ok(ByteSize(*b)),
            SizeInput::Text(t) => t.parse(),
        }
    }
}

impl From<ByteSize> for SizeInput {
    fn from(b: ByteSize) -> Self {
        SizeInput::Bytes(b.bytes())
    }
}

/// Hand-written so that a number JSON cannot hold as bytes is refused with a message that
/// names it, not "data did not match any variant".
impl<'de> Deserialize<'de> for SizeInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SizeInput;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes, or a string like \"10G\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SizeInput, E> {
                Ok(SizeInput::Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SizeInput, E> {
                u64::try_from(v)
                    .map(SizeInput::Bytes)
                    .map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<SizeInput, E> {
                if v.fract() == 0.0 && v >= 18_446_744_073_709_551_616.0 {
                    Err(E::custom(format!(
                        "size {v} is too large: a size must be below 16 EiB (2^64 bytes)"
                    )))
                } else if v < 0.0 {
                    Err(E::custom(format!("size {v} is negative")))
                } else {
                    Err(E::custom(format!(
                        "size {v} is not a whole number of bytes"
                    )))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SizeInput, E> {
                Ok(SizeInput::Text(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    pub size: SizeInput,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Frontend>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_selector: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_selector: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_locality: Option<DataLocality>,
    /// Seconds a failed replica is kept for reuse; `None`: the cluster setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_replica_timeout: Option<u64>,
    /// Fill the new volume with a snapshot's data (or a volume's, through a snapshot taken
    /// for it) before it can be attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_source: Option<DataSource>,
    /// Annotations recorded on the Volume (e.g. the CSI plugin's resolved parameters).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Where a new volume's data comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DataSource {
    pub volume: String,
    /// A snapshot of `volume`; `None` clones the volume as it is now (through a snapshot
    /// taken for the clone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

impl CreateVolume {
    /// A volume of `size` with every other choice left to the defaults.
    pub fn new(name: impl Into<String>, size: ByteSize) -> Self {
        CreateVolume {
            name: name.into(),
            size: size.into(),
            number_of_replicas: None,
            frontend: None,
            node_selector: vec![],
            disk_selector: vec![],
            data_locality: None,
            stale_replica_timeout: None,
            data_source: None,
            annotations: BTreeMap::new(),
        }
    }
}

/// `POST /v1/volumes/{name}/attach`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AttachVolume {
    /// The node to attach to; `None` picks a ready node.
    #[serde(default)]
    pub node: Option<String>,
    /// Start the engine without a frontend (for a snapshot revert).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub maintenance: bool,
    /// Serve the volume with this frontend (recorded in its spec); `None`: the one it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Frontend>,
}

/// `POST /v1/volumes/{name}/expand`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExpandVolume {
    pub size: SizeInput,
}

/// `POST /v1/volumes/{name}/scrub`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartScrub {
    /// Data bytes read per second, over every replica (`"64M"`); the engine's default
    /// (64 MiB/s) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<SizeInput>,
}

/// `POST /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSnapshot {
    /// Unnamed snapshots are named after the moment they were asked for.
    #[serde(default)]
    pub name: Option<String>,
}

/// One snapshot of a volume, as its engine lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfo {
    pub name: String,
    /// Empty for the oldest.
    #[serde(default)]
    pub parent: String,
    pub user_created: bool,
    pub created: String,
    pub data_bytes: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// `GET /v1/capacity`: what new replicas can still take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    /// Bytes free for new replicas on the schedulable disks of the nodes asked about
    /// (each disk's free bytes less its reserve, at least 0).
    pub available: ByteSize,
    /// The largest replica one of those disks can take now: the largest volume that fits.
    pub maximum_volume_size: ByteSize,
}

/// `{"items": [...]}`, as Kubernetes lists are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Items<T> {
    pub items: Vec<T>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(json: &str) -> Result<SizeInput, String> {
        serde_json::from_str::<SizeInput>(json).map_err(|e| e.to_string())
    }

    #[test]
    fn sizes_that_do_not_fit_are_named_in_the_error() {
        assert_eq!(size("4096"), Ok(SizeInput::Bytes(4096)));
        assert_eq!(size("\"10G\""), Ok(SizeInput::Text("10G".into())));
        let e = size("99999999999999999999").expect_err("too large");
        assert!(
            e.starts_with("size 100000000000000000000 is too large"),
            "{e}"
        );
        assert!(
            size("-1")
                .expect_err("negative")
                .contains("size -1 is negative")
        );
        assert!(
            size("1.5")
                .expect_err("fraction")
                .contains("size 1.5 is not a whole number")
        );
        let e = SizeInput::Text("99999999999T".into())
            .resolve()
            .expect_err("too large");
        assert!(
            e.to_string()
                .starts_with("size \"99999999999T\" is too large"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<CreateVolume>(r#"{"name":"a","size":1,"colour":"red"}"#)
            .expect_err("unknown field");
        assert!(e.to_string().contains("colour"), "{e}");
        let a: AttachVolume = serde_json::from_str(r#"{"node":null}"#).expect("old body");
        assert_eq!(a, AttachVolume::default());
    }
}
