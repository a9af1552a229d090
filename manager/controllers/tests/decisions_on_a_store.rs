//! The controllers' decision table, run on worlds loaded from a real embedded store after the
//! case's objects were written through the store contract, exactly as it runs on worlds built
//! directly (`src/volume/tests.rs`). A Kubernetes store runs the same table with
//! `zebu_controllers::cases::check_on_store`.

use std::sync::Arc;

use zebu_controllers::World;
use zebu_controllers::cases;
use zebu_store::EmbeddedStore;
use zebu_types::Store;
use zebu_types::names::{NODE_LABEL, REPLICA_FINALIZER, VOLUME_LABEL};
use zebu_types::resources::{Replica, Volume};
use zebu_types::store::{LabelSelector, TypedStore};

#[tokio::test]
async fn every_decision_case_holds_on_a_world_loaded_from_the_embedded_store() {
    let mut failures = Vec::new();
    let all = cases::all();
    for case in &all {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(dir.path().join("z.redb")).expect("open");
        if let Err(e) = cases::check_on_store(case, &store).await {
            failures.push(format!("{}: {e}", case.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}

/// The thin apply half: a pass over a new volume creates its replicas in the store with the
/// labels, owner and finalizer the agents and a cluster rely on.
#[tokio::test]
async fn a_pass_creates_labelled_owned_replicas_for_a_new_volume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> =
        Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
    let case = cases::all()
        .into_iter()
        .find(|c| c.name == "a new volume is placed on three nodes")
        .expect("case");
    cases::load_into(store.as_ref(), &case.fixture)
        .await
        .expect("load");
    // Decided at the case's instant, so its heartbeats are fresh.
    let w = World::load(store.as_ref(), cases::now())
        .await
        .expect("world");
    let v = w.volume("v").expect("volume").clone();
    let actions = zebu_controllers::volume::decide(&w, &v);
    let mut applier = zebu_controllers::VolumeApplier::new(store.clone());
    applier.apply(&w, &v, actions).await.expect("apply");
    let selector: LabelSelector = "zebu.io/volume=v".parse().expect("selector");
    let replicas: Vec<Replica> = store.list_selected(&selector).await.expect("list");
    assert_eq!(replicas.len(), 3);
    let v: Volume = store.get_as("v").await.expect("get").expect("volume");
    for r in &replicas {
        assert_eq!(r.metadata.labels[VOLUME_LABEL], "v");
        assert_eq!(r.metadata.labels[NODE_LABEL], r.spec.node);
        assert_eq!(r.metadata.finalizers, [REPLICA_FINALIZER]);
        assert_eq!(r.metadata.owner_references[0].uid, v.metadata.uid);
        assert!(
            r.spec
                .data_path
                .ends_with(&format!("/replicas/{}", r.metadata.name)),
            "{}",
            r.spec.data_path
        );
    }
    assert_eq!(v.status.observed_generation, v.metadata.generation);
    // The next pass counts the replicas just created: the volume is not placed twice.
    let w = World::load(store.as_ref(), cases::now())
        .await
        .expect("world");
    let v = w.volume("v").expect("volume").clone();
    let again = zebu_controllers::volume::decide(&w, &v);
    assert!(
        again
            .iter()
            .all(|a| !a.to_string().starts_with("create replica")),
        "{again:?}"
    );
}
