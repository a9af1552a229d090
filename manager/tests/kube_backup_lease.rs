//! A backup upload goes with the cluster Lease: two real `zebu manager` processes (nodes on
//! 127.0.0.11-12, the chart's Role) on the real kube-apiserver of `tests/k8s`, a real S3
//! server (moto), real engines, replicas and `zebu-backup-run` processes.
//!
//! node-1 holds the cluster Lease and starts the upload of a backup; its S3 endpoint is a
//! tarpit (it accepts and never answers), so that upload cannot end by itself. Then node-1
//! is cut off from the API server (its requests go through a proxy that stops forwarding,
//! as a partition does: nothing is refused, nothing answers). The test shows:
//!
//! - node-1's upload process ends once node-1 stops leading (within the renew deadline),
//!   killed by node-1's manager, which keeps running;
//! - node-2 takes the cluster Lease over, and its own upload attempt starts only after
//!   node-1's has ended: at no poll (every 100 ms) do both run;
//! - the backup completes through node-2 (a second attempt, counted as such) and verifies
//!   chunk by chunk against the target.
//!
//! Needs `cargo build --workspace --bins` (zebu, zebu-engine, zebu-replica, zebu-backup-run),
//! `qemu-io`, python3 (the moto venv) and the tools of `tests/k8s/tools.sh k8s`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
mod k8s;
#[path = "k8s/managers.rs"]
mod managers;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use common::{pids, qemu_io, wait_for};
use managers::ZebuCluster;
use store_fixtures::Moto;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A TCP proxy to `upstream` that can be cut: from then on it forwards nothing in either
/// direction and answers no new connection, but closes nothing either (a partition, not a
/// refusal), so the client learns it only by time.
struct Partition {
    addr: String,
    cut: Arc<AtomicBool>,
}

impl Partition {
    fn start(upstream: String) -> Partition {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("addr").to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for client in listener.incoming().flatten() {
                if c.load(Ordering::SeqCst) {
                    held.push(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ] {
                    let (Ok(from), Ok(to)) = (from, to) else {
                        continue;
                    };
                    let c = c.clone();
                    std::thread::spawn(move || pump(from, to, &c));
                }
                held.push(client);
                held.push(server);
            }
        });
        Partition { addr, cut }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes; once `cut`, holds both open and copies
/// nothing more.
fn pump(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// An endpoint that accepts connections and never answers.
fn tarpit() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind tarpit");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        let held: Vec<TcpStream> = listener.incoming().flatten().collect();
        drop(held);
    });
    format!("http://{addr}")
}

/// A copy of `kubeconfig` whose server is `https://ADDR` (the proxy's: the API server's
/// certificate names 127.0.0.1, so TLS checks pass through it unchanged).
fn kubeconfig_through(kubeconfig: &Path, addr: &str, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let mut replaced = 0;
    let out: Vec<String> = text
        .lines()
        .map(|l| match l.trim_start().strip_prefix("server: ") {
            Some(_) => {
                replaced += 1;
                let indent = &l[..l.len() - l.trim_start().len()];
                format!("{indent}server: https://{addr}")
            }
            None => l.to_string(),
        })
        .collect();
    assert_eq!(replaced, 1, "one server line in {}", kubeconfig.display());
    let path = dir.join("partitioned.kubeconfig");
    std::fs::write(&path, out.join("\n") + "\n").expect("write kubeconfig");
    path
}

fn upstream_of(kubeconfig: &Path) -> String {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let server = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("server: "))
        .expect("server line");
    server
        .trim()
        .strip_prefix("https://")
        .expect("an https server")
        .trim_end_matches('/')
        .to_string()
}

fn cluster_lease_holder(zc: &ZebuCluster) -> Option<String> {
    let out = zc.k8s.kubectl(
        &zc.k8s.admin(),
        &[
            "-n",
            &zc.ns,
            "get",
            "lease",
            "zebu-cluster",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
    );
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|h| !h.is_empty())
}

fn uploads_on(zc: &ZebuCluster, node: &str) -> Vec<i32> {
    pids(
        "zebu-backup-run",
        &zc.members[node].dir.display().to_string(),
    )
}

