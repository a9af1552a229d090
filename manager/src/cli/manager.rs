//! `zebu manager`: one node's manager in a Kubernetes cluster, in the foreground: its Leases
//! (the node's presence; the cluster singletons while it holds the cluster Lease), the
//! controllers as a member (the volumes it owns, their scrub schedule), the node agent (this
//! node's engines and replicas), the backup, standby and recurring controllers while it
//! holds the cluster Lease ([`crate::cluster::singletons`]) and the REST API, all over the
//! kube store in `--namespace`: every controller `zebu up` runs on one host.
//!
//! Stopping it (SIGTERM, a pod restart or upgrade, or kill -9) stops the manager only: the
//! node's engines and replicas go on serving (they are the instance manager's processes, or,
//! without one, in process groups of their own), and the next manager of the node adopts
//! them. Nothing is released on the way out either: the node's Lease runs out by itself, so
//! a manager that restarts within the Lease's duration never lets its volumes move.
//!
//! It checks what it can before it claims anything: the flags (clap), the API server
//! reachable within [`REACH_TIMEOUT`], the data directory writable, the API address free,
//! the replica CA readable and this node's certificate made (with `--replica-tls-ca`),
//! the node registered (which needs the CRDs installed and the rights of the chart's Role).
//! Each failure is one line on stderr and exit code 1.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use zebu_agent::{AgentConfig, NodeAgent};
use zebu_kube_store::{KubeStore, KubeStoreOptions};
use zebu_ops::Ops;
use zebu_types::Store;

use super::args::ManagerArgs;
use crate::cluster::{LeaseMembership, client_from, kube_config, lease, run_leases, singletons};

/// How often the node agent writes its Node's status (disk capacity); presence is the
/// Lease's, so this only keeps the capacity the scheduler reads current.
const NODE_STATUS_EVERY: Duration = Duration::from_secs(10);
/// How long the first request to the API server may take before the manager gives up.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(15);
/// The REST API's port when `--listen` is left out.
pub const API_PORT: u16 = 9500;

