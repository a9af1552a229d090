//! TLS on the replica ports, turned on for a whole cluster (issue 18, item 2):
//! `zebu up --replica-tls` makes a CA, signs each node's certificate for its address, starts
//! every replica with `--tls-cert/--tls-key` and every engine with `--tls-ca`, and its own
//! replica clients (the backup and restore jobs, the copy into a volume made from a
//! snapshot) connect over TLS too.
//!
//! One cluster of three nodes: a volume written and read through its engine; its replicas
//! refuse a plaintext frames client and a plaintext gRPC client and change nothing for
//! them, while a client that trusts the cluster's CA reaches them; a backup of the volume
//! restores into a new volume, and a volume made from a snapshot of it gets its data, both
//! over TLS.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`), `qemu-io` and `curl`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zebu_proto::auth::{self, Secret};
use zebu_proto::frames::{self, Decoded, Hello};
use zebu_proto::replica as rpb;
use zebu_proto::replica::replica_client::ReplicaClient;

mod common;
use common::{FULL_DISK_OK, ok, qemu_io, start_up_with, volume, wait_for, wait_nodes};

/// `key value` lines of a process's stdout file.
fn announced(path: &Path, key: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(' '))
            .map(str::to_string)
    })
}

/// The `listening on` addresses of a volume's replicas, from their stdout files.
fn replica_addrs(dir: &Path, v: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for r in v["status"]["replicas"].as_array().expect("replicas") {
        let name = r["name"].as_str().expect("name");
        let node = r["node"].as_str().expect("node");
        let f = dir
            .join(node)
            .join("logs")
            .join(format!("replica-{name}.out"));
        out.push(
            announced(&f, "listening on")
                .unwrap_or_else(|| panic!("no address in {}", f.display())),
        );
    }
    out.sort();
    out
}

/// The command lines of the running `binary` processes that name `needle`.
fn cmdlines(binary: &str, needle: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if e.file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
            .is_none()
        {
            continue;
        }
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        let named = argv
            .first()
            .is_some_and(|a| Path::new(a).file_name().and_then(|f| f.to_str()) == Some(binary));
        if named && argv.iter().any(|a| a.contains(needle)) {
            out.push(argv);
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
struct Sign(Secret);

impl tonic::service::Interceptor for Sign {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let t = self.0.grpc_token(auth::now_secs());
        req.metadata_mut()
            .insert(auth::GRPC_AUTH_HEADER, t.parse().expect("ascii"));
        Ok(req)
    }
}

/// What a plaintext frames client gets from a replica port: the bytes it sent back before
/// the connection ended (within 10 s).
async fn plaintext_frames(addr: &str) -> BytesMut {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(&Hello::new(frames::VERSION, 1 << 30).encode())
        .await
        .expect("send a hello");
    let mut buf = BytesMut::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read_buf(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return buf,
            Ok(Ok(_)) => {}
            Err(_) => panic!("{addr}: a TLS port kept a plaintext client waiting 10 s"),
        }
    }
}

/// Info of the replica at `addr` over TLS trusting `ca`, with the volume's `secret`.
async fn info_over_tls(addr: &str, ca: &Path, secret: &Secret) -> rpb::InfoResponse {
    let tls = zebu_proto::tls::connector(ca).expect("connector");
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("uri");
    let ch = zebu_proto::tls::grpc_channel(endpoint, addr, Some(&tls), Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{addr}: no TLS channel with the cluster's CA: {e:?}"));
    ReplicaClient::with_interceptor(ch, Sign(secret.clone()))
        .info(rpb::InfoRequest {})
        .await
        .unwrap_or_else(|s| panic!("{addr}: Info over TLS: {s:?}"))
        .into_inner()
}

fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--fail-with-body", "--max-time", "60"])
        .args(args)
        .output()
        .expect("curl");
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "curl {args:?}: {body} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    body
}

fn healthy(api: &str, name: &str) {
    wait_for(&format!("{name} healthy"), 120, || {
        volume(api, name).is_some_and(|v| v["status"]["robustness"] == "healthy")
    });
}

