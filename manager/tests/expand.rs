//! End to end: `zebu volume expand` grows an attached volume through its engine; the
//! records follow, so the engine and its replicas restart at the new size after a detach.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, `nbdinfo` and `qemu-io`.

mod common;

use std::process::Command;

use common::*;

fn nbd_size(endpoint: &str) -> u64 {
    let out = Command::new("nbdinfo")
        .args(["--size", endpoint])
        .output()
        .expect("nbdinfo");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("nbdinfo: {}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn an_attached_volume_grows_and_keeps_its_size_across_a_restart_of_its_engine() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 2, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 2);
    ok(
        &api,
        &[
            "volume",
            "create",
            "g",
            "--size",
            "64M",
            "--replicas",
            "2",
            "--frontend",
            "nbd",
        ],
    );
    // Detached: there is no engine to grow the replicas; the message says what to do.
    let out = zebu(&api, &["volume", "expand", "g", "--size", "128M"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is not attached") && err.contains("--maintenance"),
        "{err}"
    );

    let endpoint = ok(&api, &["volume", "attach", "g"]).trim().to_string();
    qemu_io(&endpoint, "write -P 0x61 0 1M");
    let out = zebu(&api, &["volume", "expand", "g", "--size", "32M"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot shrink"));
    ok(&api, &["volume", "expand", "g", "--size", "128M"]);
    assert_eq!(nbd_size(&endpoint), 128 << 20);
    let v = volume(&api, "g").expect("volume");
    assert_eq!(v["spec"]["size"], 128u64 << 20);
    qemu_io(&endpoint, "write -P 0x62 100M 1M");
    // Repeating it is a no-op that succeeds.
    ok(&api, &["volume", "expand", "g", "--size", "128M"]);

    // A new engine and restarted replicas must ask for the new size, or they refuse it.
    wait_for("healthy", 60, || {
        volume(&api, "g").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    ok(&api, &["volume", "detach", "g"]);
    wait_for("detached", 60, || {
        volume(&api, "g").is_some_and(|v| v["status"]["state"] == "detached")
    });
    let needle = tmp.path().display().to_string();
    for pid in pids("zebu-replica", &needle) {
        kill9(pid);
    }
    let endpoint = ok(&api, &["volume", "attach", "g"]).trim().to_string();
    assert_eq!(nbd_size(&endpoint), 128 << 20);
    qemu_io(&endpoint, "read -P 0x61 0 1M");
    qemu_io(&endpoint, "read -P 0x62 100M 1M");
    drop(up);
}
