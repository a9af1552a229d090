//! csi-sanity v5.4.0 (the upstream conformance suite, built by `tests/k8s/tools.sh`) against
//! a real `zebu-csi --controller --node --attach nbdfuse` on a real `zebu up` with three
//! nodes: every group the plugin advertises, node tests included (real nbdfuse attaches,
//! loop devices, mkfs and mounts). It must end with 0 failed; the skipped specs are printed
//! with csi-sanity's reasons (from its JUnit report), and the ones expected to be skipped
//! are listed in [`EXPECTED_SKIPS`] so a new skip fails the test instead of hiding.
//!
//! Afterwards nothing may be left: no mount or loop device under the test directory, no
//! volume in the manager, no replica directory.

mod common;

use std::process::Command;

use common::{Plugin, Up, k8s_tool, loops_under, mounts_under, wait_for};

/// Why csi-sanity may skip a spec against this plugin (words of its reason, lower case, and
/// ours).
const EXPECTED_SKIPS: &[(&str, &str)] = &[
    // No MODIFY_VOLUME capability: no mutable parameters, no VolumeAttributesClass.
    (
        "modify volume not supported",
        "MODIFY_VOLUME is not offered",
    ),
    (
        "controllermodifyvolume not supported",
        "MODIFY_VOLUME is not offered",
    ),
    // The attach-limit spec is opt-in (csi.testnodevolumeattachlimit).
    (
        "testnodevolumeattachlimit not enabled",
        "opt-in; the node limit is --max-volumes",
    ),
    // No PUBLISH_READONLY capability: read-only is decided at NodePublish.
    (
        "readonly field not supported",
        "PUBLISH_READONLY is not offered",
    ),
    // No group controller service (VolumeGroupSnapshots).
    (
        "groupcontrollerservice not supported",
        "no group controller service",
    ),
    // Marked pending in csi-sanity v5.4.0 itself.
    ("pending", "pending upstream"),
];

#[test]
fn csi_sanity_passes_with_real_staging_and_mounts() {
    let sanity = k8s_tool("csi-sanity");
    let dir = tempfile::Builder::new()
        .prefix("zebu-csi-sanity")
        .tempdir()
        .expect("tempdir");
    let up = Up::start(dir.path(), 3);
    let mut plugin = Plugin::start(
        dir.path(),
        &up.api,
        "node-1",
        &["--controller", "--node", "--attach", "nbdfuse"],
    );
    let junit = dir.path().join("junit.xml");
    let staging = dir.path().join("staging");
    let mount = dir.path().join("mount");
    let params = dir.path().join("params.yaml");
    // Two replicas keep the suite fast on two cores; placement and replication are the
    // manager's tests' subject.
    std::fs::write(&params, "numberOfReplicas: \"2\"\n").expect("params");
    let out = Command::new(&sanity)
        .arg(format!("-csi.endpoint=unix://{}", plugin.socket.display()))
        .arg(format!("-csi.stagingdir={}", staging.display()))
        .arg(format!("-csi.mountdir={}", mount.display()))
        .arg(format!("-csi.testvolumeparameters={}", params.display()))
        .arg(format!("-csi.junitfile={}", junit.display()))
        // 64 MiB: mkfs is quick, the expansion test doubles it.
        .arg("-csi.testvolumesize=67108864")
        .arg("-csi.testvolumeexpandsize=134217728")
        .arg("-ginkgo.timeout=40m")
        .arg("-ginkgo.no-color")
        .output()
        .expect("run csi-sanity");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = std::fs::read_to_string(&junit).unwrap_or_default();
    let (failed, skipped) = junit_results(&report);
    eprintln!("csi-sanity:\n{}", tail(&stdout, 60));
    for (name, why) in &skipped {
        let ours = EXPECTED_SKIPS
            .iter()
            .find(|(w, _)| why.to_lowercase().contains(w))
            .map_or("NOT EXPECTED", |(_, o)| o);
        eprintln!("skipped: {name}: {why} ({ours})");
    }
    let summary = stdout
        .lines()
        .rev()
        .find(|l| l.contains("Passed") && l.contains("Failed"))
        .unwrap_or("")
        .to_string();
    eprintln!("summary: {summary}");
    if !out.status.success() || !failed.is_empty() {
        eprintln!("zebu-csi log:\n{}", tail(&plugin.proc.log_text(), 200));
        panic!(
            "csi-sanity failed ({}): {} failed: {failed:#?}",
            out.status,
            failed.len()
        );
    }
    let unexplained: Vec<&Spec> = skipped
        .iter()
        .filter(|(_, why)| {
            !EXPECTED_SKIPS
                .iter()
                .any(|(w, _)| why.to_lowercase().contains(w))
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "specs skipped that EXPECTED_SKIPS does not explain: {unexplained:#?}"
    );
    let passed = count_passed(&report);
    assert!(passed >= 60, "only {passed} specs passed: {summary}");
    // Node specs really ran: they stage and mount.
    assert!(
        report.contains("Node Service"),
        "no node spec in the report: {summary}"
    );

    // csi-sanity cleans up what it created: nothing may be left on the host or in Zebu.
    plugin.proc.stop();
    assert_eq!(
        mounts_under(dir.path()),
        Vec::<String>::new(),
        "mounts left"
    );
    assert_eq!(
        loops_under(dir.path()),
        Vec::<String>::new(),
        "loop devices left"
    );
    wait_for("every volume to be deleted", 60, || {
        let v = up.json(&["volume", "ls"]);
        v["items"].as_array().is_some_and(Vec::is_empty)
    });
    wait_for("every replica directory to be removed", 60, || {
        up.replica_dirs().is_empty()
    });
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Attribute `name` of an XML start tag's text.
fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!("{name}=\"");
    let start = tag.find(&key)? + key.len();
    let end = tag[start..].find('"')? + start;
    Some(
        tag[start..end]
            .replace("&#39;", "'")
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

/// A spec's name and csi-sanity's message about it.
type Spec = (String, String);

/// The failed specs (name and message) and the skipped ones (name and reason) of a JUnit
/// report as ginkgo writes it.
fn junit_results(report: &str) -> (Vec<Spec>, Vec<Spec>) {
    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    for case in report.split("<testcase ").skip(1) {
        let head = case.split('>').next().unwrap_or("");
        let name = attr(head, "name").unwrap_or_default();
        let body = case.split("</testcase>").next().unwrap_or("");
        if let Some(i) = body.find("<failure").or_else(|| body.find("<error")) {
            let tag = body[i..].split('>').next().unwrap_or("");
            failed.push((name, attr(tag, "message").unwrap_or_default()));
        } else if let Some(i) = body.find("<skipped") {
            let tag = body[i..].split('>').next().unwrap_or("");
            skipped.push((name, attr(tag, "message").unwrap_or_default()));
        }
    }
    (failed, skipped)
}

fn count_passed(report: &str) -> usize {
    report
        .split("<testcase ")
        .skip(1)
        .filter(|c| {
            let head = c.split('>').next().unwrap_or("");
            attr(head, "status").as_deref() == Some("passed")
        })
        .count()
}
