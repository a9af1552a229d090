//! Store tests: a property test against a naive in-memory model, and focused cases.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;

use super::{BLOCK_SIZE, Replica};
use crate::error::ReplicaError;
use crate::io::{BackendKind, CacheMode, IoConfig, IoEngine};

const KIB: u64 = 1024;

fn io() -> IoEngine {
    IoEngine::new(BackendKind::Auto).expect("io engine")
}

fn io_with(cache: CacheMode) -> IoEngine {
    let config = IoConfig {
        cache,
        ..IoConfig::default()
    };
    IoEngine::with_config(BackendKind::Auto, config).expect("io engine")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A pattern that differs per write, so a block from the wrong write or layer shows.
fn pattern(seed: u64, len: usize) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, len: u64, seed: u64 },
    Unmap { offset: u64, len: u64 },
    Snapshot { user: bool },
    Delete { pick: usize },
    Revert { pick: usize },
    Purge,
    Expand { blocks: u64 },
    Flush,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    // Offsets and lengths cluster on block boundaries but include unaligned ones.
    let pos = prop_oneof![(0..40u64).prop_map(|b| b * BLOCK_SIZE), 0..160 * KIB,];
    let len = prop_oneof![(1..12u64).prop_map(|b| b * BLOCK_SIZE), 1..40 * KIB,];
    prop_oneof![
        6 => (pos.clone(), len.clone(), any::<u64>()).prop_map(|(offset, len, seed)| Op::Write { offset, len, seed }),
        3 => (pos, len).prop_map(|(offset, len)| Op::Unmap { offset, len }),
        2 => any::<bool>().prop_map(|user| Op::Snapshot { user }),
        2 => any::<usize>().prop_map(|pick| Op::Delete { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Revert { pick }),
        1 => Just(Op::Purge),
        1 => (0..8u64).prop_map(|blocks| Op::Expand { blocks }),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
    ]
}

/// The naive model: full copies of everything.
struct Model {
    data: Vec<u8>,
    /// name -> (content when taken, parent snapshot, user created)
    snaps: BTreeMap<String, (Vec<u8>, Option<String>, bool)>,
    head_parent: Option<String>,
    next: u32,
}

impl Model {
    fn children(&self, name: &str) -> usize {
        self.snaps
            .values()
            .filter(|s| s.1.as_deref() == Some(name))
            .count()
            + usize::from(self.head_parent.as_deref() == Some(name))
    }

    fn delete(&mut self, name: &str) -> bool {
        if self.children(name) > 1 {
            return false;
        }
        let parent = self.snaps.remove(name).expect("model: snapshot exists").1;
        for s in self.snaps.values_mut() {
            if s.1.as_deref() == Some(name) {
                s.1 = parent.clone();
            }
        }
        if self.head_parent.as_deref() == Some(name) {
            self.head_parent = parent;
        }
        true
    }
}

