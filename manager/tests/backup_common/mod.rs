//! Helpers of the backup end-to-end tests that are not in `common` (they need moto): the
//! AWS variables of a moto server, killing the cluster's upload processes, whole-device
//! images and restores, the bucket's manifests, and a TCP proxy in front of moto that
//! counts the bytes through it and can cut the S3 connection.
#![allow(dead_code)] // each test file uses its own subset

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::common::*;
use super::store_fixtures::{self, Moto};

/// The AWS variables that point a `zebu up` at an S3 endpoint with moto's credentials.
pub fn s3_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ACCESS_KEY_ID", "testing".into()),
        ("AWS_SECRET_ACCESS_KEY", "testing".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
    ]
}

/// Kills every `zebu-backup-run` of the cluster in its directory when the test ends.
pub struct KillRunners(pub String);
impl Drop for KillRunners {
    fn drop(&mut self) {
        for pid in pids("zebu-backup-run", &self.0) {
            kill9(pid);
        }
    }
}

pub fn backup(api: &str, name: &str) -> Option<Value> {
    let out = zebu(api, &["backup", "get", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).expect("json"))
}

/// The whole device behind an NBD endpoint.
pub fn image(endpoint: &str, out: &Path) -> Vec<u8> {
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", endpoint])
        .arg(out)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert {endpoint}");
    let img = std::fs::read(out).expect("read image");
    let _ = std::fs::remove_file(out);
    img
}

/// The first 4 KiB block where two images differ, or `None`.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.chunks(4096)
        .zip(b.chunks(4096))
        .position(|(x, y)| x != y)
        .map(|i| i * 4096)
}

/// Writes `len` random bytes (from `seed`) at `offset` of the device.
pub fn write_random(endpoint: &str, tmp: &Path, seed: u64, offset: u64, len: u64) {
    let src = tmp.join(format!("random-{seed}.bin"));
    std::fs::write(&src, store_fixtures::random_bytes(seed, len as usize)).expect("random");
    qemu_io(
        endpoint,
        &format!("write -s {} {offset} {len}", src.display()),
    );
    let _ = std::fs::remove_file(&src);
}

/// Restores `backup` into a new volume with `replicas` replicas and returns its whole device.
pub fn restore_image(api: &str, backup: &str, volume: &str, replicas: u8, tmp: &Path) -> Vec<u8> {
    ok(
        api,
        &[
            "volume",
            "create",
            volume,
            "--from-backup",
            backup,
            "--replicas",
            &replicas.to_string(),
            "--frontend",
            "nbd",
        ],
    );
    wait_for(&format!("restore of {backup} completed"), 300, || {
        let v = super::common::volume(api, volume).expect("restored volume");
        let state = v["status"]["restore"]["state"].clone();
        assert_ne!(state, "error", "restore failed: {v}");
        state == "completed"
    });
    let endpoint = ok(api, &["volume", "attach", volume]).trim().to_string();
    let img = image(&endpoint, &tmp.join(format!("{volume}.img")));
    ok(api, &["volume", "detach", volume]);
    img
}

/// The object keys in `bucket` under `prefix` (one listing: the tests keep under 1,000).
pub fn keys(moto: &Moto, bucket: &str, prefix: &str) -> Vec<String> {
    let listing = store_fixtures::http(
        moto.port,
        "GET",
        &format!("/{bucket}?list-type=2&prefix={prefix}"),
        &[],
    )
    .unwrap_or_default();
    listing
        .split("<Key>")
        .skip(1)
        .filter_map(|k| k.split("</Key>").next())
        .map(str::to_string)
        .collect()
}

/// The names of the backups whose manifests `bucket` holds under `prefix`, sorted.
pub fn manifests(moto: &Moto, bucket: &str, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = keys(moto, bucket, prefix)
        .iter()
        .filter_map(|k| k.strip_suffix(".manifest"))
        .filter_map(|k| k.rsplit('/').next())
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// A TCP proxy on 127.0.0.1 in front of one upstream port: counts the bytes each way and,
/// while cut, drops every connection it has and every new one at once (an S3 endpoint that
/// went away mid-request).
pub struct FaultProxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    /// A pause after each 64 KiB forwarded, in microseconds (0: none).
    slow: Arc<AtomicU64>,
    open: Arc<Mutex<Vec<TcpStream>>>,
    pub to_upstream: Arc<AtomicU64>,
    pub from_upstream: Arc<AtomicU64>,
    pub connections: Arc<AtomicU64>,
}

impl FaultProxy {
    pub fn start(upstream: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let p = FaultProxy {
            port,
            cut: Arc::new(AtomicBool::new(false)),
            slow: Arc::new(AtomicU64::new(0)),
            open: Arc::new(Mutex::new(Vec::new())),
            to_upstream: Arc::new(AtomicU64::new(0)),
            from_upstream: Arc::new(AtomicU64::new(0)),
            connections: Arc::new(AtomicU64::new(0)),
        };
        let (cut, slow, open, up, down, conns) = (
            p.cut.clone(),
            p.slow.clone(),
            p.open.clone(),
            p.to_upstream.clone(),
            p.from_upstream.clone(),
            p.connections.clone(),
        );
        // The accepting thread ends with the test process.
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                conns.fetch_add(1, Ordering::Relaxed);
                if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                    let mut o = open.lock().expect("proxy lock");
                    o.push(c2);
                    o.push(s2);
                }
                pump(&client, &server, up.clone(), cut.clone(), slow.clone());
                pump(&server, &client, down.clone(), cut.clone(), slow.clone());
            }
        });
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Drops every connection now and every new one until [`FaultProxy::mend`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.open.lock().expect("proxy lock").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Forward at most about `mib_per_s` MiB/s per connection and direction (0: at full
    /// speed), so a test can act in the middle of an upload.
    pub fn throttle(&self, mib_per_s: u64) {
        let us = if mib_per_s == 0 {
            0
        } else {
            1_000_000 / (16 * mib_per_s)
        };
        self.slow.store(us, Ordering::SeqCst);
    }

    pub fn mend(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    pub fn bytes(&self) -> (u64, u64) {
        (
            self.to_upstream.load(Ordering::Relaxed),
            self.from_upstream.load(Ordering::Relaxed),
        )
    }
}

fn pump(
    from: &TcpStream,
    to: &TcpStream,
    count: Arc<AtomicU64>,
    cut: Arc<AtomicBool>,
    slow: Arc<AtomicU64>,
) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if cut.load(Ordering::SeqCst) || to.write_all(&buf[..n]).is_err() {
                break;
            }
            count.fetch_add(n as u64, Ordering::Relaxed);
            let us = slow.load(Ordering::Relaxed);
            if us > 0 {
                std::thread::sleep(std::time::Duration::from_micros(us));
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        if cut.load(Ordering::SeqCst) {
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        }
    });
}
