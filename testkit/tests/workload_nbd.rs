//! The NBD client and the `zebu-verify` command against real `nbdkit` servers on loopback.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;
use zebu_engine::blockdev::{BlockDevice, BlockError};
use zebu_testkit::workload::{self, Expect, NbdClient, RunId, Scope, StopAfter, WorkloadConfig};

/// An `nbdkit` process serving on a free loopback port; killed (by its own handle) on drop.
struct Nbdkit {
    child: Child,
    addr: String,
}

impl Nbdkit {
    fn start(args: &[&str]) -> Nbdkit {
        // Ask the kernel for a free port, release it and hand it to nbdkit; retry if another
        // process grabbed it in between.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("free port")
                .port();
            let addr = format!("127.0.0.1:{port}");
            let mut child = Command::new("nbdkit")
                .args(["-f", "-p", &port.to_string(), "-i", "127.0.0.1"])
                .args(args)
                .stdout(Stdio::null())
                .spawn()
                .expect("nbdkit is installed");
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // exited: port taken, try another
                }
                if std::net::TcpStream::connect(&addr).is_ok() {
                    return Nbdkit { child, addr };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("nbdkit did not start");
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pattern(seed: u8, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn nbd_client_round_trips_data_with_many_requests_in_flight() {
    let server = Nbdkit::start(&["memory", "64M"]);
    let dev = NbdClient::connect(&server.addr, "vol")
        .await
        .expect("connect");
    assert_eq!(dev.size(), 64 << 20);

    // 64 concurrent writes of different sizes and contents, then 64 concurrent reads.
    let writes = (0..64u8).map(|i| {
        let dev = &dev;
        async move {
            let len = 4096 * (1 + usize::from(i % 4));
            let off = u64::from(i) * (1 << 20);
            dev.write(off, pattern(i, len)).await.map(|()| (off, len))
        }
    });
    let done: Vec<(u64, usize)> = join_all(writes)
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("writes");
    dev.flush().await.expect("flush");
    let reads = done.iter().map(|&(off, len)| dev.read(off, len as u64));
    for (i, r) in join_all(reads).await.into_iter().enumerate() {
        let (_, len) = done[i];
        assert_eq!(r.expect("read"), pattern(i as u8, len), "request {i}");
    }

    // FUA write, then trim reads back as zeros (nbdkit memory punches the range).
    dev.write_fua(8192, pattern(7, 4096))
        .await
        .expect("fua write");
    assert_eq!(dev.read(8192, 4096).await.expect("read"), pattern(7, 4096));
    dev.unmap(0, 1 << 20).await.expect("trim");
    assert!(
        dev.read(0, 1 << 20)
            .await
            .expect("read")
            .iter()
            .all(|&b| b == 0)
    );

    // Out of range is refused locally with the device size in the error.
    match dev.read((64 << 20) - 4096, 8192).await {
        Err(BlockError::OutOfRange { size, .. }) => assert_eq!(size, 64 << 20),
        other => panic!("expected OutOfRange, got {other:?}"),
    }
    dev.disconnect().await;
}

#[tokio::test]
async fn nbd_server_errors_map_to_block_errors() {
    let server = Nbdkit::start(&[
        "--filter=error",
        "memory",
        "16M",
        "error-pwrite=ENOSPC",
        "error-pwrite-rate=100%",
    ]);
    let dev = NbdClient::connect(&server.addr, "").await.expect("connect");
    match dev.write(0, pattern(1, 4096)).await {
        Err(BlockError::NoSpace(msg)) => assert!(msg.contains("ENOSPC"), "{msg}"),
        other => panic!("expected NoSpace, got {other:?}"),
    }
    // The connection survives a failed request.
    assert_eq!(dev.read(0, 4096).await.expect("read").len(), 4096);
}

#[tokio::test]
async fn server_death_fails_in_flight_and_later_requests_and_the_workload_records_it() {
    let mut server = Nbdkit::start(&["--filter=delay", "memory", "16M", "delay-write=50ms"]);
    let dev = NbdClient::connect(&server.addr, "").await.expect("connect");
    let cfg = WorkloadConfig {
        stop: StopAfter::Duration(Duration::from_secs(20)),
        queue_depth: 8,
        ..WorkloadConfig::default()
    };
    let mut model = cfg.new_model(dev.size(), RunId(7)).expect("config");
    let kill = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.child.kill().expect("kill nbdkit");
    };
    let (report, ()) = tokio::join!(workload::run_workload(&dev, &mut model, &cfg), kill);
    assert!(report.elapsed < Duration::from_secs(10), "stopped on error");
    assert!(!report.io_errors.is_empty());
    assert!(
        report
            .io_errors
            .iter()
            .all(|e| e.error.contains("NBD connection")),
        "{:?}",
        report.io_errors
    );
    assert!(matches!(
        dev.read(0, 4096).await,
        Err(BlockError::Unavailable(_))
    ));
}

#[tokio::test]
async fn workload_over_nbd_verifies_clean() {
    let server = Nbdkit::start(&["memory", "64M"]);
    let dev = NbdClient::connect(&server.addr, "vol")
        .await
        .expect("connect");
    let cfg = WorkloadConfig {
        range_len: Some(16 << 20),
        stop: StopAfter::Ops(20_000),
        queue_depth: 32,
        unmap_percent: 5,
        ..WorkloadConfig::default()
    };
    let mut model = cfg.new_model(dev.size(), RunId(8)).expect("config");
    let report = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty(), "{:?}", report.bad_reads);
    let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 16).await;
    assert!(check.passed(), "{:?}", check.wrong);
    assert_eq!(check.checked, 4096);
}

