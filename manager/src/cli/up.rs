//! `zebu up`: a whole cluster on one host, in the foreground — the embedded store, the REST
//! API, the controllers and one node agent per simulated node (node-1 on
//! `--first-node-address`, node-2 on the next address, ...), until Ctrl-C or SIGTERM.
//! Two clusters side by side need their own `--data-dir`, `--listen` and
//! `--first-node-address`.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use zebu_agent::AgentConfig;
use zebu_ops::Ops;
use zebu_store::EmbeddedStore;
use zebu_types::Store;
use zebu_types::requests::{AttachVolume, CreateVolume};
use zebu_types::resources::{Frontend, Setting, SettingSpec};
use zebu_types::size::ByteSize;
use zebu_types::store::{StoreError, TypedStore};

use super::args::UpArgs;
use super::commands::wait_attached;
use super::render::emit;
use crate::client::Client;
use crate::standalone::LocalAgents;

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

/// The address of each node: `first`, then the following ones, all in `first`'s /24 so a
/// typo cannot spill into another network.
pub fn node_addresses(first: Ipv4Addr, nodes: u8) -> anyhow::Result<Vec<Ipv4Addr>> {
    let [a, b, c, d] = first.octets();
    let last = u32::from(d) + u32::from(nodes) - 1;
    if d == 0 || last > 254 {
        bail!("--first-node-address {first} leaves no room for {nodes} nodes in {a}.{b}.{c}.1-254");
    }
    Ok((0..nodes).map(|i| Ipv4Addr::new(a, b, c, d + i)).collect())
}

