//! The controllers' decision table on worlds loaded from the Kubernetes store (a real
//! kube-apiserver), each case in a namespace of its own, exactly as
//! `manager/controllers/tests/decisions_on_a_store.rs` runs it on the embedded store.

mod common;

use zebu_controllers::cases;
use zebu_kube_store::KubeStoreOptions;

#[tokio::test]
async fn every_decision_case_holds_on_a_world_loaded_from_the_kube_store() {
    let c = common::cluster();
    let all = cases::all();
    let mut failures = Vec::new();
    for case in &all {
        let ns = c.namespace("zt-case").await;
        let store = c.store("ADMIN", &ns, KubeStoreOptions::default()).await;
        if let Err(e) = cases::check_on_store(case, &store).await {
            failures.push(format!("{}: {e}", case.name));
        }
        drop(store);
        c.delete_namespace(&ns).await;
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}
