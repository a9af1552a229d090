//! A volume's lifecycle through the `zebu-engine` CLI: snapshots (create, list, delete under
//! load, revert, purge), expand, replica removal and re-adding, and an engine restart in the
//! middle of a catch-up. Each test checks every replica's own view (its Info and its data),
//! not only what the engine reports.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::time::{Duration, Instant};

use bytes::Bytes;
use zebu_engine::blockdev::BlockDevice;
use zebu_testkit::workload::{self, Expect, Model, RunId, StopAfter, WorkloadConfig};
use zebu_tests::engine::{
    Background, Cluster, Fingerprint, assert_clean_run, assert_verified, busy_workload, chain_of,
    fill, mode_in, replica_info,
};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;

/// The snapshot chain of every running replica in `which`, by address.
async fn chains(c: &Cluster, which: &[usize]) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let mut out = Vec::new();
    for &i in which {
        out.push((c.addr(i), chain_of(&replica_info(c.replica(i).addr).await?)));
    }
    Ok(out)
}

/// Asserts the replicas in `which` are identical (nothing may write meanwhile).
async fn assert_identical(c: &Cluster, which: &[usize], what: &str) -> anyhow::Result<()> {
    let first = Fingerprint::of(c.replica(which[0]).addr).await?;
    for &i in &which[1..] {
        let d = first.diff(&Fingerprint::of(c.replica(i).addr).await?);
        assert!(
            d.is_empty(),
            "{what}: replica {} differs from {}: {d:#?}",
            c.addr(i),
            c.addr(which[0])
        );
    }
    Ok(())
}

/// Asserts a failed CLI run printed one clear line and exited non-zero; returns the line.
fn one_line_error(out: &std::process::Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(
        !out.status.success(),
        "{what}: the CLI succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "{what}: the error is not one line: {stderr:?}"
    );
    assert!(
        stderr.starts_with("zebu-engine: error: "),
        "{what}: unexpected error form: {stderr:?}"
    );
    eprintln!("{what}: {stderr}");
    stderr
}

