//! The controller and node services over gRPC on a real `zebu up` (three nodes): bad input
//! gets a precise code and message and disturbs nothing; a snapshot of a detached volume, a
//! volume from it and a clone hold the source's data block for block (read back over NBD
//! from the engines the publishes start); expansion offline and online.

mod common;

use std::process::Command;
use std::time::Duration;

use common::ctl::{Ctl, create, create_req, delete_volume, publish, unpublish};
use common::{Plugin, Up, first_difference, mount_cap, qemu_io, read_all};
use tonic::Code;
use tonic::transport::Channel;
use zebu_csi::Endpoint;
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;
use zebu_proto::csi::node_client::NodeClient;

const MIB: i64 = 1 << 20;

struct Env {
    up: Up,
    plugin: Plugin,
    ctl: Ctl,
    node: NodeClient<Channel>,
    _dir: tempfile::TempDir,
}

async fn env() -> Env {
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-ctl")
        .tempdir()
        .expect("tempdir");
    let up = Up::start(dir.path(), 3);
    let plugin = Plugin::start(
        dir.path(),
        &up.api,
        "node-1",
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let ch = zebu_csi::connect(&Endpoint::Unix(plugin.socket.clone()))
        .await
        .expect("connect");
    Env {
        up,
        plugin,
        ctl: ControllerClient::new(ch.clone()),
        node: NodeClient::new(ch),
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_precise_code_and_disturbs_nothing() {
    let mut e = env().await;
    let good = create(&e.ctl, create_req("Bad-Input-Keep", 16 * MIB, &[])).await;

    // An unknown StorageClass parameter: InvalidArgument naming the key.
    let err = e
        .ctl
        .create_volume(create_req(
            "bad-param",
            16 * MIB,
            &[("numberOfReplica", "3")],
        ))
        .await
        .expect_err("unknown parameter");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("numberOfReplica"), "{err:?}");
    // A malformed one.
    let err = e
        .ctl
        .create_volume(create_req(
            "bad-param",
            16 * MIB,
            &[("numberOfReplicas", "three")],
        ))
        .await
        .expect_err("malformed parameter");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("numberOfReplicas"), "{err:?}");

    // Larger than any disk: OutOfRange or ResourceExhausted, saying so.
    let err = e
        .ctl
        .create_volume(create_req("too-big", 1 << 60, &[]))
        .await
        .expect_err("too big");
    assert!(
        matches!(err.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{err:?}"
    );
    assert!(
        e.up.json(&["volume", "ls"])["items"]
            .as_array()
            .is_some_and(|v| v.len() == 1),
        "a refused create left a volume behind"
    );

    // A volume that does not exist: NotFound.
    let err = e
        .ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: "no-such-volume".into(),
        })
        .await
        .expect_err("missing");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = e
        .ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            node_id: "node-1".into(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .expect_err("missing");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // A publish to a node that does not exist: NotFound naming it, the volume untouched.
    let err = e
        .ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: good.volume_id.clone(),
            node_id: "node-9".into(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .expect_err("unknown node");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("node-9"), "{err:?}");

    // A staging path that is a file: InvalidArgument, nothing attached.
    let ctx = publish(&e.ctl, &good.volume_id, "node-1").await;
    let file = e.plugin.state_dir.parent().expect("dir").join("not-a-dir");
    std::fs::write(&file, b"x").expect("file");
    let err = e
        .node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: good.volume_id.clone(),
            publish_context: ctx,
            staging_target_path: file.display().to_string(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .expect_err("staging path is a file");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("not a directory"), "{err:?}");
    assert!(common::loops_under(e.plugin.state_dir.as_path()).is_empty());
    unpublish(&e.ctl, &good.volume_id, "node-1").await;

    // The volume is still there, healthy, and deletes cleanly.
    let v = e
        .ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: good.volume_id.clone(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(v.volume.expect("volume").capacity_bytes, 16 * MIB);
    delete_volume(&e.ctl, &good.volume_id).await;
    common::wait_for("the replica directories to go", 60, || {
        e.up.replica_dirs().is_empty()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_restore_clone_and_expand_keep_every_block() {
    let mut e = env().await;
    let tmp = e._dir.path().to_path_buf();
    let size = 32 * MIB;
    let src = create(
        &e.ctl,
        create_req("Source-Volume", size, &[("numberOfReplicas", "3")]),
    )
    .await;
    let ctx = publish(&e.ctl, &src.volume_id, "node-1").await;
    let uri = ctx.get("nbdUri").expect("an NBD publish context").clone();
    // Data at the start, in the middle and at the very end; the rest stays holes.
    qemu_io(&uri, "write -P 0x5a 0 1M");
    qemu_io(&uri, "write -P 0xa5 13M 3M");
    qemu_io(&uri, "write -P 0x3c 31M 1M");
    let want = read_all(&uri, &tmp, "src.img");
    assert_eq!(want.len() as i64, size);
    unpublish(&e.ctl, &src.volume_id, "node-1").await;

    // A snapshot of the detached volume.
    let snap = e
        .ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: src.volume_id.clone(),
            name: "Snap-Of-Source".into(),
            ..Default::default()
        })
        .await
        .expect("CreateSnapshot of a detached volume")
        .into_inner()
        .snapshot
        .expect("snapshot");
    assert!(snap.ready_to_use, "{snap:?}");
    assert_eq!(snap.size_bytes, size);
    let listed = e
        .ctl
        .list_snapshots(csi::ListSnapshotsRequest {
            source_volume_id: src.volume_id.clone(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "{listed:?}");

    // Writes after the snapshot must not reach the volume made from it.
    let ctx = publish(&e.ctl, &src.volume_id, "node-1").await;
    qemu_io(&ctx["nbdUri"], "write -P 0xff 0 4k");
    unpublish(&e.ctl, &src.volume_id, "node-1").await;

    let mut from_snap = create_req("From-Snapshot", size, &[("numberOfReplicas", "2")]);
    from_snap.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            },
        )),
    });
    let restored = create(&e.ctl, from_snap).await;
    let mut clone_req = create_req("Clone-Of-Source", size, &[]);
    clone_req.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: src.volume_id.clone(),
            },
        )),
    });
    let clone = create(&e.ctl, clone_req).await;

    let ctx = publish(&e.ctl, &restored.volume_id, "node-2").await;
    let got = read_all(&ctx["nbdUri"], &tmp, "restored.img");
    assert_eq!(got.len(), want.len());
    assert_eq!(
        first_difference(&got, &want),
        None,
        "the volume from the snapshot differs"
    );
    unpublish(&e.ctl, &restored.volume_id, "node-2").await;

    let ctx = publish(&e.ctl, &clone.volume_id, "node-1").await;
    let got = read_all(&ctx["nbdUri"], &tmp, "clone.img");
    let mut want_now = want.clone();
    want_now[..4096].fill(0xff);
    assert_eq!(
        first_difference(&got, &want_now),
        None,
        "the clone differs from its source as it was"
    );

    // Online expansion of the published clone: the engine presents the new size.
    let r = e
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: clone.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 2 * size,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .expect("online expand")
        .into_inner();
    assert_eq!(r.capacity_bytes, 2 * size);
    assert!(
        r.node_expansion_required,
        "a filesystem volume needs the node step"
    );
    common::wait_for("the engine to present the new size", 30, || {
        let out = Command::new("nbdinfo")
            .args(["--size", &ctx["nbdUri"]])
            .output()
            .expect("nbdinfo");
        String::from_utf8_lossy(&out.stdout).trim() == (2 * size).to_string()
    });
    qemu_io(&ctx["nbdUri"], "write -P 0x77 63M 1M");
    qemu_io(&ctx["nbdUri"], "read -P 0x77 63M 1M");
    qemu_io(&ctx["nbdUri"], "read -P 0x3c 31M 1M");
    unpublish(&e.ctl, &clone.volume_id, "node-1").await;

    // Offline expansion of the detached source.
    let r = e
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: src.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 3 * size,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .expect("offline expand")
        .into_inner();
    assert_eq!(r.capacity_bytes, 3 * size);
    let ctx = publish(&e.ctl, &src.volume_id, "node-1").await;
    qemu_io(&ctx["nbdUri"], "read -P 0xa5 13M 3M");
    qemu_io(&ctx["nbdUri"], "read -P 0 95M 1M");
    unpublish(&e.ctl, &src.volume_id, "node-1").await;

    // The snapshot goes, then every volume and every replica directory.
    e.ctl
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .expect("delete snapshot");
    for id in [&src.volume_id, &restored.volume_id, &clone.volume_id] {
        delete_volume(&e.ctl, id).await;
    }
    common::wait_for("every replica directory to be removed", 90, || {
        e.up.replica_dirs().is_empty()
    });
    // And no process of theirs runs: not the engines the publishes started (the one of the
    // volume made from the snapshot, on node-2, included), not a replica.
    let t0 = std::time::Instant::now();
    loop {
        let left = e.up.processes();
        if left.is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "zebu processes left after every volume was deleted: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
