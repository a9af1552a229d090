//! End to end: a standby (disaster-recovery) volume follows a source volume's backups in a
//! real S3 server (moto), with real engines, replicas, `zebu-backup-run` processes and NBD
//! clients (DESIGN §6, issue 16).
//!
//! The standby restores the first backup whole and each later one as an increment (its
//! download is about the chunks that changed, not the volume); it cannot be attached (nor
//! get an engine for a snapshot) until activated; once activated it is a normal volume
//! whose whole device equals the source at its third backup. The layers the standby wrote
//! are immutable snapshots of it named after the backups, so reverting the activated volume
//! to each of them and comparing the whole device checks what it held after each step.
//!
//! Needs `zebu-replica`, `zebu-engine` and `zebu-backup-run` built next to `zebu`,
//! `qemu-io` and `qemu-img`, and python3 (the moto venv).

mod common;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;
use store_fixtures::Moto;

const MIB: u64 = 1 << 20;

/// Kills every `zebu-backup-run` of the cluster in `dir` when the test ends.
struct KillRunners(String);
impl Drop for KillRunners {
    fn drop(&mut self) {
        for pid in pids("zebu-backup-run", &self.0) {
            kill9(pid);
        }
    }
}

fn moto_env(m: &Moto) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ACCESS_KEY_ID", "testing".into()),
        ("AWS_SECRET_ACCESS_KEY", "testing".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ENDPOINT_URL", m.endpoint()),
    ]
}

fn volume_json(api: &str, name: &str) -> Value {
    volume(api, name).unwrap_or_else(|| panic!("volume {name} missing"))
}

/// The whole device behind an NBD endpoint.
fn image(endpoint: &str, out: &Path) -> Vec<u8> {
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", endpoint])
        .arg(out)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert {endpoint}");
    let img = std::fs::read(out).expect("read image");
    let _ = std::fs::remove_file(out);
    img
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.chunks(4096)
        .zip(b.chunks(4096))
        .position(|(x, y)| x != y)
        .map(|i| i * 4096)
}

/// Writes `len` random bytes (from `seed`) at `offset` of the device.
fn write_random(endpoint: &str, tmp: &Path, seed: u64, offset: u64, len: u64) {
    let src = tmp.join(format!("random-{seed}.bin"));
    std::fs::write(&src, store_fixtures::random_bytes(seed, len as usize)).expect("random");
    qemu_io(
        endpoint,
        &format!("write -s {} {offset} {len}", src.display()),
    );
    let _ = std::fs::remove_file(&src);
}

fn backup_wait(api: &str, volume: &str, name: &str) {
    ok(api, &["backup", "create", volume, "--name", name, "--wait"]);
}

/// Waits until the standby holds `backup`; its restore status then.
fn wait_holds(api: &str, standby: &str, backup: &str) -> Value {
    wait_for(&format!("{standby} holds {backup}"), 240, || {
        let v = volume_json(api, standby);
        let r = &v["status"]["restore"];
        assert_ne!(r["state"], "error", "standby restore failed: {v}");
        r["restored"] == backup && r["state"] == "completed"
    });
    volume_json(api, standby)["status"]["restore"].clone()
}

fn wait_detached(api: &str, name: &str) {
    wait_for("detached", 90, || {
        volume(api, name)
            .is_some_and(|v| v["status"]["state"] == "detached" && v["spec"]["nodeId"].is_null())
    });
}

