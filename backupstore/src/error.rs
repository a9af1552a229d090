//! The crate's error type: one enum, with the object, chunk and offset a failure concerns in
//! its fields, so the line a user sees names what to look at.

use crate::ids::{BackupName, ChunkHash, FamilyId};

/// Everything that can go wrong in the backup store.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The target URL could not be understood.
    #[error("bad backup target URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    /// The S3 bucket does not exist.
    #[error("backup target {url}: bucket {bucket:?} does not exist")]
    MissingBucket { url: String, bucket: String },
    /// The credentials were refused.
    #[error("backup target {url}: credentials refused ({detail})")]
    BadCredentials { url: String, detail: String },
    /// The endpoint did not answer.
    #[error("backup target {url}: endpoint unreachable ({detail})")]
    Unreachable { url: String, detail: String },
    /// Settings that were required were not given.
    #[error("backup target {url}: {what} not set (give it explicitly or in {env})")]
    MissingSetting {
        url: String,
        what: &'static str,
        env: &'static str,
    },
    /// A name that cannot be used as an object key segment.
    #[error(
        "invalid {kind} name {name:?}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
    )]
    InvalidName { kind: &'static str, name: String },
    /// The caller broke the writer's or reader's contract.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// No such backup.
    #[error("backup {family}/{name} not found")]
    BackupNotFound { family: FamilyId, name: BackupName },
    /// A backup of that name already exists (the create-only manifest put refused).
    #[error("backup {family}/{name} already exists")]
    BackupExists { family: FamilyId, name: BackupName },
    /// A stored object failed its checks.
    #[error("corrupt object {object}: {reason}")]
    CorruptObject { object: String, reason: String },
    /// A chunk failed to decompress or did not match its hash.
    #[error("corrupt chunk {hash} (volume offset {offset}) in {object}: {reason}")]
    CorruptChunk {
        object: String,
        hash: ChunkHash,
        offset: u64,
        reason: String,
    },
    /// A chunk a manifest references is in no pack.
    #[error("chunk {hash} (volume offset {offset}) of backup {backup} is in no pack of the store")]
    MissingChunk {
        backup: String,
        hash: ChunkHash,
        offset: u64,
    },
    /// The store was written by a newer format.
    #[error("{object}: format version {found} is newer than this build reads ({supported})")]
    UnsupportedFormat {
        object: String,
        found: u32,
        supported: u32,
    },
    /// The writer's session marker lapsed (heartbeats failed or were too slow), so a GC may have
    /// stopped protecting the packs it deduplicated against; the backup must be retried.
    #[error("backup session {session} expired before commit ({reason}); retry the backup")]
    SessionExpired { session: String, reason: String },
    /// A GC lost its lease to another one while it ran (it was too slow to renew it).
    #[error("gc of family {family}: lease lost to generation {by}")]
    LeaseLost { family: FamilyId, by: u64 },
    /// The object store failed an operation.
    #[error("backup target {url}: {op} {key}: {source}")]
    Store {
        url: String,
        op: &'static str,
        key: String,
        source: Box<object_store::Error>,
    },
    /// Local file I/O (the index cache, a file to back up or restore into).
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A background task panicked or was cancelled.
    #[error("internal task failed: {0}")]
    Task(String),
}

/// The crate's result type.
pub type Result<T, E = BackupError> = std::result::Result<T, E>;

impl BackupError {
    pub(crate) fn io(path: impl std::fmt::Display, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_string(),
            source,
        }
    }
}

impl From<tokio::task::JoinError> for BackupError {
    fn from(e: tokio::task::JoinError) -> Self {
        Self::Task(e.to_string())
    }
}
