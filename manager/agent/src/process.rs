//! Starting, finding and stopping the data-plane processes (`zebu-replica`,
//! `zebu-engine`) on behalf of a node agent.
//!
//! Design points, each there so that a manager killed at any moment
//! converges after a restart:
//!
//! - **Processes outlive the manager.** Each child gets its own process group
//!   (a Ctrl-C at the terminal reaches only the manager, which then stops them
//!   in order) and its stdout goes to a *file*, not a pipe: a pipe would
//!   break when the manager dies and the child's next `println!` would kill
//!   it with SIGPIPE. stderr is appended to a log file next to it.
//! - **A process is identified by its command line**, never by a pid alone.
//!   [`find`] scans `/proc/*/cmdline` for the binary and the arguments that
//!   make the process unique (`--dir` for a replica, `--volume` plus the
//!   node's control host for an engine, and the file its stdout goes to,
//!   which is in this cluster's data directory). So a process started just before a
//!   crash, whose pid never reached the store, is still found and adopted
//!   instead of being started twice; and a recycled pid is never mistaken
//!   for ours. A zombie has an empty cmdline and so counts as gone.
//! - **What a process announced is read back from its stdout file**
//!   ([`announced`]): the replica's `listening on ADDR`, the engine's
//!   `nbd …`, `iscsi …`, `control …`, `ready`.
//! - **Stop is SIGTERM, then SIGKILL** after a grace period ([`stop`]).
//!
//! Binaries are looked up in `$ZEBU_BIN_DIR`, else next to the running
//! executable (cargo puts every workspace binary in one directory).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("cannot find the {binary} binary (looked in {looked}); set ZEBU_BIN_DIR")]
    NoBinary { binary: String, looked: String },
    #[error("{what}: cannot open {path}: {source}")]
    Log {
        what: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: cannot start {binary}: {source}")]
    Spawn {
        what: String,
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: exited before it was ready ({tail})")]
    Exited { what: String, tail: String },
    #[error("{what}: the instance manager at {socket} did not start it: {why}")]
    InstanceManager {
        what: String,
        socket: PathBuf,
        why: String,
    },
    #[error("{what}: not ready after {secs} s (pid {pid}); stopped it")]
    Timeout { what: String, secs: u64, pid: u32 },
}

/// The directory the data-plane binaries are in.
pub fn bin_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ZEBU_BIN_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

/// The path of one data-plane binary.
pub fn binary(name: &str) -> Result<PathBuf, ProcessError> {
    let dir = bin_dir();
    if let Some(p) = dir.as_ref().map(|d| d.join(name))
        && p.is_file()
    {
        return Ok(p);
    }
    Err(ProcessError::NoBinary {
        binary: name.to_string(),
        looked: dir.map_or_else(|| "nowhere".into(), |d| d.display().to_string()),
    })
}

/// How to recognise one process on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The executable's file name (`zebu-replica`).
    pub binary: String,
    /// `(flag, value)` pairs that must appear as consecutive arguments.
    pub args: Vec<(String, String)>,
    /// `(flag, prefix)`: the flag's value must start with the prefix.
    pub prefixed: Vec<(String, String)>,
    /// The file its stdout goes to, when the command line alone could name
    /// a process of another cluster on the same host (an engine's
    /// arguments name its volume and node address, but two `zebu up` with
    /// different data directories can both have a volume `vol` on
    /// 127.0.0.11). The file lives in this cluster's data directory.
    pub stdout: Option<PathBuf>,
}

impl Identity {
    fn matches(&self, argv: &[String]) -> bool {
        let Some(exe) = argv.first() else {
            return false;
        };
        if Path::new(exe).file_name().and_then(|f| f.to_str()) != Some(self.binary.as_str()) {
            return false;
        }
        let value_of = |flag: &str| {
            argv.windows(2)
                .find(|w| w[0] == flag)
                .map(|w| w[1].as_str())
        };
        self.args
            .iter()
            .all(|(f, v)| value_of(f) == Some(v.as_str()))
            && self
                .prefixed
                .iter()
                .all(|(f, p)| value_of(f).is_some_and(|v| v.starts_with(p.as_str())))
    }
}

fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None; // a zombie or a kernel thread
    }
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Whether `pid` is alive and is the process `id` describes.
pub fn is_running(pid: u32, id: &Identity) -> bool {
    cmdline(pid).is_some_and(|argv| id.matches(&argv))
        && id.stdout.as_ref().is_none_or(|want| {
            std::fs::read_link(format!("/proc/{pid}/fd/1")).is_ok_and(|got| got == *want)
        })
}

