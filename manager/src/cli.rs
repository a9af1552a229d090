//! The `zebu` command line: `zebu up` runs a one-host cluster in the
//! foreground; every other command is a REST call to a running manager.
//!
//! Bad input gets one line on stderr and exit code 2 (argument errors) or 1
//! (the API refused or could not be reached); `-o json|yaml` prints the
//! objects exactly as the API returns them, `-o table` a summary.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use hyper::Method;
use serde_json::{Value, json};

use crate::agent::AgentConfig;
use crate::client::Client;
use crate::progress::RebuildView;
use crate::resources::{Frontend, Node, RebuildProgress, Setting, SettingSpec, Volume};
use crate::size::ByteSize;
use crate::standalone::LocalAgents;
use crate::store::{EmbeddedStore, TypedStore};

#[derive(Debug, Parser)]
#[command(name = "zebu", about = "Zebu replicated block storage", version)]
pub struct Cli {
    /// The manager's API address.
    #[arg(
        long,
        global = true,
        env = "ZEBU_API",
        default_value = "http://127.0.0.1:9500"
    )]
    pub api: String,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the manager API and N node agents on this host, in the foreground.
    Up {
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=200))]
        nodes: u8,
        #[arg(long, default_value = "./zebu-data")]
        data_dir: PathBuf,
        /// Where the API listens (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:9500")]
        listen: SocketAddr,
        /// Set a cluster setting at start, e.g.
        /// `storage-minimal-available-percentage=10` (repeatable).
        #[arg(long = "setting", value_name = "NAME=VALUE")]
        settings: Vec<String>,
        /// Also create this volume (if it does not exist yet) with up to 3
        /// replicas, attach it over NBD on node-1 and print its endpoint.
        #[arg(long, value_name = "NAME")]
        volume: Option<String>,
        /// The size `--volume` is created with.
        #[arg(long, default_value = "10G", value_name = "SIZE")]
        volume_size: ByteSize,
    },
    /// Nodes.
    #[command(subcommand)]
    Node(NodeCmd),
    /// Volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Snapshots of a volume.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
}

#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// List nodes.
    Ls,
    /// Stop a node's agent and its processes (`zebu up` only; for tests).
    #[command(hide = true)]
    Stop { node: String },
    /// Start a node's agent again (`zebu up` only; for tests).
    #[command(hide = true)]
    Start { node: String },
}

