//! `zebu-backup`: the data path of backups and restores, between a volume's replicas and the
//! backup store (`zebu-backupstore`), and the `zebu-backup-run` process that carries out one
//! of them as a job.
//!
//! - [`replica`]: [`ReplicaLink`], the only place that connects to a replica (its sync RPCs).
//! - [`chain`]: a snapshot's layers and which layer each byte of it is read from.
//! - [`read`]: [`SnapshotReader`], a consistent snapshot read from one replica while I/O
//!   goes on, in windows, continuing on another replica if one dies.
//! - [`backup_job`]: one backup, incremental to a parent when the parent's snapshot is still
//!   in the chain (only the layers above it are read), else a full read that dedup makes
//!   cheap; the manifest is committed last.
//! - [`restore_job`]: one restore into every replica of a volume as a snapshot layer, whole
//!   or as the difference from a backup the replicas already hold (standby volumes).
//! - [`job`]: the job file the node agent writes and the report file the process keeps.
//! - [`target`]: a target from its URL and a credentials file or the AWS variables.
//!
//! Why a process per job (`zebu-backup-run --job FILE`), started by the node agent of a node
//! holding a replica: a backup outlives a manager or an engine that is killed meanwhile (it
//! reads the replicas directly and needs neither), and a backup whose process is killed
//! leaves no manifest, so it does not exist and its retry starts clean, deduplicating against
//! the packs the killed one had uploaded (GC removes them if no retry comes).
//!
//! ```no_run
//! # async fn demo() -> Result<(), zebu_backup::read::ReadError> {
//! use zebu_backup::SnapshotReader;
//! let r = SnapshotReader::open("db", "snap-1", &["127.0.0.11:9501".to_string()]).await?;
//! let written = r.extents_since(None).await.unwrap_or_default();
//! let first_mib = r.read(0..1 << 20).await?.slice(0..1 << 20);
//! # let _ = (written, first_mib); Ok(()) }
//! ```

pub mod backup_job;
pub mod chain;
pub mod job;
pub mod read;
pub mod replica;
pub mod report;
pub mod restore_job;
pub mod target;

pub use job::{JobKind, JobReport, JobSpec, JobState};
pub use read::SnapshotReader;
pub use replica::ReplicaLink;

/// Runs one job to its end, keeping its report at [`job::report_path`]`(job_file)`.
pub async fn run_job(spec: &JobSpec, job_file: &std::path::Path) -> Result<JobReport, String> {
    let rep = report::Reporter::new(job::report_path(job_file));
    rep.update(|r| r.run_id = spec.run_id.clone());
    let outcome = match use_secret(spec) {
        Err(f) => Err(f),
        Ok(()) => match &spec.job {
            JobKind::Backup(b) => backup_job::run(spec, b, &rep).await,
            JobKind::Restore(r) => restore_job::run(spec, r, &rep).await,
        },
    };
    if let Err(e) = rep.finish(outcome.as_ref().map(|_| ())) {
        return Err(format!("cannot write the job report: {e}"));
    }
    match outcome {
        Ok(()) => Ok(rep.snapshot()),
        Err(f) => Err(f.message),
    }
}

/// Loads the job's volume secret, if it names one, for every replica call of this process,
/// and the replicas' CA, if the job names one, for every replica connection.
fn use_secret(spec: &JobSpec) -> Result<(), report::JobFailure> {
    if let Some(ca) = &spec.tls_ca {
        let tls = zebu_proto::tls::connector(ca)
            .map_err(|e| report::JobFailure::permanent(format!("the replicas' CA: {e}")))?;
        replica::set_replica_tls(tls).map_err(report::JobFailure::permanent)?;
    }
    let Some(path) = &spec.secret_file else {
        return Ok(());
    };
    let secret = zebu_proto::auth::Secret::load(path)
        .map_err(|e| report::JobFailure::permanent(format!("the volume's secret: {e}")))?;
    replica::set_volume_secret(secret).map_err(report::JobFailure::permanent)
}

// Offsets are u64 and buffers usize; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
