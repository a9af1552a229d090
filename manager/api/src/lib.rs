//! The REST API (axum, JSON) that the `zebu` CLI and the web UI talk to.
//!
//! | method | path                              | does                          |
//! |--------|-----------------------------------|-------------------------------|
//! | GET    | `/v1/volumes`                     | list volumes                  |
//! | POST   | `/v1/volumes`                     | create (a [`CreateVolume`])   |
//! | GET    | `/v1/volumes/{name}[?watch=true]` | one volume; with `watch`, an NDJSON stream of it, current state first |
//! | DELETE | `/v1/volumes/{name}`              | delete                        |
//! | POST   | `/v1/volumes/{name}/attach`       | want it attached (`{"node"}`) |
//! | POST   | `/v1/volumes/{name}/detach`       | want it detached              |
//! | GET    | `/v1/volumes/{name}/snapshots`    | its snapshots (attached only) |
//! | POST   | `/v1/volumes/{name}/snapshots`    | take one (`{"name"}`, optional) |
//! | DELETE | `/v1/volumes/{name}/snapshots/{s}`| delete one                    |
//! | GET    | `/v1/nodes`                       | list nodes                    |
//!
//! Handlers only validate and write `spec` through the [`Store`];
//! controllers and node agents make it so and write `status`. Snapshots
//! are the exception: they live in the replicas, so their handlers ask the
//! volume's running engine, and a detached volume has none to ask. Every error
//! is `{"error": "..."}` with a 4xx status for the caller's mistakes
//! (400 invalid, 404 missing, 409 exists/conflict) and 5xx for ours.
//! Lists are `{"items": [...]}` as in Kubernetes.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::resources::{
    DataLocality, Engine, EngineState, Frontend, Kind, Node, Replica, Resource, Setting, Volume,
    VolumeSpec,
};
use crate::scheduler::{ScheduleRequest, schedule};
use crate::settings::Settings;
use crate::size::ByteSize;
use crate::store::{Store, StoreError, TypedStore, validate_name};

/// An error as the API reports it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, "API error: {}", self.message);
        }
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let status = match &e {
            StoreError::NotFound { .. } => StatusCode::NOT_FOUND,
            StoreError::AlreadyExists { .. } | StoreError::Conflict { .. } => StatusCode::CONFLICT,
            StoreError::Invalid(_) => StatusCode::BAD_REQUEST,
            StoreError::Expired { .. } => StatusCode::GONE,
            StoreError::Db { .. } | StoreError::Codec { .. } | StoreError::Task(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        ApiError {
            status,
            message: e.to_string(),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("invalid request body: {}", r.body_text()),
        }
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A size given as bytes (`10737418240`) or as text (`"10G"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizeInput {
    Bytes(u64),
    Text(String),
}

impl SizeInput {
    fn resolve(&self) -> ApiResult<ByteSize> {
        match self {
            SizeInput::Bytes(b) => Ok(ByteSize(*b)),
            SizeInput::Text(t) => t
                .parse()
                .map_err(|e: crate::size::SizeError| ApiError::bad_request(e.to_string())),
        }
    }
}

/// The body of `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    pub size: SizeInput,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Frontend>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_selector: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_selector: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_locality: Option<DataLocality>,
}

/// The body of `POST /v1/volumes/{name}/attach`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    #[serde(default)]
    pub node: Option<String>,
}

/// Volumes must be whole 4 KiB blocks: the frontends expose 4 KiB sectors.
pub const VOLUME_ALIGNMENT: u64 = 4096;
pub const MAX_REPLICAS: u32 = 20;

pub fn router<S: Store>(store: Arc<S>) -> Router {
    Router::new()
        .route(
            "/v1/volumes",
            get(list_volumes::<S>).post(create_volume::<S>),
        )
        .route(
            "/v1/volumes/{name}",
            get(get_volume::<S>).delete(delete_volume::<S>),
        )
        .route("/v1/volumes/{name}/attach", post(attach_volume::<S>))
        .route("/v1/volumes/{name}/detach", post(detach_volume::<S>))
        .route(
            "/v1/volumes/{name}/snapshots",
            get(list_snapshots::<S>).post(create_snapshot::<S>),
        )
        .route(
            "/v1/volumes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_snapshot::<S>),
        )
        .route("/v1/nodes", get(list_nodes::<S>))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such API path".into(),
            }
        })
        .with_state(store)
}

fn items<R: Resource>(list: Vec<R>) -> Json<Value> {
    Json(json!({ "items": list }))
}

async fn list_volumes<S: Store>(State(store): State<Arc<S>>) -> ApiResult<Json<Value>> {
    Ok(items(store.list_as::<Volume>().await?))
}

async fn list_nodes<S: Store>(State(store): State<Arc<S>>) -> ApiResult<Json<Value>> {
    Ok(items(store.list_as::<Node>().await?))
}

