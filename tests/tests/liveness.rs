//! Replica liveness on an idle volume: with no I/O at all, a replica killed with SIGKILL or
//! hung with SIGSTOP goes ERR within the I/O timeout (the engine pings every replica over its
//! data path), and under `zebu up` the volume is degraded within 10 s and healthy again
//! within 30 s without a single write; a replica stopped for 30 s comes back after SIGCONT;
//! afterwards everything written before reads back.
//!
//! Run with `--test-threads=1` when other suites run at the same time: the tests use the
//! fixed loopback addresses 127.0.0.11-13.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use zebu_engine::blockdev::BlockDevice;
use zebu_testkit::workload::NbdClient;
use zebu_tests::bin_path;
use zebu_tests::engine::{Cluster, mode_in};
use zebu_tests::model::{BLOCK, blocks_data, decode};

const MIB: u64 = 1 << 20;

async fn write_and_check(dev: &NbdClient, blocks: u64, stamp: u64) -> anyhow::Result<()> {
    dev.write(0, Bytes::from(blocks_data(0, blocks, stamp)))
        .await?;
    dev.flush().await?;
    Ok(())
}

async fn verify(dev: &NbdClient, blocks: u64, stamp: u64) -> anyhow::Result<()> {
    let data = dev.read(0, blocks * BLOCK).await?;
    for b in 0..blocks {
        let got = decode(b, &data[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize]);
        if got != Ok(stamp) {
            bail!("block {b}: {got:?}, wanted stamp {stamp}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_engine_finds_a_killed_and_a_stopped_replica_without_any_io() -> anyhow::Result<()>
{
    let mut c = Cluster::start("idle", 64 * MIB)?;
    let io_timeout = c.cfg.io_timeout;
    let dev = c.engine().nbd_client().await?;
    write_and_check(&dev, 256, 1).await?;
    let before = c.engine().info().await?;
    assert_eq!(before.state, "healthy");

    let killed = Instant::now();
    c.kill_replica(2);
    let (_, took) = c
        .engine()
        .wait_until(Duration::from_secs(10), |i| mode_in(i, &c.addr(2)) == "ERR")
        .await
        .context("a killed replica goes ERR with no I/O")?;
    eprintln!("killed replica: ERR after {took:?}");
    assert!(
        killed.elapsed() < io_timeout + Duration::from_secs(2),
        "{took:?}"
    );

    c.replica(1).pause();
    let stopped = Instant::now();
    let (info, took) = c
        .engine()
        .wait_until(Duration::from_secs(15), |i| mode_in(i, &c.addr(1)) == "ERR")
        .await
        .context("a stopped replica goes ERR with no I/O")?;
    eprintln!("stopped replica: ERR after {took:?}");
    // One ping interval (half the I/O timeout here) to send the ping, the I/O timeout to
    // give up on it, and some slack for a loaded machine.
    assert!(
        stopped.elapsed() < io_timeout + io_timeout / 2 + Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(info.state, "degraded");
    assert!(
        c.engine().info().await?.epoch > before.epoch,
        "the new membership was recorded without waiting for a write"
    );
    c.replica(1).resume();
    c.restart_replica(2)?;
    for i in [1, 2] {
        c.engine().cli(&["replica", "add", &c.addr(i)]).await?;
        c.engine()
            .wait_rebuilt(&c.addr(i), Duration::from_secs(60))
            .await?;
    }
    assert_eq!(c.engine().info().await?.state, "healthy");
    verify(&dev, 256, 1).await
}

/// `zebu up` and the processes it started; everything is killed when dropped.
struct Up {
    child: Child,
    dir: std::path::PathBuf,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Anything still running under the data directory (a replica left SIGSTOPped).
        for pid in pids_with(&self.dir.display().to_string()) {
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGKILL);
        }
    }
}

/// Processes whose command line contains `needle`.
fn pids_with(needle: &str) -> Vec<Pid> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) && pid != std::process::id() as i32 {
            out.push(Pid::from_raw(pid));
        }
    }
    out
}

