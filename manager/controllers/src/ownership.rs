//! Which manager reconciles a volume, in a cluster of managers: exactly one at a time.
//!
//! A volume's owner is recorded in `status.ownerId`, and every change of it is a status
//! write with the resourceVersion the deciding manager read, so of two managers that decide
//! from the same version only one wins; the other gets a conflict, reads again, and sees the
//! winner. The rules, decided by [`decide`] from the [`World`] alone:
//!
//! - **Preferred owner** ([`preferred`]): the volume's attached node (`spec.nodeId`) while
//!   its manager is up; else the node of its engine while that one is up (a volume being
//!   detached or moved); else the live node with the highest rendezvous score for the
//!   volume's name ([`rendezvous`]), so every manager that sees the same live nodes picks
//!   the same one, and a node joining or leaving moves only the volumes it wins or held.
//! - **Only the owner hands over.** The current owner, when it sees another preferred node
//!   up, writes that node as owner and does nothing more for the volume in that pass; the
//!   new owner starts only once it reads itself as owner. So a volume moves between two live
//!   managers without an instant where both drive it: the old one wrote its last action
//!   before the hand-off write, the new one acts only after it.
//! - **A gone owner is replaced.** When the recorded owner's manager is down (its Lease
//!   expired, or it has neither Lease nor Node) or there is none, the preferred node claims
//!   it. An owner whose Lease this manager has not read yet is not gone: it may have
//!   started after the last read ([`World::manager_gone`]). The old owner cannot be acting
//!   any more: a manager stops all volume work once it has not renewed its own Lease for the
//!   renew deadline, which is shorter than the Lease duration others wait (see
//!   `zebu manager`'s lease module).
//!
//! ```text
//!                 preferred = me, owner down/none          preferred = other (up)
//!   not mine ───────────────── Claim ───────────▶ mine ─────────── HandOff ──────▶ not mine
//!      ▲                                            │
//!      └──────────── another wins the claim ────────┘ (conflict: read again)
//! ```
//!
//! What the engine does meanwhile does not depend on any of this: it keeps serving whatever
//! manager owns the volume, and if a stale owner ever caused a second engine to start, the
//! new engine's generation fences the old one off every replica.
//!
//! On one host (the embedded store) one manager does everything: [`Role::Sole`].

use std::fmt;

use zebu_types::resources::Volume;

use crate::World;

/// How this manager shares the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The only manager: it reconciles every volume and leaves `ownerId` unset.
    Sole,
    /// One of a cluster's managers: the one of this node.
    Member { node: String },
}

/// What this manager does with one volume this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerAction {
    /// It owns the volume: decide and apply.
    Drive,
    /// Record this manager as owner (the previous one is gone or there was none), then
    /// drive.
    Claim { from: Option<String> },
    /// Record `to` as owner and leave the volume to it.
    HandOff { to: String },
    /// Another manager's (or, while nobody is preferred, nobody's): leave it alone.
    Leave { owner: Option<String> },
}

impl fmt::Display for OwnerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OwnerAction::Drive => f.write_str("drive"),
            OwnerAction::Claim { from: None } => f.write_str("claim"),
            OwnerAction::Claim { from: Some(n) } => write!(f, "claim from {n}"),
            OwnerAction::HandOff { to } => write!(f, "hand off to {to}"),
            OwnerAction::Leave { owner: None } => f.write_str("leave (no owner)"),
            OwnerAction::Leave { owner: Some(n) } => write!(f, "leave (owner {n})"),
        }
    }
}

/// A score for `node` as the owner of `volume`: a 64-bit FNV-1a hash of both names, mixed
/// (splitmix64's finaliser) so names that differ in one character still score apart. Written
/// out rather than taken from `std`, whose hashers may change between Rust releases: two
/// manager versions in one cluster must agree.
pub fn rendezvous(volume: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in volume.bytes().chain([0]).chain(node.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The node whose manager should own `v` now; `None` when no manager is up.
pub fn preferred<'a>(w: &'a World, v: &'a Volume) -> Option<&'a str> {
    if let Some(n) = v.spec.node_id.as_deref()
        && w.node_ready(n)
    {
        return Some(n);
    }
    if let Some(e) = w
        .engines_of(&v.metadata.name)
        .find(|e| w.node_ready(&e.spec.node))
    {
        return Some(e.spec.node.as_str());
    }
    // Ties (equal scores) go to the lower name, so the choice is total.
    w.live_nodes().max_by(|a, b| {
        rendezvous(&v.metadata.name, a)
            .cmp(&rendezvous(&v.metadata.name, b))
            .then(b.cmp(a))
    })
}

/// What manager `me` does with volume `v`; see the module docs.
pub fn decide(w: &World, v: &Volume, me: &str) -> OwnerAction {
    let owner = v.status.owner_id.as_deref();
    let want = preferred(w, v);
    match owner {
        Some(o) if o == me => match want {
            Some(p) if p != me => OwnerAction::HandOff { to: p.to_string() },
            _ => OwnerAction::Drive,
        },
        Some(o) if !w.manager_gone(o) => OwnerAction::Leave {
            owner: Some(o.to_string()),
        },
        _ if want == Some(me) => OwnerAction::Claim {
            from: owner.map(str::to_string),
        },
        _ => OwnerAction::Leave {
            owner: owner.map(str::to_string),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_is_stable_and_spreads_volumes() {
        // Fixed values: a change here changes which manager owns what in a running cluster.
        assert_eq!(rendezvous("v", "node-1"), rendezvous("v", "node-1"));
        assert_ne!(rendezvous("v", "node-1"), rendezvous("v", "node-2"));
        assert_ne!(rendezvous("v1", "node-1"), rendezvous("v", "1node-1"));
        let nodes = ["node-1", "node-2", "node-3"];
        let mut wins = [0u32; 3];
        for i in 0..300 {
            let v = format!("pvc-{i}");
            let best = (0..3)
                .max_by_key(|&n| rendezvous(&v, nodes[n]))
                .expect("three nodes");
            wins[best] += 1;
        }
        // 100 each expected; a poor hash puts most on one node.
        assert!(wins.iter().all(|&w| (60..=140).contains(&w)), "{wins:?}");
    }

    #[test]
    fn removing_a_node_moves_only_the_volumes_it_won() {
        let all = ["node-1", "node-2", "node-3", "node-4"];
        let best = |v: &str, nodes: &[&str]| {
            nodes
                .iter()
                .copied()
                .max_by_key(|n| rendezvous(v, n))
                .expect("nodes")
                .to_string()
        };
        for i in 0..200 {
            let v = format!("vol-{i}");
            let before = best(&v, &all);
            let after = best(&v, &all[..3]);
            if before != "node-4" {
                assert_eq!(before, after, "{v} moved though its owner stayed");
            }
        }
    }
}
