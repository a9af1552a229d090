//! Replica faults under a verified workload through the engine's NBD frontend: a replica
//! that dies, hangs, loses its network or fills its disk is dropped (ERR) within the I/O
//! timeout, the workload sees no error, and every block reads back as acknowledged.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zebu_engine::blockdev::BlockDevice;
use zebu_engine::workload::{Expect, RunId};
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
    assert!(report.writes > 1000, "too few writes to mean anything: {report:?}");
    assert_verified("after kill -9 of one replica", &dev, &model, Expect::Exact).await;
    let t = Instant::now();
    let info = c.engine().info().await?;
    eprintln!("info took {:?}", t.elapsed());
    assert_eq!(info.state, "degraded");
    assert_eq!(mode_in(&info, &c.addr(0)), "RW");
    assert_eq!(mode_in(&info, &c.addr(2)), "RW");
    let t = Instant::now();
    drop(dev);
    eprintln!("dev drop took {:?}", t.elapsed());
    let t = Instant::now();
    drop(c);
    eprintln!("cluster drop took {:?}", t.elapsed());
    Ok(())
}
