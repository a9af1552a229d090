//! Data frames, version 2: the replica data stream of `replica.proto` as fixed binary headers
//! over a plain TCP connection, without HTTP/2 or protobuf.
//!
//! The semantics are exactly those of the gRPC `Data` stream: a hello with the protocol
//! version and the engine's generation, answered once; then requests with ids chosen by the
//! engine (read, write, unmap with `zero_fill`, flush with a flush number), answered in any
//! order with the same id and a [`Status`] plus a message. Frames are served on the replica's
//! gRPC port: the server peeks at the first byte of a connection, and an HTTP/2 client always
//! starts with the preface `PRI * HTTP/2.0`, whose first byte `P` differs from the first byte
//! of [`MAGIC`] (`Z`).
//!
//! # Layout (every integer little-endian)
//!
//! ```text
//! hello, client -> server, once, 16 bytes
//!   0  [u8; 4]  magic "ZBDF"
//!   4  u32      protocol version (1 or 2; see "Versions")
//!   8  u64      generation
//!
//! request header, client -> server, 40 bytes, then `length` payload bytes for a write
//!   0  u8       op: 1 read, 2 write, 3 unmap, 4 flush
//!   1  u8       flags: bit 0 zero_fill (unmap only); other bits must be 0
//!   2  [u8; 6]  reserved, 0
//!   8  u64      id
//!  16  u64      offset (flush: 0)
//!  24  u64      length (read, unmap: the range; write: payload bytes that follow; flush: 0)
//!  32  u64      flush number (flush only: 0 lets the replica pick its own + 1)
//!
//! response header, server -> client, 32 bytes, then `message length` bytes of UTF-8,
//! then `payload length` bytes of read data
//!   0  u8       status: 0 OK, 1 INVALID, 2 IO_ERROR, 3 NO_SPACE, 4 UNAVAILABLE
//!   1  u8       flags: bit 0 END (see below); bit 1 ZEROS (version 2, OK answers only:
//!               the payload is `payload length` zero bytes, and none of them follow);
//!               other bits must be 0
//!   2  u16      reserved, 0
//!   4  u32      message length (<= MAX_MESSAGE_LEN)
//!   8  u64      id (0: the hello's answer, or an END notice)
//!  16  u64      flush number (a flush's answer: the number now durable)
//!  24  u32      payload length (<= MAX_IO_BYTES)
//!  28  u32      reserved, 0
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
//! - 1: the layout above without the ZEROS flag.
//! - 2: a read answer whose data is all zeros because no layer holds it (a hole) may carry
//!   the ZEROS flag instead of its payload: reads of unwritten space cost a header, not
//!   megabytes over the network. A server speaks both and answers a version-1 client with
//!   version-1 frames; a client refused for its version by a version-1 server says hello
//!   again with version 1. The receiver gets its zeros from [`zeros`], one shared buffer
//!   that is never written, so they cost no memory either.
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
//! path; a larger length, an unknown op, non-zero reserved bits or a bad magic cannot be
//! skipped safely and are a [`FrameError`], which ends the connection. Decoding never panics
//! on any input (see the proptests).
//!
//! ```
//! use bytes::BytesMut;
//! use zebu_proto::frames::{Decoded, Request, RequestOp, decode_request};
//! let req = Request { id: 9, op: RequestOp::Read { offset: 4096, length: 4096 } };
//! let mut buf = BytesMut::from(&req.header().encode()[..]);
//! match decode_request(&mut buf).unwrap() {
//!     Decoded::Frame(back) => assert_eq!(back, req),
//!     Decoded::Need(_) => unreachable!(),
//! }
//! ```

use std::fmt;
use std::io::IoSlice;
use std::sync::LazyLock;

use bytes::{Buf, Bytes, BytesMut};

use crate::replica::{MAX_IO_BYTES, MAX_MESSAGE_BYTES, Status};