/// Random 4 KiB writes over `[start, start+len)`, flushed at the end, recorded in `model`.
async fn write_random(
    dev: &impl BlockDevice,
    model: &mut Model,
    start: u64,
    len: u64,
    ops: u64,
    seed: u64,
) {
    let cfg = WorkloadConfig {
        range_start: start,
        range_len: Some(len),
        stop: StopAfter::Ops(ops),
        read_percent: 0,
        seed,
        ..WorkloadConfig::default()
    };
    let r = workload::run_workload(dev, model, &cfg).await;
    assert_clean_run(&format!("random writes on {start}+{len}"), &r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshot_create_list_delete_revert_through_engine() -> anyhow::Result<()> {
    snapshot_lifecycle("snaps", true).await
}

/// The same, with the snapshot deleted while the workload is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshot_create_list_delete_idle_revert_purge() -> anyhow::Result<()> {
    snapshot_lifecycle("snaps-idle", false).await
}

/// Snapshots s1 and s2 under a running workload, `snapshot ls`, delete s1 (under load if
/// `rm_under_load`), revert to s2, purge the rebuild's system snapshot; checks every
/// replica's chain and data at each step.
async fn snapshot_lifecycle(name: &str, rm_under_load: bool) -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start(name, 256 * MIB)?;
    let all = [0, 1, 2];

    // A full rebuild of replica 3 leaves a system snapshot on every replica, for purge.
    let r3 = c.addr(2);
    c.engine().cli(&["replica", "rm", &r3]).await?;
    let dev = c.engine().nbd_client().await?;
    let (base, _) = fill(&dev, 192 * MIB, 16 * MIB, seed).await?;
    let fresh = c.tmp.path().join("r3-fresh");
    c.restart_replica_in(2, &fresh)?;
    c.dirs[2] = fresh;
    c.engine().cli(&["replica", "add", &r3]).await?;
    c.engine()
        .wait_rebuilt(&r3, Duration::from_secs(60))
        .await?;
    let system = chain_of(&replica_info(c.replica(0).addr).await?);
    assert_eq!(system.len(), 1, "one rebuild snapshot expected: {system:?}");
    assert!(system[0].starts_with("rebuild-"), "{system:?}");

    // The verified workload runs on [0, 128 MiB) through all snapshot operations but revert.
    let mut cfg = busy_workload(seed);
    cfg.range_len = Some(128 * MIB);
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(c.engine().nbd_client().await?, model, cfg);
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.engine().cli(&["snapshot", "create", "s1"]).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // [128, 192 MiB) holds a known state when s2 is taken, and a different one after.
    let (b0, b1) = (128 * MIB, 64 * MIB);
    let mut known = Model::new(RunId::random(), 4096, b0 / 4096, b1 / 4096);
    write_random(&dev, &mut known, b0, b1, 3000, seed ^ 1).await;
    let at_s2 = known.clone();
    c.engine().cli(&["snapshot", "create", "s2"]).await?;
    write_random(&dev, &mut known, b0, b1, 3000, seed ^ 2).await;
    assert_ne!(known, at_s2, "the writes after s2 changed nothing");

    let listed = c.engine().cli(&["snapshot", "ls"]).await?;
    let names: Vec<&str> = listed
        .as_array()
        .expect("snapshot ls --json prints an array")
        .iter()
        .filter(|s| s["head"] != true)
        .filter_map(|s| s["name"].as_str())
        .collect();
    eprintln!("snapshot ls: {names:?}");
    for want in [system[0].as_str(), "s1", "s2"] {
        assert!(names.contains(&want), "snapshot ls lacks {want}: {listed}");
    }
    let expect = vec![system[0].clone(), "s1".to_string(), "s2".to_string()];
    for (addr, chain) in chains(&c, &all).await? {
        assert_eq!(chain, expect, "chain of replica {addr}");
    }

    // Delete (merge) s1, while the workload runs if asked.
    let t = Instant::now();
    let (model, report, bg_dev) = if rm_under_load {
        c.engine().cli(&["snapshot", "rm", "s1"]).await?;
        eprintln!("snapshot rm s1 under load took {:?}", t.elapsed());
        tokio::time::sleep(Duration::from_secs(1)).await;
        bg.stop().await?
    } else {
        let stopped = bg.stop().await?;
        c.engine().cli(&["snapshot", "rm", "s1"]).await?;
        eprintln!("snapshot rm s1 (idle) took {:?}", t.elapsed());
        stopped
    };
    assert_clean_run("workload across snapshot create and delete", &report);
    assert!(report.writes > 500, "too few writes: {report:?}");
    let expect = vec![system[0].clone(), "s2".to_string()];
    for (addr, chain) in chains(&c, &all).await? {
        assert_eq!(chain, expect, "chain of replica {addr} after rm s1");
    }
    assert_verified("workload after rm s1", &bg_dev, &model, Expect::Exact).await;
    assert_verified("known range before revert", &dev, &known, Expect::Exact).await;
    assert_verified("rebuilt range", &dev, &base, Expect::Exact).await;
    bg_dev.disconnect().await;
    dev.disconnect().await;

    // Revert to s2 with the frontend idle: the known range holds its state at s2 again.
    c.engine().cli(&["snapshot", "revert", "s2"]).await?;
    let dev = c.engine().nbd_client().await?;
    assert_verified("known range after revert", &dev, &at_s2, Expect::Exact).await;
    assert_verified("rebuilt range after revert", &dev, &base, Expect::Exact).await;
    for (addr, chain) in chains(&c, &all).await? {
        assert_eq!(chain, expect, "chain of replica {addr} after revert");
    }
    assert_identical(&c, &all, "after revert").await?;

    // Purge removes the rebuild's system snapshot and keeps the data.
    c.engine().cli(&["snapshot", "purge"]).await?;
    for (addr, chain) in chains(&c, &all).await? {
        assert_eq!(
            chain,
            vec!["s2".to_string()],
            "chain of replica {addr} after purge"
        );
    }
    assert_verified("known range after purge", &dev, &at_s2, Expect::Exact).await;
    assert_verified("rebuilt range after purge", &dev, &base, Expect::Exact).await;
    dev.disconnect().await;
    assert_identical(&c, &all, "after purge").await?;
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");
    Ok(())
}

/// Expands a 64 MiB volume to 128 MiB and checks every replica took the new size.
async fn expanded_cluster(name: &str) -> anyhow::Result<(Cluster, Model)> {
    let seed = test_seed();
    let c = Cluster::start(name, OLD)?;
    let dev = c.engine().nbd_client().await?;
    let (low, _) = fill(&dev, 0, OLD, seed).await?;
    assert!(
        dev.write(OLD, Bytes::from(vec![1u8; 4096])).await.is_err(),
        "a write past the end succeeded before the expand"
    );
    dev.disconnect().await;

    let info = c.engine().cli(&["expand", &NEW.to_string()]).await?;
    assert_eq!(info["size"], NEW, "{info}");
    assert_eq!(c.engine().info().await?.size, NEW);
    for i in 0..3 {
        let r = replica_info(c.replica(i).addr).await?;
        assert_eq!(r.size, NEW, "replica {} size", c.addr(i));
    }
    let shrink = c.engine().cli_raw(&["expand", &OLD.to_string()]).await?;
    one_line_error(&shrink, "shrinking");
    Ok((c, low))
}

