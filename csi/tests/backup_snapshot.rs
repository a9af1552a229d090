//! VolumeSnapshotClass `type: backup` on a real `zebu up` whose backup target is a real S3
//! server (moto): CreateSnapshot backs the volume up (id `backup:<name>`, readyToUse once the
//! upload is committed, the same answer on every repeat), ListSnapshots shows the backup (by
//! id, by source volume, page by page) and not the snapshot it took, CreateVolume from it
//! restores it (its data block for block as at the snapshot, though the source was written
//! after), DeleteSnapshot deletes the backup and its snapshot. Refused, each with its code and
//! a message that names what is wrong: an unknown `type`, no backup target, a restore below
//! the backup's size, a restore of a backup still uploading, the same name for another volume.

mod common;
#[path = "../../backupstore/tests/common/mod.rs"]
mod store_fixtures;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::ctl::{Ctl, create_req, delete_snapshot, publish};
use common::{Plugin, Up, qemu_io, read_all, retry_aborted};
use store_fixtures::Moto;
use tonic::Code;
use zebu_csi::Endpoint;
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;
use zebu_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType};

const MIB: i64 = 1 << 20;
const NODE: &str = "node-1";

fn from_snapshot(mut req: csi::CreateVolumeRequest, id: &str) -> csi::CreateVolumeRequest {
    req.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(SourceType::Snapshot(SnapshotSource {
            snapshot_id: id.into(),
        })),
    });
    req
}

fn backup_req(name: &str, source: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: source.into(),
        parameters: HashMap::from([("type".to_string(), "backup".to_string())]),
        ..Default::default()
    }
}

