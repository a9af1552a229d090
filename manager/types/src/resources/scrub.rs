//! A volume's scrubs as the manager records them: a scrub runs in the volume's engine (it
//! reads every allocated block of every replica, checks it against its checksum, compares
//! the replicas and repairs what it can), but the engine keeps its report only while it runs,
//! so the manager copies each finished one into the volume's status
//! ([`VolumeStatus::last_scrub`](super::VolumeStatus::last_scrub)), where it outlives the
//! engine process.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a scrub is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScrubState {
    Running,
    /// Ran over the whole volume.
    Done,
    /// Stopped by someone before its end.
    Stopped,
    /// Could not go on (see `error`).
    Failed,
}

impl ScrubState {
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubState::Running => "running",
            ScrubState::Done => "done",
            ScrubState::Stopped => "stopped",
            ScrubState::Failed => "failed",
        }
    }
}

/// One scrub's progress and findings. Blocks are 4 KiB; a block counts once per replica and
/// layer it was checked on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScrubReport {
    pub state: ScrubState,
    /// RFC 3339.
    pub started: String,
    /// RFC 3339; unset while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    /// The engine's start time in milliseconds: with `started` it names this scrub (two
    /// scrubs can start within one second).
    pub started_unix_ms: i64,
    /// Volume bytes gone over, of `bytesTotal`.
    pub bytes_scanned: u64,
    pub bytes_total: u64,
    /// Data blocks read and checked against their checksums, over every replica.
    pub blocks_checked: u64,
    /// Data bytes checked per second (over every replica).
    pub bytes_per_second: u64,
    /// The rate limit it ran under (bytes per second, over every replica).
    pub rate_limit: u64,
    /// Blocks that failed their checksum.
    pub mismatches: u64,
    /// Of those, blocks rewritten from a good copy on another replica.
    pub repaired: u64,
    /// Blocks no replica held a good copy of: reads of them fail with a medium error.
    pub unrecoverable: u64,
    /// Blocks whose replicas each passed their checksums but held different data.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub divergent: u64,
    /// Of those, blocks set right from the version most replicas held.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub divergent_repaired: u64,
    /// Data bytes on replicas still computing their checksums (upgraded replicas), so not
    /// checked.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_unverified: u64,
    /// The replicas (addresses) it checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ScrubReport {
    /// Whether it found something it could not set right.
    pub fn left_damage(&self) -> bool {
        self.unrecoverable > 0 || self.divergent > self.divergent_repaired
    }
}

/// What `GET /v1/volumes/{name}/scrub` answers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScrubInfo {
    /// The running engine's current scrub, or the last one it ran; unset when the volume is
    /// not attached or its engine has scrubbed nothing since it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<ScrubReport>,
    /// The last finished scrub, as recorded in the volume's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<ScrubReport>,
}
