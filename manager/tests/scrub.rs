//! End to end: `zebu volume scrub` and the scrub schedule (issue 17, item 3) with real
//! replicas and engines under `zebu up`, bits flipped directly in the replicas' layer files.
//!
//! - `zebu volume scrub NAME --wait` finds every flipped block and repairs it: the layer
//!   files hold the written bytes again, and the volume's status records the scrub (time,
//!   rate, blocks checked, mismatches, repairs);
//! - the record outlives the engine: kill -9 of the engine, and the new one's volume still
//!   shows it;
//! - with `scrub-interval` short, the manager scrubs by itself: blocks flipped afterwards are
//!   found and repaired with no command.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, and `qemu-io`.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

const BLOCK: u64 = 4096;
/// Short enough for a test, long enough that the manual scrub comes first.
const INTERVAL: u64 = 60;

fn byte_at(path: &Path, offset: u64) -> u8 {
    let f = std::fs::File::open(path).expect("open layer");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).expect("read a byte");
    b[0]
}

/// Flip one byte in each of `blocks` (replica index, block number) and check they read back
/// wrong from the files.
fn damage(layers: &[PathBuf], blocks: &[(usize, u64)]) {
    for &(r, b) in blocks {
        let at = b * BLOCK + 123;
        flip(&layers[r], at);
        assert_ne!(byte_at(&layers[r], at), 0xaa, "flipped");
    }
}

fn assert_repaired(layers: &[PathBuf], blocks: &[(usize, u64)]) {
    for &(r, b) in blocks {
        let at = b * BLOCK + 123;
        assert_eq!(
            byte_at(&layers[r], at),
            0xaa,
            "block {b} of replica {r} ({}) repaired in its layer file",
            layers[r].display()
        );
    }
}

fn last_scrub(api: &str, name: &str) -> Value {
    volume(api, name).expect("volume")["status"]["lastScrub"].clone()
}

#[test]
fn scrub_repairs_flipped_blocks_records_its_findings_and_runs_on_schedule() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let interval = format!("scrub-interval={INTERVAL}");
    let up = start_up(tmp.path(), 3, &[FULL_DISK_OK[0], &interval]);
    let api = up.api.clone();
    wait_nodes(&api, 3);
    ok(
        &api,
        &[
            "volume",
            "create",
            "s",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "s"]).trim().to_string();
    qemu_io(&endpoint, "write -P 0xaa 0 4M");
    let layers = flushed_head_layers(&api, "s", &endpoint, tmp.path(), 3);

    // Blocks no read touches, spread over the replicas.
    let first = [(0, 3), (0, 200), (1, 517), (2, 900), (2, 1000)];
    damage(&layers, &first);
    let out = ok(&api, &["volume", "scrub", "s", "--wait"]);
    assert!(out.contains("scrub of s done"), "{out}");
    assert_repaired(&layers, &first);
    let last = last_scrub(&api, "s");
    assert_eq!(last["state"], "done", "{last}");
    assert_eq!(last["mismatches"], first.len() as u64, "{last}");
    assert_eq!(last["repaired"], first.len() as u64, "{last}");
    assert_eq!(last["unrecoverable"], 0, "{last}");
    // 4 MiB written on three replicas: 1024 blocks each, at least.
    assert!(
        last["blocksChecked"]
            .as_u64()
            .is_some_and(|n| n >= 3 * 1024),
        "{last}"
    );
    assert!(
        last["bytesPerSecond"].as_u64().is_some_and(|n| n > 0),
        "{last}"
    );
    assert!(last["finished"].is_string(), "{last}");
    qemu_io(&endpoint, "read -P 0xaa 0 4M");

    // Asked again while none runs: the API shows the recorded one.
    let shown: Value =
        serde_json::from_str(&ok(&api, &["volume", "scrub", "s", "--stop", "-o", "json"]))
            .expect("json");
    assert_eq!(shown["last"], last, "{shown}");

    // The record is the volume's, not the engine's: kill -9 the engine, and once the new
    // one serves, the volume still shows the scrub.
    let engines = pids("zebu-engine", "s");
    assert!(!engines.is_empty(), "the volume's engine runs");
    for p in engines {
        kill9(p);
    }
    wait_for("a new engine, healthy", 120, || {
        !pids("zebu-engine", "s").is_empty()
            && volume(&api, "s").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    assert_eq!(
        last_scrub(&api, "s"),
        last,
        "the record survived the engine"
    );

    // On schedule: damage more blocks and wait; the manager scrubs the volume by itself once
    // the interval since the last scrub's start is over.
    let second = [(1, 10), (2, 11), (0, 777)];
    damage(&layers, &second);
    let before = last["startedUnixMs"].as_i64().expect("started");
    wait_for("a scheduled scrub", 3 * INTERVAL, || {
        last_scrub(&api, "s")["startedUnixMs"]
            .as_i64()
            .is_some_and(|t| t > before)
    });
    let scheduled = last_scrub(&api, "s");
    assert_eq!(scheduled["state"], "done", "{scheduled}");
    assert_eq!(scheduled["mismatches"], second.len() as u64, "{scheduled}");
    assert_eq!(scheduled["repaired"], second.len() as u64, "{scheduled}");
    let gap = scheduled["startedUnixMs"].as_i64().expect("started") - before;
    assert!(
        gap >= (INTERVAL * 1000) as i64,
        "not before the interval: {gap} ms after the last"
    );
    assert_repaired(&layers, &second);

    // Not attached: no scrub, with what to do.
    ok(&api, &["volume", "detach", "s"]);
    wait_for("detached", 60, || {
        volume(&api, "s").is_some_and(|v| v["status"]["state"] == "detached")
    });
    let out = zebu(&api, &["volume", "scrub", "s"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not attached"), "{err}");
    drop(up);
}
