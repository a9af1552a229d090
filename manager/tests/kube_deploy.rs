//! `deploy/`: the Helm chart, the plain manifests rendered from it, and what a real API
//! server and a real manager's rights make of them.
//!
//! - `deploy/zebu.yaml` is exactly what `deploy/render.sh` renders from the chart (drift);
//! - the chart's CRDs are deploy/crds itself (`deploy/chart/crds` is a link to it, so the
//!   generated CRDs, whose drift `zebu-kube-store` checks, are the ones Helm installs);
//! - every rendered manifest passes `kubernetes-validate --strict`;
//! - they apply to a real kube-apiserver with `kubectl apply --server-side` (the DaemonSets
//!   start no pods there: no kubelet);
//! - the rendered Role is enough for the Leases of a cluster of managers: three members
//!   run as the `zebu-manager` user with only that Role (`kube_leases.rs` does the rest);
//! - the Role names every Zebu kind with the verbs the kube store uses, its status
//!   subresource, Leases and Secrets, and nothing it does not need (patch, escalation).

use std::process::Command;

mod k8s;
use k8s::{Cluster, repo, tool};

#[test]
fn the_rendered_manifests_are_the_charts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("zebu.yaml");
    let status = Command::new(repo().join("deploy/render.sh"))
        .arg(&out)
        .env("HELM", tool("helm"))
        .status()
        .expect("run deploy/render.sh");
    assert!(status.success());
    let want = std::fs::read_to_string(&out).expect("rendered");
    let got = std::fs::read_to_string(repo().join("deploy/zebu.yaml")).expect("deploy/zebu.yaml");
    assert!(
        want == got,
        "deploy/zebu.yaml drifted from deploy/chart: run deploy/render.sh and commit it"
    );
}

#[test]
fn the_charts_crds_are_deploy_crds() {
    let chart = std::fs::canonicalize(repo().join("deploy/chart/crds")).expect("chart/crds");
    let crds = std::fs::canonicalize(repo().join("deploy/crds")).expect("deploy/crds");
    assert_eq!(
        chart, crds,
        "deploy/chart/crds must be a link to deploy/crds"
    );
    let rendered = std::fs::read_to_string(repo().join("deploy/zebu.yaml")).expect("zebu.yaml");
    for e in std::fs::read_dir(&crds).expect("deploy/crds").flatten() {
        let name = e.file_name().to_string_lossy().replace(".yaml", "");
        assert!(
            rendered.contains(&format!("  name: {name}\n")),
            "deploy/zebu.yaml lacks the CRD {name}"
        );
    }
}

/// The Role `zebu-manager` in deploy/zebu.yaml: (apiGroup, resource) -> verbs.
fn rendered_role_rules() -> std::collections::BTreeMap<(String, String), Vec<String>> {
    let text = std::fs::read_to_string(repo().join("deploy/zebu.yaml")).expect("zebu.yaml");
    let mut rules = std::collections::BTreeMap::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("yaml");
        if v["kind"] != "Role" || v["metadata"]["name"] != "zebu-manager" {
            continue;
        }
        for r in v["rules"].as_array().expect("rules") {
            let strings = |k: &str| -> Vec<String> {
                r[k].as_array()
                    .expect("a list")
                    .iter()
                    .map(|s| s.as_str().expect("a string").to_string())
                    .collect()
            };
            for g in strings("apiGroups") {
                for res in strings("resources") {
                    let verbs: &mut Vec<String> = rules.entry((g.clone(), res)).or_default();
                    verbs.extend(strings("verbs"));
                    verbs.sort();
                    verbs.dedup();
                }
            }
        }
    }
    rules
}

#[test]
fn the_managers_role_covers_every_kind_leases_and_secrets_and_no_more() {
    let rules = rendered_role_rules();
    assert!(
        !rules.is_empty(),
        "deploy/zebu.yaml renders Role zebu-manager"
    );
    let verbs = |g: &str, r: &str| -> Vec<String> {
        rules
            .get(&(g.to_string(), r.to_string()))
            .cloned()
            .unwrap_or_default()
    };
    let want = |list: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        v.sort();
        v
    };
    for kind in zebu_types::Kind::ALL {
        let plural = kind.plural();
        assert_eq!(
            verbs("zebu.io", plural),
            want(&["get", "list", "watch", "create", "update", "delete"]),
            "{plural}"
        );
        assert_eq!(
            verbs("zebu.io", &format!("{plural}/status")),
            want(&["update"]),
            "{plural}/status"
        );
    }
    assert_eq!(
        verbs("coordination.k8s.io", "leases"),
        want(&["get", "list", "create", "update"])
    );
    assert_eq!(verbs("", "secrets"), want(&["get", "create", "delete"]));
    let known = zebu_types::Kind::ALL.len() * 2 + 2;
    assert_eq!(
        rules.len(),
        known,
        "the Role grants something no manager uses: {rules:?}"
    );
}

