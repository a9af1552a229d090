//! The recurring job routes (DESIGN §5, §6), merged into [`crate::router`]:
//!
//! | method | path                        | does                                          |
//! |--------|-----------------------------|-----------------------------------------------|
//! | GET    | `/v1/recurringjobs`         | list the jobs, by name                        |
//! | POST   | `/v1/recurringjobs`         | create one (a [`CreateRecurringJob`]; checked) |
//! | GET    | `/v1/recurringjobs/{name}`  | one job and its status (`nextRunAt`, `runs`)  |
//! | DELETE | `/v1/recurringjobs/{name}`  | delete it; what it took stays                 |
//!
//! The recurring controller (`zebu-controllers`' `recurring`) runs the jobs: in `zebu up`
//! for good, under `zebu manager` while that manager holds the cluster Lease.

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};
use zebu_ops::Ops;
use zebu_types::requests::Items;
use zebu_types::requests::recurring::CreateRecurringJob;
use zebu_types::resources::RecurringJob;

use crate::ApiResult;

pub(crate) fn routes() -> Router<Ops> {
    Router::new()
        .route("/v1/recurringjobs", get(list_jobs).post(create_job))
        .route("/v1/recurringjobs/{name}", get(get_job).delete(delete_job))
}

async fn list_jobs(State(ops): State<Ops>) -> ApiResult<Json<Items<RecurringJob>>> {
    Ok(Json(Items {
        items: ops.list_recurring_jobs().await?,
    }))
}

async fn create_job(
    State(ops): State<Ops>,
    body: Result<Json<CreateRecurringJob>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<RecurringJob>)> {
    let Json(req) = body?;
    Ok((
        StatusCode::CREATED,
        Json(ops.create_recurring_job(req).await?),
    ))
}

async fn get_job(
    State(ops): State<Ops>,
    Path(name): Path<String>,
) -> ApiResult<Json<RecurringJob>> {
    Ok(Json(ops.get_recurring_job(&name).await?))
}

async fn delete_job(State(ops): State<Ops>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    ops.delete_recurring_job(&name).await?;
    Ok(Json(json!({ "deleted": true })))
}
