//! `zebu-csi`: Zebu's Container Storage Interface plugin (CSI spec v1.12).
//!
//! One binary serves the three CSI services on one gRPC endpoint (a Unix socket for the
//! kubelet and the sidecars, or TCP for tests):
//!
//! - [`identity`]: `driver.zebu.io`, its capabilities, and a Probe that is ready only when
//!   the manager answers;
//! - [`controller`] (`--controller`): volumes, publishing, snapshots, snapshots that are
//!   backups (VolumeSnapshotClass `type: backup`, id `backup:<name>`), clones, restores
//!   from backups (`fromBackup`, or a backup snapshot as the content source), expansion and
//!   capacity, all through the manager's REST API (the typed client of `zebu-manager`), so
//!   the same rules hold as for the `zebu` CLI, on `zebu up` and in a cluster alike;
//! - [`node`] (`--node`): attaching a published volume on this host (iSCSI with `iscsiadm`,
//!   or `nbdfuse` and a direct-I/O loop device: [`node::attach`]), making its filesystem
//!   when blank, the staging mount and the bind mounts, expansion and statistics.
//!
//! [`names`] maps CSI names to Zebu names, [`params`] checks StorageClass and
//! VolumeSnapshotClass parameters,
//! [`caps`] the volume capabilities.
//!
//! Tests (`csi/tests/`): `sanity.rs` (csi-sanity v5.4.0 with real staging and mounts),
//! `controller.rs` (bad input, snapshots, clones, expansion, block for block),
//! `from_backup.rs` (`fromBackup` against a real backup target), `backup_snapshot.rs`
//! (`type: backup` snapshots to a real S3 server, restored through CreateVolume), `kube_e2e.rs` (the
//! upstream sidecars on a real API server, from a PVC to deletion), `vm_iscsi.rs` (the node
//! service with the real Linux iSCSI initiator, `iscsiadm` and `iscsid` in a QEMU VM:
//! stage, publish, write, unstage, stage again). Attach time:
//! `benches/csi-attach-bench.sh`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), zebu_csi::ServeError> {
//! use std::time::Duration;
//! use zebu_csi::{Endpoint, PluginConfig};
//! let cfg = PluginConfig {
//!     endpoint: Endpoint::parse("unix:///run/zebu-csi.sock")?,
//!     api: Some("http://127.0.0.1:9500".into()),
//!     controller: true,
//!     node: None,
//!     attach: zebu_csi::node::attach::AttachMode::Nbdfuse,
//!     call_budget: Duration::from_secs(10),
//! };
//! zebu_csi::serve(cfg, std::future::pending()).await
//! # }
//! ```

pub mod caps;
pub mod controller;
pub mod exec;
pub mod identity;
pub mod names;
pub mod node;
pub mod params;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use zebu_manager::client::Client;
use zebu_proto::csi;

const _: () = assert!(usize::BITS == 64, "Zebu builds for 64-bit Linux only");

/// Where the plugin listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Endpoint {
    /// `unix:///path`, `unix:/path`, a bare absolute path, or `tcp://HOST:PORT`.
    pub fn parse(s: &str) -> Result<Endpoint, ServeError> {
        let bad = |reason: &str| ServeError::Endpoint {
            endpoint: s.to_string(),
            reason: reason.to_string(),
        };
        if let Some(rest) = s.strip_prefix("tcp://") {
            return rest
                .parse()
                .map(Endpoint::Tcp)
                .map_err(|_| bad("expected tcp://IP:PORT"));
        }
        let path = s
            .strip_prefix("unix://")
            .or_else(|| s.strip_prefix("unix:"))
            .unwrap_or(s);
        if !path.starts_with('/') {
            return Err(bad("expected unix:///ABSOLUTE/PATH or tcp://IP:PORT"));
        }
        Ok(Endpoint::Unix(PathBuf::from(path)))
    }
}

/// What one plugin process serves.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub endpoint: Endpoint,
    /// The manager's API; needed by the controller.
    pub api: Option<String>,
    pub controller: bool,
    pub node: Option<node::NodeConfig>,
    /// How nodes attach; the controller publishes with the matching frontend.
    pub attach: node::attach::AttachMode,
    /// How long a controller call waits for the cluster before answering "in progress".
    pub call_budget: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("the manager API: {0}")]
    Api(#[from] zebu_manager::client::ClientError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("nothing to serve: give --controller, --node or both")]
    NothingToServe,
}

/// Serve until `shutdown` resolves.
pub async fn serve(
    cfg: PluginConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    if !cfg.controller && cfg.node.is_none() {
        return Err(ServeError::NothingToServe);
    }
    let client = match (&cfg.api, cfg.controller) {
        (Some(api), true) => Some(Client::new(api)?),
        (None, true) => {
            return Err(ServeError::Endpoint {
                endpoint: "--api".into(),
                reason: "the controller needs the manager's API address".into(),
            });
        }
        _ => None,
    };
    let identity =
        csi::identity_server::IdentityServer::new(identity::IdentityService::new(client.clone()));
    let controller = client.map(|c| {
        csi::controller_server::ControllerServer::new(controller::ControllerService::new(
            c,
            cfg.attach,
            cfg.call_budget,
        ))
    });
    let node = match cfg.node {
        Some(n) => {
            let dir = n.state_dir.clone();
            Some(csi::node_server::NodeServer::new(
                node::NodeService::new(n).map_err(|source| ServeError::Io {
                    what: format!("state directory {}", dir.display()),
                    source,
                })?,
            ))
        }
        None => None,
    };
    let router = tonic::transport::Server::builder()
        .trace_fn(|req| tracing::info_span!("csi", call = %req.uri().path()))
        .add_service(identity)
        .add_optional_service(controller)
        .add_optional_service(node);
    match cfg.endpoint {
        Endpoint::Tcp(addr) => {
            tracing::info!(%addr, "serving CSI");
            router.serve_with_shutdown(addr, shutdown).await?;
        }
        Endpoint::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|source| ServeError::Io {
                    what: format!("creating {}", dir.display()),
                    source,
                })?;
            }
            // A socket left by an earlier run would make the bind fail.
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(ServeError::Io {
                        what: format!("removing the old socket {}", path.display()),
                        source,
                    });
                }
            }
            let listener =
                tokio::net::UnixListener::bind(&path).map_err(|source| ServeError::Io {
                    what: format!("binding {}", path.display()),
                    source,
                })?;
            tracing::info!(socket = %path.display(), "serving CSI");
            router
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    shutdown,
                )
                .await?;
            let _ = std::fs::remove_file(&path);
        }
    }
    Ok(())
}

/// A gRPC channel to a plugin's endpoint (tests, tools).
pub async fn connect(
    endpoint: &Endpoint,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match endpoint {
        Endpoint::Tcp(addr) => {
            tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                .connect()
                .await
        }
        Endpoint::Unix(path) => {
            let path = path.clone();
            // The URI is not used: the connector dials the socket.
            tonic::transport::Endpoint::from_static("http://unix.invalid")
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        tokio::net::UnixStream::connect(path)
                            .await
                            .map(hyper_util::rt::TokioIo::new)
                    }
                }))
                .await
        }
    }
}