/// The pid of the running process `id` describes, trying `hint` (the pid the
/// store remembers) first. The lowest pid wins if, against every rule,
/// there are several.
pub fn find(id: &Identity, hint: Option<u32>) -> Option<u32> {
    if let Some(pid) = hint
        && is_running(pid, id)
    {
        return Some(pid);
    }
    let mut found: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| is_running(*pid, id))
        .collect();
    found.sort_unstable();
    if found.len() > 1 {
        tracing::warn!(binary = %id.binary, pids = ?found, "several processes match one identity");
    }
    found.first().copied()
}

/// What to start.
#[derive(Debug, Clone)]
pub struct Launch {
    /// For messages: `replica v-r-1a2b`.
    pub what: String,
    pub binary: PathBuf,
    pub args: Vec<String>,
    /// stdout goes here (truncated at start), stderr to `log`.
    pub stdout: PathBuf,
    pub log: PathBuf,
    /// The stdout line that means "ready", e.g. `listening on ` (a prefix).
    pub ready_prefix: String,
    pub timeout: Duration,
    /// The instance manager's socket, when it (not this process) is to start it.
    pub via: Option<PathBuf>,
}

/// A started process and what it announced on stdout (`first word -> rest`).
#[derive(Debug, Clone)]
pub struct Started {
    pub pid: u32,
    pub announced: BTreeMap<String, String>,
}

