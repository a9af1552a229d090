//! Attach time: ControllerPublishVolume → a usable block device on the node, for a
//! 3-replica volume on `zebu up`, against a reference measured in the same run.
//!
//! One attach, timed from the first ControllerPublishVolume to the first 4 KiB read with
//! `O_DIRECT` from the device NodeStageVolume (block mode) made: publish (retried on
//! Aborted, as csi-attacher does; the manager starts the engine on the node), stage
//! (nbdfuse + a direct-I/O loop device, `--attach nbdfuse`), read. Then unstage and
//! unpublish (not timed), and again, `--attaches` times (default 20).
//!
//! The reference does the same with what any NBD-over-loop attach costs: start a server
//! (nbdkit's `file` plugin on a file of the same size, the engine's counterpart), wait for
//! it to accept, attach its export with the plugin's own nbdfuse + losetup code, read 4 KiB.
//! The ratio is Zebu's median over the reference's; the goal is a median under 2 s.
//!
//! Run: `benches/csi-attach-bench.sh` (builds, then runs this with the debug binaries).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tonic::Code;
use zebu_csi::Endpoint;
use zebu_csi::node::attach::{self, AttachMode, CTX_FRONTEND, CTX_NBD_URI};
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;
use zebu_proto::csi::node_client::NodeClient;

const SIZE: i64 = 64 << 20;

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(csi::volume_capability::AccessType::Block(
            csi::volume_capability::BlockVolume::default(),
        )),
        access_mode: Some(csi::volume_capability::AccessMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}

/// Read the first 4 KiB of `device` with O_DIRECT: the device answers I/O.
fn read_first_block(device: &str) {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .unwrap_or_else(|e| panic!("open {device}: {e}"));
    // O_DIRECT wants an aligned buffer: a 4 KiB-aligned slice of a larger one.
    let mut buf = vec![0u8; 8192];
    let off = buf.as_ptr().align_offset(4096);
    f.read_exact(&mut buf[off..off + 4096])
        .unwrap_or_else(|e| panic!("read {device}: {e}"));
}

