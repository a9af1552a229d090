//! The API's OpenAPI 3.0 document (issue 18, item 8), served at `GET /v1/openapi.json` and
//! checked into the repository as `manager/api/openapi.json` (a test fails when the two
//! differ; `ZEBU_WRITE_OPENAPI=1 cargo test -p zebu-api` rewrites the file).
//!
//! The operations are listed by hand in [`operations`], in the order of the route tables in
//! `lib.rs`, `backup.rs`, `standby.rs` and `recurring.rs`. Both directions are checked: a unit
//! test below reads the route tables of this crate's sources and fails on a method and path
//! the router serves that the document lacks (or the other way round), and
//! `manager/tests/openapi.rs` calls every path the document names on a running `zebu up` and
//! fails on one the router does not know. The schemas are
//! generated from the Rust types the handlers decode and encode (schemars, in OpenAPI 3.0
//! form), so a field added to a type is in the document without anyone writing it there.
//!
//! Left out on purpose: `GET /v1/volumes/{name}?watch=true` (an NDJSON stream that does not
//! end while the volume exists) and the `zebu up`-only `/v1/standalone/...` routes.

use schemars::JsonSchema;
use schemars::generate::{SchemaGenerator, SchemaSettings};
use serde_json::{Map, Value, json};
use zebu_types::requests::backup::{
    CreateBackup, GcReportLine, RestoreBackup, SetBackupTarget, VerifyReport,
};
use zebu_types::requests::recurring::CreateRecurringJob;
use zebu_types::requests::standby::CreateStandby;
use zebu_types::requests::{
    AttachVolume, Capacity, CreateSnapshot, CreateVolume, ExpandVolume, Items, SnapshotInfo,
    StartScrub,
};
use zebu_types::resources::{
    Backup, BackupTarget, Node, RecurringJob, ScrubInfo, Snapshot, Volume,
};

/// A body or answer: a generated schema, or one written here.
#[derive(Clone, Copy)]
enum Body {
    None,
    Of(fn(&mut SchemaGenerator) -> Value),
}

fn of<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

/// `{"deleted": bool, "object": T or null}`: what the deletes answer.
fn deleted<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    // A `$ref` cannot carry `nullable` in OpenAPI 3.0: wrap it.
    let object = json!({ "allOf": [of::<T>(g)], "nullable": true });
    json!({
        "type": "object",
        "required": ["deleted", "object"],
        "properties": { "deleted": { "type": "boolean" }, "object": object },
    })
}

/// `{"deleted": true}`: what deleting a recurring job answers.
fn deleted_flag(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object",
        "required": ["deleted"],
        "properties": { "deleted": { "type": "boolean" } },
    })
}

/// The document itself: an OpenAPI 3.0 object, not described further here.
fn any_object(_: &mut SchemaGenerator) -> Value {
    json!({ "type": "object" })
}

fn population(_: &mut SchemaGenerator) -> Value {
    json!({
        "type": "object",
        "required": ["population"],
        "properties": { "population": { "type": "string", "nullable": true } },
    })
}

/// One operation of the API.
struct Op {
    method: &'static str,
    path: &'static str,
    id: &'static str,
    summary: &'static str,
    /// Query parameters: (name, schema type, description).
    query: &'static [(&'static str, &'static str, &'static str)],
    body: Body,
    /// Whether the body may be left out (the defaults).
    body_optional: bool,
    status: u16,
    answer: Body,
}

const fn op(
    method: &'static str,
    path: &'static str,
    id: &'static str,
    summary: &'static str,
) -> Op {
    Op {
        method,
        path,
        id,
        summary,
        query: &[],
        body: Body::None,
        body_optional: false,
        status: 200,
        answer: Body::None,
    }
}

