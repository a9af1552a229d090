//! `zebu-csi` behind the upstream sidecars on a real Kubernetes control plane
//! (`tests/k8s/cluster.sh`: etcd, kube-apiserver, kube-controller-manager with its
//! persistent-volume binder, attach-detach and expander controllers; no kubelet, no
//! scheduler). The sidecars (csi-provisioner, csi-attacher, csi-resizer, csi-snapshotter)
//! and the snapshot-controller run as processes against the plugin's Unix socket, as they
//! run beside it in the controller Deployment; the manager is `zebu up` (three nodes on the
//! embedded store), so Kubernetes hosts only the PVC side of things.
//!
//! What a user does, and what must follow:
//! - a PVC on StorageClass `zebu` → a Bound PV and a 3-replica volume in the manager;
//! - a pod with `spec.nodeName` on a Node whose CSINode names the driver → the attach-detach
//!   controller's VolumeAttachment is attached (the plugin attached with NBD here: the
//!   publish context is the engine's NBD URI) and the engine serves on that node, healthy;
//! - a VolumeSnapshot → readyToUse; a PVC from it and a PVC cloned from the first are Bound
//!   and hold, block for block, the first volume's data as it was at the snapshot and at the
//!   clone;
//! - raising the PVC's request expands the volume (online: the engine presents the size);
//! - deleting everything removes every volume, engine process and replica directory.

mod common;
#[path = "../../manager/tests/k8s/mod.rs"]
mod k8s;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Plugin, Proc, Up, first_difference, qemu_io, read_all};
use serde_json::Value;

const DRIVER: &str = "driver.zebu.io";
const MIB: u64 = 1 << 20;

/// kubectl as the cluster's admin, in the test's namespace.
struct Kube<'a> {
    cluster: &'a k8s::Cluster,
    ns: String,
    dir: &'a Path,
}

