//! The store contract on a real kube-apiserver (`tests/k8s`), test for test what the
//! embedded store's tests check, through the cached store a manager uses and the uncached
//! one the CLI uses. Each test works in a namespace of its own.

mod common;

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use zebu_kube_store::{KubeStore, KubeStoreOptions};
use zebu_types::store::{
    KindWatcher, LabelSelector, ListParams, StoreError, TypedStore, WatchChange, WatchEvent,
    WatchStream, object_version,
};
use zebu_types::{API_VERSION, Kind, ResourceVersion, Store};

fn setting(name: &str, value: &str) -> Value {
    json!({"apiVersion": API_VERSION, "kind": "Setting", "metadata": {"name": name}, "spec": {"value": value}})
}

fn node(name: &str) -> Value {
    json!({"kind": "Node", "metadata": {"name": name}, "spec": {"address": "127.0.0.10"}})
}

fn uncached() -> KubeStoreOptions {
    KubeStoreOptions {
        cached: false,
        ..Default::default()
    }
}

async fn next_event(w: &mut WatchStream) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(20), w.next())
        .await
        .expect("an event within 20 s")
        .expect("stream open")
        .expect("event")
}

/// The next event that is not a bookmark.
async fn next_change(w: &mut WatchStream) -> WatchEvent {
    loop {
        match next_event(w).await {
            WatchEvent::Bookmark(_) => continue,
            ev => return ev,
        }
    }
}

async fn both_stores(prefix: &str) -> (common::Cluster, String, Vec<KubeStore>) {
    let c = common::cluster();
    let ns = c.namespace(prefix).await;
    let cached = c.store("ADMIN", &ns, KubeStoreOptions::default()).await;
    let direct = c.store("ADMIN", &ns, uncached()).await;
    (c, ns, vec![cached, direct])
}

#[tokio::test]
async fn create_assigns_identity_namespace_and_generation_and_refuses_duplicates() {
    let (c, ns, stores) = both_stores("zt-create").await;
    for (i, s) in stores.iter().enumerate() {
        let name = format!("a{i}");
        let a = s.create(setting(&name, "1")).await.expect("create");
        assert!(!object_version(&a).is_empty());
        assert_eq!(a["metadata"]["uid"].as_str().map(str::len), Some(36));
        assert_eq!(a["metadata"]["namespace"], ns.as_str());
        assert_eq!(a["metadata"]["generation"], 1);
        assert!(a["metadata"]["creationTimestamp"].is_string());
        assert!(a["metadata"].get("managedFields").is_none());
        let err = s.create(setting(&name, "2")).await.expect_err("duplicate");
        assert!(
            matches!(
                err,
                StoreError::AlreadyExists {
                    kind: Kind::Setting,
                    ..
                }
            ),
            "{err}"
        );
        // Read your own write, from the cache as from the server.
        assert_eq!(s.get(Kind::Setting, &name).await.expect("get"), Some(a));
        assert!(matches!(
            s.create(setting("Bad_Name", "1")).await,
            Err(StoreError::InvalidName { .. })
        ));
        assert!(matches!(
            s.create(json!({"kind": "Pod", "metadata": {"name": "x"}}))
                .await,
            Err(StoreError::Invalid { .. })
        ));
        let mut elsewhere = setting("b", "1");
        elsewhere["metadata"]["namespace"] = json!("default");
        let e = s.create(elsewhere).await.expect_err("namespace");
        assert!(e.to_string().contains("\"default\""), "{e}");
        let mut versioned = setting("c", "1");
        versioned["metadata"]["resourceVersion"] = json!("1");
        assert!(matches!(
            s.create(versioned).await,
            Err(StoreError::Invalid { .. })
        ));
        assert_eq!(s.get(Kind::Setting, "nothing").await.expect("get"), None);
    }
    c.delete_namespace(&ns).await;
}

