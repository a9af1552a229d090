//! Entry points of the cargo-fuzz targets in `fuzz/` (not a stable API): each takes the
//! fuzzer's raw bytes and panics only when an invariant of the code under test is broken.
//!
//! - [`iscsi`]: the engine's iSCSI target (PDU framing, login, text negotiation).
//!
//! The replica's harness (`zebu_replica::server::fuzzing`, feature `fuzzing`) is not here:
//! it runs one frames connection of a real `ReplicaServer` through the server's private
//! handler and reads the server's private state to check that an unauthenticated client
//! changed nothing, which no public API offers (nor should).

pub mod iscsi;