async fn create_volume<S: Store>(
    State(store): State<Arc<S>>,
    body: Result<Json<CreateVolume>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    let Json(req) = body?;
    validate_name(&req.name).map_err(|e| ApiError::bad_request(format!("volume {e}")))?;
    let size = req.size.resolve()?;
    if size.bytes() == 0 {
        return Err(ApiError::bad_request("size must be greater than 0"));
    }
    if !size.bytes().is_multiple_of(VOLUME_ALIGNMENT) {
        return Err(ApiError::bad_request(format!(
            "size {} is not a multiple of 4 KiB",
            size.bytes()
        )));
    }
    let settings =
        Settings::from_objects(&store.list_as::<Setting>().await?).map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })?;
    let replicas = req
        .number_of_replicas
        .unwrap_or(settings.default_replica_count);
    if !(1..=MAX_REPLICAS).contains(&replicas) {
        return Err(ApiError::bad_request(format!(
            "numberOfReplicas {replicas} is out of range 1..={MAX_REPLICAS}"
        )));
    }
    let mut volume = Volume::new(
        req.name,
        VolumeSpec {
            size,
            number_of_replicas: replicas,
            frontend: req.frontend.unwrap_or_default(),
            node_selector: req.node_selector,
            disk_selector: req.disk_selector,
            data_locality: req.data_locality.unwrap_or_default(),
            stale_replica_timeout: settings.stale_replica_timeout,
            node_id: None,
        },
    );
    // Refuse at once what can never be placed (more replicas than nodes
    // under hard anti-affinity, bigger than any disk), with the scheduler's
    // reason, instead of a volume stuck in `creating`. The controller
    // schedules for real afterwards; capacity may change in between.
    if store
        .get_as::<Volume>(&volume.metadata.name)
        .await?
        .is_some()
    {
        return Err(StoreError::AlreadyExists {
            kind: Kind::Volume,
            name: volume.metadata.name.clone(),
        }
        .into());
    }
    let nodes = store.list_as::<Node>().await?;
    // Replicas of a former volume of this name are going away.
    let replica_objs: Vec<Replica> = store
        .list_as::<Replica>()
        .await?
        .into_iter()
        .filter(|r| r.spec.volume != volume.metadata.name)
        .collect();
    schedule(&ScheduleRequest {
        volume: &volume,
        nodes: &nodes,
        replicas: &replica_objs,
        settings: &settings,
        count: replicas,
    })
    .map_err(|e| ApiError::bad_request(e.to_string()))?;
    // The volume controller drops this once the engine and replicas are gone.
    volume
        .metadata
        .finalizers
        .push(crate::controller::volume::VOLUME_FINALIZER.into());
    let created = store.create_as(&volume).await?;
    tracing::info!(volume = %created.metadata.name, size = %size, replicas, "volume created");
    Ok((StatusCode::CREATED, Json(created)))
}

#[derive(Debug, Deserialize)]
struct GetQuery {
    #[serde(default)]
    watch: bool,
}

async fn get_volume<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
    Query(q): Query<GetQuery>,
) -> ApiResult<Response> {
    let volume = load_volume(&*store, &name).await?;
    if !q.watch {
        return Ok(Json(volume).into_response());
    }
    // Current state first, then every change, one JSON object per line.
    let since = volume.metadata.rv();
    let first = futures::stream::once(async move {
        Ok::<_, std::io::Error>(json_line(&json!({"type": "Added", "object": volume})))
    });
    let events = store
        .watch(Some(Kind::Volume), since)
        .await?
        .filter_map(move |ev| {
            let line = match ev {
                Ok(ev) if ev.name == name => Some(json_line(&json!({
                    "type": ev.type_, "object": ev.object
                }))),
                Ok(_) => None,
                Err(e) => Some(json_line(&json!({"type": "Error", "error": e.to_string()}))),
            };
            futures::future::ready(line.map(Ok))
        });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(first.chain(events)))
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })
}

fn json_line(v: &Value) -> Vec<u8> {
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    line
}

async fn load_volume<S: Store>(store: &S, name: &str) -> ApiResult<Volume> {
    store.get_as::<Volume>(name).await?.ok_or_else(|| ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("volume {name:?} not found"),
    })
}

async fn delete_volume<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    match store.delete(Kind::Volume, &name).await {
        Ok(held) => Ok(Json(json!({ "deleted": held.is_none(), "object": held }))),
        Err(StoreError::NotFound { .. }) => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("volume {name:?} not found"),
        }),
        Err(e) => Err(e.into()),
    }
}

/// Read-modify-write of a volume's spec, retried on resourceVersion
/// conflicts (a controller may be writing the same object).
async fn edit_volume<S: Store>(
    store: &S,
    name: &str,
    edit: impl Fn(&mut Volume) -> ApiResult<()>,
) -> ApiResult<Volume> {
    for _ in 0..10 {
        let mut v = load_volume(store, name).await?;
        edit(&mut v)?;
        match store.update_as(&v).await {
            Err(StoreError::Conflict { .. }) => continue,
            other => return Ok(other?),
        }
    }
    Err(ApiError {
        status: StatusCode::CONFLICT,
        message: format!("volume {name:?} keeps changing; try again"),
    })
}

