//! Data frames, version 3: the replica data stream of `replica.proto` as fixed binary headers
//! over a plain TCP connection, without HTTP/2 or protobuf.
//!
//! The semantics are exactly those of the gRPC `Data` stream: a hello with the protocol
//! version and the engine's generation, answered once; then requests with ids chosen by the
//! engine (read, write, unmap with `zero_fill`, flush with a flush number, ping), answered in
//! any order with the same id and a [`Status`] plus a message. Frames are served on the
//! replica's gRPC port: the server peeks at the first byte of a connection, and an HTTP/2
//! client always starts with the preface `PRI * HTTP/2.0`, whose first byte `P` differs from
//! the first byte of [`MAGIC`] (`Z`).
//!
//! Both transports decode into the same types: a frame becomes a [`Request`] here, and a
//! gRPC `DataRequest` becomes the same [`Request`] through the conversions in `grpc.rs`, so a
//! replica has one request type to execute and one [`Response`] type to answer with.
//!
//! # Layout (every integer little-endian)
//!
//! ```text
//! hello, client -> server, once: 16 bytes, and from version 3 an extension area
//!   0  [u8; 4]  magic "ZBDF"
//!   4  u32      protocol version (1 to 4; see "Versions")
//!   8  u64      generation
//!  16  u32      extension length (version 3; <= MAX_HELLO_EXTENSIONS)
//!  20  ...      extensions (version 3): entries of u16 kind, u16 length, `length` bytes
//!
//! request header, client -> server, 40 bytes, then the payload of a write
//!   0  u8       op: 1 read, 2 write, 3 unmap, 4 flush, 5 ping (version 3)
//!   1  u8       flags: bit 0 zero_fill (unmap only); bit 1 SUMS (write only, version 3);
//!               bit 2 FLUSH (write only, version 4: flush after it); other bits must be 0
//!   2  [u8; 6]  reserved, 0
//!   8  u64      id
//!  16  u64      offset (flush, ping: 0)
//!  24  u64      length (read, unmap: the range; write: data bytes; flush, ping: 0)
//!  32  u64      flush number (a flush, or a write with FLUSH: 0 lets the replica pick its
//!               own + 1; other requests: 0)
//!  a write's payload: with SUMS, length / 4096 u32 CRC32C sums of its 4 KiB blocks (length
//!  must then be a multiple of 4096), then the `length` data bytes
//!
//! response header, server -> client, 32 bytes, then `message length` bytes of UTF-8, then
//! `corrupt count` u32 block indices, then `payload length` bytes of read data
//!   0  u8       status: 0 OK, 1 INVALID, 2 IO_ERROR, 3 NO_SPACE, 4 UNAVAILABLE,
//!               5 CORRUPT (version 3)
//!   1  u8       flags: bit 0 END (see below); bit 1 ZEROS (version 2, OK answers only:
//!               the payload is `payload length` zero bytes, and none of them follow);
//!               other bits must be 0
//!   2  u16      reserved, 0
//!   4  u32      message length (<= MAX_MESSAGE_LEN)
//!   8  u64      id (0: the hello's answer, or an END notice)
//!  16  u64      flush number (a flush's answer: the number now durable)
//!  24  u32      payload length (<= MAX_IO_BYTES)
//!  28  u32      corrupt count (version 3, CORRUPT answers only, <= MAX_CORRUPT; else 0)
//! ```
//!
//! Little-endian because both ends are x86-64 or arm64 in practice, so encoding is a plain
//! store. The hello's answer is a response with id 0: OK, or a refusal (stale generation,
//! closed replica, unsupported version: the status and message say which) after which the
//! server closes the connection. Where the gRPC stream ends with an error status (fenced by a
//! higher generation, replica closed), the server sends a response with the END flag, id 0,
//! a non-OK status and the reason, after the answers of every request already running, and
//! closes the connection; nothing follows an END.
//!
//! # Versions
//!
//! - 1: the layout above without ZEROS, SUMS, CORRUPT, ping or hello extensions.
//! - 2: a read answer whose data is all zeros because no layer holds it (a hole) may carry
//!   the ZEROS flag instead of its payload: reads of unwritten space cost a header, not
//!   megabytes over the network. The receiver gets its zeros from [`zeros`], one shared
//!   buffer that is never written, so they cost no memory either.
//! - 3: block checksums and liveness (issue 17), and room for issue 18 in the hello:
//!   a write may carry the CRC32C of each of its 4 KiB blocks (SUMS), which the replica
//!   stores with the data, so the sum is taken once, where the data comes from, instead of
//!   on every replica; a read whose blocks fail their stored checksums is answered CORRUPT
//!   with the indices of those blocks (relative to the read's first block) and the data as
//!   read, so the engine can take just those blocks from another replica; ping (op 5) is
//!   answered OK by a replica that serves requests, and costs a header each way; the hello
//!   carries an extension area, and an OK hello answer's payload carries the server's
//!   extensions in the same form (see [`Extensions`]).
//! - 4: a write may carry the FLUSH flag: the replica does the write, then flushes as a
//!   flush request with the header's flush number would, and answers once, with the
//!   number now durable in the answer's flush number. A FUA write so costs one round trip.
//!   A client sends it only on a connection whose hello agreed version 4 ([`Batch`] does
//!   not translate it: an older peer refuses the flag and ends the connection, which is
//!   loud, where dropping the flush would be a silent loss).
//!
//! A server speaks every version from [`MIN_VERSION`] to [`VERSION`] and answers a client in
//! the client's version: an older client never sees a ZEROS flag it does not know, and a
//! CORRUPT answer reaches it as IO_ERROR with the same message. A client refused for its
//! version by an older server (the refusal's message names the "protocol version") says hello
//! again one version lower.
//!
//! # Hello extensions
//!
//! An extension is a `kind` (u16) and a value of up to 65,535 bytes; bit 15 of the kind marks
//! it *critical*. A receiver ignores extensions it does not know, except critical ones, which
//! make it refuse the hello (the client asked for something this server cannot give).
//! Kinds 1-0x7fff are the protocol's, given out here with a changelog line; they are how
//! issue 18 adds to version 3 without a version 4:
//!
//! - `0x8001` [`EXT_VOLUME`] (critical): the volume the client serves, as a flags byte
//!   (bit 0: adopt) and the volume uuid in ASCII ([`VolumeClaim`]). A replica that belongs
//!   to another volume refuses the hello (INVALID, naming both uuids) before it looks at the
//!   generation, so nothing is fenced; one that belongs to a volume refuses a hello without
//!   it; one that belongs to none takes the uuid if it is fresh (never a member of an epoch)
//!   or if the client set adopt (an engine sets it only for replicas it lists as current
//!   members: replicas made before volume identity existed). A server that does not know
//!   the kind refuses the hello, because it is critical.
//!
//! A challenge-response (the client's nonce in its hello, the server's nonce and proof in
//! the answer's extensions) is to take further kinds the same way.
//!
//! # The local socket
//!
//! An OK hello answer's message, when not empty, names a Unix socket in the abstract
//! namespace, written `@name`, where the same server serves this protocol (and only this
//! protocol) too. A client on the server's host may say hello there instead and use that
//! connection for its data: it skips the TCP stack, and nothing else changes (the same hello,
//! generation and fencing). A client that cannot connect to it (another host or network
//! namespace: the name is random, so it does not exist there) keeps its TCP connection.
//! Earlier servers send an empty message and earlier clients ignore it, so both versions
//! carry it unchanged.
//!
//! # Limits and malformed input
//!
//! A write payload may be up to [`MAX_FRAME_PAYLOAD`] (the gRPC message limit) so that a
//! write above [`MAX_IO_BYTES`] still frames intact and is answered INVALID, as on the gRPC
//! path; a larger length, an unknown op, non-zero reserved bits, SUMS on a length that is not
//! a multiple of 4096, a bad magic or an oversized hello extension area cannot be skipped
//! safely and are a [`FrameError`], which ends the connection. Decoding never panics on any
//! input (see the proptests).
//!
//! ```
//! use bytes::BytesMut;
//! use zebu_proto::frames::{Decoded, Request, RequestOp, decode_request};
//! use zebu_proto::ids::RequestId;
//! let req = Request { id: RequestId(9), op: RequestOp::Read { offset: 4096, length: 4096 } };
//! let mut buf = BytesMut::from(&req.header().encode()[..]);
//! match decode_request(&mut buf).unwrap() {
//!     Decoded::Frame(back) => assert_eq!(back, req),
//!     Decoded::Need(_) => unreachable!(),
//! }
//! ```

