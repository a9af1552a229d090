//! Translations between the store's types and the wire types: errors to gRPC codes (control
//! RPCs) and to [`DataStatus`] values (data stream), and [`ReplicaInfo`] to `InfoResponse`.

use tonic::{Code, Status};
use zebu_proto::replica as pb;

use crate::error::ReplicaError;
use crate::store::{BLOCK_SIZE, LayerInfo, ReplicaInfo};

/// The data stream's per-request status (`zebu.replica.v1.Status`).
pub use pb::Status as DataStatus;

/// The gRPC code a control RPC answers with when the store fails with `e`.
pub fn code_of(e: &ReplicaError) -> Code {
    match e {
        ReplicaError::Invalid(_) | ReplicaError::OutOfRange { .. } => Code::InvalidArgument,
        ReplicaError::UnknownSnapshot(_) => Code::NotFound,
        ReplicaError::SnapshotExists(_) => Code::AlreadyExists,
        ReplicaError::StaleGeneration { .. }
        | ReplicaError::WrongVolume { .. }
        | ReplicaError::UnclaimedVolume { .. } => Code::FailedPrecondition,
        ReplicaError::Closed => Code::Unavailable,
        ReplicaError::NoSpace(_) => Code::ResourceExhausted,
        ReplicaError::ChecksumMismatch { .. } => Code::DataLoss,
        ReplicaError::SizeMismatch { .. }
        | ReplicaError::NotAReplica { .. }
        | ReplicaError::Corrupt { .. }
        | ReplicaError::Lost(_)
        | ReplicaError::Io { .. } => Code::Internal,
    }
}

/// A control RPC's error: the code from [`code_of`] and the error's full text.
pub fn to_status(e: ReplicaError) -> Status {
    Status::new(code_of(&e), e.to_string())
}

/// The data-stream status a failed request is answered with.
pub fn data_status_of(e: &ReplicaError) -> DataStatus {
    match e {
        ReplicaError::Invalid(_)
        | ReplicaError::OutOfRange { .. }
        | ReplicaError::UnknownSnapshot(_)
        | ReplicaError::SnapshotExists(_)
        | ReplicaError::WrongVolume { .. }
        | ReplicaError::UnclaimedVolume { .. } => DataStatus::Invalid,
        // A fenced or closed replica cannot serve this engine; retrying elsewhere helps.
        ReplicaError::Closed | ReplicaError::StaleGeneration { .. } => DataStatus::Unavailable,
        ReplicaError::NoSpace(_) => DataStatus::NoSpace,
        ReplicaError::ChecksumMismatch { .. } => DataStatus::Corrupt,
        ReplicaError::SizeMismatch { .. }
        | ReplicaError::NotAReplica { .. }
        | ReplicaError::Corrupt { .. }
        | ReplicaError::Lost(_)
        | ReplicaError::Io { .. } => DataStatus::IoError,
    }
}

fn layer_to_pb(l: LayerInfo) -> pb::LayerInfo {
    pb::LayerInfo {
        id: l.id,
        name: l.name,
        parent: l.parent,
        head: l.head,
        user_created: l.user_created,
        data_bytes: l.data_bytes,
        created: l.created,
        labels: l.labels.into_iter().collect(),
        size: l.size,
        incomplete: l.incomplete,
        rebuilt: l.rebuilt,
    }
}

/// The wire form of a replica's info; `open` says whether the replica is open now.
pub fn info_to_pb(info: ReplicaInfo, open: bool) -> pb::InfoResponse {
    pb::InfoResponse {
        protocol_version: pb::PROTOCOL_VERSION,
        size: info.size,
        block_size: BLOCK_SIZE as u32,
        generation: info.generation,
        epoch: info.epoch,
        epoch_members: info.epoch_members,
        flush_number: info.flush_number,
        layers: info.layers.into_iter().map(layer_to_pb).collect(),
        regions: Some(pb::RegionSummary {
            region_size: info.region_size,
            region_count: info.region_count,
            dirty: info.dirty_regions,
        }),
        open,
        checksums: Some(pb::ChecksumSummary {
            unverified_bytes: info.unverified_bytes,
            adopted_blocks: info.adopted_blocks,
            corrupt_found: info.corrupt_found,
        }),
        replica_id: info.replica_id,
        volume_uuid: info.volume_uuid.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_names_the_volume_size() {
        let e = ReplicaError::OutOfRange {
            offset: 8192,
            length: 4096,
            size: 8192,
        };
        assert_eq!(data_status_of(&e), DataStatus::Invalid);
        let s = to_status(e);
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().contains("outside the volume of 8192 bytes"),
            "{}",
            s.message()
        );
    }

    #[test]
    fn enospc_is_no_space_everywhere() {
        let e = ReplicaError::io(
            "write head",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(data_status_of(&e), DataStatus::NoSpace);
        assert_eq!(code_of(&e), Code::ResourceExhausted);
        let e = ReplicaError::io("write head", std::io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(data_status_of(&e), DataStatus::IoError);
        assert_eq!(code_of(&e), Code::Internal);
    }

    #[test]
    fn control_codes() {
        assert_eq!(
            code_of(&ReplicaError::UnknownSnapshot("s".into())),
            Code::NotFound
        );
        assert_eq!(
            code_of(&ReplicaError::SnapshotExists("s".into())),
            Code::AlreadyExists
        );
        assert_eq!(code_of(&ReplicaError::Closed), Code::Unavailable);
        let stale = ReplicaError::StaleGeneration {
            offered: 1,
            accepted: 2,
        };
        assert_eq!(code_of(&stale), Code::FailedPrecondition);
        assert_eq!(data_status_of(&stale), DataStatus::Unavailable);
    }
}
