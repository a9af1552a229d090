//! One copy of a Zebu volume.
//!
//! (Overview to be written with the implementation.)

pub mod error;
pub mod io;
pub mod server;
pub mod store;

pub use error::{ReplicaError, Result};
pub use store::{BLOCK_SIZE, LayerInfo, LayerSpec, Replica, ReplicaInfo};

// Offsets are u64 and buffers usize everywhere; they convert losslessly only on 64-bit.
const _: () = assert!(usize::BITS == 64, "Zebu supports 64-bit targets only");
