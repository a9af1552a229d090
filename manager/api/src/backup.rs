//! The backup routes (DESIGN §6), merged into [`crate::router`]:
//!
//! | method | path                              | does                                        |
//! |--------|-----------------------------------|---------------------------------------------|
//! | GET    | `/v1/backuptarget`                | the backup target and its status            |
//! | PUT    | `/v1/backuptarget`                | set it (a [`SetBackupTarget`]; checked first)|
//! | POST   | `/v1/backuptarget/gc[?wait=true]` | run GC now ([`GcReportLine`]; 202 unless wait)|
//! | GET    | `/v1/backups[?volume=V]`          | list backups, oldest first                  |
//! | POST   | `/v1/backups`                     | back up a volume (a [`CreateBackup`])       |
//! | GET    | `/v1/backups/{name}`              | one backup                                  |
//! | DELETE | `/v1/backups/{name}`              | delete it from the target                   |
//! | POST   | `/v1/backups/{name}/verify`       | read and check every chunk ([`VerifyReport`])|
//! | POST   | `/v1/backups/{name}/restore`      | a new volume from it (a [`RestoreBackup`])  |

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use zebu_ops::Ops;
use zebu_types::requests::Items;
use zebu_types::requests::backup::{
    CreateBackup, GcReportLine, RestoreBackup, SetBackupTarget, VerifyReport,
};
use zebu_types::resources::{Backup, BackupTarget, Volume};

use crate::ApiResult;

pub(crate) fn routes() -> Router<Ops> {
    Router::new()
        .route("/v1/backuptarget", get(get_target).put(set_target))
        .route("/v1/backuptarget/gc", post(run_gc))
        .route("/v1/backups", get(list_backups).post(create_backup))
        .route("/v1/backups/{name}", get(get_backup).delete(delete_backup))
        .route("/v1/backups/{name}/verify", post(verify_backup))
        .route("/v1/backups/{name}/restore", post(restore_backup))
}

async fn get_target(State(ops): State<Ops>) -> ApiResult<Json<BackupTarget>> {
    Ok(Json(ops.get_backup_target().await?))
}

async fn set_target(
    State(ops): State<Ops>,
    body: Result<Json<SetBackupTarget>, JsonRejection>,
) -> ApiResult<Json<BackupTarget>> {
    let Json(req) = body?;
    Ok(Json(ops.set_backup_target(req).await?))
}

#[derive(Debug, Deserialize)]
struct GcQuery {
    #[serde(default)]
    wait: bool,
}

async fn run_gc(
    State(ops): State<Ops>,
    Query(q): Query<GcQuery>,
) -> ApiResult<(StatusCode, Json<GcReportLine>)> {
    let line = ops.backup_gc(q.wait).await?;
    let code = if q.wait {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((code, Json(line)))
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    #[serde(default)]
    volume: Option<String>,
}

async fn list_backups(
    State(ops): State<Ops>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<Items<Backup>>> {
    Ok(Json(Items {
        items: ops.list_backups(q.volume.as_deref()).await?,
    }))
}

async fn create_backup(
    State(ops): State<Ops>,
    body: Result<Json<CreateBackup>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Backup>)> {
    let Json(req) = body?;
    Ok((StatusCode::CREATED, Json(ops.create_backup(req).await?)))
}

async fn get_backup(State(ops): State<Ops>, Path(name): Path<String>) -> ApiResult<Json<Backup>> {
    Ok(Json(ops.get_backup(&name).await?))
}

async fn delete_backup(State(ops): State<Ops>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    let held = ops.delete_backup(&name).await?;
    Ok(Json(json!({ "deleted": held.is_none(), "object": held })))
}

async fn verify_backup(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<VerifyReport>> {
    Ok(Json(ops.verify_backup(&name).await?))
}

async fn restore_backup(
    State(ops): State<Ops>,
    Path(name): Path<String>,
    body: Result<Json<RestoreBackup>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    let Json(req) = body?;
    Ok((
        StatusCode::CREATED,
        Json(ops.restore_backup(&name, req).await?),
    ))
}
