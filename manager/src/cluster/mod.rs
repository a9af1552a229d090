//! A cluster of managers on Kubernetes: what each node's manager needs beyond the
//! controllers and the agent it shares with `zebu up`.
//!
//! - [`lease`]: the node Leases and the cluster Lease, their pure decision and the client
//!   that reads and writes them;
//! - [`membership`]: the loop that keeps this manager's Leases and observes everyone's,
//!   and hands the controllers what it learnt ([`zebu_controllers::Membership`]);
//! - [`singletons`]: the backup controller, run by whichever manager holds the cluster Lease.

pub mod lease;
pub mod membership;
pub mod singletons;

pub use membership::{LeaseMembership, run_leases};

/// A client for the cluster: `kubeconfig` when given, else the in-cluster config (a pod's
/// service account).
pub async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
) -> Result<kube::Client, KubeConfigError> {
    client_from(kube_config(kubeconfig).await?)
}

/// The configuration [`kube_client`] connects with (its `cluster_url` names the server in
/// messages).
pub async fn kube_config(
    kubeconfig: Option<&std::path::Path>,
) -> Result<kube::Config, KubeConfigError> {
    match kubeconfig {
        Some(path) => {
            let read = |source| KubeConfigError::Read {
                path: path.to_path_buf(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(read)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(read)
        }
        None => kube::Config::incluster().map_err(KubeConfigError::InCluster),
    }
}

/// A client over `config`.
pub fn client_from(config: kube::Config) -> Result<kube::Client, KubeConfigError> {
    zebu_kube_store::client::from_config(config).map_err(KubeConfigError::Client)
}

/// Why there is no client; the causes are its `source()`s (the CLI prints the chain).
#[derive(Debug, thiserror::Error)]
pub enum KubeConfigError {
    #[error("kubeconfig {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("no --kubeconfig and not in a pod")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("Kubernetes client")]
    Client(#[source] kube::Error),
}
