//! `deploy/crds/` is exactly what the Rust types generate: a change to a resource type
//! without regenerating the CRDs fails here, and the message says how to regenerate.

use std::collections::BTreeSet;
use std::path::PathBuf;

use zebu_kube_store::crd;
use zebu_types::Kind;

fn crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
}

#[test]
fn deploy_crds_are_what_the_types_generate() {
    let dir = crds_dir();
    let mut stale = Vec::new();
    for kind in Kind::ALL {
        let want = crd::yaml(kind).expect("generate");
        let path = dir.join(crd::file_name(kind));
        if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    let expected: BTreeSet<String> = Kind::ALL.iter().map(|k| crd::file_name(*k)).collect();
    let present: BTreeSet<String> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let extra: Vec<_> = present.difference(&expected).collect();
    assert!(
        stale.is_empty() && extra.is_empty(),
        "deploy/crds drifted from the Rust types (stale: {stale:?}, not generated: {extra:?}).\n\
         Regenerate from the repository root with:\n    {}",
        crd::REGENERATE
    );
}

#[test]
fn every_kind_has_its_names_status_subresource_and_columns() {
    for kind in Kind::ALL {
        let c = crd::crd(kind).expect("generate");
        assert_eq!(c["spec"]["group"], "zebu.io");
        assert_eq!(c["spec"]["scope"], "Namespaced");
        assert_eq!(c["spec"]["names"]["shortNames"][0], kind.short_name());
        let v = &c["spec"]["versions"][0];
        assert_eq!(v["name"], "v1alpha1");
        assert_eq!(v["subresources"]["status"], serde_json::json!({}));
        let cols = v["additionalPrinterColumns"].as_array().expect("columns");
        assert!(
            cols.iter().any(|c| c["name"] == "Age"),
            "{kind}: no Age column"
        );
        let schema = &v["schema"]["openAPIV3Schema"];
        assert_eq!(schema["properties"]["spec"]["type"], "object", "{kind}");
    }
    let v = crd::crd(Kind::Volume).expect("generate");
    let names: Vec<_> = v["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .expect("columns")
        .iter()
        .filter(|c| c.get("priority").is_none())
        .map(|c| c["name"].as_str().expect("name").to_string())
        .collect();
    assert_eq!(
        names,
        [
            "State",
            "Robustness",
            "Size",
            "Replicas",
            "Node",
            "Frontend",
            "Age"
        ]
    );
}
