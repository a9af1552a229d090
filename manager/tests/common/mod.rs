//! Helpers for the end-to-end tests that run `zebu up` as a real process.
#![allow(dead_code)] // each test file uses its own subset

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use zebu_testkit::workload::{
    self, Expect, NbdClient, Pattern, RunReport, Scope, StopAfter, WorkloadConfig,
};

pub const ZEBU: &str = env!("CARGO_BIN_EXE_zebu");

/// Settings for tests on a shared machine: its disk is often fuller than the
/// minimal-available percentage `zebu up` keeps free by default, and a test
/// volume needs little of it.
pub const FULL_DISK_OK: &[&str] = &["storage-minimal-available-percentage=0"];

/// A running `zebu up`; on drop it and every data-plane process under its
/// data directory are killed.
pub struct Up {
    child: Option<Child>,
    pub api: String,
    pub dir: PathBuf,
}

/// `zebu up --nodes N` on `dir` with extra `--setting`s. Its stdout is read
/// for the API address and then closed: `zebu up` must survive that.
pub fn start_up(dir: &Path, nodes: u8, settings: &[&str]) -> Up {
    start_up_with(dir, nodes, settings, &[])
}

/// [`start_up`] with more arguments for `zebu up`.
pub fn start_up_with(dir: &Path, nodes: u8, settings: &[&str], extra: &[&str]) -> Up {
    start_up_env(dir, nodes, settings, extra, &[])
}

/// [`start_up_with`] with variables added to `zebu up`'s environment.
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn start_up_env(
    dir: &Path,
    nodes: u8,
    settings: &[&str],
    extra: &[&str],
    env: &[(&str, String)],
) -> Up {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("up.log"))
        .expect("log");
    let mut cmd = Command::new(ZEBU);
    cmd.args([
        "up",
        "--nodes",
        &nodes.to_string(),
        "--listen",
        "127.0.0.1:0",
    ]);
    for s in settings {
        cmd.args(["--setting", s]);
    }
    cmd.args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .arg("--data-dir")
        .arg(dir)
        .env(
            "ZEBU_LOG",
            "zebu_manager=info,zebu_ops=info,zebu_controllers=info,zebu_agent=info",
        )
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn zebu up");
    let api = first_line_api(&mut child);
    Up::adopt(child, api, dir)
}

