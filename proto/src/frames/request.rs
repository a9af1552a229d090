//! Requests: the one request type both transports decode into, and its frame header.

use std::fmt;

use bytes::{Buf, Bytes, BytesMut};

use super::{Decoded, FrameError, MAX_FRAME_PAYLOAD, REQUEST_HEADER_LEN, u64_at};
use crate::ids::RequestId;
use crate::sums::{BlockSums, SUM_BLOCK_U64};

pub(super) const OP_READ: u8 = 1;
pub(super) const OP_WRITE: u8 = 2;
pub(super) const OP_UNMAP: u8 = 3;
pub(super) const OP_FLUSH: u8 = 4;
pub(super) const OP_PING: u8 = 5;
pub(super) const REQ_FLAG_ZERO_FILL: u8 = 1;
pub(super) const REQ_FLAG_SUMS: u8 = 2;
pub(super) const REQ_FLAG_FLUSH: u8 = 4;

/// One data request, whichever transport carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
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
        /// The CRC32C of each 4 KiB block of `data`, when the sender computed them
        /// (version 3); without them the replica sums the data itself.
        sums: Option<BlockSums>,
        /// Version 4: once the write is done, the replica flushes as a [`RequestOp::Flush`]
        /// with this number would (every write completed before, this one with them) and
        /// answers with the number now durable: a FUA write in one round trip.
        flush: Option<u64>,
    },
    Unmap {
        offset: u64,
        length: u64,
        zero_fill: bool,
    },
    Flush {
        flush_number: u64,
    },
    /// Answered OK by a replica that serves requests (version 3).
    Ping,
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
    /// write payload within [`MAX_FRAME_PAYLOAD`], block sums only on whole blocks.
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
            OP_WRITE => REQ_FLAG_SUMS | REQ_FLAG_FLUSH,
            OP_READ | OP_FLUSH | OP_PING => 0,
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
        if h.has_sums() && !h.length.is_multiple_of(SUM_BLOCK_U64) {
            return Err(FrameError::SumsUnaligned { len: h.length });
        }
        Ok(h)
    }

    /// Whether this is a write, whose `payload_len()` bytes follow the header.
    pub fn is_write(&self) -> bool {
        self.op == OP_WRITE
    }

    /// Whether a write's payload starts with block sums.
    pub fn has_sums(&self) -> bool {
        self.op == OP_WRITE && self.flags & REQ_FLAG_SUMS != 0
    }

    /// Bytes of block sums before a write's data.
    pub fn sums_len(&self) -> usize {
        if self.has_sums() {
            (self.length / SUM_BLOCK_U64) as usize * 4
        } else {
            0
        }
    }

    /// Payload bytes that follow the header: a write's sums and data.
    pub fn payload_len(&self) -> usize {
        if self.op == OP_WRITE {
            self.sums_len() + self.length as usize
        } else {
            0
        }
    }

    /// The request, from this header and its whole payload (`sums_len()` bytes of sums,
    /// then the data).
    pub fn into_request(self, sums: Bytes, data: Bytes) -> Request {
        let op = match self.op {
            OP_READ => RequestOp::Read {
                offset: self.offset,
                length: self.length,
            },
            OP_WRITE => RequestOp::Write {
                offset: self.offset,
                data,
                sums: if self.has_sums() {
                    BlockSums::from_wire(sums)
                } else {
                    None
                },
                flush: (self.flags & REQ_FLAG_FLUSH != 0).then_some(self.flush_number),
            },
            OP_UNMAP => RequestOp::Unmap {
                offset: self.offset,
                length: self.length,
                zero_fill: self.flags & REQ_FLAG_ZERO_FILL != 0,
            },
            OP_PING => RequestOp::Ping,
            _ => RequestOp::Flush {
                flush_number: self.flush_number,
            },
        };
        Request {
            id: RequestId(self.id),
            op,
        }
    }
}

impl Request {
    /// The header of this request (a write's length is its data length; its sums, when it
    /// has any, are sent only if they cover the data exactly).
    pub fn header(&self) -> RequestHeader {
        let mut h = RequestHeader {
            op: 0,
            flags: 0,
            id: self.id.0,
            offset: 0,
            length: 0,
            flush_number: 0,
        };
        match &self.op {
            RequestOp::Read { offset, length } => {
                (h.op, h.offset, h.length) = (OP_READ, *offset, *length)
            }
            RequestOp::Write {
                offset,
                data,
                sums,
                flush,
            } => {
                (h.op, h.offset, h.length) = (OP_WRITE, *offset, data.len() as u64);
                if sums_fit(sums.as_ref(), data) {
                    h.flags = REQ_FLAG_SUMS;
                }
                if let Some(n) = flush {
                    h.flags |= REQ_FLAG_FLUSH;
                    h.flush_number = *n;
                }
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
            RequestOp::Ping => h.op = OP_PING,
        }
        h
    }

    /// The write data, if any.
    pub fn payload(&self) -> Option<&Bytes> {
        match &self.op {
            RequestOp::Write { data, .. } => Some(data),
            _ => None,
        }
    }

    /// The write's sums, if it has sums that cover its data exactly.
    pub fn sums(&self) -> Option<&BlockSums> {
        match &self.op {
            RequestOp::Write { data, sums, .. } if sums_fit(sums.as_ref(), data) => sums.as_ref(),
            _ => None,
        }
    }

    /// This request as a peer of `version` receives it: without sums below version 3.
    pub fn for_version(mut self, version: u32) -> Request {
        if version < super::INTEGRITY_VERSION
            && let RequestOp::Write { sums, .. } = &mut self.op
        {
            *sums = None;
        }
        self
    }
}

fn sums_fit(sums: Option<&BlockSums>, data: &Bytes) -> bool {
    sums.is_some_and(|s| {
        data.len().is_multiple_of(crate::sums::SUM_BLOCK)
            && s.len() == data.len() / crate::sums::SUM_BLOCK
    })
}

impl fmt::Display for Request {
    /// The request without its payload, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.op {
            RequestOp::Read { offset, length } => {
                write!(f, "#{} read {offset}+{length}", self.id.0)
            }
            RequestOp::Write {
                offset,
                data,
                sums,
                flush,
            } => {
                write!(f, "#{} write {offset}+{}", self.id.0, data.len())?;
                if sums.is_some() {
                    f.write_str(" with sums")?;
                }
                if let Some(n) = flush {
                    write!(f, " then flush {n}")?;
                }
                Ok(())
            }
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            } => write!(
                f,
                "#{} unmap {offset}+{length}{}",
                self.id.0,
                if *zero_fill { " zero-fill" } else { "" }
            ),
            RequestOp::Flush { flush_number } => write!(f, "#{} flush {flush_number}", self.id.0),
            RequestOp::Ping => write!(f, "#{} ping", self.id.0),
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
    let sums = buf.split_to(h.sums_len()).freeze();
    let data = if h.is_write() {
        buf.split_to(h.length as usize).freeze()
    } else {
        Bytes::new()
    };
    Ok(Decoded::Frame(h.into_request(sums, data)))
}