/// The first bytes of a frames connection. `Z` differs from `P`, the first byte of the
/// HTTP/2 preface, which lets one port serve both.
pub const MAGIC: [u8; 4] = *b"ZBDF";
/// The newest frames protocol version this build speaks (see "Versions" above).
pub const VERSION: u32 = 2;
/// The oldest version this build still speaks.
pub const MIN_VERSION: u32 = 1;
/// The first version with the ZEROS answer flag.
pub const ZEROS_VERSION: u32 = 2;
pub const HELLO_LEN: usize = 16;
pub const REQUEST_HEADER_LEN: usize = 40;
pub const RESPONSE_HEADER_LEN: usize = 32;
/// The longest status message a response may carry; longer ones are cut by the encoder.
pub const MAX_MESSAGE_LEN: usize = 16 << 10;
/// The largest write payload that still frames: as large as a gRPC message may be.
pub const MAX_FRAME_PAYLOAD: u64 = MAX_MESSAGE_BYTES as u64;

const OP_READ: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_UNMAP: u8 = 3;
const OP_FLUSH: u8 = 4;
const REQ_FLAG_ZERO_FILL: u8 = 1;
const RESP_FLAG_END: u8 = 1;
const RESP_FLAG_ZEROS: u8 = 2;

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
}

/// What a decoder got from a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<T> {
    /// One whole frame, removed from the buffer.
    Frame(T),
    /// Not enough bytes yet: the whole frame is this long (counting what is buffered).
    Need(usize),
}

/// The hello a client sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub generation: u64,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b
    }

    /// Decodes a hello; the version is not checked here (the server answers a wrong one).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, FrameError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        Ok(Hello {
            version: u32_at(b, 4),
            generation: u64_at(b, 8),
        })
    }
}

/// One data request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: u64,
    pub op: RequestOp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestOp {
    Read {
        offset: u64,
        length: u64,
    },
    Write {
        offset: u64,
        data: Bytes,
    },
    Unmap {
        offset: u64,
        length: u64,
        zero_fill: bool,
    },
    Flush {
        flush_number: u64,
    },
}

/// A request header as it travels; a write's payload follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: u8,
    pub flags: u8,
    pub id: u64,
    pub offset: u64,
    pub length: u64,
    pub flush_number: u64,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0] = self.op;
        b[1] = self.flags;
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.length.to_le_bytes());
        b[32..40].copy_from_slice(&self.flush_number.to_le_bytes());
        b
    }

    /// Decodes and checks a header: known op, flags valid for it, reserved bytes zero, a
    /// write payload within [`MAX_FRAME_PAYLOAD`].
    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<RequestHeader, FrameError> {
        let h = RequestHeader {
            op: b[0],
            flags: b[1],
            id: u64_at(b, 8),
            offset: u64_at(b, 16),
            length: u64_at(b, 24),
            flush_number: u64_at(b, 32),
        };
        if b[2..8].iter().any(|&x| x != 0) {
            return Err(FrameError::Reserved);
        }
        let allowed = match h.op {
            OP_UNMAP => REQ_FLAG_ZERO_FILL,
            OP_READ | OP_WRITE | OP_FLUSH => 0,
            op => return Err(FrameError::UnknownOp(op)),
        };
        if h.flags & !allowed != 0 {
            return Err(FrameError::BadFlags {
                what: "a request",
                flags: h.flags,
            });
        }
        if h.op == OP_WRITE && h.length > MAX_FRAME_PAYLOAD {
            return Err(FrameError::TooLarge {
                what: "write payload",
                len: h.length,
                max: MAX_FRAME_PAYLOAD,
            });
        }
        Ok(h)
    }

    /// Payload bytes that follow the header.
    /// Whether this is a write, whose `payload_len()` bytes follow the header.
    pub fn is_write(&self) -> bool {
        self.op == OP_WRITE
    }

    pub fn payload_len(&self) -> usize {
        if self.op == OP_WRITE {
            self.length as usize
        } else {
            0
        }
    }
}

