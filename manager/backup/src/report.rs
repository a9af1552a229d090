//! The running job's report file, rewritten at most every [`EVERY`] while the job runs and
//! once when it ends.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::job::{JobReport, JobState, write_json_atomic};

const EVERY: Duration = Duration::from_millis(500);

/// Why a job failed, and whether trying again can help.
#[derive(Debug)]
pub struct JobFailure {
    pub message: String,
    /// The caller's mistake or broken data: a retry will fail the same way.
    pub permanent: bool,
}

impl JobFailure {
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            permanent: true,
        }
    }

    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            permanent: false,
        }
    }
}

impl From<zebu_backupstore::BackupError> for JobFailure {
    fn from(e: zebu_backupstore::BackupError) -> Self {
        use zebu_backupstore::BackupError as E;
        let permanent = matches!(
            e,
            E::BadUrl { .. }
                | E::MissingBucket { .. }
                | E::BadCredentials { .. }
                | E::MissingSetting { .. }
                | E::InvalidName { .. }
                | E::InvalidInput(_)
                | E::BackupNotFound { .. }
                | E::CorruptObject { .. }
                | E::CorruptChunk { .. }
                | E::MissingChunk { .. }
                | E::UnsupportedFormat { .. }
        );
        Self {
            message: e.to_string(),
            permanent,
        }
    }
}

/// Keeps a job's report and its file.
pub struct Reporter {
    path: PathBuf,
    start: Instant,
    inner: Mutex<(JobReport, Instant)>,
}

impl Reporter {
    pub fn new(path: PathBuf) -> Self {
        let now = Instant::now();
        Self {
            path,
            start: now,
            inner: Mutex::new((JobReport::default(), now - EVERY)),
        }
    }

    /// Changes the report; writes the file if the last write is older than [`EVERY`].
    pub fn update(&self, f: impl FnOnce(&mut JobReport)) {
        let mut g = self.inner.lock().expect("invariant: report lock");
        f(&mut g.0);
        g.0.elapsed_secs = self.start.elapsed().as_secs_f64();
        if g.1.elapsed() >= EVERY {
            g.1 = Instant::now();
            if let Err(e) = write_json_atomic(&self.path, &g.0) {
                tracing::warn!(path = %self.path.display(), "cannot write the job report: {e}");
            }
        }
    }

    /// A copy of the report as it stands.
    pub fn snapshot(&self) -> JobReport {
        self.inner.lock().expect("invariant: report lock").0.clone()
    }

    /// Writes the final report (done, or failed with `failure`).
    pub fn finish(&self, outcome: Result<(), &JobFailure>) -> std::io::Result<()> {
        let mut g = self.inner.lock().expect("invariant: report lock");
        g.0.elapsed_secs = self.start.elapsed().as_secs_f64();
        g.0.peak_rss_bytes = peak_rss_bytes();
        match outcome {
            Ok(()) => {
                g.0.state = JobState::Done;
                g.0.bytes_done = g.0.bytes_total;
            }
            Err(f) => {
                g.0.state = JobState::Failed;
                g.0.error = f.message.clone();
                g.0.permanent = f.permanent;
            }
        }
        write_json_atomic(&self.path, &g.0)
    }
}

/// This process's peak resident memory (`VmHWM`), if the kernel says (Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// CPU time this process has used so far (user + system, ms), if the kernel says (Linux;
/// clock ticks of 10 ms, as `/proc/self/stat` counts them).
pub fn cpu_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) end with ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks * 10)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_rss_and_cpu_time_of_this_process_are_read() {
        let peak = super::peak_rss_bytes().expect("VmHWM on Linux");
        assert!(peak > 1 << 20 && peak < 64 << 30, "{peak}");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(100) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        let cpu = super::cpu_ms().expect("/proc/self/stat on Linux");
        assert!(cpu >= 50, "100 ms of spinning counted {cpu} ms ({x})");
    }
}
