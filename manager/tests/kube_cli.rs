//! The `zebu` CLI against a cluster (`zebu --kubeconfig FILE --namespace NS ...`), with three
//! real `zebu manager` processes (nodes on 127.0.0.11-13, the chart's Role) on the real
//! kube-apiserver of `tests/k8s` and a real S3 server (moto):
//!
//! - every command a person runs on one host works against the cluster: volumes (create,
//!   attach with its wait, get, ls, expand, detach, delete), nodes, snapshots (create, ls,
//!   revert, rm), scrub (`--wait`), the backup target (set, get), backups (create `--wait`,
//!   ls, get, verify, rm) and a restore into a new volume (`volume create --from-backup`);
//! - the backup runs in Kubernetes mode end to end: `zebu manager` runs the backup
//!   controller (on the manager that holds the cluster Lease), and the restored volume reads
//!   back exactly what was written before the backup;
//! - what cannot work in a cluster (`zebu node stop`, `zebu up`) says so in one line.
//!
//! Needs `cargo build --workspace --bins` (zebu, zebu-engine, zebu-replica, zebu-backup-run),
//! `qemu-io`, python3 (the moto venv) and the tools of `tests/k8s/tools.sh k8s`.

use serde_json::Value;

mod common;
mod k8s;
#[path = "k8s/managers.rs"]
mod managers;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use common::{qemu_io, wait_for};
use managers::ZebuCluster;
use store_fixtures::Moto;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn lines(s: &str) -> usize {
    s.trim().lines().count()
}

