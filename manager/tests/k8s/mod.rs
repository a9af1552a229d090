//! The harness of the tests against a real Kubernetes control plane (`tests/k8s`): one
//! cluster shared by every test of a run (`cluster.sh ensure`, keyed by the test runner's
//! pid, stopped when the runner exits), the tools it built, and kubectl.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("manager/ is in the repository")
        .to_path_buf()
}

/// The path of a tool `tests/k8s/tools.sh` built; fails (never skips) when it is not built.
pub fn tool(name: &str) -> PathBuf {
    let out = Command::new(repo().join("tests/k8s/tools.sh"))
        .args(["which", name])
        .output()
        .expect("run tests/k8s/tools.sh");
    assert!(
        out.status.success(),
        "tests/k8s/tools.sh which {name}: {} (build it: tests/k8s/tools.sh all)",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A running control plane, as `cluster.sh` describes it (`cluster.env`).
pub struct Cluster {
    pub env: BTreeMap<String, String>,
}

impl Cluster {
    /// The run's cluster: started by the first test that asks, reused by the others, stopped
    /// when the test runner (this process's parent) exits.
    pub fn ensure() -> Cluster {
        let runner = std::os::unix::process::parent_id();
        let out = Command::new(repo().join("tests/k8s/cluster.sh"))
            .args([
                "ensure",
                "--state",
                &format!("/dev/shm/zebu-k8s-cluster-{runner}"),
                "--watch-pid",
                &runner.to_string(),
            ])
            .output()
            .expect("run tests/k8s/cluster.sh");
        assert!(
            out.status.success(),
            "cluster.sh ensure: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Cluster { env }
    }

    pub fn get(&self, key: &str) -> &str {
        self.env
            .get(key)
            .unwrap_or_else(|| panic!("cluster.env has no {key}"))
    }

    pub fn admin(&self) -> PathBuf {
        PathBuf::from(self.get("ZEBU_K8S_KUBECONFIG_ADMIN"))
    }

    pub fn manager(&self) -> PathBuf {
        PathBuf::from(self.get("ZEBU_K8S_KUBECONFIG_MANAGER"))
    }

    pub fn norights(&self) -> PathBuf {
        PathBuf::from(self.get("ZEBU_K8S_KUBECONFIG_NORIGHTS"))
    }

    /// kubectl with `kubeconfig`.
    pub fn kubectl(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        Command::new(self.get("ZEBU_KUBECTL"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .output()
            .expect("run kubectl")
    }

    /// kubectl as the admin; panics with its stderr unless it succeeds.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(&self.admin(), args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply --server-side` of deploy/zebu.yaml (the CRDs with the rest; returns
    /// once they are established), then bind the `zebu-manager` test user to the rendered
    /// Role, as the chart binds the managers' ServiceAccount.
    pub fn install(&self) {
        let manifests = repo().join("deploy/zebu.yaml");
        self.kubectl_ok(&[
            "apply",
            "--server-side",
            "--field-manager=zebu-tests",
            "-f",
            manifests.to_str().expect("utf-8 path"),
        ]);
        let crds: Vec<String> = std::fs::read_dir(repo().join("deploy/crds"))
            .expect("deploy/crds")
            .flatten()
            .map(|e| {
                format!(
                    "crd/{}",
                    e.file_name().to_string_lossy().replace(".yaml", "")
                )
            })
            .collect();
        let mut wait = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        wait.extend(crds.iter().map(String::as_str));
        self.kubectl_ok(&wait);
        let user = self.get("ZEBU_K8S_MANAGER_USER").to_string();
        let binding = format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: zebu-manager-test-user\n  namespace: zebu-system\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: Role\n  name: zebu-manager\nsubjects:\n  - apiGroup: rbac.authorization.k8s.io\n    kind: User\n    name: {user}\n"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("binding.yaml");
        std::fs::write(&path, binding).expect("write");
        self.kubectl_ok(&[
            "apply",
            "--server-side",
            "--field-manager=zebu-tests",
            "-f",
            path.to_str().expect("utf-8 path"),
        ]);
    }
}