fn zebu_verify(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zebu-verify"))
        .args(args)
        .output()
        .expect("run zebu-verify");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn corrupt(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open backing file");
    f.write_all_at(&[0xEE; 16], offset).expect("corrupt");
    f.sync_all().expect("sync");
}

#[test]
fn zebu_verify_run_then_check_passes_and_names_a_corrupted_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(32 << 20))
        .expect("create disk");
    let state = dir.path().join("state.json");
    let state_s = state.to_str().expect("utf-8 path");
    let server = Nbdkit::start(&["file", disk.to_str().expect("utf-8 path")]);

    let (rc, out, err) = zebu_verify(&[
        "run",
        "--nbd",
        &server.addr,
        "--export",
        "vol",
        "--size-range",
        "4M",
        "--qd",
        "16",
        "--ops",
        "5000",
        "--flush-every",
        "100",
        "--pattern",
        "random",
        "--state",
        state_s,
    ]);
    assert_eq!(rc, 0, "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains("5000 ops") && out.contains("0 I/O errors"),
        "{out}"
    );

    let (rc, out, err) = zebu_verify(&[
        "check",
        "--nbd",
        &server.addr,
        "--export",
        "vol",
        "--state",
        state_s,
    ]);
    assert_eq!(rc, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("1024 blocks checked, 0 wrong"), "{out}");

    // Damage block 123 in the backing file, behind the server's and the driver's back.
    corrupt(&disk, 123 * 4096 + 100);
    let (rc, out, _) = zebu_verify(&[
        "check",
        "--nbd",
        &server.addr,
        "--export",
        "vol",
        "--state",
        state_s,
    ]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("1 wrong"), "{out}");
    assert!(out.contains("WRONG: block 123 (offset 503808)"), "{out}");
    // A crash check is no more lenient about garbage.
    let (rc, out, _) = zebu_verify(&[
        "check",
        "--nbd",
        &server.addr,
        "--state",
        state_s,
        "--after-crash",
    ]);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("WRONG: block 123 "), "{out}");
}

