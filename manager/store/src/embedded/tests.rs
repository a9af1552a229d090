use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;

use super::*;
use zebu_types::resources::{Setting, SettingSpec};
use zebu_types::store::{KindWatcher, LabelSelector, TypedStore, WatchChange};

fn setting(name: &str, value: &str) -> Value {
    json!({"apiVersion": API_VERSION, "kind": "Setting", "metadata": {"name": name}, "spec": {"value": value}})
}

fn node(name: &str) -> Value {
    json!({"kind": "Node", "metadata": {"name": name}, "spec": {"address": "127.0.0.10"}})
}

fn temp_store() -> (tempfile::TempDir, EmbeddedStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedStore::open(dir.path().join("zebu.redb")).expect("open");
    (dir, store)
}

fn rv(v: &Value) -> ResourceVersion {
    object_version(v)
}

async fn next_event(w: &mut WatchStream) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("an event within 10 s")
        .expect("stream open")
        .expect("event")
}

#[test]
fn create_assigns_identity_namespace_and_generation_and_refuses_duplicates() {
    let (_d, s) = temp_store();
    let a = s.create_sync(setting("a", "1")).expect("create");
    assert_eq!(a["metadata"]["resourceVersion"], "1");
    assert_eq!(a["metadata"]["uid"].as_str().map(str::len), Some(36));
    assert_eq!(a["metadata"]["namespace"], DEFAULT_NAMESPACE);
    assert_eq!(a["metadata"]["generation"], 1);
    assert!(a["metadata"]["creationTimestamp"].is_string());
    let err = s.create_sync(setting("a", "2")).expect_err("duplicate");
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
    assert_eq!(s.get_sync(Kind::Setting, "a").expect("get"), Some(a));
    assert!(matches!(
        s.create_sync(setting("Bad_Name", "1")),
        Err(StoreError::InvalidName { .. })
    ));
    assert!(matches!(
        s.create_sync(json!({"kind": "Pod", "metadata": {"name": "x"}})),
        Err(StoreError::Invalid { .. })
    ));
    // Another namespace is refused; a resourceVersion on create too.
    let mut elsewhere = setting("b", "1");
    elsewhere["metadata"]["namespace"] = json!("default");
    let e = s.create_sync(elsewhere).expect_err("namespace");
    assert!(e.to_string().contains("\"default\""), "{e}");
    let mut versioned = setting("c", "1");
    versioned["metadata"]["resourceVersion"] = json!("1");
    assert!(matches!(
        s.create_sync(versioned),
        Err(StoreError::Invalid { .. })
    ));
}

#[test]
fn create_ignores_status_as_a_status_subresource_does() {
    let (_d, s) = temp_store();
    let mut n = node("n1");
    n["status"] = json!({"lastHeartbeat": "2025-01-01T00:00:00Z"});
    let created = s.create_sync(n).expect("create");
    assert!(created.get("status").is_none(), "{created}");
    let mut with = created.clone();
    with["status"] = json!({"lastHeartbeat": "2025-01-01T00:00:00Z"});
    let updated = s.update_status_sync(with).expect("status");
    assert_eq!(updated["status"]["lastHeartbeat"], "2025-01-01T00:00:00Z");
    assert_eq!(updated["metadata"]["generation"], 1, "status is not spec");
}

