//! Restores through the reorder window (`zebu_backupstore::restore`), against a real moto S3
//! server: an incremental backup whose chunks alternate between the packs of two backups is
//! read with a few large reads per pack, handed on in volume order, each chunk downloaded
//! once, and the bytes held never exceed the buffer the options give, whatever the backup's
//! size.

mod common;

use common::*;
use zebu_backupstore::*;

/// A 96 MiB volume of random data (two packs), then every other chunk rewritten (a third
/// pack): the incremental backup's chunks alternate full, incremental, full, ...
async fn alternating(store: &BackupStore) -> (Vec<u8>, Manifest) {
    let mut img = random_bytes(11, 96 * MIB as usize);
    backup_full(store, "v", "full", &img).await;
    let mut changed = Vec::new();
    for c in (1..96u64).step_by(2) {
        let r = (c * MIB) as usize..((c + 1) * MIB) as usize;
        img[r].copy_from_slice(&random_bytes(1000 + c, MIB as usize));
        changed.push(c * MIB..(c + 1) * MIB);
    }
    let incr = backup_incremental(store, "v", "incr", "full", &img, &changed, &[]).await;
    assert_eq!(incr.stats.chunks_given, 48);
    (img, incr)
}

#[tokio::test]
async fn an_incremental_restore_alternating_between_packs_is_identical_and_reads_each_chunk_once_within_its_buffer()
 {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "alt"), opts(cache.path()))
        .await
        .unwrap();
    let (img, incr) = alternating(&store).await;
    let buffer = 8 * MIB;

    // The defaults but a small buffer: a gap of one replaced chunk is read through, so each
    // pack is one read, and every chunk is handed on once, in order.
    let (restored, st) = restore_with(
        &store,
        &incr,
        RestoreOptions {
            buffer,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(restored == img, "restored byte-identical");
    assert_eq!(st.chunks, 96, "each chunk handed on once: {st:?}");
    assert_eq!(st.bytes, 96 * MIB);
    assert!(st.reads <= 3, "one read per pack: {st:?}");
    assert_eq!(
        st.downloaded - st.skipped,
        96 * MIB,
        "every chunk downloaded once: {st:?}"
    );
    assert!(
        st.peak_held <= buffer + MIB,
        "held at most the buffer and the cursor's chunk: {st:?}"
    );

    // No gap read through: nothing but the chunks is downloaded (the full backup's chunks
    // are then one read each), and the window still holds no more than its buffer.
    let (restored, st) = restore_with(
        &store,
        &incr,
        RestoreOptions {
            concurrency: 3,
            max_gap: 0,
            buffer,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(restored == img);
    assert_eq!(st.downloaded, 96 * MIB, "{st:?}");
    assert_eq!(st.skipped, 0);
    assert_eq!(st.reads, 48 + 1, "{st:?}");
    assert!(st.peak_held <= buffer + MIB, "{st:?}");

    // A buffer of one chunk still finishes (the cursor's chunk always passes).
    let (restored, st) = restore_with(
        &store,
        &incr,
        RestoreOptions {
            buffer: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(restored == img);
    assert!(st.peak_held <= MIB + 1, "{st:?}");
}

#[tokio::test]
async fn a_file_target_restores_the_alternating_backup_with_the_same_reads() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    let (img, incr) = alternating(&store).await;
    let (restored, st) = restore_with(&store, &incr, RestoreOptions::default())
        .await
        .unwrap();
    assert!(restored == img);
    assert!(st.reads <= 3, "{st:?}");
    assert_eq!(st.chunks, 96);
}
