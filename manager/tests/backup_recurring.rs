//! End to end: RecurringJobs on `zebu up` with a real S3 server (moto), real engines,
//! replicas and `zebu-backup-run` processes (DESIGN §5, §6, issue 16).
//!
//! - A backup job on a schedule of every few seconds keeps exactly `retain` of the backups
//!   it took: the older ones leave the store and their manifests leave the bucket; a
//!   backup the user took of the same volume is never touched; every kept backup verifies.
//! - A snapshot job keeps exactly `retain` of its snapshots in the volume's chain.
//! - Both go on after the manager is killed -9 and started again (the schedule and the
//!   runs are in the store, not in the process), and `zebu recurring-job rm` stops a job
//!   without deleting what it took.
//! - Bad input (a schedule that is not one, retain 0, no volumes): one line, nothing made.
//!
//! Needs `zebu-replica`, `zebu-engine` and `zebu-backup-run` built next to `zebu`,
//! `qemu-io`, and python3 (the moto venv).

mod backup_common;
mod common;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use std::path::Path;
use std::time::{Duration, Instant};

use backup_common::{KillRunners, s3_env};
use common::*;
use serde_json::Value;
use store_fixtures::Moto;

const MIB: u64 = 1 << 20;
const RETAIN: usize = 2;
const SNAP_RETAIN: usize = 3;

fn start(dir: &Path, moto: &Moto) -> Up {
    common::start_up_env(dir, 2, FULL_DISK_OK, &[], &s3_env(&moto.endpoint()))
}

fn json(api: &str, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    serde_json::from_str(&ok(api, &a)).expect("json")
}

fn items(v: &Value) -> Vec<Value> {
    v["items"].as_array().cloned().unwrap_or_default()
}

