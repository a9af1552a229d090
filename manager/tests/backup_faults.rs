//! End to end, faults around backups: `zebu up` with real engines, replicas and
//! `zebu-backup-run` processes, against a real S3 server (moto) reached through a TCP proxy
//! of the test's own ([`backup_common::FaultProxy`]) that counts bytes and can cut S3 away
//! (DESIGN §6, issue 16). GC runs with a one-second margin, so what protects a running
//! backup's packs is the session marker and the two passes, not the margin.
//!
//! 1. **Races.** Two volumes backed up at once while GC passes run and a third volume's
//!    backup is deleted: both backups complete and restore byte-identical.
//! 2. **S3 cut mid-upload.** Every connection to S3 is dropped for a while during a backup:
//!    no manifest appears while it is cut, the backup is committed once S3 is back (by the
//!    same attempt or a retry), and it restores byte-identical.
//! 3. **Manager and upload killed mid-backup.** kill -9 of `zebu up` and of the backup's
//!    upload process: the backup is not listed as completed until a retry under the next
//!    manager commits it, and it restores byte-identical.
//! 4. **GC after all that.** A backup deleted, GC passes until it settles: then a pass
//!    condemns nothing and has nothing waiting (no pack is left without a live chunk:
//!    the deleted volume's, the killed upload's, the deleted backup's), something was
//!    deleted along the way, and every remaining backup still restores byte-identical.
//!
//! Needs `zebu-replica`, `zebu-engine` and `zebu-backup-run` built next to `zebu`,
//! `qemu-io` and `qemu-img`, and python3 (the moto venv).

mod backup_common;
mod common;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use backup_common::*;
use common::*;
use store_fixtures::Moto;

const MIB: u64 = 1 << 20;
const PREFIX: &str = "faults/";

fn start(dir: &Path, proxy: &FaultProxy) -> Up {
    common::start_up_env(dir, 2, FULL_DISK_OK, &[], &s3_env(&proxy.endpoint()))
}