/// Create the volume unless it exists (its data survives a restart of `zebu up`), attach it
/// on node-1 unless it is attached, and return its endpoint once it is served. Goes through
/// the cluster's own API, so the same checks apply as to `zebu volume create`.
async fn provide_volume(api: SocketAddr, nodes: u8, vol: UpVolume) -> anyhow::Result<String> {
    let client = Client::new(&format!("http://{api}"))?;
    // The scheduler places replicas only on nodes that reported their disks: wait for every
    // node's first heartbeat.
    let deadline = tokio::time::Instant::now() + NODES_READY_TIMEOUT;
    loop {
        let ready = client
            .list_nodes()
            .await?
            .items
            .iter()
            .filter(|n| n.is_ready())
            .count();
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
    let v = match client.find_volume(&vol.name).await? {
        Some(v) => v,
        None => {
            let mut req = CreateVolume::new(vol.name.clone(), vol.size);
            req.number_of_replicas = Some(vol.replicas);
            req.frontend = Some(Frontend::Nbd);
            client
                .create_volume(&req)
                .await
                .with_context(|| format!("creating volume {}", vol.name))?
        }
    };
    if v.spec.node_id.is_none() {
        let req = AttachVolume {
            node: Some("node-1".into()),
            maintenance: false,
            frontend: None,
        };
        client
            .attach_volume(&vol.name, &req)
            .await
            .with_context(|| format!("attaching volume {}", vol.name))?;
    }
    let v = wait_attached(&client, &vol.name, UP_VOLUME_TIMEOUT).await?;
    Ok(v.status.endpoint.unwrap_or_default())
}

/// Store the `--setting`s, refusing unknown names and bad values before anything is stored.
async fn apply_settings(store: &dyn Store, settings: &[String]) -> anyhow::Result<()> {
    for s in settings {
        let (name, value) = s
            .split_once('=')
            .with_context(|| format!("--setting {s:?}: expected NAME=VALUE"))?;
        zebu_types::settings::Settings::default().set(name, value)?;
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
        let value = zebu_types::settings::STANDALONE_MINIMAL_AVAILABLE_PERCENTAGE.to_string();
        match store
            .create_as(&Setting::new(minimal, SettingSpec { value }))
            .await
        {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    let nodes = args.nodes;
    let addresses = node_addresses(args.first_node_address, nodes)?;
    let volume = args.volume.map(|name| UpVolume {
        name,
        size: args.volume_size,
        replicas: u32::from(nodes).min(3),
    });
    let data_dir: PathBuf = args.data_dir;
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating data dir {}", data_dir.display()))?;
    let data_dir = data_dir
        .canonicalize()
        .with_context(|| format!("resolving {}", data_dir.display()))?;
    let db = data_dir.join("zebu.redb");
    let store: Arc<dyn Store> = Arc::new(
        EmbeddedStore::open(&db).with_context(|| format!("opening store {}", db.display()))?,
    );
    apply_settings(store.as_ref(), &args.settings).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the API to {}", args.listen))?;
    let addr = listener.local_addr()?;
    // TLS on the replica ports: the cluster's CA (made once, kept), a certificate per node.
    let ca = if args.replica_tls {
        Some(zebu_agent::CaFiles::ensure(
            &data_dir.join("tls").join("ca"),
        )?)
    } else {
        None
    };
    let mut configs = Vec::new();
    for (i, address) in addresses.iter().enumerate() {
        let name = format!("node-{}", i + 1);
        let replica_tls = match &ca {
            Some(ca) => Some(ca.issue(
                &name,
                std::net::IpAddr::V4(*address),
                &data_dir.join(&name).join("tls"),
            )?),
            None => None,
        };
        configs.push(AgentConfig {
            node: name.clone(),
            address: address.to_string(),
            disks: BTreeMap::from([("disk-0".to_string(), data_dir.join(&name).join("disk-0"))]),
            heartbeat: Duration::from_secs(2),
            log_dir: data_dir.join(&name).join("logs"),
            instance_manager: args.instance_manager.clone(),
            replica_tls,
        });
    }
    let replica_tls_ca = ca.as_ref().map(|ca| ca.cert.clone());
    let ops_tls = match &replica_tls_ca {
        Some(ca) => Some(zebu_proto::tls::connector(ca)?),
        None => None,
    };
    let agents = Arc::new(LocalAgents::new(store.clone(), configs));
    agents.start_all().await.context("registering the nodes")?;
    // One pass before the API answers, so volume status left from before a restart (an
    // endpoint whose engine is gone) is not shown as current. It runs before the controller
    // loop starts: two passes at once could both schedule the same missing replica.
    if let Err(e) = zebu_controllers::Controllers::new(store.clone())
        .pass()
        .await
    {
        tracing::warn!("controllers: {e}");
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let backups = tokio::spawn(zebu_controllers::backup::run(
        store.clone(),
        zebu_controllers::backup::BackupConfig {
            work_dir: data_dir.join("backups"),
            replica_tls_ca: replica_tls_ca.clone(),
        },
        stop_rx.clone(),
    ));
    let standby = tokio::spawn(zebu_controllers::standby::run(
        store.clone(),
        zebu_controllers::backup::BackupConfig {
            work_dir: data_dir.join("backups"),
            replica_tls_ca: replica_tls_ca.clone(),
        },
        stop_rx.clone(),
    ));
    // One host, one manager: the recurring jobs' scheduler runs for good.
    let recurring = tokio::spawn(zebu_controllers::recurring::run(
        store.clone(),
        None,
        stop_rx.clone(),
    ));
    let controllers = tokio::spawn(zebu_controllers::run(store.clone(), stop_rx));
    // Whoever started us may stop reading our output (a closed pipe): the cluster keeps
    // running, so a failed write here is only logged.
    let banner = format!(
        "zebu API listening on http://{addr}\ndata in {}, {nodes} nodes; Ctrl-C stops everything\n",
        data_dir.display()
    );
    if let Err(e) = emit(&banner) {
        tracing::warn!("cannot write to stdout: {e}");
    }
    let app = zebu_api::router(Ops::new(store.clone()).with_replica_tls(ops_tls))
        .merge(crate::standalone::router(agents.clone()));
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
    if let Err(e) = backups.await {
        tracing::warn!("backup controller task failed: {e}");
    }
    if let Err(e) = standby.await {
        tracing::warn!("standby controller task failed: {e}");
    }
    if let Err(e) = recurring.await {
        tracing::warn!("recurring controller task failed: {e}");
    }
    agents.stop_all().await;
    let _ = writeln!(std::io::stderr(), "zebu: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_follow_the_first_within_its_network() {
        let first: Ipv4Addr = "127.0.0.21".parse().expect("ip");
        let got = node_addresses(first, 3).expect("room");
        assert_eq!(
            got.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["127.0.0.21", "127.0.0.22", "127.0.0.23"]
        );
        let e = node_addresses("127.0.0.250".parse().expect("ip"), 10).expect_err("no room");
        assert!(e.to_string().contains("no room for 10 nodes"), "{e}");
        assert!(node_addresses("127.0.0.0".parse().expect("ip"), 1).is_err());
    }
}
