//! `kill -9` of a real `zebu-replica` at random moments, then a restart on the same
//! directory: the replica must open, every write acknowledged before the last completed
//! flush must read back, unflushed blocks may hold the old or the new data but nothing
//! else, and an interrupted snapshot operation is either done or not done, never half.
//!
//! Each test runs [`ROUNDS`] kill/restart rounds with a seeded RNG (the seed is printed;
//! replay with `ZEBU_TEST_SEED`). Block contents are checked with [`zebu_tests::model`].

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use zebu_proto::replica::data_request::Op;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_proto::replica::{self as pb, UnmapOp, WriteOp};
use zebu_tests::model::{BLOCK, Model, blocks_data, decode};
use zebu_tests::{DataStream, ReplicaProcess, loopback, test_seed};

const ROUNDS: usize = 20;
const SIZE: u64 = 64 << 20;
/// The tests touch the first 8 MiB, so a full check reads little.
const NBLOCKS: u64 = 2048;

/// A kill delay that adapts so that about half the interrupted operations complete:
/// longer after a kill that came too early, shorter after one that came too late.
struct KillDelay {
    micros: u64,
}

impl KillDelay {
    fn new() -> KillDelay {
        KillDelay { micros: 20_000 }
    }

    fn pick(&self, rng: &mut StdRng) -> Duration {
        Duration::from_micros(rng.random_range(0..=self.micros))
    }

    fn observe(&mut self, done: bool) {
        self.micros = if done {
            self.micros * 7 / 10
        } else {
            self.micros * 3 / 2
        }
        .clamp(500, 2_000_000);
    }
}

/// One replica directory and the process currently serving it.
struct Rig {
    _tmp: tempfile::TempDir,
    dir: std::path::PathBuf,
    ip: u8,
    proc: Option<ReplicaProcess>,
    generation: u64,
}

impl Rig {
    fn new(ip: u8) -> Rig {
        // ZEBU_TEST_KEEP=1 keeps the directory (and the server's log) for a post-mortem.
        let keep = std::env::var_os("ZEBU_TEST_KEEP").is_some();
        let tmp = tempfile::Builder::new()
            .disable_cleanup(keep)
            .tempdir()
            .expect("tempdir");
        let dir = tmp.path().join("replica");
        if keep {
            eprintln!("keeping {}", dir.display());
        }
        Rig {
            _tmp: tmp,
            dir,
            ip,
            proc: None,
            generation: 0,
        }
    }

    /// (Re)starts the server and opens a data stream with a new generation.
    async fn start(&mut self) -> (ReplicaClient<Channel>, DataStream) {
        let p = ReplicaProcess::start(&self.dir, SIZE, loopback(self.ip))
            .expect("the replica must open after a crash");
        let mut client = p.client().await.expect("connect");
        self.generation += 1;
        let stream = DataStream::open(&mut client, self.generation)
            .await
            .unwrap_or_else(|e| panic!("hello refused: {e}; log:\n{}", p.log()));
        self.proc = Some(p);
        (client, stream)
    }

    /// Kills the server after `delay` (from a task, while the caller keeps working).
    fn kill_after(&self, delay: Duration) -> tokio::task::JoinHandle<()> {
        let pid = self.proc.as_ref().expect("running").pid();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        })
    }

    /// Waits for a kill started by [`Rig::kill_after`] and reaps the process.
    async fn reap(&mut self, killer: tokio::task::JoinHandle<()>) {
        killer.await.expect("killer task");
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }
}

/// Reads every block in use and checks it against `model`, settling unflushed blocks.
async fn verify(s: &mut DataStream, model: &mut Model) {
    const CHUNK: u64 = 256;
    for first in (0..NBLOCKS).step_by(CHUNK as usize) {
        let data = s
            .read(first * BLOCK, CHUNK * BLOCK)
            .await
            .expect("read after restart");
        for (i, block) in data.chunks(BLOCK as usize).enumerate() {
            let b = first + i as u64;
            if let Err(e) = model.verify_and_settle(b, block) {
                panic!("after restart: {e}");
            }
        }
    }
}

