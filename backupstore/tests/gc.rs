//! Deletion, GC and repack, alone and while backups run; corruption detection.

// Slices of one byte range are ranges, not Vecs of numbers.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::time::Duration;

use common::*;
use object_store::ObjectStoreExt;
use zebu_backupstore::*;

fn done(o: GcOutcome) -> GcReport {
    match o {
        GcOutcome::Done(r) => r,
        GcOutcome::Busy { holder, .. } => panic!("gc busy: {holder}"),
    }
}

#[tokio::test]
async fn gc_deletes_a_deleted_backups_packs_only_on_its_second_pass() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "gc"), opts(cache.path()))
        .await
        .unwrap();
    let keep_img = random_bytes(1, 24 * MIB as usize);
    let drop_img = random_bytes(2, 24 * MIB as usize);
    let keep = backup_full(&store, "f", "keep", &keep_img).await;
    let gone = backup_full(&store, "f", "gone", &drop_img).await;
    let fam = keep.family.clone();
    let before = store.usage().await.unwrap();
    store.delete_backup(&fam, &gone.name).await.unwrap();

    let r1 = done(store.gc(&fam, gc_now()).await.unwrap());
    assert_eq!(r1.manifests, 1);
    assert_eq!(r1.condemned, 1, "{r1:?}");
    assert_eq!(r1.deleted, 0, "first pass condemns, deletes nothing");
    assert_eq!(store.usage().await.unwrap().packs, before.packs);

    let r2 = done(store.gc(&fam, gc_now()).await.unwrap());
    assert_eq!(r2.deleted, 1, "{r2:?}");
    let after = store.usage().await.unwrap();
    assert_eq!(after.packs, before.packs - 1);
    assert!(restore(&store, &keep).await.unwrap().0 == keep_img);

    // Nothing left to do.
    let r3 = done(store.gc(&fam, gc_now()).await.unwrap());
    assert_eq!((r3.condemned, r3.deleted, r3.waiting), (0, 0, 0), "{r3:?}");
}

#[tokio::test]
async fn a_margin_keeps_young_packs() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    let m = backup_full(&store, "f", "a", &random_bytes(3, 4 * MIB as usize)).await;
    store.delete_backup(&m.family, &m.name).await.unwrap();
    let opts = GcOptions {
        margin: Duration::from_secs(3600),
        ..Default::default()
    };
    let r = done(store.gc(&m.family, opts).await.unwrap());
    assert_eq!((r.condemned, r.deleted), (0, 0), "{r:?}");
}

#[tokio::test]
async fn mostly_dead_packs_are_repacked_and_every_backup_still_restores() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    // One pack holds both backups' chunks: b1 all 40, b2 only 4 of them plus its own.
    let mut img = random_bytes(4, 40 * MIB as usize);
    let b1 = backup_full(&store, "f", "b1", &img).await;
    img[4 * MIB as usize..].fill(0);
    let b2 = backup_incremental(&store, "f", "b2", "b1", &img, &[], &[4 * MIB..40 * MIB]).await;
    assert_eq!(b2.stats.chunks, 4);
    store.delete_backup(&b1.family, &b1.name).await.unwrap();
    let r1 = done(store.gc(&b1.family, gc_now()).await.unwrap());
    assert_eq!(r1.repacked, 1, "{r1:?}");
    assert!(r1.repack_packs >= 1);
    let r2 = done(store.gc(&b1.family, gc_now()).await.unwrap());
    assert!(r2.deleted >= 1, "{r2:?}");
    let u = store.usage().await.unwrap();
    assert!(u.bytes < 12 * MIB, "dead 36 MiB freed: {u:?}");
    // A fresh cache must not be needed for the restore to find the moved chunks, but use one
    // to prove the index is rebuilt from what is there now.
    let cache2 = tempfile::tempdir().unwrap();
    let store2 = BackupStore::open(&file_config(dir.path()), opts(cache2.path()))
        .await
        .unwrap();
    assert!(restore(&store2, &b2).await.unwrap().0 == img);
    assert!(
        restore(&store, &b2).await.unwrap().0 == img,
        "a stale cache copes with moved chunks"
    );
}

