//! A store whose credentials lack RBAC rights reports errors that name the verb and the
//! resource, keeps running, and works once the rights are granted.

mod common;

use std::time::{Duration, Instant};

use serde_json::json;
use zebu_kube_store::KubeStoreOptions;
use zebu_types::store::{ListParams, StoreError};
use zebu_types::{Kind, Store};

fn assert_forbidden(e: &StoreError, verb: &str, kind: Kind, user: &str) {
    match e {
        StoreError::Forbidden {
            verb: v,
            kind: k,
            reason,
        } => {
            assert_eq!(*v, verb, "{e}");
            assert_eq!(*k, kind, "{e}");
            assert!(reason.contains(kind.plural()), "names the resource: {e}");
            assert!(reason.contains(user), "names the user: {e}");
        }
        other => panic!("expected Forbidden to {verb} {kind}, got {other:?}"),
    }
    let text = e.to_string();
    assert!(text.contains(&format!("cannot {verb} {kind}")), "{text}");
}

#[tokio::test]
async fn a_store_without_rights_names_the_verb_and_resource_and_keeps_working() {
    let c = common::cluster();
    let ns = c.namespace("zt-rbac").await;
    let norights = &c.env["ZEBU_K8S_NORIGHTS_USER"];
    let volume = json!({
        "kind": "Volume", "metadata": {"name": "v"},
        "spec": {"size": 1u64 << 30, "numberOfReplicas": 1},
    });

    // Cached (a manager) and uncached (the CLI): each call fails with its own verb.
    let cached = c.store("NORIGHTS", &ns, KubeStoreOptions::default()).await;
    let direct = c
        .store(
            "NORIGHTS",
            &ns,
            KubeStoreOptions {
                cached: false,
                ..Default::default()
            },
        )
        .await;
    let e = cached
        .list(Kind::Volume, &ListParams::all())
        .await
        .expect_err("list");
    assert_forbidden(&e, "list", Kind::Volume, norights);
    // The cache keeps trying in the background; the store answers every call, the same way.
    let e = cached.get(Kind::Volume, "v").await.expect_err("get");
    assert_forbidden(&e, "list", Kind::Volume, norights);
    let e = direct.get(Kind::Volume, "v").await.expect_err("get");
    assert_forbidden(&e, "get", Kind::Volume, norights);
    let e = direct.create(volume.clone()).await.expect_err("create");
    assert_forbidden(&e, "create", Kind::Volume, norights);
    let e = direct
        .watch(Kind::Node, &zebu_types::ResourceVersion::new("0"))
        .await
        .err()
        .expect("watch refused");
    assert_forbidden(&e, "watch", Kind::Node, norights);

    // The manager's user: refused until a Role grants it volumes (and only volumes).
    let manager_user = &c.env["ZEBU_K8S_MANAGER_USER"];
    let manager = c.store("MANAGER", &ns, KubeStoreOptions::default()).await;
    let e = manager
        .list(Kind::Volume, &ListParams::all())
        .await
        .expect_err("list");
    assert_forbidden(&e, "list", Kind::Volume, manager_user);
    let role = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: volumes, namespace: {ns}}}\n\
         rules:\n- apiGroups: [zebu.io]\n  resources: [volumes, volumes/status]\n  verbs: [get, list, watch, create, update, delete]\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: volumes, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: volumes}}\n\
         subjects:\n- {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {manager_user}}}\n"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("role.yaml");
    std::fs::write(&file, role).expect("write role");
    c.kubectl_out(&["apply", "-f", file.to_str().expect("utf-8")]);
    // The same store, without a restart, works once its cache's retry lists.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match manager.list(Kind::Volume, &ListParams::all()).await {
            Ok(l) => {
                assert!(l.items.is_empty());
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert_forbidden(&e, "list", Kind::Volume, manager_user);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("still refused 30 s after the Role was bound: {e}"),
        }
    }
    let created = manager.create(volume).await.expect("create with rights");
    assert_eq!(created["metadata"]["name"], "v");
    assert!(manager.get(Kind::Volume, "v").await.expect("get").is_some());
    // Other kinds stay refused, and say so.
    let e = manager
        .list(Kind::Setting, &ListParams::all())
        .await
        .expect_err("settings");
    assert_forbidden(&e, "list", Kind::Setting, manager_user);
    c.delete_namespace(&ns).await;
}