#[test]
fn a_lost_cluster_lease_ends_the_old_leaders_upload_and_the_new_leader_completes_the_backup() {
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let mut zc = ZebuCluster::new("bklease");
    zc.env = vec![
        ("AWS_ACCESS_KEY_ID".into(), "testing".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "testing".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_ENDPOINT_URL".into(), moto.endpoint()),
    ];

    // node-1: the API server through a proxy the test can cut, S3 a tarpit.
    let proxy = Partition::start(upstream_of(zc.manager_kubeconfig()));
    let partitioned = kubeconfig_through(zc.manager_kubeconfig(), &proxy.addr, zc.tmp.path());
    let stalled_s3 = vec![("AWS_ENDPOINT_URL".to_string(), tarpit())];
    zc.start_with("node-1", "127.0.0.11", &partitioned, &stalled_s3);
    wait_for("node-1 holds the cluster Lease", 60, || {
        cluster_lease_holder(&zc).as_deref() == Some("node-1")
    });
    zc.start("node-2", "127.0.0.12");
    wait_for("two Ready nodes", 90, || {
        let v = json(&zc.zebu_ok(&["node", "ls", "-o", "json"]));
        let items = v["items"].as_array().cloned().unwrap_or_default();
        items.len() == 2
            && items.iter().all(|n| {
                n["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
    });

    // A volume served on node-2, with data.
    zc.zebu_ok(&[
        "volume",
        "create",
        "src",
        "--size",
        "64Mi",
        "--replicas",
        "2",
        "--frontend",
        "nbd",
    ]);
    let endpoint = zc
        .zebu_ok(&["volume", "attach", "src", "--node", "node-2"])
        .trim()
        .to_string();
    qemu_io(&endpoint, "write -P 0x5a 0 8M");
    qemu_io(&endpoint, "write -P 0xc3 32M 4M");

    zc.zebu_ok(&["backup", "target", "set", "s3://zebu@us-east-1/lease"]);
    zc.zebu_ok(&["backup", "create", "src", "--name", "b1"]);
    wait_for("node-1's upload of b1 running", 90, || {
        !uploads_on(&zc, "node-1").is_empty()
    });
    let old = uploads_on(&zc, "node-1");
    let b1 = json(&zc.zebu_ok(&["backup", "get", "b1", "-o", "json"]));
    assert_eq!(b1["status"]["attempts"], 1, "{b1}");
    assert!(uploads_on(&zc, "node-2").is_empty(), "node-2 uploads too");

    // The partition: node-1's manager keeps running but reaches the API server no more.
    proxy.cut();
    let cut_at = Instant::now();
    let mut old_ended: Option<Duration> = None;
    let mut new_started: Option<Duration> = None;
    let deadline = cut_at + Duration::from_secs(120);
    while new_started.is_none() {
        assert!(
            Instant::now() < deadline,
            "after {:?}: node-1's upload {} and node-2's {}\n{}",
            cut_at.elapsed(),
            if old_ended.is_some() {
                "ended"
            } else {
                "still runs"
            },
            "never started",
            zc.logs()
        );
        let on1 = uploads_on(&zc, "node-1");
        let on2 = uploads_on(&zc, "node-2");
        assert!(
            on1.is_empty() || on2.is_empty(),
            "two uploads at once: node-1 {on1:?}, node-2 {on2:?}\n{}",
            zc.logs()
        );
        if on1.is_empty() && old_ended.is_none() {
            old_ended = Some(cut_at.elapsed());
        }
        if !on2.is_empty() {
            new_started = Some(cut_at.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let old_ended = old_ended.expect("node-1's upload ended before node-2's started");
    eprintln!(
        "node-1's upload {old:?} ended {old_ended:?} after the cut; node-2's started after {:?}",
        new_started.expect("started")
    );
    // Ended by its manager when it stopped leading, not by itself or by chance.
    assert!(
        old_ended <= Duration::from_secs(15),
        "node-1's upload ended only {old_ended:?} after the cut"
    );
    let log = std::fs::read_to_string(zc.tmp.path().join("node-1.log")).expect("node-1 log");
    assert!(
        log.contains("killed this manager's job processes"),
        "node-1 did not say it killed its upload:\n{}",
        zc.log_tail("node-1")
    );
    assert_eq!(
        cluster_lease_holder(&zc).as_deref(),
        Some("node-2"),
        "node-2 leads"
    );

    wait_for("b1 completed through node-2", 180, || {
        let b = json(&zc.zebu_ok(&["backup", "get", "b1", "-o", "json"]));
        assert_ne!(b["status"]["state"], "error", "{b}");
        b["status"]["state"] == "completed"
    });
    let b1 = json(&zc.zebu_ok(&["backup", "get", "b1", "-o", "json"]));
    assert_eq!(b1["status"]["attempts"], 2, "{b1}");
    assert!(uploads_on(&zc, "node-1").is_empty(), "node-1 uploads again");
    let verified = json(&zc.zebu_ok(&["backup", "verify", "b1", "-o", "json"]));
    assert_eq!(verified["ok"], true, "{verified}");
    assert!(
        verified["chunks"].as_u64().is_some_and(|c| c > 0),
        "{verified}"
    );
    // node-1's manager is still running: it lost the lead, not its life.
    assert!(zc.alive("node-1"), "node-1's manager exited");
}