#[derive(Debug, Subcommand)]
pub enum VolumeCmd {
    /// Create a volume.
    Create {
        name: String,
        /// Size: 10G, 512M, 1Ti or bytes.
        #[arg(long)]
        size: ByteSize,
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20))]
        replicas: Option<u32>,
        #[arg(long, value_enum)]
        frontend: Option<FrontendArg>,
    },
    /// List volumes.
    Ls,
    /// Show one volume.
    Get {
        name: String,
        /// Keep printing it as it changes.
        #[arg(long)]
        watch: bool,
    },
    /// Attach a volume to a node and print its endpoint once it is served.
    Attach {
        name: String,
        #[arg(long)]
        node: Option<String>,
        /// Return at once instead of waiting for the endpoint.
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait for the endpoint.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Detach a volume.
    Detach { name: String },
    /// Delete a volume.
    Delete { name: String },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FrontendArg {
    Iscsi,
    Nbd,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Take a snapshot.
    Create {
        volume: String,
        name: Option<String>,
    },
    /// List snapshots.
    Ls { volume: String },
    /// Remove a snapshot.
    Rm { volume: String, name: String },
}

/// Parse arguments; on error print one line and return the exit code.
pub fn parse_args() -> Result<Cli, u8> {
    match Cli::try_parse() {
        Ok(cli) => Ok(cli),
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return Err(
                    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                        2
                    } else {
                        0
                    },
                );
            }
            // clap's first paragraph, on one line: "the following required
            // arguments were not provided:" is useless without the next line.
            let text = e.to_string();
            let para: Vec<&str> = text
                .lines()
                .skip_while(|l| l.trim().is_empty())
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let joined = para.join(" ");
            let line = if joined.is_empty() {
                "invalid arguments"
            } else {
                joined.as_str()
            };
            let _ = writeln!(
                std::io::stderr(),
                "zebu: {}",
                line.trim_start_matches("error: ")
            );
            Err(2)
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let client = Client::new(&cli.api);
    let out = cli.output;
    match cli.command {
        Command::Up {
            nodes,
            data_dir,
            listen,
            settings,
            volume,
            volume_size,
        } => {
            let volume = volume.map(|name| UpVolume {
                name,
                size: volume_size,
                replicas: u32::from(nodes).min(3),
            });
            up(nodes, data_dir, listen, &settings, volume).await
        }
        Command::Node(NodeCmd::Ls) => {
            let v = client.call(Method::GET, "/v1/nodes", None).await?;
            print_items(out, &v, node_table)
        }
        Command::Node(NodeCmd::Stop { node }) => {
            let path = format!("/v1/standalone/nodes/{node}/stop");
            let v = client.call(Method::POST, &path, None).await?;
            print_value(out, &v)
        }
        Command::Node(NodeCmd::Start { node }) => {
            let path = format!("/v1/standalone/nodes/{node}/start");
            let v = client.call(Method::POST, &path, None).await?;
            print_value(out, &v)
        }
        Command::Volume(cmd) => volume(&client, out, cmd).await,
        Command::Snapshot(cmd) => {
            let (method, path, body) = match &cmd {
                SnapshotCmd::Create { volume, name } => (
                    Method::POST,
                    format!("/v1/volumes/{volume}/snapshots"),
                    Some(json!({ "name": name })),
                ),
                SnapshotCmd::Ls { volume } => {
                    (Method::GET, format!("/v1/volumes/{volume}/snapshots"), None)
                }
                SnapshotCmd::Rm { volume, name } => (
                    Method::DELETE,
                    format!("/v1/volumes/{volume}/snapshots/{name}"),
                    None,
                ),
            };
            // Every snapshot call answers with the volume's snapshots now.
            let v = client.call(method, &path, body.as_ref()).await?;
            print_items(out, &v, snapshot_table)
        }
    }
}

async fn volume(client: &Client, out: Output, cmd: VolumeCmd) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            replicas,
            frontend,
        } => {
            let mut body = json!({ "name": name, "size": size.bytes() });
            if let Some(r) = replicas {
                body["numberOfReplicas"] = json!(r);
            }
            if let Some(f) = frontend {
                body["frontend"] = json!(match f {
                    FrontendArg::Iscsi => Frontend::Iscsi,
                    FrontendArg::Nbd => Frontend::Nbd,
                });
            }
            let v = client
                .call(Method::POST, "/v1/volumes", Some(&body))
                .await?;
            print_one(out, &v, volume_table)
        }
        VolumeCmd::Ls => {
            let v = client.call(Method::GET, "/v1/volumes", None).await?;
            print_items(out, &v, volume_table)
        }
        VolumeCmd::Get { name, watch: false } => {
            let v = client
                .call(Method::GET, &format!("/v1/volumes/{name}"), None)
                .await?;
            print_one(out, &v, volume_table)
        }
        VolumeCmd::Get { name, watch: true } => {
            let mut failure: Option<anyhow::Error> = None;
            let mut view = RebuildView::new(std::io::IsTerminal::is_terminal(&std::io::stdout()));
            let mut last_shown = Value::Null;
            client
                .stream_lines(&format!("/v1/volumes/{name}?watch=true"), |ev| {
                    if ev["type"] == "Error" {
                        let msg = ev["error"].as_str().unwrap_or("watch failed").to_string();
                        failure = Some(anyhow::anyhow!(msg));
                        return false;
                    }
                    let obj = &ev["object"];
                    let shown = if out == Output::Table {
                        // The table once per change of what it shows; the
                        // rebuild's progress as a bar or a line of its own.
                        let table_part = json!([
                            obj["spec"],
                            obj["status"]["state"],
                            obj["status"]["robustness"],
                            obj["status"]["replicas"]
                        ]);
                        let mut r = Ok(());
                        if table_part != last_shown {
                            r = print_one(out, obj, volume_table);
                            last_shown = table_part;
                        }
                        let rebuild: Option<RebuildProgress> =
                            serde_json::from_value(obj["status"]["rebuild"].clone()).ok();
                        r.and_then(|()| emit(&view.update(rebuild.as_ref())))
                    } else {
                        print_one(out, obj, volume_table)
                    };
                    if let Err(e) = shown {
                        failure = Some(e);
                        return false;
                    }
                    ev["type"] != "Deleted"
                })
                .await?;
            match failure {
                Some(f) => Err(f),
                None => Ok(()),
            }
        }
        VolumeCmd::Attach {
            name,
            node,
            no_wait,
            timeout,
        } => {
            let v = client
                .call(
                    Method::POST,
                    &format!("/v1/volumes/{name}/attach"),
                    Some(&json!({ "node": node })),
                )
                .await?;
            if no_wait {
                return print_one(out, &v, volume_table);
            }
            let v = wait_attached(client, &name, Duration::from_secs(timeout)).await?;
            match out {
                // Just the endpoint, so `dev=$(zebu volume attach v)` works.
                Output::Table => {
                    let endpoint = v["status"]["endpoint"].as_str().unwrap_or("");
                    emit(&format!("{endpoint}\n"))
                }
                _ => print_value(out, &v),
            }
        }
        VolumeCmd::Detach { name } => {
            let v = client
                .call(Method::POST, &format!("/v1/volumes/{name}/detach"), None)
                .await?;
            print_one(out, &v, volume_table)
        }
        VolumeCmd::Delete { name } => {
            let v = client
                .call(Method::DELETE, &format!("/v1/volumes/{name}"), None)
                .await?;
            match out {
                Output::Table => emit(&format!("volume {name} deleted\n")),
                _ => print_value(out, &v),
            }
        }
    }
}