/// The `key value` lines a process printed to its stdout file.
pub fn announced(stdout: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(stdout).unwrap_or_default();
    text.lines()
        .map(|l| {
            let l = l.trim();
            // `listening on ADDR` is the replica's one two-word key.
            if let Some(rest) = l.strip_prefix("listening on ") {
                return ("listening".to_string(), rest.to_string());
            }
            let (k, v) = l.split_once(' ').unwrap_or((l, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
    if tail.is_empty() {
        "no output".into()
    } else {
        tail
    }
}

/// Start `binary` with `args` as a child of this process, in its own process group, stdout
/// to `stdout` (truncated) and stderr appended to `log`. Used by [`launch`] and by the
/// instance manager.
pub fn spawn(
    what: &str,
    binary: &Path,
    args: &[String],
    stdout: &Path,
    log: &Path,
) -> Result<tokio::process::Child, ProcessError> {
    let open = |path: &Path, append: bool| {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| ProcessError::Log {
                what: what.to_string(),
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|source| ProcessError::Log {
                what: what.to_string(),
                path: path.to_path_buf(),
                source,
            })
    };
    let out = open(stdout, false)?;
    let err = open(log, true)?;
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(false);
    cmd.spawn().map_err(|source| ProcessError::Spawn {
        what: what.to_string(),
        binary: binary.display().to_string(),
        source,
    })
}

/// The process a [`launch`] started: our child, or the instance manager's.
enum Launched {
    Child(tokio::process::Child),
    Remote(u32),
}

/// Start a process (itself, or through the instance manager when `l.via` names its socket)
/// and wait until it prints its ready line.
pub async fn launch(l: &Launch) -> Result<Started, ProcessError> {
    let exited_at_once = || ProcessError::Exited {
        what: l.what.clone(),
        tail: "exited at once".into(),
    };
    let mut started = match &l.via {
        None => Launched::Child(spawn(&l.what, &l.binary, &l.args, &l.stdout, &l.log)?),
        Some(socket) => {
            let name = l
                .binary
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default()
                .to_string();
            // The instance manager runs in another directory: absolute paths only.
            let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
            let req = crate::instance_manager::StartRequest {
                binary: name,
                args: l.args.clone(),
                stdout: absolute(&l.stdout),
                log: absolute(&l.log),
            };
            Launched::Remote(crate::instance_manager::request_start(socket, &l.what, &req).await?)
        }
    };
    let pid = match &started {
        Launched::Child(c) => c.id().ok_or_else(exited_at_once)?,
        Launched::Remote(pid) => *pid,
    };
    // The instance manager's child is ours to recognise by its stdout file, like any
    // process the agent adopts.
    let remote_id = Identity {
        binary: l
            .binary
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or_default()
            .to_string(),
        args: vec![],
        prefixed: vec![],
        stdout: Some(std::path::absolute(&l.stdout).unwrap_or_else(|_| l.stdout.clone())),
    };
    tracing::info!(what = %l.what, pid, args = ?l.args, via = ?l.via, "started");
    let deadline = Instant::now() + l.timeout;
    loop {
        let text = std::fs::read_to_string(&l.stdout).unwrap_or_default();
        if text.lines().any(|line| line.starts_with(&l.ready_prefix)) {
            // The child handle is dropped; tokio reaps it if it exits later.
            return Ok(Started {
                pid,
                announced: announced(&l.stdout),
            });
        }
        let exited = match &mut started {
            Launched::Child(c) => match c.try_wait() {
                Ok(Some(status)) => Some(status.to_string()),
                _ => None,
            },
            Launched::Remote(pid) => (!is_running(*pid, &remote_id)).then(|| "exited".to_string()),
        };
        if let Some(status) = exited {
            return Err(ProcessError::Exited {
                what: l.what.clone(),
                tail: format!("{status}: {}", log_tail(&l.log)),
            });
        }
        if Instant::now() >= deadline {
            match &mut started {
                Launched::Child(c) => {
                    let _ = c.start_kill();
                    let _ = c.wait().await;
                }
                Launched::Remote(pid) => {
                    if let Ok(raw) = i32::try_from(*pid)
                        && is_running(*pid, &remote_id)
                    {
                        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
                    }
                }
            }
            return Err(ProcessError::Timeout {
                what: l.what.clone(),
                secs: l.timeout.as_secs(),
                pid,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM, wait up to `grace` for it to go, then SIGKILL. Returns once the
/// process `id` at `pid` is gone (or was never there).
pub async fn stop(pid: u32, id: &Identity, grace: Duration) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    if !is_running(pid, id) {
        return;
    }
    let target = Pid::from_raw(raw);
    let _ = kill(target, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !is_running(pid, id) {
            tracing::info!(binary = %id.binary, pid, "stopped");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!(binary = %id.binary, pid, grace_secs = grace.as_secs(), "did not stop on SIGTERM; killing");
    let _ = kill(target, Signal::SIGKILL);
    for _ in 0..100 {
        if !is_running(pid, id) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_needs_binary_and_arguments() {
        let id = Identity {
            binary: "zebu-replica".into(),
            args: vec![("--dir".into(), "/d/r1".into())],
            prefixed: vec![("--listen".into(), "127.0.0.11:".into())],
            stdout: None,
        };
        let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert!(id.matches(&argv(
            "/bin/zebu-replica serve --dir /d/r1 --listen 127.0.0.11:0"
        )));
        assert!(!id.matches(&argv(
            "/bin/zebu-replica serve --dir /d/r2 --listen 127.0.0.11:0"
        )));
        assert!(!id.matches(&argv(
            "/bin/zebu-replica serve --dir /d/r1 --listen 127.0.0.12:0"
        )));
        assert!(!id.matches(&argv(
            "/bin/zebu-engine serve --dir /d/r1 --listen 127.0.0.11:0"
        )));
        assert!(!id.matches(&[]));
    }

    #[tokio::test]
    async fn launch_find_and_stop_a_real_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("marker").display().to_string();
        let l = Launch {
            what: "test sh".into(),
            binary: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "echo listening on 127.0.0.1:7; exec sleep 60".into(),
                "--dir".into(),
                marker.clone(),
            ],
            stdout: dir.path().join("out"),
            log: dir.path().join("log"),
            ready_prefix: "listening on ".into(),
            timeout: Duration::from_secs(10),
            via: None,
        };
        let started = launch(&l).await.expect("launch");
        assert_eq!(started.announced["listening"], "127.0.0.1:7");
        // `exec sleep` replaces the shell: its cmdline no longer matches.
        let id = Identity {
            binary: "sleep".into(),
            args: vec![],
            prefixed: vec![],
            stdout: Some(l.stdout.clone()),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !is_running(started.pid, &id) {
            assert!(Instant::now() < deadline, "sleep never ran");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The same command line writing elsewhere is another cluster's.
        let elsewhere = Identity {
            stdout: Some(dir.path().join("other.out")),
            ..id.clone()
        };
        assert!(!is_running(started.pid, &elsewhere));
        stop(started.pid, &id, Duration::from_secs(5)).await;
        assert!(!is_running(started.pid, &id));
    }

    #[tokio::test]
    async fn a_process_that_dies_at_start_reports_its_stderr() {
        let dir = tempfile::tempdir().expect("tempdir");
        let l = Launch {
            what: "test sh".into(),
            binary: "/bin/sh".into(),
            args: vec!["-c".into(), "echo cannot bind >&2; exit 3".into()],
            stdout: dir.path().join("out"),
            log: dir.path().join("log"),
            ready_prefix: "ready".into(),
            timeout: Duration::from_secs(10),
            via: None,
        };
        let err = launch(&l).await.expect_err("must fail").to_string();
        assert!(err.contains("cannot bind") && err.contains('3'), "{err}");
    }
}
