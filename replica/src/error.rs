//! The replica crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in a replica, with the context needed to act on it.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The request itself is wrong: nothing was done.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The range lies (partly) outside the volume.
    #[error("range {offset}+{length} is outside the volume of {size} bytes")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("snapshot {0:?} does not exist")]
    UnknownSnapshot(String),
    #[error("snapshot {0:?} already exists")]
    SnapshotExists(String),
    /// The engine's generation is lower than one this replica already accepted.
    #[error("generation {offered} is lower than the accepted generation {accepted}")]
    StaleGeneration { offered: u64, accepted: u64 },
    #[error("the replica is closed")]
    Closed,
    /// Its files went away under it (unlinked, truncated): it serves nothing any more.
    #[error("the replica is lost: {0}")]
    Lost(String),
    /// The replica belongs to another volume than the one a client named (or names none
    /// while the replica belongs to one): nothing was done.
    #[error(
        "replica {replica} belongs to volume {has}, not to volume {offered}; refused (nothing \
         was fenced or written)"
    )]
    WrongVolume {
        replica: String,
        has: String,
        offered: String,
    },
    /// The replica records no volume and is not fresh, and the client did not say it lists
    /// it as a member (see `Replica::claim_volume`).
    #[error(
        "replica {replica} records no volume (made before volume identity) and was a member of \
         epoch {epoch}; only an engine that lists it as a current member may adopt it for volume \
         {offered} (give it a fresh directory to rebuild it)"
    )]
    UnclaimedVolume {
        replica: String,
        epoch: u64,
        offered: String,
    },
    #[error("{dir}: holds a replica of {found} bytes, not {wanted}")]
    SizeMismatch {
        dir: PathBuf,
        found: u64,
        wanted: u64,
    },
    #[error("{dir}: not a replica directory ({why})")]
    NotAReplica { dir: PathBuf, why: String },
    #[error("{path}: corrupt metadata: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("no space left on the replica's disk: {0}")]
    NoSpace(String),
    /// Blocks whose data does not match the checksum stored with them: the data there is
    /// damaged (or was never completely written) and must not be served as good.
    #[error("{} block(s) of {offset}+{length} fail their checksum (first at offset {})", blocks.len(), blocks.first().copied().unwrap_or(*offset))]
    ChecksumMismatch {
        offset: u64,
        length: u64,
        /// Byte offsets of the failing 4 KiB blocks.
        blocks: Vec<u64>,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl ReplicaError {
    /// Wraps an I/O error with what was being done; ENOSPC becomes [`ReplicaError::NoSpace`].
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        let what = what.into();
        if source.raw_os_error() == Some(libc::ENOSPC) {
            ReplicaError::NoSpace(what)
        } else {
            ReplicaError::Io { what, source }
        }
    }
}

pub type Result<T, E = ReplicaError> = std::result::Result<T, E>;
