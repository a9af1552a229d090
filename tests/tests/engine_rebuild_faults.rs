//! Faults during a full rebuild: the source replica dies mid-copy (another RW replica takes
//! over), or the target dies mid-copy (re-added, it resumes: layers it finished are not
//! copied again). Either way the rebuilt replica ends identical to the others.
//!
//! The volume holds 384 MiB in three layers (two user snapshots and the head), so the copy
//! takes long enough to be interrupted. Replica 3 is removed before the data is written and
//! comes back on a fresh directory, so its rebuild is a full one.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::time::{Duration, Instant};

use zebu_testkit::workload::{Expect, Model};
use zebu_tests::engine::{
    Cluster, Fingerprint, assert_verified, chain_of, fill, mode_in, replica_info,
};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;
/// Bytes written into each of the three layers.
const LAYER: u64 = 128 * MIB;
/// The replica that is rebuilt.
const TARGET: usize = 2;

/// A volume with data in snapshots `a` and `b` and in the head, written while replica 3 was
/// out; replica 3 is running again on a fresh directory, not yet added.
async fn layered_volume(name: &str) -> anyhow::Result<(Cluster, Vec<Model>)> {
    let seed = test_seed();
    let mut c = Cluster::start(name, 4 * LAYER)?;
    let target = c.addr(TARGET);
    c.engine().cli(&["replica", "rm", &target]).await?;
    c.kill_replica(TARGET);

    let dev = c.engine().nbd_client().await?;
    let started = Instant::now();
    let mut models = Vec::new();
    for (i, snap) in [Some("a"), Some("b"), None].into_iter().enumerate() {
        let (m, _) = fill(&dev, i as u64 * LAYER, LAYER, seed + i as u64).await?;
        models.push(m);
        if let Some(s) = snap {
            c.engine().cli(&["snapshot", "create", s]).await?;
        }
    }
    eprintln!(
        "{name}: wrote {} MiB in 3 layers in {:?}",
        3 * LAYER / MIB,
        started.elapsed()
    );
    dev.disconnect().await;

    let fresh = c.tmp.path().join("r3-fresh");
    c.restart_replica_in(TARGET, &fresh)?;
    c.dirs[TARGET] = fresh;
    Ok((c, models))
}

/// Reads every model back through the engine.
async fn verify_all(c: &Cluster, what: &str, models: &[Model]) -> anyhow::Result<()> {
    let started = Instant::now();
    let dev = c.engine().nbd_client().await?;
    for (i, m) in models.iter().enumerate() {
        assert_verified(&format!("{what}, layer {i}"), &dev, m, Expect::Exact).await;
    }
    dev.disconnect().await;
    eprintln!("{what}: verified in {:?}", started.elapsed());
    Ok(())
}

