//! The CustomResourceDefinitions of Zebu's kinds, generated from the Rust types.
//!
//! Why a generator over the types' own `schemars` schemas rather than kube-rs's
//! `CustomResource` derive: the derive makes its own root type around a spec, with
//! k8s-openapi's `ObjectMeta`; Zebu's resources already are whole Kubernetes-shaped objects
//! with their own [`ObjectMeta`](zebu_types::ObjectMeta), shared by the embedded store, the
//! REST API and the CLI, and `zebu-types` deliberately depends on no Kubernetes crate. The
//! schemas the derive would read are the same `schemars` schemas, so this module reads them
//! directly ([`crate::schema`] makes them structural) and adds what only a CRD has: names,
//! scope, the status subresource and printer columns.
//!
//! Every kind is namespaced (in `zebu-system`, [`zebu_types::DEFAULT_NAMESPACE`]): a store
//! holds one namespace, RBAC for the managers is then a Role in one namespace rather than
//! cluster-wide rights, and two installations (or two tests) on one API server stay apart.
//! Every kind has the `status` subresource (status is written by `update_status` only, as
//! the store contract says), a `z`-prefixed short name and the category `zebu`
//! (`kubectl get zebu` lists them all).
//!
//! Sizes are bytes in the objects (exact, as the engine and replicas need them); kubectl
//! cannot format a number, so the Kubernetes store writes the human form next to them in
//! `status.display` ([`crate::present`]) and the Size columns print that.

use serde_json::{Value, json};
use zebu_types::resources::{
    Backup, BackupTarget, Engine, Node, RecurringJob, Replica, Setting, Snapshot, Volume,
};
use zebu_types::{GROUP, Kind, VERSION};

use crate::schema::{SchemaError, sorted, structural_for};

/// One `additionalPrinterColumns` entry.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    pub name: &'static str,
    /// `string`, `integer`, `number`, `boolean` or `date`.
    pub type_: &'static str,
    pub json_path: &'static str,
    pub description: &'static str,
    /// 0: always shown; 1: only with `-o wide`.
    pub priority: u8,
}

const fn col(
    name: &'static str,
    type_: &'static str,
    json_path: &'static str,
    description: &'static str,
) -> Column {
    Column {
        name,
        type_,
        json_path,
        description,
        priority: 0,
    }
}

const fn wide(
    name: &'static str,
    type_: &'static str,
    json_path: &'static str,
    description: &'static str,
) -> Column {
    Column {
        name,
        type_,
        json_path,
        description,
        priority: 1,
    }
}

const AGE: Column = col(
    "Age",
    "date",
    ".metadata.creationTimestamp",
    "Time since the object was created",
);

