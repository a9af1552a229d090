//! Engine crashes and power cuts: after `kill -9` of the engine (or of every process at
//! once) and a restart on the same directories, every write acknowledged before a
//! completed flush reads back, and unflushed blocks hold their old or new content only.
//! A stale replica is never a source: the engine refuses to start from it alone, and when
//! it starts with the current replicas the stale one serves no read until it is caught up.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use zebu_engine::blockdev::BlockDevice;
use zebu_testkit::workload::{self, Expect, RunId, StopAfter, WorkloadConfig};
use zebu_tests::engine::{
    Background, Cluster, Fingerprint, assert_clean_run, assert_verified, busy_workload, mode_in,
};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;

/// Runs the workload, lets `crash` kill processes mid-run, restarts what `crash` stopped (via
/// `restart`), and checks the volume with after-crash semantics.
async fn crash_and_verify(
    name: &str,
    crash: impl FnOnce(&mut Cluster),
    restart: impl FnOnce(&mut Cluster) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start(name, 256 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let mut cfg = busy_workload(seed);
    cfg.final_flush = false;
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(dev, model, cfg);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!bg.is_finished(), "the workload stopped before the crash");
    crash(&mut c);
    let (model, report, _dev) = bg.stop().await?;
    eprintln!(
        "{name}: {} writes, {} flushes before the crash; {} I/O errors at the crash (expected)",
        report.writes,
        report.flushes,
        report.io_errors.len()
    );
    assert!(
        report.bad_reads.is_empty(),
        "wrong reads before the crash: {:?}",
        report.bad_reads
    );
    assert!(
        report.flushes > 0,
        "no flush completed: the test proves nothing"
    );
    restart(&mut c)?;
    let started = Instant::now();
    c.start_engine()
        .map_err(|e| anyhow::anyhow!("engine restart: {e}"))?;
    eprintln!("{name}: engine restarted in {:?}", started.elapsed());
    let info = c.engine().info().await?;
    eprintln!(
        "{name}: after restart: {} epoch {} {:?}",
        info.state,
        info.epoch,
        info.replicas
            .iter()
            .map(|r| (&r.address, &r.mode))
            .collect::<Vec<_>>()
    );
    assert_eq!(info.state, "healthy", "{info:?}");
    let dev = c.engine().nbd_client().await?;
    assert_verified(name, &dev, &model, Expect::AfterCrash).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_kill9_restart_salvages() -> anyhow::Result<()> {
    crash_and_verify("engine-kill9", |c| c.engine_mut().kill9(), |_| Ok(())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn power_cut_all_processes_restart() -> anyhow::Result<()> {
    crash_and_verify(
        "power-cut",
        |c| {
            // SIGKILL to every process before reaping any, so none outlives the others.
            let _ = kill(c.engine().pid(), Signal::SIGKILL);
            for i in 0..3 {
                let _ = kill(c.replica(i).pid(), Signal::SIGKILL);
            }
            c.engine_mut().kill9();
            for i in 0..3 {
                c.kill_replica(i);
            }
        },
        |c| {
            for i in 0..3 {
                c.restart_replica(i)?;
            }
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_replica_is_never_a_source() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start("stale", 256 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let cfg = WorkloadConfig {
        stop: StopAfter::Ops(3000),
        seed,
        ..WorkloadConfig::default()
    };
    let mut model = cfg.new_model(dev.size(), RunId::random())?;
    let r = workload::run_workload(&dev, &mut model, &cfg).await;
    assert_clean_run("all three replicas", &r);
    let ids: Vec<String> = c
        .engine()
        .info()
        .await?
        .replicas
        .iter()
        .map(|r| r.id.clone())
        .collect();
    let epoch_before = c.engine().info().await?.epoch;

    // B misses writes: they go to A and C in a new epoch.
    let b = c.addr(1);
    c.kill_replica(1);
    let cfg2 = WorkloadConfig {
        seed: seed ^ 1,
        ..cfg.clone()
    };
    let r = workload::run_workload(&dev, &mut model, &cfg2).await;
    assert_clean_run("A and C only", &r);
    let info = c.engine().info().await?;
    assert_eq!(mode_in(&info, &b), "ERR");
    assert!(info.epoch > epoch_before, "epoch did not advance: {info:?}");
    dev.disconnect().await;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    c.kill_replica(0);
    c.kill_replica(2);

    // Only B is reachable: the engine must refuse and name what it needs.
    c.restart_replica(1)?;
    let err = match c.start_engine() {
        Ok(_) => panic!(
            "the engine started from the stale replica alone:\n{}",
            c.logs()
        ),
        Err(e) => e.to_string(),
    };
    eprintln!(
        "refused as expected: {}",
        err.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
    );
    for i in [0, 2] {
        let addr = c.addr(i);
        assert!(
            err.contains(&addr) || err.contains(&ids[i]),
            "the refusal does not name missing member {addr} ({}): {err}",
            ids[i]
        );
    }

    // With A and C back, B is brought up to date and serves no read meanwhile.
    c.restart_replica(0)?;
    c.restart_replica(2)?;
    c.start_engine()?;
    let info = c.engine().info().await?;
    eprintln!(
        "after start: {:?}",
        info.replicas
            .iter()
            .map(|r| (&r.address, &r.mode, &r.reason))
            .collect::<Vec<_>>()
    );
    assert_ne!(
        mode_in(&info, &b),
        "RW",
        "the stale replica is RW at start: {info:?}"
    );
    // Read everything while B catches up: a read served by B would find old data.
    let dev = c.engine().nbd_client().await?;
    assert_verified(
        "while the stale replica catches up",
        &dev,
        &model,
        Expect::Exact,
    )
    .await;
    let (info, took) = c
        .engine()
        .wait_until(Duration::from_secs(60), |i| mode_in(i, &b) == "RW")
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!(
        "stale replica RW after {took:?}; rebuild: {:?}",
        c.engine().rebuild_status().await?
    );
    assert_eq!(info.state, "healthy");
    assert_verified("after the catch-up", &dev, &model, Expect::Exact).await;
    Ok(())
}

/// Issue 19's crash loop for the durable path: kill -9 of every replica and the engine at a
/// random moment while a flush-heavy verified workload runs (a flush after every 2 writes at
/// QD 16, so flushes overlap and share one another's replica flush: the engine's group
/// commit), round after round on the same directories. After each restart every flushed write
/// reads back, and the three replicas hold the same CRC32C for every block of the volume (no
/// two disagree after reconciliation). `ZEBU_CRASH_ROUNDS` sets the rounds (the issue asks for
/// at least 50; the default keeps CI short).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_of_everything_during_flush_heavy_writes_keeps_every_flushed_write()
-> anyhow::Result<()> {
    let config = |seed: u64| WorkloadConfig {
        queue_depth: 16,
        flush_every: Some(2),
        final_flush: false,
        ..busy_workload(seed)
    };
    let totals = kill9_rounds("flush-crash", config).await?;
    assert!(
        totals.shared > 0,
        "no flush was ever shared: the workload did not exercise group commit"
    );
    Ok(())
}

/// The same with half the writes sent with FUA and no flush at all: every FUA write
/// acknowledged before the kill reads back (the replicas took it with its flush in one
/// request), and the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_of_everything_during_fua_writes_keeps_every_fua_write() -> anyhow::Result<()> {
    let config = |seed: u64| WorkloadConfig {
        queue_depth: 16,
        flush_every: None,
        fua_percent: 50,
        final_flush: false,
        ..busy_workload(seed)
    };
    let totals = kill9_rounds("fua-crash", config).await?;
    assert!(totals.fua_writes > 0, "no FUA write was acknowledged");
    Ok(())
}

/// What [`kill9_rounds`] saw over all its rounds.
struct Totals {
    shared: u64,
    fua_writes: u64,
}

/// Rounds of: the workload `config` on the volume, `kill -9` of the engine and every replica
/// at a random moment, a restart, and the checks (every durable write reads back, the
/// replicas agree block for block). `ZEBU_CRASH_ROUNDS` sets the rounds (default 4).
async fn kill9_rounds(
    name: &str,
    config: impl Fn(u64) -> WorkloadConfig,
) -> anyhow::Result<Totals> {
    const SIZE: u64 = 64 * MIB;
    let rounds: usize = std::env::var("ZEBU_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let seed = test_seed();
    let mut c = Cluster::start(name, SIZE)?;
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut model = config(seed).new_model(SIZE, RunId::random())?;
    let mut totals = Totals {
        shared: 0,
        fua_writes: 0,
    };
    for round in 0..rounds {
        let dev = c.engine().nbd_client().await?;
        let bg = Background::spawn(dev, model, config(seed.wrapping_add(round as u64)));
        tokio::time::sleep(Duration::from_millis(400 + next() % 1200)).await;
        let counters = c.engine().info().await?.data_path.unwrap_or_default();
        totals.shared += counters.flushes_shared;
        // SIGKILL to every process before reaping any, so none outlives the others.
        let _ = kill(c.engine().pid(), Signal::SIGKILL);
        for i in 0..3 {
            let _ = kill(c.replica(i).pid(), Signal::SIGKILL);
        }
        c.engine_mut().kill9();
        for i in 0..3 {
            c.kill_replica(i);
        }
        let (mut m, report, _dev) = bg.stop().await?;
        totals.fua_writes += report.fua_writes;
        assert!(
            report.bad_reads.is_empty(),
            "round {round}: wrong reads before the crash: {:?}",
            report.bad_reads
        );
        for i in 0..3 {
            c.restart_replica(i)?;
        }
        c.start_engine()
            .map_err(|e| anyhow::anyhow!("round {round}: engine restart: {e}"))?;
        let info = c.engine().info().await?;
        assert_eq!(info.state, "healthy", "round {round}: {info:?}");
        let dev = c.engine().nbd_client().await?;
        let checked =
            assert_verified(&format!("round {round}"), &dev, &m, Expect::AfterCrash).await;
        for (block, found) in checked.found {
            m.settle(block, found);
        }
        model = m;
        // The engine is idle (this client writes nothing): the replicas must agree.
        let prints = [
            Fingerprint::of(c.addrs[0]).await?,
            Fingerprint::of(c.addrs[1]).await?,
            Fingerprint::of(c.addrs[2]).await?,
        ];
        for i in 1..3 {
            let differing: Vec<usize> = prints[0]
                .volume_crcs
                .iter()
                .zip(&prints[i].volume_crcs)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(b, _)| b)
                .take(10)
                .collect();
            assert!(
                differing.is_empty() && prints[0].volume_crcs.len() == prints[i].volume_crcs.len(),
                "round {round}: replicas 0 and {i} disagree on blocks {differing:?}"
            );
        }
        dev.disconnect().await;
        eprintln!(
            "{name} round {round}: {} writes ({} FUA), {} flushes before the kill ({} flushes \
             shared so far); every durable write read back, replicas agree",
            report.writes, report.fua_writes, report.flushes, counters.flushes_shared
        );
    }
    Ok(totals)
}