/// Stops the engine (so nothing writes) and asserts the listed replicas are identical.
async fn assert_identical(c: &mut Cluster, replicas: &[usize]) -> anyhow::Result<()> {
    let status = c.engine_mut().terminate(Duration::from_secs(30))?;
    assert!(status.success(), "engine exit on SIGTERM: {status}");
    let started = Instant::now();
    let first = Fingerprint::of(c.replica(replicas[0]).addr).await?;
    eprintln!("layers: {:?}", first.layers);
    for &i in &replicas[1..] {
        let other = Fingerprint::of(c.replica(i).addr).await?;
        let d = first.diff(&other);
        assert!(
            d.is_empty(),
            "replica {} differs from replica {}: {d:#?}",
            c.addr(i),
            c.addr(replicas[0])
        );
    }
    eprintln!(
        "{} replicas compared in {:?}",
        replicas.len(),
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebuild_resumes_after_source_replica_dies() -> anyhow::Result<()> {
    let (mut c, models) = layered_volume("rb-source-dies").await?;
    let target = c.addr(TARGET);
    let started = Instant::now();
    c.engine().cli(&["replica", "add", &target]).await?;
    // With no I/O in flight and no local replica, the engine reads from the first RW
    // replica it lists: replica 1. The reason it records below proves it was the source.
    let s = c
        .engine()
        .wait_rebuild(Duration::from_secs(30), |s| {
            s.replica == target && (s.state != "running" || s.bytes_copied > 0)
        })
        .await?;
    assert_eq!(
        s.state, "running",
        "the rebuild ended before the test could kill its source: {s:?}"
    );
    let source = c.addr(0);
    c.kill_replica(0);
    eprintln!("killed source {source} at {s:?}");

    let status = c
        .engine()
        .wait_rebuilt(&target, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!("rebuild done in {:?}: {status:?}", started.elapsed());
    assert_eq!(status.kind, "full", "{status:?}");
    let info = c.engine().info().await?;
    let dead = info
        .replicas
        .iter()
        .find(|r| r.address == source)
        .expect("the engine still lists the dead source");
    assert_eq!(dead.mode, "ERR", "{info:?}");
    assert!(
        dead.reason.contains("rebuild source"),
        "replica {source} was not dropped as the rebuild source (so the test killed the \
         wrong one): {dead:?}"
    );
    assert_eq!(mode_in(&info, &c.addr(1)), "RW", "{info:?}");
    assert_eq!(info.state, "degraded", "{info:?}");

    let t = replica_info(c.replica(TARGET).addr).await?;
    let unfinished: Vec<&String> = t
        .layers
        .iter()
        .filter(|l| l.incomplete)
        .map(|l| &l.name)
        .collect();
    assert!(
        unfinished.is_empty(),
        "layers still incomplete: {unfinished:?}"
    );
    verify_all(&c, "after the source died mid-rebuild", &models).await?;
    assert_identical(&mut c, &[1, TARGET]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebuild_target_killed_then_readded_resumes() -> anyhow::Result<()> {
    let (mut c, models) = layered_volume("rb-target-dies").await?;
    let target = c.addr(TARGET);
    c.engine().cli(&["replica", "add", &target]).await?;
    // Once at least one layer is done, and before the last is.
    let s = c
        .engine()
        .wait_rebuild(Duration::from_secs(30), |s| {
            s.replica == target && (s.state != "running" || s.bytes_done > 0)
        })
        .await?;
    assert!(
        s.state == "running" && s.bytes_done < s.bytes_total,
        "the rebuild ended before the test could kill its target: {s:?}"
    );
    c.kill_replica(TARGET);
    eprintln!("killed target {target} at {s:?}");
    let failed = c
        .engine()
        .wait_rebuild(Duration::from_secs(30), |s| s.state != "running")
        .await?;
    eprintln!("first rebuild: {failed:?}");
    assert_eq!(failed.state, "failed", "{failed:?}");
    assert_eq!(mode_in(&c.engine().info().await?, &target), "ERR");

    c.restart_replica(TARGET)?;
    let t = replica_info(c.replica(TARGET).addr).await?;
    let layers: Vec<(&str, bool, bool, u64)> = t
        .layers
        .iter()
        .map(|l| (l.name.as_str(), l.rebuilt, l.incomplete, l.data_bytes))
        .collect();
    eprintln!(
        "target after the restart: epoch {}, layers {layers:?}",
        t.epoch
    );
    assert_eq!(t.epoch, 0, "a half-rebuilt replica must not be a member");
    let finished: Vec<(String, u64)> = t
        .layers
        .iter()
        .filter(|l| l.rebuilt && !l.incomplete)
        .map(|l| (l.name.clone(), l.data_bytes))
        .collect();
    assert!(
        finished.iter().any(|(n, _)| n == "a"),
        "snapshot a was copied before the kill but is not reported rebuilt: {layers:?}"
    );
    let skipped: u64 = finished.iter().map(|(_, b)| b).sum();

    c.engine().cli(&["replica", "add", &target]).await?;
    let status = c
        .engine()
        .wait_rebuilt(&target, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!(
        "second rebuild: {status:?}; {} MiB were already there",
        skipped / MIB
    );
    assert_eq!(status.kind, "full", "{status:?}");
    assert!(
        status.bytes_copied + skipped <= status.bytes_total,
        "the second rebuild copied {} bytes of {}, though {skipped} were already rebuilt",
        status.bytes_copied,
        status.bytes_total
    );
    assert!(
        status.bytes_copied < 3 * LAYER,
        "the second rebuild copied everything again: {status:?}"
    );

    let t = replica_info(c.replica(TARGET).addr).await?;
    assert!(
        t.layers.iter().all(|l| !l.incomplete),
        "layers still incomplete after the rebuild: {:?}",
        t.layers
    );
    let src = replica_info(c.replica(0).addr).await?;
    assert_eq!(chain_of(&t), chain_of(&src), "snapshot chains differ");
    verify_all(&c, "after the target was re-added", &models).await?;
    assert_identical(&mut c, &[0, 1, TARGET]).await
}
