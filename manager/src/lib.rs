//! `zebu-manager`: the control plane of Zebu.
//!
//! - [`resources`]: Volume, Engine, Replica, Node, Setting — Kubernetes-shaped
//!   objects (`spec` wanted, `status` observed).
//! - [`store`]: the small store trait controllers are written against, and the
//!   embedded one-file implementation on redb.
//! - [`scheduler`]: a pure function that places replicas on node disks.
//! - [`size`]: `10G`-style sizes shared by the API and the CLI.

pub mod agent;
pub mod api;
pub mod resources;
pub mod scheduler;
pub mod settings;
pub mod size;
pub mod store;
pub mod time;