#[test]
fn every_rendered_manifest_passes_kubernetes_validate_strict() {
    let manifests = repo().join("deploy/zebu.yaml");
    let out = Command::new(tool("kubernetes-validate"))
        .args(["--strict", "-k", "1.34.0"])
        .arg(&manifests)
        .output()
        .expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for kind in [
        "namespace/zebu-system",
        "serviceaccount/zebu-manager",
        "role/zebu-manager",
        "rolebinding/zebu-manager",
        "service/zebu-manager",
        "daemonset/zebu-manager",
        "daemonset/zebu-instance-manager",
        "storageclass/zebu",
    ] {
        assert!(
            text.contains(&format!("passed for resource {kind}")),
            "{kind}: {text}"
        );
    }
}

/// Replica TLS turned on (`replicaTls.enabled`): the manager mounts the CA Secret read-only
/// and names the mount with `--replica-tls-ca`, and the manifests still pass
/// `kubernetes-validate --strict`. Off (the default), the rendering has none of it.
#[test]
fn replica_tls_mounts_the_ca_secret_and_names_it_to_the_manager() {
    let out = Command::new(tool("helm"))
        .args(["template", "zebu"])
        .arg(repo().join("deploy/chart"))
        .args([
            "--namespace",
            "zebu-system",
            "--set",
            "replicaTls.enabled=true",
        ])
        .args(["--set", "replicaTls.caSecret=my-replica-ca"])
        .output()
        .expect("run helm template");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        rendered.contains("- --replica-tls-ca=/etc/zebu/replica-ca"),
        "{rendered}"
    );
    assert!(rendered.contains("secretName: my-replica-ca"), "{rendered}");
    assert!(
        rendered.contains("mountPath: /etc/zebu/replica-ca"),
        "{rendered}"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("tls.yaml");
    std::fs::write(&file, &rendered).expect("write");
    let v = Command::new(tool("kubernetes-validate"))
        .args(["--strict", "-k", "1.34.0"])
        .arg(&file)
        .output()
        .expect("run kubernetes-validate");
    assert!(
        v.status.success(),
        "{}{}",
        String::from_utf8_lossy(&v.stdout),
        String::from_utf8_lossy(&v.stderr)
    );
    let plain = std::fs::read_to_string(repo().join("deploy/zebu.yaml")).expect("zebu.yaml");
    assert!(!plain.contains("replica-tls-ca") && !plain.contains("replica-ca"));
}

#[test]
fn the_manifests_apply_server_side_to_a_real_api_server() {
    let c = Cluster::ensure();
    c.install();
    // Applied again: server-side apply is idempotent, nothing conflicts.
    c.install();
    let ds = c.kubectl_ok(&["get", "daemonsets", "-n", "zebu-system", "-o", "name"]);
    assert!(ds.contains("daemonset.apps/zebu-manager"), "{ds}");
    assert!(ds.contains("daemonset.apps/zebu-instance-manager"), "{ds}");
    let sc = c.kubectl_ok(&[
        "get",
        "storageclass",
        "zebu",
        "-o",
        "jsonpath={.provisioner}",
    ]);
    assert_eq!(sc, "driver.zebu.io");
    // The manager's user has exactly what the Role gives: Leases without delete, the
    // Secrets its objects name but no listing or watching of them.
    let can = |verb: &str, what: &str| {
        let out = c.kubectl(
            &c.manager(),
            &["auth", "can-i", verb, what, "-n", "zebu-system"],
        );
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    assert!(can("update", "leases.coordination.k8s.io"));
    assert!(can("create", "leases.coordination.k8s.io"));
    assert!(!can("delete", "leases.coordination.k8s.io"));
    assert!(can("get", "secrets"));
    assert!(can("create", "secrets"));
    assert!(can("delete", "secrets"));
    assert!(!can("list", "secrets"));
    assert!(!can("watch", "secrets"));
    assert!(!can("update", "secrets"));
    assert!(!can("list", "pods"));
}