fn zebu(api: &str, args: &[&str]) -> anyhow::Result<Value> {
    let out = Command::new(bin_path("zebu"))
        .args(args)
        .args(["-o", "json"])
        .env("ZEBU_API", api)
        .output()
        .context("run zebu")?;
    if !out.status.success() {
        bail!(
            "zebu {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout).context("zebu printed no JSON")
}

/// Polls the volume every 200 ms until `pred` holds; returns how long it took.
fn wait_volume(
    api: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let v = zebu(api, &["volume", "get", "vol"])?;
        if pred(&v) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > within {
            bail!("{what}: not within {within:?}; volume: {}", v["status"]);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn replica_mode(v: &Value, node: &str) -> String {
    v["status"]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["node"] == node)
        .and_then(|r| r["mode"].as_str())
        .unwrap_or("")
        .to_string()
}

/// The pid of the replica of volume `vol` that node `node` runs.
fn replica_pid(dir: &Path, node: &str) -> anyhow::Result<Pid> {
    let needle = format!("--dir {}/{node}/", dir.display());
    let pids: Vec<Pid> = pids_with(&needle)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains("zebu-replica"))
                .unwrap_or(false)
        })
        .collect();
    match pids.as_slice() {
        [p] => Ok(*p),
        other => bail!("expected one replica process on {node}, found {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_volume_under_zebu_up_heals_a_killed_and_a_stopped_replica_without_io()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut child = Command::new(bin_path("zebu"))
        .args(["up", "--listen", "127.0.0.1:0", "--volume", "vol"])
        .args(["--volume-size", "64M"])
        .args(["--setting", "storage-minimal-available-percentage=0"])
        .arg("--data-dir")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("up.log"))?)
        .spawn()
        .context("spawn zebu up")?;
    let stdout = child.stdout.take().context("stdout")?;
    let _up = Up {
        child,
        dir: dir.path().to_path_buf(),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let next = || rx.recv_timeout(Duration::from_secs(120));
    let api = next()?
        .strip_prefix("zebu API listening on ")
        .context("API line")?
        .to_string();
    let endpoint = loop {
        let line = next()?;
        if let Some(e) = line.strip_prefix("volume vol attached: ") {
            break e.to_string();
        }
    };
    let hostport = endpoint
        .strip_prefix("nbd://")
        .and_then(|r| r.strip_suffix("/vol"))
        .context("nbd endpoint")?
        .to_string();
    let dev = NbdClient::connect(&hostport, "vol").await?;
    write_and_check(&dev, 512, 7).await?;
    // Idle from here: nothing is read or written until the end.
    wait_volume(&api, Duration::from_secs(30), "healthy at start", |v| {
        v["status"]["robustness"] == "healthy"
    })?;

    kill(replica_pid(dir.path(), "node-2")?, Signal::SIGKILL)?;
    let degraded = wait_volume(
        &api,
        Duration::from_secs(10),
        "degraded after kill -9",
        |v| v["status"]["robustness"] == "degraded",
    )?;
    let healthy = wait_volume(&api, Duration::from_secs(30), "healthy again", |v| {
        v["status"]["robustness"] == "healthy"
    })?;
    eprintln!(
        "kill -9: degraded after {degraded:?}, healthy after {:?} more",
        healthy
    );

    let stopped = replica_pid(dir.path(), "node-3")?;
    kill(stopped, Signal::SIGSTOP)?;
    let started = Instant::now();
    let err = wait_volume(&api, Duration::from_secs(15), "ERR after SIGSTOP", |v| {
        replica_mode(v, "node-3") == "ERR"
    })?;
    eprintln!("SIGSTOP: ERR after {err:?}");
    let held = Duration::from_secs(30).saturating_sub(started.elapsed());
    std::thread::sleep(held);
    kill(stopped, Signal::SIGCONT)?;
    let back = wait_volume(
        &api,
        Duration::from_secs(60),
        "healthy after SIGCONT",
        |v| v["status"]["robustness"] == "healthy" && replica_mode(v, "node-3") == "RW",
    )?;
    eprintln!("SIGCONT after 30 s stopped: healthy after {back:?}");
    verify(&dev, 512, 7).await
}
