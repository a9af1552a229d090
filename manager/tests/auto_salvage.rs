//! End to end: every replica of an attached volume dies, and the manager
//! brings the volume back by itself with every flushed write.
//!
//! `zebu up --nodes 3` runs a 3-replica volume attached over NBD; a verified
//! workload writes stamped blocks through it and flushes every 32 writes.
//! Then, twice:
//!
//! 1. kill -9 every replica process while the engine lives: the engine
//!    faults (no RW replica left), the agents restart the replicas, and the
//!    volume controller restarts the engine with `--salvage` (auto-salvage);
//! 2. kill -9 every replica process *and* the engine: the agents restart
//!    all of them and the engine reconciles the replicas at start.
//!
//! Each time the volume must become attached and healthy again without any
//! command, and every block must read back as a version at least as new as
//! the last one acknowledged before a completed flush
//! ([`Expect::AfterCrash`]).
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use zebu_testkit::workload::{
    self, Expect, Model, NbdClient, Pattern, RunReport, Scope, StopAfter, WorkloadConfig,
};

const SIZE: u64 = 128 << 20;
const RANGE: u64 = 32 << 20;

fn hostport(endpoint: &str) -> String {
    endpoint
        .strip_prefix("nbd://")
        .and_then(|s| s.split('/').next())
        .unwrap_or_else(|| panic!("not an nbd endpoint: {endpoint}"))
        .to_string()
}

/// The endpoint once the volume is attached and healthy again.
fn wait_healthy(api: &str, secs: u64) -> String {
    let mut endpoint = String::new();
    let took = wait_for("attached and healthy", secs, || {
        let Some(v) = volume(api, "v") else {
            return false;
        };
        let ok = v["status"]["state"] == "attached" && v["status"]["robustness"] == "healthy";
        if ok {
            endpoint = v["status"]["endpoint"].as_str().unwrap_or("").to_string();
        }
        ok && !endpoint.is_empty()
    });
    eprintln!("attached and healthy after {took:?} at {endpoint}");
    endpoint
}

/// A verified workload on `[start, start + RANGE)` until it hits an I/O
/// error (the replicas died) or `stop` is set; returns its report and model.
fn writer(
    endpoint: &str,
    start: u64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(RunReport, Model)> {
    let hp = hostport(endpoint);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let dev = NbdClient::connect(&hp, "v").await.expect("nbd connect");
            let cfg = WorkloadConfig {
                range_start: start,
                range_len: Some(RANGE),
                queue_depth: 8,
                pattern: Pattern::Random,
                stop: StopAfter::Duration(Duration::from_secs(120)),
                read_percent: 10,
                flush_every: Some(32),
                final_flush: false,
                stop_on_error: true,
                cancel: Some(stop),
                ..WorkloadConfig::default()
            };
            let mut model = cfg
                .new_model(SIZE, workload::RunId::random())
                .expect("model");
            let report = workload::run_workload(&dev, &mut model, &cfg).await;
            (report, model)
        })
    })
}

/// Read every block of each model's range through `endpoint` and check it.
fn verify_all(endpoint: &str, models: &[&Model]) {
    let hp = hostport(endpoint);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let dev = NbdClient::connect(&hp, "v").await.expect("nbd connect");
        for m in models {
            let check = workload::verify(&dev, m, Expect::AfterCrash, Scope::Range, 8).await;
            assert!(check.io_errors.is_empty(), "{:?}", check.io_errors);
            let wrong: Vec<String> = check.wrong.iter().take(5).map(|w| w.to_string()).collect();
            assert!(
                check.wrong.is_empty(),
                "{} blocks lost or wrong, e.g. {wrong:?}",
                check.wrong.len()
            );
            assert_eq!(check.checked, RANGE / 4096);
        }
    });
}

/// Run the writer until it has flushed a few times, kill `victims`, see the
/// volume leave `healthy`, and return what the writer saw.
fn write_then_kill(
    api: &str,
    endpoint: &str,
    start: u64,
    victims: impl FnOnce() -> Vec<i32>,
) -> (RunReport, Model) {
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(endpoint, start, stop.clone());
    std::thread::sleep(Duration::from_secs(3));
    let victims = victims();
    eprintln!("kill -9 {victims:?}");
    for pid in victims {
        kill9(pid);
    }
    let noticed = wait_for("volume not attached and healthy", 10, || {
        volume(api, "v").is_some_and(|v| {
            v["status"]["state"] != "attached" || v["status"]["robustness"] != "healthy"
        })
    });
    eprintln!("not healthy {noticed:?} after the kill");
    // The writer ends on its first I/O error; the flag is a backstop.
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let (report, model) = w.join().expect("writer");
    eprintln!(
        "writer: {} writes, {} flushes, {} reads, {} io errors",
        report.writes,
        report.flushes,
        report.reads,
        report.io_errors.len()
    );
    assert!(report.writes > 100 && report.flushes > 2, "too little I/O");
    assert!(report.bad_reads.is_empty(), "{:?}", report.bad_reads);
    (report, model)
}

#[test]
fn every_replica_killed_the_manager_salvages_and_flushed_writes_read_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 3, FULL_DISK_OK);
    let api = up.api.clone();
    let needle = tmp.path().display().to_string();
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
    let endpoint = {
        let healthy = wait_healthy(&api, 60);
        assert_eq!(healthy, endpoint);
        healthy
    };

    // 1. Every replica dies; the engine lives on, faulted.
    let (report, first) = write_then_kill(&api, &endpoint, 0, || {
        let r = pids("zebu-replica", &needle);
        assert_eq!(r.len(), 3, "{r:?}");
        r
    });
    assert!(!report.io_errors.is_empty(), "the volume never failed");
    let endpoint = wait_healthy(&api, 60);
    let log = std::fs::read_to_string(tmp.path().join("up.log")).unwrap_or_default();
    assert!(
        log.contains("auto-salvage"),
        "the controller never salvaged"
    );
    verify_all(&endpoint, &[&first]);

    // 2. Every replica and the engine die at once.
    let engine = pids("zebu-engine", &needle);
    assert_eq!(engine.len(), 1, "{engine:?}");
    let (_, second) = write_then_kill(&api, &endpoint, RANGE, || {
        let mut all = pids("zebu-replica", &needle);
        assert_eq!(all.len(), 3, "{all:?}");
        all.extend(pids("zebu-engine", &needle));
        all
    });
    let endpoint = wait_healthy(&api, 60);
    let engine_after = pids("zebu-engine", &needle);
    assert_eq!(engine_after.len(), 1, "{engine_after:?}");
    assert_ne!(engine_after, engine, "a new engine process");
    assert_eq!(pids("zebu-replica", &needle).len(), 3);
    verify_all(&endpoint, &[&first, &second]);
    drop(up);
}
