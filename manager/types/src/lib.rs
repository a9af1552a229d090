//! `zebu-types`: what every part of Zebu's control plane agrees on.
//!
//! - [`resources`]: Volume, Engine, Replica, Node, Setting, Snapshot, Backup, BackupTarget,
//!   RecurringJob — Kubernetes-shaped objects (`spec` wanted, `status` observed) with JSON
//!   schemas, so they are custom resources in a cluster and records in the embedded store.
//! - [`meta`]: their metadata ([`ObjectMeta`], opaque [`ResourceVersion`]s, owner references)
//!   and the name rules (DNS-1123 labels for what people name, subdomains for any object).
//! - [`store`]: the [`Store`] contract every backend implements (embedded redb, Kubernetes),
//!   its errors, label selectors and a resumable per-kind watcher.
//! - [`secrets`]: each volume's uuid and secret, and where secrets are kept.
//! - [`names`]: finalizer, label and annotation names.
//! - [`requests`]: the bodies of user operations (create, attach, expand, snapshot, ...).
//! - [`settings`], [`size`], [`time`]: typed settings, `10G` sizes, RFC 3339 times.
//!
//! No database, HTTP server, CLI or process code lives here: a CSI plugin or a Kubernetes
//! store depends on this crate without pulling in the manager.
//!
//! ```
//! use zebu_types::resources::{Frontend, Volume, VolumeSpec};
//! use zebu_types::size::ByteSize;
//! use zebu_types::store::LabelSelector;
//!
//! let size: ByteSize = "10G".parse().expect("a size");
//! let mut v = Volume::new("db", VolumeSpec {
//!     size,
//!     number_of_replicas: 3,
//!     frontend: Frontend::Nbd,
//!     node_selector: vec![],
//!     disk_selector: vec![],
//!     data_locality: Default::default(),
//!     stale_replica_timeout: 60,
//!     node_id: None,
//!     disable_frontend: false,
//! });
//! v.metadata.labels.insert("tier".into(), "gold".into());
//! let gold: LabelSelector = "tier in (gold, silver)".parse().expect("a selector");
//! assert!(gold.matches(&v.metadata.labels));
//! assert_eq!(serde_json::to_value(&v).unwrap()["apiVersion"], "zebu.io/v1alpha1");
//! ```

pub mod kind;
pub mod meta;
pub mod names;
pub mod requests;
pub mod resources;
pub mod secrets;
pub mod settings;
pub mod size;
pub mod store;
pub mod time;

pub use kind::{API_VERSION, DEFAULT_NAMESPACE, GROUP, Kind, VERSION};
pub use meta::{ObjectMeta, OwnerReference, ResourceVersion, validate_label, validate_object_name};
pub use store::{Store, StoreError, TypedStore};
