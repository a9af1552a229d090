//! `zebu-api`: the REST API (axum, JSON) that the `zebu` CLI and the web UI talk to.
//!
//! | method | path                                     | does                              |
//! |--------|------------------------------------------|-----------------------------------|
//! | GET    | `/v1/volumes`                            | list volumes                      |
//! | POST   | `/v1/volumes`                            | create (a [`CreateVolume`])       |
//! | GET    | `/v1/volumes/{name}[?watch=true]`        | one volume; with `watch`, an NDJSON stream of it, current state first |
//! | DELETE | `/v1/volumes/{name}`                     | delete                            |
//! | POST   | `/v1/volumes/{name}/attach`              | want it attached (an [`AttachVolume`]) |
//! | POST   | `/v1/volumes/{name}/detach`              | want it detached                  |
//! | POST   | `/v1/volumes/{name}/expand`              | grow it (an [`ExpandVolume`])     |
//! | GET    | `/v1/volumes/{name}/snapshots`           | its snapshots (attached only)     |
//! | POST   | `/v1/volumes/{name}/snapshots`           | take one (a [`CreateSnapshot`])   |
//! | DELETE | `/v1/volumes/{name}/snapshots/{s}`       | delete one                        |
//! | POST   | `/v1/volumes/{name}/snapshots/{s}/revert`| revert the volume to it           |
//! | GET    | `/v1/volumes/{name}/scrub`               | its engine's scrub and the last recorded one (a [`ScrubInfo`]) |
//! | POST   | `/v1/volumes/{name}/scrub`               | start one (a [`StartScrub`]); attached only |
//! | POST   | `/v1/volumes/{name}/scrub/stop`          | stop the running one              |
//! | POST   | `/v1/volumes/{name}/populate`            | start (again) the copy from its data source unless done or running; `{"population": STATE}` |
//! | GET    | `/v1/snapshots[?volume=V]`               | the Snapshot records (detached volumes' too) |
//! | GET    | `/v1/capacity[?node=N][&zone=Z]`         | what new replicas can take (a [`Capacity`]) |
//! | GET    | `/v1/nodes`                              | list nodes                        |
//! | GET    | `/v1/openapi.json`                       | this API's OpenAPI 3.0 document ([`openapi`]) |
//!
//! The backup routes are in the `backup` module, the standby volume routes in `standby`,
//! the recurring job routes in `recurring`.
//!
//! Handlers only decode the request and call [`Ops`], where every rule lives; an
//! [`OpsError`] becomes its HTTP status with `{"error": "...", "code": "..."}` (4xx for the
//! caller's mistakes: 400 invalid, 404 missing, 409 exists or not now; 5xx for ours; `code`
//! is the gRPC code name, so a CSI plugin answers with the code the operation meant). Lists are
//! `{"items": [...]}` as in Kubernetes; snapshot calls answer with the volume's snapshots.

mod backup;
pub mod openapi;
mod recurring;
mod standby;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use zebu_ops::{CapacityScope, Ops, OpsError, VolumeChange};
use zebu_types::requests::{
    AttachVolume, Capacity, CreateSnapshot, CreateVolume, ExpandVolume, Items, SnapshotInfo,
    StartScrub,
};
use zebu_types::resources::{Node, ScrubInfo, Snapshot, Volume};

