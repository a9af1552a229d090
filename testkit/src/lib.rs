//! Zebu's test tooling, kept out of the shipping engine library (issue 17): nothing here is
//! linked into `zebu-engine`, `zebu-replica` or the manager.
//!
//! - [`workload`]: the verified workload. It writes self-describing (stamped) blocks to any
//!   [`BlockDevice`](zebu_engine::blockdev::BlockDevice), remembers what was acknowledged
//!   and flushed in a [`workload::Model`], and checks a device against it, exactly or as
//!   after a crash. [`workload::NbdClient`] is an NBD client that is itself a `BlockDevice`,
//!   so the same workload drives an engine over the wire. Every data-safety test of Zebu
//!   (`tests/`, `manager/tests/`) and the engine benchmark use it.
//! - the `zebu-verify` binary (`src/bin/zebu-verify.rs`): the workload as a command, `run`
//!   saving the model to a file and `check` reading it back, so a check can run after the
//!   processes under test were killed and restarted. Tests and scripts start it from
//!   `ZEBU_BIN_DIR`, beside the other `zebu-*` binaries.
//! - [`fuzz`]: the iSCSI harnesses the cargo-fuzz targets in `fuzz/` forward their input to
//!   (PDU framing, login, text negotiation), with stable tests of their own. The replica's
//!   harness stays in `zebu-replica` behind its `fuzzing` feature, because it drives the
//!   server's private connection handler and state (see `fuzz/README.md`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use zebu_engine::blockdev::BlockDevice;
//! use zebu_testkit::workload::{self, Expect, NbdClient, RunId, Scope, WorkloadConfig};
//! let dev = NbdClient::connect("127.0.0.1:10809", "vol").await?;
//! let cfg = WorkloadConfig::default();
//! let mut model = cfg.new_model(dev.size(), RunId::random())?;
//! let report = workload::run_workload(&dev, &mut model, &cfg).await;
//! assert!(report.io_errors.is_empty());
//! let check = workload::verify(&dev, &model, Expect::Exact, Scope::Range, 32).await;
//! assert!(check.wrong.is_empty());
//! # Ok(()) }
//! ```

pub mod fuzz;
pub mod workload;

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