/// Reads every block in use and returns its stamp.
async fn stamps(s: &mut DataStream) -> Vec<u64> {
    let mut out = Vec::with_capacity(NBLOCKS as usize);
    let data = s.read(0, NBLOCKS * BLOCK).await.expect("read");
    for (b, block) in data.chunks(BLOCK as usize).enumerate() {
        out.push(decode(b as u64, block).unwrap_or_else(|e| panic!("{e}")));
    }
    out
}

fn expected(model: &Model) -> Vec<u64> {
    (0..NBLOCKS).map(|b| model.expected(b)).collect()
}

/// Panics with the first blocks that differ (not thousands of numbers).
fn assert_same(got: &[u64], want: &[u64], what: &str) {
    let diff: Vec<String> = (0..got.len())
        .filter(|&b| got[b] != want[b])
        .take(8)
        .map(|b| format!("block {b}: stamp {} instead of {}", got[b], want[b]))
        .collect();
    assert!(diff.is_empty(), "{what}: {}", diff.join("; "));
}

/// Sends one batch of non-overlapping writes (and a few unmaps) with many in flight and
/// waits for every answer, recording them in `model`. Returns false once the stream died.
async fn batch(s: &mut DataStream, model: &mut Model, rng: &mut StdRng, stamp: &mut u64) -> bool {
    let mut used = vec![false; NBLOCKS as usize];
    let mut pending = std::collections::HashMap::new();
    for _ in 0..rng.random_range(1..48) {
        let count = rng.random_range(1..=8u64);
        let first = rng.random_range(0..NBLOCKS - count);
        if used[first as usize..(first + count) as usize]
            .iter()
            .any(|&u| u)
        {
            continue;
        }
        used[first as usize..(first + count) as usize].fill(true);
        *stamp += 1;
        let this = if rng.random_ratio(1, 10) { 0 } else { *stamp };
        let op = if this == 0 {
            Op::Unmap(UnmapOp {
                offset: first * BLOCK,
                length: count * BLOCK,
                zero_fill: false,
            })
        } else {
            let data = blocks_data(first, count, this).into();
            Op::Write(WriteOp {
                offset: first * BLOCK,
                data,
                crc32c: Vec::new(),
                flush_number: None,
            })
        };
        for b in first..first + count {
            model.sent(b, this);
        }
        let Ok(id) = s.send(op).await else {
            return false;
        };
        pending.insert(id, (first, count, this));
    }
    while !pending.is_empty() {
        let Ok(resp) = s.recv().await else {
            return false;
        };
        let (first, count, this) = pending.remove(&resp.id).expect("known id");
        assert_eq!(resp.status, 0, "write failed: {}", resp.message);
        for b in first..first + count {
            model.acked(b, this);
        }
    }
    true
}

/// Writes a batch and flushes it, without interruption.
async fn settled_batch(s: &mut DataStream, model: &mut Model, rng: &mut StdRng, stamp: &mut u64) {
    assert!(
        batch(s, model, rng, stamp).await,
        "stream died without a kill"
    );
    s.flush().await.expect("flush");
    model.flushed();
}

