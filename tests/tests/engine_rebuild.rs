//! Bringing replicas back: a full rebuild under load leaves every replica identical, and a
//! short outage is repaired by a catch-up that copies only what changed.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::time::{Duration, Instant};

use zebu_engine::blockdev::BlockDevice;
use zebu_testkit::workload::{self, Expect, Pattern, RunId, StopAfter, WorkloadConfig};
use zebu_tests::engine::{
    Background, Cluster, Fingerprint, assert_clean_run, assert_verified, busy_workload, mode_in,
};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebuild_under_load_makes_replicas_identical() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start("rebuild", 256 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let cfg = busy_workload(seed);
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(dev, model, cfg);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let addr = c.addr(1);
    c.kill_replica(1);
    c.engine()
        .wait_until(Duration::from_secs(3), |i| mode_in(i, &addr) == "ERR")
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // A fresh, empty replica where the dead one was.
    let fresh = c.tmp.path().join("r2-fresh");
    c.restart_replica_in(1, &fresh)?;
    c.dirs[1] = fresh;
    let added = c.engine().cli(&["replica", "add", &addr]).await?;
    eprintln!("replica add: {added}");
    let started = Instant::now();
    let status = c
        .engine()
        .wait_rebuilt(&addr, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!("rebuild done in {:?}: {status:?}", started.elapsed());
    assert_eq!(status.kind, "full", "{status:?}");
    assert!(!bg.is_finished(), "the workload stopped during the rebuild");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (model, report, dev) = bg.stop().await?;
    assert_clean_run("workload across kill and rebuild", &report);
    dev.disconnect().await;
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");

    let status = c.engine_mut().terminate(Duration::from_secs(30))?;
    assert!(status.success(), "engine exit on SIGTERM: {status}");
    let mut prints = Vec::new();
    for i in 0..3 {
        prints.push(Fingerprint::of(c.replica(i).addr).await?);
    }
    eprintln!("layers: {:?}", prints[0].layers);
    for i in 1..3 {
        let d = prints[0].diff(&prints[i]);
        assert!(
            d.is_empty(),
            "replica {} differs from replica {}: {d:#?}",
            c.addr(i),
            c.addr(0)
        );
    }

    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    assert_verified(
        "after the rebuild and an engine restart",
        &dev,
        &model,
        Expect::Exact,
    )
    .await;
    Ok(())
}

/// Writes before an outage of replica 1, `outage_cfg` during it, brings the replica back on
/// its old directory, and checks the catch-up copied at most twice what was written.
async fn outage_and_catch_up(name: &str, outage_cfg: WorkloadConfig) -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start(name, 256 * MIB)?;
    let dev = c.engine().nbd_client().await?;

    // Before: data on the lower half, all replicas in sync.
    let before_cfg = WorkloadConfig {
        range_len: Some(128 * MIB),
        stop: StopAfter::Ops(3000),
        seed,
        ..WorkloadConfig::default()
    };
    let mut before = before_cfg.new_model(dev.size(), RunId::random())?;
    let r = workload::run_workload(&dev, &mut before, &before_cfg).await;
    assert_clean_run("before the outage", &r);

    let addr = c.addr(1);
    c.kill_replica(1);
    let outage_started = Instant::now();
    let mut during = outage_cfg.new_model(dev.size(), RunId::random())?;
    let r = workload::run_workload(&dev, &mut during, &outage_cfg).await;
    assert_clean_run("during the outage", &r);
    let written = during.touched_blocks().count() as u64 * during.block_size;
    // Keep the replica away for about 10 s in all.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(outage_started.elapsed())).await;
    let info = c.engine().info().await?;
    assert_eq!(mode_in(&info, &addr), "ERR", "{info:?}");

    c.restart_replica(1)?;
    c.engine().cli(&["replica", "add", &addr]).await?;
    let status = c
        .engine()
        .wait_rebuilt(&addr, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!(
        "{name}: outage of {:?}: wrote {written} bytes ({} writes, {:.2}% of the volume); \
         catch-up: kind {}, bytesDone {}, bytesTotal {}, bytesCopied {} ({:.2}x written)",
        outage_started.elapsed(),
        r.writes,
        100.0 * written as f64 / c.size as f64,
        status.kind,
        status.bytes_done,
        status.bytes_total,
        status.bytes_copied,
        status.bytes_copied as f64 / written as f64
    );
    assert_eq!(status.kind, "catch-up", "{status:?}");
    assert!(
        status.bytes_copied <= 2 * written,
        "catch-up copied {} bytes for {written} bytes written during the outage",
        status.bytes_copied
    );
    assert!(
        status.bytes_copied >= written / 2,
        "catch-up copied only {} bytes for {written} bytes written: the replica cannot be current",
        status.bytes_copied
    );
    assert_verified("lower half", &dev, &before, Expect::Exact).await;
    assert_verified("written during the outage", &dev, &during, Expect::Exact).await;

    // The caught-up replica must hold the same data as the others.
    dev.disconnect().await;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    let a = Fingerprint::of(c.replica(0).addr).await?;
    let b = Fingerprint::of(c.replica(1).addr).await?;
    let d = a.diff(&b);
    assert!(d.is_empty(), "caught-up replica differs: {d:#?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_outage_catch_up_copies_only_what_changed() -> anyhow::Result<()> {
    // About 1 % of the volume as one sequential run in the upper half.
    let blocks = (256 * MIB / 100) / 4096;
    let cfg = WorkloadConfig {
        range_start: 160 * MIB,
        range_len: Some(blocks * 4096),
        pattern: Pattern::Sequential,
        stop: StopAfter::Ops(blocks),
        read_percent: 0,
        seed: 7,
        ..WorkloadConfig::default()
    };
    outage_and_catch_up("catchup-seq", cfg).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_outage_catch_up_random_4k() -> anyhow::Result<()> {
    // About 1 % of the volume as random 4 KiB writes over the upper half.
    let blocks = (256 * MIB / 100) / 4096;
    let cfg = WorkloadConfig {
        range_start: 128 * MIB,
        range_len: Some(128 * MIB),
        pattern: Pattern::Random,
        stop: StopAfter::Ops(blocks),
        read_percent: 0,
        seed: 11,
        ..WorkloadConfig::default()
    };
    outage_and_catch_up("catchup-rand", cfg).await
}