/// What `kubectl get` prints for each kind, in order.
pub fn columns(kind: Kind) -> Vec<Column> {
    match kind {
        Kind::Volume => vec![
            col("State", "string", ".status.state", "Attach state"),
            col(
                "Robustness",
                "string",
                ".status.robustness",
                "healthy, degraded, faulted or unknown",
            ),
            col("Size", "string", ".status.display.size", "Volume size"),
            col(
                "Replicas",
                "string",
                ".status.display.replicas",
                "Healthy (RW) replicas / replicas wanted",
            ),
            col(
                "Node",
                "string",
                ".status.currentNode",
                "Node the volume is attached to",
            ),
            col(
                "Frontend",
                "string",
                ".spec.frontend",
                "How the volume is served",
            ),
            AGE,
            wide(
                "Wanted-Node",
                "string",
                ".spec.nodeId",
                "Node the volume should be attached to",
            ),
            wide(
                "Endpoint",
                "string",
                ".status.endpoint",
                "Where its frontend listens",
            ),
            wide("Locality", "string", ".spec.dataLocality", "Data locality"),
            wide(
                "Rebuilding",
                "string",
                ".status.rebuild.replica",
                "Replica being rebuilt",
            ),
        ],
        Kind::Engine => vec![
            col("Volume", "string", ".spec.volume", "Volume it serves"),
            col("Node", "string", ".spec.node", "Node it runs on"),
            col("State", "string", ".status.state", "Process state"),
            col(
                "Volume-State",
                "string",
                ".status.volumeState",
                "The engine's verdict on its replicas",
            ),
            col("Size", "string", ".status.display.size", "Volume size"),
            col(
                "Endpoint",
                "string",
                ".status.endpoint",
                "Where its frontend listens",
            ),
            AGE,
            wide("PID", "integer", ".status.pid", "Process id on its node"),
            wide(
                "Control",
                "string",
                ".status.controlAddress",
                "Its gRPC control address",
            ),
            wide(
                "Salvage",
                "boolean",
                ".spec.salvage",
                "Started with --salvage",
            ),
        ],
        Kind::Replica => vec![
            col("Volume", "string", ".spec.volume", "Volume it is a copy of"),
            col("Node", "string", ".spec.node", "Node it lives on"),
            col("State", "string", ".status.state", "Process state"),
            col(
                "Mode",
                "string",
                ".status.mode",
                "RW, WO (rebuilding) or ERR",
            ),
            col("Size", "string", ".status.display.size", "Volume size"),
            AGE,
            wide("Disk", "string", ".spec.disk", "Disk it lives on"),
            wide("Address", "string", ".status.address", "Where it listens"),
            wide("PID", "integer", ".status.pid", "Process id on its node"),
            wide("Path", "string", ".spec.dataPath", "Its data directory"),
        ],
        Kind::Node => vec![
            col("Address", "string", ".spec.address", "Node address"),
            col(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status",
                "Its agent heartbeats",
            ),
            col(
                "Schedulable",
                "boolean",
                ".spec.allowScheduling",
                "Takes new replicas",
            ),
            col(
                "Heartbeat",
                "date",
                ".status.lastHeartbeat",
                "Time since the last heartbeat",
            ),
            AGE,
            wide("Tags", "string", ".spec.tags", "Node tags"),
        ],
        Kind::Setting => vec![
            col("Value", "string", ".spec.value", "The setting's value"),
            AGE,
        ],
        Kind::Snapshot => vec![
            col("Volume", "string", ".spec.volume", "Volume it is of"),
            col(
                "Ready",
                "boolean",
                ".status.readyToUse",
                "Taken on every replica",
            ),
            col("Size", "string", ".status.display.size", "Data it holds"),
            col(
                "Taken",
                "date",
                ".status.creationTime",
                "When the engine took it",
            ),
            AGE,
            wide("Parent", "string", ".status.parent", "Snapshot below it"),
            wide("Error", "string", ".status.error", "Why it failed"),
        ],
        Kind::Backup => vec![
            col("Volume", "string", ".spec.volume", "Volume backed up"),
            col("Snapshot", "string", ".spec.snapshot", "Snapshot backed up"),
            col(
                "Target",
                "string",
                ".spec.backupTarget",
                "Backup target it goes to",
            ),
            col("State", "string", ".status.state", "Backup state"),
            col(
                "Progress",
                "integer",
                ".status.progress",
                "Percent uploaded",
            ),
            col(
                "Size",
                "string",
                ".status.display.size",
                "Size of the volume",
            ),
            AGE,
            wide("URL", "string", ".status.url", "Where it is stored"),
            wide("Error", "string", ".status.error", "Why it failed"),
        ],
        Kind::BackupTarget => vec![
            col("URL", "string", ".spec.url", "s3:// or file:// URL"),
            col(
                "Available",
                "boolean",
                ".status.available",
                "Reachable at the last poll",
            ),
            col(
                "Synced",
                "date",
                ".status.lastSyncedAt",
                "Time since the last poll",
            ),
            AGE,
            wide(
                "Credentials",
                "string",
                ".spec.credentialSecret",
                "Secret holding the credentials",
            ),
            wide(
                "Poll",
                "integer",
                ".spec.pollInterval",
                "Seconds between polls",
            ),
        ],
        Kind::RecurringJob => vec![
            col("Task", "string", ".spec.task", "snapshot or backup"),
            col("Cron", "string", ".spec.cron", "Schedule"),
            col("Retain", "integer", ".spec.retain", "How many are kept"),
            col(
                "Concurrency",
                "integer",
                ".spec.concurrency",
                "Volumes at a time",
            ),
            col(
                "Last-Run",
                "date",
                ".status.lastRunAt",
                "Time since the last run",
            ),
            AGE,
            wide(
                "Groups",
                "string",
                ".spec.groups",
                "Volume groups it runs on",
            ),
        ],
    }
}

/// `status.display`: what the Kubernetes store derives for `kubectl get` (see
/// [`crate::present`]); part of the schema so the API server keeps it.
fn display_schema(kind: Kind) -> Option<Value> {
    let size = json!({
        "type": "string",
        "description": "The size in binary units (10Gi), for kubectl; derived by the store from the size in bytes at every status write.",
    });
    let mut props = serde_json::Map::new();
    match kind {
        Kind::Volume => {
            props.insert("size".into(), size);
            props.insert(
                "replicas".into(),
                json!({
                    "type": "string",
                    "description": "Healthy (RW) replicas / spec.numberOfReplicas (2/3), for kubectl; derived by the store at every status write.",
                }),
            );
        }
        Kind::Engine | Kind::Replica | Kind::Snapshot | Kind::Backup => {
            props.insert("size".into(), size);
        }
        Kind::Node | Kind::Setting | Kind::BackupTarget | Kind::RecurringJob => return None,
    }
    Some(json!({
        "type": "object",
        "description": "What kubectl prints, derived by the Kubernetes store from the object at every status write; never read by Zebu.",
        "properties": props,
    }))
}

