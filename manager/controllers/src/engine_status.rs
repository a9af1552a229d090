//! What a running engine says about itself, folded into its Engine object's status.
//!
//! Two parties observe engines: the node agent of the engine's node (which also knows the
//! process), and, while that node has no manager, the volume's owner over the network
//! (`Action::ObserveEngine`). Both fold the engine's `Info` and `RebuildStatus` answers with
//! the same functions here, so an Engine's status means the same whoever wrote it.

use std::collections::BTreeMap;

use zebu_proto::engine as pb;
use zebu_types::resources::{
    EngineStatus, EngineVolumeState, RebuildKind, RebuildProgress, RebuildState, Replica,
    ReplicaMode,
};
use zebu_types::size::ByteSize;

/// A mode word from the engine; one this manager does not know is taken as failed, so it
/// is never counted as in sync.
pub fn parse_mode(m: &str) -> ReplicaMode {
    ReplicaMode::parse(m).unwrap_or(ReplicaMode::ERR)
}

/// The volume's replicas by address, as stored now.
fn by_address<'a>(volume: &str, replicas: &'a [Replica]) -> BTreeMap<&'a str, &'a str> {
    replicas
        .iter()
        .filter(|r| r.spec.volume == volume)
        .filter_map(|r| Some((r.status.address.as_deref()?, r.metadata.name.as_str())))
        .collect()
}

/// A `RebuildStatus` answer as progress (`None` for `idle`: no rebuild yet), the replica
/// named by its Replica when one has that address.
pub fn rebuild_progress(
    volume: &str,
    r: &pb::RebuildStatusResponse,
    replicas: &[Replica],
) -> Option<RebuildProgress> {
    let state = RebuildState::parse(&r.state)?;
    let names = by_address(volume, replicas);
    Some(RebuildProgress {
        replica: names
            .get(r.replica.as_str())
            .map_or_else(|| r.replica.clone(), |n| (*n).to_string()),
        state,
        kind: RebuildKind::parse(&r.kind).unwrap_or(RebuildKind::Full),
        bytes_done: r.bytes_done,
        bytes_total: r.bytes_total,
        error: r.error.clone(),
    })
}

/// Fold an `Info` answer into `status`: the engine's verdict, size and generation, each
/// replica's mode by Replica name (addresses no Replica has go to `unknownReplicas`), and
/// the pid of each replica process the engine was first seen taking as RW.
///
/// `replicas` must be read *after* the engine answered: a pid read before a replica's
/// restart would be taken for the process the engine calls RW, and stick, since the engine
/// never sees that old process fail; the volume would stay Degraded for good.
pub fn fold_info(
    status: &mut EngineStatus,
    volume: &str,
    info: &pb::VolumeInfo,
    replicas: &[Replica],
) {
    let names = by_address(volume, replicas);
    let pids: BTreeMap<&str, u32> = replicas
        .iter()
        .filter(|r| r.spec.volume == volume)
        .filter_map(|r| Some((r.metadata.name.as_str(), r.status.pid?)))
        .collect();
    if status
        .engine_generation
        .is_some_and(|g| g != info.generation)
    {
        // Another engine process (a restart): what the old one took is moot.
        status.replica_pids.clear();
        status.replica_modes.clear();
    }
    status.engine_generation = Some(info.generation);
    status.volume_state = EngineVolumeState::parse(&info.state);
    status.size = Some(ByteSize(info.size));
    let before = std::mem::take(&mut status.replica_modes);
    status.unknown_replicas.clear();
    for r in &info.replicas {
        let mode = parse_mode(&r.mode);
        match names.get(r.address.as_str()) {
            Some(n) => {
                let name = (*n).to_string();
                let was_rw = before.get(&name) == Some(&ReplicaMode::RW);
                match (mode, pids.get(*n)) {
                    (ReplicaMode::RW, Some(p))
                        if !was_rw || !status.replica_pids.contains_key(&name) =>
                    {
                        status.replica_pids.insert(name.clone(), *p);
                    }
                    (ReplicaMode::RW, _) => {}
                    _ => {
                        status.replica_pids.remove(&name);
                    }
                }
                status.replica_modes.insert(name, mode);
            }
            None => {
                status.unknown_replicas.insert(r.address.clone(), mode);
            }
        }
    }
    status.message.clear();
}

/// An engine that could not be asked: nothing it said before can be vouched for any more
/// (its verdict is what the volume controller trusts a replica's mode on).
pub fn fold_unreachable(status: &mut EngineStatus, why: &str) {
    status.volume_state = None;
    status.message = format!("engine unreachable: {why}");
}
