//! What a running engine says about itself, folded into its Engine object's status.
//!
//! Two parties observe engines: the node agent of the engine's node (which also knows the
//! process), and, while that node has no manager, the volume's owner over the network
//! (`Action::ObserveEngine`). Both fold the engine's `Info` and `RebuildStatus` answers with
//! the same functions here, so an Engine's status means the same whoever wrote it.
//!
//! States come as enums from engines of control protocol 3 and later ([`mode_of`],
//! [`volume_state_of`], [`rebuild_progress`]); an older engine sends only words (its enums
//! read UNSPECIFIED), which are parsed instead. A value this manager does not know (from a
//! newer engine) is taken for the worst: a replica mode as ERR, so it is never counted in
//! sync, a volume state as unknown.

use std::collections::BTreeMap;

use zebu_proto::engine as pb;
use zebu_types::resources::{
    EngineStatus, EngineVolumeState, RebuildKind, RebuildProgress, RebuildState, Replica,
    ReplicaMode,
};
use zebu_types::size::ByteSize;

/// A replica's mode as its engine reports it; see the module docs.
pub fn mode_of(r: &pb::ReplicaStatus) -> ReplicaMode {
    match pb::ReplicaMode::try_from(r.replica_mode) {
        Ok(pb::ReplicaMode::Rw) => ReplicaMode::RW,
        Ok(pb::ReplicaMode::Wo) => ReplicaMode::WO,
        Ok(pb::ReplicaMode::Err) | Err(_) => ReplicaMode::ERR,
        Ok(pb::ReplicaMode::Unspecified) => ReplicaMode::parse(&r.mode).unwrap_or(ReplicaMode::ERR),
    }
}

/// The engine's verdict on its volume; `None` for one this manager does not know.
pub fn volume_state_of(info: &pb::VolumeInfo) -> Option<EngineVolumeState> {
    match pb::VolumeState::try_from(info.volume_state).ok()? {
        pb::VolumeState::Healthy => Some(EngineVolumeState::Healthy),
        pb::VolumeState::Degraded => Some(EngineVolumeState::Degraded),
        pb::VolumeState::Faulted => Some(EngineVolumeState::Faulted),
        pb::VolumeState::Unspecified => EngineVolumeState::parse(&info.state),
    }
}

/// A rebuild's state and kind (`None`: no rebuild since the engine started, or a state this
/// manager does not know).
fn rebuild_of(r: &pb::RebuildStatusResponse) -> Option<(RebuildState, RebuildKind)> {
    let state = match pb::RebuildState::try_from(r.rebuild_state).ok()? {
        pb::RebuildState::Idle => return None,
        pb::RebuildState::Running => RebuildState::Running,
        pb::RebuildState::Done => RebuildState::Done,
        pb::RebuildState::Failed => RebuildState::Failed,
        pb::RebuildState::Unspecified => {
            let state = RebuildState::parse(&r.state)?;
            let kind = RebuildKind::parse(&r.kind).unwrap_or(RebuildKind::Full);
            return Some((state, kind));
        }
    };
    let kind = match pb::RebuildKind::try_from(r.rebuild_kind) {
        Ok(pb::RebuildKind::CatchUp) => RebuildKind::CatchUp,
        // Full is what a rebuild of unknown kind may have to be.
        Ok(pb::RebuildKind::Full | pb::RebuildKind::Unspecified) | Err(_) => RebuildKind::Full,
    };
    Some((state, kind))
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
    let (state, kind) = rebuild_of(r)?;
    let names = by_address(volume, replicas);
    Some(RebuildProgress {
        replica: names
            .get(r.replica.as_str())
            .map_or_else(|| r.replica.clone(), |n| (*n).to_string()),
        state,
        kind,
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
    status.volume_state = volume_state_of(info);
    status.size = Some(ByteSize(info.size));
    let before = std::mem::take(&mut status.replica_modes);
    status.unknown_replicas.clear();
    for r in &info.replicas {
        let mode = mode_of(r);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(word: &str, typed: i32) -> pb::ReplicaStatus {
        pb::ReplicaStatus {
            mode: word.into(),
            replica_mode: typed,
            ..Default::default()
        }
    }

    #[test]
    fn states_are_read_from_the_enums_and_from_the_words_of_engines_before_protocol_3() {
        use pb::ReplicaMode as M;
        let cases = [
            // (word, enum, seen as)
            ("RW", M::Rw as i32, ReplicaMode::RW),
            ("", M::Wo as i32, ReplicaMode::WO),
            ("RW", M::Err as i32, ReplicaMode::ERR),
            // An engine of protocol 2: only the word.
            ("RW", 0, ReplicaMode::RW),
            ("WO", 0, ReplicaMode::WO),
            ("ERR", 0, ReplicaMode::ERR),
            // Nothing this manager knows: never in sync.
            ("SYNCING", 0, ReplicaMode::ERR),
            ("RW", 99, ReplicaMode::ERR),
        ];
        for (word, typed, want) in cases {
            assert_eq!(mode_of(&replica(word, typed)), want, "{word:?} {typed}");
        }

        let info = |word: &str, typed: pb::VolumeState| pb::VolumeInfo {
            state: word.into(),
            volume_state: typed as i32,
            ..Default::default()
        };
        use pb::VolumeState as V;
        assert_eq!(
            volume_state_of(&info("", V::Degraded)),
            Some(EngineVolumeState::Degraded)
        );
        assert_eq!(
            volume_state_of(&info("healthy", V::Unspecified)),
            Some(EngineVolumeState::Healthy)
        );
        assert_eq!(volume_state_of(&info("", V::Unspecified)), None);

        let rebuild = |word: &str, kind: &str, s: pb::RebuildState, k: pb::RebuildKind| {
            pb::RebuildStatusResponse {
                state: word.into(),
                kind: kind.into(),
                rebuild_state: s as i32,
                rebuild_kind: k as i32,
                ..Default::default()
            }
        };
        use pb::{RebuildKind as K, RebuildState as S};
        assert_eq!(
            rebuild_of(&rebuild("", "", S::Running, K::CatchUp)),
            Some((RebuildState::Running, RebuildKind::CatchUp))
        );
        assert_eq!(rebuild_of(&rebuild("", "", S::Idle, K::Unspecified)), None);
        assert_eq!(
            rebuild_of(&rebuild("done", "catch-up", S::Unspecified, K::Unspecified)),
            Some((RebuildState::Done, RebuildKind::CatchUp))
        );
        assert_eq!(
            rebuild_of(&rebuild("idle", "", S::Unspecified, K::Unspecified)),
            None
        );
    }
}
