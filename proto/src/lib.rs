//! Zebu's wire contracts.
//!
//! Every message between Zebu processes is defined in `proto/*.proto` and generated here:
//! - [`replica`]: engine ⇄ replica (data stream, control and sync RPCs), version
//!   [`replica::PROTOCOL_VERSION`].
//! - [`engine`]: manager or CLI ⇄ engine (volume info, replicas, snapshots, rebuilds),
//!   version [`engine::PROTOCOL_VERSION`].
//! - [`frames`]: the replica data stream as fixed binary frames on plain TCP (no HTTP/2),
//!   version [`frames::VERSION`]; same semantics as the gRPC `Data` stream, and the one
//!   request and response type both transports decode into.
//! - [`auth`]: how an engine proves it holds its volume's secret at the replica ports.
//! - [`tls`]: TLS on the replica ports, an option.
//! - [`ids`]: replica ids and request ids.
//! - [`numbers`]: generations, epochs and flush numbers, with the checks every value from
//!   the wire goes through.
//! - [`sums`]: the CRC32C block checksums that writes carry and replicas store.
//! - [`csi`]: the Container Storage Interface v1.12 (package `csi.v1`), vendored unchanged,
//!   which the `zebu-csi` plugin serves.
//!
//! ```
//! use zebu_proto::replica::{DataRequest, data_request::Op, ReadOp};
//! let req = DataRequest { id: 7, op: Some(Op::Read(ReadOp { offset: 0, length: 4096 })) };
//! assert_eq!(req.id, 7);
//! ```

pub mod auth;
pub mod frames;
pub mod ids;
pub mod numbers;
pub mod sums;
pub mod tls;

/// The replica protocol (package `zebu.replica.v1`).
pub mod replica {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("zebu.replica.v1");

    /// The version this build speaks; see the changelog at the top of `replica.proto`.
    pub const PROTOCOL_VERSION: u32 = 4;
    /// The oldest version of a gRPC data hello this build accepts.
    pub const MIN_PROTOCOL_VERSION: u32 = 1;
    /// The largest gRPC message either side sends or accepts.
    pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
    /// The most one read or write on the data stream moves; engines split larger I/O. Leaves
    /// room below [`MAX_MESSAGE_BYTES`] for the message framing.
    pub const MAX_IO_BYTES: u64 = 8 << 20;
}

/// The engine control protocol (package `zebu.engine.v1`).
pub mod engine {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("zebu.engine.v1");

    /// The version this build speaks; see the changelog at the top of `engine.proto`.
    pub const PROTOCOL_VERSION: u32 = 3;
}

/// The Container Storage Interface, v1.12.0 (package `csi.v1`; `proto/csi.proto`).
pub mod csi {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("csi.v1");

    /// The CSI spec version this build serves.
    pub const SPEC_VERSION: &str = "1.12.0";
}
