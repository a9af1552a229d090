//! The kinds of resource, with the names Kubernetes knows them by.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The API group of every Zebu resource.
pub const GROUP: &str = "zebu.io";
/// The version of the resources' schema.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of every Zebu object: `GROUP/VERSION`.
pub const API_VERSION: &str = "zebu.io/v1alpha1";
/// The namespace every Zebu object lives in, in a cluster and in the embedded store alike.
pub const DEFAULT_NAMESPACE: &str = "zebu-system";

/// The kinds of resource the manager stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    Volume,
    Engine,
    Replica,
    Node,
    Setting,
    Snapshot,
    Backup,
    BackupTarget,
    RecurringJob,
}

impl Kind {
    pub const ALL: [Kind; 9] = [
        Kind::Volume,
        Kind::Engine,
        Kind::Replica,
        Kind::Node,
        Kind::Setting,
        Kind::Snapshot,
        Kind::Backup,
        Kind::BackupTarget,
        Kind::RecurringJob,
    ];

    /// The `kind` field of its objects (`Volume`).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Volume => "Volume",
            Kind::Engine => "Engine",
            Kind::Replica => "Replica",
            Kind::Node => "Node",
            Kind::Setting => "Setting",
            Kind::Snapshot => "Snapshot",
            Kind::Backup => "Backup",
            Kind::BackupTarget => "BackupTarget",
            Kind::RecurringJob => "RecurringJob",
        }
    }

    /// The plural resource name in URLs and CRD names (`volumes` in `volumes.zebu.io`).
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Volume => "volumes",
            Kind::Engine => "engines",
            Kind::Replica => "replicas",
            Kind::Node => "nodes",
            Kind::Setting => "settings",
            Kind::Snapshot => "snapshots",
            Kind::Backup => "backups",
            Kind::BackupTarget => "backuptargets",
            Kind::RecurringJob => "recurringjobs",
        }
    }

    /// The short name `kubectl get` takes (`kubectl get zv`): a `z` prefix keeps them apart
    /// from the built-in `nodes`, `volumesnapshots` and others.
    pub fn short_name(self) -> &'static str {
        match self {
            Kind::Volume => "zv",
            Kind::Engine => "ze",
            Kind::Replica => "zr",
            Kind::Node => "zn",
            Kind::Setting => "zs",
            Kind::Snapshot => "zsnap",
            Kind::Backup => "zb",
            Kind::BackupTarget => "zbt",
            Kind::RecurringJob => "zrj",
        }
    }

    /// The kind whose objects say `kind: s`.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_parse_back() {
        let mut plurals: Vec<_> = Kind::ALL.iter().map(|k| k.plural()).collect();
        let mut shorts: Vec<_> = Kind::ALL.iter().map(|k| k.short_name()).collect();
        plurals.sort_unstable();
        plurals.dedup();
        shorts.sort_unstable();
        shorts.dedup();
        assert_eq!(plurals.len(), Kind::ALL.len());
        assert_eq!(shorts.len(), Kind::ALL.len());
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.as_str()), Some(k));
            assert_eq!(k.plural(), k.as_str().to_lowercase() + "s");
        }
        assert_eq!(Kind::parse("Pod"), None);
        assert_eq!(API_VERSION, format!("{GROUP}/{VERSION}"));
    }
}
