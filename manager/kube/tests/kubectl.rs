//! What people see: `kubectl get zv` (and `volumes.zebu.io`, `-o wide`) prints the
//! columns of the CRD, `kubectl explain` describes the fields from the Rust docs, and the
//! `zebu` CLI works against the cluster with `--kubeconfig`. Needs the `zebu` binary
//! (`cargo build --workspace --bins`; `ZEBU_BIN_DIR` as in tests/run.sh).

mod common;

use std::path::PathBuf;
use std::process::Command;

use serde_json::json;
use zebu_kube_store::KubeStoreOptions;
use zebu_types::store::TypedStore;
use zebu_types::{Kind, Store};

fn zebu() -> PathBuf {
    let dir = std::env::var_os("ZEBU_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::repo().join("target/debug"));
    let bin = dir.join("zebu");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        bin.display()
    );
    bin
}

/// The words of each line of a kubectl table.
fn table(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[tokio::test]
async fn kubectl_prints_volume_columns_and_explains_fields_and_the_cli_works_on_the_cluster() {
    let c = common::cluster();
    let ns = c.namespace("zt-kubectl").await;
    let admin = c.kubeconfig("ADMIN");

    // Three ready nodes, as their agents would register them.
    let store = c.store("ADMIN", &ns, KubeStoreOptions::default()).await;
    for i in 1..=3 {
        let n = zebu_controllers::cases::ready_node(i);
        let mut created = store.create_as(&n).await.expect("node");
        created.status = n.status.clone();
        store.update_status_as(&created).await.expect("node status");
    }

    // The CLI creates the volume through the operations layer over the cluster.
    let created = Command::new(zebu())
        .arg("--kubeconfig")
        .arg(&admin)
        .args([
            "--namespace",
            &ns,
            "volume",
            "create",
            "db",
            "--size",
            "10G",
        ])
        .args(["--replicas", "3", "--frontend", "nbd"])
        .output()
        .expect("run zebu");
    assert!(
        created.status.success(),
        "zebu volume create: {}",
        String::from_utf8_lossy(&created.stderr)
    );

    // A controller's status write, as the managers would make it.
    let mut v = store
        .get(Kind::Volume, "db")
        .await
        .expect("get")
        .expect("created");
    v["spec"]["nodeId"] = json!("node-1");
    let mut v = store.update(v).await.expect("attach");
    v["status"] = json!({
        "state": "attached", "robustness": "healthy", "currentNode": "node-1",
        "endpoint": "nbd://127.0.0.11:10809",
        "replicas": [
            {"name": "db-r-1", "node": "node-1", "mode": "RW"},
            {"name": "db-r-2", "node": "node-2", "mode": "RW"},
            {"name": "db-r-3", "node": "node-3", "mode": "RW"},
        ],
    });
    store.update_status(v).await.expect("status");

    for resource in ["zv", "volumes.zebu.io", "volume"] {
        let out = c.kubectl_out(&["get", resource, "-n", &ns]);
        let t = table(&out);
        assert_eq!(
            t[0],
            [
                "NAME",
                "STATE",
                "ROBUSTNESS",
                "SIZE",
                "REPLICAS",
                "NODE",
                "FRONTEND",
                "AGE"
            ],
            "{out}"
        );
        assert_eq!(
            t[1][..7],
            ["db", "attached", "healthy", "10Gi", "3/3", "node-1", "nbd"],
            "{out}"
        );
    }
    let out = c.kubectl_out(&["get", "zv", "-n", &ns, "-o", "wide"]);
    let t = table(&out);
    assert_eq!(
        t[0][8..],
        ["WANTED-NODE", "ENDPOINT", "LOCALITY", "REBUILDING"],
        "{out}"
    );
    assert_eq!(
        t[1][8..11],
        ["node-1", "nbd://127.0.0.11:10809", "disabled"],
        "{out}"
    );
    let out = c.kubectl_out(&["get", "zebu", "-n", &ns]);
    assert!(
        out.contains("volume.zebu.io/db"),
        "the zebu category: {out}"
    );

    let explain = c.kubectl_out(&[
        "explain",
        "volume.spec",
        "--api-version",
        "zebu.io/v1alpha1",
    ]);
    for words in [
        "numberOfReplicas",
        "How many replicas",
        "Size in bytes",
        "`nbd`: An NBD server",
        "The node the volume should be attached to",
    ] {
        assert!(
            explain.contains(words),
            "explain lacks {words:?}:\n{explain}"
        );
    }

    // The CLI reads the cluster too, and says what it may not do.
    let ls = Command::new(zebu())
        .arg("--kubeconfig")
        .arg(&admin)
        .args(["--namespace", &ns, "volume", "ls", "-o", "json"])
        .output()
        .expect("run zebu");
    assert!(
        ls.status.success(),
        "{}",
        String::from_utf8_lossy(&ls.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&ls.stdout).expect("json");
    assert_eq!(listed["items"][0]["metadata"]["name"], "db");
    assert_eq!(listed["items"][0]["spec"]["size"], 10u64 << 30);
    assert_eq!(listed["items"][0]["status"]["currentNode"], "node-1");
    let refused = Command::new(zebu())
        .arg("--kubeconfig")
        .arg(c.kubeconfig("NORIGHTS"))
        .args(["--namespace", &ns, "volume", "ls"])
        .output()
        .expect("run zebu");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot list Volume"), "{err}");
    assert!(err.contains("zebu-norights"), "{err}");
    c.delete_namespace(&ns).await;
}
