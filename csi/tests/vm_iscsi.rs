//! The node path with the real Linux iSCSI initiator: `zebu-csi --node --attach iscsi` runs
//! inside a QEMU VM (`vm/node-vm.sh`: a Debian kernel, the real `iscsiadm` and `iscsid`,
//! `mkfs.ext4`, `blkid`, `mount`), because this host's kernel has no initiator. The
//! controller runs on the host against a real `zebu up` with three nodes and publishes a
//! 3-replica volume with the iSCSI frontend; the test then drives the VM's plugin over gRPC
//! (QEMU forwards a host loopback port to it): NodeStage (discovery, login, mkfs of the blank
//! disk, mount), NodePublish, a 16 MiB file written and read back in the VM after dropping
//! its caches, NodeUnpublish, NodeUnstage (the session is gone), NodeStage again on a fresh
//! login (no mkfs: the filesystem is found) and NodePublish, and the file reads back with
//! the same checksum. The engine's portal and target are used exactly as published.
//!
//! The VM's kernel and base initramfs are built from Debian packages on first use and cached
//! under /var/cache/zebu-tools (see the script). The VM runs under KVM when it works here,
//! else TCG; a run takes about a minute under TCG. Needs root (it installs packages and
//! mounts inside the VM only).

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Plugin, Up, mount_cap_fs, retry_aborted};
use tonic::transport::Channel;
use zebu_csi::Endpoint;
use zebu_proto::csi;
use zebu_proto::csi::controller_client::ControllerClient;
use zebu_proto::csi::node_client::NodeClient;

const MIB: i64 = 1 << 20;
/// Inside the VM.
const STAGING: &str = "/var/lib/kubelet/plugins/driver.zebu.io/staging/vol";
const TARGET: &str = "/var/lib/kubelet/pods/pod-1/volumes/vol";

/// A free port on host loopback (released at once; QEMU binds it).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// The QEMU process; killed (by its pid) on drop.
struct Vm {
    child: Child,
    console: std::path::PathBuf,
    shell: SocketAddr,
}