/// The names `zebu backup ls` lists.
fn backups(up: &Up) -> Vec<String> {
    up.json(&["backup", "ls"])["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|b| b["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// The backup manifests in the bucket (a backup exists exactly when its manifest does).
fn manifests(moto: &Moto) -> Vec<String> {
    let listing = store_fixtures::http(moto.port, "GET", "/zebu?list-type=2&prefix=csi/", &[])
        .expect("list the bucket");
    listing
        .split("<Key>")
        .skip(1)
        .filter_map(|k| k.split("</Key>").next())
        .filter_map(|k| k.strip_suffix(".manifest"))
        .filter_map(|k| k.rsplit('/').next())
        .map(str::to_string)
        .collect()
}

/// The snapshot names on `volume`'s replicas, as `zebu snapshot ls` lists them.
fn snapshots(up: &Up, volume: &str) -> Vec<String> {
    let v = up.json(&["snapshot", "ls", volume]);
    v["items"]
        .as_array()
        .or_else(|| v.as_array())
        .expect("snapshot items")
        .iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect()
}

async fn list_ids(ctl: &mut Ctl, req: csi::ListSnapshotsRequest) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let mut r = req.clone();
        r.starting_token = token;
        let page = ctl
            .list_snapshots(r)
            .await
            .expect("ListSnapshots")
            .into_inner();
        out.extend(
            page.entries
                .into_iter()
                .filter_map(|e| e.snapshot.map(|s| (s.snapshot_id, s.ready_to_use))),
        );
        if page.next_token.is_empty() {
            return out;
        }
        token = page.next_token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_snapshots_are_backups_and_restore_through_create_volume() {
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-bsnap")
        .tempdir()
        .expect("tempdir");
    let tmp = dir.path();
    let moto = Moto::start();
    moto.create_bucket("zebu");
    let env = [
        ("AWS_ACCESS_KEY_ID", "testing".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_ENDPOINT_URL", moto.endpoint()),
    ];
    let up = Up::start_env(tmp, 3, &env);
    let plugin = Plugin::start(
        tmp,
        &up.api,
        NODE,
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let ch = zebu_csi::connect(&Endpoint::Unix(plugin.socket.clone()))
        .await
        .expect("connect");
    let mut ctl = ControllerClient::new(ch);
    let t0 = Instant::now();

    // The source: a CSI volume with data at the start, the middle and the end.
    let src = ctl
        .create_volume(create_req("src", 32 * MIB, &[("numberOfReplicas", "2")]))
        .await
        .expect("CreateVolume src")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let uri = publish(&ctl, &src, NODE).await["nbdUri"].clone();
    qemu_io(&uri, "write -P 0x5a 0 1M");
    qemu_io(&uri, "write -P 0xa5 13M 3M");
    qemu_io(&uri, "write -P 0x3c 31M 1M");
    let want = read_all(&uri, tmp, "src.img");

    // Refused before anything is made: an unknown type, and no backup target.
    let mut bad = backup_req("snap-bad", &src);
    bad.parameters.insert("type".into(), "bakup".into());
    let err = ctl.create_snapshot(bad).await.expect_err("unknown type");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("\"type\"") && err.message().contains("bakup"),
        "{err:?}"
    );
    let err = ctl
        .create_snapshot(backup_req("snap-no-target", &src))
        .await
        .expect_err("no backup target");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("backup target") && !err.message().contains('\n'),
        "{err:?}"
    );
    assert_eq!(
        backups(&up),
        Vec::<String>::new(),
        "a refused call made a backup"
    );
    let out = up.zebu(&["backup", "target", "set", "s3://zebu@us-east-1/csi"]);
    assert!(
        out.status.success(),
        "backup target set: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The backup: answered at once, not ready; written after, the source moves on.
    let name = "snapshot-8d6c1b2e-backup";
    let first = ctl
        .create_snapshot(backup_req(name, &src))
        .await
        .expect("CreateSnapshot type backup")
        .into_inner()
        .snapshot
        .expect("snapshot");
    let id = format!("backup:{name}");
    assert_eq!(first.snapshot_id, id);
    assert_eq!(first.source_volume_id, src);
    assert_eq!(first.size_bytes, 32 * MIB);
    assert!(!first.ready_to_use, "ready before any upload: {first:?}");
    assert!(first.creation_time.is_some(), "{first:?}");
    qemu_io(&uri, "write -P 0xee 12M 2M");
    assert_eq!(backups(&up), [name]);
    let err = ctl
        .create_snapshot(backup_req(name, "other-volume"))
        .await
        .expect_err("the same name for another volume");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert!(err.message().contains(&src), "{err:?}");

    // Repeats answer the same backup until it is ready.
    let ready = loop {
        let s = ctl
            .create_snapshot(backup_req(name, &src))
            .await
            .expect("repeat CreateSnapshot")
            .into_inner()
            .snapshot
            .expect("snapshot");
        assert_eq!(s.snapshot_id, id);
        assert_eq!(s.creation_time, first.creation_time);
        if s.ready_to_use {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the backup never became ready: {}",
            up.json(&["backup", "get", name])
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("backup ready after {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(ready.size_bytes, 32 * MIB);
    let b = up.json(&["backup", "get", name]);
    assert_eq!(b["status"]["state"], "completed", "{b}");
    assert_eq!(b["spec"]["volume"], src.as_str(), "{b}");
    assert_eq!(
        manifests(&moto),
        [name],
        "the committed backup is in the bucket"
    );

    // Listed by id, by source, and page by page; the snapshot the backup took is not listed
    // as a snapshot of its own.
    let by_id = list_ids(
        &mut ctl,
        csi::ListSnapshotsRequest {
            snapshot_id: id.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(by_id, [(id.clone(), true)]);
    let by_source = list_ids(
        &mut ctl,
        csi::ListSnapshotsRequest {
            source_volume_id: src.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(by_source, [(id.clone(), true)]);
    assert!(
        snapshots(&up, &src).iter().any(|s| s == name),
        "the backup's snapshot is on the volume"
    );
    let local = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            name: "snapshot-local".into(),
            source_volume_id: src.clone(),
            ..Default::default()
        })
        .await
        .expect("a plain snapshot")
        .into_inner()
        .snapshot
        .expect("snapshot");
    let mut paged = list_ids(
        &mut ctl,
        csi::ListSnapshotsRequest {
            max_entries: 1,
            ..Default::default()
        },
    )
    .await;
    paged.sort();
    assert_eq!(
        paged,
        [(id.clone(), true), (local.snapshot_id.clone(), true)]
    );
    let err = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            name: name.into(),
            source_volume_id: src.clone(),
            ..Default::default()
        })
        .await
        .expect_err("a plain snapshot named as the backup");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");

    // A restore: not below the backup's size; with no size, the backup's.
    let err = ctl
        .create_volume(from_snapshot(create_req("small", 16 * MIB, &[]), &id))
        .await
        .expect_err("below the backup's size");
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    let err = ctl
        .create_volume(from_snapshot(create_req("gone", 0, &[]), "backup:no-such"))
        .await
        .expect_err("no such backup");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let restore = from_snapshot(create_req("restored", 0, &[("numberOfReplicas", "3")]), &id);
    let vol = retry_aborted("CreateVolume from the backup", || {
        let mut c = ctl.clone();
        let r = restore.clone();
        async move { c.create_volume(r).await }
    })
    .await
    .into_inner()
    .volume
    .expect("volume");
    assert_eq!(vol.capacity_bytes, 32 * MIB);
    assert!(vol.content_source.is_some(), "{vol:?}");
    let v = up.json(&["volume", "get", &vol.volume_id]);
    assert_eq!(v["spec"]["numberOfReplicas"], 3, "{v}");
    assert_eq!(v["status"]["restore"]["backup"], name, "{v}");
    let got = read_all(
        &publish(&ctl, &vol.volume_id, NODE).await["nbdUri"],
        tmp,
        "restored.img",
    );
    assert_eq!(
        common::first_difference(&got, &want),
        None,
        "the restored volume differs from the source at the snapshot"
    );
    println!(
        "restored and compared after {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // A backup still uploading cannot be restored yet (Aborted: the CO calls again).
    let early = ctl
        .create_snapshot(backup_req("snapshot-early", &src))
        .await
        .expect("a second backup")
        .into_inner()
        .snapshot
        .expect("snapshot");
    let err = ctl
        .create_volume(from_snapshot(
            create_req("too-early", 0, &[]),
            &early.snapshot_id,
        ))
        .await
        .expect_err("not ready yet");
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert!(err.message().contains("not ready"), "{err:?}");

    // DeleteSnapshot: the backups go from the target, with the snapshots they took; again
    // and for a backup that never was, OK.
    delete_snapshot(&ctl, &early.snapshot_id).await;
    delete_snapshot(&ctl, &id).await;
    assert_eq!(backups(&up), Vec::<String>::new());
    assert_eq!(
        manifests(&moto),
        Vec::<String>::new(),
        "a deleted backup's manifest stayed"
    );
    let left = snapshots(&up, &src);
    assert!(
        !left.iter().any(|s| s == name || s == "snapshot-early"),
        "the backups' snapshots stayed: {left:?}"
    );
    delete_snapshot(&ctl, &id).await;
    delete_snapshot(&ctl, "backup:never-was").await;
    let by_id = list_ids(
        &mut ctl,
        csi::ListSnapshotsRequest {
            snapshot_id: id.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(by_id, []);
    println!("done after {:.1} s", t0.elapsed().as_secs_f64());
}