async fn run_ops(dir: &Path, ops: Vec<Op>, cache: CacheMode) -> Result<(), TestCaseError> {
    let initial = 128 * KIB;
    let mut r = Replica::create(dir, initial, io_with(cache))
        .await
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut m = Model {
        data: vec![0; initial as usize],
        snaps: BTreeMap::new(),
        head_parent: None,
        next: 0,
    };
    for (step, op) in ops.into_iter().enumerate() {
        let size = m.data.len() as u64;
        match op {
            Op::Write { offset, len, seed } => {
                let len = len.min(size.saturating_sub(offset));
                if len == 0 {
                    let err = r.write(offset, pattern(seed, 1)).await;
                    prop_assert!(
                        offset >= size && err.is_err(),
                        "write past the end must fail"
                    );
                    continue;
                }
                let data = pattern(seed, len as usize);
                r.write(offset, data.clone())
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.data[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            }
            Op::Unmap { offset, len } => {
                let len = len.min(size.saturating_sub(offset));
                if len == 0 {
                    continue;
                }
                r.unmap(offset, len)
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.data[offset as usize..(offset + len) as usize].fill(0);
            }
            Op::Snapshot { user } => {
                m.next += 1;
                let name = format!("s{}", m.next);
                r.snapshot_create(&name, user, BTreeMap::new())
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let parent = m.head_parent.replace(name.clone());
                m.snaps.insert(name, (m.data.clone(), parent, user));
            }
            Op::Delete { pick } => {
                if m.snaps.is_empty() {
                    prop_assert!(matches!(
                        r.snapshot_delete("nope").await,
                        Err(ReplicaError::UnknownSnapshot(_))
                    ));
                    continue;
                }
                let name = m
                    .snaps
                    .keys()
                    .nth(pick % m.snaps.len())
                    .expect("picked")
                    .clone();
                let res = r.snapshot_delete(&name).await;
                let allowed = m.delete(&name);
                prop_assert_eq!(
                    res.is_ok(),
                    allowed,
                    "delete {} at step {}: {:?}",
                    name,
                    step,
                    res
                );
            }
            Op::Revert { pick } => {
                if m.snaps.is_empty() {
                    continue;
                }
                let name = m
                    .snaps
                    .keys()
                    .nth(pick % m.snaps.len())
                    .expect("picked")
                    .clone();
                r.snapshot_revert(&name)
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let mut content = m.snaps[&name].0.clone();
                content.resize(m.data.len(), 0);
                m.data = content;
                m.head_parent = Some(name);
            }
            Op::Purge => {
                r.snapshot_purge()
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                while let Some(n) = m
                    .snaps
                    .iter()
                    .find(|(n, s)| !s.2 && m.children(n) <= 1)
                    .map(|(n, _)| n.clone())
                {
                    m.delete(&n);
                }
            }
            Op::Expand { blocks } => {
                let new = size + blocks * BLOCK_SIZE;
                r.expand(new)
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.data.resize(new as usize, 0);
            }
            Op::Flush => {
                r.flush(0)
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Reopen => {
                r.close()
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(matches!(r.read(0, 4096).await, Err(ReplicaError::Closed)));
                drop(r);
                r = Replica::open(dir, io_with(cache))
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        check_reads(&r, &m.data, step).await?;
    }
    // Every snapshot still reads as it did when it was taken.
    let names: Vec<String> = m.snaps.keys().cloned().collect();
    for name in names {
        r.snapshot_revert(&name)
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut want = m.snaps[&name].0.clone();
        want.resize(m.data.len(), 0);
        check_reads(&r, &want, usize::MAX).await?;
    }
    Ok(())
}

async fn check_reads(r: &Arc<Replica>, want: &[u8], step: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(r.size(), want.len() as u64);
    let got = r
        .read(0, want.len() as u64)
        .await
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    if got[..] != want[..] {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        return Err(TestCaseError::fail(format!(
            "step {step}: first difference at byte {first}"
        )));
    }
    // An unaligned read in the middle.
    let (o, l) = (
        want.len() as u64 / 3 + 7,
        5000u64.min(want.len() as u64 / 2),
    );
    let got = r
        .read(o, l)
        .await
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&got[..], &want[o as usize..(o + l) as usize]);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: Some(Box::new(
        proptest::test_runner::FileFailurePersistence::SourceParallel("proptest-regressions"))), ..ProptestConfig::default() })]

    /// Random sequences of write, unmap, snapshot, delete, revert, purge, expand, flush and
    /// reopen read back exactly like full copies would, with layer files in the page cache
    /// and with O_DIRECT.
    #[test]
    fn store_matches_naive_model(
        ops in proptest::collection::vec(op(), 1..40),
        direct in any::<bool>(),
    ) {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let cache = if direct { CacheMode::Direct } else { CacheMode::Page };
        rt().block_on(run_ops(dir.path(), ops, cache))?;
    }
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        r.write(0, pattern(1, 4096)).await.expect("write");
        assert!(matches!(
            r.read(1 << 20, 4096).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.write((1 << 20) - 4096, pattern(2, 8192)).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        assert!(matches!(r.read(0, 0).await, Err(ReplicaError::Invalid(_))));
        assert!(matches!(
            r.read(u64::MAX - 10, 4096).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.snapshot_delete("missing").await,
            Err(ReplicaError::UnknownSnapshot(_))
        ));
        assert!(matches!(
            r.snapshot_revert("missing").await,
            Err(ReplicaError::UnknownSnapshot(_))
        ));
        assert!(matches!(
            r.snapshot_create("bad/name", true, BTreeMap::new()).await,
            Err(ReplicaError::Invalid(_))
        ));
        r.snapshot_create("a", true, BTreeMap::new())
            .await
            .expect("snapshot");
        assert!(matches!(
            r.snapshot_create("a", true, BTreeMap::new()).await,
            Err(ReplicaError::SnapshotExists(_))
        ));
        assert!(matches!(
            r.expand(4096).await,
            Err(ReplicaError::Invalid(_))
        ));
        assert_eq!(r.read(0, 4096).await.expect("read"), pattern(1, 4096));
    });
}

