//! End to end: backups of a volume through the manager to a real S3 server (moto) and to a
//! directory, and restores into new 3-replica volumes, with real engines, replicas,
//! `zebu-backup-run` processes and NBD clients (DESIGN §6, issue 16).
//!
//! - A backup taken while a verified workload writes to the volume restores byte-identical
//!   to the volume at its snapshot (the source is reverted to the snapshot and both whole
//!   devices are compared); the next backup is incremental (reads only what changed).
//! - kill -9 of the upload process mid-backup: no backup is listed in the target until a
//!   retry commits it, and the retry restores byte-identical; kill -9 of the manager, then
//!   of the volume's engine, mid-backup: the backup completes and restores byte-identical.
//! - Bad input (a malformed URL, a missing bucket, an unreachable endpoint, a volume that
//!   does not exist): one clear line each, within seconds, nothing recorded.
//! - A flipped byte in a pack object: `zebu backup verify` and a restore both fail naming
//!   the object and the chunk, and the restored volume cannot be attached.
//! - Bit rot on a replica's disk: a block that fails its checksum on the replica the backup
//!   reads is read from another replica (the backup restores byte-identical to what was
//!   written); a block bad on every replica fails the backup, naming it, and nothing is
//!   listed.
//!
//! Needs `zebu-replica`, `zebu-engine` and `zebu-backup-run` built next to `zebu`,
//! `qemu-io` and `qemu-img`, and python3 (the moto venv).

mod common;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use store_fixtures::Moto;

/// `zebu up` with the AWS variables of a moto server (or none).
fn start_up_env(dir: &Path, nodes: u8, env: &[(&str, String)]) -> Up {
    common::start_up_env(dir, nodes, FULL_DISK_OK, &[], env)
}

fn moto_env(m: &Moto) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ACCESS_KEY_ID", "testing".into()),
        ("AWS_SECRET_ACCESS_KEY", "testing".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ENDPOINT_URL", m.endpoint()),
    ]
}

/// Kills every `zebu-backup-run` of the cluster in `dir` when the test ends.
struct KillRunners(String);
impl Drop for KillRunners {
    fn drop(&mut self) {
        for pid in pids("zebu-backup-run", &self.0) {
            kill9(pid);
        }
    }
}

fn fails(api: &str, args: &[&str]) -> String {
    let out = zebu(api, args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail: {err}");
    err
}

fn backup(api: &str, name: &str) -> Option<Value> {
    let out = zebu(api, &["backup", "get", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).expect("json"))
}

fn wait_detached(api: &str, name: &str) {
    wait_for("detached", 90, || {
        volume(api, name)
            .is_some_and(|v| v["status"]["state"] == "detached" && v["spec"]["nodeId"].is_null())
    });
}

/// The whole device behind an NBD endpoint, read into a file.
fn image(endpoint: &str, out: &Path) -> Vec<u8> {
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", endpoint])
        .arg(out)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert {endpoint}");
    std::fs::read(out).expect("read image")
}

/// The first differing 4 KiB block, for a readable failure.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.chunks(4096)
        .zip(b.chunks(4096))
        .position(|(x, y)| x != y)
        .map(|i| i * 4096)
}