/// Every operation of the cluster API, in the order of the route tables.
fn operations() -> Vec<Op> {
    use Body::Of;
    vec![
        Op {
            answer: Of(of::<Items<Volume>>),
            ..op("get", "/v1/volumes", "listVolumes", "List volumes")
        },
        Op {
            body: Of(of::<CreateVolume>),
            status: 201,
            answer: Of(of::<Volume>),
            ..op("post", "/v1/volumes", "createVolume", "Create a volume")
        },
        Op {
            answer: Of(of::<Volume>),
            ..op("get", "/v1/volumes/{name}", "getVolume", "One volume")
        },
        Op {
            answer: Of(deleted::<Volume>),
            ..op(
                "delete",
                "/v1/volumes/{name}",
                "deleteVolume",
                "Delete a volume (held while its engine and replicas go)",
            )
        },
        Op {
            body: Of(of::<AttachVolume>),
            body_optional: true,
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/volumes/{name}/attach",
                "attachVolume",
                "Want a volume attached",
            )
        },
        Op {
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/volumes/{name}/detach",
                "detachVolume",
                "Want a volume detached",
            )
        },
        Op {
            body: Of(of::<ExpandVolume>),
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/volumes/{name}/expand",
                "expandVolume",
                "Grow a volume",
            )
        },
        Op {
            answer: Of(of::<Items<SnapshotInfo>>),
            ..op(
                "get",
                "/v1/volumes/{name}/snapshots",
                "listSnapshots",
                "A volume's snapshots (attached volumes)",
            )
        },
        Op {
            body: Of(of::<CreateSnapshot>),
            body_optional: true,
            answer: Of(of::<Items<SnapshotInfo>>),
            ..op(
                "post",
                "/v1/volumes/{name}/snapshots",
                "createSnapshot",
                "Take a snapshot",
            )
        },
        Op {
            answer: Of(of::<Items<SnapshotInfo>>),
            ..op(
                "delete",
                "/v1/volumes/{name}/snapshots/{snapshot}",
                "deleteSnapshot",
                "Delete a snapshot",
            )
        },
        Op {
            answer: Of(of::<Items<SnapshotInfo>>),
            ..op(
                "post",
                "/v1/volumes/{name}/snapshots/{snapshot}/revert",
                "revertSnapshot",
                "Revert a volume to a snapshot",
            )
        },
        Op {
            answer: Of(of::<ScrubInfo>),
            ..op(
                "get",
                "/v1/volumes/{name}/scrub",
                "scrubStatus",
                "The running or last scrub",
            )
        },
        Op {
            body: Of(of::<StartScrub>),
            body_optional: true,
            answer: Of(of::<ScrubInfo>),
            ..op(
                "post",
                "/v1/volumes/{name}/scrub",
                "startScrub",
                "Start a scrub (attached volumes)",
            )
        },
        Op {
            answer: Of(of::<ScrubInfo>),
            ..op(
                "post",
                "/v1/volumes/{name}/scrub/stop",
                "stopScrub",
                "Stop the running scrub",
            )
        },
        Op {
            answer: Of(population),
            ..op(
                "post",
                "/v1/volumes/{name}/populate",
                "populateVolume",
                "Start (again) the copy from the volume's data source",
            )
        },
        Op {
            query: &[("volume", "string", "Only this volume's")],
            answer: Of(of::<Items<Snapshot>>),
            ..op(
                "get",
                "/v1/snapshots",
                "listSnapshotRecords",
                "Snapshot records",
            )
        },
        Op {
            query: &[
                ("node", "string", "Only this node"),
                ("zone", "string", "Only this zone"),
            ],
            answer: Of(of::<Capacity>),
            ..op(
                "get",
                "/v1/capacity",
                "capacity",
                "What new replicas can take",
            )
        },
        Op {
            answer: Of(of::<Items<Node>>),
            ..op("get", "/v1/nodes", "listNodes", "List nodes")
        },
        Op {
            answer: Of(any_object),
            ..op(
                "get",
                "/v1/openapi.json",
                "getOpenApi",
                "This document (OpenAPI 3.0)",
            )
        },
        Op {
            answer: Of(of::<BackupTarget>),
            ..op(
                "get",
                "/v1/backuptarget",
                "getBackupTarget",
                "The backup target",
            )
        },
        Op {
            body: Of(of::<SetBackupTarget>),
            answer: Of(of::<BackupTarget>),
            ..op(
                "put",
                "/v1/backuptarget",
                "setBackupTarget",
                "Set the backup target",
            )
        },
        Op {
            query: &[("wait", "boolean", "Wait for GC to end (200; else 202)")],
            status: 202,
            answer: Of(of::<GcReportLine>),
            ..op(
                "post",
                "/v1/backuptarget/gc",
                "backupGc",
                "Run backup GC now",
            )
        },
        Op {
            query: &[("volume", "string", "Only this volume's")],
            answer: Of(of::<Items<Backup>>),
            ..op("get", "/v1/backups", "listBackups", "List backups")
        },
        Op {
            body: Of(of::<CreateBackup>),
            status: 201,
            answer: Of(of::<Backup>),
            ..op("post", "/v1/backups", "createBackup", "Back up a volume")
        },
        Op {
            answer: Of(of::<Backup>),
            ..op("get", "/v1/backups/{name}", "getBackup", "One backup")
        },
        Op {
            answer: Of(deleted::<Backup>),
            ..op(
                "delete",
                "/v1/backups/{name}",
                "deleteBackup",
                "Delete a backup from the target",
            )
        },
        Op {
            answer: Of(of::<VerifyReport>),
            ..op(
                "post",
                "/v1/backups/{name}/verify",
                "verifyBackup",
                "Read and check every chunk of a backup",
            )
        },
        Op {
            body: Of(of::<RestoreBackup>),
            status: 201,
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/backups/{name}/restore",
                "restoreBackup",
                "A new volume from a backup",
            )
        },
        Op {
            body: Of(of::<CreateStandby>),
            status: 201,
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/standby",
                "createStandby",
                "A standby volume following another's backups",
            )
        },
        Op {
            answer: Of(of::<Volume>),
            ..op(
                "post",
                "/v1/volumes/{name}/activate",
                "activateStandby",
                "End standby mode",
            )
        },
        Op {
            answer: Of(of::<Items<RecurringJob>>),
            ..op(
                "get",
                "/v1/recurringjobs",
                "listRecurringJobs",
                "List recurring jobs, by name",
            )
        },
        Op {
            body: Of(of::<CreateRecurringJob>),
            status: 201,
            answer: Of(of::<RecurringJob>),
            ..op(
                "post",
                "/v1/recurringjobs",
                "createRecurringJob",
                "Schedule snapshots or backups of some volumes",
            )
        },
        Op {
            answer: Of(of::<RecurringJob>),
            ..op(
                "get",
                "/v1/recurringjobs/{name}",
                "getRecurringJob",
                "One recurring job and its status",
            )
        },
        Op {
            answer: Of(deleted_flag),
            ..op(
                "delete",
                "/v1/recurringjobs/{name}",
                "deleteRecurringJob",
                "Delete a recurring job (what it took stays)",
            )
        },
    ]
}