impl Kube<'_> {
    fn run(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["--namespace", self.ns.as_str()];
        all.extend(args);
        self.cluster.kubectl(&self.cluster.admin(), &all)
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// kubectl without the test's namespace (objects that name their own).
    fn ok_anywhere(&self, args: &[&str]) -> String {
        let out = self.cluster.kubectl(&self.cluster.admin(), args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply --server-side` of a YAML document.
    fn apply(&self, name: &str, yaml: &str) {
        let path = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&path, yaml).expect("write manifest");
        self.ok(&[
            "apply",
            "--server-side",
            "--field-manager=zebu-csi-tests",
            "-f",
            path.to_str().expect("utf-8 path"),
        ]);
    }

    /// The object as JSON, `None` when it does not exist.
    fn get(&self, what: &str) -> Option<Value> {
        let out = self.run(&["get", what, "-o", "json"]);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("NotFound"), "kubectl get {what}: {err}");
            return None;
        }
        Some(serde_json::from_slice(&out.stdout).expect("kubectl json"))
    }

    fn items(&self, kind: &str) -> Vec<Value> {
        let v: Value =
            serde_json::from_str(&self.ok(&["get", kind, "-o", "json"])).expect("kubectl json");
        v["items"].as_array().cloned().unwrap_or_default()
    }
}

/// Poll `f` every 250 ms until it gives a value, at most `secs`; panics naming `what` with
/// `why()` (the state that explains a timeout).
fn wait_some<T>(
    what: &str,
    secs: u64,
    mut f: impl FnMut() -> Option<T>,
    why: impl Fn() -> String,
) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out after {secs} s waiting for {what}: {}",
            why()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn sidecar(dir: &Path, name: &str, bin: &str, args: &[&str]) -> Proc {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    common::spawn(
        name,
        &common::k8s_tool(bin),
        &args,
        &dir.join(format!("{name}.log")),
    )
}

fn log_tails(procs: &[&Proc]) -> String {
    procs
        .iter()
        .map(|p| {
            let text = p.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            format!("--- {} ---\n{tail}", p.name)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The engine processes of `volume` (its name follows `--volume` on their command line).
fn engine_pids(volume: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let argv = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let argv: Vec<&[u8]> = argv.split(|b| *b == 0).collect();
        let is_engine = argv.first().is_some_and(|a| a.ends_with(b"zebu-engine"));
        let of_volume = argv
            .windows(2)
            .any(|w| w[0] == b"--volume" && w[1] == volume.as_bytes());
        if is_engine && of_volume {
            pids.push(pid);
        }
    }
    pids
}

fn pvc(name: &str, size: &str, source: Option<(&str, &str, &str)>) -> String {
    let source = source.map_or(String::new(), |(group, kind, from)| {
        let group = if group.is_empty() {
            String::new()
        } else {
            format!("\n    apiGroup: {group}")
        };
        format!("\n  dataSource:{group}\n    kind: {kind}\n    name: {from}")
    });
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\nspec:\n  storageClassName: zebu\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: {size}{source}\n"
    )
}

fn pod(name: &str, node: &str, claim: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  nodeName: {node}\n  automountServiceAccountToken: false\n  containers:\n    - name: app\n      image: registry.invalid/none:0\n      volumeMounts:\n        - name: data\n          mountPath: /data\n  volumes:\n    - name: data\n      persistentVolumeClaim:\n        claimName: {claim}\n"
    )
}

#[test]
fn pvc_attach_snapshot_clone_expand_and_delete_through_the_sidecars() {
    let t0 = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-kube")
        .tempdir()
        .expect("tempdir");
    let tmp = dir.path();
    let cluster = k8s::Cluster::ensure();
    let up = Up::start(tmp, 3);
    let mut plugin = Plugin::start(
        tmp,
        &up.api,
        "node-1",
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let sock = plugin.socket.display().to_string();
    let ns = format!("csi-e2e-{}", std::process::id());
    let kube = Kube {
        cluster: &cluster,
        ns: ns.clone(),
        dir: tmp,
    };

    // The snapshot CRDs, which a cluster installs once for every CSI driver (from the
    // external-snapshotter release the tools are built from).
    let crds = common::k8s_tool("csi-snapshotter")
        .parent()
        .and_then(Path::parent)
        .expect("the tool cache entry")
        .join("crd");
    for crd in [
        "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
        "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
        "snapshot.storage.k8s.io_volumesnapshots.yaml",
    ] {
        kube.ok(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            crds.join(crd).to_str().expect("utf-8 path"),
        ]);
    }
    for crd in [
        "volumesnapshotclasses",
        "volumesnapshotcontents",
        "volumesnapshots",
    ] {
        kube.ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &format!("crd/{crd}.snapshot.storage.k8s.io"),
        ]);
    }
    // The driver's cluster-wide objects as deploy/'s chart renders them (with the snapshot
    // API present, as it is now), applied server-side like deploy/zebu.yaml: the same
    // objects another test may have installed already, so this is idempotent.
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/chart");
    let out = Command::new(common::k8s_tool("helm"))
        .args(["template", "zebu"])
        .arg(&chart)
        .args([
            "--namespace",
            "zebu-system",
            "--api-versions",
            "snapshot.storage.k8s.io/v1/VolumeSnapshotClass",
            "--show-only",
            "templates/csi-driver.yaml",
            "--show-only",
            "templates/csi-storageclass.yaml",
            "--show-only",
            "templates/csi-snapshotclass.yaml",
            "--show-only",
            "templates/namespace.yaml",
            "--show-only",
            "templates/csi-rbac.yaml",
        ])
        .output()
        .expect("helm template");
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = tmp.join("csi-objects.yaml");
    std::fs::write(&rendered, &out.stdout).expect("write");
    kube.ok_anywhere(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=zebu-csi-tests",
        "-f",
        rendered.to_str().expect("utf-8 path"),
    ]);
    let driver = kube.get("csidriver/driver.zebu.io").expect("CSIDriver");
    assert_eq!(driver["spec"]["attachRequired"], true, "{driver}");
    let sc = kube.get("storageclass/zebu").expect("storage class");
    assert_eq!(sc["provisioner"], DRIVER, "{sc}");
    assert_eq!(sc["parameters"]["numberOfReplicas"], "3", "{sc}");
    assert_eq!(sc["allowVolumeExpansion"], true, "{sc}");
    let class = kube
        .get("volumesnapshotclass/zebu")
        .expect("snapshot class");
    assert_eq!(class["driver"], DRIVER, "{class}");
    let backup_class = kube
        .get("volumesnapshotclass/zebu-backup")
        .expect("backup snapshot class");
    assert_eq!(backup_class["driver"], DRIVER, "{backup_class}");
    assert_eq!(
        backup_class["parameters"]["type"], "backup",
        "{backup_class}"
    );
    let node = format!("csi-e2e-{}-node", std::process::id());
    kube.apply(
        "node",
        &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n  labels:\n    topology.zebu.io/node: node-1\n  annotations:\n    volumes.kubernetes.io/controller-managed-attach-detach: \"true\"\n"),
    );
    kube.apply(
        "csinode",
        &format!("apiVersion: storage.k8s.io/v1\nkind: CSINode\nmetadata:\n  name: {node}\nspec:\n  drivers:\n    - name: {DRIVER}\n      nodeID: node-1\n      topologyKeys: [topology.zebu.io/node]\n"),
    );
    kube.ok(&["create", "namespace", &ns]);
    wait_some(
        "the namespace's default ServiceAccount",
        60,
        || kube.get("serviceaccount/default"),
        String::new,
    );

    // The sidecars, as the controller Deployment runs them (short retry intervals: the
    // plugin answers "in progress" instead of blocking, and the test should not wait out
    // the default five-minute backoff).
    let csi = format!("--csi-address={sock}");
    // The sidecars run as the chart's ServiceAccount with the chart's ClusterRole, so a
    // right missing from csi-rbac.yaml fails here; the snapshot-controller (the cluster's,
    // not the driver's) runs as the admin.
    let token = kube.ok_anywhere(&[
        "create",
        "token",
        "zebu-csi-controller",
        "--namespace=zebu-system",
        "--duration=2h",
    ]);
    let sidecar_kubeconfig = tmp.join("sidecars.kubeconfig");
    std::fs::write(
        &sidecar_kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n  - name: c\n    cluster:\n      server: {}\n      certificate-authority: {}\nusers:\n  - name: u\n    user:\n      token: {}\ncontexts:\n  - name: x\n    context:\n      cluster: c\n      user: u\ncurrent-context: x\n",
            cluster.get("ZEBU_K8S_SERVER"),
            cluster.get("ZEBU_K8S_CA"),
            token.trim()
        ),
    )
    .expect("write kubeconfig");
    let kc = format!("--kubeconfig={}", sidecar_kubeconfig.display());
    let admin_kc = format!("--kubeconfig={}", cluster.admin().display());
    let common_args = [csi.as_str(), kc.as_str(), "--v=2"];
    let with = |extra: &[&'static str]| {
        let mut a: Vec<&str> = common_args.to_vec();
        a.extend(extra);
        a
    };
    let provisioner = sidecar(
        tmp,
        "csi-provisioner",
        "csi-provisioner",
        &with(&[
            "--timeout=30s",
            "--retry-interval-max=2s",
            "--extra-create-metadata",
        ]),
    );
    let attacher = sidecar(
        tmp,
        "csi-attacher",
        "csi-attacher",
        &with(&["--timeout=30s", "--retry-interval-max=2s"]),
    );
    let resizer = sidecar(
        tmp,
        "csi-resizer",
        "csi-resizer",
        &with(&["--timeout=30s", "--retry-interval-max=2s"]),
    );
    let snapshotter = sidecar(
        tmp,
        "csi-snapshotter",
        "csi-snapshotter",
        &with(&["--timeout=30s", "--retry-interval-max=2s"]),
    );
    let snapshot_controller = sidecar(
        tmp,
        "snapshot-controller",
        "snapshot-controller",
        &[admin_kc.as_str(), "--v=2", "--retry-interval-max=2s"],
    );
    let why = || {
        format!(
            "{}\n--- zebu-csi ---\n{}",
            log_tails(&[
                &provisioner,
                &attacher,
                &resizer,
                &snapshotter,
                &snapshot_controller
            ]),
            plugin
                .proc
                .log_text()
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .join("\n")
        )
    };

    // 1. A PVC → a Bound PV and a 3-replica volume.
    kube.apply("pvc-src", &pvc("src", "64Mi", None));
    let pv_of = |claim: &str| -> Option<String> {
        let p = kube.get(&format!("pvc/{claim}"))?;
        (p["status"]["phase"] == "Bound")
            .then(|| p["spec"]["volumeName"].as_str().map(str::to_string))?
    };
    let src_pv = wait_some("PVC src to be Bound", 120, || pv_of("src"), why);
    let handle = |pv: &str| -> String {
        let pv = kube.get(&format!("pv/{pv}")).expect("the bound PV");
        assert_eq!(pv["spec"]["csi"]["driver"], DRIVER, "{pv}");
        pv["spec"]["csi"]["volumeHandle"]
            .as_str()
            .expect("volumeHandle")
            .to_string()
    };
    let src = handle(&src_pv);
    let v = up.json(&["volume", "get", &src]);
    assert_eq!(v["spec"]["numberOfReplicas"], 3, "{v}");
    assert_eq!(v["spec"]["size"], 64 * MIB, "{v}");
    println!("bound: {} s", t0.elapsed().as_secs());

    // 2. A pod on the node → an attached VolumeAttachment and an engine on that node.
    kube.apply("pod-src", &pod("app-src", &node, "src"));
    let attached = |pv: &str| -> Option<String> {
        kube.items("volumeattachments").into_iter().find_map(|va| {
            (va["spec"]["source"]["persistentVolumeName"] == pv && va["status"]["attached"] == true)
                .then(|| {
                    assert_eq!(va["spec"]["nodeName"], node.as_str(), "{va}");
                    assert_eq!(
                        va["status"]["attachmentMetadata"]["frontend"], "nbd",
                        "{va}"
                    );
                    va["status"]["attachmentMetadata"]["nbdUri"]
                        .as_str()
                        .expect("an NBD URI in the publish context")
                        .to_string()
                })
        })
    };
    let uri = wait_some(
        "the VolumeAttachment of src",
        120,
        || attached(&src_pv),
        why,
    );
    let v = up.json(&["volume", "get", &src]);
    assert_eq!(v["status"]["state"], "attached", "{v}");
    assert_eq!(v["status"]["currentNode"], "node-1", "{v}");
    assert_eq!(engine_pids(&src).len(), 1, "one engine serves {src}");
    wait_some(
        "the volume to be healthy with 3 replicas",
        60,
        || {
            let v = up.json(&["volume", "get", &src]);
            (v["status"]["robustness"] == "healthy"
                && v["status"]["replicas"].as_array().map(Vec::len) == Some(3))
            .then_some(())
        },
        || up.json(&["volume", "get", &src]).to_string(),
    );
    println!("attached: {} s", t0.elapsed().as_secs());

    // Data at the start, the middle and the end; the rest stays holes.
    qemu_io(&uri, "write -P 0x5a 0 1M");
    qemu_io(&uri, "write -P 0xa5 29M 3M");
    qemu_io(&uri, "write -P 0x3c 63M 1M");
    let at_snapshot = read_all(&uri, tmp, "src-at-snapshot.img");
    assert_eq!(at_snapshot.len() as u64, 64 * MIB);

    // 3. A VolumeSnapshot of the attached volume → readyToUse.
    kube.apply(
        "snap",
        "apiVersion: snapshot.storage.k8s.io/v1\nkind: VolumeSnapshot\nmetadata:\n  name: snap\nspec:\n  volumeSnapshotClassName: zebu\n  source:\n    persistentVolumeClaimName: src\n",
    );
    wait_some(
        "VolumeSnapshot snap to be readyToUse",
        120,
        || {
            kube.get("volumesnapshot/snap")
                .filter(|s| s["status"]["readyToUse"] == true)
        },
        why,
    );
    println!("snapshot ready: {} s", t0.elapsed().as_secs());
    // Written after the snapshot: in the clone, not in the volume from the snapshot.
    qemu_io(&uri, "write -P 0xff 0 64k");
    let at_clone = read_all(&uri, tmp, "src-at-clone.img");

    // 4. A PVC from the snapshot and a clone of src: Bound, holding src's data.
    kube.apply(
        "pvc-restored",
        &pvc(
            "restored",
            "64Mi",
            Some(("snapshot.storage.k8s.io", "VolumeSnapshot", "snap")),
        ),
    );
    kube.apply(
        "pvc-clone",
        &pvc("clone", "64Mi", Some(("", "PersistentVolumeClaim", "src"))),
    );
    let restored_pv = wait_some("PVC restored to be Bound", 180, || pv_of("restored"), why);
    let clone_pv = wait_some("PVC clone to be Bound", 180, || pv_of("clone"), why);
    let restored = handle(&restored_pv);
    let clone = handle(&clone_pv);
    println!("restored and clone bound: {} s", t0.elapsed().as_secs());
    kube.apply("pod-restored", &pod("app-restored", &node, "restored"));
    kube.apply("pod-clone", &pod("app-clone", &node, "clone"));
    let restored_uri = wait_some(
        "the VolumeAttachment of restored",
        120,
        || attached(&restored_pv),
        why,
    );
    let clone_uri = wait_some(
        "the VolumeAttachment of clone",
        120,
        || attached(&clone_pv),
        why,
    );
    let got = read_all(&restored_uri, tmp, "restored.img");
    assert_eq!(
        first_difference(&got, &at_snapshot),
        None,
        "the PVC from the snapshot differs from src at the snapshot"
    );
    let got = read_all(&clone_uri, tmp, "clone.img");
    assert_eq!(
        first_difference(&got, &at_clone),
        None,
        "the cloned PVC differs from src at the clone"
    );
    println!("data checked: {} s", t0.elapsed().as_secs());

    // 5. Raising the request expands the volume, online: the engine presents the size.
    kube.ok(&[
        "patch",
        "pvc",
        "src",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    wait_some(
        "the volume to grow to 128 MiB",
        120,
        || {
            let v = up.json(&["volume", "get", &src]);
            (v["spec"]["size"] == 128 * MIB).then_some(())
        },
        why,
    );
    wait_some(
        "the PV to say 128Mi",
        60,
        || {
            kube.get(&format!("pv/{src_pv}"))
                .filter(|pv| pv["spec"]["capacity"]["storage"] == "128Mi")
        },
        why,
    );
    wait_some(
        "the engine to present 128 MiB",
        30,
        || {
            let out = Command::new("nbdinfo")
                .args(["--size", &uri])
                .output()
                .expect("nbdinfo");
            (String::from_utf8_lossy(&out.stdout).trim() == (128 * MIB).to_string()).then_some(())
        },
        why,
    );
    qemu_io(&uri, "read -P 0x3c 63M 1M");
    println!("expanded: {} s", t0.elapsed().as_secs());

    // 6. Delete the pods (no kubelet: forced), the snapshot and the PVCs → no volume, no
    // engine, no replica directory.
    for p in ["app-src", "app-restored", "app-clone"] {
        kube.ok(&[
            "delete",
            "pod",
            p,
            "--grace-period=0",
            "--force",
            "--wait=false",
        ]);
    }
    wait_some(
        "the VolumeAttachments to go",
        120,
        || {
            let pvs = [&src_pv, &restored_pv, &clone_pv];
            kube.items("volumeattachments")
                .iter()
                .all(|va| {
                    let pv = va["spec"]["source"]["persistentVolumeName"].as_str();
                    !pvs.iter().any(|p| Some(p.as_str()) == pv)
                })
                .then_some(())
        },
        why,
    );
    kube.ok(&["delete", "volumesnapshot", "snap", "--wait=false"]);
    for c in ["restored", "clone", "src"] {
        kube.ok(&["delete", "pvc", c, "--wait=false"]);
    }
    wait_some(
        "the PVs to go",
        180,
        || {
            [&src_pv, &restored_pv, &clone_pv]
                .iter()
                .all(|pv| kube.get(&format!("pv/{pv}")).is_none())
                .then_some(())
        },
        why,
    );
    wait_some(
        "the volumes to go from the manager",
        60,
        || {
            let v = up.json(&["volume", "ls"]);
            v["items"]
                .as_array()
                .is_some_and(Vec::is_empty)
                .then_some(())
        },
        || up.json(&["volume", "ls"]).to_string(),
    );
    wait_some(
        "every replica directory to go",
        60,
        || up.replica_dirs().is_empty().then_some(()),
        || format!("{:?}", up.replica_dirs()),
    );
    for v in [&src, &restored, &clone] {
        assert!(
            engine_pids(v).is_empty(),
            "an engine of {v} is still running"
        );
    }
    assert!(common::loops_under(tmp).is_empty());
    println!("all gone: {} s", t0.elapsed().as_secs());

    kube.ok(&["delete", "namespace", &ns, "--wait=false"]);
    let _ = Command::new(cluster.get("ZEBU_KUBECTL"))
        .arg("--kubeconfig")
        .arg(cluster.admin())
        .args(["delete", "csinode", &node, "--wait=false"])
        .output();
    let _ = Command::new(cluster.get("ZEBU_KUBECTL"))
        .arg("--kubeconfig")
        .arg(cluster.admin())
        .args(["delete", "node", &node, "--wait=false"])
        .output();
    plugin.proc.stop();
}
