//! Refusals that do not fault a volume (issue 18, finding 3): a full replica disk, and an
//! expansion the replicas cannot hold.
//!
//! Before, a full disk failed every replica, faulted the volume and gave the client EIO, and
//! reads of data already written and TRIM (which would free space) failed with it; an
//! expansion to 16 TiB on ext4 failed the replicas ("File too large") and faulted the volume.
//! Now the client gets ENOSPC, no replica is failed by a refusal, reads and TRIM go on, and
//! writes succeed again once space is freed; the expansion is refused before any replica
//! changed.
//!
//! The replicas live on small tmpfs mounts made by the test (it needs root, as the rest of
//! the end-to-end suite does for iptables).
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use zebu_engine::blockdev::{BlockDevice, BlockError};
use zebu_tests::engine::{Cluster, EngineConfig, EngineProcess};
use zebu_tests::{ReplicaProcess, loopback};

const MIB: u64 = 1 << 20;

/// A tmpfs of a fixed size, unmounted when dropped.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(at: &Path, size: &str) -> anyhow::Result<SmallFs> {
        std::fs::create_dir_all(at)?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "zebu-test"])
            .arg(at)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "mount tmpfs at {}: {}",
            at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(SmallFs(at.to_path_buf()))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn fill(byte: u8, len: u64) -> Bytes {
    Bytes::from(vec![byte; len as usize])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_gives_enospc_keeps_reads_and_trim_and_recovers() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut mounts = Vec::new();
    let mut replicas = Vec::new();
    // A 64 MiB volume on 24 MiB disks: the disks fill long before the volume does.
    let size = 64 * MIB;
    for i in 0..3u8 {
        let dir = tmp.path().join(format!("disk{i}"));
        mounts.push(SmallFs::mount(&dir, "24m")?);
        replicas.push(ReplicaProcess::start(&dir, size, loopback(11 + i))?);
    }
    let addrs: Vec<_> = replicas.iter().map(|r| r.addr).collect();
    let cfg = EngineConfig::new("vol-full", size, &addrs);
    let engine_log = tmp.path().join("engine.log");
    let mut engine = EngineProcess::start(&cfg, &engine_log)?;
    let mut dev = engine.nbd_client().await?;

    let mut at = 0;
    let full = loop {
        anyhow::ensure!(at < size, "a 64 MiB volume fit on 24 MiB disks");
        match dev.write(at, fill(0x11 + (at / MIB) as u8, MIB)).await {
            Ok(()) => at += MIB,
            Err(e) => break e,
        }
    };
    eprintln!("disk full after {} MiB: {full}", at / MIB);
    assert!(
        matches!(full, BlockError::NoSpace(_)),
        "a full disk must be ENOSPC to the client, not {full:?}\n{}",
        engine.log()
    );
    let info = engine.info().await?;
    assert_ne!(info.state, "faulted", "{info:?}\n{}", engine.log());
    let modes: Vec<_> = info
        .replicas
        .iter()
        .map(|r| (&r.address, &r.mode))
        .collect();
    eprintln!("modes after ENOSPC: {modes:?}");

    // Reads of what was written, then TRIM to free space.
    for m in 0..at / MIB {
        let got = dev.read(m * MIB, MIB).await?;
        assert!(
            got.iter().all(|&b| b == 0x11 + m as u8),
            "MiB {m} after the disk filled"
        );
    }
    // The write that failed went part way on each replica (about 900 KiB of its MiB fit):
    // every block of it reads as before (zeros) or as the new bytes, never as an error, now
    // and after every replica restarts with that range's regions flushed clean. Before, the
    // blocks that took the new bytes stayed in the head file with no checksum of theirs and
    // held the last free space: the flush that followed failed with EIO.
    let failed = fill(0x11 + (at / MIB) as u8, MIB);
    assert_old_or_new(&dev, at, &failed, "the failed write's range").await;
    dev.flush().await?;
    dev.disconnect().await;
    engine.terminate(Duration::from_secs(30))?;
    for (r, dir) in replicas.iter_mut().zip(0..3u8) {
        let addr = r.addr;
        r.terminate(Duration::from_secs(30))?;
        let dir = tmp.path().join(format!("disk{dir}"));
        // The port may linger for a moment after the exit; retry the bind briefly.
        let mut tries = 0;
        *r = loop {
            match ReplicaProcess::start_at(&dir, size, addr, &[]) {
                Ok(started) => break started,
                Err(e) if tries >= 50 => return Err(e),
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
    }
    engine = EngineProcess::start(&cfg, &engine_log)?;
    dev = engine.nbd_client().await?;
    assert_old_or_new(
        &dev,
        at,
        &failed,
        "the failed write's range, after a restart",
    )
    .await;

    dev.unmap(0, 12 * MIB).await?;
    dev.flush().await?;
    // Space is back: the write that failed goes through now, and reads back.
    dev.write(at, fill(0x77, MIB)).await?;
    dev.flush().await?;
    assert!(dev.read(at, MIB).await?.iter().all(|&b| b == 0x77));
    assert!(dev.read(0, MIB).await?.iter().all(|&b| b == 0));
    let info = engine.info().await?;
    assert_ne!(info.state, "faulted", "{info:?}");
    dev.disconnect().await;
    drop(engine);
    drop(replicas);
    Ok(())
}

/// Reads `new.len()` bytes at `at` and asserts every 4 KiB block is all zeros (as before a
/// write that failed) or the block of `new` there.
async fn assert_old_or_new(dev: &impl BlockDevice, at: u64, new: &[u8], what: &str) {
    let got = match dev.read(at, new.len() as u64).await {
        Ok(got) => got,
        Err(e) => panic!("{what}: the read failed: {e:?}"),
    };
    let (mut old, mut took) = (0, 0);
    for (i, (g, n)) in got.chunks(4096).zip(new.chunks(4096)).enumerate() {
        if g.iter().all(|&b| b == 0) {
            old += 1;
        } else {
            assert_eq!(
                g, n,
                "{what}: block {i} is neither its old nor its new bytes"
            );
            took += 1;
        }
    }
    eprintln!("{what}: {old} blocks read as before the write, {took} as the new bytes");
}

/// An expansion beyond what the replicas' filesystem can hold (ext4 and tmpfs take files up
/// to 16 TiB - 4 KiB at most, or less): refused, no replica failed or changed size.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expansion_the_replicas_cannot_hold_is_refused_before_any_changes() -> anyhow::Result<()>
{
    let c = Cluster::start("vol-expand", 64 * MIB)?;
    // 32 TiB: within what the region record allows, beyond ext4's largest file (the
    // replicas' probe file shows it); 4 EiB: beyond the region record.
    for huge in [32u64 << 40, 1 << 62] {
        let r = c.engine().cli(&["expand", &huge.to_string()]).await;
        let err = format!(
            "{:#}",
            r.expect_err("an expansion beyond the disk was accepted")
        );
        assert!(err.contains("cannot"), "{err}");
    }
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}\n{}", c.logs());
    assert_eq!(info.size, 64 * MIB);
    for i in 0..3 {
        let ri = zebu_tests::connect(c.replica(i).addr)
            .await?
            .info(zebu_proto::replica::InfoRequest {})
            .await?
            .into_inner();
        assert_eq!(ri.size, 64 * MIB, "replica {i} changed size");
    }
    // A plausible expansion still works.
    c.engine()
        .cli(&["expand", &(128 * MIB).to_string()])
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(c.engine().info().await?.size, 128 * MIB);
    Ok(())
}
