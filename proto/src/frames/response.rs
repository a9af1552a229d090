//! Responses: the one answer type both transports encode, and its frame header.

use std::fmt;

use bytes::{Buf, Bytes, BytesMut};

use super::{
    Decoded, FrameError, MAX_CORRUPT, MAX_MESSAGE_LEN, RESPONSE_HEADER_LEN, status_byte, u32_at,
    u64_at, zeros,
};
use crate::ids::RequestId;
use crate::replica::{MAX_IO_BYTES, Status};

pub(super) const RESP_FLAG_END: u8 = 1;
pub(super) const RESP_FLAG_ZEROS: u8 = 2;

/// One answer (or the hello's answer, or an END notice).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub id: RequestId,
    pub status: Status,
    /// The server ends the connection after this; see the module docs.
    pub end: bool,
    pub message: String,
    pub flush_number: u64,
    /// A read's data (also on a CORRUPT answer: the bytes as read); from a ZEROS answer,
    /// [`zeros`]. On an OK hello answer (version 3): the server's hello extensions.
    pub data: Bytes,
    /// CORRUPT answers: the blocks of the read (4 KiB each, counted from its first block)
    /// whose data does not match the checksum the replica stored with it, ascending.
    pub corrupt: Vec<u32>,
}

impl Response {
    pub fn ok(id: RequestId) -> Response {
        Response {
            id,
            status: Status::Ok,
            end: false,
            message: String::new(),
            flush_number: 0,
            data: Bytes::new(),
            corrupt: Vec::new(),
        }
    }

    pub fn failed(id: RequestId, status: Status, message: impl Into<String>) -> Response {
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

    /// The corrupt-block list as it goes on the wire: only on CORRUPT answers, at most
    /// [`MAX_CORRUPT`] entries.
    pub fn wire_corrupt(&self) -> &[u32] {
        if self.status == Status::Corrupt {
            &self.corrupt[..self.corrupt.len().min(MAX_CORRUPT as usize)]
        } else {
            &[]
        }
    }

    /// The header of this response.
    pub fn header(&self) -> ResponseHeader {
        ResponseHeader {
            id: self.id.0,
            status: self.status,
            end: self.end,
            message_len: self.wire_message().len() as u32,
            flush_number: self.flush_number,
            payload_len: self.data.len() as u32,
            zeros: false,
            corrupt_count: self.wire_corrupt().len() as u32,
        }
    }

    /// This answer as a peer of `version` can take it: below version 3 a CORRUPT answer
    /// becomes IO_ERROR (with the same message) and carries neither list nor data.
    pub fn for_version(&self, version: u32) -> Option<Response> {
        if version >= super::INTEGRITY_VERSION || self.status != Status::Corrupt {
            return None;
        }
        Some(Response {
            status: Status::IoError,
            corrupt: Vec::new(),
            data: Bytes::new(),
            ..self.clone()
        })
    }
}

impl fmt::Display for Response {
    /// The response without its payload, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}", self.id.0, self.status.as_str_name())?;
        if self.end {
            f.write_str(" END")?;
        }
        if !self.data.is_empty() {
            write!(f, " {} bytes", self.data.len())?;
        }
        if !self.corrupt.is_empty() {
            write!(f, " {} corrupt blocks", self.corrupt.len())?;
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
    /// Corrupt-block indices after the message (version 3, CORRUPT answers).
    pub corrupt_count: u32,
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
        b[28..32].copy_from_slice(&self.corrupt_count.to_le_bytes());
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
        if b[2..4].iter().any(|&x| x != 0) {
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
            corrupt_count: u32_at(b, 28),
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
        if h.corrupt_count > 0 && status != Status::Corrupt {
            return Err(FrameError::StrayCorruptList {
                status: status.as_str_name(),
            });
        }
        if h.corrupt_count > MAX_CORRUPT {
            return Err(FrameError::TooLarge {
                what: "corrupt-block list",
                len: u64::from(h.corrupt_count),
                max: u64::from(MAX_CORRUPT),
            });
        }
        Ok(h)
    }

    /// Bytes that follow the header on the wire.
    pub fn body_len(&self) -> usize {
        let data = if self.zeros {
            0
        } else {
            self.payload_len as usize
        };
        self.message_len as usize + self.corrupt_count as usize * 4 + data
    }
}

/// Takes one response frame off the front of `buf`, if it is all there.
pub fn decode_response(buf: &mut BytesMut) -> Result<Decoded<Response>, FrameError> {
    let Some(head) = buf.first_chunk::<RESPONSE_HEADER_LEN>() else {
        return Ok(Decoded::Need(RESPONSE_HEADER_LEN));
    };
    let h = ResponseHeader::decode(head)?;
    let total = RESPONSE_HEADER_LEN + h.body_len();
    if buf.len() < total {
        return Ok(Decoded::Need(total));
    }
    buf.advance(RESPONSE_HEADER_LEN);
    let msg_len = h.message_len as usize;
    // A peer's bad UTF-8 only garbles its own error text; not worth ending the stream.
    let message = String::from_utf8_lossy(&buf[..msg_len]).into_owned();
    buf.advance(msg_len);
    let corrupt = (0..h.corrupt_count as usize)
        .map(|i| u32_at(buf, i * 4))
        .collect();
    buf.advance(h.corrupt_count as usize * 4);
    let data = if h.zeros {
        zeros(h.payload_len as usize)
    } else {
        buf.split_to(h.payload_len as usize).freeze()
    };
    Ok(Decoded::Frame(Response {
        id: RequestId(h.id),
        status: h.status,
        end: h.end,
        message,
        flush_number: h.flush_number,
        data,
        corrupt,
    }))
}
