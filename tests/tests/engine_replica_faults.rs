//! Replica faults under a verified workload through the engine's NBD frontend: a replica
//! that dies, hangs, loses its network or fills its disk is dropped (ERR) within the I/O
//! timeout, the workload sees no error, and every block reads back as acknowledged.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zebu_engine::blockdev::BlockDevice;
use zebu_testkit::workload::{Expect, RunId};
use zebu_tests::engine::{
    Background, Cluster, LatencyProbe, assert_clean_run, assert_verified, busy_workload, mode_in,
    percentile,
};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;

/// How long after a fault the replica must be ERR: the I/O timeout plus 1 s.
fn err_deadline(c: &Cluster) -> Duration {
    c.cfg.io_timeout + Duration::from_secs(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_kill9_under_load_loses_nothing() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start("kill9", 256 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let cfg = busy_workload(seed);
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(dev, model, cfg);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!bg.is_finished(), "the workload stopped early");

    let victim = c.addr(1);
    c.kill_replica(1);
    let deadline = err_deadline(&c);
    let (info, took) = c
        .engine()
        .wait_until(deadline, |i| mode_in(i, &victim) == "ERR")
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!("killed replica {victim} was ERR after {took:?}");
    assert!(took <= deadline, "ERR after {took:?}, over {deadline:?}");
    assert_eq!(info.state, "degraded", "{info:?}");

    // Keep writing on two replicas for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (model, report, dev) = bg.stop().await?;
    eprintln!(
        "workload: {} writes, {} reads, {} flushes, {:.0} IOPS",
        report.writes,
        report.reads,
        report.flushes,
        report.iops()
    );
    assert_clean_run("workload across the kill", &report);
    assert!(
        report.writes > 1000,
        "too few writes to mean anything: {report:?}"
    );
    assert_verified("after kill -9 of one replica", &dev, &model, Expect::Exact).await;
    let info = c.engine().info().await?;
    assert_eq!(info.state, "degraded");
    assert_eq!(mode_in(&info, &c.addr(0)), "RW");
    assert_eq!(mode_in(&info, &c.addr(2)), "RW");
    Ok(())
}

/// Runs a workload on the first 192 MiB and a latency probe on 16 MiB above it, calls
/// `inject` to make replica 1 stop answering, and checks that it is ERR within the I/O timeout
/// plus 1 s, that writes issued in the second after that are fast again (p99 < 1 s), that the
/// workload saw no error and that every block verifies.
async fn hang_replica_and_check(
    c: &Cluster,
    seed: u64,
    inject: impl FnOnce(),
) -> anyhow::Result<()> {
    let dev = c.engine().nbd_client().await?;
    let mut cfg = busy_workload(seed);
    cfg.range_len = Some(192 * MIB);
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(dev, model, cfg);
    let probe_dev = Arc::new(c.engine().nbd_client().await?);
    let probe = LatencyProbe::spawn(probe_dev.clone(), 224 * MIB, 16 * MIB, 4);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let victim = c.addr(1);
    inject();
    let deadline = err_deadline(c);
    let (info, took) = c
        .engine()
        .wait_until(deadline + Duration::from_secs(5), |i| {
            mode_in(i, &victim) == "ERR"
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    let err_at = Instant::now();
    eprintln!(
        "hung replica {victim} was ERR after {took:?} (reason: {:?})",
        info.replicas
            .iter()
            .find(|r| r.address == victim)
            .map(|r| r.reason.clone())
    );
    assert!(took <= deadline, "ERR after {took:?}, over {deadline:?}");
    assert_eq!(info.state, "degraded", "{info:?}");

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let lat = probe.stop().await?;
    let (model, report, dev) = bg.stop().await?;
    let before: Vec<Duration> = lat
        .iter()
        .filter(|(t, _)| *t < err_at)
        .map(|(_, d)| *d)
        .collect();
    let after: Vec<Duration> = lat
        .iter()
        .filter(|(t, _)| *t >= err_at && *t < err_at + Duration::from_secs(1))
        .map(|(_, d)| *d)
        .collect();
    let worst = before.iter().max().copied().unwrap_or_default();
    eprintln!(
        "probe writes: {} before ERR (worst {worst:?}), {} in the second after ERR: p50 {:?}, p99 {:?}",
        before.len(),
        after.len(),
        percentile(&after, 50),
        percentile(&after, 99)
    );
    assert!(
        after.len() >= 10,
        "only {} probe writes in the second after ERR",
        after.len()
    );
    assert!(
        percentile(&after, 99) < Duration::from_secs(1),
        "writes still slow after the replica was dropped"
    );
    assert_clean_run("workload across the hang", &report);
    assert_verified("after the hang", &dev, &model, Expect::Exact).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_sigstop_goes_err_within_timeout() -> anyhow::Result<()> {
    let seed = test_seed();
    let c = Cluster::start("sigstop", 256 * MIB)?;
    /// Resumes the frozen replica in every outcome.
    struct Cont<'a>(&'a zebu_tests::ReplicaProcess);
    impl Drop for Cont<'_> {
        fn drop(&mut self) {
            self.0.resume();
        }
    }
    let victim = c.replica(1);
    let _cont = Cont(victim);
    hang_replica_and_check(&c, seed, || victim.pause()).await?;
    victim.resume();
    // A replica that comes back from a hang stays ERR for this connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let info = c.engine().info().await?;
    assert_eq!(mode_in(&info, &c.addr(1)), "ERR", "{info:?}");
    Ok(())
}

/// An iptables rule that is removed again in every outcome.
struct DropRule {
    args: Vec<String>,
}

impl DropRule {
    /// Drops TCP traffic to `addr` (INPUT covers loopback). None if iptables is unusable.
    fn install(addr: std::net::SocketAddr) -> Option<DropRule> {
        let usable = std::process::Command::new("iptables")
            .args(["-L", "INPUT", "-n"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !usable {
            return None;
        }
        let args: Vec<String> = [
            "INPUT",
            "-d",
            &addr.ip().to_string(),
            "-p",
            "tcp",
            "--dport",
            &addr.port().to_string(),
            "-j",
            "DROP",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let ok = std::process::Command::new("iptables")
            .arg("-I")
            .args(&args)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(DropRule { args })
    }
}

impl Drop for DropRule {
    fn drop(&mut self) {
        let status = std::process::Command::new("iptables")
            .arg("-D")
            .args(&self.args)
            .status();
        if !status.is_ok_and(|s| s.success()) {
            eprintln!("WARNING: could not remove iptables rule {:?}", self.args);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn iptables_drop_goes_err_within_timeout() -> anyhow::Result<()> {
    let seed = test_seed();
    let c = Cluster::start("iptables", 256 * MIB)?;
    let victim = c.replica(1).addr;
    let mut rule = None;
    hang_replica_and_check(&c, seed, || rule = DropRule::install(victim))
        .await
        .or_else(|e| if rule.is_none() { Ok(()) } else { Err(e) })?;
    if rule.is_none() {
        eprintln!("SKIPPED: iptables is not usable here (needs root and the iptables command)");
    }
    drop(rule);
    Ok(())
}

/// A 64 MiB ext4 filesystem on a loop device, unmounted and detached in every outcome.
struct SmallFs {
    mount: std::path::PathBuf,
    loopdev: String,
}

impl SmallFs {
    fn create(dir: &std::path::Path) -> anyhow::Result<SmallFs> {
        use anyhow::Context;
        let run = |cmd: &str, args: &[&str]| -> anyhow::Result<String> {
            let out = std::process::Command::new(cmd).args(args).output()?;
            anyhow::ensure!(
                out.status.success(),
                "{cmd} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        let image = dir.join("small.img");
        std::fs::File::create(&image)?.set_len(64 * MIB)?;
        let img = image.to_str().context("utf-8 path")?;
        run("mkfs.ext4", &["-q", "-F", img])?;
        let loopdev = run("losetup", &["--find", "--show", img])?;
        let mount = dir.join("small");
        std::fs::create_dir_all(&mount)?;
        let fs = SmallFs {
            mount: mount.clone(),
            loopdev: loopdev.clone(),
        };
        run("mount", &[&loopdev, mount.to_str().context("utf-8 path")?])?;
        Ok(fs)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mount)
            .status();
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.loopdev])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_disk_replica_goes_err_volume_continues() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to mount a small filesystem");
        return Ok(());
    }
    let seed = test_seed();
    let mut c = Cluster::replicas_only("fulldisk", 256 * MIB)?;
    let fs = match SmallFs::create(c.tmp.path()) {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("SKIPPED: cannot make a loop-mounted ext4 here: {e}");
            return Ok(());
        }
    };
    // Replica 1 lives on the 64 MiB filesystem; the volume is 256 MiB.
    let dir = fs.mount.join("r2");
    c.restart_replica_in(1, &dir)?;
    c.dirs[1] = dir;
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    let cfg = zebu_testkit::workload::WorkloadConfig {
        range_len: Some(160 * MIB),
        pattern: zebu_testkit::workload::Pattern::Sequential,
        stop: zebu_testkit::workload::StopAfter::Ops(160 * MIB / 4096),
        read_percent: 5,
        seed,
        ..zebu_testkit::workload::WorkloadConfig::default()
    };
    let mut model = cfg.new_model(dev.size(), RunId::random())?;
    let report = zebu_testkit::workload::run_workload(&dev, &mut model, &cfg).await;
    let info = c.engine().info().await?;
    eprintln!(
        "after {} writes: {} {:?}",
        report.writes,
        info.state,
        info.replicas
            .iter()
            .map(|r| (&r.address, &r.mode, &r.reason))
            .collect::<Vec<_>>()
    );
    assert_clean_run("workload filling one replica's disk", &report);
    assert_eq!(mode_in(&info, &c.addr(1)), "ERR", "{info:?}\n{}", c.logs());
    assert_eq!(info.state, "degraded");
    assert_verified(
        "after one replica's disk filled",
        &dev,
        &model,
        Expect::Exact,
    )
    .await;
    dev.disconnect().await;
    // Stop everything on the small filesystem before it is unmounted.
    drop(c.engine.take());
    c.kill_replica(1);
    drop(fs);
    Ok(())
}