/// The head's chain in `info` is well formed: oldest first, each the parent of the next,
/// the head last, and no name twice. Returns the snapshot names along the chain.
fn chain(info: &pb::InfoResponse) -> Vec<String> {
    let mut names = Vec::new();
    let mut parent = 0;
    let head = info
        .layers
        .iter()
        .position(|l| l.head)
        .expect("a head layer");
    for l in &info.layers[..=head] {
        assert_eq!(l.parent, parent, "broken chain: {:?}", info.layers);
        parent = l.id;
        if !l.head {
            assert!(!names.contains(&l.name), "name twice: {:?}", info.layers);
            names.push(l.name.clone());
        }
    }
    assert_eq!(head, names.len());
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_during_writes_and_flushes_loses_no_flushed_write() {
    let mut rng = StdRng::seed_from_u64(test_seed());
    let mut rig = Rig::new(40);
    let mut model = Model::default();
    let mut stamp = 0;
    let mut batches = 0;
    for _round in 0..ROUNDS {
        let (_client, mut s) = rig.start().await;
        verify(&mut s, &mut model).await;
        let killer = rig.kill_after(Duration::from_millis(rng.random_range(10..500)));
        while batch(&mut s, &mut model, &mut rng, &mut stamp).await {
            batches += 1;
            if rng.random_ratio(1, 3) {
                match s.flush().await {
                    Ok(_) => model.flushed(),
                    Err(_) => break,
                }
            }
        }
        rig.reap(killer).await;
    }
    let (_client, mut s) = rig.start().await;
    verify(&mut s, &mut model).await;
    eprintln!("{ROUNDS} kills over {batches} batches, {stamp} writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_during_snapshot_create_leaves_it_done_or_not() {
    let mut rng = StdRng::seed_from_u64(test_seed());
    let mut rig = Rig::new(41);
    let mut model = Model::default();
    let mut snaps: Vec<(String, Model)> = Vec::new();
    let mut stamp = 0;
    let mut done = 0;
    let mut delay = KillDelay::new();
    for round in 0..ROUNDS {
        let (mut client, mut s) = rig.start().await;
        verify(&mut s, &mut model).await;
        settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
        let name = format!("s{round}");
        let killer = rig.kill_after(delay.pick(&mut rng));
        let req = pb::SnapshotCreateRequest {
            name: name.clone(),
            user_created: true,
            ..Default::default()
        };
        let _ = client.snapshot_create(req).await;
        rig.reap(killer).await;

        let (mut client, mut s) = rig.start().await;
        let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
        let names = chain(&info);
        delay.observe(names.contains(&name));
        if names.contains(&name) {
            done += 1;
            snaps.push((name, model.clone()));
        }
        let want: Vec<String> = snaps.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, want, "snapshots after the kill");
        assert_same(
            &stamps(&mut s).await,
            &expected(&model),
            "head after the kill",
        );
        rig.reap(rig.kill_after(Duration::ZERO)).await;
    }
    // Every snapshot holds what the volume held when it was taken.
    let (mut client, mut s) = rig.start().await;
    for (name, m) in snaps.iter().rev() {
        client
            .snapshot_revert(pb::SnapshotRevertRequest { name: name.clone() })
            .await
            .unwrap();
        assert_same(
            &stamps(&mut s).await,
            &expected(m),
            &format!("snapshot {name}"),
        );
    }
    eprintln!("{done} of {ROUNDS} interrupted snapshot creates completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_during_snapshot_delete_leaves_it_done_or_not() {
    let mut rng = StdRng::seed_from_u64(test_seed());
    let mut rig = Rig::new(42);
    let mut model = Model::default();
    let mut snaps: Vec<(String, Model)> = Vec::new();
    let mut stamp = 0;
    let mut done = 0;
    let mut delay = KillDelay::new();
    for round in 0..ROUNDS {
        let (mut client, mut s) = rig.start().await;
        verify(&mut s, &mut model).await;
        // Two new snapshots a round, with data in each, so there is always one to merge.
        for k in 0..2 {
            for _ in 0..2 {
                settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
            }
            let name = format!("s{round}-{k}");
            let req = pb::SnapshotCreateRequest {
                name: name.clone(),
                ..Default::default()
            };
            client.snapshot_create(req).await.expect("snapshot create");
            snaps.push((name, model.clone()));
        }
        settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
        let victim = snaps[rng.random_range(0..snaps.len())].0.clone();
        let killer = rig.kill_after(delay.pick(&mut rng));
        let _ = client
            .snapshot_delete(pb::SnapshotDeleteRequest {
                name: victim.clone(),
            })
            .await;
        rig.reap(killer).await;

        let (mut client, mut s) = rig.start().await;
        let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
        let names = chain(&info);
        delay.observe(!names.contains(&victim));
        if !names.contains(&victim) {
            done += 1;
            snaps.retain(|(n, _)| *n != victim);
        }
        let want: Vec<String> = snaps.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, want, "snapshots after the kill (victim {victim})");
        // Merging never changes what the volume reads.
        assert_same(
            &stamps(&mut s).await,
            &expected(&model),
            "head after the kill",
        );
        rig.reap(rig.kill_after(Duration::ZERO)).await;
    }
    let (mut client, mut s) = rig.start().await;
    for (name, m) in snaps.iter().rev() {
        client
            .snapshot_revert(pb::SnapshotRevertRequest { name: name.clone() })
            .await
            .unwrap();
        assert_same(
            &stamps(&mut s).await,
            &expected(m),
            &format!("snapshot {name}"),
        );
    }
    eprintln!("{done} of {ROUNDS} interrupted snapshot deletes completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_during_revert_leaves_old_head_or_snapshot() {
    let mut rng = StdRng::seed_from_u64(test_seed());
    let mut rig = Rig::new(43);
    let mut model = Model::default();
    let mut snaps: Vec<(String, Model)> = Vec::new();
    let mut stamp = 0;
    let mut done = 0;
    let mut delay = KillDelay::new();
    for round in 0..ROUNDS {
        let (mut client, mut s) = rig.start().await;
        verify(&mut s, &mut model).await;
        settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
        if round % 2 == 0 {
            let name = format!("s{round}");
            let req = pb::SnapshotCreateRequest {
                name: name.clone(),
                ..Default::default()
            };
            client.snapshot_create(req).await.expect("snapshot create");
            snaps.push((name, model.clone()));
            settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
        }
        let (target, target_model) = snaps[rng.random_range(0..snaps.len())].clone();
        let killer = rig.kill_after(delay.pick(&mut rng));
        let _ = client
            .snapshot_revert(pb::SnapshotRevertRequest {
                name: target.clone(),
            })
            .await;
        rig.reap(killer).await;

        let (mut client, mut s) = rig.start().await;
        let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
        let names = chain(&info);
        // Every snapshot survives a revert (off the chain or on it).
        for (n, _) in &snaps {
            assert!(
                info.layers.iter().any(|l| &l.name == n),
                "snapshot {n} lost: {names:?}"
            );
        }
        let got = stamps(&mut s).await;
        let (old, new) = (expected(&model), expected(&target_model));
        delay.observe(got == new);
        if got == new && got != old {
            done += 1;
            model = target_model;
            assert_eq!(names.last(), Some(&target), "the reverted head's parent");
        } else if got == new {
            // The revert changes nothing readable: either outcome is this model.
            model = target_model;
        } else {
            let what = format!("head is neither the old head nor snapshot {target}");
            assert_same(&got, &old, &what);
        }
        rig.reap(rig.kill_after(Duration::ZERO)).await;
    }
    eprintln!("{done} of {ROUNDS} interrupted reverts completed (or were no-ops)");
}

/// A second server on a directory that a live server holds is refused, with a message that
/// says so, instead of serving the same files twice; the first keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_a_live_directory_is_refused() {
    let mut rig = Rig::new(43);
    let (_client, mut s) = rig.start().await;
    let mut model = Model::default();
    let mut rng = StdRng::seed_from_u64(test_seed());
    let mut stamp = 0;
    settled_batch(&mut s, &mut model, &mut rng, &mut stamp).await;
    let err = match ReplicaProcess::start(&rig.dir, SIZE, loopback(44)) {
        Ok(_) => panic!("a second server opened a directory another one serves"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("held by another open file"), "{err}");
    verify(&mut s, &mut model).await;
}