const OLD: u64 = 64 * MIB;
const NEW: u64 = 2 * OLD;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expand_grows_every_replica() -> anyhow::Result<()> {
    let seed = test_seed();
    let (mut c, low) = expanded_cluster("expand").await?;
    // The NBD frontend learns the new size at an engine restart (see
    // `expand_is_visible_to_new_nbd_connections`).
    c.engine_mut().terminate(Duration::from_secs(30))?;
    c.cfg.size = NEW;
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    assert_eq!(dev.size(), NEW);
    let (high, _) = fill(&dev, OLD, OLD, seed ^ 1).await?;
    // Random 4 KiB writes just below and just past the old end.
    let mut below = Model::new(
        RunId::random(),
        4096,
        (OLD - 8 * MIB) / 4096,
        4 * MIB / 4096,
    );
    let mut past = Model::new(RunId::random(), 4096, OLD / 4096, 4 * MIB / 4096);
    write_random(&dev, &mut below, OLD - 8 * MIB, 4 * MIB, 500, seed ^ 2).await;
    write_random(&dev, &mut past, OLD, 4 * MIB, 500, seed ^ 3).await;
    dev.disconnect().await;

    // Restart everything at the new size; every replica must hold the same data. The
    // replicas stop cleanly: one killed within 50 ms of the engine's last flush has not yet
    // recorded that flush (its checksums' fdatasync runs in the background, and until then
    // the flush's regions stay dirty on disk), so it would come back with a lower flush
    // number than the others until an engine reconciles them (`replica/src/store/sumsync.rs`),
    // and this test is about expand, not crashes (those are in engine_crash.rs).
    c.engine_mut().terminate(Duration::from_secs(30))?;
    c.size = NEW;
    for i in 0..3 {
        c.stop_replica(i)?;
        c.restart_replica(i)?;
    }
    for i in 0..3 {
        let r = replica_info(c.replica(i).addr).await?;
        assert_eq!(r.size, NEW, "replica {} size after restart", c.addr(i));
    }
    assert_identical(&c, &[0, 1, 2], "after the expand").await?;
    c.start_engine()?;
    let dev = c.engine().nbd_client().await?;
    assert_eq!(dev.size(), NEW);
    // The random writes overwrote parts of `low` and `high`: those parts are checked
    // against `below` and `past` only.
    let mut low_rest = low.clone();
    low_rest.block_count = (OLD - 8 * MIB) / MIB;
    let mut high_rest = high.clone();
    high_rest.first_block += 4;
    high_rest.block_count -= 4;
    assert_verified("below the old end", &dev, &low_rest, Expect::Exact).await;
    for (what, m) in [("below", &below), ("past", &past)] {
        // Untouched blocks of these ranges hold the sequential fill.
        let r = workload::verify(&dev, m, Expect::Exact, workload::Scope::Touched, 32).await;
        assert!(
            r.passed() && r.checked > 0,
            "random writes {what} the old end: {} checked, wrong {:?}, errors {:?}",
            r.checked,
            r.wrong
                .iter()
                .take(5)
                .map(|w| w.to_string())
                .collect::<Vec<_>>(),
            r.io_errors
        );
    }
    assert_verified("past the old end", &dev, &high_rest, Expect::Exact).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expand_is_visible_to_new_nbd_connections() -> anyhow::Result<()> {
    let seed = test_seed();
    let (c, _) = expanded_cluster("expand-nbd").await?;
    let dev = c.engine().nbd_client().await?;
    assert_eq!(dev.size(), NEW, "a new NBD connection sees the old size");
    let (past, _) = fill(&dev, OLD, OLD, seed).await?;
    assert_verified("past the old end", &dev, &past, Expect::Exact).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn remove_last_rw_replica_is_refused() -> anyhow::Result<()> {
    let seed = test_seed();
    let c = Cluster::start("rm-last", 64 * MIB)?;
    let e = c.engine();
    let unknown = e.cli_raw(&["replica", "rm", "127.0.0.11:1"]).await?;
    let msg = one_line_error(&unknown, "removing a replica that is not a member");
    assert!(
        msg.contains("127.0.0.11:1") && msg.contains("not part of"),
        "{msg}"
    );

    e.cli(&["replica", "rm", &c.addr(0)]).await?;
    e.cli(&["replica", "rm", &c.addr(1)]).await?;
    let last = e.cli_raw(&["replica", "rm", &c.addr(2)]).await?;
    let msg = one_line_error(&last, "removing the last RW replica");
    assert!(
        msg.contains(&c.addr(2)) && msg.contains("last RW replica"),
        "{msg}"
    );
    let info = e.info().await?;
    assert_eq!(info.replicas.len(), 1, "{info:?}");
    assert_eq!(mode_in(&info, &c.addr(2)), "RW", "{info:?}");
    assert_eq!(info.members.len(), 1, "{info:?}");

    // The volume still serves from the last replica.
    let dev = e.nbd_client().await?;
    let (m, _) = fill(&dev, 0, 16 * MIB, seed).await?;
    assert_verified("on the last replica", &dev, &m, Expect::Exact).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_rm_then_add_back() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start("rm-add", 128 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let (before, _) = fill(&dev, 0, 32 * MIB, seed).await?;

    let r2 = c.addr(1);
    let listed = c.engine().cli(&["replica", "rm", &r2]).await?;
    let addrs: Vec<&str> = listed
        .as_array()
        .expect("replica rm --json prints the replicas")
        .iter()
        .filter_map(|r| r["address"].as_str())
        .collect();
    assert!(!addrs.contains(&r2.as_str()), "{listed}");
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");
    assert_eq!(info.members.len(), 2, "{info:?}");
    let again = c.engine().cli_raw(&["replica", "rm", &r2]).await?;
    one_line_error(&again, "removing it twice");

    // Written while the replica is out.
    let (during, _) = fill(&dev, 32 * MIB, 32 * MIB, seed ^ 1).await?;
    let bad = c
        .engine()
        .cli_raw(&["replica", "add", "not-an-address"])
        .await?;
    one_line_error(&bad, "adding a malformed address");

    c.engine().cli(&["replica", "add", &r2]).await?;
    let status = c
        .engine()
        .wait_rebuilt(&r2, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!("re-added: {status:?}");
    assert_eq!(status.kind, "catch-up", "{status:?}");
    assert!(
        status.bytes_copied >= 32 * MIB && status.bytes_copied <= 64 * MIB,
        "catch-up copied {} bytes for 32 MiB written while the replica was out",
        status.bytes_copied
    );
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");
    assert_eq!(info.members.len(), 3, "{info:?}");

    assert_verified("written before rm", &dev, &before, Expect::Exact).await;
    assert_verified("written while out", &dev, &during, Expect::Exact).await;
    dev.disconnect().await;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    assert_identical(&c, &[0, 1, 2], "after rm and add back").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_add_of_an_rw_replica_is_refused() -> anyhow::Result<()> {
    let c = Cluster::start("add-dup", 64 * MIB)?;
    let r2 = c.addr(1);
    let dup = c.engine().cli_raw(&["replica", "add", &r2]).await?;
    let status = c
        .engine()
        .wait_rebuild(Duration::from_secs(10), |s| s.state != "running")
        .await?;
    eprintln!("rebuild status after adding a member: {status:?}");
    let msg = one_line_error(&dup, "adding a replica that is RW");
    assert!(msg.contains(&r2) && msg.contains("already"), "{msg}");
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_restart_during_catch_up_then_completes() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::start("restart-catchup", 512 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let (before, _) = fill(&dev, 384 * MIB, 64 * MIB, seed).await?;

    let r2 = c.addr(1);
    c.kill_replica(1);
    let written = 256 * MIB;
    let (during, _) = fill(&dev, 0, written, seed ^ 1).await?;
    dev.disconnect().await;
    c.restart_replica(1)?;

    c.engine().cli(&["replica", "add", &r2]).await?;
    let first = c
        .engine()
        .wait_rebuild(Duration::from_secs(30), |s| {
            s.replica == r2 && (s.state != "running" || s.bytes_copied > 0)
        })
        .await?;
    assert!(
        first.state == "running"
            && first.kind == "catch-up"
            && first.bytes_done < first.bytes_total,
        "the catch-up was not caught running: {first:?}"
    );
    c.engine_mut().kill9();
    eprintln!("engine killed during the catch-up at {first:?}");

    // The restarted engine finds replica 2 stale and catches it up by itself.
    let t = Instant::now();
    c.start_engine()?;
    let status = c
        .engine()
        .wait_rebuilt(&r2, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    eprintln!("after restart: caught up in {:?}: {status:?}", t.elapsed());
    assert_eq!(status.kind, "catch-up", "not caught up but {status:?}");
    assert!(
        status.bytes_copied < written,
        "the second catch-up copied {} bytes: all {written} again, though {} were copied before \
         the restart",
        status.bytes_copied,
        first.bytes_copied
    );
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");

    let dev = c.engine().nbd_client().await?;
    assert_verified("written before the outage", &dev, &before, Expect::Exact).await;
    assert_verified("written during the outage", &dev, &during, Expect::Exact).await;
    dev.disconnect().await;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    assert_identical(&c, &[0, 1, 2], "after the interrupted catch-up").await
}
