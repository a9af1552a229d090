//! Shared by the CSI tests: a real `zebu up`, a real `zebu-csi` on a Unix socket, and the
//! tools built by `tests/k8s/tools.sh` (csi-sanity, the sidecars).
//!
//! Binaries: `ZEBU_BIN_DIR` when set (as `tests/run.sh` sets it), else the `target/<profile>`
//! directory of this test, after a `cargo build` of the binaries `zebu up` starts, so they
//! are never stale.

#![allow(dead_code)]

pub mod ctl;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The directory with `zebu`, `zebu-engine`, `zebu-replica`, `zebu-backup-run` and
/// `zebu-csi`.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("ZEBU_BIN_DIR") {
            return PathBuf::from(d);
        }
        let exe = std::env::current_exe().expect("the test executable has a path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("the test executable lives in target/<profile>/deps")
            .to_path_buf();
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the csi crate lives in the workspace");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(workspace)
            .args([
                "build",
                "--quiet",
                "-p",
                "zebu-manager",
                "-p",
                "zebu-engine",
                "-p",
                "zebu-replica",
                "-p",
                "zebu-csi",
                "-p",
                "zebu-backup",
                "--bins",
            ])
            .status()
            .expect("running cargo build");
        assert!(
            status.success(),
            "cargo build of the zebu binaries: {status}"
        );
        profile_dir
    })
    .clone()
}

/// A tool from the tests/k8s cache (`tests/k8s/tools.sh which NAME`). `tests/run.sh`
/// builds them before the Rust tests; a missing tool fails the test with what to run.
pub fn k8s_tool(name: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/k8s/tools.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args(["which", name])
        .output()
        .expect("running tests/k8s/tools.sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && !path.is_empty() && Path::new(&path).exists(),
        "{name} is not built: run `tests/k8s/tools.sh csi` (tests/run.sh does): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(path)
}

/// A child killed (SIGKILL) and reaped on drop, its output in a log file.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
    pub name: String,
}

impl Proc {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then a bounded wait, then SIGKILL.
    pub fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = self.child.id().cast_signed();
            // SAFETY: kill(2) on our own child's pid, which is not reaped yet.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `program args` with stdout and stderr in `log`.
pub fn spawn(name: &str, program: &Path, args: &[String], log: &Path) -> Proc {
    let out = std::fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
    Proc {
        child,
        log: log.to_path_buf(),
        name: name.to_string(),
    }
}

/// A running `zebu up`; on drop it is killed and so is every engine and replica it
/// started (they are found by the data directory on their command line).
pub struct Up {
    child: Option<Child>,
    pub api: String,
    pub dir: PathBuf,
}

impl Up {
    /// `zebu up --nodes N` on `dir`; returns once the N nodes are ready.
    pub fn start(dir: &Path, nodes: u8) -> Up {
        Up::start_env(dir, nodes, &[])
    }

    /// [`Up::start`] with extra environment for `zebu up` (the AWS variables of an S3
    /// server, which the manager and its backup processes read).
    pub fn start_env(dir: &Path, nodes: u8, env: &[(&str, String)]) -> Up {
        let log = std::fs::File::create(dir.join("up.log")).expect("log");
        let mut child = Command::new(bin_dir().join("zebu"))
            .args([
                "up",
                "--nodes",
                &nodes.to_string(),
                "--listen",
                "127.0.0.1:0",
            ])
            // Shared CI disks are often fuller than the default reserve allows.
            .args(["--setting", "storage-minimal-available-percentage=0"])
            .arg("--data-dir")
            .arg(dir)
            .env(
                "ZEBU_LOG",
                "zebu_manager=info,zebu_ops=info,zebu_controllers=info,zebu_agent=info",
            )
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn zebu up");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("read zebu up's first line");
        let api = first
            .trim()
            .strip_prefix("zebu API listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        let up = Up {
            child: Some(child),
            api,
            dir: dir.to_path_buf(),
        };
        up.wait_nodes(usize::from(nodes));
        up
    }

    pub fn zebu(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin_dir().join("zebu"))
            .args(args)
            .env("ZEBU_API", &self.api)
            .output()
            .expect("run zebu")
    }

    /// `zebu ARGS -o json`, which must succeed.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.zebu(&all);
        assert!(
            out.status.success(),
            "zebu {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json output")
    }

    fn wait_nodes(&self, count: usize) {
        wait_for("the nodes to be ready", 60, || {
            let out = self.zebu(&["node", "ls", "-o", "json"]);
            if !out.status.success() {
                return false;
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let ready = v
                .as_array()
                .or_else(|| v.get("items").and_then(|i| i.as_array()))
                .map_or(0, |items| {
                    items
                        .iter()
                        .filter(|n| {
                            n.pointer("/status/conditions")
                                .and_then(|c| c.as_array())
                                .is_some_and(|c| {
                                    c.iter().any(|c| {
                                        c.get("type").and_then(|t| t.as_str()) == Some("Ready")
                                            && c.get("status").and_then(|s| s.as_str())
                                                == Some("True")
                                    })
                                })
                        })
                        .count()
                });
            ready >= count
        });
    }

    /// The replica directories on every node's disks (`node-N/DISK/replicas/*`).
    pub fn replica_dirs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let Ok(nodes) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for n in nodes.flatten() {
            if !n.file_name().to_string_lossy().starts_with("node-") {
                continue;
            }
            let Ok(disks) = std::fs::read_dir(n.path()) else {
                continue;
            };
            for d in disks.flatten() {
                if let Ok(r) = std::fs::read_dir(d.path().join("replicas")) {
                    out.extend(r.flatten().map(|e| e.path()));
                }
            }
        }
        out.sort();
        out
    }
}

