//! Volume identity and secrets issued by the manager (issue 18): `zebu up` gives each volume a
//! uuid and a secret at create, its node agents start the volume's engine and replicas with
//! `--volume-uuid` and `--secret-file` (a 0600 file under `<data-dir>/secrets/`, never the
//! secret on a command line), and the secret goes with the volume.
//!
//! Two volumes started by the manager side by side: the second volume's engine, an engine
//! without a secret, and a gRPC client with no token or the other volume's cannot open,
//! fence or rebuild from the first volume's replicas; the first keeps serving its data,
//! unfenced, throughout.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`) and `qemu-io`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tonic::service::Interceptor;
use zebu_proto::auth::{self, Secret};
use zebu_proto::replica as rpb;
use zebu_proto::replica::replica_client::ReplicaClient;

mod common;
use common::{FULL_DISK_OK, ok, qemu_io, start_up, volume, wait_for, wait_nodes, zebu};

fn bin(name: &str) -> PathBuf {
    if let Some(d) = std::env::var_os("ZEBU_BIN_DIR") {
        return PathBuf::from(d).join(name);
    }
    Path::new(common::ZEBU)
        .parent()
        .expect("the zebu binary's directory")
        .join(name)
}

/// `key value` lines of a process's stdout file.
fn announced(path: &Path, key: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(' '))
            .map(str::to_string)
    })
}

fn annotation(v: &Value, key: &str) -> String {
    v["metadata"]["annotations"][key]
        .as_str()
        .unwrap_or_else(|| panic!("volume has no annotation {key}: {v}"))
        .to_string()
}

/// The `listening on` addresses of a volume's replicas, from their stdout files.
fn replica_addrs(dir: &Path, v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for r in v["status"]["replicas"].as_array().expect("replicas") {
        let name = r["name"].as_str().expect("name");
        let node = r["node"].as_str().expect("node");
        let f = dir
            .join(node)
            .join("logs")
            .join(format!("replica-{name}.out"));
        let a = announced(&f, "listening on")
            .unwrap_or_else(|| panic!("no address in {}", f.display()));
        out.push(a);
    }
    out.sort();
    out
}

/// The stdout file of `volume`'s engine on whichever node runs it.
fn engine_out(dir: &Path, volume: &str) -> PathBuf {
    for n in 1..=3 {
        let f = dir.join(format!("node-{n}/logs/engine-{volume}-e.out"));
        if f.is_file() {
            return f;
        }
    }
    panic!("no engine stdout of {volume} under {}", dir.display());
}

fn cmdlines(binary: &str) -> Vec<(i32, Vec<String>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        if argv
            .first()
            .is_some_and(|a| Path::new(a).file_name().and_then(|f| f.to_str()) == Some(binary))
        {
            out.push((pid, argv));
        }
    }
    out
}

fn flag<'a>(argv: &'a [String], name: &str) -> Option<&'a str> {
    argv.windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].as_str())
}

#[derive(Clone)]
struct Sign(Option<Secret>);

impl Interceptor for Sign {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(s) = &self.0 {
            let t = s.grpc_token(auth::now_secs());
            req.metadata_mut()
                .insert(auth::GRPC_AUTH_HEADER, t.parse().expect("ascii"));
        }
        Ok(req)
    }
}

/// One gRPC call to a replica, signed with `secret` or not: Info, or (with `epoch`) SetEpoch.
fn replica_call(
    addr: &str,
    secret: Option<Secret>,
    epoch: Option<u64>,
) -> Result<rpb::InfoResponse, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut c = ReplicaClient::with_interceptor(ch, Sign(secret));
        if let Some(e) = epoch {
            c.set_epoch(rpb::SetEpochRequest {
                epoch: e,
                members: vec!["intruder".into()],
            })
            .await?;
        }
        Ok(c.info(rpb::InfoRequest {}).await?.into_inner())
    })
}