#[test]
fn update_with_a_stale_resource_version_conflicts() {
    let (_d, s) = temp_store();
    let v1 = s.create_sync(setting("a", "1")).expect("create");
    let mut mine = v1.clone();
    mine["spec"]["value"] = json!("mine");
    let mut theirs = v1.clone();
    theirs["spec"]["value"] = json!("theirs");
    let v2 = s.update_sync(theirs).expect("first update wins");
    assert_ne!(rv(&v2), rv(&v1));
    match s.update_sync(mine.clone()) {
        Err(StoreError::Conflict { given, .. }) => assert_eq!(given, rv(&v1)),
        other => panic!("expected a conflict, got {other:?}"),
    }
    // Status updates check the version too.
    assert!(matches!(
        s.update_status_sync(mine),
        Err(StoreError::Conflict { .. })
    ));
    let stored = s
        .get_sync(Kind::Setting, "a")
        .expect("get")
        .expect("exists");
    assert_eq!(stored["spec"]["value"], "theirs");
    // An update without a version is refused rather than overwriting blindly.
    let err = s
        .update_sync(setting("a", "blind"))
        .expect_err("blind update");
    assert!(
        err.to_string().contains("resourceVersion must be set"),
        "{err}"
    );
    let mut forged = v2.clone();
    forged["metadata"]["resourceVersion"] = json!("seven");
    let err = s.update_sync(forged).expect_err("not ours");
    assert!(
        err.to_string().contains("not issued by this store"),
        "{err}"
    );
    assert!(matches!(
        s.update_sync({
            let mut x = setting("nope", "1");
            x["metadata"]["resourceVersion"] = json!("1");
            x
        }),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn generation_counts_spec_changes_only() {
    let (_d, s) = temp_store();
    let v = s.create_sync(setting("a", "1")).expect("create");
    let mut labelled = v.clone();
    labelled["metadata"]["labels"] = json!({"x": "y"});
    labelled["metadata"]["annotations"] = json!({"why": "a test"});
    let v = s.update_sync(labelled).expect("labels");
    assert_eq!(v["metadata"]["generation"], 1, "metadata is not spec");
    assert_eq!(v["metadata"]["annotations"]["why"], "a test");
    let mut changed = v.clone();
    changed["spec"]["value"] = json!("2");
    changed["metadata"]["generation"] = json!(40); // store-owned
    let v = s.update_sync(changed).expect("spec");
    assert_eq!(v["metadata"]["generation"], 2);
    let mut same = v.clone();
    same["metadata"]["labels"] = json!({});
    let v = s.update_sync(same).expect("same spec");
    assert_eq!(v["metadata"]["generation"], 2);
}

#[test]
fn update_keeps_status_and_update_status_keeps_spec() {
    let (_d, s) = temp_store();
    let v = s.create_sync(setting("a", "1")).expect("create");
    let mut v = v;
    v["status"] = json!({"seen": true});
    v["spec"]["value"] = json!("ignored by update_status");
    let v = s.update_status_sync(v).expect("status");
    assert_eq!(v["status"]["seen"], true);
    assert_eq!(v["spec"]["value"], "1");
    let mut w = v.clone();
    w["status"] = json!({"seen": false});
    w["spec"]["value"] = json!("2");
    w["metadata"]["uid"] = json!("forged");
    let w = s.update_sync(w).expect("update");
    assert_eq!(w["status"]["seen"], true, "update must not touch status");
    assert_eq!(w["spec"]["value"], "2");
    assert_eq!(
        w["metadata"]["uid"], v["metadata"]["uid"],
        "uid is store-owned"
    );
}

#[test]
fn finalizers_hold_a_deleted_object_until_removed() {
    let (_d, s) = temp_store();
    let mut v = setting("a", "1");
    v["metadata"]["finalizers"] = json!(["zebu.io/agent"]);
    s.create_sync(v).expect("create");
    let held = s
        .delete_sync(Kind::Setting, "a")
        .expect("delete")
        .expect("held by finalizer");
    assert!(held["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(
        held["metadata"]["generation"], 2,
        "a delete is a new generation"
    );
    assert!(s.get_sync(Kind::Setting, "a").expect("get").is_some());
    // No new finalizer while it is being deleted.
    let mut more = held.clone();
    more["metadata"]["finalizers"] = json!(["zebu.io/agent", "zebu.io/other"]);
    let e = s.update_sync(more).expect_err("new finalizer");
    assert!(e.to_string().contains("no finalizer may be added"), "{e}");
    let mut release = held.clone();
    release["metadata"]["finalizers"] = json!([]);
    // deletionTimestamp cannot be cleared by an update.
    release["metadata"]
        .as_object_mut()
        .expect("meta")
        .remove("deletionTimestamp");
    s.update_sync(release).expect("remove finalizer");
    assert_eq!(s.get_sync(Kind::Setting, "a").expect("get"), None);
    assert!(matches!(
        s.delete_sync(Kind::Setting, "a"),
        Err(StoreError::NotFound { .. })
    ));
    s.create_sync(setting("b", "1")).expect("create");
    assert_eq!(s.delete_sync(Kind::Setting, "b").expect("delete"), None);
}

#[test]
fn lists_take_label_selectors() {
    let (_d, s) = temp_store();
    for (name, labels) in [
        (
            "r1",
            json!({"zebu.io/volume": "db", "zebu.io/node": "node-1"}),
        ),
        (
            "r2",
            json!({"zebu.io/volume": "db", "zebu.io/node": "node-2"}),
        ),
        (
            "r3",
            json!({"zebu.io/volume": "web", "zebu.io/node": "node-1"}),
        ),
        ("r4", json!({})),
    ] {
        let mut o = setting(name, "x");
        o["metadata"]["labels"] = labels;
        s.create_sync(o).expect("create");
    }
    let names = |sel: &str| -> Vec<String> {
        let params = ListParams::selected(sel.parse::<LabelSelector>().expect("selector"));
        s.list_sync(Kind::Setting, &params)
            .expect("list")
            .items
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(names("zebu.io/volume=db"), ["r1", "r2"]);
    assert_eq!(names("zebu.io/volume=db,zebu.io/node=node-1"), ["r1"]);
    assert_eq!(names("zebu.io/node in (node-1)"), ["r1", "r3"]);
    assert_eq!(names("!zebu.io/volume"), ["r4"]);
    assert_eq!(names("zebu.io/volume!=db"), ["r3", "r4"]);
    assert_eq!(names(""), ["r1", "r2", "r3", "r4"]);
}

#[test]
fn resource_version_survives_reopen_and_never_repeats() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("zebu.redb");
    let before;
    {
        let s = EmbeddedStore::open(&path).expect("open");
        for i in 0..5 {
            s.create_sync(setting(&format!("s{i}"), "x"))
                .expect("create");
        }
        s.delete_sync(Kind::Setting, "s4").expect("delete");
        before = s.current_version().expect("rv");
    }
    let s = EmbeddedStore::open(&path).expect("reopen");
    assert_eq!(s.current_version().expect("rv"), before);
    let v = s.create_sync(setting("after", "x")).expect("create");
    assert_ne!(rv(&v), before);
    let list = s
        .list_sync(Kind::Setting, &ListParams::all())
        .expect("list");
    assert_eq!(list.resource_version, rv(&v));
    let names: Vec<_> = list
        .items
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(names, ["after", "s0", "s1", "s2", "s3"]);
}

/// An object written by the first version of the store (no namespace, no generation) reads
/// with the store's namespace and generation 1, and updates like any other.
#[test]
fn objects_from_an_earlier_store_version_read_normalized() {
    let (_d, s) = temp_store();
    let created = s.create_sync(setting("old", "1")).expect("create");
    // Rewrite it as the first version stored it.
    let mut old = created.clone();
    let meta = old["metadata"].as_object_mut().expect("meta");
    meta.remove("namespace");
    meta.remove("generation");
    {
        let txn = s.inner.db.begin_write().expect("txn");
        {
            let mut t = txn.open_table(OBJECTS).expect("table");
            let bytes = serde_json::to_vec(&old).expect("json");
            t.insert("Setting/old", bytes.as_slice()).expect("insert");
        }
        txn.commit().expect("commit");
    }
    let got = s
        .get_sync(Kind::Setting, "old")
        .expect("get")
        .expect("there");
    assert_eq!(got["metadata"]["namespace"], DEFAULT_NAMESPACE);
    assert_eq!(got["metadata"]["generation"], 1);
    let mut next = got.clone();
    next["spec"]["value"] = json!("2");
    let next = s.update_sync(next).expect("update");
    assert_eq!(next["metadata"]["generation"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_delivers_every_change_of_its_kind_once_in_order_across_catch_up_and_live() {
    let (_d, s) = temp_store();
    let mut versions = Vec::new();
    for i in 0..20 {
        let v = s
            .create(setting(&format!("pre{i}"), "x"))
            .await
            .expect("create");
        versions.push(rv(&v));
        s.create(node(&format!("pre-node{i}"))).await.expect("node");
    }
    // Start from the middle of the log: catch-up from the db, then live.
    let mut w = s.watch(Kind::Setting, &versions[9]).await.expect("watch");
    let writers: Vec<_> = (0..4)
        .map(|t| {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..25 {
                    let name = format!("w{t}-{i}");
                    let v = s.create(setting(&name, "x")).await.expect("create");
                    let mut v2 = v.clone();
                    v2["spec"]["value"] = json!("y");
                    s.update(v2).await.expect("update");
                    s.create(node(&name)).await.expect("other kind");
                }
            })
        })
        .collect();
    for w in writers {
        w.await.expect("writer");
    }
    let total = 10 + 4 * 25 * 2;
    let mut seen = Vec::new();
    while seen.len() < total {
        match next_event(&mut w).await {
            WatchEvent::Bookmark(_) => {}
            ev => seen.push(ev),
        }
    }
    // Per object: Added before Modified, each object of the watched kind only, and the
    // versions strictly increasing (the store's own numbers; callers never compare them).
    let mut state: BTreeMap<String, &'static str> = BTreeMap::new();
    let mut last = 0u64;
    for ev in &seen {
        let o = ev.object().expect("object");
        assert_eq!(o["kind"], "Setting");
        let n: u64 = ev.resource_version().as_str().parse().expect("number");
        assert!(n > last, "in order, no repeats");
        last = n;
        let name = o["metadata"]["name"].as_str().unwrap_or("").to_string();
        let prev = state.insert(name.clone(), ev.type_name());
        if ev.type_name() == "MODIFIED" {
            assert_eq!(prev, Some("ADDED"), "{name}");
        }
    }
    assert_eq!(
        seen.iter().filter(|e| e.type_name() == "ADDED").count(),
        10 + 100
    );
}

#[tokio::test]
async fn watch_reports_deletes_with_the_last_state() {
    let (_d, s) = temp_store();
    let start = s.current_version().expect("rv");
    let mut w = s.watch(Kind::Setting, &start).await.expect("watch");
    s.create(node("n1")).await.expect("node");
    s.create(setting("a", "1")).await.expect("create");
    s.delete(Kind::Setting, "a").await.expect("delete");
    let a = next_event(&mut w).await;
    assert!(matches!(a, WatchEvent::Added(_)), "{a:?}");
    let b = next_event(&mut w).await;
    match b {
        WatchEvent::Deleted(o) => assert_eq!(o["spec"]["value"], "1", "last state is carried"),
        other => panic!("expected a delete, got {other:?}"),
    }
}

#[tokio::test]
async fn a_watch_resumed_from_its_last_version_misses_nothing() {
    let (_d, s) = temp_store();
    let start = s.current_version().expect("rv");
    let mut w = s.watch(Kind::Setting, &start).await.expect("watch");
    s.create(setting("a", "1")).await.expect("create");
    let last = next_event(&mut w).await.resource_version();
    drop(w);
    // Changes while nobody watches, of this kind and others.
    s.create(setting("b", "1")).await.expect("create");
    s.create(node("n1")).await.expect("node");
    s.delete(Kind::Setting, "a").await.expect("delete");
    let mut w = s.watch(Kind::Setting, &last).await.expect("resume");
    let b = next_event(&mut w).await;
    assert_eq!(b.object().expect("object")["metadata"]["name"], "b");
    assert!(matches!(next_event(&mut w).await, WatchEvent::Deleted(_)));
    assert!(
        s.watch(Kind::Setting, &ResourceVersion::new("x1"))
            .await
            .is_err(),
        "a version this store never issued"
    );
}

#[tokio::test]
async fn watch_from_a_pruned_version_expires() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s =
        EmbeddedStore::open_with(dir.path().join("z.redb"), DEFAULT_NAMESPACE, 5).expect("open");
    let mut versions = Vec::new();
    for i in 0..12 {
        let v = s
            .create(setting(&format!("s{i}"), "x"))
            .await
            .expect("create");
        versions.push(rv(&v));
    }
    match s.watch(Kind::Setting, &versions[2]).await {
        Err(StoreError::Expired { kind, since }) => {
            assert_eq!((kind, since), (Kind::Setting, versions[2].clone()));
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("a watch from a pruned version must expire"),
    }
    // The oldest version still kept works.
    let mut w = s.watch(Kind::Setting, &versions[6]).await.expect("watch");
    let first = next_event(&mut w).await;
    assert_eq!(first.object().expect("object")["metadata"]["name"], "s7");
}

/// A watcher of a quiet kind is moved on by bookmarks while other kinds change, so it can
/// resume long after without expiring.
#[tokio::test]
async fn bookmarks_keep_a_quiet_kind_resumable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limit = BOOKMARK_EVERY + 200;
    let s = EmbeddedStore::open_with(dir.path().join("z.redb"), DEFAULT_NAMESPACE, limit)
        .expect("open");
    let start = s.current_version().expect("rv");
    let mut w = s.watch(Kind::Setting, &start).await.expect("watch");
    for i in 0..BOOKMARK_EVERY + 10 {
        s.create_sync(node(&format!("n{i}"))).expect("node");
    }
    let bookmark = match next_event(&mut w).await {
        WatchEvent::Bookmark(rv) => rv,
        other => panic!("expected a bookmark, got {other:?}"),
    };
    drop(w);
    // Far more changes elsewhere than the log keeps past the starting version...
    for i in 0..300 {
        s.create_sync(node(&format!("m{i}"))).expect("node");
    }
    assert!(matches!(
        s.watch(Kind::Setting, &start).await,
        Err(StoreError::Expired { .. })
    ));
    // ...but the bookmark is recent enough, and the catch-up ends with a fresh one.
    let mut w = s
        .watch(Kind::Setting, &bookmark)
        .await
        .expect("resume from bookmark");
    assert!(matches!(next_event(&mut w).await, WatchEvent::Bookmark(_)));
    s.create(setting("a", "1")).await.expect("create");
    assert!(matches!(next_event(&mut w).await, WatchEvent::Added(_)));
}

/// The resumable watcher lists, follows changes, and lists again after an expiry.
#[tokio::test]
async fn kind_watcher_lists_follows_and_relists_after_expiry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s =
        EmbeddedStore::open_with(dir.path().join("z.redb"), DEFAULT_NAMESPACE, 5).expect("open");
    s.create(setting("a", "1")).await.expect("create");
    let store: Arc<dyn Store> = Arc::new(s.clone());
    let mut w = KindWatcher::new(store, Kind::Setting);
    match w.next().await.expect("list") {
        WatchChange::Listed(items) => assert_eq!(items.len(), 1),
        other => panic!("{other:?}"),
    }
    s.create(setting("b", "1")).await.expect("create");
    match w.next().await.expect("event") {
        WatchChange::Event(WatchEvent::Added(o)) => assert_eq!(o["metadata"]["name"], "b"),
        other => panic!("{other:?}"),
    }
    // A second watcher lists, then falls behind the log before it opens its watch.
    let store: Arc<dyn Store> = Arc::new(s.clone());
    let mut late = KindWatcher::new(store, Kind::Setting);
    assert!(matches!(
        late.next().await.expect("list"),
        WatchChange::Listed(_)
    ));
    for i in 0..10 {
        s.create(setting(&format!("c{i}"), "1"))
            .await
            .expect("create");
    }
    match late.next().await.expect("relist") {
        WatchChange::Listed(items) => assert_eq!(items.len(), 12, "everything, listed again"),
        other => panic!("expected a new list after the expiry, got {other:?}"),
    }
    assert_eq!(late.relists, 1);
    // The first one had its watch open: it receives every change in order, no relist.
    let mut names = Vec::new();
    while names.len() < 10 {
        if let WatchChange::Event(WatchEvent::Added(o)) = w.next().await.expect("event") {
            names.push(o["metadata"]["name"].as_str().unwrap_or("").to_string());
        }
    }
    let want: Vec<String> = (0..10).map(|i| format!("c{i}")).collect();
    assert_eq!(names, want);
    assert_eq!(w.relists, 0);
}

#[tokio::test]
async fn typed_helpers_round_trip_over_a_dyn_store() {
    let (_d, s) = temp_store();
    let store: Arc<dyn Store> = Arc::new(s);
    let created = store
        .create_as(&Setting::new("x", SettingSpec { value: "1".into() }))
        .await
        .expect("create");
    assert_eq!(created.metadata.generation, 1);
    let got: Setting = store.get_as("x").await.expect("get").expect("exists");
    assert_eq!(got, created);
    let all: Vec<Setting> = store.list_as().await.expect("list");
    assert_eq!(all.len(), 1);
}
