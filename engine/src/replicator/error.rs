//! Why a control operation of the replicator failed (rebuild, catch-up, reconcile, snapshots,
//! expand, scrub, replica removal).
//!
//! Frontends never see these: their I/O fails with a [`BlockError`]. These go to the
//! engine's control server, which answers them to the manager and the `zebu-engine` CLI with
//! the error's text, so every message names what a person needs to act on (the volume, the
//! replica address, the offset), and the same facts are in fields for code that matches on
//! them. Text that came from a replica (a gRPC status message) is kept as the replica wrote
//! it, in `message`.

use super::{Mode, PathError};
use crate::blockdev::BlockError;

/// A control operation's failure. See the module docs.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The volume itself cannot go on (faulted, disk full, a flush failed): the same error
    /// the frontends get.
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error("replica {replica} is not part of volume {volume}")]
    NotMember { volume: String, replica: String },
    #[error("replica {replica} is the last RW replica of volume {volume}; it cannot be removed")]
    LastRw { volume: String, replica: String },
    #[error("replica {replica} is already {mode} in volume {volume}")]
    AlreadyMember {
        volume: String,
        replica: String,
        mode: Mode,
    },
    #[error("a rebuild of {replica} is already running")]
    RebuildRunning { volume: String, replica: String },
    /// Snapshot delete, revert and purge change the layers a rebuild copies.
    #[error("cannot {op} while a replica is rebuilding")]
    Rebuilding { volume: String, op: &'static str },
    /// The data path to a replica failed.
    #[error("{replica}: {source}")]
    Path {
        volume: String,
        replica: String,
        #[source]
        source: Box<PathError>,
    },
    /// A control RPC to a replica failed (`call` names it: Info, Checksums, ...).
    #[error("{replica}: {call}: {message}")]
    Rpc {
        volume: String,
        replica: String,
        call: &'static str,
        message: String,
    },
    /// The replica records another volume's uuid (issue 18): it is left alone.
    #[error(
        "{replica}: replica {replica_id} belongs to volume {theirs}, not to volume {volume} \
         ({uuid}); refused, nothing was fenced or written"
    )]
    Foreign {
        volume: String,
        uuid: String,
        replica: String,
        replica_id: String,
        theirs: String,
    },
    #[error("{replica}: size {size} differs from the volume size {volume_size}")]
    SizeMismatch {
        volume: String,
        replica: String,
        size: u64,
        volume_size: u64,
    },
    /// A former member whose snapshot chain is not the volume's: catch-up cannot fix it and a
    /// full rebuild would mix lineages.
    #[error(
        "{replica} holds data of an older lineage (epoch {epoch}, snapshots {theirs:?}; the \
         volume has {ours:?}); give it a fresh directory"
    )]
    OlderLineage {
        volume: String,
        replica: String,
        epoch: u64,
        theirs: Vec<String>,
        ours: Vec<String>,
    },
    /// The rebuild target went ERR while it was being rebuilt (`reason` says why).
    #[error("{replica} failed during the rebuild: {reason}")]
    FailedDuringRebuild {
        volume: String,
        replica: String,
        reason: String,
    },
    #[error("the rebuild snapshot failed on the target: {reason}")]
    RebuildSnapshot {
        volume: String,
        replica: String,
        reason: String,
    },
    /// A layer copy (rebuild, snapshot block repair) failed on `replica`.
    #[error("{message}")]
    LayerCopy {
        volume: String,
        replica: String,
        message: String,
    },
    /// Two replicas answered checksums for the same range with different counts.
    #[error("{source_replica} and {target} answered checksums of different lengths")]
    SumsDiffer {
        volume: String,
        source_replica: String,
        target: String,
        offset: u64,
        length: u64,
    },
    #[error("replicas answered checksums of the wrong length for {offset}+{length}")]
    SumsLength {
        volume: String,
        offset: u64,
        length: u64,
    },
    /// A replica refused the operation as wrong (a bad or duplicate snapshot name, an unknown
    /// snapshot): the replica is fine and nothing changed on it.
    #[error("{message}")]
    Refused {
        volume: String,
        replica: String,
        message: String,
    },
    #[error("cannot shrink volume {volume} from {size} to {wanted} bytes")]
    Shrink {
        volume: String,
        size: u64,
        wanted: u64,
    },
    #[error("volume {volume}: cannot expand to {wanted} bytes: replica {replica}: {message}")]
    ExpandRefused {
        volume: String,
        replica: String,
        wanted: u64,
        message: String,
    },
    #[error("a scrub of volume {volume} is already running")]
    ScrubRunning { volume: String },
    #[error("volume {volume} has no RW replica that keeps checksums")]
    NoVerifyingReplica { volume: String },
    #[error("snapshot {layer} is gone from {replica}")]
    SnapshotGone {
        volume: String,
        replica: String,
        layer: String,
    },
    #[error("no other replica holds a good copy of the block at {offset}")]
    NoGoodCopy { volume: String, offset: u64 },
}

/// Setting the process's volume secret twice.
#[derive(Debug, thiserror::Error)]
#[error("the volume secret is already set")]
pub struct SecretAlreadySet;

/// Setting the process's TLS to the replicas twice.
#[derive(Debug, thiserror::Error)]
#[error("TLS to the replicas is already set")]
pub struct TlsAlreadySet;

/// A `--data-transport` value that names no transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown data transport '{0}' (use frames or grpc)")]
pub struct UnknownTransport(pub String);
