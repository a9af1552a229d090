//! `zebu-store`: the backends of the [`Store`] contract (defined in `zebu-types`).
//!
//! - [`EmbeddedStore`]: one redb file, for one host (`zebu up`) and for tests; its module
//!   docs give the file layout, the commit point and how watches work.
//! - [`KubeStore`]: custom resources on a Kubernetes API server (crate `zebu-kube-store`),
//!   with a reflector cache per kind.
//! - [`open`]: a backend chosen at run time from a [`StoreConfig`], as the `Arc<dyn Store>`
//!   every layer above is written against.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use zebu_store::{StoreConfig, open};
//! use zebu_types::resources::Volume;
//! use zebu_types::store::TypedStore;
//! let store = open(&StoreConfig::Embedded { path: "/var/lib/zebu/zebu.redb".into() }).await?;
//! let volumes: Vec<Volume> = store.list_as().await?;
//! # Ok(()) }
//! ```

pub mod embedded;

use std::path::PathBuf;
use std::sync::Arc;

pub use embedded::EmbeddedStore;
pub use zebu_kube_store::{KubeStore, KubeStoreOptions};
pub use zebu_types::store::{Store, StoreError};

/// Which backend to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// The embedded store in one file, created if missing.
    Embedded { path: PathBuf },
    /// Custom resources in `namespace` of the cluster `kubeconfig` names (without one: the
    /// in-cluster service account, else `$KUBECONFIG` or `~/.kube/config`). `cached`: serve
    /// reads from reflector caches (a long-running manager) rather than asking the server
    /// every time (a one-shot CLI call).
    Kube {
        kubeconfig: Option<PathBuf>,
        namespace: String,
        cached: bool,
    },
}

/// Open the configured backend.
pub async fn open(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    match config {
        StoreConfig::Embedded { path } => Ok(Arc::new(EmbeddedStore::open(path)?)),
        StoreConfig::Kube {
            kubeconfig,
            namespace,
            cached,
        } => {
            let options = KubeStoreOptions {
                cached: *cached,
                ..Default::default()
            };
            let store = KubeStore::connect(kubeconfig.as_deref(), namespace, options).await?;
            Ok(Arc::new(store))
        }
    }
}
