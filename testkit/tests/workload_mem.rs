//! The verified workload against in-process devices: clean runs pass, and every kind of
//! damage a replicated store can do (corruption, stale data, lost flushed writes, torn or
//! misdirected blocks) is reported with the right block.

use std::sync::Mutex;

use bytes::Bytes;
use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture, MemDevice};
use zebu_testkit::workload::{
    self, BlockIndex, Expect, Model, Pattern, RunId, Scope, StopAfter, WorkloadConfig,
};

const MIB: u64 = 1 << 20;

fn config(ops: u64) -> WorkloadConfig {
    WorkloadConfig {
        stop: StopAfter::Ops(ops),
        queue_depth: 16,
        read_percent: 20,
        unmap_percent: 5,
        flush_every: Some(50),
        ..WorkloadConfig::default()
    }
}

#[tokio::test]
async fn clean_run_over_mem_device_has_no_errors_and_verifies() {
    let dev = MemDevice::new(4 * MIB);
    let cfg = config(5000);
    let mut model = cfg.new_model(dev.size(), RunId(1)).expect("valid config");
    let report = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(report.io_errors.is_empty(), "{:?}", report.io_errors);
    assert!(report.bad_reads.is_empty(), "{:?}", report.bad_reads);
    assert_eq!(report.ops(), 5000);
    assert!(report.reads > 500 && report.unmaps > 100 && report.flushes >= 80);

    for expect in [Expect::Exact, Expect::AfterCrash] {
        let check = workload::verify(&dev, &model, expect, Scope::Range, 8).await;
        assert!(check.passed(), "{expect:?}: {:?}", check.wrong);
        assert_eq!(check.checked, 1024);
    }
}

#[tokio::test]
async fn block_corrupted_behind_the_drivers_back_is_reported_with_its_number() {
    let dev = MemDevice::new(MIB);
    let cfg = config(2000);
    let mut model = cfg.new_model(dev.size(), RunId(2)).expect("valid config");
    let report = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(report.io_errors.is_empty() && report.bad_reads.is_empty());

    // Flip one byte deep inside the payload of block 77, and scribble on untouched-looking
    // block 200 too: both must be named, nothing else.
    let mut b77 = dev.read(77 * 4096, 4096).await.expect("read").to_vec();
    b77[3000] ^= 0x40;
    dev.write(77 * 4096, Bytes::from(b77)).await.expect("write");
    dev.write(200 * 4096, Bytes::from(vec![0xAB; 4096]))
        .await
        .expect("write");

    let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 8).await;
    let blocks: Vec<u64> = check.wrong.iter().map(|w| w.block.0).collect();
    assert_eq!(blocks, vec![77, 200], "{:#?}", check.wrong);
    let text = check.wrong[0].to_string();
    assert!(text.starts_with("block 77 "), "{text}");
    // A flipped payload byte is either torn (checksum) or, if block 77 was last unmapped,
    // garbage; both must say the block is not what was written.
    assert!(
        text.contains("torn or corrupted") || text.contains("garbage"),
        "{text}"
    );
    assert!(check.wrong[1].why.contains("garbage"), "{}", check.wrong[1]);
}

#[tokio::test]
async fn stale_block_restored_from_an_older_write_is_reported() {
    let dev = MemDevice::new(MIB);
    let mut cfg = WorkloadConfig {
        range_len: Some(64 * 4096),
        pattern: Pattern::Sequential,
        read_percent: 0,
        ..config(64)
    };
    let mut model = cfg.new_model(dev.size(), RunId(3)).expect("valid config");
    let first = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(first.io_errors.is_empty());
    let old = dev.read(10 * 4096, 4096).await.expect("read");

    // Sequential over 64 blocks: 256 more ops rewrite block 10 several times.
    cfg.stop = StopAfter::Ops(256);
    let second = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(second.io_errors.is_empty() && second.bad_reads.is_empty());
    assert_ne!(dev.read(10 * 4096, 4096).await.expect("read"), old);

    dev.write(10 * 4096, old).await.expect("write");
    for expect in [Expect::Exact, Expect::AfterCrash] {
        let check = workload::verify(&dev, &model, expect, Scope::Range, 4).await;
        assert_eq!(check.wrong.len(), 1, "{:#?}", check.wrong);
        let w = &check.wrong[0];
        assert_eq!(w.block, BlockIndex(10));
        assert!(
            w.why.contains("stale") || w.why.contains("lost write"),
            "{w}"
        );
    }
}

