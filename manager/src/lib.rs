//! `zebu-manager`: the control plane of Zebu.
//!
//! - [`resources`]: Volume, Engine, Replica, Node, Setting — Kubernetes-shaped
//!   objects (`spec` wanted, `status` observed).
//! - [`store`]: the small store trait controllers are written against, and the
//!   embedded one-file implementation on redb.
//! - [`scheduler`]: a pure function that places replicas on node disks.
//! - [`settings`]: the typed view of Setting objects, with defaults.
//! - [`api`]: the REST API (axum); [`client`] and [`cli`]: the `zebu` CLI.
//! - [`agent`]: the node agent (registers its Node, heartbeats disk capacity)
//!   and, through [`instances`] and [`process`], runs the node's replica and
//!   engine processes.
//! - [`controller`]: the Volume and Node controllers; [`engine_rpc`]: the
//!   calls they make to an engine's control API.
//! - [`size`]: `10G`-style sizes shared by the API and the CLI.
//!
//! Controllers read and write only through [`store::Store`]; the REST API
//! writes `spec`, agents and controllers write `status`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use zebu_manager::store::{EmbeddedStore, TypedStore};
//! use zebu_manager::resources::Volume;
//! let store = EmbeddedStore::open("/var/lib/zebu/zebu.redb")?;
//! let volumes: Vec<Volume> = store.list_as().await?;
//! # Ok(()) }
//! ```

pub mod agent;
pub mod api;
pub mod cli;
pub mod client;
pub mod controller;
pub mod engine_rpc;
pub mod instances;
pub mod process;
pub mod progress;
pub mod resources;
pub mod scheduler;
pub mod settings;
pub mod size;
pub mod standalone;
pub mod store;
pub mod time;
