//! Object metadata, shaped and named exactly as Kubernetes' `ObjectMeta`, so a stored object
//! is a valid custom resource and a custom resource reads back into these types.
//!
//! Who writes what:
//!
//! | field | written by |
//! |---|---|
//! | `name`, `labels`, `annotations`, `ownerReferences`, `finalizers` | the caller |
//! | `namespace` | the store (its own namespace; a different one is refused) |
//! | `uid`, `creationTimestamp` | the store, at create |
//! | `resourceVersion` | the store, at every write; callers hand it back unchanged |
//! | `generation` | the store: 1 at create, +1 at every write that changes `spec` |
//! | `deletionTimestamp` | the store, at a delete while finalizers remain |

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A store's version of an object, or of a whole kind at the time of a list.
///
/// Opaque, as Kubernetes says: callers may hand it back (to update an object, to watch from a
/// list) and compare two for equality, but never order them or do arithmetic; only the store
/// that issued one knows what it means. Empty means "never stored".
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct ResourceVersion(String);

impl ResourceVersion {
    /// Made by a store from its own representation.
    pub fn new(s: impl Into<String>) -> Self {
        ResourceVersion(s.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for ResourceVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("(none)")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// An object that owns this one (Kubernetes garbage-collects owned objects with their
/// owner; the embedded store leaves that to the controllers, which delete what they own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    pub uid: String,
    /// The owner that manages this object (at most one owner has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_owner_deletion: Option<bool>,
}

/// Kubernetes-style object metadata; see the module docs for who writes which field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(default, skip_serializing_if = "ResourceVersion::is_empty")]
    pub resource_version: ResourceVersion,
    /// Bumped by the store whenever `spec` changes; a controller that has acted on a spec
    /// writes this number into its status as `observedGeneration`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: i64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_references: Vec<OwnerReference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<String>,
    /// Set by a delete while finalizers remain; the object goes away when the last
    /// finalizer is removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalizers: Vec<String>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl ObjectMeta {
    pub fn named(name: impl Into<String>) -> Self {
        ObjectMeta {
            name: name.into(),
            ..Default::default()
        }
    }

    pub fn is_deleting(&self) -> bool {
        self.deletion_timestamp.is_some()
    }

    pub fn has_finalizer(&self, f: &str) -> bool {
        self.finalizers.iter().any(|x| x == f)
    }

    /// An owner reference to this object, as the controller of what it owns.
    pub fn controller_ref(&self, kind: crate::Kind) -> OwnerReference {
        OwnerReference {
            api_version: crate::API_VERSION.to_string(),
            kind: kind.as_str().to_string(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }
}

/// Why a name was refused; the message names it and says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("name is empty")]
    Empty,
    #[error("name {name:?} is longer than {max} characters")]
    TooLong { name: String, max: usize },
    #[error(
        "name {name:?} is not a valid DNS-1123 label: use at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    )]
    NotALabel { name: String },
    #[error(
        "name {name:?} is not valid: use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
    )]
    NotASubdomain { name: String },
}

fn alnum(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// A DNS-1123 label (at most 63 of `a-z`, `0-9`, `-`, alphanumeric at both ends): what the
/// API asks of every name a person chooses (volumes, snapshots, backups), as Kubernetes asks
/// it of most objects. Such a name can also be a label value, a path component, a process
/// argument and part of an iSCSI IQN.
pub fn validate_label(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 63 {
        return Err(NameError::TooLong {
            name: name.to_string(),
            max: 63,
        });
    }
    let ok = name.chars().all(|c| alnum(c) || c == '-')
        && name.starts_with(alnum)
        && name.ends_with(alnum);
    if !ok {
        return Err(NameError::NotALabel {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// A DNS-1123 subdomain (at most 253 characters: labels joined by `.`): what a store accepts
/// as any object's name, as Kubernetes does for custom resources. Names the manager derives
/// (`<volume>-r-<id>`) may be longer than a label.
pub fn validate_object_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 253 {
        return Err(NameError::TooLong {
            name: name.to_string(),
            max: 253,
        });
    }
    let ok = name.chars().all(|c| alnum(c) || c == '-' || c == '.')
        && name
            .split('.')
            .all(|part| !part.is_empty() && part.starts_with(alnum) && part.ends_with(alnum));
    if !ok {
        return Err(NameError::NotASubdomain {
            name: name.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_what_kubernetes_calls_dns_1123_labels() {
        for good in ["a", "vol-1", "0", "pvc-0b1c", &"a".repeat(63)] {
            assert_eq!(validate_label(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "A",
            "-a",
            "a-",
            "a/b",
            "a_b",
            "a.b",
            "a b",
            "vol#frag",
            "x/../../v1/nodes",
            "é",
            &"a".repeat(64),
        ] {
            assert!(validate_label(bad).is_err(), "{bad}");
        }
        let e = validate_label("a.b").expect_err("dot");
        assert!(
            e.to_string()
                .contains("\"a.b\" is not a valid DNS-1123 label"),
            "{e}"
        );
    }

    #[test]
    fn object_names_are_dns_subdomains() {
        for good in ["a", "vol-1", "pvc-0b1c.x", "0", &"a".repeat(253)] {
            assert_eq!(validate_object_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "A",
            "-a",
            "a-",
            "a/b",
            "a_b",
            "a..b",
            "a.-b",
            "a b",
            &"a".repeat(254),
        ] {
            assert!(validate_object_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn metadata_json_uses_kubernetes_field_names() {
        let mut m = ObjectMeta::named("v");
        m.namespace = Some("zebu-system".into());
        m.resource_version = ResourceVersion::new("42");
        m.generation = 3;
        m.annotations.insert("a".into(), "b".into());
        m.owner_references
            .push(ObjectMeta::named("o").controller_ref(crate::Kind::Volume));
        let j = serde_json::to_value(&m).expect("json");
        assert_eq!(j["resourceVersion"], "42");
        assert_eq!(j["generation"], 3);
        assert_eq!(j["namespace"], "zebu-system");
        assert_eq!(j["ownerReferences"][0]["apiVersion"], "zebu.io/v1alpha1");
        assert_eq!(j["ownerReferences"][0]["blockOwnerDeletion"], true);
        let back: ObjectMeta = serde_json::from_value(j).expect("back");
        assert_eq!(back, m);
        // A never-stored object has no version, and says so when printed.
        assert!(ObjectMeta::named("x").resource_version.is_empty());
        assert_eq!(ResourceVersion::default().to_string(), "(none)");
    }
}