/// The whole-resource schema of `kind` (`apiVersion`, `kind`, `metadata`, `spec`, `status`).
fn resource_schema(kind: Kind) -> Result<Value, SchemaError> {
    match kind {
        Kind::Volume => structural_for::<Volume>(),
        Kind::Engine => structural_for::<Engine>(),
        Kind::Replica => structural_for::<Replica>(),
        Kind::Node => structural_for::<Node>(),
        Kind::Setting => structural_for::<Setting>(),
        Kind::Snapshot => structural_for::<Snapshot>(),
        Kind::Backup => structural_for::<Backup>(),
        Kind::BackupTarget => structural_for::<BackupTarget>(),
        Kind::RecurringJob => structural_for::<RecurringJob>(),
    }
}

/// `openAPIV3Schema` of `kind`: the types' spec and status, metadata left to the server.
pub fn open_api_schema(kind: Kind) -> Result<Value, SchemaError> {
    let full = resource_schema(kind)?;
    let missing = |what: &str| SchemaError {
        type_name: kind.to_string(),
        path: ".".into(),
        reason: format!("the resource schema has no {what}"),
    };
    let mut spec = full
        .pointer("/properties/spec")
        .cloned()
        .ok_or_else(|| missing("spec"))?;
    let mut status = full
        .pointer("/properties/status")
        .cloned()
        .ok_or_else(|| missing("status"))?;
    if let Some(display) = display_schema(kind) {
        match status.as_object_mut() {
            Some(s) => {
                let props = s.entry("properties").or_insert_with(|| json!({}));
                props["display"] = display;
            }
            None => return Err(missing("status object")),
        }
    }
    for (part, what) in [
        (&mut spec, "What is wanted of this object."),
        (
            &mut status,
            "What Zebu last observed of this object (written through the status subresource).",
        ),
    ] {
        if part.get("description").is_none() {
            part["description"] = json!(what);
        }
    }
    let mut schema = json!({
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "zebu.io/v1alpha1"},
            "kind": {"type": "string", "description": kind.as_str()},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    });
    if let Some(d) = full.get("description") {
        schema["description"] = d.clone();
    }
    Ok(schema)
}

/// The CRD of `kind`, as a JSON object with sorted keys.
pub fn crd(kind: Kind) -> Result<Value, SchemaError> {
    let columns: Vec<Value> = columns(kind)
        .into_iter()
        .map(|c| {
            let mut v = json!({
                "name": c.name,
                "type": c.type_,
                "jsonPath": c.json_path,
                "description": c.description,
            });
            if c.priority > 0 {
                v["priority"] = json!(c.priority);
            }
            v
        })
        .collect();
    let crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": format!("{}.{GROUP}", kind.plural()),
            "labels": {"app.kubernetes.io/part-of": "zebu"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.as_str(),
                "listKind": format!("{}List", kind.as_str()),
                "plural": kind.plural(),
                "singular": kind.as_str().to_lowercase(),
                "shortNames": [kind.short_name()],
                "categories": ["zebu"],
            },
            "versions": [{
                "name": VERSION,
                "served": true,
                "storage": true,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": open_api_schema(kind)?},
            }],
        },
    });
    Ok(sorted(&crd))
}

/// The file name of `kind`'s CRD in `deploy/crds/`.
pub fn file_name(kind: Kind) -> String {
    format!("{}.{GROUP}.yaml", kind.plural())
}

/// The command that rewrites `deploy/crds/` from the types; the drift test prints it.
pub const REGENERATE: &str = "cargo run -p zebu-kube-store --bin zebu-crds -- deploy/crds";

/// The YAML of `kind`'s CRD file, with a header saying where it comes from.
pub fn yaml(kind: Kind) -> Result<String, CrdError> {
    let body =
        serde_yaml::to_string(&crd(kind)?).map_err(|source| CrdError::Yaml { kind, source })?;
    Ok(format!(
        "# Generated from the Rust types in manager/types (zebu-kube-store's crd module).\n\
         # Do not edit: change the types, then run `{REGENERATE}`.\n{body}"
    ))
}

#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("cannot write the {kind} CRD as YAML: {source}")]
    Yaml {
        kind: Kind,
        #[source]
        source: serde_yaml::Error,
    },
}
