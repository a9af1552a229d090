//! The `zebu-backup-run` processes of the backup controller: one per backup or restore
//! attempt, started with a job file, watched through the report file it keeps.
//!
//! A process is found again after a manager restart by its command line (`--job FILE`), so
//! a manager killed mid-backup neither loses nor duplicates the upload. An attempt's
//! outcome is its report: `done`, `failed` (permanent or not), or still `running` in a
//! report whose process is gone, which means the process was killed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use zebu_backup::job::{JobReport, JobSpec, read_json, report_path, write_json_atomic};

use crate::changes::Changes;

/// How often a controller looks whether one of its job processes exited (a `waitpid` each, no
/// store access): the pass that records the outcome runs then, not at its next period.
const EXIT_POLL: Duration = Duration::from_millis(50);

/// The wait between two passes of a controller that runs jobs: until one of its job
/// processes exited, a watched change came, or `period` passed.
pub async fn wait_for_work(jobs: &mut Jobs, changes: &mut Changes, period: Duration) {
    let exited = async {
        loop {
            tokio::time::sleep(EXIT_POLL).await;
            if jobs.reap_exited() {
                break;
            }
        }
    };
    tokio::select! {
        _ = changes.wait(period) => {}
        _ = exited => {}
    }
}

/// The binary that runs jobs.
pub const RUNNER: &str = "zebu-backup-run";

/// Where the runner binary is: `$ZEBU_BIN_DIR`, else next to the running program.
pub fn runner_binary() -> PathBuf {
    let dir = std::env::var_os("ZEBU_BIN_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
        })
        .unwrap_or_default();
    dir.join(RUNNER)
}

/// How an attempt stands, from its process and its report.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    /// No attempt was made (no report).
    None,
    Running(JobReport),
    Done(JobReport),
    Failed(JobReport),
    /// The process is gone without a final report (killed).
    Killed(JobReport),
}

/// The jobs of one controller, by job name.
pub struct Jobs {
    dir: PathBuf,
    children: HashMap<String, Child>,
}

impl Jobs {
    pub fn new(dir: PathBuf) -> Self {
        Jobs {
            dir,
            children: HashMap::new(),
        }
    }

    pub fn job_file(&self, job: &str) -> PathBuf {
        self.dir.join(format!("{job}.json"))
    }

    /// Whether the job's process runs (ours, or one found by its command line).
    pub fn running(&mut self, job: &str) -> bool {
        if let Some(c) = self.children.get_mut(job) {
            match c.try_wait() {
                Ok(None) => return true,
                _ => {
                    self.children.remove(job);
                    return false;
                }
            }
        }
        find_pid(&self.job_file(job)).is_some()
    }

    /// Forgets the processes this controller started that have exited (reaping them), and
    /// says whether there were any: the pass after it reads their reports. Processes found
    /// by their command line after a restart are not ours to wait for; the controller's
    /// period finds those.
    pub fn reap_exited(&mut self) -> bool {
        let before = self.children.len();
        self.children
            .retain(|_, c| matches!(c.try_wait(), Ok(None)));
        self.children.len() != before
    }

    /// The attempt's state.
    pub fn attempt(&mut self, job: &str) -> Attempt {
        let running = self.running(job);
        let report: Option<JobReport> = read_json(&report_path(&self.job_file(job)));
        match report {
            None if running => Attempt::Running(JobReport::default()),
            None => Attempt::None,
            Some(r) => match r.state {
                zebu_backup::JobState::Done => Attempt::Done(r),
                zebu_backup::JobState::Failed => Attempt::Failed(r),
                zebu_backup::JobState::Running if running => Attempt::Running(r),
                zebu_backup::JobState::Running => Attempt::Killed(r),
            },
        }
    }

    /// Starts an attempt: a fresh job file, no report, a new process.
    pub fn start(&mut self, job: &str, spec: &JobSpec) -> std::io::Result<u32> {
        std::fs::create_dir_all(&self.dir)?;
        let file = self.job_file(job);
        let _ = std::fs::remove_file(report_path(&file));
        write_json_atomic(&file, spec)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{job}.log")))?;
        let child = Command::new(runner_binary())
            .arg("--job")
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot start {}: {e}", runner_binary().display()),
                )
            })?;
        let pid = child.id();
        self.children.insert(job.to_string(), child);
        tracing::info!(job, pid, "backup job process started");
        Ok(pid)
    }

    /// Stops the job's process, if it runs, and waits for it.
    pub fn kill(&mut self, job: &str) {
        if let Some(mut c) = self.children.remove(job) {
            let _ = c.kill();
            let _ = c.wait();
        } else if let Some(pid) = find_pid(&self.job_file(job)) {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }

    /// Removes a finished job's files (its log stays).
    pub fn forget(&mut self, job: &str) {
        let file = self.job_file(job);
        let _ = std::fs::remove_file(report_path(&file));
        let _ = std::fs::remove_file(&file);
    }
}

impl Drop for Jobs {
    /// Reaps the processes of this controller that have ended (killed ones, when it stops
    /// because its manager lost the cluster Lease); those still running go on unreaped.
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            let _ = c.try_wait();
        }
    }
}

/// Pids of running `zebu-backup-run --job FILE` processes whose job file passes `wanted`.
fn runner_pids(wanted: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // A zombie's cmdline is empty: it runs no more.
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            args.first().is_some_and(|a| a.ends_with(RUNNER.as_bytes()))
                && args.windows(2).any(|w| w[0] == b"--job" && wanted(w[1]))
        })
        .collect()
}

/// The pid of a running `zebu-backup-run --job FILE`, found by its command line.
pub fn find_pid(job_file: &Path) -> Option<u32> {
    let want = job_file.as_os_str().as_encoded_bytes();
    runner_pids(|f| f == want).into_iter().next()
}

/// Kills (SIGKILL) every running job process whose job file is in `dir`, whoever started
/// it (this manager's controller now, or before a restart), and waits up to a second for
/// them to be gone; returns their pids. A killed backup leaves no manifest, so nothing is
/// committed; its report says `running` with no process behind it, which counts as a
/// killed attempt.
pub fn kill_all_in(dir: &Path) -> Vec<u32> {
    let prefix = dir.as_os_str().as_encoded_bytes();
    let in_dir = |f: &[u8]| {
        f.strip_prefix(prefix)
            .is_some_and(|rest| rest.first() == Some(&b'/'))
    };
    let pids = runner_pids(in_dir);
    for pid in &pids {
        let _ = Command::new("kill")
            .arg("-9")
            .arg(pid.to_string())
            .stderr(Stdio::null())
            .status();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while !pids.is_empty()
        && runner_pids(in_dir).iter().any(|p| pids.contains(p))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    pids
}
