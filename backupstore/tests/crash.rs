//! kill -9 of a backup process mid-upload: no partial backup is ever listed, a retry
//! succeeds (reusing what the dead writer finished), and GC removes what is left over.

// Slices of one byte range are ranges, not Vecs of numbers.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use zebu_backupstore::*;

fn tool() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let p = dir.join("examples/backup_tool");
    assert!(
        p.exists(),
        "{} missing: build with `cargo build -p zebu-backupstore --examples`",
        p.display()
    );
    p
}

fn tool_cmd(url: &str, env: &[(String, String)], cache: &Path) -> Command {
    let mut c = Command::new(tool());
    c.args(["--target", url, "--cache-dir"])
        .arg(cache)
        .args(["--session-ttl-secs", "4"]);
    for (k, v) in env {
        c.env(k, v);
    }
    c.env_remove("RUST_LOG");
    c
}

/// Starts a slow backup of `image`, kills it with SIGKILL once `packs_before + 2` packs are
/// stored, and returns how many packs there were then.
async fn kill_mid_upload(
    store: &BackupStore,
    url: &str,
    env: &[(String, String)],
    cache: &Path,
    image: &Path,
    name: &str,
) -> u64 {
    let before = store.usage().await.unwrap().packs;
    let mut child = tool_cmd(url, env, cache)
        .args([
            "--pack-mib",
            "8",
            "--part-mib",
            "5",
            "--uploads",
            "2",
            "--chunk-delay-ms",
            "40",
        ])
        .args(["backup", "--family", "fam", "--name", name])
        .arg(image)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "backup never uploaded two packs");
        assert!(
            child.try_wait().unwrap().is_none(),
            "backup finished before it could be killed"
        );
        let packs = store.usage().await.unwrap().packs;
        if packs >= before + 2 {
            // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            child.wait().unwrap();
            return packs;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn kill_then_retry_then_gc(cfg: TargetConfig, env: Vec<(String, String)>) {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("cache");
    let store = BackupStore::open(&cfg, opts(&cache)).await.unwrap();
    let img = random_bytes(77, 96 * MIB as usize);
    let image = work.path().join("vol.img");
    std::fs::write(&image, &img).unwrap();

    // 1. Killed mid-upload: nothing listed.
    let packs_at_kill = kill_mid_upload(&store, &cfg.url, &env, &cache, &image, "b1").await;
    assert!(
        store.list_backups(None).await.unwrap().is_empty(),
        "a killed backup is never listed"
    );

    // 2. A retry succeeds and reuses the dead writer's packs.
    let out = tool_cmd(&cfg.url, &env, &cache)
        .args(["backup", "--family", "fam", "--name", "b1"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "retry: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = store
        .get_backup(
            &FamilyId::new("fam").unwrap(),
            &BackupName::new("b1").unwrap(),
        )
        .await
        .unwrap();
    assert!(
        m.stats.dedup_chunks >= 8,
        "the retry reused finished packs: {:?} ({packs_at_kill} packs at kill)",
        m.stats
    );
    assert!(restore(&store, &m).await.unwrap().0 == img);

    // 3. Another backup killed; GC waits for its session to expire, then removes its packs.
    let other = random_bytes(78, 96 * MIB as usize);
    let other_path = work.path().join("other.img");
    std::fs::write(&other_path, &other).unwrap();
    let kept = store.usage().await.unwrap();
    kill_mid_upload(&store, &cfg.url, &env, &cache, &other_path, "b2").await;
    let fam = m.family.clone();
    let first = match store.gc(&fam, gc_now()).await.unwrap() {
        GcOutcome::Done(r) => r,
        b => panic!("{b:?}"),
    };
    assert!(first.condemned >= 2, "{first:?}");
    let early = match store.gc(&fam, gc_now()).await.unwrap() {
        GcOutcome::Done(r) => r,
        b => panic!("{b:?}"),
    };
    assert_eq!(
        early.deleted, 0,
        "the dead writer's session is still within its ttl: {early:?}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let late = match store.gc(&fam, gc_now()).await.unwrap() {
        GcOutcome::Done(r) => r,
        b => panic!("{b:?}"),
    };
    assert!(late.deleted >= 2, "{late:?}");
    let after = store.usage().await.unwrap();
    assert_eq!(
        after.packs, kept.packs,
        "exactly the killed backup's packs are gone: {after:?} vs {kept:?}"
    );
    assert!(
        restore(&store, &m).await.unwrap().0 == img,
        "the retried backup is intact"
    );
    assert!(store.list_backups(None).await.unwrap().len() == 1);
}

#[tokio::test]
async fn kill_9_mid_upload_on_moto_leaves_no_backup_and_gc_cleans_up() {
    let moto = Moto::start();
    let cfg = moto.config("zebu", "crash");
    let s = moto.settings();
    let env = vec![
        ("AWS_ACCESS_KEY_ID".to_string(), s.access_key_id.unwrap()),
        (
            "AWS_SECRET_ACCESS_KEY".to_string(),
            s.secret_access_key.unwrap(),
        ),
        ("AWS_REGION".to_string(), s.region.unwrap()),
        ("AWS_ENDPOINT_URL".to_string(), s.endpoint.unwrap()),
    ];
    kill_then_retry_then_gc(cfg, env).await;
}

#[tokio::test]
async fn kill_9_mid_upload_on_a_file_target_leaves_no_backup_and_gc_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    kill_then_retry_then_gc(file_config(&dir.path().join("t")), Vec::new()).await;
    // The killed uploads' hidden staging files go once they are older than the session ttl.
    let packs = dir.path().join("t/families/fam/packs");
    let staged = || {
        std::fs::read_dir(&packs)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains('#')
            })
            .count()
    };
    if staged() > 0 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let store = BackupStore::open(
            &file_config(&dir.path().join("t")),
            StoreOptions {
                sessions: SessionTimes {
                    ttl: Duration::from_secs(4),
                    heartbeat: Duration::from_millis(400),
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let _ = store
            .gc(&FamilyId::new("fam").unwrap(), gc_now())
            .await
            .unwrap();
        assert_eq!(staged(), 0, "staged uploads swept");
    }
}