impl Request {
    /// The header of this request (a write's length is its payload length).
    pub fn header(&self) -> RequestHeader {
        let mut h = RequestHeader {
            op: 0,
            flags: 0,
            id: self.id,
            offset: 0,
            length: 0,
            flush_number: 0,
        };
        match &self.op {
            RequestOp::Read { offset, length } => {
                (h.op, h.offset, h.length) = (OP_READ, *offset, *length)
            }
            RequestOp::Write { offset, data } => {
                (h.op, h.offset, h.length) = (OP_WRITE, *offset, data.len() as u64)
            }
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            } => {
                (h.op, h.offset, h.length) = (OP_UNMAP, *offset, *length);
                h.flags = if *zero_fill { REQ_FLAG_ZERO_FILL } else { 0 };
            }
            RequestOp::Flush { flush_number } => (h.op, h.flush_number) = (OP_FLUSH, *flush_number),
        }
        h
    }

    /// The write payload, if any.
    pub fn payload(&self) -> Option<&Bytes> {
        match &self.op {
            RequestOp::Write { data, .. } => Some(data),
            _ => None,
        }
    }
}

impl fmt::Display for Request {
    /// The request without its payload, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.op {
            RequestOp::Read { offset, length } => {
                write!(f, "#{} read {offset}+{length}", self.id)
            }
            RequestOp::Write { offset, data } => {
                write!(f, "#{} write {offset}+{}", self.id, data.len())
            }
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            } => write!(
                f,
                "#{} unmap {offset}+{length}{}",
                self.id,
                if *zero_fill { " zero-fill" } else { "" }
            ),
            RequestOp::Flush { flush_number } => write!(f, "#{} flush {flush_number}", self.id),
        }
    }
}

/// Takes one request frame off the front of `buf`, if it is all there.
pub fn decode_request(buf: &mut BytesMut) -> Result<Decoded<Request>, FrameError> {
    let Some(head) = buf.first_chunk::<REQUEST_HEADER_LEN>() else {
        return Ok(Decoded::Need(REQUEST_HEADER_LEN));
    };
    let h = RequestHeader::decode(head)?;
    let total = REQUEST_HEADER_LEN + h.payload_len();
    if buf.len() < total {
        return Ok(Decoded::Need(total));
    }
    buf.advance(REQUEST_HEADER_LEN);
    let op = match h.op {
        OP_READ => RequestOp::Read {
            offset: h.offset,
            length: h.length,
        },
        OP_WRITE => RequestOp::Write {
            offset: h.offset,
            data: buf.split_to(h.payload_len()).freeze(),
        },
        OP_UNMAP => RequestOp::Unmap {
            offset: h.offset,
            length: h.length,
            zero_fill: h.flags & REQ_FLAG_ZERO_FILL != 0,
        },
        _ => RequestOp::Flush {
            flush_number: h.flush_number,
        },
    };
    Ok(Decoded::Frame(Request { id: h.id, op }))
}

/// One answer (or the hello's answer, or an END notice).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub id: u64,
    pub status: Status,
    /// The server ends the connection after this; see the module docs.
    pub end: bool,
    pub message: String,
    pub flush_number: u64,
    /// A read's data; from a ZEROS answer, [`zeros`].
    pub data: Bytes,
}

impl Response {
    pub fn ok(id: u64) -> Response {
        Response {
            id,
            status: Status::Ok,
            end: false,
            message: String::new(),
            flush_number: 0,
            data: Bytes::new(),
        }
    }

    pub fn failed(id: u64, status: Status, message: impl Into<String>) -> Response {
        Response {
            status,
            message: message.into(),
            ..Response::ok(id)
        }
    }

    /// The message as it goes on the wire: cut to [`MAX_MESSAGE_LEN`] on a char boundary.
    pub fn wire_message(&self) -> &str {
        let mut end = self.message.len().min(MAX_MESSAGE_LEN);
        while !self.message.is_char_boundary(end) {
            end -= 1;
        }
        &self.message[..end]
    }

