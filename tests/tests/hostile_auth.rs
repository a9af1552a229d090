//! Authenticated replica ports (issue 18, item 2): replicas and engine started with the
//! volume's secret file. A client without the secret, or with another, is refused on the
//! frames port, the local socket and every gRPC call (SetEpoch, WriteLayer, Info, Data), and
//! changes nothing: the generation, epoch, flush number and data stay as the engine left
//! them, and the volume keeps serving.
//!
//! The last test is the final hostile check: every kind of hostile input at once, then every
//! server still serves a normal client and no replica's files changed.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::service::Interceptor;
use zebu_engine::blockdev::BlockDevice;
use zebu_proto::auth::{self, Secret};
use zebu_proto::frames::{self, Decoded, Extension, Hello, Request, RequestOp, Response};
use zebu_proto::ids::RequestId;
use zebu_proto::replica as rpb;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_tests::engine::Cluster;

const MIB: u64 = 1 << 20;
const SECRET: &[u8] = b"the volume secret of vol-auth, 32b";

fn write_secret(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> anyhow::Result<String> {
    let p = dir.join(name);
    std::fs::write(&p, bytes)?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))?;
    Ok(p.to_string_lossy().into_owned())
}

/// A gRPC client that signs every call with `secret` (or sends no token).
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

async fn client(
    addr: SocketAddr,
    secret: Option<Secret>,
) -> anyhow::Result<
    ReplicaClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Sign>>,
> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    Ok(ReplicaClient::with_interceptor(ch, Sign(secret)))
}

/// Reads one response off `s`.
async fn recv(s: &mut tokio::net::TcpStream, buf: &mut BytesMut) -> Option<Response> {
    loop {
        if let Ok(Decoded::Frame(r)) = frames::decode_response(buf) {
            return Some(r);
        }
        let n = tokio::time::timeout(Duration::from_secs(10), s.read_buf(buf))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
    }
}

