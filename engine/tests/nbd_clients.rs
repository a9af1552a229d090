//! Real NBD clients against the server: libnbd's `nbdinfo` and `nbdcopy`, and fio's `nbd`
//! engine with data verification. The device is a [`FileDevice`] in a temporary directory.

mod nbd_common;

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nbd_common::*;
use tokio::process::Command;
use zebu_engine::blockdev::FileDevice;

async fn run(cmd: &mut Command) -> String {
    let out = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .expect("client finishes within 5 minutes")
        .expect("client starts (is libnbd-bin / fio installed?)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn file_server_dev(dir: &Path, size: u64) -> Arc<FileDevice> {
    Arc::new(FileDevice::open(&dir.join("dev.img"), size).expect("open device file"))
}

/// Compares two files in 1 MiB chunks and names the first differing offset.
fn assert_same_file(a: &Path, b: &Path) {
    let mut fa = std::fs::File::open(a).expect("open a");
    let mut fb = std::fs::File::open(b).expect("open b");
    assert_eq!(
        fa.metadata().expect("meta").len(),
        fb.metadata().expect("meta").len(),
        "sizes differ"
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    loop {
        let n = fa.read(&mut ba).expect("read a");
        if n == 0 {
            break;
        }
        fb.read_exact(&mut bb[..n]).expect("read b");
        if ba[..n] != bb[..n] {
            let i = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y);
            panic!("files differ at byte {}", off + i.unwrap_or(0) as u64);
        }
        off += n as u64;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_reports_size_and_capabilities() {
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 192 << 20;
    let server = TestServer::start(file_server_dev(dir.path(), size)).await;
    let out = run(Command::new("nbdinfo").arg("--json").arg(server.uri())).await;
    let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo json");
    let export = &v["exports"][0];
    assert_eq!(export["export-name"], EXPORT);
    assert_eq!(export["export-size"], size);
    assert_eq!(export["can_multi_conn"], true);
    assert_eq!(export["can_fua"], true);
    assert_eq!(export["can_trim"], true);
    assert_eq!(export["can_zero"], true);
    assert_eq!(export["block_size_maximum"], 32 << 20);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_round_trip_of_random_data_matches() {
    let dir = tempfile::tempdir().expect("tempdir");
    let size: u64 = 256 << 20;
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    run(Command::new("dd")
        .arg("if=/dev/urandom")
        .arg(format!("of={}", src.display()))
        .arg("bs=1M")
        .arg(format!("count={}", size >> 20))
        .arg("status=none"))
    .await;
    let server = TestServer::start(file_server_dev(dir.path(), size)).await;
    // nbdcopy uses four connections by default when the server allows multi-conn, so this
    // also exercises several connections writing at once.
    run(Command::new("nbdcopy")
        .arg(&src)
        .arg(server.uri())
        .arg("--flush"))
    .await;
    run(Command::new("nbdcopy").arg(server.uri()).arg(&back)).await;
    assert_same_file(&src, &back);
    // The device file itself holds the data too (not only a cache in the server).
    assert_same_file(&src, &dir.path().join("dev.img"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_nbd_engine_verify_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = TestServer::start(file_server_dev(dir.path(), 64 << 20)).await;
    // fio saves a verify state file in its working directory: keep it in the test's own.
    let out = run(Command::new("fio")
        .current_dir(dir.path())
        .arg("--name=nbdverify")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={}", server.uri()))
        .arg("--rw=randwrite")
        .arg("--bsrange=4k-64k")
        .arg("--iodepth=32")
        .arg("--size=64M")
        .arg("--verify=crc32c")
        .arg("--do_verify=1")
        .arg("--verify_fatal=1")
        .arg("--output-format=json"))
    .await;
    // fio may print notices before the JSON document.
    let json = &out[out.find('{').expect("fio printed JSON")..];
    let v: serde_json::Value = serde_json::from_str(json).expect("fio json");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0);
    assert_eq!(job["write"]["io_bytes"], 64u64 << 20);
    // The verify pass read everything back.
    assert_eq!(job["read"]["io_bytes"], 64u64 << 20);
    server.stop().await;
}