/// The paths of the document, for the test that compares them with the router.
pub fn paths() -> Vec<(&'static str, &'static str)> {
    operations().iter().map(|o| (o.method, o.path)).collect()
}

fn path_params(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            json!({
                "name": name,
                "in": "path",
                "required": true,
                "schema": { "type": "string" },
            })
        })
        .collect()
}

fn json_content(schema: Value) -> Value {
    json!({ "application/json": { "schema": schema } })
}

/// The whole document.
pub fn document() -> Value {
    let mut g = SchemaSettings::openapi3().into_generator();
    let error = json!({ "$ref": "#/components/schemas/Error" });
    let mut paths = Map::new();
    for o in operations() {
        let mut operation = Map::new();
        operation.insert("operationId".into(), o.id.into());
        operation.insert("summary".into(), o.summary.into());
        let mut params = path_params(o.path);
        for (name, ty, description) in o.query {
            params.push(json!({
                "name": name,
                "in": "query",
                "required": false,
                "description": description,
                "schema": { "type": ty },
            }));
        }
        if !params.is_empty() {
            operation.insert("parameters".into(), Value::Array(params));
        }
        if let Body::Of(f) = o.body {
            operation.insert(
                "requestBody".into(),
                json!({ "required": !o.body_optional, "content": json_content(f(&mut g)) }),
            );
        }
        let mut responses = Map::new();
        if let Body::Of(f) = o.answer {
            let schema = f(&mut g);
            let mut codes = vec![o.status];
            if o.id == "backupGc" {
                codes.push(200);
            }
            for code in codes {
                responses.insert(
                    code.to_string(),
                    json!({ "description": "done", "content": json_content(schema.clone()) }),
                );
            }
        }
        responses.insert(
            "4XX".into(),
            json!({
                "description": "the request cannot be carried out (400 invalid, 403 forbidden, 404 missing, 405 method, 409 exists or not now, 410 expired, 413/415 body)",
                "content": json_content(error.clone()),
            }),
        );
        responses.insert(
            "503".into(),
            json!({ "description": "the store cannot be reached just now", "content": json_content(error.clone()) }),
        );
        responses.insert(
            "504".into(),
            json!({ "description": "an engine did not answer in time", "content": json_content(error.clone()) }),
        );
        operation.insert("responses".into(), Value::Object(responses));
        let entry = paths
            .entry(o.path.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(m) = entry {
            m.insert(o.method.into(), Value::Object(operation));
        }
    }
    let mut schemas: Map<String, Value> = g.take_definitions(true).into_iter().collect();
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": { "type": "string", "description": "what went wrong, in one line" },
                "code": { "type": "string", "description": "the gRPC code name of the operation's error" },
            },
        }),
    );
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Zebu manager API",
            "version": "v1",
            "description": "Volumes, snapshots, backups and nodes of a Zebu cluster (`zebu up` on one host, `zebu manager` in Kubernetes). Lists are {\"items\": [...]}; errors are {\"error\": ..., \"code\": ...}.",
        },
        "paths": paths,
        "components": { "schemas": schemas },
    })
}

