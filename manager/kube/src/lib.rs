//! `zebu-kube-store`: Zebu's resources as Kubernetes custom resources.
//!
//! - [`crd`]: the CustomResourceDefinitions of every kind, generated from the Rust types'
//!   schemas ([`schema`] makes them structural); `deploy/crds/` holds them as YAML, written
//!   by the `zebu-crds` binary and checked for drift by this crate's tests.
//! - [`present`]: the printable forms (`10Gi`, `2/3`) the store adds under
//!   `status.display` for `kubectl get`.
//! - [`KubeStore`]: the [`Store`](zebu_types::Store) contract over the API server, with a
//!   reflector cache per kind ([`cache`] says what consistency that gives and why it is
//!   safe), status through the status subresource, and the API server's refusals mapped to
//!   [`StoreError`](zebu_types::StoreError)s (403 names the verb and kind).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::path::Path;
//! use zebu_kube_store::{KubeStore, KubeStoreOptions};
//! use zebu_types::resources::Volume;
//! use zebu_types::store::TypedStore;
//! let store = KubeStore::connect(
//!     Some(Path::new("/etc/zebu/kubeconfig")),
//!     zebu_types::DEFAULT_NAMESPACE,
//!     KubeStoreOptions::default(),
//! )
//! .await?;
//! let volumes: Vec<Volume> = store.list_as().await?;
//! # Ok(()) }
//! ```

mod cache;
pub mod client;
pub mod crd;
mod errors;
pub mod present;
pub mod schema;
pub mod secrets;
mod store;

pub use store::{KubeStore, KubeStoreOptions, api_resource};