#[test]
fn unmap_of_a_whole_large_volume_is_one_request() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 256 << 20, io())
            .await
            .expect("create");
        r.write(100 << 20, pattern(1, 8192)).await.expect("write");
        r.snapshot_create("s", true, BTreeMap::new())
            .await
            .expect("snapshot");
        r.write(200 << 20, pattern(2, 4096)).await.expect("write");
        // What mkfs does first: discard everything, far more than one I/O's payload limit.
        r.unmap(0, 256 << 20).await.expect("unmap everything");
        assert!(
            r.read(100 << 20, 8192)
                .await
                .expect("read")
                .iter()
                .all(|b| *b == 0)
        );
        assert!(
            r.read(200 << 20, 4096)
                .await
                .expect("read")
                .iter()
                .all(|b| *b == 0)
        );
        // Zero-fill leaves data (zeros) in the head, so layers inserted below later stay hidden.
        r.zero_fill(4096 * 3 + 100, 3 << 20)
            .await
            .expect("zero fill");
        let head = r.list_extents(None, 0..256 << 20).await.expect("extents");
        assert_eq!(head.first().map(|e| e.start), Some(4096 * 3));
        assert!(head.iter().map(|e| e.end - e.start).sum::<u64>() >= 3 << 20);
    });
}

#[test]
fn generation_fencing_persists() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        r.accept_generation(5).await.expect("gen 5");
        r.accept_generation(5).await.expect("same generation again");
        assert!(matches!(
            r.accept_generation(4).await,
            Err(ReplicaError::StaleGeneration {
                offered: 4,
                accepted: 5
            })
        ));
        let me = r.info().replica_id;
        r.set_epoch(3, vec![me.clone(), "b".into()])
            .await
            .expect("epoch");
        assert!(r.set_epoch(2, vec![me.clone()]).await.is_err());
        r.close().await.expect("close");
        drop(r);
        let r = Replica::open(dir.path(), io()).await.expect("reopen");
        assert!(matches!(
            r.accept_generation(4).await,
            Err(ReplicaError::StaleGeneration { .. })
        ));
        let info = r.info();
        assert_eq!((info.generation, info.epoch), (5, 3));
        assert_eq!(info.epoch_members, vec![me, "b".to_string()]);
    });
}

