//! `zebu-manager`: the control plane of Zebu, and the `zebu` command.
//!
//! The manager is split by layer, each crate calling only the ones below it:
//!
//! | crate | owns |
//! |---|---|
//! | `zebu-types` (`manager/types`) | resources, metadata, the store contract, names of finalizers and labels, sizes, times, settings |
//! | `zebu-store` (`manager/store`) | store backends: the embedded redb file |
//! | `zebu-ops` (`manager/ops`) | the rules of every user operation, the scheduler, every call to an engine |
//! | `zebu-controllers` (`manager/controllers`) | one controller per kind: pure decisions plus a thin apply |
//! | `zebu-agent` (`manager/agent`) | the node agent: engine and replica processes on its node |
//! | `zebu-api` (`manager/api`) | the REST API over ops |
//! | this crate | the `zebu` CLI ([`cli`]) over a typed REST [`client`], `zebu up`'s node agents ([`standalone`]), a cluster member's Leases ([`cluster`]) and `zebu manager`, one node's manager in a cluster ([`cli::manager`]) |
//!
//! ```no_run
//! # async fn demo() -> Result<(), zebu_manager::client::ClientError> {
//! use zebu_manager::client::Client;
//! let client = Client::new("http://127.0.0.1:9500")?;
//! for v in client.list_volumes().await?.items {
//!     println!("{} {}", v.metadata.name, v.status.robustness.as_str());
//! }
//! # Ok(()) }
//! ```

pub mod cli;
pub mod client;
pub mod cluster;
pub mod progress;
pub mod standalone;