#[tokio::test]
async fn misdirected_write_names_the_block_the_data_was_meant_for() {
    let dev = MemDevice::new(MIB);
    let cfg = WorkloadConfig {
        unmap_percent: 0,
        ..config(3000)
    };
    let mut model = cfg.new_model(dev.size(), RunId(4)).expect("valid config");
    workload::run_workload(&dev, &mut model, &cfg).await;
    let b5 = dev.read(5 * 4096, 4096).await.expect("read");
    dev.write(9 * 4096, b5).await.expect("write");
    let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 4).await;
    assert_eq!(check.wrong.len(), 1, "{:#?}", check.wrong);
    assert_eq!(check.wrong[0].block, BlockIndex(9));
    assert!(
        check.wrong[0].why.contains("meant for block 5"),
        "{}",
        check.wrong[0]
    );
}

/// A device with a volatile write cache: writes land in `cache`, flush copies the cache to
/// `disk`, and `crash` throws away unflushed writes — some of them, chosen by `keep`, so a
/// crashed device holds a mix of old and new blocks like a real one would.
/// A FUA write goes to the cache and the disk, unless `lying_fua` (then it is a plain
/// write, as a device that ignores FUA would do).
struct VolatileCacheDevice {
    state: Mutex<(Vec<u8>, Vec<u8>)>, // (cache, disk)
    lying_fua: bool,
}

impl VolatileCacheDevice {
    fn new(size: usize) -> Self {
        VolatileCacheDevice {
            state: Mutex::new((vec![0; size], vec![0; size])),
            lying_fua: false,
        }
    }

    fn crash(&self, block_size: usize, keep: impl Fn(usize) -> bool) -> usize {
        let mut s = self.state.lock().expect("lock");
        let (cache, disk) = &mut *s;
        let mut lost = 0;
        for (i, (c, d)) in cache
            .chunks_mut(block_size)
            .zip(disk.chunks_mut(block_size))
            .enumerate()
        {
            if c != d {
                if keep(i) {
                    d.copy_from_slice(c);
                } else {
                    c.copy_from_slice(d);
                    lost += 1;
                }
            }
        }
        lost
    }

    fn poke(&self, offset: usize, data: &[u8]) {
        let mut s = self.state.lock().expect("lock");
        s.0[offset..offset + data.len()].copy_from_slice(data);
        s.1[offset..offset + data.len()].copy_from_slice(data);
    }
}

impl BlockDevice for VolatileCacheDevice {
    fn size(&self) -> u64 {
        self.state.lock().expect("lock").0.len() as u64
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        let s = self.state.lock().expect("lock");
        let r = offset as usize..(offset + len) as usize;
        let out = Bytes::copy_from_slice(&s.0[r]);
        Box::pin(async move { Ok(out) })
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            // Yield so completions interleave with other in-flight operations.
            tokio::task::yield_now().await;
            let mut s = self.state.lock().expect("lock");
            s.0[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
            Ok(())
        })
    }
    fn write_fua(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            let mut s = self.state.lock().expect("lock");
            let r = offset as usize..offset as usize + data.len();
            s.0[r.clone()].copy_from_slice(&data);
            if !self.lying_fua {
                s.1[r].copy_from_slice(&data);
            }
            Ok(())
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            let mut s = self.state.lock().expect("lock");
            s.0[offset as usize..(offset + len) as usize].fill(0);
            Ok(())
        })
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            let mut s = self.state.lock().expect("lock");
            let (cache, disk) = &mut *s;
            disk.copy_from_slice(cache);
            Ok(())
        })
    }
}

