//! Zebu's wire contracts.
//!
//! Every message between Zebu processes is defined in `proto/*.proto` and generated here:
//! - [`replica`]: engine ⇄ replica (data stream, control and sync RPCs), version
//!   [`replica::PROTOCOL_VERSION`].
//!
//! ```
//! use zebu_proto::replica::{DataRequest, data_request::Op, ReadOp};
//! let req = DataRequest { id: 7, op: Some(Op::Read(ReadOp { offset: 0, length: 4096 })) };
//! assert_eq!(req.id, 7);
//! ```

/// The replica protocol (package `zebu.replica.v1`).
pub mod replica {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("zebu.replica.v1");

    /// The version this build speaks; see the changelog at the top of `replica.proto`.
    pub const PROTOCOL_VERSION: u32 = 1;
}
