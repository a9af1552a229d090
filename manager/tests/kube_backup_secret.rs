//! A backup target's credentials from a Kubernetes Secret (issue 16): a real `zebu manager`
//! (node on 127.0.0.11, the chart's Role) on the real kube-apiserver of `tests/k8s`, a real
//! S3 server (moto), real engines, replicas and `zebu-backup-run` processes.
//!
//! Neither the manager nor the CLI has any `AWS_*` variable: the keys, the region and the
//! endpoint of the S3 server are only in the Secret the BackupTarget names, so a backup
//! that reaches moto at all read them from there. The test shows:
//!
//! - `zebu backup target set URL --credentials SECRET` refuses a Secret that does not exist,
//!   naming it and the namespace, and succeeds once it exists (the target is checked with
//!   the Secret's credentials);
//! - a backup completes through the manager's `zebu-backup-run` process, which gets the
//!   credentials in a file readable by its owner only, and a restore of it reads back what
//!   was written;
//! - the Secret is read when needed, not once: with it deleted, a new backup says which
//!   Secret is missing and starts no attempt.
//!
//! Needs `cargo build --workspace --bins` (zebu, zebu-engine, zebu-replica, zebu-backup-run),
//! `qemu-io`, python3 (the moto venv) and the tools of `tests/k8s/tools.sh k8s`.

use std::os::unix::fs::PermissionsExt as _;

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

fn backup(zc: &ZebuCluster, name: &str) -> Value {
    json(&zc.zebu_ok(&["backup", "get", name, "-o", "json"]))
}

#[test]
fn the_backup_target_reads_its_credentials_from_a_kubernetes_secret() {
    for v in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
    ] {
        assert!(
            std::env::var_os(v).is_none(),
            "{v} is set in the test's environment: the test must reach S3 only through the Secret"
        );
    }
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let mut zc = ZebuCluster::new("bksecret");
    zc.start("node-1", "127.0.0.11");
    wait_for("node-1 Ready", 90, || {
        let v = json(&zc.zebu_ok(&["node", "ls", "-o", "json"]));
        v["items"].as_array().is_some_and(|items| {
            items.len() == 1
                && items[0]["status"]["conditions"]
                    .as_array()
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
        })
    });

    let url = "s3://zebu@us-east-1/from-secret";
    let e = zc.zebu_fails(&["backup", "target", "set", url, "--credentials", "zebu-s3"]);
    assert!(
        e.contains("\"zebu-s3\" does not exist") && e.contains(&zc.ns),
        "{e}"
    );
    zc.kubectl(&[
        "create",
        "secret",
        "generic",
        "zebu-s3",
        "--from-literal=AWS_ACCESS_KEY_ID=testing",
        "--from-literal=AWS_SECRET_ACCESS_KEY=testing",
        "--from-literal=AWS_REGION=us-east-1",
        &format!("--from-literal=AWS_ENDPOINT_URL={}", moto.endpoint()),
    ]);
    zc.zebu_ok(&["backup", "target", "set", url, "--credentials", "zebu-s3"]);
    let t = json(&zc.zebu_ok(&["backup", "target", "get", "-o", "json"]));
    assert_eq!(t["spec"]["credentialSecret"], "zebu-s3", "{t}");

    zc.zebu_ok(&[
        "volume",
        "create",
        "src",
        "--size",
        "32Mi",
        "--replicas",
        "1",
        "--frontend",
        "nbd",
    ]);
    let endpoint = zc
        .zebu_ok(&["volume", "attach", "src", "--node", "node-1"])
        .trim()
        .to_string();
    qemu_io(&endpoint, "write -P 0x6d 0 4M");
    qemu_io(&endpoint, "write -P 0x19 20M 1M");
    let out = zc.zebu_ok(&["backup", "create", "src", "--name", "b1", "--wait"]);
    assert!(out.contains("b1"), "{out}");
    let b1 = backup(&zc, "b1");
    assert_eq!(b1["status"]["state"], "completed", "{b1}");
    assert_eq!(b1["status"]["attempts"], 1, "{b1}");

    // The job process read the Secret's pairs from a file only its owner may read.
    let creds = zc.members["node-1"]
        .dir
        .join("backups/credentials/zebu-s3.env");
    let mode = std::fs::metadata(&creds)
        .unwrap_or_else(|e| panic!("{}: {e}", creds.display()))
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{}", creds.display());
    let text = std::fs::read_to_string(&creds).expect("credentials file");
    assert!(text.contains(&format!("AWS_ENDPOINT_URL={}", moto.endpoint())));

    let verified = json(&zc.zebu_ok(&["backup", "verify", "b1", "-o", "json"]));
    assert_eq!(verified["ok"], true, "{verified}");

    // A restore through the same credentials reads back what was written.
    zc.zebu_ok(&["volume", "detach", "src"]);
    zc.zebu_ok(&[
        "volume",
        "create",
        "restored",
        "--from-backup",
        "b1",
        "--replicas",
        "1",
        "--frontend",
        "nbd",
    ]);
    wait_for("restore of b1 completed", 240, || {
        let v = json(&zc.zebu_ok(&["volume", "get", "restored", "-o", "json"]));
        let state = v["status"]["restore"]["state"].clone();
        assert_ne!(state, "error", "restore failed: {v}");
        state == "completed"
    });
    let restored = zc
        .zebu_ok(&["volume", "attach", "restored", "--node", "node-1"])
        .trim()
        .to_string();
    qemu_io(&restored, "read -P 0x6d 0 4M");
    qemu_io(&restored, "read -P 0 4M 16M");
    qemu_io(&restored, "read -P 0x19 20M 1M");
    zc.zebu_ok(&["volume", "detach", "restored"]);

    // Without the Secret, a new backup says which one is missing and makes no attempt.
    zc.kubectl(&["delete", "secret", "zebu-s3"]);
    let endpoint = zc
        .zebu_ok(&["volume", "attach", "src", "--node", "node-1"])
        .trim()
        .to_string();
    assert!(endpoint.starts_with("nbd://"), "{endpoint}");
    zc.zebu_ok(&["backup", "create", "src", "--name", "b2"]);
    wait_for("b2 names the missing Secret", 60, || {
        let b = backup(&zc, "b2");
        b["status"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("\"zebu-s3\" does not exist"))
    });
    let b2 = backup(&zc, "b2");
    assert_eq!(b2["status"]["attempts"].as_u64().unwrap_or(0), 0, "{b2}");
    assert_ne!(b2["status"]["state"], "completed", "{b2}");
}