impl Vm {
    fn console_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.console).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Runs `script` in the VM's shell; returns its output and exit status.
    fn sh(&self, script: &str) -> (String, i32) {
        let mut s = TcpStream::connect(self.shell).expect("connect to the VM's shell");
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        s.write_all(format!("{script}\necho \"ZEBU-RC=$?\"\nexit\n").as_bytes())
            .expect("send to the VM's shell");
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = String::new();
        s.read_to_string(&mut out)
            .expect("read the VM's shell output");
        let (body, rc) = out
            .rsplit_once("ZEBU-RC=")
            .unwrap_or_else(|| panic!("no exit status from {script:?}: {out:?}"));
        (
            body.to_string(),
            rc.trim().parse().expect("the exit status is a number"),
        )
    }

    /// Runs `script`, which must succeed.
    fn ok(&self, script: &str) -> String {
        let (out, rc) = self.sh(script);
        assert_eq!(
            rc,
            0,
            "in the VM: {script}\n{out}\nconsole:\n{}",
            self.console_tail()
        );
        out
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn boot_vm(dir: &Path, portal: &str, grpc: u16, shell: u16) -> Vm {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/node-vm.sh");
    let console = dir.join("console.log");
    let work = dir.join("vm");
    std::fs::create_dir_all(&work).expect("vm dir");
    let log = std::fs::File::create(dir.join("node-vm.log")).expect("log");
    let child = Command::new(&script)
        .arg("run")
        .arg("--csi")
        .arg(common::bin_dir().join("zebu-csi"))
        .args(["--portal", portal])
        .args(["--grpc-port", &grpc.to_string()])
        .args(["--shell-port", &shell.to_string()])
        .arg("--console")
        .arg(&console)
        .arg("--workdir")
        .arg(&work)
        .args(["--node", "node-1"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("run node-vm.sh");
    Vm {
        child,
        console,
        shell: SocketAddr::from(([127, 0, 0, 1], shell)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stage_publish_write_unstage_and_stage_again_with_the_real_initiator_in_a_vm() {
    let t0 = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-vm")
        .tempdir()
        .expect("tempdir");
    let up = Up::start(dir.path(), 3);
    let plugin = Plugin::start(
        dir.path(),
        &up.api,
        "node-1",
        &["--controller", "--attach", "iscsi"],
    );
    let ch = zebu_csi::connect(&Endpoint::Unix(plugin.socket.clone()))
        .await
        .expect("connect to the controller");
    let ctl = ControllerClient::new(ch);

    let create = csi::CreateVolumeRequest {
        name: "VM-Node-Path".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 256 * MIB,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap_fs("ext4")],
        parameters: [("numberOfReplicas".to_string(), "3".to_string())].into(),
        ..Default::default()
    };
    let vol = retry_aborted("CreateVolume", || {
        let mut c = ctl.clone();
        let r = create.clone();
        async move { c.create_volume(r).await }
    })
    .await
    .into_inner()
    .volume
    .expect("a volume");
    let id = vol.volume_id.clone();
    let publish = csi::ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: "node-1".into(),
        volume_capability: Some(mount_cap_fs("ext4")),
        ..Default::default()
    };
    let ctx: HashMap<String, String> = retry_aborted("ControllerPublishVolume", || {
        let mut c = ctl.clone();
        let r = publish.clone();
        async move { c.controller_publish_volume(r).await }
    })
    .await
    .into_inner()
    .publish_context;
    assert_eq!(
        ctx.get("frontend").map(String::as_str),
        Some("iscsi"),
        "{ctx:?}"
    );
    let portal = ctx.get("portal").expect("a portal").clone();
    common::wait_for("the volume to be healthy with 3 replicas", 60, || {
        let v = up.json(&["volume", "get", &id]);
        v["status"]["robustness"] == "healthy"
            && v["status"]["replicas"].as_array().map(Vec::len) == Some(3)
    });
    println!("published {id} at {portal}: {:?}", t0.elapsed());

    let (grpc, shell) = (free_port(), free_port());
    let mut vm = boot_vm(dir.path(), &portal, grpc, shell);
    // The VM's plugin answers once the guest has booted (QEMU accepts on the forwarded port
    // before that, and the connection then fails).
    let mut node = None;
    let boot = Instant::now();
    while boot.elapsed() < Duration::from_secs(180) {
        if let Ok(Some(status)) = vm.child.try_wait() {
            panic!(
                "the VM exited ({status}) before its zebu-csi answered; {}:\n{}\nconsole:\n{}",
                dir.path().join("node-vm.log").display(),
                std::fs::read_to_string(dir.path().join("node-vm.log")).unwrap_or_default(),
                vm.console_tail()
            );
        }
        if let Ok(ch) =
            zebu_csi::connect(&Endpoint::Tcp(SocketAddr::from(([127, 0, 0, 1], grpc)))).await
        {
            let mut n = NodeClient::new(ch);
            if let Ok(info) = n.node_get_info(csi::NodeGetInfoRequest {}).await {
                assert_eq!(info.into_inner().node_id, "node-1");
                node = Some(n);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut node: NodeClient<Channel> = node.unwrap_or_else(|| {
        panic!(
            "the VM's zebu-csi never answered; console:\n{}",
            vm.console_tail()
        )
    });
    println!("VM up: {:?} (boot {:?})", t0.elapsed(), boot.elapsed());

    let stage = csi::NodeStageVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: STAGING.into(),
        volume_capability: Some(mount_cap_fs("ext4")),
        ..Default::default()
    };
    let node_publish = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: STAGING.into(),
        target_path: TARGET.into(),
        volume_capability: Some(mount_cap_fs("ext4")),
        ..Default::default()
    };
    let unpublish = csi::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: TARGET.into(),
    };
    let unstage = csi::NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: STAGING.into(),
    };

    // Stage: discovery and login with iscsiadm, a blank disk gets ext4.
    node.node_stage_volume(stage.clone())
        .await
        .unwrap_or_else(|s| panic!("NodeStage: {s:?}\nconsole:\n{}", vm.console_tail()));
    let sessions = vm.ok("iscsiadm -m session");
    let iqn = &ctx["iqn"];
    assert!(
        sessions.contains(iqn.as_str()) && sessions.contains(portal.as_str()),
        "one session to {iqn} at {portal}: {sessions}"
    );
    let staged = vm.ok(&format!("grep ' {STAGING} ' /proc/mounts"));
    assert!(
        staged.starts_with("/dev/sd") && staged.contains(" ext4 "),
        "the staging path is the iSCSI disk's ext4: {staged}"
    );
    let first_disk = staged.split(' ').next().expect("a device").to_string();
    node.node_publish_volume(node_publish.clone())
        .await
        .unwrap_or_else(|s| panic!("NodePublish: {s:?}"));
    assert!(
        vm.ok(&format!("grep ' {TARGET} ' /proc/mounts"))
            .contains(" ext4 "),
        "the target is mounted"
    );
    println!("staged and published on {first_disk}: {:?}", t0.elapsed());

    // Write through the filesystem, flush, read back from the disk (not the page cache).
    let sum = vm.ok(&format!(
        "dd if=/dev/urandom of={TARGET}/data.bin bs=1M count=16 2>/dev/null && sync && \
         sha256sum {TARGET}/data.bin | cut -d' ' -f1"
    ));
    let sum = sum.trim().to_string();
    assert_eq!(sum.len(), 64, "a sha256: {sum}");
    let again = vm.ok(&format!(
        "echo 3 > /proc/sys/vm/drop_caches && sha256sum {TARGET}/data.bin | cut -d' ' -f1"
    ));
    assert_eq!(
        again.trim(),
        sum,
        "the file reads back after dropping the caches"
    );

    // Unpublish and unstage: no mount, no session left in the VM.
    node.node_unpublish_volume(unpublish.clone())
        .await
        .unwrap_or_else(|s| panic!("NodeUnpublish: {s:?}"));
    node.node_unstage_volume(unstage.clone())
        .await
        .unwrap_or_else(|s| panic!("NodeUnstage: {s:?}"));
    let (mounts, _) = vm.sh("cat /proc/mounts");
    assert!(
        !mounts.contains(STAGING) && !mounts.contains(TARGET),
        "nothing mounted after unstage: {mounts}"
    );
    let (sessions, rc) = vm.sh("iscsiadm -m session");
    assert_eq!(
        rc, 21,
        "no session after unstage (iscsiadm exits 21): {sessions}"
    );
    let (disk, rc) = vm.sh(&format!("test -b {first_disk}"));
    assert_ne!(rc, 0, "{first_disk} is gone after the logout: {disk}");
    println!("unstaged: {:?}", t0.elapsed());

    // Stage again: a new login and a new disk; the filesystem is found, not made again, and
    // the file reads back.
    node.node_stage_volume(stage.clone())
        .await
        .unwrap_or_else(|s| panic!("NodeStage again: {s:?}\nconsole:\n{}", vm.console_tail()));
    node.node_publish_volume(node_publish.clone())
        .await
        .unwrap_or_else(|s| panic!("NodePublish again: {s:?}"));
    let back = vm.ok(&format!("sha256sum {TARGET}/data.bin | cut -d' ' -f1"));
    assert_eq!(
        back.trim(),
        sum,
        "the file reads back after unstage and stage"
    );
    println!("staged again, data verified: {:?}", t0.elapsed());

    node.node_unpublish_volume(unpublish)
        .await
        .unwrap_or_else(|s| panic!("NodeUnpublish: {s:?}"));
    node.node_unstage_volume(unstage)
        .await
        .unwrap_or_else(|s| panic!("NodeUnstage: {s:?}"));
    drop(vm);
    let unpub = csi::ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: "node-1".into(),
        ..Default::default()
    };
    retry_aborted("ControllerUnpublishVolume", || {
        let mut c = ctl.clone();
        let r = unpub.clone();
        async move { c.controller_unpublish_volume(r).await }
    })
    .await;
    let del = csi::DeleteVolumeRequest {
        volume_id: id.clone(),
        ..Default::default()
    };
    retry_aborted("DeleteVolume", || {
        let mut c = ctl.clone();
        let r = del.clone();
        async move { c.delete_volume(r).await }
    })
    .await;
    common::wait_for("no zebu process of the volume left", 60, || {
        up.processes().iter().all(|(_, cmd)| !cmd.contains(&id))
    });
    println!("wall time {:?}", t0.elapsed());
}