#[test]
fn open_or_create_refuses_other_sizes_and_foreign_dirs() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let d = dir.path().join("r");
        drop(
            Replica::open_or_create(&d, 1 << 20, io())
                .await
                .expect("create"),
        );
        drop(
            Replica::open_or_create(&d, 1 << 20, io())
                .await
                .expect("reopen"),
        );
        assert!(matches!(
            Replica::open_or_create(&d, 2 << 20, io()).await,
            Err(ReplicaError::SizeMismatch {
                found: 1048576,
                wanted: 2097152,
                ..
            })
        ));
        let foreign = dir.path().join("f");
        std::fs::create_dir(&foreign).expect("mkdir");
        std::fs::write(foreign.join("notes.txt"), "hello").expect("write");
        assert!(matches!(
            Replica::open_or_create(&foreign, 1 << 20, io()).await,
            Err(ReplicaError::NotAReplica { .. })
        ));
        assert_eq!(
            std::fs::read(foreign.join("notes.txt")).expect("still there"),
            b"hello"
        );
    });
}

#[test]
fn dirty_regions_track_writes_until_flush() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 256 << 20, io())
            .await
            .expect("create");
        let rs = r.info().region_size;
        r.write(3 * rs, pattern(1, 4096)).await.expect("write");
        r.unmap(5 * rs, 8192).await.expect("unmap");
        assert_eq!(r.info().dirty_regions, vec![3, 5]);
        assert_eq!(r.flush(0).await.expect("flush"), 1);
        let ahead = super::regions::LOOKAHEAD;
        assert_eq!(
            r.info().dirty_regions,
            vec![3, 5],
            "marked ahead: still possibly dirty"
        );
        assert_eq!(
            r.flush(1 + ahead)
                .await
                .expect("flush with the engine's number"),
            1 + ahead
        );
        assert!(r.info().dirty_regions.is_empty());
        r.write(7 * rs + 4096, pattern(2, 4096))
            .await
            .expect("write");
        assert_eq!(r.regions_written_since(0), vec![3, 5, 7]);
        assert_eq!(r.regions_written_since(1 + ahead), vec![7]);
        assert!(r.flush(ahead).await.is_err(), "flush numbers never go back");
    });
}

#[test]
fn memory_grows_with_data_not_volume_size() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 40, io())
            .await
            .expect("create 1 TiB");
        for i in 0..64u64 {
            r.write(i * (16 << 30), pattern(i, 4096))
                .await
                .expect("write");
        }
        r.snapshot_create("s", true, BTreeMap::new())
            .await
            .expect("snapshot");
        r.write(5 << 30, pattern(99, 4096)).await.expect("write");
        assert_eq!(r.index_extents(), 65);
        assert_eq!(
            r.read(16 << 30, 4096).await.expect("read"),
            pattern(1, 4096)
        );
    });
}

