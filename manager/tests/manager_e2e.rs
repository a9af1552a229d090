//! End to end with real processes: `zebu up` runs the API, three node
//! agents and the controllers; the agents run real `zebu-replica` and
//! `zebu-engine` processes; data goes through the real NBD endpoint.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`
//! (`cargo build -p zebu-replica -p zebu-engine`), and `nbdinfo`/`qemu-io`.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::{
    FULL_DISK_OK, background_writer, kill9, ok, pids, qemu_io, replica_dirs, start_up, volume,
    wait_for, wait_nodes,
};

#[test]
fn volume_lifecycle_self_heals_a_killed_replica_and_delete_leaves_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 3, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 3);
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
    assert_eq!(replica_dirs(tmp.path(), 3).len(), 3);
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
        replica_dirs(tmp.path(), 3).is_empty(),
        "{:?}",
        replica_dirs(tmp.path(), 3)
    );
    assert!(pids("zebu-replica", &tmp.path().display().to_string()).is_empty());
    assert!(pids("zebu-engine", &tmp.path().display().to_string()).is_empty());
}

#[test]
fn manager_killed_during_create_converges_without_orphans_or_duplicates() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut up = start_up(tmp.path(), 3, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 3);
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
    let mut up2 = start_up(tmp.path(), 3, FULL_DISK_OK);
    up2.dir = up.dir.clone();
    let api = up2.api.clone();
    let endpoint = ok(&api, &["volume", "attach", "w"]).trim().to_string();
    assert!(endpoint.starts_with("nbd://"), "{endpoint}");
    let needle = tmp.path().display().to_string();
    wait_for("healthy after restart", 30, || {
        volume(&api, "w").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    assert_eq!(
        replica_dirs(tmp.path(), 3).len(),
        3,
        "{:?}",
        replica_dirs(tmp.path(), 3)
    );
    assert_eq!(pids("zebu-replica", &needle).len(), 3);
    let engines = pids("zebu-engine", &needle);
    assert_eq!(engines.len(), 1, "one engine for w: {engines:?}");
    ok(&api, &["volume", "delete", "w"]);
    wait_for("volume gone", 60, || volume(&api, "w").is_none());
    assert!(replica_dirs(tmp.path(), 3).is_empty());
    assert!(pids("zebu-replica", &needle).is_empty());
    drop(up);
}

/// A deleted replica that does not stop on SIGTERM (here: stopped with SIGSTOP) keeps its
/// node's agent waiting out the grace period before SIGKILL. That wait must not hold up the
/// node's other work: a volume created meanwhile gets its replica started at once, and the
/// stuck one is still killed and its directory removed.
#[test]
fn a_deleted_replica_that_ignores_sigterm_does_not_hold_up_a_new_volumes_replica() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 1, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 1);
    let create = |name: &str| {
        ok(
            &api,
            &["volume", "create", name, "--size", "64M", "--replicas", "1"],
        );
    };
    // Volume names order the replicas in the agent's pass: v1's teardown comes before v2's
    // start.
    create("v1");
    let old = |n: &str| pids("zebu-replica", &format!("/replicas/{n}-r-"));
    wait_for("v1's replica runs", 30, || old("v1").len() == 1);
    let stuck = old("v1")[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(stuck),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("SIGSTOP");
    ok(&api, &["volume", "delete", "v1"]);
    // Let the agent reach the stuck replica and send its SIGTERM.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        old("v1"),
        vec![stuck],
        "v1's replica went before its grace period"
    );

    create("v2");
    let took = wait_for("v2's replica starts beside v1's teardown", 30, || {
        old("v2").len() == 1
    });
    // The grace period is 10 s; waiting behind it, v2's replica would start after ~9 s.
    assert!(
        took < Duration::from_secs(6),
        "v2's replica started {took:?} after its volume: it waited for v1's teardown"
    );
    assert_eq!(
        old("v1"),
        vec![stuck],
        "v1's replica is still in its grace period"
    );

    // The teardown finishes: killed after the grace period, the directory and the volume go.
    wait_for("v1's replica killed", 30, || old("v1").is_empty());
    wait_for("v1 gone", 30, || volume(&api, "v1").is_none());
    let dirs = replica_dirs(tmp.path(), 1);
    assert!(
        dirs.iter()
            .all(|d| !d.display().to_string().contains("/v1-r-")),
        "v1's replica directory is still there: {dirs:?}"
    );
    assert!(volume(&api, "v2").is_some());
}

/// The same for an engine: a detached volume's engine that ignores SIGTERM is stopped in a
/// task of its own, so another volume's attach (its engine start, later in the agent's pass)
/// does not wait for the old one's grace period; the stuck engine is still killed after it,
/// and only then does its volume report detached.
#[test]
fn a_detached_engine_that_ignores_sigterm_does_not_hold_up_another_volumes_attach() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 1, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 1);
    for name in ["e1", "e2"] {
        ok(
            &api,
            &["volume", "create", name, "--size", "64M", "--replicas", "1"],
        );
    }
    ok(&api, &["volume", "attach", "e1"]);
    let engine = |n: &str| pids("zebu-engine", &format!("engine-{n}"));
    let stuck = engine("e1");
    assert_eq!(stuck.len(), 1, "e1's engine: {stuck:?}");
    let stuck = stuck[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(stuck),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("SIGSTOP");
    ok(&api, &["volume", "detach", "e1"]);
    // Let the agent reach the stuck engine and send its SIGTERM.
    wait_for("e1's engine object being deleted", 30, || {
        volume(&api, "e1").is_some_and(|v| v["spec"]["nodeId"].is_null())
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        engine("e1"),
        vec![stuck],
        "e1's engine went before its grace period"
    );

    let started = Instant::now();
    ok(&api, &["volume", "attach", "e2"]);
    let took = started.elapsed();
    // The grace period is 10 s; waiting behind it, e2's attach would take ~9 s.
    assert!(
        took < Duration::from_secs(6),
        "e2's attach took {took:?}: its engine waited for e1's teardown"
    );
    assert_eq!(engine("e2").len(), 1);
    assert_eq!(
        engine("e1"),
        vec![stuck],
        "e1's engine is still in its grace period"
    );
    assert_ne!(
        volume(&api, "e1").expect("e1")["status"]["state"],
        "detached",
        "e1 reported detached while its engine still runs"
    );

    wait_for("e1's engine killed", 30, || engine("e1").is_empty());
    wait_for("e1 detached", 30, || {
        volume(&api, "e1").is_some_and(|v| v["status"]["state"] == "detached")
    });
}