/// Poll the volume until it is attached with an endpoint.
async fn wait_attached(client: &Client, name: &str, timeout: Duration) -> anyhow::Result<Value> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = client
            .call(Method::GET, &format!("/v1/volumes/{name}"), None)
            .await?;
        if v["status"]["state"] == "attached" && v["status"]["endpoint"].is_string() {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "volume {name} not attached after {} s (state {}, robustness {})",
                timeout.as_secs(),
                v["status"]["state"],
                v["status"]["robustness"]
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Write to stdout and flush. A reader that went away (`zebu volume ls |
/// head -1`) shows up as an `io::Error` of kind `BrokenPipe`, which `main`
/// treats as a quiet end (see [`is_broken_pipe`]) instead of a panic, as
/// `println!` would.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Whether an error is stdout's reader having gone away.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn print_value(out: Output, v: &Value) -> anyhow::Result<()> {
    match out {
        Output::Json | Output::Table => emit(&format!("{}\n", serde_json::to_string_pretty(v)?)),
        Output::Yaml => emit(&serde_yaml::to_string(v)?),
    }
}

fn print_one(
    out: Output,
    v: &Value,
    table: fn(&[Value]) -> anyhow::Result<String>,
) -> anyhow::Result<()> {
    match out {
        Output::Table => emit(&table(std::slice::from_ref(v))?),
        _ => print_value(out, v),
    }
}

fn print_items(
    out: Output,
    v: &Value,
    table: fn(&[Value]) -> anyhow::Result<String>,
) -> anyhow::Result<()> {
    match out {
        Output::Table => {
            let items = v["items"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            emit(&table(items)?)
        }
        _ => print_value(out, v),
    }
}

/// Columns padded to their widest cell.
fn render(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut s = String::new();
    let line = |cells: Vec<&str>, s: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        s.push_str(parts.join("  ").trim_end());
        s.push('\n');
    };
    line(header.to_vec(), &mut s);
    for r in &rows {
        line(r.iter().map(String::as_str).collect(), &mut s);
    }
    s
}

