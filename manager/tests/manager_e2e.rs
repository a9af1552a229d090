//! End to end with real processes: `zebu up` runs the API, three node
//! agents and the controllers; the agents run real `zebu-replica` and
//! `zebu-engine` processes; data goes through the real NBD endpoint.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`
//! (`cargo build -p zebu-replica -p zebu-engine`), and `nbdinfo`/`qemu-io`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;

mod common;
use common::{background_writer, kill9, ok, qemu_io, volume, wait_for};

const ZEBU: &str = env!("CARGO_BIN_EXE_zebu");

/// A running `zebu up`; on drop it and every data-plane process under its
/// data directory are killed.
struct Up {
    child: Option<Child>,
    /// Kept open: `zebu up` prints more lines, and a closed pipe kills it.
    _stdout: BufReader<std::process::ChildStdout>,
    api: String,
    dir: PathBuf,
}

fn start_up(dir: &Path, listen: &str) -> Up {
    let mut child = Command::new(ZEBU)
        .args(["up", "--nodes", "3", "--listen", listen])
        // Shared CI disks are often fuller than the 25% default allows.
        .args(["--setting", "storage-minimal-available-percentage=0"])
        .arg("--data-dir")
        .arg(dir)
        .env("ZEBU_LOG", "zebu_manager=info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("up.log")).expect("log"))
        .spawn()
        .expect("spawn zebu up");
    let mut first = String::new();
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    stdout.read_line(&mut first).expect("read");
    let api = first
        .trim()
        .strip_prefix("zebu API listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();
    Up {
        child: Some(child),
        _stdout: stdout,
        api,
        dir: dir.to_path_buf(),
    }
}

/// Pids of processes whose command line is `binary ...` and mentions
/// `needle`, or whose stdout is a file whose path does.
fn pids(binary: &str, needle: &str) -> Vec<i32> {
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
        // stdout goes to a file under the data dir, so fd 1 names it.
        let out_file = std::fs::read_link(format!("/proc/{pid}/fd/1"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if is_bin && (argv.iter().any(|a| a.contains(needle)) || out_file.contains(needle)) {
            out.push(pid);
        }
    }
    out
}

impl Up {
    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
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

fn replica_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for n in 1..=3 {
        if let Ok(rd) = std::fs::read_dir(dir.join(format!("node-{n}/disk-0/replicas"))) {
            out.extend(rd.flatten().map(|e| e.path()));
        }
    }
    out
}

fn wait_nodes(api: &str) {
    wait_for("three ready nodes", 20, || {
        let v: Value = serde_json::from_str(&ok(api, &["node", "ls", "-o", "json"])).expect("json");
        let items = v["items"].as_array().cloned().unwrap_or_default();
        items.len() == 3
            && items.iter().all(|n| {
                n["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
    });
}

#[test]
fn volume_lifecycle_self_heals_a_killed_replica_and_delete_leaves_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), "127.0.0.1:0");
    let api = up.api.clone();
    wait_nodes(&api);
    ok(
        &api,
        &[
            "volume",
            "create",
            "v",
            "--size",
            "256M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "v"]).trim().to_string();
    assert!(
        endpoint.starts_with("nbd://127.0.0.1") && endpoint.ends_with("/v"),
        "{endpoint:?}"
    );
    let info = Command::new("nbdinfo")
        .args(["--size", &endpoint])
        .output()
        .expect("nbdinfo");
    assert_eq!(String::from_utf8_lossy(&info.stdout).trim(), "268435456");
    assert_eq!(replica_dirs(tmp.path()).len(), 3);
    wait_for("healthy after attach", 30, || {
        volume(&api, "v").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    qemu_io(&endpoint, "write -P 0xab 0 1M");

    // kill -9 one replica under a verified workload: Degraded, then Healthy
    // again by itself, and the workload never sees an error.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = background_writer(&endpoint, stop.clone());
    std::thread::sleep(Duration::from_secs(1));
    let victims = pids("zebu-replica", &tmp.path().display().to_string());
    assert_eq!(victims.len(), 3, "{victims:?}");
    kill9(victims[0]);
    // A write makes the engine notice at once.
    qemu_io(&endpoint, "write -P 0xcd 1M 1M");
    let degraded = wait_for("degraded", 10, || {
        volume(&api, "v").is_some_and(|v| v["status"]["robustness"] == "degraded")
    });
    let healed = wait_for("healthy again", 60, || {
        volume(&api, "v").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    eprintln!("degraded after {degraded:?}, healthy again after {healed:?}");
    stop.store(true, Ordering::Relaxed);
    let (report, wrong) = writer.join().expect("writer");
    eprintln!(
        "background writer: {} writes, {} reads, {} flushes",
        report.writes, report.reads, report.flushes
    );
    assert!(report.writes > 0);
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty(), "{:?}", report.bad_reads);
    assert_eq!(wrong, 0, "blocks not as last acknowledged");
    assert_eq!(
        pids("zebu-replica", &tmp.path().display().to_string()).len(),
        3
    );
    qemu_io(&endpoint, "read -P 0xab 0 1M");
    qemu_io(&endpoint, "read -P 0xcd 1M 1M");

    ok(&api, &["volume", "delete", "v"]);
    wait_for("volume gone", 60, || volume(&api, "v").is_none());
    assert!(
        replica_dirs(tmp.path()).is_empty(),
        "{:?}",
        replica_dirs(tmp.path())
    );
    assert!(pids("zebu-replica", &tmp.path().display().to_string()).is_empty());
    assert!(pids("zebu-engine", &tmp.path().display().to_string()).is_empty());
}

#[test]
fn manager_killed_during_create_converges_without_orphans_or_duplicates() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut up = start_up(tmp.path(), "127.0.0.1:0");
    let api = up.api.clone();
    wait_nodes(&api);
    ok(
        &api,
        &[
            "volume",
            "create",
            "w",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    ok(&api, &["volume", "attach", "w", "--no-wait"]);
    // Die somewhere in the middle of scheduling and starting.
    std::thread::sleep(Duration::from_millis(400));
    up.kill9();
    let mut up2 = start_up(tmp.path(), "127.0.0.1:0");
    up2.dir = up.dir.clone();
    let api = up2.api.clone();
    let endpoint = ok(&api, &["volume", "attach", "w"]).trim().to_string();
    assert!(endpoint.starts_with("nbd://"), "{endpoint}");
    let needle = tmp.path().display().to_string();
    wait_for("healthy after restart", 30, || {
        volume(&api, "w").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    assert_eq!(
        replica_dirs(tmp.path()).len(),
        3,
        "{:?}",
        replica_dirs(tmp.path())
    );
    assert_eq!(pids("zebu-replica", &needle).len(), 3);
    let engines = pids("zebu-engine", &needle);
    assert_eq!(engines.len(), 1, "one engine for w: {engines:?}");
    ok(&api, &["volume", "delete", "w"]);
    wait_for("volume gone", 60, || volume(&api, "w").is_none());
    assert!(replica_dirs(tmp.path()).is_empty());
    assert!(pids("zebu-replica", &needle).is_empty());
    drop(up);
}