    /// The header of this response.
    pub fn header(&self) -> ResponseHeader {
        ResponseHeader {
            id: self.id,
            status: self.status,
            end: self.end,
            message_len: self.wire_message().len() as u32,
            flush_number: self.flush_number,
            payload_len: self.data.len() as u32,
            zeros: false,
        }
    }
}

impl fmt::Display for Response {
    /// The response without its payload, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}", self.id, self.status.as_str_name())?;
        if self.end {
            f.write_str(" END")?;
        }
        if !self.data.is_empty() {
            write!(f, " {} bytes", self.data.len())?;
        }
        if self.flush_number != 0 {
            write!(f, " flush {}", self.flush_number)?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// A response header as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub id: u64,
    pub status: Status,
    pub end: bool,
    pub message_len: u32,
    pub flush_number: u64,
    pub payload_len: u32,
    /// The payload is `payload_len` zeros that are not sent (version 2).
    pub zeros: bool,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut b = [0u8; RESPONSE_HEADER_LEN];
        b[0] = status_byte(self.status);
        b[1] = (u8::from(self.end) * RESP_FLAG_END) | (u8::from(self.zeros) * RESP_FLAG_ZEROS);
        b[4..8].copy_from_slice(&self.message_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.flush_number.to_le_bytes());
        b[24..28].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<ResponseHeader, FrameError> {
        let status =
            Status::try_from(i32::from(b[0])).map_err(|_| FrameError::UnknownStatus(b[0]))?;
        let zeros = b[1] & RESP_FLAG_ZEROS != 0;
        if b[1] & !(RESP_FLAG_END | RESP_FLAG_ZEROS) != 0 || (zeros && status != Status::Ok) {
            return Err(FrameError::BadFlags {
                what: "a response",
                flags: b[1],
            });
        }
        if b[2..4].iter().chain(&b[28..32]).any(|&x| x != 0) {
            return Err(FrameError::Reserved);
        }
        let h = ResponseHeader {
            id: u64_at(b, 8),
            status,
            end: b[1] & RESP_FLAG_END != 0,
            message_len: u32_at(b, 4),
            flush_number: u64_at(b, 16),
            payload_len: u32_at(b, 24),
            zeros,
        };
        if h.message_len as usize > MAX_MESSAGE_LEN {
            return Err(FrameError::TooLarge {
                what: "message",
                len: u64::from(h.message_len),
                max: MAX_MESSAGE_LEN as u64,
            });
        }
        if u64::from(h.payload_len) > MAX_IO_BYTES {
            return Err(FrameError::TooLarge {
                what: "read payload",
                len: u64::from(h.payload_len),
                max: MAX_IO_BYTES,
            });
        }
        Ok(h)
    }
}

/// Takes one response frame off the front of `buf`, if it is all there.
pub fn decode_response(buf: &mut BytesMut) -> Result<Decoded<Response>, FrameError> {
    let Some(head) = buf.first_chunk::<RESPONSE_HEADER_LEN>() else {
        return Ok(Decoded::Need(RESPONSE_HEADER_LEN));
    };
    let h = ResponseHeader::decode(head)?;
    let (msg_len, data_len) = (h.message_len as usize, h.payload_len as usize);
    let sent_len = if h.zeros { 0 } else { data_len };
    let total = RESPONSE_HEADER_LEN + msg_len + sent_len;
    if buf.len() < total {
        return Ok(Decoded::Need(total));
    }
    buf.advance(RESPONSE_HEADER_LEN);
    // A peer's bad UTF-8 only garbles its own error text; not worth ending the stream.
    let message = String::from_utf8_lossy(&buf[..msg_len]).into_owned();
    buf.advance(msg_len);
    let data = if h.zeros {
        zeros(data_len)
    } else {
        buf.split_to(data_len).freeze()
    };
    Ok(Decoded::Frame(Response {
        id: h.id,
        status: h.status,
        end: h.end,
        message,
        flush_number: h.flush_number,
        data,
    }))
}

/// Payloads at least this long are written from their own buffer (one `IoSlice` each);
/// shorter ones are copied next to their header, where a copy is cheaper than a slice.
pub const GATHER_COPY_LIMIT: usize = 16 << 10;

/// Several encoded frames to send with one vectored write: headers, messages and small
/// payloads in one staging buffer, large payloads referenced without a copy.
#[derive(Default)]
pub struct Batch {
    staged: Vec<u8>,
    /// In order: `Ok(end)` = staged bytes up to `end`; `Err(bytes)` = a payload of its own.
    parts: Vec<Result<usize, Bytes>>,
    frames: usize,
    len: usize,
    /// Send data from [`zeros`] as a ZEROS flag (the peer speaks version 2).
    zeros_as_flag: bool,
}

impl Batch {
    /// A batch for a peer that speaks `version`: from version 2 on, answers whose data came
    /// from [`zeros`] go out as a ZEROS flag without their payload.
    pub fn for_version(version: u32) -> Batch {
        Batch {
            zeros_as_flag: version >= ZEROS_VERSION,
            ..Batch::default()
        }
    }