async fn attach_volume<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
    body: Option<Json<AttachRequest>>,
) -> ApiResult<Json<Volume>> {
    let req = body.map(|Json(b)| b).unwrap_or_default();
    let nodes = store.list_as::<Node>().await?;
    let node = match req.node {
        Some(n) => {
            if !nodes.iter().any(|x| x.metadata.name == n) {
                return Err(ApiError::bad_request(format!("node {n:?} does not exist")));
            }
            n
        }
        // No node given: the first ready node (on one host they are all local).
        None => nodes
            .iter()
            .find(|n| n.is_ready())
            .map(|n| n.metadata.name.clone())
            .ok_or_else(|| ApiError {
                status: StatusCode::CONFLICT,
                message: "no ready node to attach to".into(),
            })?,
    };
    let v = edit_volume(&*store, &name, |v| match &v.spec.node_id {
        Some(current) if *current != node => Err(ApiError {
            status: StatusCode::CONFLICT,
            message: format!("volume {name:?} is already attached to {current}; detach it first"),
        }),
        _ => {
            v.spec.node_id = Some(node.clone());
            Ok(())
        }
    })
    .await?;
    Ok(Json(v))
}

async fn detach_volume<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Volume>> {
    let v = edit_volume(&*store, &name, |v| {
        v.spec.node_id = None;
        Ok(())
    })
    .await?;
    Ok(Json(v))
}

/// The control address of the running engine of volume `name`.
async fn engine_control<S: Store>(store: &S, name: &str) -> ApiResult<String> {
    load_volume(store, name).await?;
    let engines = store.list_as::<Engine>().await?;
    engines
        .iter()
        .filter(|e| e.spec.volume == name && e.metadata.deletion_timestamp.is_none())
        .filter(|e| e.status.state == EngineState::Running)
        .find_map(|e| e.status.control_address.clone())
        .ok_or_else(|| ApiError {
            status: StatusCode::CONFLICT,
            message: format!(
                "volume {name:?} is not attached: snapshots are taken by its engine (zebu volume attach {name})"
            ),
        })
}

fn engine_error(volume: &str, e: crate::engine_rpc::EngineRpcError) -> ApiError {
    use crate::engine_rpc::EngineRpcError;
    let status = match e {
        // The engine refused (no such snapshot, a name taken): the caller's.
        EngineRpcError::Call { .. } => StatusCode::CONFLICT,
        _ => StatusCode::BAD_GATEWAY,
    };
    ApiError {
        status,
        message: format!("volume {volume:?}: {e}"),
    }
}

/// `{"items": [...]}` of the engine's snapshots, without its live head.
fn snapshot_items(s: zebu_proto::engine::Snapshots) -> Value {
    let items: Vec<Value> = s
        .snapshots
        .into_iter()
        .filter(|s| !s.head)
        .map(|s| {
            json!({
                "name": s.name,
                "parent": s.parent,
                "userCreated": s.user_created,
                "created": s.created,
                "dataBytes": s.data_bytes,
                "labels": s.labels,
            })
        })
        .collect();
    json!({ "items": items })
}

/// The body of `POST /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    #[serde(default)]
    pub name: Option<String>,
}

async fn list_snapshots<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let control = engine_control(&*store, &name).await?;
    let s = crate::engine_rpc::snapshot_list(&control)
        .await
        .map_err(|e| engine_error(&name, e))?;
    Ok(Json(snapshot_items(s)))
}

async fn create_snapshot<S: Store>(
    State(store): State<Arc<S>>,
    Path(name): Path<String>,
    body: Option<Json<CreateSnapshot>>,
) -> ApiResult<Json<Value>> {
    let req = body.map(|Json(b)| b).unwrap_or_default();
    // Unnamed snapshots are named after the moment they were asked for.
    let snapshot = req.name.unwrap_or_else(|| {
        let t = crate::time::now_rfc3339().replace([':', '-'], "");
        format!(
            "snap-{}",
            t.trim_end_matches('Z').replace('T', "-").to_lowercase()
        )
    });
    validate_name(&snapshot)
        .map_err(|e| ApiError::bad_request(format!("snapshot name {snapshot:?}: {e}")))?;
    let control = engine_control(&*store, &name).await?;
    let s = crate::engine_rpc::snapshot_create(&control, &snapshot)
        .await
        .map_err(|e| engine_error(&name, e))?;
    tracing::info!(volume = %name, snapshot = %snapshot, "snapshot taken");
    Ok(Json(snapshot_items(s)))
}

async fn delete_snapshot<S: Store>(
    State(store): State<Arc<S>>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let control = engine_control(&*store, &name).await?;
    let s = crate::engine_rpc::snapshot_delete(&control, &snapshot)
        .await
        .map_err(|e| engine_error(&name, e))?;
    tracing::info!(volume = %name, snapshot = %snapshot, "snapshot deleted");
    Ok(Json(snapshot_items(s)))
}
