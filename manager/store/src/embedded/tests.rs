use std::collections::BTreeMap;

use futures::StreamExt;
use serde_json::json;

use super::*;
use crate::resources::{Setting, SettingSpec};
use crate::store::TypedStore;

fn setting(name: &str, value: &str) -> Value {
    json!({"apiVersion": API_VERSION, "kind": "Setting", "metadata": {"name": name}, "spec": {"value": value}})
}

fn temp_store() -> (tempfile::TempDir, EmbeddedStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedStore::open(dir.path().join("zebu.redb")).expect("open");
    (dir, store)
}

#[test]
fn create_assigns_identity_and_refuses_duplicates() {
    let (_d, s) = temp_store();
    let a = s.create_sync(setting("a", "1")).expect("create");
    assert_eq!(a["metadata"]["resourceVersion"], "1");
    assert_eq!(a["metadata"]["uid"].as_str().map(str::len), Some(36));
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
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        s.create_sync(json!({"kind": "Pod", "metadata": {"name": "x"}})),
        Err(StoreError::Invalid(_))
    ));
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
    assert_eq!(v2["metadata"]["resourceVersion"], "2");
    match s.update_sync(mine.clone()) {
        Err(StoreError::Conflict { stored, given, .. }) => assert_eq!((stored, given), (2, 1)),
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
    // An object never stored (no resourceVersion) conflicts rather than overwriting.
    let err = s
        .update_sync(setting("a", "blind"))
        .expect_err("blind update");
    assert!(
        matches!(err, StoreError::Conflict { given: 0, .. }),
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
fn update_keeps_status_and_update_status_keeps_spec() {
    let (_d, s) = temp_store();
    let mut v = s.create_sync(setting("a", "1")).expect("create");
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
    assert!(s.get_sync(Kind::Setting, "a").expect("get").is_some());
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
fn resource_version_survives_reopen_and_never_repeats() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("zebu.redb");
    {
        let s = EmbeddedStore::open(&path).expect("open");
        for i in 0..5 {
            s.create_sync(setting(&format!("s{i}"), "x"))
                .expect("create");
        }
        s.delete_sync(Kind::Setting, "s4").expect("delete");
        assert_eq!(s.resource_version().expect("rv"), 6);
    }
    let s = EmbeddedStore::open(&path).expect("reopen");
    let v = s.create_sync(setting("after", "x")).expect("create");
    assert_eq!(v["metadata"]["resourceVersion"], "7");
    let (items, rv) = s.list_sync(Kind::Setting).expect("list");
    assert_eq!(rv, 7);
    let names: Vec<_> = items
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(names, ["after", "s0", "s1", "s2", "s3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_delivers_every_change_once_in_order_across_catch_up_and_live() {
    let (_d, s) = temp_store();
    for i in 0..20 {
        s.create(setting(&format!("pre{i}"), "x"))
            .await
            .expect("create");
    }
    // Start from the middle of the log: catch-up from the db, then live.
    let mut w = s.watch(None, 10).await.expect("watch");
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
                }
            })
        })
        .collect();
    for w in writers {
        w.await.expect("writer");
    }
    let total = 20 + 4 * 25 * 2;
    let mut seen = Vec::new();
    while seen.len() < total - 10 {
        let ev = tokio::time::timeout(std::time::Duration::from_secs(10), w.next())
            .await
            .expect("event within 10 s")
            .expect("stream open")
            .expect("event");
        seen.push(ev);
    }
    let rvs: Vec<u64> = seen.iter().map(|e| e.resource_version).collect();
    let want: Vec<u64> = (11..=total as u64).collect();
    assert_eq!(rvs, want, "every change once, in order, no gaps");
    // Per object: Added before Modified, and the object carries its own version.
    let mut state: BTreeMap<String, EventType> = BTreeMap::new();
    for ev in &seen {
        assert_eq!(
            ev.object["metadata"]["resourceVersion"],
            ev.resource_version.to_string()
        );
        let prev = state.insert(ev.name.clone(), ev.type_);
        if ev.type_ == EventType::Modified {
            assert_eq!(prev, Some(EventType::Added), "{}", ev.name);
        }
    }
}

#[tokio::test]
async fn watch_filters_by_kind_and_reports_deletes() {
    let (_d, s) = temp_store();
    let mut w = s.watch(Some(Kind::Setting), 0).await.expect("watch");
    let node =
        json!({"kind": "Node", "metadata": {"name": "n1"}, "spec": {"address": "127.0.0.10"}});
    s.create(node).await.expect("node");
    s.create(setting("a", "1")).await.expect("create");
    s.delete(Kind::Setting, "a").await.expect("delete");
    let a = w.next().await.expect("open").expect("event");
    let b = w.next().await.expect("open").expect("event");
    assert_eq!((a.type_, a.resource_version), (EventType::Added, 2));
    assert_eq!((b.type_, b.resource_version), (EventType::Deleted, 3));
    assert_eq!(b.object["spec"]["value"], "1", "last state is carried");
}

#[tokio::test]
async fn watch_from_a_pruned_version_expires() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = EmbeddedStore::open_with_log_limit(dir.path().join("z.redb"), 5).expect("open");
    for i in 0..12 {
        s.create(setting(&format!("s{i}"), "x"))
            .await
            .expect("create");
    }
    match s.watch(None, 3).await {
        Err(StoreError::Expired {
            since: 3,
            pruned_through: 7,
        }) => {}
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("a watch from a pruned version must expire"),
    }
    let mut w = s.watch(None, 7).await.expect("watch from the oldest kept");
    let first = w.next().await.expect("open").expect("event");
    assert_eq!(first.resource_version, 8);
}

#[tokio::test]
async fn typed_helpers_round_trip() {
    let (_d, s) = temp_store();
    let created = s
        .create_as(&Setting::new("x", SettingSpec { value: "1".into() }))
        .await
        .expect("create");
    assert_eq!(created.metadata.rv(), 1);
    let got: Setting = s.get_as("x").await.expect("get").expect("exists");
    assert_eq!(got, created);
    let all: Vec<Setting> = s.list_as().await.expect("list");
    assert_eq!(all.len(), 1);
}