fn stats(mut ms: Vec<f64>) -> (f64, f64, f64, f64) {
    ms.sort_by(f64::total_cmp);
    // Nearest rank: the sample at index round((n - 1) * q).
    let at = |percent: usize| ms[((ms.len() - 1) * percent + 50) / 100];
    (at(50), at(90), ms[0], ms[ms.len() - 1])
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let attaches: usize = std::env::args()
        .skip_while(|a| a != "--attaches")
        .nth(1)
        .map_or(20, |n| n.parse().expect("--attaches N"));
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-attach-bench")
        .tempdir()
        .expect("tempdir");
    let up = common::Up::start(dir.path(), 3);
    let plugin = common::Plugin::start(
        dir.path(),
        &up.api,
        "node-1",
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let ch = zebu_csi::connect(&Endpoint::Unix(plugin.socket.clone()))
        .await
        .expect("connect");
    let mut ctl = ControllerClient::new(ch.clone());
    let mut node = NodeClient::new(ch);

    let create = csi::CreateVolumeRequest {
        name: "attach-bench".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: SIZE,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        parameters: HashMap::from([("numberOfReplicas".into(), "3".into())]),
        ..Default::default()
    };
    let volume = ctl
        .create_volume(create)
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let staging = dir.path().join("staging");
    std::fs::create_dir_all(&staging).expect("staging dir");

    let mut zebu = Vec::new();
    let mut calls = Vec::new();
    for i in 0..attaches {
        let t0 = Instant::now();
        let mut publishes = 0;
        let ctx = loop {
            publishes += 1;
            let r = ctl
                .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: volume.clone(),
                    node_id: "node-1".into(),
                    volume_capability: Some(block_cap()),
                    ..Default::default()
                })
                .await;
            match r {
                Ok(r) => break r.into_inner().publish_context,
                // The sidecar's retry; its first backoff is 1 s, this one is shorter so
                // the figure is the plugin's, not the backoff's.
                Err(s) if s.code() == Code::Aborted => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(s) => panic!("ControllerPublishVolume: {s:?}"),
            }
        };
        let published = t0.elapsed();
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: volume.clone(),
            publish_context: ctx,
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(block_cap()),
            ..Default::default()
        })
        .await
        .expect("NodeStageVolume");
        // The device NodeStage made, from the node's state (`<state-dir>/volumes/<id>.json`).
        let state: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                plugin
                    .state_dir
                    .join("volumes")
                    .join(format!("{volume}.json")),
            )
            .expect("the node's state of the staged volume"),
        )
        .expect("state json");
        let device = state["attachment"]["device"]
            .as_str()
            .expect("a device in the node's state")
            .to_string();
        read_first_block(&device);
        let total = t0.elapsed();
        zebu.push(total.as_secs_f64() * 1000.0);
        calls.push(publishes);
        eprintln!(
            "zebu attach {i}: {:.0} ms (publish {:.0} ms in {publishes} call(s)), {device}",
            total.as_secs_f64() * 1000.0,
            published.as_secs_f64() * 1000.0
        );
        node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: volume.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume");
        loop {
            match ctl
                .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: volume.clone(),
                    node_id: "node-1".into(),
                    ..Default::default()
                })
                .await
            {
                Ok(_) => break,
                Err(s) if s.code() == Code::Aborted => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(s) => panic!("ControllerUnpublishVolume: {s:?}"),
            }
        }
    }

    // The reference: nbdkit's file plugin started and attached the same way.
    let file = dir.path().join("reference.img");
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(SIZE as u64))
        .expect("reference file");
    let ref_state = dir.path().join("reference-state");
    std::fs::create_dir_all(&ref_state).expect("dir");
    let mut reference = Vec::new();
    for i in 0..attaches {
        let port = free_port();
        let t0 = Instant::now();
        let mut server = Command::new("nbdkit")
            .args(["--foreground", "--ipaddr", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--exportname", "reference", "file"])
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nbdkit");
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "nbdkit never listened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ctx = HashMap::from([
            (CTX_FRONTEND.to_string(), "nbd".to_string()),
            (
                CTX_NBD_URI.to_string(),
                format!("nbd://127.0.0.1:{port}/reference"),
            ),
        ]);
        let a = attach::attach("reference", AttachMode::Nbdfuse, &ctx, &ref_state)
            .await
            .expect("reference attach");
        read_first_block(a.device());
        let total = t0.elapsed();
        reference.push(total.as_secs_f64() * 1000.0);
        eprintln!(
            "reference attach {i}: {:.0} ms, {}",
            total.as_secs_f64() * 1000.0,
            a.device()
        );
        attach::detach("reference", &a)
            .await
            .expect("reference detach");
        let _ = server.kill();
        let _ = server.wait();
    }

    let (zm, z90, zmin, zmax) = stats(zebu);
    let (rm, r90, rmin, rmax) = stats(reference);
    println!(
        "attach time over {attaches} attaches, ControllerPublishVolume → first O_DIRECT read of the device (ms):"
    );
    println!(
        "  zebu-csi (3 replicas, nbdfuse + loop): median {zm:.0}, p90 {z90:.0}, min {zmin:.0}, max {zmax:.0}; publish calls: {calls:?}"
    );
    println!(
        "  reference (nbdkit file, nbdfuse + loop): median {rm:.0}, p90 {r90:.0}, min {rmin:.0}, max {rmax:.0}"
    );
    println!(
        "  ratio of medians {:.2}; goal: zebu median under 2000 ms: {}",
        zm / rm,
        if zm < 2000.0 { "met" } else { "MISSED" }
    );
    let _ = ctl
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: volume,
            ..Default::default()
        })
        .await;
}
