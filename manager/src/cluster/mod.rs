//! A cluster of managers on Kubernetes: what each node's manager needs beyond the
//! controllers and the agent it shares with `zebu up`.
//!
//! - [`lease`]: the node Leases and the cluster Lease, their pure decision and the client
//!   that reads and writes them;
//! - [`membership`]: the loop that keeps this manager's Leases and observes everyone's,
//!   and hands the controllers what it learnt ([`zebu_controllers::Membership`]).

pub mod lease;
pub mod membership;

pub use membership::{LeaseMembership, run_leases};

/// A client for the cluster: `kubeconfig` when given, else the in-cluster config (a pod's
/// service account).
pub async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
) -> Result<kube::Client, KubeConfigError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc =
                kube::config::Kubeconfig::read_from(path).map_err(|e| KubeConfigError::Read {
                    path: path.to_path_buf(),
                    source: e,
                })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| KubeConfigError::Read {
                    path: path.to_path_buf(),
                    source: e,
                })?
        }
        None => kube::Config::incluster().map_err(KubeConfigError::InCluster)?,
    };
    zebu_kube_store::client::from_config(config).map_err(KubeConfigError::Client)
}

#[derive(Debug, thiserror::Error)]
pub enum KubeConfigError {
    #[error("kubeconfig {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("no --kubeconfig and not in a pod: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}