#[test]
fn zebu_up_with_replica_tls_serves_backs_up_and_copies_over_tls_and_refuses_plaintext() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let up = start_up_with(dir, 3, FULL_DISK_OK, &["--replica-tls"]);
    let api = up.api.clone();
    wait_nodes(&api, 3);

    // The CA, made once, its key owner-only; a certificate per node.
    let ca = dir.join("tls/ca/ca.crt");
    let ca_key = dir.join("tls/ca/ca.key");
    assert!(ca.is_file(), "no CA at {}", ca.display());
    let mode = |p: &PathBuf| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&ca_key), 0o600);
    for n in 1..=3 {
        let key = dir.join(format!("node-{n}/tls/replica.key"));
        assert_eq!(mode(&key), 0o600, "{}", key.display());
    }

    ok(
        &api,
        &[
            "volume",
            "create",
            "v",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--frontend",
            "nbd",
        ],
    );
    let ep = ok(&api, &["volume", "attach", "v"]).trim().to_string();
    healthy(&api, "v");
    qemu_io(&ep, "write -P 0x5c 0 4M");
    qemu_io(&ep, "flush");
    qemu_io(&ep, "read -P 0x5c 0 4M");

    // Started with TLS: each replica serves its node's certificate, the engine trusts the CA.
    let needle = dir.display().to_string();
    let replicas = cmdlines("zebu-replica", &needle);
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    for argv in &replicas {
        let cert = flag(argv, "--tls-cert").unwrap_or_else(|| panic!("no --tls-cert: {argv:?}"));
        assert!(cert.ends_with("/tls/replica.crt"), "{argv:?}");
        assert!(flag(argv, "--tls-key").is_some(), "{argv:?}");
    }
    let engines = cmdlines("zebu-engine", &needle);
    assert_eq!(engines.len(), 1, "{engines:?}");
    let engine_ca =
        flag(&engines[0], "--tls-ca").unwrap_or_else(|| panic!("no --tls-ca: {:?}", engines[0]));
    assert_eq!(
        std::fs::read(engine_ca).expect("the engine's CA file"),
        std::fs::read(&ca).expect("the cluster's CA"),
        "the engine trusts the cluster's CA ({engine_ca})"
    );

    // Plaintext clients get nothing from the replicas and change nothing on them; a client
    // that trusts the cluster's CA (and holds the volume's secret) is served.
    let v = volume(&api, "v").expect("v");
    let addrs = replica_addrs(dir, &v);
    let secret_name = v["metadata"]["annotations"]["zebu.io/secret-name"]
        .as_str()
        .expect("secret name")
        .to_string();
    let secret = Secret::load(&dir.join("secrets").join(&secret_name)).expect("secret");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for addr in &addrs {
            let before = info_over_tls(addr, &ca, &secret).await;
            let got = plaintext_frames(addr).await;
            let mut b = got.clone();
            assert!(
                !matches!(frames::decode_response(&mut b), Ok(Decoded::Frame(_))),
                "{addr}: a plaintext frames client got an answer: {got:?}"
            );
            let plain = async {
                let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                    .connect()
                    .await?;
                ReplicaClient::with_interceptor(ch, Sign(secret.clone()))
                    .set_epoch(rpb::SetEpochRequest {
                        epoch: before.epoch + 1000,
                        members: vec!["intruder".into()],
                    })
                    .await?;
                Ok::<_, Box<dyn std::error::Error>>(())
            };
            match tokio::time::timeout(Duration::from_secs(15), plain).await {
                Ok(Err(_)) | Err(_) => {}
                Ok(Ok(())) => panic!("{addr}: a plaintext gRPC call was served"),
            }
            let after = info_over_tls(addr, &ca, &secret).await;
            assert_eq!(
                (after.epoch, &after.epoch_members, after.generation),
                (before.epoch, &before.epoch_members, before.generation),
                "{addr}: a plaintext client changed the replica"
            );
        }
    });
    healthy(&api, "v");
    qemu_io(&ep, "read -P 0x5c 0 4M");

    // A backup (the job reads the replicas over TLS) restored into a new volume (the restore
    // job writes its replicas over TLS).
    let target = dir.join("target");
    std::fs::create_dir_all(&target).expect("target dir");
    ok(
        &api,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", target.display()),
        ],
    );
    ok(&api, &["backup", "create", "v", "--name", "b1", "--wait"]);
    ok(
        &api,
        &[
            "volume",
            "create",
            "r",
            "--from-backup",
            "b1",
            "--replicas",
            "2",
            "--frontend",
            "nbd",
        ],
    );
    wait_for("restore completed", 300, || {
        let v = volume(&api, "r").expect("r");
        let state = v["status"]["restore"]["state"].clone();
        assert_ne!(state, "error", "the restore failed: {v}");
        state == "completed"
    });
    let ep_r = ok(&api, &["volume", "attach", "r"]).trim().to_string();
    healthy(&api, "r");
    qemu_io(&ep_r, "read -P 0x5c 0 4M");
    qemu_io(&ep_r, "read -P 0 4M 60M");

    // A volume made from a snapshot: the manager copies the layers itself, over TLS.
    ok(&api, &["snapshot", "create", "v", "s1"]);
    qemu_io(&ep, "write -P 0x77 0 1M");
    let body = r#"{"name":"c","size":67108864,"numberOfReplicas":2,"frontend":"nbd","dataSource":{"volume":"v","snapshot":"s1"}}"#;
    curl(&[
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "--data",
        body,
        &format!("{api}/v1/volumes"),
    ]);
    wait_for("c populated", 120, || {
        let state = curl(&["-X", "POST", &format!("{api}/v1/volumes/c/populate")]);
        assert!(!state.contains("failed"), "populating c: {state}");
        state.contains("done")
    });
    let ep_c = ok(&api, &["volume", "attach", "c"]).trim().to_string();
    healthy(&api, "c");
    qemu_io(&ep_c, "read -P 0x5c 0 4M");
    qemu_io(&ep, "read -P 0x77 0 1M");
    drop(up);
}