#[test]
fn rebuild_copies_layers_between_replicas() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let src = Replica::create(&dir.path().join("src"), 8 << 20, io())
            .await
            .expect("create");
        src.write(0, pattern(1, 65536)).await.expect("write");
        src.snapshot_create("s1", true, BTreeMap::new())
            .await
            .expect("s1");
        src.write(4096, pattern(2, 4096)).await.expect("write");
        src.unmap(8192, 4096)
            .await
            .expect("unmap over snapshot data");
        src.snapshot_create("s2", false, BTreeMap::new())
            .await
            .expect("s2");
        src.write(1 << 20, pattern(3, 4096)).await.expect("write");
        // The target took the same new writes as a WO replica, then the rebuild snapshot.
        let dst = Replica::create(&dir.path().join("dst"), 8 << 20, io())
            .await
            .expect("create");
        dst.write(1 << 20, pattern(3, 4096)).await.expect("write");
        src.snapshot_create("rb", false, BTreeMap::new())
            .await
            .expect("rb");
        dst.snapshot_create("rb", false, BTreeMap::new())
            .await
            .expect("rb");
        let mut parent = String::new();
        for layer in ["s1", "s2", "rb"] {
            let spec = super::LayerSpec {
                name: layer.into(),
                parent: parent.clone(),
                ..Default::default()
            };
            dst.begin_layer(&spec).await.expect("begin");
            let l = dst
                .info()
                .layers
                .into_iter()
                .find(|l| l.name == layer)
                .expect("layer exists");
            assert!(
                l.incomplete || layer == "rb",
                "a new rebuilt layer is incomplete until finished"
            );
            for ext in src
                .list_extents(Some(layer), 0..8 << 20)
                .await
                .expect("extents")
            {
                let data = src
                    .read_layer(Some(layer), ext.start, ext.end - ext.start)
                    .await
                    .expect("read layer");
                assert!(data.corrupt.is_empty(), "a good layer reads clean");
                dst.write_layer(layer, ext.start, data.data, Some(data.sums), &[])
                    .await
                    .expect("write layer");
            }
            dst.finish_layer(layer).await.expect("finish");
            parent = layer.into();
        }
        let a = src.read(0, 8 << 20).await.expect("read");
        let b = dst.read(0, 8 << 20).await.expect("read");
        assert!(a == b, "rebuilt replica differs");
        let names: Vec<String> = dst.info().layers.iter().map(|l| l.name.clone()).collect();
        assert_eq!(names, vec!["s1", "s2", "rb", ""]);
        assert!(
            dst.info().layers.iter().all(|l| !l.incomplete),
            "finished layers are complete"
        );
        assert_eq!(
            src.checksums(0, 1 << 20, 0).await.expect("checksums"),
            dst.checksums(0, 1 << 20, 0).await.expect("checksums")
        );
        drop(dst);
        let dst = Replica::open(&dir.path().join("dst"), io())
            .await
            .expect("reopen");
        assert!(dst.read(0, 8 << 20).await.expect("read") == a);
    });
}

/// Writes to the head while a snapshot is merged into it must all stay visible: the index
/// of the head is never replaced by a scan taken before a write completed.
#[test]
fn writes_during_a_merge_into_the_head_stay_visible() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 64 << 20, io())
            .await
            .expect("create");
        for b in 0..2048u64 {
            r.write(b * 8192, pattern(b, 4096)).await.expect("write");
        }
        r.snapshot_create("s1", true, BTreeMap::new())
            .await
            .expect("s1");
        let writer = {
            let r = r.clone();
            tokio::spawn(async move {
                let mut last = BTreeMap::new();
                for i in 0..3000u64 {
                    let b = (i * 7919) % 4096;
                    r.write(b * 4096, pattern(100_000 + i, 4096))
                        .await
                        .expect("write");
                    last.insert(b, 100_000 + i);
                    tokio::task::yield_now().await;
                }
                last
            })
        };
        r.snapshot_delete("s1").await.expect("merge into the head");
        let last = writer.await.expect("writer");
        for b in 0..4096u64 {
            let want = match last.get(&b) {
                Some(seed) => pattern(*seed, 4096),
                None if b % 2 == 0 => pattern(b / 2, 4096),
                None => Bytes::from(vec![0u8; 4096]),
            };
            assert_eq!(
                r.read(b * 4096, 4096).await.expect("read"),
                want,
                "block {b}"
            );
        }
    });
}

fn claim(uuid: &str, adopt: bool) -> zebu_proto::frames::VolumeClaim {
    zebu_proto::frames::VolumeClaim {
        uuid: uuid.into(),
        adopt,
    }
}