#[tokio::test]
async fn a_running_backup_that_dedups_against_a_condemned_pack_keeps_it() {
    // The race GC's design is about: W starts (and loads the index) while pack P is dead but
    // not yet condemned, GC condemns P, W commits a manifest naming P's chunk, GC runs its
    // second pass. P must survive.
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "race"), opts(cache.path()))
        .await
        .unwrap();
    let img = random_bytes(5, 8 * MIB as usize);
    let old = backup_full(&store, "f", "old", &img).await;
    store.delete_backup(&old.family, &old.name).await.unwrap();
    let mut w = store
        .begin_backup(spec("f", "new", img.len() as u64, None))
        .await
        .unwrap();
    let r1 = done(store.gc(&old.family, gc_now()).await.unwrap());
    assert_eq!(r1.condemned, 1);
    for off in (0..img.len()).step_by(MIB as usize) {
        w.put_chunk(off as u64, img[off..off + MIB as usize].to_vec().into())
            .await
            .unwrap();
    }
    let r2 = done(store.gc(&old.family, gc_now()).await.unwrap());
    assert_eq!(
        r2.deleted, 0,
        "the live session blocks the deletion: {r2:?}"
    );
    assert_eq!(r2.waiting, 1);
    let new = w.commit().await.unwrap();
    assert_eq!(
        new.stats.dedup_chunks, 8,
        "W deduplicated against the condemned pack"
    );
    let r3 = done(store.gc(&old.family, gc_now()).await.unwrap());
    assert_eq!(r3.deleted, 0, "{r3:?}");
    assert_eq!(r3.kept_live, 1, "{r3:?}");
    assert!(restore(&store, &new).await.unwrap().0 == img);
    // And a backup started after the condemnation does not dedup against it.
    store.delete_backup(&new.family, &new.name).await.unwrap();
    let _ = done(store.gc(&old.family, gc_now()).await.unwrap());
    let again = backup_full(&store, "f", "again", &img).await;
    assert_eq!(
        again.stats.dedup_chunks, 0,
        "condemned packs are not deduplicated against"
    );
}

#[tokio::test]
async fn two_backups_a_gc_and_a_delete_at_once_leave_every_backup_restorable() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", "conc"), opts(cache.path()))
        .await
        .unwrap();
    let a_img = random_bytes(10, 48 * MIB as usize);
    let mut b_img = a_img.clone();
    b_img[..8 * MIB as usize].copy_from_slice(&random_bytes(11, 8 * MIB as usize));
    let c_img = random_bytes(12, 16 * MIB as usize);
    let a0 = backup_full(&store, "fam", "a0", &a_img).await;
    let doomed = backup_full(&store, "fam", "doomed", &c_img).await;
    let fam = a0.family.clone();
    // Round after round: two backups (one deduplicating heavily), a delete, a GC, at once.
    let mut kept = vec![(a0.clone(), a_img.clone())];
    for round in 0..3 {
        let (s1, s2, s3) = (store.clone(), store.clone(), store.clone());
        let (ai, bi) = (a_img.clone(), b_img.clone());
        let n1 = format!("a{}", round + 1);
        let n2 = format!("b{}", round + 1);
        let t1 = tokio::spawn(async move { backup_full(&s1, "fam", &n1, &ai).await });
        let t2 = tokio::spawn(async move { backup_full(&s2, "fam", &n2, &bi).await });
        let f2 = fam.clone();
        let victim = if round == 0 {
            Some(doomed.name.clone())
        } else {
            None
        };
        let t3 = tokio::spawn(async move {
            if let Some(v) = victim {
                s3.delete_backup(&f2, &v).await.unwrap();
            }
            for _ in 0..3 {
                let _ = s3.gc(&f2, gc_now()).await.unwrap();
            }
        });
        let (m1, m2, _) = (t1.await.unwrap(), t2.await.unwrap(), t3.await.unwrap());
        kept.push((m1, a_img.clone()));
        kept.push((m2, b_img.clone()));
    }
    for _ in 0..2 {
        let _ = store.gc(&fam, gc_now()).await.unwrap();
    }
    for (m, img) in &kept {
        assert!(
            restore(&store, m).await.unwrap().0 == *img,
            "{} restores byte-identical",
            m.name
        );
        store.verify(m, RestoreOptions::default()).await.unwrap();
    }
    assert!(store.get_backup(&fam, &doomed.name).await.is_err());
}

