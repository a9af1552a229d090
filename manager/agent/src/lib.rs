//! `zebu-agent`: the node agent, one per node.
//!
//! - [`agent`]: [`NodeAgent`] registers its Node (address and disks), heartbeats disk
//!   capacity and conditions, and runs the node's processes until told to stop.
//! - [`instances`]: turns the Replica and Engine objects placed on the node into running
//!   `zebu-replica` and `zebu-engine` processes, adopts the ones still running after a
//!   restart, stops and cleans up deleted ones, and reports them in their status.
//! - [`process`]: starting, finding (by command line) and stopping those processes.
//! - [`instance_manager`]: the process that, in a cluster, is the parent of the node's
//!   engines and replicas instead of the manager, so a manager restart never stops them.
//! - [`tls`]: the cluster's replica CA and each node's certificate, when the replica ports
//!   speak TLS.
//!
//! The agent reads and writes only through the store (`Arc<dyn Store>`, any backend) and
//! talks to engines only through `zebu_ops::engine_rpc`.

pub mod agent;
pub mod instance_manager;
pub mod instances;
pub mod process;
pub mod tls;

pub use agent::{AgentConfig, AgentError, NodeAgent};
pub use tls::{CaFiles, ReplicaTls, TlsSetupError};