    pub fn push_request(&mut self, req: &Request) {
        self.stage(&req.header().encode());
        if let Some(data) = req.payload() {
            self.payload(data);
        }
        self.frames += 1;
    }

    pub fn push_response(&mut self, resp: &Response) {
        let mut h = resp.header();
        h.zeros = self.zeros_as_flag && resp.status == Status::Ok && is_zeros(&resp.data);
        self.stage(&h.encode());
        self.stage(resp.wire_message().as_bytes());
        if !h.zeros {
            self.payload(&resp.data);
        }
        self.frames += 1;
    }

    fn stage(&mut self, b: &[u8]) {
        self.staged.extend_from_slice(b);
        self.len += b.len();
    }

    fn payload(&mut self, data: &Bytes) {
        if data.len() < GATHER_COPY_LIMIT {
            self.stage(data);
            return;
        }
        self.parts.push(Ok(self.staged.len()));
        self.parts.push(Err(data.clone()));
        self.len += data.len();
    }

    /// Frames pushed since the last [`Batch::clear`].
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Bytes to send.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slices of every byte to send, in order (at most two per large payload plus one).
    pub fn io_slices(&self) -> Vec<IoSlice<'_>> {
        let mut out = Vec::with_capacity(self.parts.len() + 1);
        let mut from = 0;
        for part in &self.parts {
            match part {
                Ok(end) => {
                    if *end > from {
                        out.push(IoSlice::new(&self.staged[from..*end]));
                    }
                    from = *end;
                }
                Err(data) => out.push(IoSlice::new(data)),
            }
        }
        if self.staged.len() > from {
            out.push(IoSlice::new(&self.staged[from..]));
        }
        out
    }

    /// Writes every byte of the batch to `wr`, with as few vectored writes as it takes.
    pub async fn write_to<W>(&self, wr: &mut W) -> std::io::Result<()>
    where
        W: tokio::io::AsyncWrite + Unpin,
    {
        use tokio::io::AsyncWriteExt;
        let mut slices = self.io_slices();
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let n = wr.write_vectored(rest).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    }

    /// Empties the batch, keeping the staging buffer's capacity.
    pub fn clear(&mut self) {
        self.staged.clear();
        self.parts.clear();
        self.frames = 0;
        self.len = 0;
    }
}

/// A status's wire byte: the proto enum's value (0..=4).
fn status_byte(s: Status) -> u8 {
    match s {
        Status::Ok => 0,
        Status::Invalid => 1,
        Status::IoError => 2,
        Status::NoSpace => 3,
        Status::Unavailable => 4,
    }
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
