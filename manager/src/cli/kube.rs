//! `zebu --kubeconfig FILE ...`: the CLI against a cluster, with the operations layer run
//! in-process over the Kubernetes store (uncached: one request per read). The managers in
//! the cluster then act on what was written, as they do for `kubectl apply`.
//!
//! Every command runs exactly as it does against a manager's REST API: the REST router
//! ([`zebu_api::router`] over [`Ops`] on the kube store) is served in this process on an
//! ephemeral port of 127.0.0.1, for this one command, and the same command code
//! ([`super::commands`], [`super::backup`], [`super::recurring`], [`super::scrub`]) talks to it. So the rules
//! (ops) and the output (render) are the same code on one host and in a cluster, and
//! whatever must reach an engine (snapshots, expansion, scrub) reaches it at the address its
//! Engine object records, as a manager would.
//!
//! Refused in one line: `zebu up` and `zebu manager` (not one-shot commands), and `zebu node
//! stop|start`, which drive `zebu up`'s simulated nodes (a cluster's node stops with its
//! manager's pod).

use std::net::{Ipv4Addr, SocketAddr};

use anyhow::{Context, bail};
use zebu_ops::Ops;
use zebu_store::{StoreConfig, open};

use super::args::{Command, NodeCmd, Output};
use crate::client::Client;

pub async fn run(
    kubeconfig: &std::path::Path,
    namespace: &str,
    out: Output,
    command: Command,
) -> anyhow::Result<()> {
    if let Some(why) = refused(&command) {
        bail!("{why}");
    }
    let config = StoreConfig::Kube {
        kubeconfig: Some(kubeconfig.to_path_buf()),
        namespace: namespace.to_string(),
        cached: false,
    };
    let store = open(&config)
        .await
        .with_context(|| format!("connecting with {}", kubeconfig.display()))?;
    let listener = tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .context("binding the in-process API to 127.0.0.1")?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, zebu_api::router(Ops::new(store))).await {
            tracing::warn!("in-process API: {e}");
        }
    });
    let client = Client::new(&format!("http://{addr}"))?;
    let result = match command {
        Command::Node(cmd) => super::commands::node(&client, out, cmd).await,
        Command::Volume(cmd) => super::commands::volume(&client, out, cmd).await,
        Command::Snapshot(cmd) => super::commands::snapshot(&client, out, cmd).await,
        Command::Backup(cmd) => super::backup::backup(&client, out, cmd).await,
        Command::RecurringJob(cmd) => super::recurring::recurring(&client, out, cmd).await,
        other => Err(anyhow::anyhow!(
            "{}",
            refused(&other).unwrap_or("not available with --kubeconfig")
        )),
    };
    server.abort();
    result
}

/// Why a command cannot run against a cluster, if it cannot.
fn refused(command: &Command) -> Option<&'static str> {
    match command {
        Command::Up(_) => Some("zebu up runs on one host; leave out --kubeconfig"),
        Command::Manager(_) => Some("zebu manager is not a one-shot command"),
        Command::Node(NodeCmd::Stop { .. } | NodeCmd::Start { .. }) => Some(
            "zebu node stop|start drives zebu up's simulated nodes; in a cluster a node stops with its manager",
        ),
        Command::Node(NodeCmd::Ls)
        | Command::Volume(_)
        | Command::Snapshot(_)
        | Command::Backup(_)
        | Command::RecurringJob(_) => None,
    }
}
