//! The standby (disaster-recovery) volume routes (DESIGN §6), merged into
//! [`crate::router`]:
//!
//! | method | path                          | does                                               |
//! |--------|-------------------------------|----------------------------------------------------|
//! | POST   | `/v1/standby`                 | a new volume following a source's backups (a [`CreateStandby`]) |
//! | POST   | `/v1/volumes/{name}/activate` | end standby mode once the newest backup is applied |
//!
//! A standby volume is listed and shown with the other volumes (`GET /v1/volumes/{name}`):
//! `status.restore` names the backup it holds (`restored`) and since when (`restoredAt`);
//! activation is done when `status.restore.activatedAt` is set and its
//! `zebu.io/standby-from` annotation is gone.

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use zebu_ops::Ops;
use zebu_types::requests::standby::CreateStandby;
use zebu_types::resources::Volume;

use crate::ApiResult;

pub(crate) fn routes() -> Router<Ops> {
    Router::new()
        .route("/v1/standby", post(create_standby))
        .route("/v1/volumes/{name}/activate", post(activate))
}

async fn create_standby(
    State(ops): State<Ops>,
    body: Result<Json<CreateStandby>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    let Json(req) = body?;
    Ok((StatusCode::CREATED, Json(ops.create_standby(req).await?)))
}

async fn activate(State(ops): State<Ops>, Path(name): Path<String>) -> ApiResult<Json<Volume>> {
    Ok(Json(ops.activate_standby(&name).await?))
}