mod batch;
mod grpc;
mod hello;
mod request;
mod response;

pub use batch::{Batch, GATHER_COPY_LIMIT};
pub use grpc::GrpcRequestError;
pub use hello::{
    EXT_VOLUME, EXTENSION_CRITICAL, Extension, Extensions, HELLO_LEN, Hello, MAX_HELLO_EXTENSIONS,
    MAX_VOLUME_UUID, VolumeClaim, decode_hello, valid_volume_uuid,
};
pub use request::{Request, RequestHeader, RequestOp, decode_request};
pub use response::{Response, ResponseHeader, decode_response};

use std::sync::LazyLock;

use bytes::Bytes;

use crate::replica::{MAX_IO_BYTES, MAX_MESSAGE_BYTES, Status};

/// The first bytes of a frames connection. `Z` differs from `P`, the first byte of the
/// HTTP/2 preface, which lets one port serve both.
pub const MAGIC: [u8; 4] = *b"ZBDF";
/// The newest frames protocol version this build speaks (see "Versions" above).
pub const VERSION: u32 = 4;
/// The oldest version this build still speaks.
pub const MIN_VERSION: u32 = 1;
/// The first version with the ZEROS answer flag.
pub const ZEROS_VERSION: u32 = 2;
/// The first version with SUMS, CORRUPT, ping and hello extensions.
pub const INTEGRITY_VERSION: u32 = 3;
/// The first version in which a write may carry FLUSH (a FUA write in one round trip).
pub const FLUSH_WRITE_VERSION: u32 = 4;
pub const REQUEST_HEADER_LEN: usize = 40;
pub const RESPONSE_HEADER_LEN: usize = 32;
/// The longest status message a response may carry; longer ones are cut by the encoder.
pub const MAX_MESSAGE_LEN: usize = 16 << 10;
/// The largest write payload that still frames: as large as a gRPC message may be.
pub const MAX_FRAME_PAYLOAD: u64 = MAX_MESSAGE_BYTES as u64;
/// The most blocks a CORRUPT answer may list: every block of the largest read.
pub const MAX_CORRUPT: u32 = (MAX_IO_BYTES / crate::sums::SUM_BLOCK_U64) as u32;

