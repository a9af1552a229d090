//! The cached store after a watch's `410 Gone`, on a real one: it keeps serving the map it
//! had while its watch is gone, lists again when the server says the version it watches
//! from was compacted away, and converges on the server's state, deletions included.
//!
//! How the 410 is made real: a second kube-apiserver on the run's etcd, started with
//! `--watch-cache=false`, so its watches are etcd watches from the caller's revision. The
//! store under test reads through that second server; while it is killed (the store's watch
//! is cut, nothing else is), the test writes through the run's own server and compacts etcd
//! past every revision of those writes. When the second server is back, the store's watch
//! from its old version can only be answered `410 Gone`: the events are no longer anywhere.
//! Without the compaction the watch would replay the missed events and no re-list would be
//! needed; without the re-list the store would never see the writes.

mod common;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use zebu_kube_store::{KubeStore, KubeStoreOptions};
use zebu_types::store::{ListParams, TypedStore as _};
use zebu_types::{API_VERSION, Kind, Store};

fn setting(name: &str, value: &str) -> Value {
    json!({"apiVersion": API_VERSION, "kind": "Setting", "metadata": {"name": name}, "spec": {"value": value}})
}

/// Name -> value of a kind's list: what a reader of the store sees.
type Seen = BTreeMap<String, String>;