/// The table of `identity.rs`, case by case, and that a recorded uuid survives a reopen.
#[test]
fn volume_identity_is_recorded_checked_and_adopted_only_by_a_member() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        // Fresh, no uuid: a client without one is served as before identity existed.
        r.claim_volume(None).await.expect("no uuid either side");
        assert_eq!(r.volume_uuid(), None);
        // Fresh: takes the first uuid named, durably.
        r.claim_volume(Some(&claim("vol-a", false)))
            .await
            .expect("fresh replica takes a uuid");
        r.claim_volume(Some(&claim("vol-a", false)))
            .await
            .expect("its own volume");
        for other in [
            Some(claim("vol-b", false)),
            Some(claim("vol-b", true)),
            None,
        ] {
            let e = r.claim_volume(other.as_ref()).await.unwrap_err();
            assert!(
                matches!(&e, ReplicaError::WrongVolume { has, .. } if has == "vol-a"),
                "{e}"
            );
            let text = e.to_string();
            assert!(text.contains("vol-a"), "{text}");
        }
        let e = r
            .claim_volume(Some(&claim("vol-b", false)))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("vol-b"), "names both uuids: {e}");
        r.close().await.expect("close");
        drop(r);
        let r = Replica::open(dir.path(), io()).await.expect("reopen");
        assert_eq!(r.volume_uuid().as_deref(), Some("vol-a"), "durable");
        assert_eq!(r.info().volume_uuid.as_deref(), Some("vol-a"));
        r.close().await.expect("close");
    });
}

/// A replica made before identity that was a member of an epoch: only a claim with adopt
/// (an engine that lists it as current) gives it a uuid.
#[test]
fn a_former_member_without_identity_is_adopted_only_with_adopt() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        let me = r.info().replica_id;
        r.set_epoch(4, vec![me]).await.expect("epoch");
        let e = r
            .claim_volume(Some(&claim("vol-x", false)))
            .await
            .unwrap_err();
        assert!(
            matches!(e, ReplicaError::UnclaimedVolume { epoch: 4, .. }),
            "{e}"
        );
        assert_eq!(r.volume_uuid(), None, "nothing recorded");
        r.claim_volume(Some(&claim("vol-x", true)))
            .await
            .expect("adopted by a member's engine");
        assert_eq!(r.volume_uuid().as_deref(), Some("vol-x"));
        r.close().await.expect("close");
    });
}

/// Counters from the wire: a value near u64::MAX or far ahead is refused and changes nothing
/// (issue 18, finding 2: one such flush, hello or SetEpoch made a replica unservable).
#[test]
fn counters_from_the_wire_are_bounded() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        let me = r.info().replica_id;
        assert!(r.accept_generation(u64::MAX).await.is_err());
        assert!(r.accept_generation((1 << 32) + 1).await.is_err());
        r.accept_generation(3)
            .await
            .expect("a plausible generation");
        assert!(r.set_epoch(u64::MAX, vec![me.clone()]).await.is_err());
        assert!(
            r.set_epoch(2, vec!["bogus".into()]).await.is_err(),
            "members without this replica"
        );
        assert!(r.set_epoch(2, vec![me.clone(), me.clone()]).await.is_err());
        r.set_epoch(2, vec![me.clone()])
            .await
            .expect("a real epoch");
        r.write(0, pattern(1, 4096)).await.expect("write");
        assert!(r.flush(u64::MAX).await.is_err());
        assert!(r.flush(u64::MAX - 1).await.is_err());
        let n = r.flush(0).await.expect("the next flush still works");
        r.flush(n + 1).await.expect("and the one after");
        let info = r.info();
        assert_eq!((info.generation, info.epoch), (3, 2));
        assert_eq!(info.flush_number, n + 1);
        r.close().await.expect("close");
    });
}

/// Layer ranges: past the layer's end, or wrapping 64 bits, is out of range (not zeros, not
/// an internal error).
#[test]
fn layer_ranges_are_checked_against_the_layer() {
    rt().block_on(async {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let r = Replica::create(dir.path(), 1 << 20, io())
            .await
            .expect("create");
        let far = u64::MAX - 4095;
        assert!(matches!(
            r.read_layer(None, far, 4096).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.read_layer(None, 1 << 20, 4096).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        assert!(matches!(
            r.checksums(far & !4095, 4096, 4096).await,
            Err(ReplicaError::OutOfRange { .. })
        ));
        r.read_layer(None, 0, 4096).await.expect("inside");
        r.close().await.expect("close");
    });
}