fn volume_table(items: &[Value]) -> anyhow::Result<String> {
    let mut rows = Vec::new();
    for item in items {
        let v: Volume = serde_json::from_value(item.clone()).context("decoding a volume")?;
        rows.push(vec![
            v.metadata.name.clone(),
            v.spec.size.to_string(),
            v.spec.number_of_replicas.to_string(),
            v.spec.frontend.to_string(),
            serde_json::to_value(v.status.state)?
                .as_str()
                .unwrap_or("")
                .to_string(),
            serde_json::to_value(v.status.robustness)?
                .as_str()
                .unwrap_or("")
                .to_string(),
            v.spec.node_id.clone().unwrap_or_else(|| "-".into()),
            v.status.endpoint.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    Ok(render(
        &[
            "NAME",
            "SIZE",
            "REPLICAS",
            "FRONTEND",
            "STATE",
            "ROBUSTNESS",
            "NODE",
            "ENDPOINT",
        ],
        rows,
    ))
}

fn snapshot_table(items: &[Value]) -> anyhow::Result<String> {
    let text = |v: &Value| match v.as_str() {
        Some("") | None => "-".to_string(),
        Some(s) => s.to_string(),
    };
    let rows = items
        .iter()
        .map(|s| {
            vec![
                text(&s["name"]),
                text(&s["parent"]),
                text(&s["created"]),
                ByteSize(s["dataBytes"].as_u64().unwrap_or(0)).approx(),
            ]
        })
        .collect();
    Ok(render(&["NAME", "PARENT", "CREATED", "DATA"], rows))
}

fn node_table(items: &[Value]) -> anyhow::Result<String> {
    let mut rows = Vec::new();
    for item in items {
        let n: Node = serde_json::from_value(item.clone()).context("decoding a node")?;
        let (max, avail) = n.status.disk_status.values().fold((0, 0), |(m, a), d| {
            (
                m + d.storage_maximum.bytes(),
                a + d.storage_available.bytes(),
            )
        });
        rows.push(vec![
            n.metadata.name.clone(),
            n.spec.address.clone(),
            if n.is_ready() { "True" } else { "False" }.into(),
            n.spec.disks.len().to_string(),
            ByteSize(avail).approx(),
            ByteSize(max).approx(),
        ]);
    }
    Ok(render(
        &["NAME", "ADDRESS", "READY", "DISKS", "AVAILABLE", "MAXIMUM"],
        rows,
    ))
}

/// The volume `zebu up --volume` provides.
#[derive(Debug, Clone)]
struct UpVolume {
    name: String,
    size: ByteSize,
    replicas: u32,
}

/// How long `zebu up --volume` waits for the nodes' first heartbeats.
const NODES_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `zebu up --volume` waits for its volume to be served.
const UP_VOLUME_TIMEOUT: Duration = Duration::from_secs(300);

/// Create `vol` unless it exists (its data survives a restart of `zebu up`),
/// attach it on node-1 unless it is attached, and print its endpoint once it
/// is served. Goes through the cluster's own API, so the same checks apply
/// as to `zebu volume create`.
async fn provide_volume(api: SocketAddr, nodes: u8, vol: UpVolume) -> anyhow::Result<String> {
    let client = Client::new(&format!("http://{api}"));
    // The scheduler places replicas only on nodes that reported their disks:
    // wait for every node's first heartbeat.
    let deadline = tokio::time::Instant::now() + NODES_READY_TIMEOUT;
    loop {
        let list = client.call(Method::GET, "/v1/nodes", None).await?;
        let items: Vec<Node> =
            serde_json::from_value(list["items"].clone()).context("decoding the node list")?;
        let ready = items.iter().filter(|n| n.is_ready()).count();
        if ready >= usize::from(nodes) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "only {ready} of {nodes} nodes ready after {} s",
                NODES_READY_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let path = format!("/v1/volumes/{}", vol.name);
    let existing = match client.call(Method::GET, &path, None).await {
        Ok(v) => Some(v),
        Err(crate::client::ClientError::Api { status, .. })
            if status == hyper::StatusCode::NOT_FOUND =>
        {
            None
        }
        Err(e) => return Err(e.into()),
    };
    let v = match existing {
        Some(v) => v,
        None => {
            let body = json!({
                "name": vol.name,
                "size": vol.size.bytes(),
                "numberOfReplicas": vol.replicas,
                "frontend": Frontend::Nbd,
            });
            client
                .call(Method::POST, "/v1/volumes", Some(&body))
                .await
                .with_context(|| format!("creating volume {}", vol.name))?
        }
    };
    if v["spec"]["nodeId"].is_null() {
        client
            .call(
                Method::POST,
                &format!("{path}/attach"),
                Some(&json!({ "node": "node-1" })),
            )
            .await
            .with_context(|| format!("attaching volume {}", vol.name))?;
    }
    let v = wait_attached(&client, &vol.name, UP_VOLUME_TIMEOUT).await?;
    Ok(v["status"]["endpoint"].as_str().unwrap_or("").to_string())
}

/// `zebu up`: the store, the API and the node agents, until Ctrl-C/SIGTERM.
async fn up(
    nodes: u8,
    data_dir: PathBuf,
    listen: SocketAddr,
    settings: &[String],
    volume: Option<UpVolume>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating data dir {}", data_dir.display()))?;
    let data_dir = data_dir
        .canonicalize()
        .with_context(|| format!("resolving {}", data_dir.display()))?;
    let db = data_dir.join("zebu.redb");
    let store = Arc::new(
        EmbeddedStore::open(&db).with_context(|| format!("opening store {}", db.display()))?,
    );
    for s in settings {
        let (name, value) = s
            .split_once('=')
            .with_context(|| format!("--setting {s:?}: expected NAME=VALUE"))?;
        // Refuse unknown names and bad values before anything is stored.
        crate::settings::Settings::default().set(name, value)?;
        let mut obj = Setting::new(
            name,
            SettingSpec {
                value: value.into(),
            },
        );
        match store.get_as::<Setting>(name).await? {
            Some(old) => {
                obj.metadata = old.metadata;
                store.update_as(&obj).await?;
            }
            None => {
                store.create_as(&obj).await?;
            }
        }
    }
    // One host's filesystem behind every node: see the constant's docs.
    let minimal = "storage-minimal-available-percentage";
    if store.get_as::<Setting>(minimal).await?.is_none() {
        let value = crate::settings::STANDALONE_MINIMAL_AVAILABLE_PERCENTAGE.to_string();
        match store
            .create_as(&Setting::new(minimal, SettingSpec { value }))
            .await
        {
            Ok(_) | Err(crate::store::StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the API to {listen}"))?;
    let addr = listener.local_addr()?;
    let configs = (1..=nodes)
        .map(|i| {
            let name = format!("node-{i}");
            AgentConfig {
                node: name.clone(),
                address: format!("127.0.0.{}", 10 + u32::from(i)),
                disks: BTreeMap::from([(
                    "disk-0".to_string(),
                    data_dir.join(&name).join("disk-0"),
                )]),
                heartbeat: Duration::from_secs(2),
                log_dir: data_dir.join(&name).join("logs"),
            }
        })
        .collect();
    let agents = Arc::new(LocalAgents::new(store.clone(), configs));
    agents.start_all().await.context("registering the nodes")?;
    // One pass before the API answers, so volume status left from before a
    // restart (an endpoint whose engine is gone) is not shown as current.
    // It runs before the controller loop starts: two passes at once could
    // both schedule the same missing replica.
    if let Err(e) = crate::controller::volume::VolumeController::new(store.clone())
        .pass()
        .await
    {
        tracing::warn!("volume controller: {e}");
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let controllers = tokio::spawn(crate::controller::run(store.clone(), stop_rx));
    // Whoever started us may stop reading our output (a closed pipe): the
    // cluster keeps running, so a failed write here is only logged.
    let banner = format!(
        "zebu API listening on http://{addr}\ndata in {}, {nodes} nodes; Ctrl-C stops everything\n",
        data_dir.display()
    );
    if let Err(e) = emit(&banner) {
        tracing::warn!("cannot write to stdout: {e}");
    }
    let app = crate::api::router(store.clone()).merge(crate::standalone::router(agents.clone()));
    let provider = volume.map(|vol| {
        tokio::spawn(async move {
            let name = vol.name.clone();
            match provide_volume(addr, nodes, vol).await {
                Ok(endpoint) => {
                    if let Err(e) = emit(&format!("volume {name} attached: {endpoint}\n")) {
                        tracing::warn!("cannot write to stdout: {e}");
                    }
                }
                // The cluster runs on; the user can look with `zebu volume get`.
                Err(e) => {
                    let _ = writeln!(std::io::stderr(), "zebu: volume {name}: {e:#}");
                }
            }
        })
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the API")?;
    if let Some(p) = provider {
        p.abort();
    }
    let _ = stop_tx.send(true);
    if let Err(e) = controllers.await {
        tracing::warn!("controller task failed: {e}");
    }
    agents.stop_all().await;
    let _ = writeln!(std::io::stderr(), "zebu: stopped");
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