/// An error as the API reports it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The gRPC code name of an operation's error (`OutOfRange`, `Aborted`, ...).
    pub code: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, "API error: {}", self.message);
        }
        let body = match self.code {
            Some(code) => json!({ "error": self.message, "code": code }),
            None => json!({ "error": self.message }),
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> Self {
        let status =
            StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut err = ApiError::new(status, e.to_string());
        err.code = Some(format!("{:?}", e.grpc_code()));
        err
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {}", r.body_text()),
        )
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The cluster API over `ops`.
pub fn router(ops: Ops) -> Router {
    Router::new()
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route("/v1/volumes/{name}", get(get_volume).delete(delete_volume))
        .route("/v1/volumes/{name}/attach", post(attach_volume))
        .route("/v1/volumes/{name}/detach", post(detach_volume))
        .route("/v1/volumes/{name}/expand", post(expand_volume))
        .route(
            "/v1/volumes/{name}/snapshots",
            get(list_snapshots).post(create_snapshot),
        )
        .route(
            "/v1/volumes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_snapshot),
        )
        .route(
            "/v1/volumes/{name}/snapshots/{snapshot}/revert",
            post(revert_snapshot),
        )
        .route(
            "/v1/volumes/{name}/scrub",
            get(scrub_status).post(start_scrub),
        )
        .route("/v1/volumes/{name}/scrub/stop", post(stop_scrub))
        .route("/v1/volumes/{name}/populate", post(populate_volume))
        .route("/v1/snapshots", get(list_snapshot_records))
        .route("/v1/capacity", get(capacity))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/openapi.json", get(openapi_document))
        .merge(backup::routes())
        .merge(standby::routes())
        .merge(recurring::routes())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such API path") })
        .layer(axum::middleware::map_response(json_errors))
        .with_state(ops)
}

async fn openapi_document() -> Response {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let text = TEXT.get_or_init(openapi::document_text).clone();
    ([("content-type", "application/json")], text).into_response()
}

/// Every error is `{"error": ...}` JSON, also the ones axum answers by itself before a
/// handler runs (a query string or path that does not decode, a method the path does not
/// have, a body of the wrong type): its plain-text reason becomes the message.
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, 64 << 10).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("request refused")
            .to_string()
    } else {
        text
    };
    let mut out = ApiError::new(status, message).into_response();
    for (k, v) in parts.headers.iter() {
        if k != "content-type" && k != "content-length" {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// A body that may be left out (no content type: the defaults), but must be valid when
/// given.
type OptionalBody<T> = Result<Option<Json<T>>, JsonRejection>;

fn optional<T: Default>(body: OptionalBody<T>) -> ApiResult<T> {
    Ok(body?.map(|Json(b)| b).unwrap_or_default())
}

async fn list_volumes(State(ops): State<Ops>) -> ApiResult<Json<Items<Volume>>> {
    Ok(Json(Items {
        items: ops.list_volumes().await?,
    }))
}

async fn list_nodes(State(ops): State<Ops>) -> ApiResult<Json<Items<Node>>> {
    Ok(Json(Items {
        items: ops.list_nodes().await?,
    }))
}

async fn create_volume(
    State(ops): State<Ops>,
    body: Result<Json<CreateVolume>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    let Json(req) = body?;
    Ok((StatusCode::CREATED, Json(ops.create_volume(req).await?)))
}

#[derive(Debug, Deserialize)]
struct GetQuery {
    #[serde(default)]
    watch: bool,
}

async fn get_volume(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    Query(q): Query<GetQuery>,
) -> ApiResult<Response> {
    if !q.watch {
        return Ok(Json(ops.get_volume(&name).await?).into_response());
    }
    // Current state first, then every change, one JSON object per line.
    let (volume, changes) = ops.watch_volume(&name).await?;
    let first = futures::stream::once(async move {
        Ok::<_, std::io::Error>(json_line(&json!({"type": "Added", "object": volume})))
    });
    let rest = changes.map(|c| {
        let line = match c {
            Ok(VolumeChange::Added(v)) => json!({"type": "Added", "object": v}),
            Ok(VolumeChange::Modified(v)) => json!({"type": "Modified", "object": v}),
            Ok(VolumeChange::Deleted(v)) => json!({"type": "Deleted", "object": v}),
            Err(e) => json!({"type": "Error", "error": e.to_string()}),
        };
        Ok(json_line(&line))
    });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(first.chain(rest)))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

fn json_line(v: &Value) -> Vec<u8> {
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    line
}

async fn delete_volume(State(ops): State<Ops>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    let held = ops.delete_volume(&name).await?;
    Ok(Json(json!({ "deleted": held.is_none(), "object": held })))
}

async fn attach_volume(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    body: OptionalBody<AttachVolume>,
) -> ApiResult<Json<Volume>> {
    let req = optional(body)?;
    Ok(Json(ops.attach_volume(&name, req).await?))
}

async fn detach_volume(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<Volume>> {
    Ok(Json(ops.detach_volume(&name).await?))
}

async fn expand_volume(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    body: Result<Json<ExpandVolume>, JsonRejection>,
) -> ApiResult<Json<Volume>> {
    let Json(req) = body?;
    Ok(Json(ops.expand_volume(&name, req).await?))
}

async fn list_snapshots(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<Items<SnapshotInfo>>> {
    Ok(Json(Items {
        items: ops.list_snapshots(&name).await?,
    }))
}

async fn create_snapshot(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    body: OptionalBody<CreateSnapshot>,
) -> ApiResult<Json<Items<SnapshotInfo>>> {
    let req = optional(body)?;
    Ok(Json(Items {
        items: ops.create_snapshot(&name, req).await?,
    }))
}

async fn delete_snapshot(
    State(ops): State<Ops>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<Json<Items<SnapshotInfo>>> {
    Ok(Json(Items {
        items: ops.delete_snapshot(&name, &snapshot).await?,
    }))
}

async fn revert_snapshot(
    State(ops): State<Ops>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<Json<Items<SnapshotInfo>>> {
    Ok(Json(Items {
        items: ops.revert_snapshot(&name, &snapshot).await?,
    }))
}

async fn scrub_status(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<ScrubInfo>> {
    Ok(Json(ops.scrub_status(&name).await?))
}

async fn start_scrub(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    body: OptionalBody<StartScrub>,
) -> ApiResult<Json<ScrubInfo>> {
    let req = optional(body)?;
    Ok(Json(ops.start_scrub(&name, req).await?))
}

async fn stop_scrub(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<ScrubInfo>> {
    Ok(Json(ops.stop_scrub(&name).await?))
}

async fn populate_volume(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let state = ops.ensure_populated(&name).await?;
    Ok(Json(json!({ "population": state.map(|s| s.to_string()) })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotsQuery {
    volume: Option<String>,
}

async fn list_snapshot_records(
    State(ops): State<Ops>,
    Query(q): Query<SnapshotsQuery>,
) -> ApiResult<Json<Items<Snapshot>>> {
    Ok(Json(Items {
        items: ops.list_snapshot_records(q.volume.as_deref()).await?,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CapacityQuery {
    node: Option<String>,
    zone: Option<String>,
}

async fn capacity(
    State(ops): State<Ops>,
    Query(q): Query<CapacityQuery>,
) -> ApiResult<Json<Capacity>> {
    let scope = CapacityScope {
        node: q.node,
        zone: q.zone,
    };
    Ok(Json(ops.capacity(&scope).await?))
}
