//! End to end: `zebu snapshot revert VOLUME SNAPSHOT` (issue 17, item 6) with real engines
//! and replicas, checked through the volume's real NBD endpoint.
//!
//! - Attached with its frontend: refused with what to do; the data is untouched.
//! - Detached: the revert attaches it without a frontend, reverts, and detaches it again.
//! - Attached with `--maintenance`: reverted in place; attach with a frontend is refused
//!   until it is detached.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, and `qemu-io`.

mod common;

use common::*;
use serde_json::Value;

fn snapshot_names(text: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(text).expect("json");
    v["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect()
}

fn wait_detached(api: &str, name: &str) {
    wait_for("detached", 60, || {
        volume(api, name)
            .is_some_and(|v| v["status"]["state"] == "detached" && v["spec"]["nodeId"].is_null())
    });
}

#[test]
fn revert_refuses_a_served_volume_and_reverts_detached_and_maintenance_volumes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 3, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 3);
    ok(
        &api,
        &[
            "volume",
            "create",
            "r",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&api, &["volume", "attach", "r"]).trim().to_string();
    qemu_io(&endpoint, "write -P 0xaa 0 1M");
    let taken = ok(&api, &["snapshot", "create", "r", "s1", "-o", "json"]);
    assert!(
        snapshot_names(&taken).contains(&"s1".to_string()),
        "{taken}"
    );
    qemu_io(&endpoint, "write -P 0xbb 0 1M");
    qemu_io(&endpoint, "write -P 0xcc 2M 1M");

    // Served by its frontend: refused, and nothing changes.
    let out = zebu(&api, &["snapshot", "revert", "r", "s1"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is attached to node-1 with its nbd frontend")
            && err.contains("detach it first"),
        "{err}"
    );
    qemu_io(&endpoint, "read -P 0xbb 0 1M");

    // Detached: the revert brings up an engine without a frontend, then detaches again.
    ok(&api, &["volume", "detach", "r"]);
    wait_detached(&api, "r");
    let after = ok(&api, &["snapshot", "revert", "r", "s1", "-o", "json"]);
    assert!(
        snapshot_names(&after).contains(&"s1".to_string()),
        "{after}"
    );
    let v = volume(&api, "r").expect("volume");
    assert!(v["spec"]["nodeId"].is_null(), "detached again: {v}");
    assert!(v["spec"].get("disableFrontend").is_none(), "{v}");
    assert!(
        v["metadata"]["annotations"]
            .get("zebu.io/maintenance")
            .is_none(),
        "{v}"
    );
    let endpoint = ok(&api, &["volume", "attach", "r"]).trim().to_string();
    qemu_io(&endpoint, "read -P 0xaa 0 1M");
    qemu_io(&endpoint, "read -P 0 2M 1M");

    // A snapshot that does not exist: refused by the engine, and the volume is detached
    // again all the same.
    qemu_io(&endpoint, "write -P 0xdd 0 1M");
    ok(&api, &["volume", "detach", "r"]);
    wait_detached(&api, "r");
    let out = zebu(&api, &["snapshot", "revert", "r", "nope"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("nope"), "{err}");
    wait_detached(&api, "r");

    // Attached for maintenance: no endpoint, no attach with a frontend meanwhile, and the
    // revert runs on the engine that is there.
    let printed = ok(&api, &["volume", "attach", "r", "--maintenance"]);
    assert_eq!(printed.trim(), "", "no frontend, no endpoint");
    let out = zebu(&api, &["volume", "attach", "r"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("without its frontend"), "{err}");
    ok(&api, &["snapshot", "revert", "r", "s1"]);
    let v = volume(&api, "r").expect("volume");
    assert_eq!(
        v["spec"]["nodeId"], "node-1",
        "still attached for maintenance: {v}"
    );
    ok(&api, &["volume", "detach", "r"]);
    wait_detached(&api, "r");
    let endpoint = ok(&api, &["volume", "attach", "r"]).trim().to_string();
    qemu_io(&endpoint, "read -P 0xaa 0 1M");
    wait_for("healthy", 60, || {
        volume(&api, "r").is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
    ok(&api, &["volume", "delete", "r"]);
    wait_for("volume gone", 60, || volume(&api, "r").is_none());
    drop(up);
}
