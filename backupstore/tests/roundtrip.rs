//! Round trips against a real moto S3 server and a file target: holes, zero runs,
//! incremental chains, diff restores, dedup across a clone, object counts.

// Slices of one byte range are ranges, not Vecs of numbers.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use common::*;
use zebu_backupstore::*;

/// A 64 MiB volume: random data, a zero run handed over as data, and holes.
fn base_image() -> Vec<u8> {
    let mut img = vec![0u8; 64 * MIB as usize];
    img[..20 * MIB as usize].copy_from_slice(&random_bytes(1, 20 * MIB as usize));
    // 30..40 MiB compressible text; 40..48 MiB stays zero but is "written" (a zero run).
    for (i, b) in img[30 * MIB as usize..40 * MIB as usize]
        .iter_mut()
        .enumerate()
    {
        *b = b"block storage "[i % 14];
    }
    // A short tail chunk region of data at the very end.
    let n = img.len();
    img[n - 4096..].copy_from_slice(&random_bytes(2, 4096));
    img
}

fn distinct_chunks(img: &[u8]) -> u64 {
    let set: std::collections::HashSet<ChunkHash> = img
        .chunks(MIB as usize)
        .filter(|c| c.iter().any(|&b| b != 0))
        .map(ChunkHash::of)
        .collect();
    set.len() as u64
}

async fn chain_round_trip(store: &BackupStore, family: &str) {
    let mut img = base_image();
    let b1 = backup_full(store, family, "b1", &img).await;
    // 20 data chunks + 10 text chunks + the tail chunk; the zero run and holes cost nothing.
    assert_eq!(b1.stats.chunks, 31);
    assert_eq!(b1.stats.zero_chunks, 64 - 31);
    let (restored, st) = restore(store, &b1).await.unwrap();
    assert!(restored == img, "b1 restores byte-identical");
    // The text repeats with a period that makes some 1 MiB chunks identical: those are stored
    // and downloaded once and delivered at each of their offsets.
    assert_eq!(
        st.chunks,
        distinct_chunks(&img),
        "each distinct chunk downloaded once"
    );
    assert!(st.chunks < 31);
    assert_eq!(st.bytes, 31 * MIB);

    // Change: rewrite 3 MiB, 50 small writes, unmap 4 MiB of data, write into a hole.
    let mut changed = Vec::new();
    img[2 * MIB as usize..5 * MIB as usize].copy_from_slice(&random_bytes(3, 3 * MIB as usize));
    changed.push(2 * MIB..5 * MIB);
    for i in 0..50u64 {
        let off = (i * 7919 * 4096) % (60 * MIB);
        img[off as usize..off as usize + 4096].copy_from_slice(&random_bytes(100 + i, 4096));
        changed.push(off..off + 4096);
    }
    img[10 * MIB as usize..14 * MIB as usize].fill(0);
    let zeroed = vec![10 * MIB..14 * MIB];
    img[50 * MIB as usize + 123..50 * MIB as usize + 5000].fill(9);
    changed.push(50 * MIB + 123..50 * MIB + 5000);
    // The small writes may land in the unmapped range: the plan reads those chunks.
    let b2 = backup_incremental(store, family, "b2", "b1", &img, &changed, &zeroed).await;
    let plan = plan_chunks(img.len() as u64, MIB, &changed, &zeroed);
    assert_eq!(b2.stats.chunks_given, plan.read_bytes().div_ceil(MIB));
    assert!(
        b2.stats.new_blobs <= b2.stats.chunks_given + 1,
        "only changed chunks (and one map page) uploaded"
    );
    let (restored, _) = restore(store, &b2).await.unwrap();
    assert!(restored == img, "b2 restores byte-identical");

    // A third link with no change at all: only a manifest, no pack.
    let b3 = backup_incremental(store, family, "b3", "b2", &img, &[], &[]).await;
    assert_eq!(b3.stats.packs, 0);
    assert_eq!(b3.pages, b2.pages, "unchanged pages are shared by hash");
    let (restored, _) = restore(store, &b3).await.unwrap();
    assert!(restored == img);

    // b1 is still intact after the chain grew, and a standby holding b1 catches up to b3.
    let (mut standby, _) = restore(store, &b1).await.unwrap();
    let st = apply_diff(store, &mut standby, &b1, &b3).await;
    assert!(standby == img, "diff restore b1 -> b3 gives b3");
    assert!(
        st.chunks <= plan.read_bytes().div_ceil(MIB),
        "diff downloads only changed chunks: {st:?}"
    );
    let d = store.diff(&b2, &b3).await.unwrap();
    assert!(d.changed.is_empty() && d.zeroed.is_empty());
    assert_eq!(d.pages_skipped, 1);

    // Deleting the middle backup does not affect the others.
    store.delete_backup(&b2.family, &b2.name).await.unwrap();
    let (restored, _) = restore(store, &b3).await.unwrap();
    assert!(restored == img, "b3 needs nothing from b2's manifest");
    let names: Vec<_> = store
        .list_backups(Some(&b1.family))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name.to_string())
        .collect();
    assert_eq!(names, vec!["b1", "b3"]);
}

