//! TLS on the replica ports (issue 18, item 2; `zebu_proto::tls`), with a CA made here by
//! the `openssl` CLI: replicas started with `--tls-cert/--tls-key`, an engine with
//! `--tls-ca` serves I/O over them (control gRPC and data frames, then the gRPC data
//! stream); a plaintext frames client and a plaintext gRPC client are refused, and a client
//! that trusts another CA refuses the replicas.
//!
//! Needs the workspace's binaries and `openssl`. Run with `--test-threads=1`: the replicas
//! use fixed loopback addresses.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zebu_engine::blockdev::BlockDevice;
use zebu_proto::frames::{self, Decoded, Hello};
use zebu_proto::replica as rpb;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_tests::engine::Cluster;

const MIB: u64 = 1 << 20;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `name` in `dir`: `name.pem` and `name.key`.
fn make_ca(dir: &Path, name: &str) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    dir.join(format!("{name}.pem"))
}

/// A replica certificate signed by CA `ca` for the three loopback addresses of [`Cluster`]:
/// (`replica.pem`, `replica.key`).
fn make_replica_cert(dir: &Path, ca: &str) -> (PathBuf, PathBuf) {
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.11,IP:127.0.0.12,IP:127.0.0.13\n\
         basicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature\n\
         extendedKeyUsage=serverAuth\n",
    )
    .expect("write ext.cnf");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "replica.key",
            "-out",
            "replica.csr",
            "-subj",
            "/CN=zebu-replica",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "replica.csr",
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            "replica.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
    (dir.join("replica.pem"), dir.join("replica.key"))
}

/// What a plaintext frames client gets from a TLS port: no frame at all, only the end of
/// the connection (or an error) within 10 s.
async fn plaintext_frames(addr: std::net::SocketAddr) -> anyhow::Result<BytesMut> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(&Hello::new(frames::VERSION, 1 << 30).encode())
        .await?;
    let mut buf = BytesMut::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read_buf(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(buf),
            Ok(Ok(_)) => {}
            Err(_) => anyhow::bail!("the TLS port kept a plaintext client waiting 10 s"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_serves_over_tls_and_plaintext_or_untrusting_clients_are_refused()
-> anyhow::Result<()> {
    let pki = tempfile::tempdir()?;
    let ca = make_ca(pki.path(), "zebu-test-ca");
    let other_ca = make_ca(pki.path(), "another-ca");
    let (cert, key) = make_replica_cert(pki.path(), "zebu-test-ca");
    let (cert, key) = (cert.to_string_lossy(), key.to_string_lossy());
    let args = ["--tls-cert", cert.as_ref(), "--tls-key", key.as_ref()];
    let mut c = Cluster::replicas_only_with("vol-tls", 64 * MIB, &args)?;
    c.cfg.extra_args = vec!["--tls-ca".into(), ca.to_string_lossy().into_owned()];
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    let data = Bytes::from((0..MIB).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    dev.write(0, data.clone()).await?;
    dev.flush().await?;
    assert_eq!(dev.read(0, MIB).await?, data, "reads over TLS");
    drop(dev);

    // A plaintext frames client: dropped at the handshake, no answer, nothing fenced.
    for addr in &c.addrs {
        let got = plaintext_frames(*addr).await?;
        let mut b = got.clone();
        assert!(
            !matches!(frames::decode_response(&mut b), Ok(Decoded::Frame(_))),
            "{addr}: a plaintext client got a frames answer: {got:?}"
        );
    }
    // A plaintext gRPC client: no call goes through.
    let plain = async {
        let mut cl = ReplicaClient::connect(format!("http://{}", c.addrs[0])).await?;
        cl.info(rpb::InfoRequest {}).await?;
        Ok::<_, anyhow::Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(15), plain).await {
        Ok(Err(_)) | Err(_) => {}
        Ok(Ok(())) => panic!("a plaintext gRPC call was served by a TLS port"),
    }
    // A client that trusts another CA refuses the replica's certificate; the right CA
    // accepts it (the same code the engine uses).
    let name = zebu_proto::tls::server_name(&c.addr(0))?;
    let wrong = zebu_proto::tls::connector(&other_ca)?;
    let tcp = tokio::net::TcpStream::connect(c.addrs[0]).await?;
    let Err(e) = wrong.connect(name.clone(), tcp).await else {
        panic!("a certificate from another CA is refused");
    };
    assert!(
        e.to_string().to_lowercase().contains("certificate"),
        "the refusal names the certificate: {e}"
    );
    let right = zebu_proto::tls::connector(&ca)?;
    let tcp = tokio::net::TcpStream::connect(c.addrs[0]).await?;
    right.connect(name, tcp).await?;

    // The engine still serves (nothing above fenced it), and after a restart on the gRPC
    // data stream, over TLS too.
    let dev = c.engine().nbd_client().await?;
    assert_eq!(dev.read(0, MIB).await?, data);
    drop(dev);
    c.engine = None;
    c.cfg
        .extra_args
        .extend(["--data-transport".into(), "grpc".into()]);
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    assert_eq!(
        dev.read(0, MIB).await?,
        data,
        "reads over the gRPC stream on TLS"
    );
    dev.write(MIB, data.clone()).await?;
    dev.flush().await?;
    assert_eq!(dev.read(MIB, MIB).await?, data);

    // An engine that trusts another CA cannot start on these replicas.
    drop(dev);
    c.engine = None;
    c.cfg.extra_args = vec!["--tls-ca".into(), other_ca.to_string_lossy().into_owned()];
    assert!(
        c.start_engine().is_err(),
        "an engine that does not trust the replicas' CA started"
    );
    Ok(())
}