fn failure(api: &str, args: &[&str]) -> String {
    let out = zebu(api, args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    err
}

#[test]
fn a_standby_follows_three_backups_incrementally_and_is_activated_into_the_third() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let tmp = tempfile::tempdir().expect("tempdir");
    let _runners = KillRunners(tmp.path().display().to_string());
    let up = common::start_up_env(tmp.path(), 3, FULL_DISK_OK, &[], &moto_env(&moto));
    let api = up.api.clone();
    wait_nodes(&api, 3);
    ok(&api, &["backup", "target", "set", "s3://zebu@us-east-1/dr"]);

    ok(
        &api,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "64M",
            "--replicas",
            "2",
            "--frontend",
            "nbd",
        ],
    );
    // Nothing to follow yet: refused with one line, nothing created.
    let e = failure(&api, &["volume", "create", "dr", "--standby-from", "src"]);
    assert!(e.contains("no completed backup"), "{e}");
    assert!(
        volume(&api, "dr").is_none(),
        "a refused standby was created"
    );

    let endpoint = ok(&api, &["volume", "attach", "src"]).trim().to_string();
    write_random(&endpoint, tmp.path(), 1, 0, 8 * MIB);
    write_random(&endpoint, tmp.path(), 2, 20 * MIB, 3 * MIB);
    backup_wait(&api, "src", "b1");
    let img1 = image(&endpoint, &tmp.path().join("src-b1.img"));

    ok(
        &api,
        &[
            "volume",
            "create",
            "dr",
            "--standby-from",
            "src",
            "--replicas",
            "2",
            "--frontend",
            "nbd",
        ],
    );
    let v = volume_json(&api, "dr");
    assert_eq!(v["spec"]["size"], volume_json(&api, "src")["spec"]["size"]);
    // A standby cannot be attached, nor get an engine for a snapshot, until activated.
    let e = failure(&api, &["volume", "attach", "dr", "--no-wait"]);
    assert!(
        e.contains("is a standby of volume \"src\"") && e.contains("zebu volume activate dr"),
        "{e}"
    );
    let e = failure(&api, &["snapshot", "create", "dr"]);
    assert!(e.contains("standby"), "{e}");

    let r1 = wait_holds(&api, "dr", "b1");
    assert!(r1["restoredAt"].is_string(), "{r1}");
    assert_eq!(r1["standby"], true, "{r1}");
    let full_download = r1["downloaded"].as_u64().expect("downloaded");
    assert!(
        full_download >= 10 * MIB,
        "the first restore is whole (11 MiB of random data), downloaded {full_download}"
    );

    // b2: 2 MiB rewritten, and 1 MiB of old data zeroed (the increment must write zeros).
    write_random(&endpoint, tmp.path(), 3, MIB, 2 * MIB);
    qemu_io(&endpoint, &format!("write -z {} {}", 20 * MIB, MIB));
    backup_wait(&api, "src", "b2");
    let img2 = image(&endpoint, &tmp.path().join("src-b2.img"));
    let r2 = wait_holds(&api, "dr", "b2");
    let d2 = r2["downloaded"].as_u64().expect("downloaded");
    assert!(
        d2 <= 3 * MIB,
        "the increment to b2 downloaded {d2} bytes for 2 MiB of changed chunks (whole: {full_download})"
    );
    assert_eq!(r2["restores"], 2, "{r2}");

    // b3: 4 MiB more elsewhere.
    write_random(&endpoint, tmp.path(), 4, 40 * MIB, 4 * MIB);
    backup_wait(&api, "src", "b3");
    let img3 = image(&endpoint, &tmp.path().join("src-b3.img"));
    let r3 = wait_holds(&api, "dr", "b3");
    let d3 = r3["downloaded"].as_u64().expect("downloaded");
    assert!(
        d3 <= 5 * MIB,
        "the increment to b3 downloaded {d3} bytes for 4 MiB of changed chunks"
    );
    assert_eq!(r3["restores"], 3, "{r3}");
    // Still a standby: still refused.
    failure(&api, &["volume", "attach", "dr", "--no-wait"]);

    // Activate: it waits until standby mode has ended.
    let out = ok(&api, &["volume", "activate", "dr"]);
    assert!(out.contains("activated, holds b3"), "{out}");
    let v = volume_json(&api, "dr");
    assert!(
        v["metadata"]["annotations"]
            .get("zebu.io/standby-from")
            .is_none(),
        "{v}"
    );
    assert_eq!(v["status"]["restore"]["restored"], "b3", "{v}");
    assert!(v["status"]["restore"]["activatedAt"].is_string(), "{v}");
    assert!(v["status"]["restore"].get("standby").is_none(), "{v}");
    // Activating again is not an error.
    ok(&api, &["volume", "activate", "dr"]);

    let dr = ok(&api, &["volume", "attach", "dr"]).trim().to_string();
    let got3 = image(&dr, &tmp.path().join("dr-3.img"));
    assert_eq!(
        first_difference(&got3, &img3),
        None,
        "the activated standby differs from the source at b3"
    );
    assert_ne!(
        img3, img2,
        "the backups must differ for the test to mean anything"
    );
    assert_ne!(
        img2, img1,
        "the backups must differ for the test to mean anything"
    );

    // What the standby held after each step: its layers, as snapshots of the volume.
    for (snap, want) in [("b2", &img2), ("b1", &img1)] {
        ok(&api, &["volume", "detach", "dr"]);
        wait_detached(&api, "dr");
        ok(&api, &["snapshot", "revert", "dr", snap]);
        let dr = ok(&api, &["volume", "attach", "dr"]).trim().to_string();
        let got = image(&dr, &tmp.path().join(format!("dr-{snap}.img")));
        assert_eq!(
            first_difference(&got, want),
            None,
            "the standby's layer {snap} differs from the source at {snap}"
        );
    }
    // Activating a volume that is not a standby is refused.
    let e = failure(&api, &["volume", "activate", "src"]);
    assert!(e.contains("not a standby volume"), "{e}");
    drop(up);
}
