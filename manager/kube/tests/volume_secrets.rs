//! Volume secrets in Kubernetes (issue 18; `zebu_kube_store::secrets`) on a real
//! kube-apiserver: a Secret per volume owned by its Volume, made, copied to a node's 0600 file
//! and deleted with only the rights the chart's Role gives secrets (get, create, delete).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use serde_json::json;
use zebu_kube_store::KubeStoreOptions;
use zebu_types::store::StoreError;
use zebu_types::{ObjectMeta, Store};

#[tokio::test]
async fn a_volume_secret_is_owned_by_its_volume_copied_owner_only_and_deleted() {
    let c = common::cluster();
    let ns = c.namespace("zt-secret").await;
    let manager_user = &c.env["ZEBU_K8S_MANAGER_USER"];
    // Exactly the secrets rule of deploy/chart/templates/rbac.yaml, and volumes.
    let role = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: zs, namespace: {ns}}}\n\
         rules:\n- apiGroups: [zebu.io]\n  resources: [volumes]\n  verbs: [get, create]\n\
         - apiGroups: [\"\"]\n  resources: [secrets]\n  verbs: [get, create, delete]\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: zs, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: zs}}\n\
         subjects:\n- {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {manager_user}}}\n"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("role.yaml");
    std::fs::write(&file, role).expect("write role");
    c.kubectl_out(&["apply", "-f", file.to_str().expect("utf-8")]);

    let uncached = KubeStoreOptions {
        cached: false,
        ..Default::default()
    };
    let store = c
        .store("MANAGER", &ns, uncached)
        .await
        .with_secret_dir(dir.path().join("secrets"));
    let volume = json!({
        "kind": "Volume", "metadata": {"name": "v"},
        "spec": {"size": 1u64 << 30, "numberOfReplicas": 1},
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let created = loop {
        match store.create(volume.clone()).await {
            Ok(v) => break v,
            Err(StoreError::Forbidden { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("create the volume: {e}"),
        }
    };
    let owner: ObjectMeta = serde_json::from_value(created["metadata"].clone()).expect("metadata");
    let keeper = store.secrets().expect("a kube store keeps secrets");
    let value = b"0123456789abcdef0123456789abcdef";
    keeper
        .create("zebu-volume-v", &owner, value)
        .await
        .expect("create the secret");
    let again = keeper
        .create("zebu-volume-v", &owner, b"another value, long enough")
        .await;
    assert!(
        matches!(again, Err(StoreError::AlreadyExists { .. })),
        "{again:?}"
    );

    let secrets: Api<Secret> = Api::namespaced(c.admin_client().await, &ns);
    let s = secrets.get("zebu-volume-v").await.expect("the Secret");
    let refs = s.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(refs.len(), 1, "{refs:?}");
    assert_eq!(
        (refs[0].kind.as_str(), refs[0].name.as_str()),
        ("Volume", "v")
    );
    assert_eq!(refs[0].uid, owner.uid);
    assert_eq!(
        s.data.and_then(|mut d| d.remove("secret")).map(|b| b.0),
        Some(value.to_vec())
    );

    let path = keeper
        .local_file("zebu-volume-v")
        .await
        .expect("a local copy");
    assert_eq!(std::fs::read(&path).expect("read"), value);
    let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A stale copy (a former volume's Secret of the same name) is replaced, not used.
    std::fs::write(&path, b"stale stale stale stale").expect("write");
    let path = keeper
        .local_file("zebu-volume-v")
        .await
        .expect("a local copy");
    assert_eq!(std::fs::read(&path).expect("read"), value);

    keeper.delete("zebu-volume-v").await.expect("delete");
    keeper.delete("zebu-volume-v").await.expect("delete again");
    assert!(!path.exists());
    assert!(
        secrets
            .get_opt("zebu-volume-v")
            .await
            .expect("get")
            .is_none()
    );
    assert!(matches!(
        keeper.local_file("zebu-volume-v").await,
        Err(StoreError::NotFound { .. })
    ));
    c.delete_namespace(&ns).await;
}