pub async fn manager(
    args: ManagerArgs,
    kubeconfig: Option<&std::path::Path>,
    namespace: &str,
) -> anyhow::Result<()> {
    zebu_types::meta::validate_label(namespace).map_err(|e| anyhow::anyhow!("--namespace: {e}"))?;
    let config = kube_config(kubeconfig).await?;
    let server = config.cluster_url.to_string();
    let client = client_from(config)?;
    match tokio::time::timeout(REACH_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => bail!(
            "cannot reach the Kubernetes API server at {server}: {}",
            causes(&e)
        ),
        Err(_) => bail!(
            "the Kubernetes API server at {server} did not answer within {} s",
            REACH_TIMEOUT.as_secs()
        ),
    }

    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data dir {}", args.data_dir.display()))?;
    let data_dir = args
        .data_dir
        .canonicalize()
        .with_context(|| format!("resolving {}", args.data_dir.display()))?;
    let listen = args
        .listen
        .unwrap_or_else(|| std::net::SocketAddr::new(args.address, API_PORT));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the API to {listen}"))?;
    let addr = listener.local_addr()?;

    // TLS on the replica ports: this node's certificate, signed by the cluster's CA.
    let replica_tls = match &args.replica_tls_ca {
        Some(dir) => {
            let ca = zebu_agent::CaFiles::find(dir)?;
            Some(ca.issue(&args.node, args.address, &data_dir.join("tls"))?)
        }
        None => None,
    };
    let ops_tls = match &replica_tls {
        Some(tls) => Some(tls.connector()?),
        None => None,
    };

    let store: Arc<dyn Store> = Arc::new(
        KubeStore::new(client.clone(), namespace, KubeStoreOptions::default())
            .with_secret_dir(data_dir.join("secrets")),
    );
    let agent = NodeAgent::new(
        store.clone(),
        AgentConfig {
            node: args.node.clone(),
            address: args.address.to_string(),
            disks: BTreeMap::from([("disk-0".to_string(), data_dir.join("disk-0"))]),
            heartbeat: NODE_STATUS_EVERY,
            log_dir: data_dir.join("logs"),
            instance_manager: args.instance_manager.clone(),
            replica_tls: replica_tls.clone(),
        },
    );
    agent.register().await.with_context(|| {
        format!(
            "registering node {} in namespace {namespace} of {server}",
            args.node
        )
    })?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let membership = LeaseMembership::in_namespace(
        args.node.clone(),
        namespace,
        lease::CLUSTER_LEASE.to_string(),
    );
    let leases = tokio::spawn(run_leases(client, membership.clone(), stop_rx.clone()));

    // The agent is never told to stop: stopping it would stop the node's engines and
    // replicas, which must outlive this manager (see the module docs).
    let (_agent_stop, agent_rx) = tokio::sync::watch::channel(false);
    let node = args.node.clone();
    let agent = tokio::spawn(async move {
        if let Err(e) = agent.run(agent_rx).await {
            tracing::error!(node, "node agent: {e}");
        }
    });
    // The backup and standby controllers are cluster singletons; their job processes go
    // with the lead (see `singletons`).
    let backup_cfg = zebu_controllers::backup::BackupConfig {
        work_dir: data_dir.join("backups"),
        replica_tls_ca: replica_tls.as_ref().map(|t| t.ca.clone()),
    };
    let backups = {
        let store = store.clone();
        let cfg = backup_cfg.clone();
        tokio::spawn(singletons::run_while_leading(
            "backup controller",
            membership.clone(),
            move |stop| zebu_controllers::backup::run(store.clone(), cfg.clone(), stop),
            singletons::kill_jobs("backup controller", backup_cfg.jobs_dir()),
            stop_rx.clone(),
        ))
    };
    let standby = {
        let store = store.clone();
        let cfg = backup_cfg.clone();
        tokio::spawn(singletons::run_while_leading(
            "standby controller",
            membership.clone(),
            move |stop| zebu_controllers::standby::run(store.clone(), cfg.clone(), stop),
            singletons::kill_jobs("standby controller", backup_cfg.jobs_dir()),
            stop_rx.clone(),
        ))
    };
    // The recurring jobs' scheduler is a cluster singleton too: started while this manager
    // holds the cluster Lease; its loop also asks the membership before each pass, so a
    // pass never starts after the lead was lost between two checks of the supervisor.
    let recurring = {
        let store = store.clone();
        let m = membership.clone();
        tokio::spawn(singletons::run_while_leading(
            "recurring controller",
            membership.clone(),
            move |stop| {
                let m: Arc<dyn zebu_controllers::Membership> = m.clone();
                zebu_controllers::recurring::run(store.clone(), Some(m), stop)
            },
            // Its backups and snapshots are made through the store (the backup controller
            // runs their processes), so it has no process of its own to end.
            || {},
            stop_rx.clone(),
        ))
    };
    let controllers =
        zebu_controllers::Controllers::member(store.clone(), args.node.clone(), membership);
    let controllers = tokio::spawn(zebu_controllers::run_controllers(controllers, stop_rx));

    let banner = format!(
        "zebu manager of node {} ({}) in namespace {namespace} of {server}: API listening on http://{addr}\n",
        args.node, args.address
    );
    if let Err(e) = super::render::emit(&banner) {
        tracing::warn!("cannot write to stdout: {e}");
    }
    axum::serve(
        listener,
        zebu_api::router(Ops::new(store).with_replica_tls(ops_tls)),
    )
    .with_graceful_shutdown(super::up::shutdown_signal())
    .await
    .context("serving the API")?;
    let _ = stop_tx.send(true);
    if let Err(e) = controllers.await {
        tracing::warn!("controller task failed: {e}");
    }
    if let Err(e) = backups.await {
        tracing::warn!("backup controller task failed: {e}");
    }
    if let Err(e) = standby.await {
        tracing::warn!("standby controller task failed: {e}");
    }
    if let Err(e) = recurring.await {
        tracing::warn!("recurring controller task failed: {e}");
    }
    if let Err(e) = leases.await {
        tracing::warn!("Lease task failed: {e}");
    }
    agent.abort();
    tracing::info!("zebu manager stopped; this node's engines and replicas keep running");
    Ok(())
}

/// An error and its causes on one line, without repeats (kube's errors wrap hyper's, which
/// wrap the socket's: the last one says what actually happened).
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = s.source();
    }
    parts.join(": ")
}
