//! Test fixtures: a real moto S3 server on 127.0.0.1, volumes as byte images, and helpers
//! that back up and restore them.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use zebu_backupstore::*;

/// A moto server process, killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

/// The `moto_server` program, from the venv the crate's script keeps outside the checkout.
pub fn moto_program() -> PathBuf {
    // This file is also included by the manager's backup tests, whose crate is elsewhere.
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = [
        here.join("scripts/moto-venv.sh"),
        here.join("../backupstore/scripts/moto-venv.sh"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .expect("backupstore/scripts/moto-venv.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("run moto-venv.sh");
    assert!(out.status.success(), "moto-venv.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).expect("utf8").trim())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

impl Moto {
    /// Starts a moto server that accepts any credentials.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a moto server with extra environment (e.g. authentication switched on).
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        let program = moto_program();
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("moto.log");
        for _ in 0..5 {
            let port = free_port();
            let mut cmd = Command::new(&program);
            cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(std::fs::File::create(&log).expect("log"))
                .stderr(std::fs::File::create(dir.path().join("moto.err")).expect("log"));
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawn moto_server");
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if http(port, "GET", "/", &[]).is_some() {
                    return Self {
                        child,
                        port,
                        log,
                        _dir: dir,
                    };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("moto_server did not start; see {}", log.display());
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a bucket (moto takes an unsigned request when authentication is off).
    pub fn create_bucket(&self, name: &str) {
        let r = http(self.port, "PUT", &format!("/{name}"), &[]).expect("create bucket");
        // 409 BucketAlreadyOwnedByYou: a second store on the same bucket.
        assert!(
            r.starts_with("HTTP/1.1 200") || r.contains("BucketAlreadyOwnedByYou"),
            "create bucket: {r}"
        );
    }

    pub fn settings(&self) -> S3Settings {
        S3Settings {
            access_key_id: Some("testing".into()),
            secret_access_key: Some("testing".into()),
            session_token: None,
            region: Some("us-east-1".into()),
            endpoint: Some(self.endpoint()),
        }
    }

    /// A store on `s3://BUCKET@us-east-1/PREFIX` of this server (bucket created).
    pub fn config(&self, bucket: &str, prefix: &str) -> TargetConfig {
        self.create_bucket(bucket);
        TargetConfig::with_settings(format!("s3://{bucket}@us-east-1/{prefix}"), self.settings())
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One plain HTTP/1.1 request; the response head, or `None` if nothing answered.
pub fn http(port: u16, method: &str, path: &str, body: &[u8]) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().ok()?,
        Duration::from_secs(2),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    if out.is_empty() {
        None
    } else {
        Some(String::from_utf8_lossy(&out).into_owned())
    }
}

/// Options for tests: a private index cache and short session times.
pub fn opts(cache: &Path) -> StoreOptions {
    StoreOptions {
        cache_dir: Some(cache.to_path_buf()),
        sessions: SessionTimes {
            ttl: Duration::from_secs(6),
            heartbeat: Duration::from_millis(500),
        },
        ..Default::default()
    }
}

pub const MIB: u64 = 1 << 20;

/// Deterministic incompressible bytes.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn spec(family: &str, name: &str, size: u64, parent: Option<&str>) -> BackupSpec {
    BackupSpec {
        family: FamilyId::new(family).unwrap(),
        name: BackupName::new(name).unwrap(),
        volume: family.into(),
        snapshot: format!("snap-{name}"),
        volume_size: size,
        parent: parent.map(|p| BackupName::new(p).unwrap()),
        labels: Default::default(),
    }
}

/// Full backup of an image: every chunk handed over (zero ones become holes).
pub async fn backup_full(store: &BackupStore, family: &str, name: &str, image: &[u8]) -> Manifest {
    let mut w = store
        .begin_backup(spec(family, name, image.len() as u64, None))
        .await
        .unwrap();
    let cs = w.chunk_size() as usize;
    let img = Bytes::copy_from_slice(image);
    for off in (0..image.len()).step_by(cs) {
        let end = (off + cs).min(image.len());
        w.put_chunk(off as u64, img.slice(off..end)).await.unwrap();
    }
    w.commit().await.unwrap()
}

/// Incremental backup of `image` against `parent`, handing over only the chunks the plan
/// says to read (from `changed` byte ranges and `zeroed` ranges).
pub async fn backup_incremental(
    store: &BackupStore,
    family: &str,
    name: &str,
    parent: &str,
    image: &[u8],
    changed: &[std::ops::Range<u64>],
    zeroed: &[std::ops::Range<u64>],
) -> Manifest {
    let size = image.len() as u64;
    let mut w = store
        .begin_backup(spec(family, name, size, Some(parent)))
        .await
        .unwrap();
    let cs = w.chunk_size();
    let plan = plan_chunks(size, cs, changed, zeroed);
    let img = Bytes::copy_from_slice(image);
    for r in &plan.read {
        let mut off = r.start;
        while off < r.end {
            let end = (off + cs).min(size);
            w.put_chunk(off, img.slice(off as usize..end as usize))
                .await
                .unwrap();
            off = end;
        }
    }
    for z in &plan.zero {
        w.put_zero(z.clone()).unwrap();
    }
    w.commit().await.unwrap()
}

/// Restores into a zeroed image of the backup's size.
pub async fn restore(store: &BackupStore, m: &Manifest) -> Result<(Vec<u8>, RestoreStats)> {
    restore_with(store, m, RestoreOptions::default()).await
}

/// [`restore`] with given options; checks that items come in ascending order and that no
/// chunk's bytes are handed on twice.
pub async fn restore_with(
    store: &BackupStore,
    m: &Manifest,
    opts: RestoreOptions,
) -> Result<(Vec<u8>, RestoreStats)> {
    let mut out = vec![0u8; m.volume_size as usize];
    let mut s = store.restore(m, opts).await?;
    let mut last = 0u64;
    let mut seen = std::collections::HashSet::new();
    while let Some(item) = s.next().await {
        match item? {
            RestoreItem::Data { offsets, data } => {
                assert!(offsets[0] >= last, "items must come in ascending order");
                for o in &offsets {
                    assert!(seen.insert(*o), "offset {o} handed on twice");
                }
                last = offsets[0];
                for o in offsets {
                    out[o as usize..o as usize + data.len()].copy_from_slice(&data);
                }
            }
            RestoreItem::Zero { offset, len } => {
                out[offset as usize..(offset + len) as usize].fill(0)
            }
        }
    }
    Ok((out, s.stats()))
}

/// Applies a diff restore to an image holding `from`.
pub async fn apply_diff(
    store: &BackupStore,
    image: &mut [u8],
    from: &Manifest,
    to: &Manifest,
) -> RestoreStats {
    let mut s = store
        .restore_diff(from, to, RestoreOptions::default())
        .await
        .unwrap();
    while let Some(item) = s.next().await {
        match item.unwrap() {
            RestoreItem::Data { offsets, data } => {
                for o in offsets {
                    image[o as usize..o as usize + data.len()].copy_from_slice(&data);
                }
            }
            RestoreItem::Zero { offset, len } => {
                image[offset as usize..(offset + len) as usize].fill(0)
            }
        }
    }
    s.stats()
}

pub fn file_config(dir: &Path) -> TargetConfig {
    TargetConfig::with_settings(format!("file://{}", dir.display()), S3Settings::default())
}

pub fn gc_now() -> GcOptions {
    GcOptions {
        margin: Duration::ZERO,
        ..Default::default()
    }
}

impl Moto {
    /// Settings with credentials and region but no endpoint.
    pub fn fake_settings() -> S3Settings {
        S3Settings {
            access_key_id: Some("testing".into()),
            secret_access_key: Some("testing".into()),
            session_token: None,
            region: Some("us-east-1".into()),
            endpoint: None,
        }
    }
}

impl Moto {
    /// A raw S3 client of this server's bucket (to damage objects behind the store's back).
    pub fn s3(&self, bucket: &str) -> object_store::aws::AmazonS3 {
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region("us-east-1")
            .with_access_key_id("testing")
            .with_secret_access_key("testing")
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .build()
            .expect("s3 client")
    }
}