#[test]
fn zebu_verify_lists_twenty_wrong_blocks_then_a_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(8 << 20))
        .expect("create disk");
    let state = dir.path().join("state.json");
    let state_s = state.to_str().expect("utf-8 path");
    let server = Nbdkit::start(&["file", disk.to_str().expect("utf-8 path")]);
    let (rc, out, err) = zebu_verify(&[
        "run",
        "--nbd",
        &server.addr,
        "--size-range",
        "1M",
        "--ops",
        "1000",
        "--pattern",
        "seq",
        "--read-percent",
        "0",
        "--state",
        state_s,
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    for b in 0..30u64 {
        corrupt(&disk, b * 4096 + 2048);
    }
    let (rc, out, _) = zebu_verify(&["check", "--nbd", &server.addr, "--state", state_s]);
    assert_eq!(rc, 1);
    assert_eq!(out.matches("WRONG: block").count(), 20, "{out}");
    assert!(out.contains("... and 10 more"), "{out}");
}

#[test]
fn zebu_verify_bad_flags_give_one_line_errors() {
    for args in [
        &["run", "--nbd", "127.0.0.1:1", "--qd", "0"][..],
        &["run", "--nbd", "127.0.0.1:1", "--duration", "5parsecs"][..],
        &[
            "run",
            "--nbd",
            "127.0.0.1:1",
            "--ops",
            "5",
            "--duration",
            "1s",
        ][..],
        &["check"][..],
    ] {
        let (rc, out, err) = zebu_verify(args);
        assert_eq!(rc, 2, "{args:?}: {out}{err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("zebu-verify: "), "{err}");
    }
    // Nothing listening: a readable connect error, not a panic.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let (rc, _, err) = zebu_verify(&[
        "check",
        "--nbd",
        &format!("127.0.0.1:{port}"),
        "--state",
        "/nonexistent/state.json",
    ]);
    assert_eq!(rc, 1);
    assert!(err.contains("state") && !err.contains("panicked"), "{err}");
}

#[test]
fn zebu_verify_survives_a_server_killed_mid_run_then_checks_after_crash_and_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(16 << 20))
        .expect("create disk");
    let disk_s = disk.to_str().expect("utf-8 path");
    let state = dir.path().join("state.json");
    let state_s = state.to_str().expect("utf-8 path");

    let mut server = Nbdkit::start(&["--filter=delay", "file", disk_s, "delay-write=2ms"]);
    let run = Command::new(env!("CARGO_BIN_EXE_zebu-verify"))
        .args([
            "run",
            "--nbd",
            &server.addr,
            "--size-range",
            "4M",
            "--duration",
            "30s",
            "--flush-every",
            "50",
            "--state",
            state_s,
            "--allow-errors",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn zebu-verify");
    std::thread::sleep(Duration::from_millis(700));
    server.child.kill().expect("kill nbdkit");
    let out = run.wait_with_output().expect("zebu-verify finishes");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        !stdout.contains(" 0 I/O errors"),
        "the kill must be seen: {stdout}"
    );
    assert!(stdout.contains("I/O error: "), "{stdout}");

    // Same file, new server: whatever the killed server had acknowledged or not, every block
    // must be the flushed version or a later one.
    let server = Nbdkit::start(&["file", disk_s]);
    let (rc, out, err) = zebu_verify(&["check", "--nbd", &server.addr, "--state", state_s]);
    // nbdkit's file plugin writes into the page cache, which a killed process does not lose,
    // so even the exact check (newest acknowledged write, or a failed one that may have
    // landed) must pass.
    assert_eq!(rc, 0, "{out}{err}");
    let (rc, out, err) = zebu_verify(&[
        "check",
        "--nbd",
        &server.addr,
        "--state",
        state_s,
        "--after-crash",
    ]);
    assert_eq!(rc, 0, "{out}{err}");

    // The crash check settled the state; a resumed run continues and checks exactly.
    let (rc, out, err) = zebu_verify(&[
        "run",
        "--nbd",
        &server.addr,
        "--size-range",
        "4M",
        "--ops",
        "2000",
        "--resume",
        "--state",
        state_s,
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    let (rc, out, err) = zebu_verify(&["check", "--nbd", &server.addr, "--state", state_s]);
    assert_eq!(rc, 0, "{out}{err}");
}
