//! Capacity: what new replicas can still take, on one node, one zone or the whole cluster
//! (CSI GetCapacity per topology segment).
//!
//! A disk counts with the same two tests the scheduler applies (see [`crate::scheduler`]):
//! the room left under over-provisioning (`(maximum - reserved) × over-provisioning % -
//! sizes of the replicas placed there`), and only while its free bytes are above the
//! minimal-available share. So a volume of `maximum_volume_size` passes the scheduler's
//! capacity tests on at least one disk, and one byte more passes none.

use std::collections::BTreeMap;

use zebu_types::requests::Capacity;
use zebu_types::resources::{Node, Replica};
use zebu_types::size::ByteSize;
use zebu_types::store::TypedStore;

use crate::volume::check_name;
use crate::{Ops, OpsResult};

/// Which nodes to count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapacityScope {
    pub node: Option<String>,
    pub zone: Option<String>,
}

impl Ops {
    pub async fn capacity(&self, scope: &CapacityScope) -> OpsResult<Capacity> {
        if let Some(n) = &scope.node {
            check_name("node", n)?;
        }
        let settings = self.settings().await?;
        let nodes = self.store.list_as::<Node>().await?;
        let mut scheduled: BTreeMap<(String, String), u64> = BTreeMap::new();
        for r in self.store.list_as::<Replica>().await? {
            *scheduled.entry((r.spec.node, r.spec.disk)).or_default() += r.spec.size.bytes();
        }
        let mut available = 0u64;
        let mut largest = 0u64;
        for node in &nodes {
            let name = &node.metadata.name;
            if scope.node.as_ref().is_some_and(|n| n != name)
                || scope
                    .zone
                    .as_deref()
                    .is_some_and(|z| node.zone().unwrap_or("") != z)
                || !node.is_ready()
                || !node.spec.allow_scheduling
            {
                continue;
            }
            for (d, disk) in &node.spec.disks {
                let Some(status) = node.status.disk_status.get(d) else {
                    continue;
                };
                if !disk.allow_scheduling {
                    continue;
                }
                let max = status.storage_maximum.bytes();
                let reserved = disk.storage_reserved.bytes();
                let limit = (u128::from(max.saturating_sub(reserved))
                    * u128::from(settings.storage_over_provisioning_percentage)
                    / 100) as u64;
                let used = scheduled
                    .get(&(name.clone(), d.clone()))
                    .copied()
                    .unwrap_or(0);
                let free = status.storage_available.bytes().saturating_sub(reserved);
                let min_free = (u128::from(max)
                    * u128::from(settings.storage_minimal_available_percentage)
                    / 100) as u64;
                if free < min_free {
                    continue;
                }
                let left = limit.saturating_sub(used);
                available = available.saturating_add(left);
                largest = largest.max(left);
            }
        }
        // Volumes are whole 4 KiB blocks.
        largest -= largest % crate::VOLUME_ALIGNMENT;
        Ok(Capacity {
            available: ByteSize(available),
            maximum_volume_size: ByteSize(largest),
        })
    }
}