fn state(api: &str, name: &str) -> String {
    backup(api, name).map_or_else(
        || "missing".to_string(),
        |b| {
            b["status"]["state"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        },
    )
}

/// Waits until backup `name` is completed (a failed attempt may be retried; a backup whose
/// retries are over fails the test).
fn wait_completed(api: &str, name: &str, secs: u64) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let b = backup(api, name).unwrap_or_else(|| panic!("backup {name} missing"));
        if b["status"]["state"] == "completed" {
            return b;
        }
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "backup {name} not completed within {secs} s: {}",
            b["status"]
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `zebu backup gc --wait`; its summary.
fn gc(api: &str) -> String {
    let out = zebu(api, &["backup", "gc", "--wait"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "backup gc: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The sum of a `name: N` field over every family's report in a GC summary.
fn field(summary: &str, name: &str) -> u64 {
    summary
        .split(&format!("{name}: "))
        .skip(1)
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

fn volume_image(api: &str, name: &str, tmp: &Path) -> Vec<u8> {
    let v = volume(api, name).expect("volume");
    let endpoint = v["status"]["endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!endpoint.is_empty(), "volume {name} has no endpoint: {v}");
    image(&endpoint, &tmp.join(format!("src-{name}.img")))
}

fn assert_restores(api: &str, backup: &str, into: &str, want: &[u8], tmp: &Path) {
    let got = restore_image(api, backup, into, 2, tmp);
    assert_eq!(
        first_difference(&got, want),
        None,
        "the restore of {backup} differs from the volume at its snapshot"
    );
}

#[test]
fn backups_survive_races_a_cut_s3_and_a_killed_manager_and_gc_leaves_no_orphan() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let proxy = FaultProxy::start(moto.port);
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    let up = start(tmp.path(), &proxy);
    let api = up.api.clone();
    wait_nodes(&api, 2);
    ok(
        &api,
        &[
            "backup",
            "target",
            "set",
            "s3://zebu@us-east-1/faults",
            "--gc-interval",
            "0",
            "--gc-margin",
            "1",
            "--session-ttl",
            "6",
        ],
    );
    let mut endpoints = BTreeMap::new();
    for (i, v) in ["a", "b", "c"].into_iter().enumerate() {
        ok(
            &api,
            &[
                "volume",
                "create",
                v,
                "--size",
                "128M",
                "--replicas",
                "2",
                "--frontend",
                "nbd",
            ],
        );
        let e = ok(&api, &["volume", "attach", v]).trim().to_string();
        let seed = i as u64 + 1;
        // a and b hold more than one pack (64 MiB) of data: their first pack is in the
        // bucket, named by no manifest, while the rest uploads (what scenario 1 races).
        let first = if v == "c" { 12 * MIB } else { 100 * MIB };
        write_random(&e, tmp.path(), seed * 10, 0, first);
        write_random(&e, tmp.path(), seed * 10 + 1, 100 * MIB, 5 * MIB);
        endpoints.insert(v, e);
    }
    ok(&api, &["backup", "create", "c", "--name", "c1", "--wait"]);
    let mut images = BTreeMap::new();

    // 1. a1 and b1 at once, while c1 is deleted and GC passes run. Throttled, so each
    //    backup's first pack is complete and older than the margin for several seconds
    //    before its manifest: GC condemns it, and only the session marker keeps it.
    proxy.throttle(2);
    let racers: Vec<_> = [("a", "a1"), ("b", "b1")]
        .into_iter()
        .map(|(v, b)| {
            let api = api.clone();
            std::thread::spawn(move || {
                let out = zebu(&api, &["backup", "create", v, "--name", b, "--wait"]);
                (b, out)
            })
        })
        .collect();
    ok(&api, &["backup", "rm", "c1"]);
    let mut race_passes = 0;
    let mut held_by_sessions = 0;
    while racers.iter().any(|t| !t.is_finished()) || race_passes < 3 {
        let s = gc(&api);
        eprintln!("GC during the race: {}", s.trim());
        // Per family: c's condemned pack may wait for the margin, a's and b's only for
        // their writers' sessions.
        held_by_sessions += s
            .split("; ")
            .filter(|f| f.contains("a: Done") || f.contains("b: Done"))
            .filter(|f| field(f, "live_sessions") > 0 && field(f, "waiting") > 0)
            .count();
        race_passes += 1;
        std::thread::sleep(Duration::from_millis(700));
    }
    proxy.throttle(0);
    for t in racers {
        let (b, out) = t.join().expect("racer");
        assert!(
            out.status.success(),
            "backup {b} beside GC: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for v in ["a", "b"] {
        images.insert(format!("{v}1"), volume_image(&api, v, tmp.path()));
    }
    assert_restores(&api, "a1", "ra1", &images["a1"], tmp.path());
    assert_restores(&api, "b1", "rb1", &images["b1"], tmp.path());
    // After the restores, so that a lost pack shows as a bad restore first.
    assert!(
        held_by_sessions > 0,
        "no GC pass of the race had a condemned pack held by a live session (the race tested nothing, or GC ignores sessions)"
    );
    let listed = manifests(&moto, "zebu", PREFIX);
    assert!(!listed.contains(&"c1".to_string()), "c1 left: {listed:?}");

    // 2. S3 cut while a2 uploads.
    write_random(&endpoints["a"], tmp.path(), 5, 4 * MIB, 32 * MIB);
    images.insert("a2".into(), volume_image(&api, "a", tmp.path()));
    // A few seconds of upload at 2 MiB/s a connection: time to act in its middle.
    proxy.throttle(2);
    let (up_before, _) = proxy.bytes();
    ok(&api, &["backup", "create", "a", "--name", "a2"]);
    wait_for("a2 uploading", 120, || {
        let (sent, _) = proxy.bytes();
        sent > up_before + MIB || state(&api, "a2") == "completed"
    });
    let cut_before = state(&api, "a2");
    proxy.cut();
    let cut_at = Instant::now();
    while cut_at.elapsed() < Duration::from_secs(8) {
        assert!(
            !manifests_direct(&moto).contains(&"a2".to_string()) || cut_before == "completed",
            "a2's manifest appeared while S3 was cut"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "a2 when S3 was cut: {cut_before}; after 8 s cut: {}",
        backup(&api, "a2").expect("a2")["status"]
    );
    proxy.mend();
    proxy.throttle(0);
    let a2 = wait_completed(&api, "a2", 240);
    eprintln!("a2 after S3 came back: {}", a2["status"]);
    assert_restores(&api, "a2", "ra2", &images["a2"], tmp.path());

    // 3. kill -9 the manager and the upload process while b2 uploads.
    write_random(&endpoints["b"], tmp.path(), 6, 20 * MIB, 32 * MIB);
    images.insert("b2".into(), volume_image(&api, "b", tmp.path()));
    proxy.throttle(2);
    let (up_before, _) = proxy.bytes();
    ok(&api, &["backup", "create", "b", "--name", "b2"]);
    let needle = format!("{}/backups/jobs/backup-b2.json", tmp.path().display());
    wait_for("b2's upload under way", 120, || {
        !pids("zebu-backup-run", &needle).is_empty() && proxy.bytes().0 > up_before + MIB
    });
    assert_ne!(
        state(&api, "b2"),
        "completed",
        "b2 completed before its upload was killed; the kill tests nothing"
    );
    let mut up = up;
    up.kill9();
    for pid in pids("zebu-backup-run", &needle) {
        kill9(pid);
    }
    proxy.throttle(0);
    assert!(
        !manifests_direct(&moto).contains(&"b2".to_string()),
        "a killed upload committed b2"
    );
    let up = start(tmp.path(), &proxy);
    let api = up.api.clone();
    wait_nodes(&api, 2);
    let b2 = wait_completed(&api, "b2", 300);
    eprintln!("b2 after the manager's restart: {}", b2["status"]);
    assert!(
        b2["status"]["attempts"].as_u64().unwrap_or(0) >= 2,
        "b2 completed without a second attempt although its upload was killed: {}",
        b2["status"]
    );
    assert_restores(&api, "b2", "rb2", &images["b2"], tmp.path());

    // 4. a1 deleted; GC until it settles; nothing orphaned, the rest restores.
    ok(&api, &["backup", "rm", "a1"]);
    // The killed upload's session marker must run out (ttl 6 s) before its packs may go.
    std::thread::sleep(Duration::from_secs(7));
    let mut deleted = 0;
    let mut settled = None;
    for pass in 0..12 {
        let s = gc(&api);
        eprintln!("GC pass {pass}: {}", s.trim());
        deleted += field(&s, "deleted");
        if field(&s, "condemned") == 0 && field(&s, "waiting") == 0 && pass > 0 {
            settled = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    let settled = settled.expect("GC did not settle within 12 passes");
    assert!(deleted > 0, "GC deleted nothing: {settled}");
    assert_eq!(field(&settled, "live_sessions"), 0, "{settled}");
    let listed = manifests(&moto, "zebu", PREFIX);
    assert_eq!(listed, ["a2", "b1", "b2"], "manifests after GC");
    assert_restores(&api, "a2", "ra2b", &images["a2"], tmp.path());
    assert_restores(&api, "b1", "rb1b", &images["b1"], tmp.path());
    assert_restores(&api, "b2", "rb2b", &images["b2"], tmp.path());
    let (sent, received) = proxy.bytes();
    eprintln!(
        "through the proxy: {} MiB to S3, {} MiB from S3, {} connections",
        sent / MIB,
        received / MIB,
        proxy.connections.load(std::sync::atomic::Ordering::Relaxed)
    );
    drop(up);
}

/// The manifests in the bucket, read from moto itself (not through the proxy).
fn manifests_direct(moto: &Moto) -> Vec<String> {
    manifests(moto, "zebu", PREFIX)
}