/// A frames client that says hello at `generation` naming `uuid`, answers the challenge
/// with `secret` if it has one (and is asked), then sends a FLUSH of its own. Returns the
/// answers it got, in order: the last is a refusal, or the flush's answer.
async fn frames_try(
    addr: SocketAddr,
    generation: u64,
    uuid: &str,
    secret: Option<&Secret>,
) -> anyhow::Result<Vec<Response>> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut hello = Hello::new(frames::VERSION, generation);
    hello.extensions.0.push(
        frames::VolumeClaim {
            uuid: uuid.into(),
            adopt: false,
        }
        .to_extension(),
    );
    let nc = auth::nonce();
    if secret.is_some() {
        hello.extensions.0.push(Extension {
            kind: auth::EXT_AUTH,
            value: Bytes::copy_from_slice(&nc),
        });
    }
    s.write_all(&hello.encode()).await?;
    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    let Some(first) = recv(&mut s, &mut buf).await else {
        return Ok(got);
    };
    got.push(first.clone());
    if first.status != rpb::Status::Ok {
        return Ok(got);
    }
    if let Some(secret) = secret {
        let ext = frames::Extensions::decode(first.data.clone())?;
        let ch = ext.get(auth::EXT_AUTH).cloned().unwrap_or_default();
        // A wrong secret cannot check the server's proof; answer with its own proof anyway.
        let ns = ch.get(..auth::NONCE_LEN).unwrap_or(&[]).to_vec();
        let proof = secret.client_proof(&nc, &ns, uuid, frames::VERSION, generation);
        let mut second = Hello::new(frames::VERSION, generation);
        second.extensions.0.push(Extension {
            kind: auth::EXT_AUTH,
            value: Bytes::copy_from_slice(&proof),
        });
        s.write_all(&second.encode()).await?;
        let Some(welcome) = recv(&mut s, &mut buf).await else {
            return Ok(got);
        };
        got.push(welcome.clone());
        if welcome.status != rpb::Status::Ok {
            return Ok(got);
        }
    }
    let flush = Request {
        id: RequestId(1),
        op: RequestOp::Flush { flush_number: 0 },
    };
    let _ = s.write_all(&flush.header().encode()).await;
    if let Some(r) = recv(&mut s, &mut buf).await {
        got.push(r);
    }
    Ok(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_without_the_volume_secret_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let keys = tempfile::tempdir()?;
    let good = write_secret(keys.path(), "vol.secret", SECRET, 0o600)?;
    let args = ["--secret-file", good.as_str()];
    let mut c = Cluster::replicas_only_with("vol-auth", 64 * MIB, &args)?;
    c.cfg.extra_args = args.iter().map(|a| a.to_string()).collect();
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    dev.write(0, Bytes::from(vec![0x42u8; MIB as usize]))
        .await?;
    dev.flush().await?;

    let secret = Secret::from_bytes(SECRET)?;
    let wrong = Secret::from_bytes(b"another volume's secret, 32 bytes")?;
    let addr = c.replica(0).addr;
    let mut authed = client(addr, Some(secret.clone())).await?;
    let before = authed.info(rpb::InfoRequest {}).await?.into_inner();
    assert!(!before.volume_uuid.is_empty());

    for (who, s) in [("no token", None), ("a wrong secret", Some(wrong.clone()))] {
        let mut c2 = client(addr, s).await?;
        let e = c2.info(rpb::InfoRequest {}).await.err();
        assert_eq!(
            e.map(|e| e.code()),
            Some(tonic::Code::Unauthenticated),
            "Info with {who}"
        );
        let e = c2
            .set_epoch(rpb::SetEpochRequest {
                epoch: before.epoch + 1,
                members: vec![before.replica_id.clone()],
            })
            .await
            .err();
        assert_eq!(
            e.map(|e| e.code()),
            Some(tonic::Code::Unauthenticated),
            "SetEpoch with {who}"
        );
        let msgs = vec![rpb::WriteLayerRequest {
            layer: "intruder".into(),
            size: 64 * MIB,
            ..Default::default()
        }];
        let e = c2.write_layer(tokio_stream::iter(msgs)).await.err();
        assert_eq!(
            e.map(|e| e.code()),
            Some(tonic::Code::Unauthenticated),
            "WriteLayer with {who}"
        );
    }
    // A replayed token is refused too.
    let token = secret.grpc_token(auth::now_secs());
    for round in 0..2 {
        let mut req = tonic::Request::new(rpb::InfoRequest {});
        req.metadata_mut()
            .insert(auth::GRPC_AUTH_HEADER, token.parse().expect("ascii"));
        let mut raw = ReplicaClient::connect(format!("http://{addr}")).await?;
        let r = raw.info(req).await;
        assert_eq!(r.is_ok(), round == 0, "token use {round}: {r:?}");
    }

    // Frames: no proof, a wrong proof; each tries a FLUSH after its hello.
    let g = before.generation + 1;
    let none = frames_try(addr, g, &before.volume_uuid, None).await?;
    assert!(
        none.last().is_some_and(|r| r.status != rpb::Status::Ok),
        "a hello without proof: {none:?}"
    );
    assert!(
        none.iter().all(|r| r.id == RequestId(0)),
        "a request was answered: {none:?}"
    );
    let bad = frames_try(addr, g, &before.volume_uuid, Some(&wrong)).await?;
    assert!(
        bad.last().is_some_and(|r| r.status != rpb::Status::Ok),
        "a hello with a wrong proof: {bad:?}"
    );
    assert!(
        bad.iter().all(|r| r.id == RequestId(0)),
        "a request was answered: {bad:?}"
    );

    let after = authed.info(rpb::InfoRequest {}).await?.into_inner();
    assert_eq!(
        (
            after.generation,
            after.epoch,
            &after.epoch_members,
            after.flush_number
        ),
        (
            before.generation,
            before.epoch,
            &before.epoch_members,
            before.flush_number
        ),
        "an unauthenticated client changed the replica"
    );
    assert!(
        !after.layers.iter().any(|l| l.name == "intruder"),
        "{:?}",
        after.layers
    );
    let i = c.engine().info().await?;
    assert_eq!(i.state, "healthy", "{i:?}\n{}", c.logs());
    let got = dev.read(0, MIB).await?;
    assert!(got.iter().all(|&b| b == 0x42));
    dev.write(MIB, Bytes::from(vec![0x43u8; 4096])).await?;
    dev.flush().await?;
    dev.disconnect().await;

    // The right secret over frames is accepted (at the engine's generation: no fencing).
    let ok = frames_try(addr, before.generation, &before.volume_uuid, Some(&secret)).await?;
    assert!(
        ok.last()
            .is_some_and(|r| r.id == RequestId(1) && r.status == rpb::Status::Ok),
        "an authenticated client's flush: {ok:?}"
    );

    // A secret file others may read is refused at start.
    let open = write_secret(keys.path(), "open.secret", SECRET, 0o644)?;
    let out = std::process::Command::new(zebu_tests::bin_path("zebu-replica"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--size",
            "1M",
            "--secret-file",
            &open,
        ])
        .arg("--dir")
        .arg(keys.path().join("r"))
        .output()?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("chmod 600"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The engine's gRPC data path carries the token too: a volume over `--data-transport grpc`
/// with the secret serves, and a gRPC data stream without a token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_grpc_data_path_authenticates_too() -> anyhow::Result<()> {
    let keys = tempfile::tempdir()?;
    let good = write_secret(keys.path(), "vol.secret", SECRET, 0o600)?;
    let args = ["--secret-file", good.as_str()];
    let mut c = Cluster::replicas_only_with("vol-auth-grpc", 64 * MIB, &args)?;
    c.cfg.extra_args = ["--secret-file", good.as_str(), "--data-transport", "grpc"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    dev.write(0, Bytes::from(vec![0x24u8; MIB as usize]))
        .await?;
    dev.flush().await?;
    assert!(dev.read(0, MIB).await?.iter().all(|&b| b == 0x24));
    dev.disconnect().await;
    let i = c.engine().info().await?;
    assert_eq!(i.state, "healthy", "{i:?}\n{}", c.logs());
    assert!(i.replicas.iter().all(|r| r.data_path == "grpc"), "{i:?}");
    let mut raw = zebu_tests::connect(c.replica(0).addr).await?;
    let s = zebu_tests::DataStream::open_for(&mut raw, 1, "").await;
    assert_eq!(
        s.err().map(|s| s.code()),
        Some(tonic::Code::Unauthenticated),
        "a gRPC data stream without a token"
    );
    Ok(())
}

/// Every file under `dir` with its bytes' CRC32C and length, sorted by path.
fn tree_digest(dir: &Path) -> anyhow::Result<Vec<(String, u64, u32)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let p = e.path();
            if e.file_type()?.is_dir() {
                todo.push(p);
            } else if e.file_type()?.is_file() {
                let b = std::fs::read(&p)?;
                let rel = p.strip_prefix(dir)?.display().to_string();
                out.push((rel, b.len() as u64, crc32c::crc32c(&b)));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The final hostile check (issue 18): one volume with authenticated replica ports takes
/// every kind of hostile input the other hostile tests send one at a time (unauthenticated
/// and wrongly signed gRPC calls that fence, write or read out of range; frames hellos
/// without or with a wrong proof, at the top of the generation range; garbage and truncated
/// frames; garbage on the engine's NBD port). Afterwards every server still serves a normal
/// client (each replica an authenticated client over gRPC and frames, the engine an NBD
/// client, reading what was written and writing more), and no replica's files changed
/// while only unauthenticated clients spoke to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_every_hostile_input_each_server_serves_and_no_replica_changed() -> anyhow::Result<()>
{
    let keys = tempfile::tempdir()?;
    let good = write_secret(keys.path(), "vol.secret", SECRET, 0o600)?;
    let args = ["--secret-file", good.as_str()];
    let mut c = Cluster::replicas_only_with("vol-final", 64 * MIB, &args)?;
    c.cfg.extra_args = args.iter().map(|a| a.to_string()).collect();
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    dev.write(0, Bytes::from(vec![0x5eu8; 2 * MIB as usize]))
        .await?;
    dev.flush().await?;
    dev.disconnect().await;
    let nbd = c.engine().nbd.clone();
    // The engine stopped cleanly: from here on only hostile clients talk to the replicas.
    c.engine_mut().terminate(Duration::from_secs(30))?;
    // Let the replicas finish with the engine's connections before their files are read.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let secret = Secret::from_bytes(SECRET)?;
    let wrong = Secret::from_bytes(b"another volume's secret, 32 bytes")?;
    let addrs: Vec<SocketAddr> = (0..3).map(|i| c.replica(i).addr).collect();
    let mut before = Vec::new();
    for (i, a) in addrs.iter().enumerate() {
        let info = client(*a, Some(secret.clone()))
            .await?
            .info(rpb::InfoRequest {})
            .await?
            .into_inner();
        before.push((info, tree_digest(&c.dirs[i])?));
    }

    for (a, (info, _)) in addrs.iter().zip(&before) {
        for s in [None, Some(wrong.clone())] {
            let mut h = client(*a, s).await?;
            for epoch in [u64::MAX, info.epoch + 1] {
                let e = h
                    .set_epoch(rpb::SetEpochRequest {
                        epoch,
                        members: vec!["intruder".into()],
                    })
                    .await;
                assert!(e.is_err(), "SetEpoch({epoch}) accepted");
            }
            let w = vec![rpb::WriteLayerRequest {
                layer: "intruder".into(),
                size: 64 * MIB,
                ..Default::default()
            }];
            assert!(h.write_layer(tokio_stream::iter(w)).await.is_err());
            let r = h
                .read_layer(rpb::ReadLayerRequest {
                    layer: String::new(),
                    extents: vec![rpb::Extent {
                        offset: 0,
                        length: u64::MAX - 4095,
                    }],
                })
                .await;
            assert!(r.is_err(), "ReadLayer without the secret answered");
            let sums = h
                .checksums(rpb::ChecksumsRequest {
                    offset: u64::MAX - 4095,
                    length: 4096,
                    block_size: 4096,
                })
                .await;
            assert!(sums.is_err());
        }
        for g in [info.generation + 1, u64::MAX] {
            for s in [None, Some(&wrong)] {
                let got = frames_try(*a, g, &info.volume_uuid, s).await?;
                assert!(
                    got.iter().all(|r| r.id == RequestId(0)),
                    "answered: {got:?}"
                );
            }
        }
        // Garbage, a header that claims 4 GiB, half a header.
        let mut junk = vec![0u8; 64 << 10];
        rand::Rng::fill(&mut rand::rng(), &mut junk[..]);
        for bytes in [junk.clone(), vec![0xff; 16], vec![0x5a; 5]] {
            if let Ok(mut s) = tokio::net::TcpStream::connect(*a).await {
                let _ = s.write_all(&bytes).await;
                let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut [0u8; 512])).await;
            }
        }
    }
    // Garbage at the engine's NBD port while it is down changes nothing either (nothing
    // listens); and after its restart, below, a garbage handshake leaves it serving.
    let nbd_addr = nbd
        .trim_start_matches("nbd://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();

    for (i, a) in addrs.iter().enumerate() {
        let (info, files) = &before[i];
        let mut h = client(*a, Some(secret.clone())).await?;
        let now = h.info(rpb::InfoRequest {}).await?.into_inner();
        assert_eq!(
            (
                now.generation,
                now.epoch,
                &now.epoch_members,
                now.flush_number
            ),
            (
                info.generation,
                info.epoch,
                &info.epoch_members,
                info.flush_number
            ),
            "replica {i} changed"
        );
        assert_eq!(
            &tree_digest(&c.dirs[i])?,
            files,
            "replica {i}'s files changed"
        );
        let ok = frames_try(*a, info.generation, &info.volume_uuid, Some(&secret)).await?;
        assert!(
            ok.last()
                .is_some_and(|r| r.id == RequestId(1) && r.status == rpb::Status::Ok),
            "replica {i} does not serve an authenticated client: {ok:?}"
        );
    }

    c.start_engine()?;
    if let Ok(mut s) = tokio::net::TcpStream::connect(nbd_addr.as_str()).await {
        let _ = s.write_all(&[0xa5; 4096]).await;
    }
    let i = c.engine().info().await?;
    assert_eq!(i.state, "healthy", "{i:?}\n{}", c.logs());
    let dev = c.engine().nbd_client().await?;
    assert!(dev.read(0, 2 * MIB).await?.iter().all(|&b| b == 0x5e));
    dev.write(2 * MIB, Bytes::from(vec![0x5fu8; 4096])).await?;
    dev.flush().await?;
    assert!(dev.read(2 * MIB, 4096).await?.iter().all(|&b| b == 0x5f));
    dev.disconnect().await;
    Ok(())
}