#[tokio::test]
async fn status_goes_through_the_status_subresource_only() {
    let (c, ns, stores) = both_stores("zt-status").await;
    for (i, s) in stores.iter().enumerate() {
        let mut n = node(&format!("n{i}"));
        n["status"] = json!({"lastHeartbeat": "2025-01-01T00:00:00Z"});
        let created = s.create(n).await.expect("create");
        assert!(
            created
                .get("status")
                .is_none_or(|st| st.get("lastHeartbeat").is_none()),
            "create ignores status: {created}"
        );
        let mut with = created.clone();
        with["status"] = json!({"lastHeartbeat": "2025-01-01T00:00:00Z"});
        with["spec"]["address"] = json!("127.0.0.99");
        let updated = s.update_status(with).await.expect("status");
        assert_eq!(updated["status"]["lastHeartbeat"], "2025-01-01T00:00:00Z");
        assert_eq!(
            updated["spec"]["address"], "127.0.0.10",
            "status writes keep spec"
        );
        assert_eq!(updated["metadata"]["generation"], 1, "status is not spec");
        // And a spec update keeps the status.
        let mut spec = updated.clone();
        spec["spec"]["address"] = json!("127.0.0.20");
        spec["status"] = json!({"lastHeartbeat": "1999-01-01T00:00:00Z"});
        let after = s.update(spec).await.expect("update");
        assert_eq!(after["spec"]["address"], "127.0.0.20");
        assert_eq!(after["status"]["lastHeartbeat"], "2025-01-01T00:00:00Z");
        assert_eq!(after["metadata"]["generation"], 2);
        let got = s.get(Kind::Node, &format!("n{i}")).await.expect("get");
        assert_eq!(got.as_ref(), Some(&after));
    }
    c.delete_namespace(&ns).await;
}