/// Restores `backup` into a new 3-replica volume, waits for it, attaches it and returns
/// its whole device.
fn restore_image(api: &str, backup: &str, volume: &str, tmp: &Path) -> Vec<u8> {
    ok(
        api,
        &[
            "volume",
            "create",
            volume,
            "--from-backup",
            backup,
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    // Not attachable while its replicas are being written.
    let early = zebu(api, &["volume", "attach", volume, "--no-wait"]);
    let v = volume_json(api, volume);
    if v["status"]["restore"]["state"] != "completed" {
        assert_eq!(
            early.status.code(),
            Some(1),
            "attach during a restore must be refused"
        );
        let err = String::from_utf8_lossy(&early.stderr);
        assert!(err.contains("being restored"), "{err}");
    }
    wait_for("restore completed", 300, || {
        let v = volume_json(api, volume);
        let state = v["status"]["restore"]["state"].clone();
        assert_ne!(state, "error", "restore failed: {v}");
        state == "completed"
    });
    let endpoint = ok(api, &["volume", "attach", volume]).trim().to_string();
    let img = image(&endpoint, &tmp.join(format!("{volume}.img")));
    ok(api, &["volume", "detach", volume]);
    img
}

fn volume_json(api: &str, name: &str) -> Value {
    volume(api, name).unwrap_or_else(|| panic!("volume {name} missing"))
}

/// Writes `data` at the start of the device behind `endpoint` with `nbdcopy`, from the file
/// `via`.
fn write_through_nbd(via: &Path, data: &[u8], endpoint: &str) {
    std::fs::write(via, data).expect("write the data file");
    let st = Command::new("nbdcopy")
        .arg(via)
        .arg(endpoint)
        .status()
        .expect("nbdcopy");
    assert!(st.success(), "nbdcopy into {endpoint}");
}

/// `zebu up` with 3 nodes and a file backup target under `dir`, a 64 MiB 3-replica NBD
/// volume `v` attached, `data` written at its start: the cluster, the target's directory and
/// the volume's endpoint.
fn random_volume_on_a_file_target(dir: &Path, data: &[u8]) -> (Up, PathBuf, String) {
    let store = dir.join("target");
    std::fs::create_dir_all(&store).expect("target dir");
    let up = start_up_env(dir, 3, &[]);
    let api = up.api.clone();
    wait_nodes(&api, 3);
    let url = format!("file://{}", store.display());
    ok(&api, &["backup", "target", "set", &url]);
    ok(
        &api,
        &[
            "volume",
            "create",
            "v",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "v"]).trim().to_string();
    write_through_nbd(&dir.join("random.img"), data, &endpoint);
    (up, store, endpoint)
}

fn objects_in(store: &Path) -> Vec<PathBuf> {
    fn walk(p: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                if e.path().is_dir() {
                    walk(&e.path(), out);
                } else {
                    out.push(e.path());
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(store, &mut out);
    out.sort();
    out
}

#[test]
fn backups_under_io_to_s3_restore_byte_identical_and_survive_a_killed_upload() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    let up = start_up_env(tmp.path(), 3, &moto_env(&moto));
    let api = up.api.clone();
    wait_nodes(&api, 3);

    // Bad targets are refused at once, with one line that says what is wrong.
    let t0 = Instant::now();
    let e = fails(&api, &["backup", "target", "set", "s3:/zebu"]);
    assert!(e.contains("bad backup target URL"), "{e}");
    let e = fails(
        &api,
        &["backup", "target", "set", "s3://no-such-bucket@us-east-1/x"],
    );
    assert!(e.contains("does not exist"), "{e}");
    let e = fails(
        &api,
        &[
            "backup",
            "target",
            "set",
            "s3://zebu@us-east-1/x",
            "--credentials",
            "/nonexistent/creds",
        ],
    );
    assert!(e.contains("/nonexistent/creds"), "{e}");
    let e = fails(&api, &["backup", "create", "src"]);
    assert!(
        e.contains("not found") || e.contains("no backup target"),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "bad input took {:?}",
        t0.elapsed()
    );
    assert_eq!(lines(&e), 1, "one line: {e}");
    fails(&api, &["backup", "target", "get"]);

    ok(
        &api,
        &["backup", "target", "set", "s3://zebu@us-east-1/cluster-a"],
    );
    let e = fails(&api, &["backup", "create", "nope"]);
    assert!(e.contains("volume \"nope\" not found"), "{e}");

    ok(
        &api,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "160M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "src"]).trim().to_string();
    qemu_io(&endpoint, "write -P 0xa1 0 8M");
    qemu_io(&endpoint, "write -P 0x3c 20M 3M");
    qemu_io(&endpoint, "write -P 0x77 130M 64k");

    // b1, taken while a verified workload writes [64M, 96M).
    let stop = Arc::new(AtomicBool::new(false));
    let writer = background_writer(&endpoint, stop.clone());
    std::thread::sleep(Duration::from_secs(2));
    let out = ok(&api, &["backup", "create", "src", "--name", "b1", "--wait"]);
    assert!(out.contains("b1"), "{out}");
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let (report, wrong) = writer.join().expect("writer");
    assert_eq!(wrong, 0, "the workload read back wrong blocks: {report:?}");
    assert!(report.writes > 0, "the workload wrote nothing: {report:?}");
    let b1 = backup(&api, "b1").expect("b1");
    assert_eq!(b1["status"]["state"], "completed", "{b1}");
    assert!(
        b1["status"].get("parent").is_none(),
        "a first backup is full: {b1}"
    );
    let b1_read = b1["status"]["read"].as_u64().expect("read");

    // b2: 2 MiB more, incremental to b1.
    qemu_io(&endpoint, "write -P 0x5e 1M 2M");
    ok(&api, &["backup", "create", "src", "--name", "b2", "--wait"]);
    let b2 = backup(&api, "b2").expect("b2");
    assert_eq!(b2["status"]["parent"], "b1", "{b2}");
    let b2_read = b2["status"]["read"].as_u64().expect("read");
    // Since b1: the workload's writes in [64M, 96M) after its snapshot, and 2 MiB.
    assert!(
        b2_read <= 35 << 20,
        "the incremental read {b2_read} bytes (the full one {b1_read})"
    );
    let src_now = image(&endpoint, &tmp.path().join("src-b2.img"));

    // b3: the upload process is killed as soon as it runs; the retry commits it.
    qemu_io(&endpoint, "write -P 0x99 40M 16M");
    let created = ok(&api, &["backup", "create", "src", "--name", "b3"]);
    assert!(created.contains("b3"), "{created}");
    let needle = format!("{}/backups/jobs/backup-b3.json", tmp.path().display());
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && !killed {
        for pid in pids("zebu-backup-run", &needle) {
            kill9(pid);
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(killed, "never saw the upload process of b3");
    assert!(listed_ok(&moto), "moto answers");
    let listed = store_fixtures::http(
        moto.endpoint()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port"),
        "GET",
        "/zebu?list-type=2&prefix=cluster-a/",
        &[],
    )
    .unwrap_or_default();
    let b3_now = backup(&api, "b3").expect("b3");
    if b3_now["status"]["state"] != "completed" {
        assert!(
            !listed.contains("/backups/b3.manifest"),
            "a killed backup is listed in the target before its retry: {listed}"
        );
    }
    wait_for("b3 completed after a retry", 180, || {
        let b = backup(&api, "b3").expect("b3");
        assert_ne!(b["status"]["state"], "error", "{b}");
        b["status"]["state"] == "completed"
    });
    let b3 = backup(&api, "b3").expect("b3");
    assert!(b3["status"]["attempts"].as_u64().unwrap_or(0) >= 2, "{b3}");
    // Incremental to b2, which nothing wrote over but the 16 MiB at 40M.
    assert_eq!(b3["status"]["parent"], "b2", "{b3}");
    let b3_read = b3["status"]["read"].as_u64().expect("read");
    assert!(
        b3_read <= 17 << 20,
        "b3 read {b3_read} bytes for 16 MiB changed"
    );
    let src_b3 = image(&endpoint, &tmp.path().join("src-b3.img"));

    let table = ok(&api, &["backup", "ls", "src"]);
    for n in ["b1", "b2", "b3"] {
        assert!(table.contains(n), "{table}");
    }

    // Every backup restores byte-identical to the volume at its snapshot.
    let r2 = restore_image(&api, "b2", "r2", tmp.path());
    assert_eq!(
        first_difference(&r2, &src_now),
        None,
        "restore of b2 differs"
    );
    let r3 = restore_image(&api, "b3", "r3", tmp.path());
    assert_eq!(
        first_difference(&r3, &src_b3),
        None,
        "restore of b3 differs"
    );
    ok(&api, &["volume", "detach", "src"]);
    wait_detached(&api, "src");
    ok(&api, &["snapshot", "revert", "src", "b1"]);
    let endpoint = ok(&api, &["volume", "attach", "src"]).trim().to_string();
    let src_b1 = image(&endpoint, &tmp.path().join("src-b1.img"));
    let r1 = restore_image(&api, "b1", "r1", tmp.path());
    assert_eq!(
        first_difference(&r1, &src_b1),
        None,
        "restore of b1 differs"
    );
    assert_ne!(
        src_b1, src_now,
        "the snapshots must differ for the test to mean anything"
    );

    // Delete: gone from the cluster and from the target; the others still restore.
    ok(&api, &["backup", "rm", "b2"]);
    wait_for("b2 deleted", 60, || backup(&api, "b2").is_none());
    let listed = list_target(&moto);
    assert!(!listed.contains("/backups/b2.manifest"), "{listed}");
    assert!(listed.contains("/backups/b3.manifest"), "{listed}");

    // b4: the manager is killed -9 while the upload runs; the upload goes on, and the next
    // manager finds its process and records the backup.
    let random = tmp.path().join("random.img");
    write_through_nbd(
        &random,
        &store_fixtures::random_bytes(11, 48 << 20),
        &endpoint,
    );
    let src_b4 = image(&endpoint, &tmp.path().join("src-b4.img"));
    ok(&api, &["backup", "create", "src", "--name", "b4"]);
    let needle = format!("{}/backups/jobs/backup-b4.json", tmp.path().display());
    wait_for("the upload process of b4", 60, || {
        !pids("zebu-backup-run", &needle).is_empty()
    });
    let mut up = up;
    up.kill9();
    let survived = !pids("zebu-backup-run", &needle).is_empty();
    let up = start_up_env(tmp.path(), 3, &moto_env(&moto));
    let api = up.api.clone();
    wait_for("b4 completed after the manager's restart", 180, || {
        let b = backup(&api, "b4").expect("b4");
        assert_ne!(b["status"]["state"], "error", "{b}");
        b["status"]["state"] == "completed"
    });
    let b4 = backup(&api, "b4").expect("b4");
    if survived {
        assert_eq!(
            b4["status"]["attempts"], 1,
            "the upload outlived the manager: {b4}"
        );
    }
    eprintln!(
        "b4: upload process outlived the manager: {survived}; {}",
        b4["status"]
    );
    let r4 = restore_image(&api, "b4", "r4", tmp.path());
    assert_eq!(
        first_difference(&r4, &src_b4),
        None,
        "restore of b4 differs"
    );

    // b5: the volume's engine is killed -9 while the upload runs. The upload reads the
    // snapshot from the replicas, not through the engine, so it goes on (or its retry
    // commits), and the backup restores byte-identical to the volume at its snapshot.
    let cluster = tmp.path().display().to_string();
    // The restored volumes are detached: once their engines are gone, src's is the one left.
    wait_for("only src's engine running", 60, || {
        pids("zebu-engine", &cluster).len() == 1
    });
    let endpoint = volume_json(&api, "src")["status"]["endpoint"]
        .as_str()
        .expect("src is attached")
        .to_string();
    // 64 MiB that neither compresses nor deduplicates: an upload that lasts.
    write_through_nbd(
        &random,
        &store_fixtures::random_bytes(12, 64 << 20),
        &endpoint,
    );
    let src_b5 = image(&endpoint, &tmp.path().join("src-b5.img"));
    ok(&api, &["backup", "create", "src", "--name", "b5"]);
    let job = format!("{}/backups/jobs/backup-b5.json", tmp.path().display());
    wait_for("the upload process of b5", 60, || {
        !pids("zebu-backup-run", &job).is_empty()
    });
    let engine = pids("zebu-engine", &cluster);
    assert_eq!(engine.len(), 1, "{engine:?}");
    kill9(engine[0]);
    let b5_now = backup(&api, "b5").expect("b5");
    assert_ne!(
        b5_now["status"]["state"], "completed",
        "b5 completed before its engine was killed; the kill tests nothing"
    );
    wait_for("b5 completed after its engine was killed", 180, || {
        let b = backup(&api, "b5").expect("b5");
        assert_ne!(b["status"]["state"], "error", "{b}");
        b["status"]["state"] == "completed"
    });
    eprintln!(
        "b5 after its engine was killed: {}",
        backup(&api, "b5").expect("b5")["status"]
    );
    let r5 = restore_image(&api, "b5", "r5", tmp.path());
    assert_eq!(
        first_difference(&r5, &src_b5),
        None,
        "restore of b5 differs"
    );
    drop(up);
}

fn list_target(m: &Moto) -> String {
    let port = m
        .endpoint()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    store_fixtures::http(port, "GET", "/zebu?list-type=2&prefix=cluster-a/", &[])
        .unwrap_or_default()
}

fn listed_ok(m: &Moto) -> bool {
    let port = m
        .endpoint()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    store_fixtures::http(port, "GET", "/zebu?list-type=2&prefix=cluster-a/", &[])
        .is_some_and(|r| r.contains("b1.manifest"))
}

fn lines(s: &str) -> usize {
    s.trim().lines().count()
}

#[test]
fn a_flipped_byte_in_a_pack_fails_verify_and_restore_naming_the_object() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    // Random data, so the pack holds incompressible chunks and most of its bytes are data.
    let (up, store, endpoint) =
        random_volume_on_a_file_target(tmp.path(), &store_fixtures::random_bytes(7, 4 << 20));
    let api = up.api.clone();
    ok(&api, &["backup", "create", "v", "--name", "good", "--wait"]);
    let out = ok(&api, &["backup", "verify", "good"]);
    assert!(out.contains("ok"), "{out}");
    let src = image(&endpoint, &tmp.path().join("v.img"));
    let restored = restore_image(&api, "good", "v2", tmp.path());
    assert_eq!(
        first_difference(&restored, &src),
        None,
        "restore from a file target differs"
    );

    // Flip one byte in the middle of the biggest object (a pack).
    let biggest = objects_in(&store)
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("objects");
    let mut bytes = std::fs::read(&biggest).expect("pack");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&biggest, &bytes).expect("write");
    let object = biggest
        .file_name()
        .expect("name")
        .to_string_lossy()
        .to_string();
    let e = fails(&api, &["backup", "verify", "good"]);
    assert!(
        e.contains("damaged") && e.contains(&object[..12.min(object.len())]),
        "{e}"
    );
    assert!(e.contains("chunk"), "{e}");

    ok(
        &api,
        &[
            "volume",
            "create",
            "v3",
            "--from-backup",
            "good",
            "--replicas",
            "3",
        ],
    );
    wait_for("restore fails", 120, || {
        volume_json(&api, "v3")["status"]["restore"]["state"] == "error"
    });
    let v = volume_json(&api, "v3");
    let why = v["status"]["restore"]["error"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(why.contains("chunk") && why.contains("corrupt"), "{why}");
    let e = fails(&api, &["volume", "attach", "v3"]);
    assert!(e.contains("failed"), "{e}");
    drop(up);
}

#[test]
fn blocks_rotten_on_a_replica_are_read_from_another_and_rotten_on_all_fail_the_backup() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    let data = store_fixtures::random_bytes(11, 32 << 20);
    let (up, _store, endpoint) = random_volume_on_a_file_target(tmp.path(), &data);
    let api = up.api.clone();
    let layers = flushed_head_layers(&api, "v", &endpoint, tmp.path(), 3);

    // One bad block on each replica, in windows of the backup's read far apart: whichever
    // replica the backup reads first has one, and each block has two good copies. Nothing
    // reads the volume until the backups are done (the engine would repair what it reads).
    let mib = 1u64 << 20;
    for (r, at) in [(0, 2 * mib), (1, 12 * mib), (2, 22 * mib)] {
        flip(&layers[r], at + 1234);
    }
    let out = ok(&api, &["backup", "create", "v", "--name", "b1", "--wait"]);
    assert!(!out.is_empty());
    let restored = restore_image(&api, "b1", "v1", tmp.path());
    let mut want = data.clone();
    want.resize(64 << 20, 0);
    assert_eq!(
        first_difference(&restored, &want),
        None,
        "the backup stored a block that failed its checksum on the replica it was read from"
    );

    // A block bad on every replica: the backup fails and says which, and is never listed.
    // (Written again first, so the incremental backup reads it, from the new head layers.)
    let everywhere = 30 * mib + 8192;
    qemu_io(&endpoint, &format!("write -P 0x5c {everywhere} 4k"));
    qemu_io(&endpoint, "flush");
    for dir in replica_dirs(tmp.path(), 3) {
        flip(&head_layer(&dir), everywhere + 77);
    }
    ok(&api, &["backup", "create", "v", "--name", "b2"]);
    let mut why = String::new();
    wait_for(
        "the backup of a block bad everywhere reports it",
        120,
        || {
            let b = backup(&api, "b2").expect("b2");
            assert_ne!(b["status"]["state"], "completed", "{b}");
            why = b["status"]["error"].as_str().unwrap_or("").to_string();
            why.contains("fail their checksum")
        },
    );
    assert!(why.contains(&format!("at byte {everywhere}")), "{why}");
    let listed = ok(&api, &["backup", "ls", "v"]);
    assert!(
        !listed
            .lines()
            .any(|l| l.contains("b2") && l.contains("completed")),
        "{listed}"
    );
    drop(up);
}
