use super::*;
use crate::size::ByteSize;
use crate::{API_VERSION, ResourceVersion};

fn volume() -> Volume {
    Volume::new(
        "db",
        VolumeSpec {
            size: ByteSize(10 << 30),
            number_of_replicas: 3,
            frontend: Frontend::Nbd,
            node_selector: vec![],
            disk_selector: vec!["ssd".into()],
            data_locality: DataLocality::BestEffort,
            stale_replica_timeout: 60,
            node_id: None,
            disable_frontend: false,
        },
    )
}

#[test]
fn volume_json_is_kubernetes_shaped() {
    let mut v = volume();
    v.metadata.resource_version = ResourceVersion::new("7");
    v.status.observed_generation = 2;
    let json = serde_json::to_value(&v).expect("serialise");
    assert_eq!(json["apiVersion"], API_VERSION);
    assert_eq!(json["kind"], "Volume");
    assert_eq!(json["metadata"]["resourceVersion"], "7");
    assert_eq!(json["spec"]["numberOfReplicas"], 3);
    assert_eq!(json["spec"]["size"], 10u64 << 30);
    assert_eq!(json["spec"]["frontend"], "nbd");
    assert_eq!(json["spec"]["dataLocality"], "best-effort");
    assert_eq!(json["spec"]["diskSelector"][0], "ssd");
    assert!(
        json["spec"].get("disableFrontend").is_none(),
        "false is left out"
    );
    assert_eq!(json["status"]["robustness"], "unknown");
    assert_eq!(json["status"]["observedGeneration"], 2);
    let back: Volume = serde_json::from_value(json).expect("deserialise");
    assert_eq!(back, v);
}

/// What older managers stored still reads: statuses as strings that are enums now, and a
/// volume without the fields added since.
#[test]
fn objects_stored_by_earlier_versions_still_read() {
    let engine: Engine = serde_json::from_value(serde_json::json!({
        "apiVersion": API_VERSION, "kind": "Engine",
        "metadata": {"name": "v-e", "resourceVersion": "12"},
        "spec": {"volume": "v", "node": "node-1", "size": 4096, "frontend": "nbd", "salvage": false},
        "status": {"state": "running", "volumeState": "degraded",
                   "rebuild": {"replica": "v-r-1", "state": "running", "kind": "catch-up",
                               "bytesDone": 1, "bytesTotal": 2}}
    }))
    .expect("old engine");
    assert_eq!(
        engine.status.volume_state,
        Some(EngineVolumeState::Degraded)
    );
    let r = engine.status.rebuild.expect("rebuild");
    assert_eq!(
        (r.state, r.kind),
        (RebuildState::Running, RebuildKind::CatchUp)
    );
    assert!(!engine.spec.disable_frontend);
}

#[test]
fn schemas_generate_for_every_kind() {
    let schemas = [
        ("Volume", schemars::schema_for!(Volume)),
        ("Engine", schemars::schema_for!(Engine)),
        ("Replica", schemars::schema_for!(Replica)),
        ("Node", schemars::schema_for!(Node)),
        ("Setting", schemars::schema_for!(Setting)),
        ("Snapshot", schemars::schema_for!(Snapshot)),
        ("Backup", schemars::schema_for!(Backup)),
        ("BackupTarget", schemars::schema_for!(BackupTarget)),
        ("RecurringJob", schemars::schema_for!(RecurringJob)),
    ];
    assert_eq!(schemas.len(), crate::Kind::ALL.len());
    for (kind, schema) in schemas {
        let text = serde_json::to_string(&schema).expect("schema json");
        assert!(text.contains("\"spec\""), "{kind}: {text}");
        assert!(text.contains("\"metadata\""), "{kind}: {text}");
        assert!(crate::Kind::parse(kind).is_some());
    }
    let text = serde_json::to_string(&schemars::schema_for!(Volume)).expect("json");
    assert!(text.contains("numberOfReplicas"));
    assert!(text.contains("best-effort"));
    assert!(text.contains("observedGeneration"));
}

#[test]
fn conditions_keep_transition_time_when_status_is_unchanged() {
    let mut c = vec![];
    set_condition_at(
        &mut c,
        "Ready",
        ConditionStatus::True,
        "",
        "",
        "2025-01-01T00:00:00Z",
    );
    set_condition_at(
        &mut c,
        "Ready",
        ConditionStatus::True,
        "Heartbeat",
        "",
        "2026-01-01T00:00:00Z",
    );
    assert_eq!(
        c[0].last_transition_time.as_deref(),
        Some("2025-01-01T00:00:00Z")
    );
    assert_eq!(c[0].reason, "Heartbeat");
    set_condition(&mut c, "Ready", ConditionStatus::False, "Lost", "");
    assert_ne!(
        c[0].last_transition_time.as_deref(),
        Some("2025-01-01T00:00:00Z")
    );
    assert!(!condition_is_true(&c, "Ready"));
}
