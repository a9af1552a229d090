//! [`Batch`]: several encoded frames sent with one vectored write.

use std::io::IoSlice;

use bytes::Bytes;

use super::{INTEGRITY_VERSION, Request, Response, VERSION, ZEROS_VERSION, is_zeros};
use crate::replica::Status;

/// Payloads at least this long are written from their own buffer (one `IoSlice` each);
/// shorter ones are copied next to their header, where a copy is cheaper than a slice.
pub const GATHER_COPY_LIMIT: usize = 16 << 10;

/// Several encoded frames to send with one vectored write: headers, messages and small
/// payloads in one staging buffer, large payloads referenced without a copy. Frames are
/// encoded for one peer's version: what that version lacks is left out or translated
/// (module docs: "Versions").
pub struct Batch {
    staged: Vec<u8>,
    /// In order: `Ok(end)` = staged bytes up to `end`; `Err(bytes)` = a payload of its own.
    parts: Vec<Result<usize, Bytes>>,
    frames: usize,
    len: usize,
    version: u32,
}

impl Default for Batch {
    /// A batch for a peer of the newest version.
    fn default() -> Batch {
        Batch::for_version(VERSION)
    }
}

impl Batch {
    /// A batch for a peer that speaks `version`: from version 2 on, answers whose data came
    /// from [`super::zeros`] go out as a ZEROS flag without their payload; below version 3,
    /// writes go without block sums and CORRUPT answers as IO_ERROR.
    pub fn for_version(version: u32) -> Batch {
        Batch {
            staged: Vec::new(),
            parts: Vec::new(),
            frames: 0,
            len: 0,
            version,
        }
    }

    pub fn push_request(&mut self, req: &Request) {
        let mut h = req.header();
        let sums = if self.version >= INTEGRITY_VERSION {
            req.sums()
        } else {
            h.flags &= !super::request::REQ_FLAG_SUMS;
            None
        };
        self.stage(&h.encode());
        if let Some(s) = sums {
            self.stage(s.as_bytes());
        }
        if let Some(data) = req.payload() {
            self.payload(data);
        }
        self.frames += 1;
    }

    pub fn push_response(&mut self, resp: &Response) {
        let older = resp.for_version(self.version);
        let resp = older.as_ref().unwrap_or(resp);
        let mut h = resp.header();
        h.zeros =
            self.version >= ZEROS_VERSION && resp.status == Status::Ok && is_zeros(&resp.data);
        self.stage(&h.encode());
        self.stage(resp.wire_message().as_bytes());
        for i in resp.wire_corrupt() {
            self.stage(&i.to_le_bytes());
        }
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
