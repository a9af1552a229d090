//! A real Kubernetes control plane for this crate's tests: `tests/k8s/cluster.sh ensure`,
//! shared by every test process of one run (keyed by the runner's PID, which the cluster's
//! watcher follows, so nothing outlives the run), the CRDs from `deploy/crds/` applied, and
//! one fresh namespace per test.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, PostParams};
use zebu_kube_store::{KubeStore, KubeStoreOptions};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub struct Cluster {
    pub env: HashMap<String, String>,
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The run's cluster, with the CRDs applied and established.
pub fn cluster() -> Cluster {
    let runner = std::os::unix::process::parent_id();
    let state = format!("/dev/shm/zebu-k8s-{runner}");
    let script = repo().join("tests/k8s/cluster.sh");
    let out = run(Command::new(&script).args([
        "ensure",
        "--state",
        &state,
        "--watch-pid",
        &runner.to_string(),
    ]));
    let env: HashMap<String, String> = out
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let c = Cluster { env };
    // Several test processes apply at once: one at a time, under a lock in the state
    // directory (removed with the cluster).
    let lock = format!("{state}/crds.lock");
    run(Command::new("flock")
        .args([
            &lock,
            &c.env["ZEBU_KUBECTL"],
            "--kubeconfig",
            &c.env["ZEBU_K8S_KUBECONFIG_ADMIN"],
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
        ])
        .arg(repo().join("deploy/crds")));
    run(c.kubectl().args([
        "wait",
        "--for",
        "condition=established",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=zebu",
        "--timeout=60s",
    ]));
    c
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Cluster {
    pub fn kubeconfig(&self, who: &str) -> PathBuf {
        PathBuf::from(&self.env[&format!("ZEBU_K8S_KUBECONFIG_{who}")])
    }

    /// kubectl as the admin.
    pub fn kubectl(&self) -> Command {
        let mut c = Command::new(&self.env["ZEBU_KUBECTL"]);
        c.arg("--kubeconfig").arg(self.kubeconfig("ADMIN"));
        c
    }

    pub fn kubectl_out(&self, args: &[&str]) -> String {
        run(self.kubectl().args(args))
    }

    pub async fn admin_client(&self) -> kube::Client {
        let file =
            kube::config::Kubeconfig::read_from(self.kubeconfig("ADMIN")).expect("kubeconfig");
        let config =
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .expect("config");
        zebu_kube_store::client::from_config(config).expect("client")
    }

    /// A new namespace named after `prefix`, this process and a counter.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("ns");
        Api::<Namespace>::all(self.admin_client().await)
            .create(&PostParams::default(), &ns)
            .await
            .expect("create namespace");
        name
    }

    pub async fn delete_namespace(&self, name: &str) {
        let _ = Api::<Namespace>::all(self.admin_client().await)
            .delete(name, &DeleteParams::default())
            .await;
    }

    /// A store in `namespace` with the credentials of `who` (`ADMIN`, `MANAGER`, `NORIGHTS`).
    pub async fn store(&self, who: &str, namespace: &str, options: KubeStoreOptions) -> KubeStore {
        KubeStore::connect(Some(&self.kubeconfig(who)), namespace, options)
            .await
            .expect("connect")
    }
}
