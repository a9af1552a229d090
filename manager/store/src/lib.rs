//! `zebu-store`: the backends of the [`Store`] contract (defined in `zebu-types`).
//!
//! - [`EmbeddedStore`]: one redb file, for one host (`zebu up`) and for tests; its module
//!   docs give the file layout, the commit point and how watches work.
//! - [`open`]: a backend chosen at run time from a [`StoreConfig`], as the `Arc<dyn Store>`
//!   every layer above is written against. The Kubernetes backend joins as another variant.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use zebu_store::{StoreConfig, open};
//! use zebu_types::resources::Volume;
//! use zebu_types::store::TypedStore;
//! let store = open(&StoreConfig::Embedded { path: "/var/lib/zebu/zebu.redb".into() })?;
//! let volumes: Vec<Volume> = store.list_as().await?;
//! # Ok(()) }
//! ```

pub mod embedded;

use std::path::PathBuf;
use std::sync::Arc;

pub use embedded::EmbeddedStore;
pub use zebu_types::store::{Store, StoreError};

/// Which backend to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// The embedded store in one file, created if missing.
    Embedded { path: PathBuf },
}

/// Open the configured backend.
pub fn open(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    match config {
        StoreConfig::Embedded { path } => Ok(Arc::new(EmbeddedStore::open(path)?)),
    }
}