fn start_nodes(zc: &mut ZebuCluster) {
    for i in 1..=3u8 {
        zc.start(&format!("node-{i}"), &format!("127.0.0.1{i}"));
    }
    wait_for("three Ready nodes in zebu node ls", 90, || {
        let v = json(&zc.zebu_ok(&["node", "ls", "-o", "json"]));
        let items = v["items"].as_array().cloned().unwrap_or_default();
        items.len() == 3
            && items.iter().all(|n| {
                n["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
    });
}

fn volume(zc: &ZebuCluster, name: &str) -> Value {
    json(&zc.zebu_ok(&["volume", "get", name, "-o", "json"]))
}

fn snapshot_names(zc: &ZebuCluster, vol: &str) -> Vec<String> {
    let v = json(&zc.zebu_ok(&["snapshot", "ls", vol, "-o", "json"]));
    let mut names: Vec<String> = v["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

#[test]
fn the_whole_cli_works_against_a_cluster_and_a_backup_completes_in_kubernetes_mode() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let mut zc = ZebuCluster::new("cli");
    zc.env = vec![
        ("AWS_ACCESS_KEY_ID".into(), "testing".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "testing".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_ENDPOINT_URL".into(), moto.endpoint()),
    ];
    start_nodes(&mut zc);

    // Commands that have no meaning in a cluster: one line each.
    let e = zc.zebu_fails(&["node", "stop", "node-1"]);
    assert!(e.contains("simulated nodes"), "{e}");
    assert_eq!(lines(&e), 1, "{e}");
    let e = zc.zebu_fails(&["up"]);
    assert!(e.contains("one host"), "{e}");
    assert_eq!(lines(&e), 1, "{e}");

    // Volumes.
    zc.zebu_ok(&[
        "volume",
        "create",
        "src",
        "--size",
        "64Mi",
        "--replicas",
        "3",
        "--frontend",
        "nbd",
    ]);
    // `attach` waits until the volume is served and prints where, as on one host.
    let endpoint = zc
        .zebu_ok(&["volume", "attach", "src", "--node", "node-1"])
        .trim()
        .to_string();
    assert!(endpoint.starts_with("nbd://127.0.0.11:"), "{endpoint:?}");
    let table = zc.zebu_ok(&["volume", "ls"]);
    assert!(
        table.contains("src") && table.contains("attached"),
        "{table}"
    );
    qemu_io(&endpoint, "write -P 0xa1 0 4M");
    qemu_io(&endpoint, "write -P 0x3c 40M 1M");

    // Snapshots reach the engine through its Engine object's address.
    zc.zebu_ok(&["snapshot", "create", "src", "s1"]);
    assert!(snapshot_names(&zc, "src").contains(&"s1".to_string()));
    qemu_io(&endpoint, "write -P 0x55 0 1M");

    // Scrub, followed to its end.
    let out = zc.zebu_ok(&["volume", "scrub", "src", "--wait"]);
    assert!(out.contains("scrub of src done"), "{out}");
    assert!(out.contains("0 mismatches"), "{out}");

    // The backup target and a backup, through the backup controller of `zebu manager`.
    let e = zc.zebu_fails(&["backup", "target", "get"]);
    assert_eq!(lines(&e), 1, "{e}");
    zc.zebu_ok(&["backup", "target", "set", "s3://zebu@us-east-1/kube-cli"]);
    let t = json(&zc.zebu_ok(&["backup", "target", "get", "-o", "json"]));
    assert_eq!(t["spec"]["url"], "s3://zebu@us-east-1/kube-cli", "{t}");
    let out = zc.zebu_ok(&["backup", "create", "src", "--name", "b1", "--wait"]);
    assert!(out.contains("b1"), "{out}");
    let b1 = json(&zc.zebu_ok(&["backup", "get", "b1", "-o", "json"]));
    assert_eq!(b1["status"]["state"], "completed", "{b1}");
    let listed = json(&zc.zebu_ok(&["backup", "ls", "src", "-o", "json"]));
    assert_eq!(
        listed["items"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    let verified = zc.zebu_ok(&["backup", "verify", "b1"]);
    assert!(!verified.trim().is_empty(), "verify printed nothing");
    // Revert to s1 (detached, as on one host).
    zc.zebu_ok(&["volume", "detach", "src"]);
    // Until the engine is gone the revert says the volume is still detaching.
    wait_for("revert of the detached src", 120, || {
        let out = zc.zebu(&["snapshot", "revert", "src", "s1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || err.contains("still detaching"),
            "revert: {err}"
        );
        out.status.success()
    });
    let endpoint = zc
        .zebu_ok(&["volume", "attach", "src", "--node", "node-2"])
        .trim()
        .to_string();
    assert!(endpoint.starts_with("nbd://127.0.0.12:"), "{endpoint:?}");
    // The revert undid the write made after s1.
    qemu_io(&endpoint, "read -P 0xa1 0 4M");
    qemu_io(&endpoint, "read -P 0x3c 40M 1M");

    // Expand while attached.
    zc.zebu_ok(&["volume", "expand", "src", "--size", "96Mi"]);
    wait_for("src at 96 MiB", 90, || {
        volume(&zc, "src")["spec"]["size"]
            .as_u64()
            .is_some_and(|s| s == 96 << 20)
    });

    // A restore of b1 into a new volume reads back what was written before the backup.
    zc.zebu_ok(&[
        "volume",
        "create",
        "restored",
        "--from-backup",
        "b1",
        "--replicas",
        "3",
        "--frontend",
        "nbd",
    ]);
    wait_for("restore of b1 completed", 300, || {
        let v = volume(&zc, "restored");
        let state = v["status"]["restore"]["state"].clone();
        assert_ne!(state, "error", "restore failed: {v}");
        state == "completed"
    });
    let restored = zc
        .zebu_ok(&["volume", "attach", "restored", "--node", "node-3"])
        .trim()
        .to_string();
    qemu_io(&restored, "read -P 0x55 0 1M");
    qemu_io(&restored, "read -P 0xa1 1M 3M");
    qemu_io(&restored, "read -P 0x3c 40M 1M");
    qemu_io(&restored, "read -P 0 44M 20M");

    // s1 is now a branch point (the layers from before the revert and the new head both
    // grow from it): its removal is refused in one line and s1 stays, as on one host.
    let refused = zc.zebu_fails(&["snapshot", "rm", "src", "s1"]);
    assert!(refused.contains("child layers"), "{refused}");
    assert!(snapshot_names(&zc, "src").contains(&"s1".to_string()));

    // Cleanup through the CLI too.
    zc.zebu_ok(&["backup", "rm", "b1"]);
    wait_for("b1 gone", 120, || {
        !zc.zebu(&["backup", "get", "b1"]).status.success()
    });
    for v in ["restored", "src"] {
        zc.zebu_ok(&["volume", "detach", v]);
    }
    for v in ["restored", "src"] {
        let out = zc.zebu_ok(&["volume", "delete", v]);
        assert!(out.contains("deleted"), "{out}");
    }
    wait_for("volumes gone", 120, || {
        let v = json(&zc.zebu_ok(&["volume", "ls", "-o", "json"]));
        v["items"].as_array().is_some_and(Vec::is_empty)
    });
}
