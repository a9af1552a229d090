//! A job for the `zebu-backup-run` process, and the report it leaves.
//!
//! The node agent writes a [`JobSpec`] as JSON, starts `zebu-backup-run --job FILE`, and
//! reads the [`JobReport`] the process keeps at `FILE.report.json` (rewritten atomically:
//! temp file, fsync, rename) while it runs and when it ends. The process needs nothing
//! else: no store, no manager. So a manager killed mid-backup leaves the upload running and
//! the agent of the next manager finds the process by its command line and reads its report;
//! a process killed mid-backup leaves no manifest (the store's commit point), so the backup
//! does not exist and the agent starts the job again. A job that finds its manifest already
//! there (killed after the commit, before its report said so) reports it as done.
//!
//! Credentials are never in the spec: `credentials` names a file (mode 0600) with
//! `AWS_*=value` lines, which the manager writes from the target's Secret; without one the
//! process uses the standard AWS variables it inherited.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the backups go or come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetRef {
    /// `s3://BUCKET@REGION/PREFIX` or `file:///PATH`.
    pub url: String,
    /// A file of `AWS_ACCESS_KEY_ID=...` lines; `None`: this process's environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<PathBuf>,
}

/// The backup an incremental one builds on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    pub backup: String,
    /// Its snapshot: the layers above it in the new snapshot's chain are what changed.
    pub snapshot: String,
}

/// Back up one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupJob {
    pub family: String,
    pub backup: String,
    pub volume: String,
    pub snapshot: String,
    /// The replicas to read from (`host:port`), in order of preference.
    pub replicas: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// Write one backup into a volume's replicas as a snapshot layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreJob {
    pub family: String,
    pub backup: String,
    /// A backup the replicas already hold (as layer `base_layer`): only what differs is
    /// written (a standby volume following its source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    pub volume: String,
    /// Every replica of the volume (`host:port`); the restore writes each of them.
    pub replicas: Vec<String>,
    /// The layer the backup becomes (a snapshot of the restored volume).
    pub layer: String,
    /// The layer it goes on top of (empty: the bottom of the chain).
    #[serde(default)]
    pub base_layer: String,
    /// The volume's size (the layer's size; at least the backup's).
    pub volume_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum JobKind {
    Backup(BackupJob),
    Restore(RestoreJob),
}

/// What `zebu-backup-run --job FILE` reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobSpec {
    pub target: TargetRef,
    /// The family index cache of this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// The attempt's id, recorded by the controller in the Backup's status before this
    /// process was started; the report carries it back, so a report is matched to its run.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// The ttl of the writer's session marker in the target, seconds (`None`: the store's
    /// default); a killed run's packs are protected from GC this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_ttl_secs: Option<u64>,
    /// The volume's secret file (mode 0600; issue 18): the replicas of the job's volume serve
    /// only clients that prove it. `None` for a volume made before volume secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// The CA the replicas' certificates are checked against, when the cluster's replica
    /// ports speak TLS (issue 18; `zebu_agent::tls`). `None`: plain TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    pub job: JobKind,
}

impl JobSpec {
    /// The session times this job's writer keeps: the ttl asked for, a heartbeat a tenth of
    /// it (at most a minute), so several heartbeats may fail before the marker lapses.
    pub fn session_times(&self) -> zebu_backupstore::SessionTimes {
        match self.session_ttl_secs {
            Some(t) if t > 0 => {
                let ttl = std::time::Duration::from_secs(t);
                zebu_backupstore::SessionTimes {
                    ttl,
                    heartbeat: (ttl / 10).min(std::time::Duration::from_secs(60)),
                }
            }
            _ => zebu_backupstore::SessionTimes::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    #[default]
    Running,
    Done,
    Failed,
}

/// What a job did, as its process reports it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobReport {
    pub state: JobState,
    /// The run this report is of ([`JobSpec::run_id`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// Bytes of the volume to go through (a backup: the chunks planned; a restore: the
    /// chunks to write).
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// Bytes read from replicas (backups).
    pub bytes_read: u64,
    /// Bytes uploaded to the target (backups) or downloaded from it (restores).
    pub bytes_transferred: u64,
    /// Bytes written into replicas (restores; every replica counted once).
    pub bytes_written: u64,
    /// Objects the job put into the target.
    pub objects: u64,
    pub elapsed_secs: f64,
    /// The backup's data bytes (not holes), once it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_size: Option<u64>,
    /// The backup's time of creation (Unix ms), once it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_unix_ms: Option<u64>,
    /// Incremental to this backup (the parent actually used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Replicas a restore wrote successfully (their ids), or the replica a backup read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// The job process's peak resident memory, written when the job ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    /// The error is the caller's (bad input, missing snapshot): retrying will not help.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub permanent: bool,
}

impl JobReport {
    /// Percent done, 0..=100.
    pub fn percent(&self) -> u8 {
        if self.state == JobState::Done {
            return 100;
        }
        match self.bytes_total {
            0 => 0,
            t => (self.bytes_done.saturating_mul(100) / t).min(99) as u8,
        }
    }
}

/// The report file of a job file.
pub fn report_path(job: &Path) -> PathBuf {
    let mut s = job.as_os_str().to_owned();
    s.push(".report.json");
    PathBuf::from(s)
}

/// Writes `value` as JSON at `path` atomically (temp file, fsync, rename, fsync the
/// directory), so a reader sees the old or the new report, never half of one.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Reads a JSON file; `None` if it is missing or not (yet) valid.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    let b = std::fs::read(path).ok()?;
    serde_json::from_slice(&b).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_round_trips_and_a_report_is_written_whole() {
        let spec = JobSpec {
            target: TargetRef {
                url: "s3://b@us-east-1/p".into(),
                credentials: None,
            },
            cache_dir: None,
            secret_file: None,
            tls_ca: None,
            run_id: "v-1-0001".into(),
            session_ttl_secs: Some(30),
            job: JobKind::Backup(BackupJob {
                family: "v".into(),
                backup: "v-1".into(),
                volume: "v".into(),
                snapshot: "s".into(),
                replicas: vec!["127.0.0.11:1".into()],
                parent: Some(ParentRef {
                    backup: "v-0".into(),
                    snapshot: "s0".into(),
                }),
                labels: Default::default(),
            }),
        };
        let json = serde_json::to_string(&spec).expect("json");
        assert!(json.contains(r#""kind":"backup""#), "{json}");
        assert_eq!(serde_json::from_str::<JobSpec>(&json).expect("back"), spec);
        let dir = tempfile::tempdir().expect("dir");
        let job = dir.path().join("j.json");
        let report = JobReport {
            bytes_total: 10,
            bytes_done: 5,
            ..Default::default()
        };
        write_json_atomic(&report_path(&job), &report).expect("write");
        let back: JobReport = read_json(&report_path(&job)).expect("read");
        assert_eq!(back.percent(), 50);
        assert!(read_json::<JobReport>(&dir.path().join("missing")).is_none());
    }
}
