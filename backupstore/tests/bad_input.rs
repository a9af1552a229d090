//! Bad input: one clear error each, within seconds, nothing half-made.

// Slices of one byte range are ranges, not Vecs of numbers.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use zebu_backupstore::*;

async fn open_err(cfg: TargetConfig) -> (BackupError, Duration) {
    let t = Instant::now();
    let e = match BackupStore::open(&cfg, StoreOptions::default()).await {
        Ok(_) => panic!("{} opened", cfg.url),
        Err(e) => e,
    };
    (e, t.elapsed())
}

#[tokio::test]
async fn a_malformed_url_is_refused_with_what_is_wrong() {
    let (e, _) = open_err(TargetConfig::with_settings(
        "s3:/bucket",
        S3Settings::default(),
    ))
    .await;
    assert!(matches!(e, BackupError::BadUrl { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("expected s3://BUCKET@REGION/PREFIX or file:///PATH"),
        "{e}"
    );
    let (e, _) = open_err(TargetConfig::with_settings(
        "s3://b@us-east-1/x",
        S3Settings::default(),
    ))
    .await;
    assert!(e.to_string().contains("bucket must be 3-63"), "{e}");
}

#[tokio::test]
async fn a_remote_plain_http_endpoint_is_refused_before_any_request() {
    let s = S3Settings {
        endpoint: Some("http://192.0.2.1:9000".into()),
        ..Moto::fake_settings()
    };
    let (e, took) = open_err(TargetConfig::with_settings("s3://bucket@us-east-1/x", s)).await;
    assert!(
        e.to_string()
            .contains("plain http is allowed only on a loopback address"),
        "{e}"
    );
    assert!(took < Duration::from_millis(500));
}

#[tokio::test]
async fn an_unreachable_endpoint_is_reported_within_seconds() {
    // A loopback port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = S3Settings {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        ..Moto::fake_settings()
    };
    let (e, took) = open_err(TargetConfig::with_settings("s3://bucket@us-east-1/x", s)).await;
    assert!(matches!(e, BackupError::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains("endpoint unreachable"), "{e}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[tokio::test]
async fn a_missing_bucket_is_named() {
    let moto = Moto::start();
    let (e, took) = open_err(TargetConfig::with_settings(
        "s3://no-such-bucket@us-east-1/x",
        moto.settings(),
    ))
    .await;
    assert!(
        matches!(e, BackupError::MissingBucket { ref bucket, .. } if bucket == "no-such-bucket"),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("bucket \"no-such-bucket\" does not exist"),
        "{e}"
    );
    assert!(took < Duration::from_secs(5));
}

#[tokio::test]
async fn wrong_credentials_are_reported_as_such() {
    // Authentication on from the first request: moto's IAM knows no access key, so any is wrong.
    let moto = Moto::start_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", "0")]);
    let (e, took) = open_err(TargetConfig::with_settings(
        "s3://zebu@us-east-1/x",
        moto.settings(),
    ))
    .await;
    assert!(matches!(e, BackupError::BadCredentials { .. }), "{e:?}");
    assert!(e.to_string().contains("credentials refused"), "{e}");
    assert!(took < Duration::from_secs(5));
}

#[tokio::test]
async fn missing_credentials_name_the_variables() {
    let s = S3Settings {
        region: Some("us-east-1".into()),
        ..Default::default()
    };
    let (e, _) = open_err(TargetConfig::with_settings("s3://bucket@us-east-1/x", s)).await;
    assert!(
        e.to_string()
            .contains("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        "{e}"
    );
}

#[tokio::test]
async fn writer_contract_violations_are_errors_and_leave_no_backup() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&file_config(dir.path()), opts(cache.path()))
        .await
        .unwrap();
    let mut w = store
        .begin_backup(spec("f", "b", 10 * MIB, None))
        .await
        .unwrap();
    for (off, len) in [(4096, MIB), (0, 4096), (10 * MIB, MIB), (20 * MIB, MIB)] {
        let e = w
            .put_chunk(off, vec![1u8; len as usize].into())
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("a chunk must start at a multiple"),
            "{e}"
        );
    }
    assert!(w.put_zero(4096..MIB).is_err());
    w.put_chunk(MIB, vec![1u8; MIB as usize].into())
        .await
        .unwrap();
    w.put_zero(0..4 * MIB).unwrap();
    let e = w.commit().await.unwrap_err();
    assert!(
        e.to_string().contains("given both as data and as zero"),
        "{e}"
    );
    assert!(store.list_backups(None).await.unwrap().is_empty());

    // A missing parent, a duplicate name.
    let e = store
        .begin_backup(spec("f", "c", 10 * MIB, Some("nope")))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, BackupError::BackupNotFound { .. }), "{e}");
    backup_full(&store, "f", "d", &vec![3u8; 3 * MIB as usize]).await;
    let e = store
        .begin_backup(spec("f", "d", 3 * MIB, None))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, BackupError::BackupExists { .. }), "{e}");
    let e = store
        .delete_backup(
            &FamilyId::new("f").unwrap(),
            &BackupName::new("zz").unwrap(),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("backup f/zz not found"), "{e}");
    // No session markers are left behind by the refused starts.
    let left = std::fs::read_dir(dir.path().join("families/f/sessions"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0);
}

#[tokio::test]
async fn two_writers_of_one_name_cannot_both_commit() {
    let moto = Moto::start();
    let cache = tempfile::tempdir().unwrap();
    let store = BackupStore::open(&moto.config("zebu", ""), opts(cache.path()))
        .await
        .unwrap();
    let mut a = store
        .begin_backup(spec("f", "same", 2 * MIB, None))
        .await
        .unwrap();
    let mut b = store
        .begin_backup(spec("f", "same", 2 * MIB, None))
        .await
        .unwrap();
    a.put_chunk(0, vec![1u8; MIB as usize].into())
        .await
        .unwrap();
    b.put_chunk(0, vec![2u8; MIB as usize].into())
        .await
        .unwrap();
    a.commit().await.unwrap();
    let e = b.commit().await.unwrap_err();
    assert!(matches!(e, BackupError::BackupExists { .. }), "{e}");
    let m = store
        .get_backup(
            &FamilyId::new("f").unwrap(),
            &BackupName::new("same").unwrap(),
        )
        .await
        .unwrap();
    assert!(
        restore(&store, &m).await.unwrap().0[..MIB as usize]
            .iter()
            .all(|&x| x == 1),
        "the first commit stands"
    );
}