#[tokio::test]
async fn after_crash_accepts_old_or_new_but_rejects_garbage_torn_and_lost_flushed_data() {
    let bs = 8192usize;
    let dev = VolatileCacheDevice::new(2 << 20);
    let cfg = WorkloadConfig {
        block_size: bs as u64,
        flush_every: Some(1000),
        final_flush: false,
        ..config(3000)
    };
    let mut model = cfg.new_model(dev.size(), RunId(5)).expect("valid config");
    let report = workload::run_workload(&dev, &mut model, &cfg).await;
    assert!(report.io_errors.is_empty() && report.bad_reads.is_empty());

    // Keep every other unflushed block: the device now mixes old and new content.
    let lost = dev.crash(bs, |i| i % 2 == 0);
    assert!(lost > 0, "the run must leave unflushed writes to lose");

    let strict = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 8).await;
    assert_eq!(
        strict.wrong.len(),
        lost,
        "exact check must see each lost write"
    );
    let crash = workload::verify(&dev, &model, Expect::AfterCrash, Scope::Range, 8).await;
    assert!(crash.passed(), "{:#?}", crash.wrong);

    // The state file round trip keeps the verdicts.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.json");
    model.save(&path).expect("save");
    let loaded = Model::load(&path).expect("load");
    let again = workload::verify(&dev, &loaded, Expect::AfterCrash, Scope::Range, 8).await;
    assert!(again.passed(), "{:#?}", again.wrong);

    // Now damage three blocks in ways no crash may produce.
    let touched: Vec<u64> = model.touched_blocks().map(|b| b.0).collect();
    let (g, t) = (touched[0] as usize, touched[1] as usize);
    dev.poke(g * bs, &vec![0x5A; bs]); // garbage
    let other = model.block_content(BlockIndex(t as u64), workload::Seq(999_999));
    dev.poke(t * bs + 4096, &other[4096..]); // torn: second half from elsewhere
    // Zeros over a block whose flushed write must survive.
    let flushed = touched
        .iter()
        .copied()
        .find(|&b| {
            b as usize != g
                && b as usize != t
                && model.state(BlockIndex(b)).is_some_and(|s| {
                    s.durable
                        .is_some_and(|d| d.seq.0 > 0 && d.content == workload::Content::Data)
                })
        })
        .expect("some block has a flushed write");
    dev.poke(flushed as usize * bs, &vec![0; bs]);

    let crash = workload::verify(&dev, &loaded, Expect::AfterCrash, Scope::Range, 8).await;
    let mut named: Vec<u64> = crash.wrong.iter().map(|w| w.block.0).collect();
    named.sort_unstable();
    let mut want = vec![g as u64, t as u64, flushed];
    want.sort_unstable();
    assert_eq!(named, want, "{:#?}", crash.wrong);
    for w in &crash.wrong {
        let expect_why = if w.block.0 == g as u64 {
            "garbage"
        } else if w.block.0 == t as u64 {
            "torn"
        } else {
            "lost write"
        };
        assert!(w.why.contains(expect_why), "{w}");
    }
}

/// FUA writes without any flush: after a crash that loses every unflushed write, each
/// acknowledged FUA write must still be there; on a device that treats FUA as a plain write
/// the check names the lost ones.
#[tokio::test]
async fn fua_writes_survive_a_crash_without_a_flush_and_a_device_that_ignores_fua_is_caught() {
    for lying_fua in [false, true] {
        let bs = 4096usize;
        let dev = VolatileCacheDevice {
            lying_fua,
            ..VolatileCacheDevice::new(1 << 20)
        };
        let cfg = WorkloadConfig {
            block_size: bs as u64,
            read_percent: 0,
            fua_percent: 50,
            flush_every: None,
            final_flush: false,
            ..config(2000)
        };
        let mut model = cfg.new_model(dev.size(), RunId(6)).expect("valid config");
        let report = workload::run_workload(&dev, &mut model, &cfg).await;
        assert!(report.io_errors.is_empty() && report.bad_reads.is_empty());
        assert_eq!(report.flushes, 0);
        assert!(
            report.fua_writes > 500 && report.fua_writes < report.writes,
            "{report:?}"
        );
        // Every write not made durable is lost.
        let lost = dev.crash(bs, |_| false);
        assert!(lost > 0, "the run must leave plain writes to lose");
        let crash = workload::verify(&dev, &model, Expect::AfterCrash, Scope::Range, 8).await;
        if lying_fua {
            assert!(
                !crash.wrong.is_empty() && crash.wrong.iter().all(|w| w.why.contains("lost")),
                "a device that drops FUA writes must fail the check: {:#?}",
                crash.wrong.iter().take(3).collect::<Vec<_>>()
            );
        } else {
            assert!(crash.passed(), "{:#?}", crash.wrong);
        }
    }
}

#[test]
fn config_errors_are_reported_not_panicked() {
    let dev = MemDevice::new(MIB);
    let bad = [
        WorkloadConfig {
            block_size: 1000,
            ..WorkloadConfig::default()
        },
        WorkloadConfig {
            range_start: 4096,
            range_len: Some(MIB),
            ..WorkloadConfig::default()
        },
        WorkloadConfig {
            queue_depth: 0,
            ..WorkloadConfig::default()
        },
    ];
    for cfg in bad {
        assert!(cfg.new_model(dev.size(), RunId(6)).is_err());
    }
}