/// The document as it is checked in: pretty JSON with a final newline.
pub fn document_text() -> String {
    let mut s = serde_json::to_string_pretty(&document()).expect("invariant: JSON encodes");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");

    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let now = document_text();
        if std::env::var_os("ZEBU_WRITE_OPENAPI").is_some() {
            std::fs::write(CHECKED_IN, &now).expect("write openapi.json");
        }
        let file = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
        assert!(
            file == now,
            "manager/api/openapi.json is not the API's document; run \
             ZEBU_WRITE_OPENAPI=1 cargo test -p zebu-api openapi, and review the diff"
        );
    }

    /// The `(method, path)` pairs of every `.route(...)` call in this crate's sources: the
    /// route tables the router is built from (axum cannot list a router's routes).
    fn routed() -> BTreeSet<(String, String)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let mut found = BTreeSet::new();
        for e in std::fs::read_dir(dir).expect("the crate's src directory") {
            let path = e.expect("a directory entry").path();
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            for call in text.split(".route(").skip(1) {
                // A route table's call names its path first (this file's own mentions of
                // the call, here, do not).
                if !call.trim_start().starts_with("\"/") {
                    continue;
                }
                // The call's arguments: up to the parenthesis that closes `.route(`.
                let mut depth = 1;
                let end = call
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '(' => 1,
                            ')' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .map(|(i, _)| i)
                    .expect("a closed .route( call");
                let args = &call[..end];
                let route = args.split('"').nth(1).expect("a path literal").to_string();
                let tail = &args[args.find(',').expect("a method router")..];
                let mut methods = 0;
                for m in ["get", "post", "put", "delete", "patch"] {
                    let call = format!("{m}(");
                    let calls = tail.match_indices(&call).filter(|&(i, _)| {
                        !tail[..i]
                            .chars()
                            .next_back()
                            .is_some_and(|c| c.is_alphanumeric() || c == '_')
                    });
                    for _ in calls {
                        found.insert((m.to_string(), route.clone()));
                        methods += 1;
                    }
                }
                assert!(methods > 0, "no method found for route {route} in {path:?}");
            }
        }
        found
    }

    /// A route served but not documented (or documented but not served) fails here, before
    /// any cluster runs: the document is written by hand (module docs).
    #[test]
    fn the_document_has_every_route_of_the_router_and_no_other() {
        let routed = routed();
        assert!(
            routed.len() >= 34,
            "only {} routes read from the sources: the scan is broken",
            routed.len()
        );
        let documented: BTreeSet<(String, String)> = paths()
            .into_iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        let undocumented: Vec<_> = routed.difference(&documented).collect();
        let unrouted: Vec<_> = documented.difference(&routed).collect();
        assert!(
            undocumented.is_empty(),
            "routes the router serves but the OpenAPI document lacks (add them to \
             `operations` in openapi.rs): {undocumented:?}"
        );
        assert!(
            unrouted.is_empty(),
            "operations in the OpenAPI document that no route serves: {unrouted:?}"
        );
    }

    #[test]
    fn every_schema_reference_resolves() {
        let doc = document();
        let schemas = doc["components"]["schemas"].as_object().expect("schemas");
        let text = doc.to_string();
        for part in text.split("\"$ref\":\"").skip(1) {
            let r = part.split('"').next().expect("a ref");
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("a reference outside the components: {r}"));
            assert!(schemas.contains_key(name), "{r} does not resolve");
        }
    }
}
