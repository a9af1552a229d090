//! The StorageClass parameter `fromBackup` on a real `zebu up` with a real backup target (a
//! directory): CreateVolume restores the named backup into a new 3-replica volume through
//! the manager, answers Aborted while the restore runs (as for clones), and the volume,
//! once published, holds the backed-up volume's data block for block. Repeats find the same
//! volume; a backup that does not exist, a parameter a restore cannot honour, and a content
//! source given as well are refused with a precise code and message.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::ctl::create_req;
use common::{Plugin, Up, mount_cap, qemu_io, read_all};
use tonic::Code;
use zebu_csi::Endpoint;
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;

const MIB: i64 = 1 << 20;

fn ok(up: &Up, args: &[&str]) -> String {
    let out = up.zebu(args);
    assert!(
        out.status.success(),
        "zebu {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_backup_restores_the_backup_into_the_new_volume() {
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-backup")
        .tempdir()
        .expect("tempdir");
    let tmp = dir.path();
    let up = Up::start(tmp, 3);
    let store = tmp.join("backups");
    std::fs::create_dir_all(&store).expect("store dir");
    ok(
        &up,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", store.display()),
        ],
    );

    // A backed-up volume: data at the start, the middle and the end.
    ok(
        &up,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "32M",
            "--replicas",
            "2",
            "--frontend",
            "nbd",
        ],
    );
    let endpoint = ok(&up, &["volume", "attach", "src"]).trim().to_string();
    qemu_io(&endpoint, "write -P 0x5a 0 1M");
    qemu_io(&endpoint, "write -P 0xa5 13M 3M");
    qemu_io(&endpoint, "write -P 0x3c 31M 1M");
    let want = read_all(&endpoint, tmp, "src.img");
    ok(&up, &["backup", "create", "src", "--name", "b1", "--wait"]);
    ok(&up, &["volume", "detach", "src"]);

    let plugin = Plugin::start(
        tmp,
        &up.api,
        "node-1",
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let ch = zebu_csi::connect(&Endpoint::Unix(plugin.socket.clone()))
        .await
        .expect("connect");
    let mut ctl = ControllerClient::new(ch);

    // Refused: a backup that does not exist, a parameter a restore drops, a second source.
    let err = ctl
        .create_volume(create_req(
            "bad",
            32 * MIB,
            &[("fromBackup", "no-such-backup")],
        ))
        .await
        .expect_err("no such backup");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("no-such-backup"), "{err:?}");
    let err = ctl
        .create_volume(create_req(
            "bad",
            32 * MIB,
            &[("fromBackup", "b1"), ("dataLocality", "best-effort")],
        ))
        .await
        .expect_err("dataLocality with fromBackup");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("dataLocality"), "{err:?}");
    let mut both = create_req("bad", 32 * MIB, &[("fromBackup", "b1")]);
    both.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: "src".into(),
            },
        )),
    });
    let err = ctl.create_volume(both).await.expect_err("two sources");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let names: Vec<String> = up.json(&["volume", "ls"])["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|v| v["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert_eq!(names, ["src"], "a refused create left a volume behind");

    // The restore: Aborted while it runs, then the volume; a repeat finds the same one.
    let req = create_req(
        "Restored-From-B1",
        32 * MIB,
        &[("fromBackup", "b1"), ("numberOfReplicas", "3")],
    );
    let t0 = Instant::now();
    let mut aborted = 0;
    let vol = loop {
        match ctl.create_volume(req.clone()).await {
            Ok(r) => break r.into_inner().volume.expect("volume"),
            Err(s) if s.code() == Code::Aborted => {
                aborted += 1;
                assert!(
                    t0.elapsed() < Duration::from_secs(180),
                    "the restore never finished: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(s) => panic!("CreateVolume fromBackup: {s:?}"),
        }
    };
    println!(
        "restored in {:.1} s ({aborted} Aborted answers)",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(vol.capacity_bytes, 32 * MIB);
    let again = ctl
        .create_volume(req.clone())
        .await
        .expect("repeat")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(again.volume_id, vol.volume_id);
    let other = ctl
        .create_volume(create_req("Restored-From-B1", 32 * MIB, &[]))
        .await
        .expect_err("the same name without the backup");
    assert_eq!(other.code(), Code::AlreadyExists, "{other:?}");
    let v = up.json(&["volume", "get", &vol.volume_id]);
    assert_eq!(v["spec"]["numberOfReplicas"], 3, "{v}");
    assert_eq!(v["status"]["restore"]["state"], "completed", "{v}");

    // Its data, block for block.
    let publish = csi::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "node-1".into(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    };
    let ctx: HashMap<String, String> = loop {
        match ctl.controller_publish_volume(publish.clone()).await {
            Ok(r) => break r.into_inner().publish_context,
            Err(s) if s.code() == Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(s) => panic!("ControllerPublishVolume: {s:?}"),
        }
    };
    let got = read_all(&ctx["nbdUri"], tmp, "restored.img");
    assert_eq!(got.len(), want.len());
    assert_eq!(
        got.iter().zip(&want).position(|(a, b)| a != b),
        None,
        "the restored volume differs from the backed-up one"
    );

    loop {
        let r = ctl
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                node_id: "node-1".into(),
                ..Default::default()
            })
            .await;
        match r {
            Ok(_) => break,
            Err(s) if s.code() == Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(s) => panic!("ControllerUnpublishVolume: {s:?}"),
        }
    }
    loop {
        let r = ctl
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: vol.volume_id.clone(),
                ..Default::default()
            })
            .await;
        match r {
            Ok(_) => break,
            Err(s) if s.code() == Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(s) => panic!("DeleteVolume: {s:?}"),
        }
    }
    common::wait_for("the restored volume to go", 60, || {
        up.json(&["volume", "ls"])["items"]
            .as_array()
            .is_some_and(|v| v.len() == 1)
    });
}
