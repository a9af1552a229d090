//! A Zebu cluster of `zebu manager` processes against the run's kube-apiserver: one
//! namespace of its own (so tests side by side never see each other's volumes, nodes or
//! Leases), the chart's rendered Role copied into it and bound to the `zebu-manager` user
//! (so every manager runs with exactly the rights the chart gives, and a missing one fails
//! the test), and one real `zebu manager` per node on its own loopback address, each with
//! its data directory under one temporary directory.
//!
//! Included by the test files that use it with `#[path = "k8s/managers.rs"] mod managers;`
//! next to `mod common;` and `mod k8s;`.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use crate::common::{ZEBU, kill9, pids};
use crate::k8s::{Cluster, repo};

/// One node's manager process.
pub struct Member {
    pub address: String,
    pub dir: PathBuf,
    child: Option<Child>,
    /// Its REST API, `http://IP:PORT`, while it runs.
    pub api: Option<String>,
}

/// A Zebu cluster in its own namespace; on drop every process it started is killed and the
/// namespace deleted.
pub struct ZebuCluster {
    pub k8s: Cluster,
    pub ns: String,
    pub tmp: tempfile::TempDir,
    kubeconfig: PathBuf,
    pub members: BTreeMap<String, Member>,
    /// Extra environment of every manager started from now on, and of [`Self::zebu`].
    pub env: Vec<(String, String)>,
}

/// The `zebu manager` binaries' neighbour `name` (cargo build --workspace --bins).
pub fn bin(name: &str) -> PathBuf {
    let p = Path::new(ZEBU).parent().expect("bin dir").join(name);
    assert!(
        p.exists(),
        "{} is not built: cargo build --workspace --bins",
        p.display()
    );
    p
}

impl ZebuCluster {
    /// A cluster in namespace `zc-<tag>-<pid>`, no managers yet.
    pub fn new(tag: &str) -> ZebuCluster {
        let k8s = Cluster::ensure();
        k8s.install();
        let ns = format!("zc-{tag}-{}", std::process::id());
        k8s.kubectl_ok(&["create", "namespace", &ns]);
        let tmp = tempfile::tempdir().expect("tempdir");
        let zc = ZebuCluster {
            kubeconfig: k8s.manager(),
            k8s,
            ns,
            tmp,
            members: BTreeMap::new(),
            env: Vec::new(),
        };
        zc.bind_the_charts_role();
        // The shared machine's disk is often fuller than the default free-space reserve.
        zc.apply(&format!(
            "apiVersion: zebu.io/v1alpha1\nkind: Setting\nmetadata:\n  name: storage-minimal-available-percentage\n  namespace: {}\nspec:\n  value: \"0\"\n",
            zc.ns
        ));
        zc
    }