fn seen(items: &[Value]) -> Seen {
    items
        .iter()
        .map(|o| {
            (
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                o["spec"]["value"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn map(pairs: &[(&str, &str)]) -> Seen {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A second kube-apiserver on the run's etcd, without a watch cache; killed on drop.
struct SecondApiServer {
    args: Vec<String>,
    binary: std::path::PathBuf,
    log: std::path::PathBuf,
    child: Option<Child>,
    port: u16,
}

impl SecondApiServer {
    fn new(c: &common::Cluster, dir: &std::path::Path) -> Self {
        let out = Command::new(common::repo().join("tests/k8s/tools.sh"))
            .args(["which", "kube-apiserver"])
            .output()
            .expect("tools.sh which");
        assert!(out.status.success(), "kube-apiserver is not built");
        let binary = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let state = &c.env["ZEBU_K8S_STATE"];
        let pki = |f: &str| format!("{state}/pki/{f}");
        let port = free_port();
        let args = [
            "--etcd-servers",
            &c.env["ZEBU_K8S_ETCD"],
            "--watch-cache=false",
            "--bind-address",
            "127.0.0.1",
            "--advertise-address",
            "127.0.0.1",
            "--secure-port",
            &port.to_string(),
            "--tls-cert-file",
            &pki("apiserver.crt"),
            "--tls-private-key-file",
            &pki("apiserver.key"),
            "--token-auth-file",
            &pki("tokens.csv"),
            "--authorization-mode",
            "RBAC",
            "--service-account-issuer",
            "https://kubernetes.default.svc",
            "--service-account-key-file",
            &pki("sa.pub"),
            "--service-account-signing-key-file",
            &pki("sa.key"),
            "--service-cluster-ip-range",
            "10.96.0.0/24",
            "--endpoint-reconciler-type",
            "none",
            "--profiling=false",
        ]
        .map(str::to_string)
        .to_vec();
        let mut s = SecondApiServer {
            args,
            binary,
            log: dir.join("second-apiserver.log"),
            child: None,
            port,
        };
        s.start();
        s
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let child = Command::new(&self.binary)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start the second kube-apiserver");
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// An admin client of this server.
    async fn client(&self, c: &common::Cluster) -> kube::Client {
        let file = kube::config::Kubeconfig::read_from(c.kubeconfig("ADMIN")).expect("kubeconfig");
        let mut config =
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .expect("config");
        config.cluster_url = format!("https://127.0.0.1:{}", self.port)
            .parse()
            .expect("url");
        zebu_kube_store::client::from_config(config).expect("client")
    }

    /// Wait until it serves the zebu.io kinds in `ns`.
    async fn wait_serving(&self, c: &common::Cluster, ns: &str) {
        let store = KubeStore::new(
            self.client(c).await,
            ns,
            KubeStoreOptions {
                cached: false,
                ..Default::default()
            },
        );
        let t0 = Instant::now();
        while store.list(Kind::Setting, &ListParams::all()).await.is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "the second kube-apiserver does not serve settings after 180 s:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for SecondApiServer {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// etcd's current revision and a compaction up to it, through its HTTP gateway.
fn compact_etcd(etcd: &str) -> i64 {
    let post = |path: &str, body: &str| -> Value {
        let out = Command::new("curl")
            .args(["-fsS", "--max-time", "20", "-X", "POST"])
            .arg(format!("{etcd}{path}"))
            .args(["-d", body])
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "etcd {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("etcd answers JSON")
    };
    // A range read of any key answers with the store's revision in its header ("/" in base64).
    let head = post("/v3/kv/range", r#"{"key":"Lw=="}"#);
    let revision: i64 = head["header"]["revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no revision in {head}"));
    post(
        "/v3/kv/compaction",
        &format!(r#"{{"revision":"{revision}","physical":true}}"#),
    );
    revision
}

#[tokio::test]
async fn the_cache_serves_its_map_through_a_410_relists_and_converges() {
    let c = common::cluster();
    let ns = c.namespace("zt-relist").await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut second = SecondApiServer::new(&c, tmp.path());
    second.wait_serving(&c, &ns).await;

    let writer = c
        .store(
            "ADMIN",
            &ns,
            KubeStoreOptions {
                cached: false,
                ..Default::default()
            },
        )
        .await;
    for n in ["a", "b", "c"] {
        writer.create(setting(n, "1")).await.expect("create");
    }
    let before = map(&[("a", "1"), ("b", "1"), ("c", "1")]);
    let after = map(&[("a", "2"), ("c", "1"), ("d", "1")]);

    let cached = KubeStore::new(second.client(&c).await, &ns, KubeStoreOptions::default());
    let first = cached
        .list(Kind::Setting, &ListParams::all())
        .await
        .expect("first list");
    assert_eq!(seen(&first.items), before);
    let relists_before = cached.cache_counters(Kind::Setting).expect("a cache").1;

    // A reader asking all the time: every answer must be a whole state, old or new.
    let stop = Arc::new(AtomicBool::new(false));
    let new_seen = Arc::new(AtomicUsize::new(0));
    let reader = {
        let cached = cached.clone();
        let stop = stop.clone();
        let new_seen = new_seen.clone();
        let after = after.clone();
        tokio::spawn(async move {
            let mut answers: Vec<(Instant, Result<Seen, String>)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = cached
                    .list(Kind::Setting, &ListParams::all())
                    .await
                    .map(|l| seen(&l.items))
                    .map_err(|e| e.to_string());
                if r.as_ref().is_ok_and(|s| *s == after) {
                    new_seen.fetch_add(1, Ordering::Relaxed);
                }
                answers.push((Instant::now(), r));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            answers
        })
    };

    // Cut the watch: the second server goes, the run's server and etcd stay.
    second.kill9();
    let cut = Instant::now();
    let mut a: zebu_types::resources::Setting = writer.get_as("a").await.expect("get").expect("a");
    a.spec.value = "2".into();
    writer.update_as(&a).await.expect("update a");
    writer.delete(Kind::Setting, "b").await.expect("delete b");
    writer.create(setting("d", "1")).await.expect("create d");
    let compacted = compact_etcd(&c.env["ZEBU_K8S_ETCD"]);
    // Served from the old map while the server is away.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = cached
        .list(Kind::Setting, &ListParams::all())
        .await
        .expect("the cache serves while its server is away");
    assert_eq!(seen(&during.items), before, "the old map, whole");
    let back = Instant::now();
    second.start();

    let t0 = Instant::now();
    loop {
        let now = cached
            .list(Kind::Setting, &ListParams::all())
            .await
            .expect("list");
        if seen(&now.items) == after {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "the cache never converged after the compaction to revision {compacted}: it shows {:?}, the server {after:?} (relists {:?})\n{}",
            seen(&now.items),
            cached.cache_counters(Kind::Setting),
            second.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The reader runs into the new state too before it stops: this loop may have seen the
    // change first (both woken in the same turn), and an order old -> new needs both.
    let converged = Instant::now();
    while new_seen.load(Ordering::Relaxed) < 3 {
        assert!(
            converged.elapsed() < Duration::from_secs(10),
            "the reader never saw the state this loop saw, 10 s after it did"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let answers = reader.await.expect("reader");

    let (_, relists) = cached.cache_counters(Kind::Setting).expect("a cache");
    assert!(
        relists > relists_before,
        "converged without a re-list ({relists_before} -> {relists}): the 410 was not exercised"
    );
    let mut old = 0;
    let mut new = 0;
    for (at, r) in &answers {
        match r {
            Ok(s) if *s == before => {
                assert!(
                    new == 0,
                    "the old state again after the new one, at {:?}",
                    at.duration_since(cut)
                );
                old += 1;
            }
            Ok(s) if *s == after => new += 1,
            Ok(s) => panic!(
                "a read {:?} after the cut showed neither state: {s:?}",
                at.duration_since(cut)
            ),
            Err(e) => panic!(
                "a read {:?} after the cut failed (the cache must serve its old map): {e}",
                at.duration_since(cut)
            ),
        }
    }
    let served_while_away = answers
        .iter()
        .filter(|(at, _)| *at > cut && *at < back)
        .count();
    assert!(
        served_while_away > 10,
        "{served_while_away} reads while the server was away"
    );
    assert!(old > 0 && new > 0, "old {old}, new {new}");
    c.delete_namespace(&ns).await;
}
