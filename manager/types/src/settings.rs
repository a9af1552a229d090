//! Typed view of the Setting resources.
//!
//! Settings are stored one object per name (`spec.value` a string), as in
//! Longhorn, so an operator can change one with one write. [`Settings`] is
//! what code reads: every known name with its default, parsed once; an
//! unknown name or an unparsable value is an error that names the setting.

use crate::resources::Setting;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Allow two replicas of a volume on one node when nothing else fits.
    pub replica_soft_anti_affinity: bool,
    /// Allow two replicas in one zone when nothing else fits.
    pub replica_zone_soft_anti_affinity: bool,
    /// Allow two replicas on one disk when nothing else fits.
    pub replica_disk_soft_anti_affinity: bool,
    /// Scheduled replica sizes may add up to this percentage of a disk's
    /// usable capacity (thin provisioning).
    pub storage_over_provisioning_percentage: u64,
    /// A disk with less than this percentage of its capacity actually free
    /// takes no new replicas.
    pub storage_minimal_available_percentage: u64,
    pub default_replica_count: u32,
    /// `staleReplicaTimeout` (seconds) given to new volumes: how long a
    /// replica whose node is down is waited for before a replacement is
    /// scheduled on another node.
    pub stale_replica_timeout: u64,
    /// `node-down-after` (seconds): a node whose agent has written no
    /// heartbeat for this long is marked not Ready. Agents beat every 2 s,
    /// so anything shorter than a few beats would flap on a busy host.
    pub node_down_after: u64,
    /// `scrub-interval` (seconds; 0: never): an attached, healthy volume whose last scrub
    /// started this long ago (or, never scrubbed, that was created this long ago) is
    /// scrubbed by the manager; one volume at a time per manager.
    pub scrub_interval: u64,
}

/// A week: a whole-volume read at the engine's default rate (64 MiB/s) costs minutes per
/// 10 GiB, so a weekly pass finds rot long before a second copy of the same block could
/// rot too.
pub const DEFAULT_SCRUB_INTERVAL: u64 = 7 * 24 * 3600;

/// The minimal-available percentage `zebu up` stores when none is set.
///
/// `zebu up` runs every node on one host, so every node's disk is the same
/// host filesystem, which also holds the user's other files. The cluster
/// default of 25 % (Longhorn's, meant for a disk given to storage) refuses
/// every replica on an ordinary developer or CI disk that is more than 75 %
/// full, while 5 % still keeps replicas off a disk that is about to fill.
pub const STANDALONE_MINIMAL_AVAILABLE_PERCENTAGE: u64 = 5;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            replica_soft_anti_affinity: false,
            replica_zone_soft_anti_affinity: true,
            replica_disk_soft_anti_affinity: true,
            storage_over_provisioning_percentage: 100,
            storage_minimal_available_percentage: 25,
            default_replica_count: 3,
            stale_replica_timeout: 2880,
            node_down_after: 10,
            scrub_interval: DEFAULT_SCRUB_INTERVAL,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("unknown setting {0:?}")]
    Unknown(String),
    #[error("setting {name:?}: invalid value {value:?}: {why}")]
    Invalid {
        name: String,
        value: String,
        why: &'static str,
    },
}

impl Settings {
    /// Defaults overridden by the stored Setting objects.
    pub fn from_objects(objects: &[Setting]) -> Result<Settings, SettingError> {
        let mut s = Settings::default();
        for o in objects {
            s.set(&o.metadata.name, &o.spec.value)?;
        }
        Ok(s)
    }

    pub fn set(&mut self, name: &str, value: &str) -> Result<(), SettingError> {
        let invalid = |why| SettingError::Invalid {
            name: name.to_string(),
            value: value.to_string(),
            why,
        };
        let boolean = || {
            value
                .parse::<bool>()
                .map_err(|_| invalid("expected true or false"))
        };
        let percent = |max: u64| {
            value
                .parse::<u64>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| invalid("expected a whole percentage in range"))
        };
        match name {
            "replica-soft-anti-affinity" => self.replica_soft_anti_affinity = boolean()?,
            "replica-zone-soft-anti-affinity" => self.replica_zone_soft_anti_affinity = boolean()?,
            "replica-disk-soft-anti-affinity" => self.replica_disk_soft_anti_affinity = boolean()?,
            "storage-over-provisioning-percentage" => {
                self.storage_over_provisioning_percentage = percent(10_000)?
            }
            "storage-minimal-available-percentage" => {
                self.storage_minimal_available_percentage = percent(100)?
            }
            "default-replica-count" => {
                self.default_replica_count = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=20).contains(n))
                    .ok_or_else(|| invalid("expected 1 to 20"))?
            }
            "stale-replica-timeout" => {
                self.stale_replica_timeout = value
                    .parse::<u64>()
                    .ok()
                    .filter(|n| (1..=7 * 24 * 3600).contains(n))
                    .ok_or_else(|| invalid("expected seconds, 1 to 604800"))?
            }
            "node-down-after" => {
                self.node_down_after = value
                    .parse::<u64>()
                    .ok()
                    .filter(|n| (3..=3600).contains(n))
                    .ok_or_else(|| invalid("expected seconds, 3 to 3600"))?
            }
            "scrub-interval" => {
                self.scrub_interval = value
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n <= 366 * 24 * 3600)
                    .ok_or_else(|| invalid("expected seconds, 0 (never) to 31622400"))?
            }
            _ => return Err(SettingError::Unknown(name.to_string())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::SettingSpec;

    #[test]
    fn stored_settings_override_defaults_and_bad_values_name_the_setting() {
        let objs = vec![Setting::new(
            "storage-over-provisioning-percentage",
            SettingSpec {
                value: "200".into(),
            },
        )];
        let s = Settings::from_objects(&objs).expect("valid");
        assert_eq!(s.storage_over_provisioning_percentage, 200);
        assert_eq!(s.storage_minimal_available_percentage, 25);
        let mut s = Settings::default();
        let e = s
            .set("replica-soft-anti-affinity", "yes")
            .expect_err("bad bool");
        assert!(e.to_string().contains("replica-soft-anti-affinity"), "{e}");
        assert!(
            s.set("storage-minimal-available-percentage", "101")
                .is_err()
        );
        s.set("node-down-after", "30").expect("valid");
        assert_eq!(s.node_down_after, 30);
        let e = s
            .set("node-down-after", "1")
            .expect_err("below a heartbeat");
        assert!(e.to_string().contains("3 to 3600"), "{e}");
        assert_eq!(Settings::default().node_down_after, 10);
        s.set("scrub-interval", "0").expect("never");
        assert_eq!(s.scrub_interval, 0);
        let e = s.set("scrub-interval", "1h").expect_err("seconds only");
        assert!(e.to_string().contains("scrub-interval"), "{e}");
        assert_eq!(
            s.set("nope", "1"),
            Err(SettingError::Unknown("nope".into()))
        );
    }
}