    /// The Role `zebu-manager` exactly as deploy/zebu.yaml renders it, in this namespace,
    /// bound to the `zebu-manager` test user.
    fn bind_the_charts_role(&self) {
        let text = std::fs::read_to_string(repo().join("deploy/zebu.yaml")).expect("zebu.yaml");
        let mut role = None;
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = match serde::Deserialize::deserialize(doc) {
                Ok(v) => v,
                Err(e) => panic!("deploy/zebu.yaml: {e}"),
            };
            if v["kind"] == "Role" && v["metadata"]["name"] == "zebu-manager" {
                role = Some(v);
            }
        }
        let mut role = role.expect("deploy/zebu.yaml renders Role zebu-manager");
        role["metadata"]["namespace"] = Value::String(self.ns.clone());
        let user = self.k8s.get("ZEBU_K8S_MANAGER_USER");
        let binding = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "zebu-manager-test-user", "namespace": self.ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "zebu-manager"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        });
        for obj in [role, binding] {
            self.apply(&serde_json::to_string(&obj).expect("json"));
        }
    }

    /// `kubectl apply` (as the admin) of one manifest (YAML or JSON).
    pub fn apply(&self, manifest: &str) {
        let path = self
            .tmp
            .path()
            .join(format!("manifest-{}.yaml", rand_suffix()));
        std::fs::write(&path, manifest).expect("write manifest");
        self.k8s
            .kubectl_ok(&["apply", "-f", path.to_str().expect("utf-8 path")]);
    }

    /// kubectl in this namespace as the admin; its stdout (panics unless it succeeds).
    pub fn kubectl(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", self.ns.as_str()];
        all.extend_from_slice(args);
        self.k8s.kubectl_ok(&all)
    }

    /// Start (or start again) node `name`'s manager on `address`; returns once it serves
    /// its API.
    pub fn start(&mut self, name: &str, address: &str) {
        let kubeconfig = self.kubeconfig.clone();
        self.start_with(name, address, &kubeconfig, &[]);
    }

    /// The kubeconfig the managers run with (the `zebu-manager` user).
    pub fn manager_kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// [`Self::start`] with another kubeconfig (one through a proxy the test controls) and
    /// environment beyond [`Self::env`] (a name given here wins).
    pub fn start_with(
        &mut self,
        name: &str,
        address: &str,
        kubeconfig: &Path,
        extra_env: &[(String, String)],
    ) {
        let dir = self.tmp.path().join(name);
        std::fs::create_dir_all(&dir).expect("node dir");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.tmp.path().join(format!("{name}.log")))
            .expect("log");
        let mut child = Command::new(ZEBU)
            .arg("manager")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--namespace", &self.ns, "--node", name, "--address", address])
            .arg("--data-dir")
            .arg(&dir)
            .args(["--listen", "127.0.0.1:0"])
            .env(
                "ZEBU_LOG",
                "zebu_manager=info,zebu_ops=info,zebu_controllers=info,zebu_agent=info,zebu_kube_store=info",
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn zebu manager");
        let mut first = String::new();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        stdout.read_line(&mut first).expect("read");
        drop(stdout);
        let api = first
            .trim()
            .rsplit_once("API listening on ")
            .map(|(_, a)| a.to_string())
            .unwrap_or_else(|| {
                panic!(
                    "zebu manager {name} did not start ({first:?}): {}",
                    self.log_tail(name)
                )
            });
        self.members.insert(
            name.to_string(),
            Member {
                address: address.to_string(),
                dir,
                child: Some(child),
                api: Some(api),
            },
        );
    }

    /// `zebu --kubeconfig ADMIN --namespace NS ARGS...`: the CLI against this cluster, as a
    /// person with kubectl's rights runs it.
    pub fn zebu(&self, args: &[&str]) -> std::process::Output {
        Command::new(ZEBU)
            .arg("--kubeconfig")
            .arg(self.k8s.admin())
            .args(["--namespace", &self.ns])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("run zebu")
    }

    /// [`Self::zebu`] that must succeed: its stdout.
    pub fn zebu_ok(&self, args: &[&str]) -> String {
        let out = self.zebu(args);
        assert!(
            out.status.success(),
            "zebu {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// [`Self::zebu`] that must fail: its stderr.
    pub fn zebu_fails(&self, args: &[&str]) -> String {
        let out = self.zebu(args);
        assert!(
            !out.status.success(),
            "zebu {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// kill -9 node `name`'s manager only (its engines and replicas run on).
    pub fn kill9_manager(&mut self, name: &str) {
        let m = self.members.get_mut(name).expect("member");
        if let Some(mut c) = m.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        m.api = None;
    }

    /// Whether node `name`'s manager process still runs.
    pub fn alive(&mut self, name: &str) -> bool {
        let m = self.members.get_mut(name).expect("member");
        m.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The whole node `name` stops: kill -9 of its manager, engines and replicas.
    pub fn stop_node(&mut self, name: &str) {
        self.kill9_manager(name);
        let needle = self.members[name].dir.display().to_string();
        for pid in self.data_plane(&needle) {
            kill9(pid);
        }
    }

    fn data_plane(&self, needle: &str) -> Vec<i32> {
        pids("zebu-engine", needle)
            .into_iter()
            .chain(pids("zebu-replica", needle))
            .collect()
    }

    /// Every engine process of this cluster, on any node.
    pub fn engines(&self) -> Vec<i32> {
        pids("zebu-engine", &self.tmp.path().display().to_string())
    }

    /// The replica processes on node `name`.
    pub fn replicas_on(&self, name: &str) -> Vec<i32> {
        pids(
            "zebu-replica",
            &self.members[name].dir.display().to_string(),
        )
    }

    /// A Zebu object as the API server has it (`kubectl get KIND NAME -o json`).
    pub fn get(&self, kind: &str, name: &str) -> Option<Value> {
        let out = self.k8s.kubectl(
            &self.k8s.admin(),
            &["-n", &self.ns, "get", kind, name, "-o", "json"],
        );
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).expect("json"))
    }

    /// Every Zebu object of a kind (`kubectl get KIND -o json`'s items).
    pub fn list(&self, kind: &str) -> Vec<Value> {
        let v: Value =
            serde_json::from_str(&self.kubectl(&["get", kind, "-o", "json"])).expect("json");
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// The last lines of node `name`'s manager log.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.tmp.path().join(format!("{name}.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Every manager's log tail, for a failure message.
    pub fn logs(&self) -> String {
        self.members
            .keys()
            .map(|n| format!("--- {n}\n{}", self.log_tail(n)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for ZebuCluster {
    fn drop(&mut self) {
        let names: Vec<String> = self.members.keys().cloned().collect();
        for n in names {
            self.kill9_manager(&n);
        }
        let needle = self.tmp.path().display().to_string();
        for pid in self
            .data_plane(&needle)
            .into_iter()
            .chain(pids("zebu-backup-run", &needle))
        {
            kill9(pid);
        }
        // A failed test leaves its managers' logs for a person to read.
        if std::thread::panicking() {
            let keep = std::env::temp_dir().join(format!("{}-logs", self.ns));
            if std::fs::create_dir_all(&keep).is_ok() {
                for n in self.members.keys() {
                    let log = format!("{n}.log");
                    let _ = std::fs::copy(self.tmp.path().join(&log), keep.join(&log));
                }
                eprintln!("managers' logs kept in {}", keep.display());
            }
        }
        // Finalizers of objects no manager serves any more would keep the namespace
        // terminating; the cluster itself goes when the run ends.
        let _ = self.k8s.kubectl(
            &self.k8s.admin(),
            &["delete", "namespace", &self.ns, "--wait=false"],
        );
    }
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}