/// Zeros for holes: [`MAX_IO_BYTES`] of them, allocated once and never written. An
/// allocation this large is a fresh anonymous mapping (the allocator zeroes it by asking the
/// kernel, not by writing), so it costs address space, not memory: reading it maps the
/// kernel's shared zero page. (A `static` array would sit in the binary's read-only data,
/// 8 MiB on disk and in the page cache.)
static ZERO_BYTES: LazyLock<&'static [u8]> =
    LazyLock::new(|| Box::leak(vec![0u8; MAX_IO_BYTES as usize].into_boxed_slice()));

/// `len` zero bytes without allocating (up to [`MAX_IO_BYTES`]; longer ones are allocated).
pub fn zeros(len: usize) -> Bytes {
    match ZERO_BYTES.get(..len) {
        Some(z) => Bytes::from_static(z),
        None => Bytes::from(vec![0u8; len]),
    }
}

/// Whether `b` is (a slice of) what [`zeros`] returns: data known to be zeros without
/// looking at it.
pub fn is_zeros(b: &Bytes) -> bool {
    let z = ZERO_BYTES.as_ptr_range();
    !b.is_empty() && z.contains(&b.as_ptr()) && b.len() <= z.end as usize - b.as_ptr() as usize
}

/// Input that is not a valid frame; the connection that carried it cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?} (not a Zebu data-frames client)")]
    BadMagic([u8; 4]),
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("unknown status {0}")]
    UnknownStatus(u8),
    #[error("unknown flags {flags:#04x} for {what}")]
    BadFlags { what: &'static str, flags: u8 },
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("{what} of {len} bytes is larger than the limit of {max} bytes")]
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("a write of {len} bytes carries block sums, but is not a multiple of 4096 bytes")]
    SumsUnaligned { len: u64 },
    #[error("a corrupt-block list on a {status} answer (only CORRUPT answers carry one)")]
    StrayCorruptList { status: &'static str },
    #[error("malformed hello extensions: {0}")]
    BadExtensions(&'static str),
}

/// What a decoder got from a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<T> {
    /// One whole frame, removed from the buffer.
    Frame(T),
    /// Not enough bytes yet: the whole frame is this long (counting what is buffered).
    Need(usize),
}

/// A status's wire byte: the proto enum's value (0..=5).
fn status_byte(s: Status) -> u8 {
    match s {
        Status::Ok => 0,
        Status::Invalid => 1,
        Status::IoError => 2,
        Status::NoSpace => 3,
        Status::Unavailable => 4,
        Status::Corrupt => 5,
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests;