/// The backups job `job` took that are not being deleted: (name, state).
fn job_backups(api: &str, job: &str) -> Vec<(String, String)> {
    items(&json(api, &["backup", "ls"]))
        .into_iter()
        .filter(|b| b["spec"]["labels"]["zebu.io/recurring-job"] == job)
        .filter(|b| b["metadata"]["deletionTimestamp"].is_null())
        .map(|b| {
            (
                b["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                b["status"]["state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// The volume's snapshots job `job` took.
fn job_snapshots(api: &str, volume: &str, job: &str) -> Vec<String> {
    let prefix = format!("{job}-rj");
    items(&json(api, &["snapshot", "ls", volume]))
        .into_iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn runs(api: &str, job: &str) -> u64 {
    json(api, &["recurring-job", "get", job])["status"]["runs"]
        .as_u64()
        .unwrap_or(0)
}

fn refused(api: &str, args: &[&str]) -> String {
    let out = zebu(api, args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    err
}

/// Waits until job `rjb` has run `min_runs` times and holds exactly [`RETAIN`] completed
/// backups, the same ones the bucket holds manifests of (besides `keep`, the user's); at
/// every look, no more than one completed backup beyond retention (the one a pass has not
/// deleted yet) and the user's backup still there.
fn wait_backups_retained(
    api: &str,
    moto: &Moto,
    min_runs: u64,
    keep: &str,
    replaced: &[String],
) -> Vec<String> {
    let mut last = String::new();
    let start = Instant::now();
    loop {
        let mine = job_backups(api, "rjb");
        let done: Vec<String> = mine
            .iter()
            .filter(|(_, s)| s == "completed")
            .map(|(n, _)| n.clone())
            .collect();
        assert!(
            done.len() <= RETAIN + 1,
            "job rjb holds {} completed backups, retain {RETAIN}: {mine:?}",
            done.len()
        );
        assert!(
            mine.iter().all(|(_, s)| s != "error"),
            "a recurring backup failed: {mine:?}"
        );
        let in_bucket = backup_common::manifests(moto, "zebu", "rj/");
        assert!(
            in_bucket.iter().any(|n| n == keep),
            "the user's backup {keep} left the bucket: {in_bucket:?}"
        );
        let of_job: Vec<String> = in_bucket
            .iter()
            .filter(|n| n.starts_with("rjb-rj"))
            .cloned()
            .collect();
        let n = runs(api, "rjb");
        let settled = mine.iter().all(|(_, s)| s == "completed");
        let mut sorted = done.clone();
        sorted.sort();
        let renewed = done.iter().all(|b| !replaced.contains(b));
        if n >= min_runs && settled && done.len() == RETAIN && of_job == sorted && renewed {
            eprintln!("rjb after {n} runs keeps {done:?}; bucket {in_bucket:?}");
            return done;
        }
        let now = format!("runs {n}, backups {mine:?}, bucket {of_job:?}");
        if now != last {
            eprintln!("{now}");
            last = now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "job rjb did not settle at {RETAIN} backups, none of {replaced:?}, after {min_runs} runs: {last}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn wait_snapshots_retained(api: &str, min_runs: u64, replaced: &[String]) -> Vec<String> {
    let mut seen_over = 0;
    let start = Instant::now();
    loop {
        let snaps = job_snapshots(api, "s", "rjs");
        assert!(
            snaps.len() <= SNAP_RETAIN + 1,
            "job rjs holds {} snapshots, retain {SNAP_RETAIN}: {snaps:?}",
            snaps.len()
        );
        if snaps.len() > SNAP_RETAIN {
            seen_over += 1;
        }
        let n = runs(api, "rjs");
        let renewed = snaps.iter().all(|s| !replaced.contains(s));
        if n >= min_runs && snaps.len() == SNAP_RETAIN && renewed {
            eprintln!(
                "rjs after {n} runs keeps {snaps:?} ({seen_over} looks saw one over retention)"
            );
            return snaps;
        }
        assert!(
            start.elapsed() < Duration::from_secs(240),
            "job rjs did not settle at {SNAP_RETAIN} snapshots, none of {replaced:?}, after {min_runs} runs: runs {n}, {snaps:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn recurring_jobs_keep_exactly_retain_backups_and_snapshots_across_a_manager_restart() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    let up = start(tmp.path(), &moto);
    let api = up.api.clone();
    wait_nodes(&api, 2);

    for v in ["v", "s"] {
        ok(
            &api,
            &[
                "volume",
                "create",
                v,
                "--size",
                "32M",
                "--replicas",
                "2",
                "--frontend",
                "nbd",
            ],
        );
    }
    let endpoint = ok(&api, &["volume", "attach", "v"]).trim().to_string();
    let src = tmp.path().join("random.bin");
    std::fs::write(&src, store_fixtures::random_bytes(7, (4 * MIB) as usize)).expect("random");
    qemu_io(
        &endpoint,
        &format!("write -s {} 0 {}", src.display(), 4 * MIB),
    );
    ok(&api, &["volume", "attach", "s"]);

    // A backup job needs a target; bad input is one line and makes nothing.
    let e = refused(
        &api,
        &[
            "recurring-job",
            "create",
            "rjb",
            "--task",
            "backup",
            "--cron",
            "*/3 * * * * *",
            "--retain",
            "2",
            "--volume",
            "v",
        ],
    );
    assert!(e.contains("target"), "{e}");
    ok(&api, &["backup", "target", "set", "s3://zebu@us-east-1/rj"]);
    for (args, says) in [
        (
            &["--cron", "every now and then", "--retain", "2"][..],
            "cron",
        ),
        (&["--cron", "@every 0s", "--retain", "2"][..], "under 1 s"),
        (&["--cron", "@every 3s", "--retain", "0"][..], "retain"),
    ] {
        let mut a = vec![
            "recurring-job",
            "create",
            "bad",
            "--task",
            "backup",
            "--volume",
            "v",
        ];
        a.extend(args);
        let e = refused(&api, &a);
        assert!(e.contains(says), "{a:?}: {e}");
    }
    let e = refused(
        &api,
        &[
            "recurring-job",
            "create",
            "bad",
            "--task",
            "snapshot",
            "--cron",
            "@every 3s",
            "--retain",
            "1",
        ],
    );
    assert!(e.contains("needs volumes"), "{e}");
    assert!(
        items(&json(&api, &["recurring-job", "ls"])).is_empty(),
        "a refused job was recorded"
    );

    // The user's own backup of the same volume: no job may delete it.
    ok(&api, &["backup", "create", "v", "--name", "mine", "--wait"]);

    ok(
        &api,
        &[
            "recurring-job",
            "create",
            "rjb",
            "--task",
            "backup",
            "--cron",
            "*/3 * * * * *",
            "--retain",
            &RETAIN.to_string(),
            "--volume",
            "v",
        ],
    );
    ok(
        &api,
        &[
            "recurring-job",
            "create",
            "rjs",
            "--task",
            "snapshot",
            "--cron",
            "@every 2s",
            "--retain",
            &SNAP_RETAIN.to_string(),
            "--volume",
            "s",
        ],
    );
    let table = ok(&api, &["recurring-job", "ls"]);
    assert!(
        table.contains("rjb") && table.contains("rjs"),
        "ls: {table}"
    );

    let kept = wait_backups_retained(&api, &moto, RETAIN as u64 + 2, "mine", &[]);
    let snaps = wait_snapshots_retained(&api, SNAP_RETAIN as u64 + 2, &[]);
    for b in &kept {
        let v = ok(&api, &["backup", "verify", b]);
        assert!(v.contains("ok"), "verify {b}: {v}");
    }

    // kill -9 the manager; the jobs go on under the next one.
    let (before_b, before_s) = (runs(&api, "rjb"), runs(&api, "rjs"));
    let mut up = up;
    up.kill9();
    std::thread::sleep(Duration::from_secs(3));
    let up = start(tmp.path(), &moto);
    let api = up.api.clone();
    wait_nodes(&api, 2);
    // Under the next manager the jobs run on and retention goes on removing the oldest: in
    // time every backup and snapshot kept is one made after the restart. (Counting runs
    // alone cannot say when: a run is counted before its object exists, and a run cut
    // short by the kill is counted with none.)
    wait_backups_retained(&api, &moto, before_b + 2, "mine", &kept);
    wait_snapshots_retained(&api, before_s + 2, &snaps);

    // rm stops the job; what it took stays.
    ok(&api, &["recurring-job", "rm", "rjb"]);
    ok(&api, &["recurring-job", "rm", "rjs"]);
    let e = refused(&api, &["recurring-job", "get", "rjb"]);
    assert!(e.contains("not found"), "{e}");
    // Let a backup started just before the rm finish, then nothing new may come.
    wait_for("the last recurring backup settles", 120, || {
        job_backups(&api, "rjb")
            .iter()
            .all(|(_, s)| s == "completed")
    });
    let settled = job_backups(&api, "rjb");
    let snaps_settled = job_snapshots(&api, "s", "rjs");
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(job_backups(&api, "rjb"), settled, "a deleted job ran");
    assert_eq!(
        job_snapshots(&api, "s", "rjs"),
        snaps_settled,
        "a deleted job ran"
    );
    assert!(settled.len() >= RETAIN, "rm deleted what the job took");
    drop(up);
}
