//! `zebu up`'s node agents, each of which can be stopped and started on its
//! own while the rest of the cluster runs.
//!
//! On one host every "node" is an agent task inside the `zebu up` process,
//! so there is no machine to switch off when a test wants to see what the
//! cluster does when a node goes away. [`LocalAgents`] gives each agent its
//! own stop signal: stopping one ends its loop, which stops its replica and
//! engine processes and ends its heartbeats — to the controllers exactly a
//! node that went down. Starting it again runs a fresh agent with the same
//! configuration, like a rebooted node: it adopts or restarts what the
//! store still places on it and cleans up what was deleted meanwhile.
//!
//! The REST routes are only mounted by `zebu up` and are not part of the
//! cluster API: `POST /v1/standalone/nodes/{name}/stop` and `.../start`
//! (the hidden `zebu node stop|start NODE`).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use zebu_agent::{AgentConfig, AgentError, NodeAgent};
use zebu_api::ApiError;
use zebu_types::Store;

type Running = (watch::Sender<bool>, JoinHandle<Result<(), AgentError>>);

/// The agents of one `zebu up`, by node name.
pub struct LocalAgents {
    store: Arc<dyn Store>,
    configs: BTreeMap<String, AgentConfig>,
    running: Mutex<BTreeMap<String, Running>>,
}

impl LocalAgents {
    pub fn new(store: Arc<dyn Store>, configs: Vec<AgentConfig>) -> Self {
        LocalAgents {
            store,
            configs: configs.into_iter().map(|c| (c.node.clone(), c)).collect(),
            running: Mutex::new(BTreeMap::new()),
        }
    }

    /// Register every node (so a bad data directory fails `zebu up` at
    /// once), then start every agent.
    pub async fn start_all(&self) -> Result<(), AgentError> {
        for cfg in self.configs.values() {
            NodeAgent::new(self.store.clone(), cfg.clone())
                .register()
                .await?;
        }
        for node in self.configs.keys() {
            self.start(node).await;
        }
        Ok(())
    }

    /// Start `node`'s agent; `None` if this `zebu up` does not run such a
    /// node, `Some(false)` if it already runs.
    pub async fn start(&self, node: &str) -> Option<bool> {
        let cfg = self.configs.get(node)?;
        let mut running = self.running.lock().await;
        if running
            .get(node)
            .is_some_and(|(_, task)| !task.is_finished())
        {
            return Some(false);
        }
        let (tx, rx) = watch::channel(false);
        let agent = NodeAgent::new(self.store.clone(), cfg.clone());
        running.insert(node.to_string(), (tx, tokio::spawn(agent.run(rx))));
        tracing::info!(node, "node agent started");
        Some(true)
    }

    /// Stop `node`'s agent and its processes and wait until they are gone;
    /// `None` for an unknown node, `Some(false)` if it was not running.
    pub async fn stop(&self, node: &str) -> Option<bool> {
        if !self.configs.contains_key(node) {
            return None;
        }
        let entry = self.running.lock().await.remove(node);
        let Some((tx, task)) = entry else {
            return Some(false);
        };
        let _ = tx.send(true);
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(node, "{e}"),
            Err(e) => tracing::warn!(node, "node agent task failed: {e}"),
        }
        tracing::info!(node, "node agent stopped");
        Some(true)
    }

    /// Stop every agent (they stop their processes concurrently).
    pub async fn stop_all(&self) {
        let all: Vec<(String, Running)> = std::mem::take(&mut *self.running.lock().await)
            .into_iter()
            .collect();
        for (_, (tx, _)) in &all {
            let _ = tx.send(true);
        }
        for (node, (_, task)) in all {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(node, "{e}"),
                Err(e) => tracing::warn!(node, "node agent task failed: {e}"),
            }
        }
    }
}

/// The standalone-only routes; merge into `zebu_api::router`.
pub fn router(agents: Arc<LocalAgents>) -> Router {
    Router::new()
        .route("/v1/standalone/nodes/{name}/stop", post(stop_node))
        .route("/v1/standalone/nodes/{name}/start", post(start_node))
        .with_state(agents)
}

fn unknown(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("node {name:?} is not run by this zebu up"),
    )
}

async fn stop_node(
    State(agents): State<Arc<LocalAgents>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let stopped = agents.stop(&name).await.ok_or_else(|| unknown(&name))?;
    Ok(Json(
        json!({ "node": name, "agent": "stopped", "changed": stopped }),
    ))
}

async fn start_node(
    State(agents): State<Arc<LocalAgents>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let started = agents.start(&name).await.ok_or_else(|| unknown(&name))?;
    Ok(Json(
        json!({ "node": name, "agent": "running", "changed": started }),
    ))
}