#[tokio::test]
async fn a_second_gc_is_told_busy_not_failed() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    let m = backup_full(&store, "f", "a", &random_bytes(3, 2 * MIB as usize)).await;
    // A lease another GC holds right now (as a crashed-or-running GC would leave it).
    let lease = dir
        .path()
        .join("families/f/gc/lease-00000000000000000007.json");
    std::fs::create_dir_all(lease.parent().unwrap()).unwrap();
    std::fs::write(&lease, br#"{"holder":"gc on node-2","ttl_ms":600000}"#).unwrap();
    match store.gc(&m.family, gc_now()).await.unwrap() {
        GcOutcome::Busy { holder, generation } => {
            assert_eq!(holder, "gc on node-2");
            assert_eq!(generation, 7);
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(lease.exists(), "the holder's lease is untouched");
    // An expired lease is taken over.
    std::fs::write(&lease, br#"{"holder":"gc on node-2","ttl_ms":1}"#).unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(matches!(
        store.gc(&m.family, gc_now()).await.unwrap(),
        GcOutcome::Done(_)
    ));
    assert!(!lease.exists());
}

#[tokio::test]
async fn a_flipped_byte_in_a_pack_fails_restore_and_verify_naming_object_and_chunk() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let cfg = moto.config("zebu", "bad");
    let store = BackupStore::open(&cfg, opts(cache.path())).await.unwrap();
    let img = random_bytes(20, 6 * MIB as usize);
    let m = backup_full(&store, "f", "b", &img).await;
    // Flip one byte in the middle of the third chunk's bytes, through the S3 API.
    let map = store.chunk_map(&m).await.unwrap();
    let (slot, hash) = map[2];
    let index = store.family_index(&m.family).await.unwrap();
    let (pack, entry) = index.locate(&hash).unwrap();
    let key = format!("bad/families/f/packs/{}.pack", pack.id);
    let s3 = moto.s3("zebu");
    let path = object_store::path::Path::from(key.as_str());
    let body = s3.get(&path).await.unwrap().bytes().await.unwrap();
    let mut bad = body.to_vec();
    bad[(entry.offset + u64::from(entry.stored_len) / 2) as usize] ^= 0x40;
    s3.put(&path, bad.into()).await.unwrap();

    let e = restore(&store, &m).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, BackupError::CorruptChunk { .. }), "{e:?}");
    assert!(
        text.contains(&format!("families/f/packs/{}.pack", pack.id)),
        "names the object: {text}"
    );
    assert!(text.contains(&hash.to_string()), "names the chunk: {text}");
    assert!(
        text.contains(&format!("volume offset {}", slot * MIB)),
        "{text}"
    );
    let e = store
        .verify(&m, RestoreOptions::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&hash.to_string()), "{e}");
    // Nothing after the bad chunk is handed on as if it were good: the stream stops.
    let mut s = store
        .restore(
            &m,
            RestoreOptions {
                concurrency: 1,
                max_read: MIB,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut good = Vec::new();
    while let Some(item) = s.next().await {
        match item {
            Ok(RestoreItem::Data { offsets, .. }) => good.push(offsets[0]),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert!(
        good.iter().all(|&o| o < slot * MIB),
        "delivered after the bad chunk: {good:?}"
    );
}