impl Up {
    /// The `zebu-engine` and `zebu-replica` processes of this `zebu up`, with their
    /// command lines. A replica names its directory (under the data directory) on its
    /// command line; an engine's command line names only its volume and addresses, which
    /// another `zebu up` on this host may share, but its stdout goes to its node's log
    /// directory under the data directory. Missing the engines here is how a failed test
    /// used to leave the engine of whatever volume it had attached running.
    pub fn processes(&self) -> Vec<(i32, String)> {
        let mut found = Vec::new();
        let dir = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return found;
        };
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let raw = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let argv0 = raw.split(|b| *b == 0).next().unwrap_or_default();
            let ours_binary = argv0.ends_with(b"/zebu-engine")
                || argv0.ends_with(b"/zebu-replica")
                || argv0 == b"zebu-engine"
                || argv0 == b"zebu-replica";
            if !ours_binary {
                continue;
            }
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            let stdout = std::fs::read_link(p.path().join("fd/1")).unwrap_or_default();
            if cmdline.contains(dir.to_string_lossy().as_ref())
                || cmdline.contains(self.dir.to_string_lossy().as_ref())
                || stdout.starts_with(&dir)
            {
                found.push((pid, cmdline.trim().to_string()));
            }
        }
        found
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The data plane outlives a killed manager on purpose; a test must not leak it.
        for (pid, _) in self.processes() {
            // SAFETY: kill(2) with a pid read from /proc; at worst it is gone.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Poll `f` every 100 ms for `secs` seconds; panics naming `what` if it never holds.
pub fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        if f() {
            return t0.elapsed();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {secs} s waiting for {what}");
}

/// A running `zebu-csi` on a Unix socket in `dir`.
pub struct Plugin {
    pub proc: Proc,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
}

impl Plugin {
    /// `zebu-csi --controller --node --attach nbdfuse` for `node` against `api`.
    pub fn start(dir: &Path, api: &str, node: &str, extra: &[&str]) -> Plugin {
        let socket = dir.join("csi.sock");
        let state_dir = dir.join("csi-state");
        let mut args: Vec<String> = vec![
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--api".into(),
            api.into(),
            "--node-id".into(),
            node.into(),
            "--state-dir".into(),
            state_dir.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = spawn(
            "zebu-csi",
            &bin_dir().join("zebu-csi"),
            &args,
            &dir.join("zebu-csi.log"),
        );
        wait_for("zebu-csi's socket", 30, || socket.exists());
        Plugin {
            proc,
            socket,
            state_dir,
        }
    }
}

/// Mounts under `dir` (what a test must not leave behind), from /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy().into_owned();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&d))
        .map(str::to_string)
        .collect()
}

/// Loop devices backed by files under `dir`.
pub fn loops_under(dir: &Path) -> Vec<String> {
    let out = Command::new("losetup")
        .args(["-l", "-n", "-O", "NAME,BACK-FILE"])
        .output()
        .expect("losetup");
    let d = dir.to_string_lossy().into_owned();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&d))
        .map(str::to_string)
        .collect()
}

/// A single-node-writer mount capability with filesystem `fs_type` ("" lets the plugin
/// choose).
pub fn mount_cap_fs(fs_type: &str) -> zebu_proto::csi::VolumeCapability {
    use zebu_proto::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode};
    zebu_proto::csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs_type.into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}

/// [`mount_cap_fs`] with the plugin's default filesystem.
pub fn mount_cap() -> zebu_proto::csi::VolumeCapability {
    mount_cap_fs("")
}

/// One `qemu-io` command on an NBD export; a failed command or a pattern that does not
/// verify fails the test. Returns qemu-io's output.
pub fn qemu_io(uri: &str, cmd: &str) -> String {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", cmd, uri])
        .output()
        .expect("qemu-io");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !text.contains("fail") && !text.contains("Pattern verification"),
        "qemu-io {cmd} on {uri}: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Every byte of an NBD export, copied by nbdcopy through the file `dir/name`.
pub fn read_all(uri: &str, dir: &Path, name: &str) -> Vec<u8> {
    let file = dir.join(name);
    let out = Command::new("nbdcopy")
        .args([uri, &file.to_string_lossy()])
        .output()
        .expect("nbdcopy");
    assert!(
        out.status.success(),
        "nbdcopy {uri}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = std::fs::read(&file).expect("read copy");
    let _ = std::fs::remove_file(&file);
    data
}

/// The first offset where `a` and `b` differ, counting a difference in length.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or_else(|| (a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Calls `f` until it answers other than Aborted ("in progress, try again"), every 500 ms for
/// at most a minute, as the CSI sidecars retry; any other error fails the test.
pub async fn retry_aborted<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    for _ in 0..120 {
        match f().await {
            Ok(v) => return v,
            Err(s) if s.code() == tonic::Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(s) => panic!("{what}: {s:?}"),
        }
    }
    panic!("{what} never finished");
}