#[tokio::test]
async fn update_with_a_stale_or_missing_resource_version_is_refused() {
    let (c, ns, stores) = both_stores("zt-conflict").await;
    for (i, s) in stores.iter().enumerate() {
        let name = format!("a{i}");
        let v1 = s.create(setting(&name, "1")).await.expect("create");
        let mut mine = v1.clone();
        mine["spec"]["value"] = json!("mine");
        let mut theirs = v1.clone();
        theirs["spec"]["value"] = json!("theirs");
        let v2 = s.update(theirs).await.expect("first update wins");
        assert_ne!(object_version(&v2), object_version(&v1));
        match s.update(mine.clone()).await {
            Err(StoreError::Conflict { given, kind, .. }) => {
                assert_eq!(given, object_version(&v1));
                assert_eq!(kind, Kind::Setting);
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        assert!(matches!(
            s.update_status(mine).await,
            Err(StoreError::Conflict { .. })
        ));
        let stored = s
            .get(Kind::Setting, &name)
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(stored["spec"]["value"], "theirs");
        // Without a version the server would overwrite blindly; the store refuses.
        assert!(matches!(
            s.update(setting(&name, "blind")).await,
            Err(StoreError::Invalid { .. })
        ));
        let mut gone = v2.clone();
        gone["metadata"]["name"] = json!(format!("never-{i}"));
        assert!(matches!(
            s.update(gone).await,
            Err(StoreError::NotFound { .. })
        ));
    }
    c.delete_namespace(&ns).await;
}

#[tokio::test]
async fn finalizers_hold_a_deleted_object_until_removed() {
    let (c, ns, stores) = both_stores("zt-final").await;
    for (i, s) in stores.iter().enumerate() {
        let name = format!("f{i}");
        let mut o = setting(&name, "1");
        o["metadata"]["finalizers"] = json!(["zebu.io/test"]);
        s.create(o).await.expect("create");
        let held = s
            .delete(Kind::Setting, &name)
            .await
            .expect("delete")
            .expect("held by its finalizer");
        assert!(held["metadata"]["deletionTimestamp"].is_string());
        assert_eq!(
            held["metadata"]["generation"], 2,
            "a delete is a new generation"
        );
        let got = s
            .get(Kind::Setting, &name)
            .await
            .expect("get")
            .expect("still there");
        assert!(got["metadata"]["deletionTimestamp"].is_string());
        // No finalizer may be added now.
        let mut more = got.clone();
        more["metadata"]["finalizers"] = json!(["zebu.io/test", "zebu.io/other"]);
        let e = s
            .update(more)
            .await
            .expect_err("finalizer added while deleting");
        assert!(matches!(e, StoreError::Invalid { .. }), "{e}");
        // Dropping the last finalizer removes it.
        let mut done = got;
        done["metadata"]["finalizers"] = json!([]);
        s.update(done).await.expect("drop finalizer");
        assert_eq!(s.get(Kind::Setting, &name).await.expect("get"), None);
        // Without finalizers a delete removes at once.
        s.create(setting(&format!("g{i}"), "1"))
            .await
            .expect("create");
        assert_eq!(
            s.delete(Kind::Setting, &format!("g{i}"))
                .await
                .expect("delete"),
            None
        );
        assert_eq!(
            s.get(Kind::Setting, &format!("g{i}")).await.expect("get"),
            None
        );
        assert!(matches!(
            s.delete(Kind::Setting, &format!("g{i}")).await,
            Err(StoreError::NotFound { .. })
        ));
    }
    c.delete_namespace(&ns).await;
}

#[tokio::test]
async fn lists_take_label_selectors() {
    let (c, ns, stores) = both_stores("zt-labels").await;
    let s = &stores[0];
    for (name, tier) in [("a", "gold"), ("b", "silver"), ("c", "bronze")] {
        let mut o = setting(name, "1");
        o["metadata"]["labels"] = json!({"tier": tier});
        s.create(o).await.expect("create");
    }
    s.create(setting("d", "1")).await.expect("create");
    for s in &stores {
        let gold: LabelSelector = "tier in (gold, silver)".parse().expect("selector");
        let got = s
            .list(Kind::Setting, &ListParams::selected(gold))
            .await
            .expect("list");
        let names: Vec<_> = got
            .items
            .iter()
            .map(|o| o["metadata"]["name"].as_str().expect("name"))
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert!(!got.resource_version.is_empty());
        let not: LabelSelector = "tier!=gold".parse().expect("selector");
        let got = s
            .list(Kind::Setting, &ListParams::selected(not))
            .await
            .expect("list");
        assert_eq!(got.items.len(), 3, "!= holds without the key");
        let all = s
            .list(Kind::Setting, &ListParams::all())
            .await
            .expect("list");
        assert_eq!(all.items.len(), 4);
    }
    c.delete_namespace(&ns).await;
}

#[tokio::test]
async fn a_watch_from_a_list_sees_every_change_in_order_and_an_old_version_expires() {
    let (c, ns, stores) = both_stores("zt-watch").await;
    for (i, s) in stores.iter().enumerate() {
        let list = s
            .list(Kind::Setting, &ListParams::all())
            .await
            .expect("list");
        let mut w = s
            .watch(Kind::Setting, &list.resource_version)
            .await
            .expect("watch");
        let name = format!("w{i}");
        let a = s.create(setting(&name, "1")).await.expect("create");
        let mut a2 = a.clone();
        a2["spec"]["value"] = json!("2");
        let a2 = s.update(a2).await.expect("update");
        s.create(node(&format!("n{i}")))
            .await
            .expect("another kind");
        s.delete(Kind::Setting, &name).await.expect("delete");
        match next_change(&mut w).await {
            WatchEvent::Added(o) => assert_eq!(object_version(&o), object_version(&a)),
            e => panic!("expected Added, got {e:?}"),
        }
        match next_change(&mut w).await {
            WatchEvent::Modified(o) => {
                assert_eq!(o["spec"]["value"], "2");
                assert_eq!(object_version(&o), object_version(&a2));
            }
            e => panic!("expected Modified, got {e:?}"),
        }
        let last = match next_change(&mut w).await {
            WatchEvent::Deleted(o) => {
                assert_eq!(o["metadata"]["name"], name.as_str());
                object_version(&o)
            }
            e => panic!("expected Deleted, got {e:?}"),
        };
        // A watch resumed from the last version misses nothing and repeats nothing.
        let mut resumed = s.watch(Kind::Setting, &last).await.expect("resume");
        s.create(setting(&format!("x{i}"), "1"))
            .await
            .expect("create");
        match next_change(&mut resumed).await {
            WatchEvent::Added(o) => assert_eq!(o["metadata"]["name"], format!("x{i}")),
            e => panic!("expected Added, got {e:?}"),
        }
        // A version from before the kind existed: 410 Gone, as Expired.
        let old = ResourceVersion::new("1");
        let expired = match s.watch(Kind::Setting, &old).await {
            Err(e) => e,
            Ok(mut st) => match tokio::time::timeout(Duration::from_secs(20), st.next()).await {
                Ok(Some(Err(e))) => e,
                other => panic!("expected an expiry, got {other:?}"),
            },
        };
        assert!(
            matches!(
                expired,
                StoreError::Expired {
                    kind: Kind::Setting,
                    ..
                }
            ),
            "{expired}"
        );
    }
    c.delete_namespace(&ns).await;
}

/// The resumable watcher the controllers use, over the kube store: it lists, follows, and
/// what it reports is what `get` then sees (the cache applied the event before it was
/// handed out).
#[tokio::test]
async fn the_kind_watcher_lists_and_follows_and_reads_after_an_event_see_it() {
    let c = common::cluster();
    let ns = c.namespace("zt-watcher").await;
    let s = std::sync::Arc::new(c.store("ADMIN", &ns, KubeStoreOptions::default()).await);
    s.create(setting("before", "1")).await.expect("create");
    let mut w = KindWatcher::new(s.clone(), Kind::Setting);
    match w.next().await.expect("list") {
        WatchChange::Listed(items) => assert_eq!(items.len(), 1),
        e => panic!("expected a list, got {e:?}"),
    }
    // Another writer (its own store, its own cache) changes the kind.
    let other = c.store("ADMIN", &ns, uncached()).await;
    for i in 0..5 {
        other
            .create(setting(&format!("s{i}"), "v"))
            .await
            .expect("create");
    }
    let mut seen = 0;
    while seen < 5 {
        let change = tokio::time::timeout(Duration::from_secs(20), w.next())
            .await
            .expect("an event within 20 s")
            .expect("event");
        if let WatchChange::Event(WatchEvent::Added(o)) = change {
            let name = o["metadata"]["name"].as_str().expect("name").to_string();
            assert_eq!(name, format!("s{seen}"), "in order");
            let got = s.get(Kind::Setting, &name).await.expect("get");
            assert_eq!(got.as_ref().map(object_version), Some(object_version(&o)));
            seen += 1;
        }
    }
    let typed: Vec<zebu_types::resources::Setting> = s.list_as().await.expect("typed list");
    assert_eq!(typed.len(), 6);
    c.delete_namespace(&ns).await;
}

/// `status.display` carries what kubectl prints: the size in binary units and the
/// healthy/wanted replica count.
#[tokio::test]
async fn volume_status_writes_derive_the_printed_size_and_replicas() {
    let c = common::cluster();
    let ns = c.namespace("zt-display").await;
    let s = c.store("ADMIN", &ns, KubeStoreOptions::default()).await;
    let v = json!({
        "kind": "Volume", "metadata": {"name": "db"},
        "spec": {"size": 10u64 << 30, "numberOfReplicas": 3, "frontend": "nbd"},
    });
    let mut v = s.create(v).await.expect("create");
    v["status"] = json!({
        "state": "attached", "robustness": "degraded",
        "replicas": [
            {"name": "db-r-1", "node": "n1", "mode": "RW"},
            {"name": "db-r-2", "node": "n2", "mode": "RW"},
            {"name": "db-r-3", "node": "n3", "mode": "WO"},
        ],
    });
    let v = s.update_status(v).await.expect("status");
    assert_eq!(
        v["status"]["display"],
        json!({"size": "10Gi", "replicas": "2/3"})
    );
    // The typed volume reads it back without the display fields and writes it again.
    let typed: zebu_types::resources::Volume = s.get_as("db").await.expect("get").expect("there");
    let again = s.update_status_as(&typed).await.expect("status");
    assert_eq!(again.status.replicas.len(), 3);
    let raw = s
        .get(Kind::Volume, "db")
        .await
        .expect("get")
        .expect("there");
    assert_eq!(raw["status"]["display"]["replicas"], "2/3");
    c.delete_namespace(&ns).await;
}
