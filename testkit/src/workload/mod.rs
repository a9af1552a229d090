//! The verified workload: writes self-describing blocks to a
//! [`BlockDevice`](zebu_engine::blockdev::BlockDevice), remembers what was acknowledged and flushed,
//! and checks the device against that memory.
//!
//! Every data-safety test of Zebu is built from three steps:
//!
//! 1. [`run_workload`] drives a device (in-process, or a server through [`NbdClient`]) with
//!    queue depth N: stamped block writes ([`stamp`]), optional unmaps and reads, flushes
//!    every K writes or T ms. Reads issued during the run are checked on the spot. Every I/O
//!    error is recorded in the [`RunReport`] — tests assert there were none.
//! 2. Something bad happens (a replica is killed, the engine restarts, a disk is corrupted).
//! 3. [`verify`] reads the blocks back and classifies each against the [`Model`]: exactly the
//!    newest acknowledged write ([`Expect::Exact`]), or after a crash anything between the
//!    last flushed write and the newest issued one ([`Expect::AfterCrash`]). Anything else is
//!    a [`Wrong`] naming the block, the acceptable sequence numbers and what was found.
//!
//! The [`Model`] serializes to a JSON file so the steps can run in different processes (the
//! `zebu-verify` command: `run` saves, `check` loads).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use zebu_engine::blockdev::BlockDevice;
//! use zebu_testkit::workload::{self, Expect, Model, RunId, Scope, WorkloadConfig};
//! let dev = zebu_engine::blockdev::MemDevice::new(64 << 20);
//! let cfg = WorkloadConfig::default();
//! let mut model = cfg.new_model(dev.size(), RunId::random())?;
//! let report = workload::run_workload(&dev, &mut model, &cfg).await;
//! assert!(report.io_errors.is_empty() && report.bad_reads.is_empty());
//! let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 32).await;
//! assert!(check.wrong.is_empty());
//! # Ok(()) }
//! ```

mod driver;
mod model;
pub mod nbd_client;
pub mod stamp;
mod verify;

use serde::{Deserialize, Serialize};

pub use driver::{IoFailure, OpKind, Pattern, RunReport, StopAfter, WorkloadConfig, run_workload};
pub use model::{
    BlockState, Candidate, Content, Expect, FlushTicket, Model, Version, WriteState, Wrong,
};
pub use nbd_client::{NbdClient, NbdError};
pub use verify::{Scope, VerifyReport, verify};

/// Index of a block of the workload's block size (offset = index × block size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockIndex(pub u64);

/// Run-wide write sequence number; 0 means "never written".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seq(pub u64);

/// Identifies one workload run, so data left by another run is recognised as such.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(pub u64);

impl RunId {
    pub fn random() -> RunId {
        RunId(rand::random())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("invalid workload configuration: {0}")]
    Config(String),
    #[error("workload state file {path}: {source}")]
    State {
        path: std::path::PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}