/// Starts an engine of `volume` over `replicas` (no frontend) and waits up to `secs` for it
/// to exit; an engine still running then is killed. Returns (exited by itself, ever ready,
/// stderr).
fn try_engine(
    tmp: &Path,
    volume: &str,
    replicas: &[String],
    identity: Option<(&str, &Path)>,
    secs: u64,
) -> (bool, bool, String) {
    let out = tmp.join(format!("intruder-{volume}.out"));
    let err = tmp.join(format!("intruder-{volume}.err"));
    let mut cmd = Command::new(bin("zebu-engine"));
    cmd.args(["serve", "--volume", volume, "--size", "64M"])
        .args(["--control", "127.0.0.1:0", "--io-timeout", "2s"]);
    for r in replicas {
        cmd.args(["--replica", r]);
    }
    if let Some((uuid, secret)) = identity {
        cmd.args(["--volume-uuid", uuid])
            .arg("--secret-file")
            .arg(secret);
    }
    let mut child = cmd
        .stdout(std::fs::File::create(&out).expect("out"))
        .stderr(std::fs::File::create(&err).expect("err"))
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn zebu-engine");
    let start = Instant::now();
    let mut exited = false;
    while start.elapsed() < Duration::from_secs(secs) {
        if child.try_wait().expect("wait").is_some() {
            exited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if !exited {
        let _ = child.kill();
    }
    let _ = child.wait();
    let ready = std::fs::read_to_string(&out)
        .unwrap_or_default()
        .lines()
        .any(|l| l == "ready");
    (
        exited,
        ready,
        std::fs::read_to_string(&err).unwrap_or_default(),
    )
}

#[test]
fn another_volume_or_a_client_without_the_secret_cannot_use_a_volumes_replicas() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let up = start_up(dir, 2, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 2);
    for v in ["va", "vb"] {
        ok(
            &api,
            &[
                "volume",
                "create",
                v,
                "--size",
                "64M",
                "--replicas",
                "2",
                "--frontend",
                "nbd",
            ],
        );
    }
    let ep_a = ok(&api, &["volume", "attach", "va"]).trim().to_string();
    let _ep_b = ok(&api, &["volume", "attach", "vb"]).trim().to_string();
    for v in ["va", "vb"] {
        wait_for(&format!("{v} healthy"), 60, || {
            volume(&api, v).is_some_and(|v| v["status"]["robustness"] == "healthy")
        });
    }
    qemu_io(&ep_a, "write -P 0xa1 0 4M");
    qemu_io(&ep_a, "flush");

    // What the manager issued: a uuid and a secret per volume, recorded on the Volume.
    let va = volume(&api, "va").expect("va");
    let vb = volume(&api, "vb").expect("vb");
    let uuid_a = annotation(&va, "zebu.io/volume-uuid");
    let uuid_b = annotation(&vb, "zebu.io/volume-uuid");
    assert_ne!(uuid_a, uuid_b);
    let secret_a = dir
        .join("secrets")
        .join(annotation(&va, "zebu.io/secret-name"));
    let secret_b = dir
        .join("secrets")
        .join(annotation(&vb, "zebu.io/secret-name"));
    for s in [&secret_a, &secret_b] {
        let mode = std::fs::metadata(s)
            .expect("secret file")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{}", s.display());
    }
    let bytes_a = std::fs::read(&secret_a).expect("read");
    assert_ne!(bytes_a, std::fs::read(&secret_b).expect("read"));
    let key_a = Secret::load(&secret_a).expect("secret a");
    let key_b = Secret::load(&secret_b).expect("secret b");

    // Started with them: every replica and engine names its file, none the secret.
    let secret_text = String::from_utf8_lossy(&bytes_a).trim().to_string();
    let needle = dir.display().to_string();
    let mut replicas_seen = 0;
    for (pid, argv) in cmdlines("zebu-replica") {
        if !argv.iter().any(|a| a.contains(&needle)) {
            continue;
        }
        replicas_seen += 1;
        let f = flag(&argv, "--secret-file").unwrap_or_else(|| panic!("replica {pid}: {argv:?}"));
        assert!(
            f == secret_a.to_str().unwrap() || f == secret_b.to_str().unwrap(),
            "{f}"
        );
        assert!(!argv.iter().any(|a| a.contains(&secret_text)), "{argv:?}");
    }
    assert_eq!(replicas_seen, 4);
    let engine_a = engine_out(dir, "va");
    let pid_a = cmdlines("zebu-engine")
        .into_iter()
        .find(|(_, argv)| {
            flag(argv, "--volume") == Some("va") && argv.iter().any(|a| a.contains(&needle))
        })
        .map(|(pid, argv)| {
            assert_eq!(
                flag(&argv, "--volume-uuid"),
                Some(uuid_a.as_str()),
                "{argv:?}"
            );
            assert_eq!(flag(&argv, "--secret-file"), secret_a.to_str(), "{argv:?}");
            assert!(!argv.iter().any(|a| a.contains(&secret_text)), "{argv:?}");
            pid
        })
        .expect("va's engine");

    let addrs_a = replica_addrs(dir, &va);
    let addrs_b = replica_addrs(dir, &vb);
    assert_eq!(addrs_a.len(), 2);

    // gRPC: no token, or the other volume's secret: refused, and SetEpoch changes nothing.
    let before =
        replica_call(&addrs_a[0], Some(key_a.clone()), None).expect("Info with a's secret");
    assert_eq!(
        before.volume_uuid, uuid_a,
        "the replica records its volume's uuid"
    );
    for (who, key) in [("no token", None), ("vb's secret", Some(key_b.clone()))] {
        let e = replica_call(&addrs_a[0], key, Some(before.epoch + 1000)).expect_err(who);
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{who}: {e:?}");
    }
    let after = replica_call(&addrs_a[0], Some(key_a.clone()), None).expect("Info");
    assert_eq!(
        (after.epoch, after.generation),
        (before.epoch, before.generation)
    );

    // vb's engine, with vb's uuid and secret, over va's replicas: never opens them.
    let (exited, ready, err) = try_engine(dir, "vb", &addrs_a, Some((&uuid_b, &secret_b)), 20);
    assert!(!ready, "vb's identity opened va's replicas: {err}");
    println!("vb's engine over va's replicas: exited {exited}: {err}");
    // An engine of va without the secret: refused too.
    let (exited, ready, err) = try_engine(dir, "va", &addrs_a, None, 20);
    assert!(
        !ready,
        "an engine without the secret opened va's replicas: {err}"
    );
    println!("an engine without the secret: exited {exited}: {err}");

    // Rebuild: vb's engine told to add one of va's replicas refuses, and vb stays healthy.
    let control_b = announced(&engine_out(dir, "vb"), "control").expect("vb control");
    let add = Command::new(bin("zebu-engine"))
        .args([
            "--control",
            &control_b,
            "replica",
            "add",
            &addrs_a[0],
            "--wait",
        ])
        .output()
        .expect("replica add");
    assert!(
        !add.status.success(),
        "vb adopted va's replica: {}",
        String::from_utf8_lossy(&add.stdout)
    );

    // va was neither fenced nor touched: same engine, healthy, its data and new writes fine.
    let after = replica_call(&addrs_a[0], Some(key_a.clone()), None).expect("Info");
    assert_eq!(
        after.generation, before.generation,
        "va's replica was fenced"
    );
    assert!(
        cmdlines("zebu-engine").iter().any(|(p, _)| *p == pid_a),
        "va's engine is gone"
    );
    let va = volume(&api, "va").expect("va");
    assert_eq!(va["status"]["robustness"], "healthy", "{va}");
    qemu_io(&ep_a, "read -P 0xa1 0 4M");
    qemu_io(&ep_a, "write -P 0xa2 4M 1M");
    qemu_io(&ep_a, "read -P 0xa2 4M 1M");
    let vb = volume(&api, "vb").expect("vb");
    assert_eq!(vb["status"]["robustness"], "healthy", "{vb}");
    assert_eq!(replica_addrs(dir, &vb), addrs_b, "vb's replicas changed");
    assert!(engine_a.is_file());

    // Delete: the secret goes with the volume.
    ok(&api, &["volume", "detach", "va"]);
    ok(&api, &["volume", "delete", "va"]);
    wait_for("va gone", 60, || {
        !zebu(&api, &["volume", "get", "va"]).status.success()
    });
    assert!(!secret_a.exists(), "va's secret outlived it");
    assert!(secret_b.exists());
    drop(up);
}
