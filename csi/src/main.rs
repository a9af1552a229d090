//! `zebu-csi`: the CSI plugin's command line (see the crate docs).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use zebu_csi::node::NodeConfig;
use zebu_csi::node::attach::AttachMode;
use zebu_csi::{Endpoint, PluginConfig};

#[derive(Debug, Parser)]
#[command(
    name = "zebu-csi",
    about = "Zebu's CSI plugin (CSI spec v1.12)",
    version
)]
struct Args {
    /// Where to serve: unix:///PATH (the kubelet and the sidecars) or tcp://IP:PORT.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// This node's name in the manager (NodeGetInfo's node id).
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,
    /// Serve the Controller service.
    #[arg(long)]
    controller: bool,
    /// Serve the Node service.
    #[arg(long)]
    node: bool,
    /// The manager's API address, http://HOST:PORT (as the `zebu` CLI takes it).
    #[arg(long, env = "ZEBU_API", default_value = "http://127.0.0.1:9500")]
    api: String,
    /// How nodes attach volumes: the kernel's iSCSI initiator, or nbdfuse and a loop device
    /// (hosts with FUSE but no iSCSI initiator). The controller publishes with the matching
    /// frontend, so give the controller and the nodes the same value.
    #[arg(long, value_enum, default_value_t = AttachMode::Iscsi)]
    attach: AttachMode,
    /// Where the node keeps what it staged, and its nbdfuse mounts.
    #[arg(long, default_value = "/var/lib/zebu-csi")]
    state_dir: PathBuf,
    /// This node's zone (topology key topology.kubernetes.io/zone).
    #[arg(long, env = "ZEBU_ZONE")]
    zone: Option<String>,
    /// The most volumes this node attaches (NodeGetInfo).
    #[arg(long, default_value_t = 128)]
    max_volumes: i64,
    /// Seconds a controller call waits for the cluster before answering "in progress"
    /// (the sidecars call again); keep it under the sidecars' --timeout.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    call_budget: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let node = if args.node {
        let node_id = args
            .node_id
            .clone()
            .context("--node needs --node-id (or NODE_ID): this node's name in the manager")?;
        Some(NodeConfig {
            node_id,
            zone: args.zone.clone(),
            attach: args.attach,
            state_dir: args.state_dir.clone(),
            max_volumes: args.max_volumes,
        })
    } else {
        None
    };
    let cfg = PluginConfig {
        endpoint: Endpoint::parse(&args.endpoint)?,
        api: Some(args.api.clone()),
        controller: args.controller,
        node,
        attach: args.attach,
        call_budget: Duration::from_secs(args.call_budget),
    };
    zebu_csi::serve(cfg, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