/// The API address from the first line `zebu up` prints; its stdout is closed after, which
/// `zebu up` must survive.
pub fn first_line_api(child: &mut Child) -> String {
    let mut first = String::new();
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    stdout.read_line(&mut first).expect("read");
    drop(stdout);
    first
        .trim()
        .strip_prefix("zebu API listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string()
}

impl Up {
    /// A started `zebu up` serving `api` on data directory `dir`.
    pub fn adopt(child: Child, api: String, dir: &Path) -> Up {
        Up {
            child: Some(child),
            api,
            dir: dir.to_path_buf(),
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.kill9();
        let needle = self.dir.display().to_string();
        for pid in pids("zebu-engine", &needle)
            .into_iter()
            .chain(pids("zebu-replica", &needle))
        {
            kill9(pid);
        }
    }
}

/// On drop (a test that ends, or fails), kill -9 every engine and replica
/// of the cluster whose data directory is the given path, so a failed test
/// leaves nothing running for the next one to trip over.
pub struct KillUnder(pub String);

impl Drop for KillUnder {
    fn drop(&mut self) {
        for pid in pids("zebu-engine", &self.0)
            .into_iter()
            .chain(pids("zebu-replica", &self.0))
        {
            kill9(pid);
        }
    }
}

/// Pids of processes whose command line is `binary ...` and mentions
/// `needle`, or whose stdout is a file whose path does.
pub fn pids(binary: &str, needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        let is_bin = argv
            .first()
            .is_some_and(|a| Path::new(a).file_name().is_some_and(|f| f == binary));
        let out_file = std::fs::read_link(format!("/proc/{pid}/fd/1"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if is_bin && (argv.iter().any(|a| a.contains(needle)) || out_file.contains(needle)) {
            out.push(pid);
        }
    }
    out
}

pub fn kill9(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

pub fn zebu(api: &str, args: &[&str]) -> Output {
    Command::new(ZEBU)
        .args(args)
        .env("ZEBU_API", api)
        .output()
        .expect("run zebu")
}

pub fn ok(api: &str, args: &[&str]) -> String {
    let out = zebu(api, args);
    assert!(
        out.status.success(),
        "zebu {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn volume(api: &str, name: &str) -> Option<Value> {
    let out = zebu(api, &["volume", "get", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).expect("json"))
}

pub fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// Every replica directory on the first `nodes` nodes.
pub fn replica_dirs(dir: &Path, nodes: u8) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for n in 1..=nodes {
        if let Ok(rd) = std::fs::read_dir(dir.join(format!("node-{n}/disk-0/replicas"))) {
            out.extend(rd.flatten().map(|e| e.path()));
        }
    }
    out.sort();
    out
}

/// Bytes allocated on disk under `path` (st_blocks, so sparse files count
/// what they hold).
pub fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let mut total = meta.blocks() * 512;
    if meta.is_dir()
        && let Ok(rd) = std::fs::read_dir(path)
    {
        for e in rd.flatten() {
            total += allocated(&e.path());
        }
    }
    total
}

pub fn qemu_io(endpoint: &str, cmd: &str) -> String {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", cmd, endpoint])
        .output()
        .expect("qemu-io");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !text.contains("fail"),
        "qemu-io {cmd}: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

pub fn wait_nodes(api: &str, count: usize) {
    wait_for("ready nodes", 30, || {
        let v: Value = serde_json::from_str(&ok(api, &["node", "ls", "-o", "json"])).expect("json");
        let items = v["items"].as_array().cloned().unwrap_or_default();
        items.len() == count
            && items.iter().all(|n| {
                n["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
    });
}

/// The nodes the volume's replicas are on, as its status lists them.
pub fn replica_nodes(v: &Value) -> Vec<String> {
    let mut nodes: Vec<String> = v["status"]["replicas"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r["node"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    nodes.sort();
    nodes
}

/// A verified workload through NBD (a volume of at least 96 MiB) on the
/// range [64 MiB, 96 MiB) until
/// `stop`; returns its report once `stop` is set, after checking every
/// block reads back exactly as last acknowledged.
pub fn background_writer(
    endpoint: &str,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(RunReport, usize)> {
    let hostport = endpoint
        .strip_prefix("nbd://")
        .and_then(|s| s.split('/').next())
        .expect("nbd endpoint")
        .to_string();
    let export = endpoint.rsplit('/').next().unwrap_or("").to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let dev = NbdClient::connect(&hostport, &export)
                .await
                .expect("nbd connect");
            let cfg = WorkloadConfig {
                range_start: 64 << 20,
                range_len: Some(32 << 20),
                queue_depth: 4,
                pattern: Pattern::Random,
                stop: StopAfter::Duration(Duration::from_secs(600)),
                read_percent: 20,
                cancel: Some(stop),
                ..WorkloadConfig::default()
            };
            let mut model = cfg
                .new_model(256 << 20, workload::RunId::random())
                .expect("model");
            let report = workload::run_workload(&dev, &mut model, &cfg).await;
            let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 8).await;
            (report, check.wrong.len())
        })
    })
}

/// The head layer file of a replica directory (the highest-numbered layer).
pub fn head_layer(dir: &Path) -> PathBuf {
    let mut layers: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("layer-") && n.ends_with(".img"))
        })
        .collect();
    layers.sort();
    layers
        .pop()
        .unwrap_or_else(|| panic!("no layer file in {}", dir.display()))
}

/// Flip a bit of the byte at `offset` of a layer file, as a rotting disk would; the replica
/// uses the page cache, so it reads the flipped byte at once.
pub fn flip(path: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open layer");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).expect("read a byte");
    b[0] ^= 0x10;
    f.write_all_at(&b, offset).expect("flip a bit");
}

/// Flushes `volume` through `endpoint`, waits until it is healthy, and returns the head layer
/// file of each of its replicas on the `nodes` nodes under `dir` (one replica per node).
pub fn flushed_head_layers(
    api: &str,
    volume: &str,
    endpoint: &str,
    dir: &Path,
    nodes: u8,
) -> Vec<PathBuf> {
    qemu_io(endpoint, "flush");
    wait_for("healthy", 60, || {
        self::volume(api, volume).is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    let layers: Vec<PathBuf> = replica_dirs(dir, nodes)
        .iter()
        .map(|d| head_layer(d))
        .collect();
    assert_eq!(layers.len(), nodes as usize, "{layers:?}");
    layers
}
