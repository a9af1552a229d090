//! The Zebu volume engine.
//!
//! (Overview to be written with the implementation.)

pub mod blockdev;
pub mod cli_args;
pub mod control;
pub mod iscsi;
pub mod nbd;
pub mod replicator;
pub mod workload;

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
