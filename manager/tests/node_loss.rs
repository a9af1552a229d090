//! End to end: a node goes away for longer than `staleReplicaTimeout`.
//!
//! `zebu up --nodes 4` runs four node agents; the hidden `zebu node stop`
//! stops one agent and its processes (to the controllers, a node that went
//! down). The volume's replica there is replaced on the fourth node by a
//! full rebuild while I/O goes on, and removed only after. The second test
//! also kills the manager with SIGKILL in the middle of that rebuild.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, and
//! `qemu-io`.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use serde_json::Value;

const SETTINGS: &[&str] = &[
    "stale-replica-timeout=5",
    "storage-minimal-available-percentage=0",
];
const ALL: [&str; 4] = ["node-1", "node-2", "node-3", "node-4"];

/// A volume attached on a node that holds one of its replicas; returns
/// (endpoint, attach node, victim node holding another replica, spare node).
fn attached_volume(api: &str, size: &str) -> (String, String, String, String) {
    wait_nodes(api, 4);
    ok(
        api,
        &[
            "volume",
            "create",
            "v",
            "--size",
            size,
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let mut nodes = Vec::new();
    wait_for("three replicas placed", 20, || {
        nodes = volume(api, "v")
            .map(|v| replica_nodes(&v))
            .unwrap_or_default();
        nodes.len() == 3
    });
    let spare = ALL
        .iter()
        .find(|n| !nodes.iter().any(|m| m == *n))
        .expect("a node without a replica")
        .to_string();
    let endpoint = ok(api, &["volume", "attach", "v", "--node", &nodes[0]])
        .trim()
        .to_string();
    wait_for("healthy after attach", 60, || {
        volume(api, "v").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    (endpoint, nodes[0].clone(), nodes[1].clone(), spare)
}

fn replica_pids(dir: &Path) -> Vec<i32> {
    pids("zebu-replica", &dir.display().to_string())
}

#[test]
fn a_replica_on_a_node_gone_too_long_is_rebuilt_elsewhere_then_removed_and_delete_frees_the_space()
{
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 4, SETTINGS);
    let api = up.api.clone();
    let (endpoint, attach, victim, spare) = attached_volume(&api, "256M");
    qemu_io(&endpoint, "write -P 0xab 0 64M");
    qemu_io(&endpoint, "write -P 0x5c 128M 64M");

    // Watch the volume as a user would; progress lines come out of a pipe.
    let mut watch = Command::new(ZEBU)
        .args(["volume", "get", "v", "--watch"])
        .env("ZEBU_API", &api)
        .stdout(Stdio::piped())
        .spawn()
        .expect("watch");
    let lines = BufReader::new(watch.stdout.take().expect("stdout"));
    let reader =
        std::thread::spawn(move || lines.lines().map_while(Result::ok).collect::<Vec<_>>());

    let stop = Arc::new(AtomicBool::new(false));
    let writer = background_writer(&endpoint, stop.clone());
    assert_eq!(replica_pids(tmp.path()).len(), 3);
    let stopped = ok(&api, &["node", "stop", &victim, "-o", "json"]);
    assert!(stopped.contains("\"stopped\""), "{stopped}");
    assert_eq!(
        replica_pids(tmp.path()).len(),
        2,
        "the node's replica went with it"
    );

    let mut seen_degraded = false;
    let took = wait_for("healthy on the spare node", 120, || {
        let Some(v) = volume(&api, "v") else {
            return false;
        };
        seen_degraded |= v["status"]["robustness"] == "degraded";
        let mut want = vec![attach.clone(), spare.clone()];
        want.extend(
            ALL.iter()
                .map(|s| s.to_string())
                .filter(|n| *n != attach && *n != spare && *n != victim),
        );
        want.sort();
        v["status"]["robustness"] == "healthy" && replica_nodes(&v) == want
    });
    eprintln!("replaced and healthy {took:?} after the node stopped");
    assert!(seen_degraded);
    stop.store(true, Ordering::Relaxed);
    let (report, wrong) = writer.join().expect("writer");
    eprintln!(
        "background writer: {} writes, {} reads, {} io errors",
        report.writes,
        report.reads,
        report.io_errors.len()
    );
    assert!(report.writes > 0);
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty());
    assert_eq!(wrong, 0, "blocks not as last acknowledged");
    qemu_io(&endpoint, "read -P 0xab 0 64M");
    qemu_io(&endpoint, "read -P 0x5c 128M 64M");

    // The old replica is gone from the store; its directory goes when the
    // node comes back, as one that no Replica names.
    let v = volume(&api, "v").expect("volume");
    assert!(!replica_nodes(&v).contains(&victim));
    ok(&api, &["node", "start", &victim]);
    wait_for("the old directory removed", 30, || {
        replica_dirs(tmp.path(), 4).len() == 3
    });
    assert_eq!(replica_pids(tmp.path()).len(), 3);

    // Delete: every directory gone and the space back.
    let used = allocated(tmp.path());
    let replicas_bytes: u64 = replica_dirs(tmp.path(), 4)
        .iter()
        .map(|d| allocated(d))
        .sum();
    assert!(replicas_bytes >= 3 * (128 << 20), "{replicas_bytes}");
    let free = |p: &Path| {
        let st = nix::sys::statvfs::statvfs(p).expect("statvfs");
        st.blocks_available() * st.fragment_size()
    };
    let before = free(tmp.path());
    ok(&api, &["volume", "delete", "v"]);
    wait_for("volume gone", 60, || volume(&api, "v").is_none());
    let after = free(tmp.path());
    eprintln!(
        "replicas held {replicas_bytes} B; free space {before} -> {after} (+{} B); data dir {used} -> {} B",
        after.saturating_sub(before),
        allocated(tmp.path())
    );
    assert!(replica_dirs(tmp.path(), 4).is_empty());
    assert!(replica_pids(tmp.path()).is_empty());
    // Every allocated byte of the replicas is gone from the data directory. `used` was
    // taken a moment before the replicas were measured, while a writer may still have been
    // finishing: allow a few MiB of slack.
    let left = allocated(tmp.path());
    assert!(
        left + replicas_bytes <= used + (4 << 20),
        "data dir {used} -> {left} B, replicas held {replicas_bytes} B"
    );
    // statvfs is of a filesystem other programs write to at the same time
    // (builds of other worktrees), so its growth is reported above and only
    // checked loosely: a delete that freed nothing would show no growth.
    assert!(
        after > before,
        "free space did not grow ({before} -> {after}), replicas held {replicas_bytes} B"
    );

    let _ = watch.kill();
    let _ = watch.wait();
    let seen = reader.join().expect("watch reader");
    let progress: Vec<&String> = seen.iter().filter(|l| l.starts_with("rebuild ")).collect();
    eprintln!(
        "watch saw {} rebuild lines, e.g. {:?}",
        progress.len(),
        progress.first()
    );
    assert!(
        progress
            .iter()
            .any(|l| l.contains("% ") && l.contains("ETA")),
        "no progress line in {seen:?}"
    );
    assert!(
        progress.iter().any(|l| l.ends_with("finished")),
        "no finish line in {seen:?}"
    );
    drop(up);
}

#[test]
fn manager_killed_during_the_rebuild_converges_and_io_never_stops() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut up = start_up(tmp.path(), 4, SETTINGS);
    let api = up.api.clone();
    let (endpoint, _attach, victim, _spare) = attached_volume(&api, "512M");
    qemu_io(&endpoint, "write -P 0x3e 128M 384M");
    let engine_before = pids("zebu-engine", &tmp.path().display().to_string());
    assert_eq!(engine_before.len(), 1);

    let stop = Arc::new(AtomicBool::new(false));
    let writer = background_writer(&endpoint, stop.clone());
    ok(&api, &["node", "stop", &victim]);
    let mut progress = Value::Null;
    wait_for("a rebuild running", 120, || {
        progress = volume(&api, "v")
            .map(|v| v["status"]["rebuild"].clone())
            .unwrap_or(Value::Null);
        progress["state"] == "running"
    });
    eprintln!("killing the manager during {progress}");
    up.kill9();
    std::thread::sleep(Duration::from_millis(500));
    let mut up2 = start_up(tmp.path(), 4, SETTINGS);
    let api = up2.api.clone();
    wait_for("healthy after the restart", 180, || {
        volume(&api, "v").is_some_and(|v| {
            v["status"]["robustness"] == "healthy" && !replica_nodes(&v).contains(&victim)
        })
    });
    assert!(up2.alive());
    // The node came back with the restart: its superseded replica goes.
    wait_for("three replica directories", 30, || {
        replica_dirs(tmp.path(), 4).len() == 3
    });
    let v = volume(&api, "v").expect("volume");
    let named: BTreeSet<String> = v["status"]["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect();
    let dirs: BTreeSet<String> = replica_dirs(tmp.path(), 4)
        .iter()
        .filter_map(|d| Some(d.file_name()?.to_string_lossy().into_owned()))
        .collect();
    assert_eq!(named, dirs, "every directory belongs to a live replica");
    assert_eq!(replica_pids(tmp.path()).len(), 3);
    let engines = pids("zebu-engine", &tmp.path().display().to_string());
    assert_eq!(engines, engine_before, "the same engine process throughout");

    stop.store(true, Ordering::Relaxed);
    let (report, wrong) = writer.join().expect("writer");
    eprintln!(
        "background writer: {} writes, {} reads, {} io errors over {:?}",
        report.writes,
        report.reads,
        report.io_errors.len(),
        report.elapsed
    );
    assert!(report.writes > 0);
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty());
    assert_eq!(wrong, 0);
    qemu_io(&endpoint, "read -P 0x3e 128M 384M");
    up2.dir = up.dir.clone();
}
