//! What survives a kill -9 of the manager: the data plane. Engines and replicas are not the
//! manager's to lose (their own process groups, stdout to files, and in a cluster the
//! instance manager as their parent), so a volume's I/O goes on while no manager runs, and
//! the manager that starts again adopts the very same processes instead of starting a
//! second engine.
//!
//! Run twice: with `zebu up` starting the processes itself (one host), and with a
//! `zebu-instance-manager` starting them (the cluster's layout, `deploy/chart`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod common;
use common::{
    FULL_DISK_OK, background_writer, ok, pids, qemu_io, start_up_with, volume, wait_for, wait_nodes,
};

/// The parent pid of `pid` (`/proc/PID/stat`, field 4, after the parenthesised name).
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A running `zebu-instance-manager`, killed on drop.
struct InstanceManager(Child);

impl Drop for InstanceManager {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_instance_manager(dir: &Path) -> InstanceManager {
    let bin = Path::new(common::ZEBU)
        .parent()
        .expect("bin dir")
        .join("zebu-instance-manager");
    let socket = dir.join("instance-manager.sock");
    let log = std::fs::File::create(dir.join("instance-manager.log")).expect("log");
    let child = Command::new(bin)
        .arg("--socket")
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn zebu-instance-manager (cargo build --workspace --bins)");
    let im = InstanceManager(child);
    wait_for("instance manager socket", 10, || socket.exists());
    im
}

fn survive(via_instance_manager: bool) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let needle = tmp.path().display().to_string();
    let im = via_instance_manager.then(|| start_instance_manager(tmp.path()));
    let socket = tmp.path().join("instance-manager.sock");
    let socket = socket.to_str().expect("utf-8 path");
    let extra: Vec<&str> = if via_instance_manager {
        vec!["--instance-manager", socket]
    } else {
        vec![]
    };
    let mut up = start_up_with(tmp.path(), 3, FULL_DISK_OK, &extra);
    let api = up.api.clone();
    wait_nodes(&api, 3);
    ok(
        &api,
        &[
            "volume",
            "create",
            "v",
            "--size",
            "128M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "v"]).trim().to_string();
    wait_for("healthy after attach", 60, || {
        volume(&api, "v").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    let engines = pids("zebu-engine", &needle);
    assert_eq!(engines.len(), 1, "{engines:?}");
    let engine = engines[0];
    let mut replicas = pids("zebu-replica", &needle);
    replicas.sort_unstable();
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    if let Some(im) = &im {
        // Their parent is the instance manager, not the manager.
        let im_pid = i32::try_from(im.0.id()).expect("pid");
        for p in replicas.iter().chain([&engine]) {
            assert_eq!(
                ppid(*p),
                Some(im_pid),
                "process {p} is not the instance manager's"
            );
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let writer = background_writer(&endpoint, stop.clone());
    std::thread::sleep(Duration::from_secs(1));
    up.kill9();
    // No manager now: the volume still takes and returns data.
    for i in 0..5u64 {
        let at = format!("{}M", 2 + i);
        qemu_io(&endpoint, &format!("write -P 0x{:x} {at} 1M", 0x40 + i));
        qemu_io(&endpoint, &format!("read -P 0x{:x} {at} 1M", 0x40 + i));
        assert_eq!(
            pids("zebu-engine", &needle),
            vec![engine],
            "the engine died with the manager"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    let up2 = start_up_with(tmp.path(), 3, FULL_DISK_OK, &extra);
    let api = up2.api.clone();
    // The restarted manager adopts: the same engine, never a second one, at every poll.
    let mut polls = 0;
    wait_for("healthy after the manager's restart", 60, || {
        polls += 1;
        let now = pids("zebu-engine", &needle);
        assert_eq!(now, vec![engine], "engines at poll {polls}");
        volume(&api, "v").is_some_and(|v| {
            v["status"]["robustness"] == "healthy" && v["status"]["state"] == "attached"
        })
    });
    for _ in 0..6 {
        assert_eq!(pids("zebu-engine", &needle), vec![engine]);
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut after = pids("zebu-replica", &needle);
    after.sort_unstable();
    assert_eq!(after, replicas, "replicas restarted though none died");

    stop.store(true, Ordering::Relaxed);
    let (report, wrong) = writer.join().expect("writer");
    eprintln!(
        "background writer across the manager's kill -9: {} writes, {} reads",
        report.writes, report.reads
    );
    assert!(report.writes > 0);
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty(), "{:?}", report.bad_reads);
    assert_eq!(wrong, 0, "blocks not as last acknowledged");
    for i in 0..5u64 {
        qemu_io(
            &endpoint,
            &format!("read -P 0x{:x} {}M 1M", 0x40 + i, 2 + i),
        );
    }
    drop(up2);
    drop(up);
    drop(im);
}

#[test]
fn a_manager_killed_under_io_leaves_its_children_serving_and_adopts_them_again() {
    survive(false);
}

#[test]
fn a_manager_killed_under_io_leaves_the_instance_managers_processes_serving() {
    survive(true);
}