#[tokio::test]
async fn incremental_chain_round_trips_on_moto() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "backups"), opts(cache.path()))
        .await
        .unwrap();
    assert!(
        store.target().has_conditional_put(),
        "moto honours If-None-Match: *"
    );
    chain_round_trip(&store, "vol-a").await;
}

#[tokio::test]
async fn incremental_chain_round_trips_on_a_file_target() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(&dir.path().join("store")), opts(cache.path()))
        .await
        .unwrap();
    assert!(store.target().has_conditional_put());
    chain_round_trip(&store, "vol-a").await;
}

#[tokio::test]
async fn a_clone_in_the_same_family_uploads_only_what_differs() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", ""), opts(cache.path()))
        .await
        .unwrap();
    let img = base_image();
    let b1 = backup_full(&store, "fam", "origin-1", &img).await;
    // The clone differs in one chunk; its first backup is a full one (no parent).
    let mut clone = img.clone();
    clone[7 * MIB as usize] ^= 1;
    let c1 = backup_full(&store, "fam", "clone-1", &clone).await;
    assert_eq!(c1.stats.chunks, b1.stats.chunks);
    assert_eq!(
        c1.stats.dedup_chunks,
        b1.stats.chunks - 1,
        "every chunk but one deduplicated"
    );
    assert_eq!(
        c1.stats.new_blobs, 2,
        "one data chunk and one map page uploaded"
    );
    // A fresh cache (another node) sees the same: the index is rebuilt from pack indexes.
    let cache2 = tempfile::tempdir().unwrap();
    let store2 = BackupStore::open(&moto.config("zebu", ""), opts(cache2.path()))
        .await
        .unwrap();
    let c2 = backup_full(&store2, "fam", "clone-2", &clone).await;
    assert_eq!(c2.stats.new_blobs, 0);
    assert_eq!(c2.stats.packs, 0);
    assert!(restore(&store2, &c2).await.unwrap().0 == clone);
    // Another family does not share chunks.
    let other = backup_full(&store, "other", "o1", &img).await;
    assert_eq!(
        other.stats.new_blobs, b1.stats.new_blobs,
        "nothing shared across families"
    );
}

#[tokio::test]
async fn a_gib_of_unique_data_is_a_few_dozen_objects() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    let img = random_bytes(42, 1 << 30);
    let m = backup_full(&store, "big", "full", &img).await;
    let u = store.usage().await.unwrap();
    eprintln!("1 GiB random: {u:?}, stats {:?}", m.stats);
    assert!(u.objects <= 32, "{} objects for 1 GiB", u.objects);
    assert_eq!(u.manifests, 1);
    let (restored, st) = restore(&store, &m).await.unwrap();
    assert!(restored == img);
    assert_eq!(st.chunks, 1024);
    // Reads of up to 16 MiB, cut at pack boundaries.
    assert!(
        st.reads <= 64 + u.packs + 1,
        "large ranged reads: {} for 1024 chunks",
        st.reads
    );
}

#[tokio::test]
async fn moto_object_count_and_ranged_reads_for_256_mib() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "p"), opts(cache.path()))
        .await
        .unwrap();
    let img = random_bytes(7, 256 << 20);
    let m = backup_full(&store, "v", "b", &img).await;
    let u = store.usage().await.unwrap();
    // 256 MiB of incompressible data: 4 packs + manifest + format marker.
    assert!(u.objects <= 8, "{u:?}");
    let (restored, st) = restore(&store, &m).await.unwrap();
    assert!(restored == img);
    assert!(
        st.downloaded <= u.bytes,
        "nothing downloaded twice: {st:?} vs {u:?}"
    );
}
