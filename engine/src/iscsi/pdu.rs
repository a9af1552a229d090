//! iSCSI PDU framing (RFC 7143 §11).
//!
//! Every PDU is a 48-byte Basic Header Segment (BHS), optional Additional Header Segments,
//! an optional CRC32C header digest, a data segment padded to 4 bytes and an optional
//! CRC32C data digest.
//!
//! Input: [`Framing::parse`] cuts the next PDU off the front of a receive buffer (one
//! growing [`BytesMut`], so that many small PDUs arrive with one `read` system call), and
//! hands its data segment on as a zero-copy [`Bytes`] slice of that buffer. [`PduReader`]
//! wraps it for the login phase, which reads one PDU at a time.
//!
//! Output: [`OutQueue`] holds outgoing PDUs in wire order until a vectored write takes
//! them. Headers, padding, digests and data segments up to [`COPY_MAX`] are appended to one
//! contiguous buffer; a larger data segment (the Data-In of a big read) is kept as its own
//! [`Bytes`] and written from there without a copy. Copying 4 KiB is cheaper than a
//! separate iovec plus a reference count, and keeps a batch of small replies in one or two
//! iovecs. [`encode`] is the same encoder for a single PDU.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const BHS_LEN: usize = 48;
/// Tag value meaning "no tag" (ITT of unsolicited NOP-In, TTT when none is needed).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Opcodes (low 6 bits of byte 0).
pub mod op {
    pub const NOP_OUT: u8 = 0x00;
    pub const SCSI_CMD: u8 = 0x01;
    pub const TASK_MGMT: u8 = 0x02;
    pub const LOGIN_REQ: u8 = 0x03;
    pub const TEXT_REQ: u8 = 0x04;
    pub const DATA_OUT: u8 = 0x05;
    pub const LOGOUT_REQ: u8 = 0x06;
    pub const SNACK: u8 = 0x10;
    pub const NOP_IN: u8 = 0x20;
    pub const SCSI_RESP: u8 = 0x21;
    pub const TASK_MGMT_RESP: u8 = 0x22;
    pub const LOGIN_RESP: u8 = 0x23;
    pub const TEXT_RESP: u8 = 0x24;
    pub const DATA_IN: u8 = 0x25;
    pub const LOGOUT_RESP: u8 = 0x26;
    pub const R2T: u8 = 0x31;
    pub const REJECT: u8 = 0x3f;
}

/// Reject reasons (RFC 7143 §11.17.1).
pub mod reject {
    pub const DATA_DIGEST: u8 = 0x02;
    pub const PROTOCOL_ERROR: u8 = 0x04;
    pub const NOT_SUPPORTED: u8 = 0x05;
    pub const INVALID_FIELD: u8 = 0x09;
}

/// Errors while reading a PDU. All of them end the connection except where the caller
/// decides otherwise (a data digest error is reported, not returned, see [`ReadOutcome`]).
#[derive(Debug, thiserror::Error)]
pub enum PduError {
    #[error("connection I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("connection closed in the middle of a PDU ({have} of {want} bytes)")]
    Truncated { have: usize, want: usize },
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data segment of {len} bytes exceeds the negotiated {max}")]
    DataTooLong {
        len: usize,
        max: usize,
        bhs: Box<Bhs>,
    },
}

/// The 48-byte Basic Header Segment with big-endian field accessors.
#[derive(Clone, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bhs(op={:#04x} flags={:#04x} itt={:#x} dlen={})",
            self.opcode(),
            self.flags(),
            self.itt(),
            self.data_len()
        )
    }
}

impl Bhs {
    pub fn new(opcode: u8) -> Bhs {
        let mut b = [0u8; BHS_LEN];
        b[0] = opcode;
        Bhs(b)
    }
    pub fn opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    pub fn ahs_len(&self) -> usize {
        usize::from(self.0[4]) * 4
    }
    pub fn data_len(&self) -> usize {
        (usize::from(self.0[5]) << 16) | (usize::from(self.0[6]) << 8) | usize::from(self.0[7])
    }
    pub fn set_data_len(&mut self, len: usize) {
        debug_assert!(len < 1 << 24);
        self.0[5] = (len >> 16) as u8;
        self.0[6] = (len >> 8) as u8;
        self.0[7] = len as u8;
    }
    pub fn u32_at(&self, off: usize) -> u32 {
        u32::from_be_bytes([
            self.0[off],
            self.0[off + 1],
            self.0[off + 2],
            self.0[off + 3],
        ])
    }
    pub fn set_u32(&mut self, off: usize, v: u32) {
        self.0[off..off + 4].copy_from_slice(&v.to_be_bytes());
    }
    pub fn lun(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[8..16]);
        u64::from_be_bytes(b)
    }
    pub fn set_lun(&mut self, lun: u64) {
        self.0[8..16].copy_from_slice(&lun.to_be_bytes());
    }
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    pub fn set_itt(&mut self, itt: u32) {
        self.set_u32(16, itt)
    }
    /// CmdSN of initiator requests (bytes 24..28).
    pub fn cmd_sn(&self) -> u32 {
        self.u32_at(24)
    }
}

/// A PDU received from the initiator. AHS are kept raw; we support none but must skip them.
#[derive(Debug)]
pub struct Pdu {
    pub bhs: Bhs,
    pub data: Bytes,
}

/// What one call to [`PduReader::read`] produced.
#[derive(Debug)]
pub enum ReadOutcome {
    Pdu(Pdu),
    /// The PDU was framed correctly but its data digest was wrong: the caller rejects it.
    DataDigestError(Bhs),
    /// Orderly end of stream at a PDU boundary.
    Eof,
}

fn pad4(n: usize) -> usize {
    (4 - n % 4) % 4
}

/// A PDU cut off the receive buffer by [`Framing::parse`].
#[derive(Debug)]
pub enum Frame {
    Pdu(Pdu),
    /// The PDU was framed correctly but its data digest was wrong: the caller rejects it.
    DataDigestError(Bhs),
}

/// How PDUs are framed on one connection (negotiated digests, our data segment limit).
#[derive(Clone, Copy, Debug)]
pub struct Framing {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment accepted (our MaxRecvDataSegmentLength, or a login limit).
    pub max_data: usize,
}

impl Framing {
    /// Wire length of the PDU at the front of `buf`, once its BHS is in (None before).
    /// A data segment over the limit is an error: the stream cannot be trusted after it.
    pub fn frame_len(&self, buf: &[u8]) -> Result<Option<usize>, PduError> {
        let Some(head) = buf.get(..BHS_LEN) else {
            return Ok(None);
        };
        let mut bhs = Bhs([0; BHS_LEN]);
        bhs.0.copy_from_slice(head);
        let dlen = bhs.data_len();
        if dlen > self.max_data {
            return Err(PduError::DataTooLong {
                len: dlen,
                max: self.max_data,
                bhs: Box::new(bhs),
            });
        }
        let hd = if self.header_digest { 4 } else { 0 };
        let dd = if self.data_digest && dlen > 0 { 4 } else { 0 };
        Ok(Some(BHS_LEN + bhs.ahs_len() + hd + dlen + pad4(dlen) + dd))
    }

    /// Cuts the next complete PDU off the front of `buf`; None while more bytes are needed
    /// (`buf` is then left as it was).
    pub fn parse(&self, buf: &mut BytesMut) -> Result<Option<Frame>, PduError> {
        let Some(total) = self.frame_len(buf)? else {
            return Ok(None);
        };
        if buf.len() < total {
            return Ok(None);
        }
        let mut bhs = Bhs([0; BHS_LEN]);
        bhs.0.copy_from_slice(&buf[..BHS_LEN]);
        let dlen = bhs.data_len();
        let hdr_end = BHS_LEN + bhs.ahs_len();
        let data_start = hdr_end + if self.header_digest { 4 } else { 0 };
        let frame = &buf[..total];
        if self.header_digest {
            let want = u32::from_le_bytes([
                frame[hdr_end],
                frame[hdr_end + 1],
                frame[hdr_end + 2],
                frame[hdr_end + 3],
            ]);
            if crc32c::crc32c(&frame[..hdr_end]) != want {
                return Err(PduError::HeaderDigest);
            }
        }
        if self.data_digest && dlen > 0 {
            let padded_end = data_start + dlen + pad4(dlen);
            let got = &frame[padded_end..padded_end + 4];
            let want = u32::from_le_bytes([got[0], got[1], got[2], got[3]]);
            if crc32c::crc32c(&frame[data_start..padded_end]) != want {
                buf.advance(total);
                return Ok(Some(Frame::DataDigestError(bhs)));
            }
        }
        // A PDU without data (most commands) is just dropped from the buffer; only a data
        // segment becomes a shared slice of it.
        let data = if dlen == 0 {
            buf.advance(total);
            Bytes::new()
        } else {
            buf.split_to(total)
                .freeze()
                .slice(data_start..data_start + dlen)
        };
        Ok(Some(Frame::Pdu(Pdu { bhs, data })))
    }
}

/// Reads PDUs from a byte stream, one at a time (the login phase).
pub struct PduReader<R> {
    inner: R,
    buf: BytesMut,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment accepted (our MaxRecvDataSegmentLength, or a login limit).
    pub max_data: usize,
}

const READ_CHUNK: usize = 64 * 1024;

impl<R: AsyncRead + Unpin> PduReader<R> {
    pub fn new(inner: R, max_data: usize) -> PduReader<R> {
        PduReader {
            inner,
            buf: BytesMut::with_capacity(READ_CHUNK),
            header_digest: false,
            data_digest: false,
            max_data,
        }
    }

    fn framing(&self) -> Framing {
        Framing {
            header_digest: self.header_digest,
            data_digest: self.data_digest,
            max_data: self.max_data,
        }
    }

    /// Reads the next PDU. Cancel safe: bytes read before a cancellation stay buffered.
    pub async fn read(&mut self) -> Result<ReadOutcome, PduError> {
        let framing = self.framing();
        loop {
            match framing.parse(&mut self.buf)? {
                Some(Frame::Pdu(p)) => return Ok(ReadOutcome::Pdu(p)),
                Some(Frame::DataDigestError(b)) => return Ok(ReadOutcome::DataDigestError(b)),
                None => {}
            }
            let want = framing.frame_len(&self.buf)?.unwrap_or(BHS_LEN);
            self.buf.reserve((want - self.buf.len()).max(READ_CHUNK));
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                if self.buf.is_empty() {
                    return Ok(ReadOutcome::Eof);
                }
                return Err(PduError::Truncated {
                    have: self.buf.len(),
                    want,
                });
            }
        }
    }

    /// The stream and whatever was read past the last PDU returned (an initiator may send
    /// its first commands right behind the last login request).
    pub fn into_inner(self) -> (R, BytesMut) {
        (self.inner, self.buf)
    }
}

/// Data segments up to this size are copied into [`OutQueue`]'s contiguous buffer; larger
/// ones are written from their own [`Bytes`].
pub const COPY_MAX: usize = 4096;

/// Iovecs per vectored write.
pub const MAX_IOVECS: usize = 64;

/// Room the contiguous buffer of [`OutQueue`] grows by.
const TAIL_CHUNK: usize = 16 * 1024;

/// Outgoing PDUs in wire order, waiting for a vectored write (see the module docs).
pub struct OutQueue {
    chunks: VecDeque<Bytes>,
    /// Small pieces not yet sealed into `chunks`.
    tail: BytesMut,
    /// Bytes queued and not yet written.
    pending: usize,
    header_digest: bool,
    data_digest: bool,
}

impl OutQueue {
    pub fn new(header_digest: bool, data_digest: bool) -> OutQueue {
        OutQueue {
            chunks: VecDeque::new(),
            tail: BytesMut::new(),
            pending: 0,
            header_digest,
            data_digest,
        }
    }

    /// Bytes queued and not yet written.
    pub fn pending(&self) -> usize {
        self.pending
    }

    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Queues one PDU whose data segment is shared (written without a copy when large).
    pub fn push(&mut self, bhs: &Bhs, data: &Bytes) {
        self.push_inner(bhs, data, Some(data));
    }

    /// Queues one PDU whose data segment is copied.
    pub fn push_copy(&mut self, bhs: &Bhs, data: &[u8]) {
        self.push_inner(bhs, data, None);
    }

    fn push_inner(&mut self, bhs: &Bhs, data: &[u8], shared: Option<&Bytes>) {
        debug_assert_eq!(bhs.data_len(), data.len());
        if self.tail.capacity() - self.tail.len() < BHS_LEN + 12 + COPY_MAX {
            // Reuses the old allocation when every chunk split off it has been written.
            self.tail.reserve(TAIL_CHUNK);
        }
        self.tail.extend_from_slice(&bhs.0);
        let mut len = BHS_LEN;
        if self.header_digest {
            self.tail
                .extend_from_slice(&crc32c::crc32c(&bhs.0).to_le_bytes());
            len += 4;
        }
        if !data.is_empty() {
            match shared {
                Some(b) if b.len() > COPY_MAX => {
                    self.seal();
                    self.chunks.push_back(b.clone());
                }
                _ => self.tail.extend_from_slice(data),
            }
            let pad = pad4(data.len());
            self.tail.extend_from_slice(&[0u8; 3][..pad]);
            len += data.len() + pad;
            if self.data_digest {
                let crc = crc32c::crc32c_append(crc32c::crc32c(data), &[0u8; 3][..pad]);
                self.tail.extend_from_slice(&crc.to_le_bytes());
                len += 4;
            }
        }
        self.pending += len;
    }

    fn seal(&mut self) {
        if !self.tail.is_empty() {
            self.chunks.push_back(self.tail.split().freeze());
        }
    }

    /// Fills `iov` with the first queued buffers; returns how many it filled.
    pub fn io_slices<'a>(&'a mut self, iov: &mut [IoSlice<'a>]) -> usize {
        self.seal();
        let mut n = 0;
        for (slot, c) in iov.iter_mut().zip(self.chunks.iter()) {
            *slot = IoSlice::new(c);
            n += 1;
        }
        n
    }

    /// Drops the first `n` bytes, which were written.
    pub fn advance(&mut self, n: usize) {
        debug_assert!(n <= self.pending);
        self.pending -= n;
        crate::sockio::consume(&mut self.chunks, n);
    }

    /// Drops everything queued (the socket is gone).
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.tail.clear();
        self.pending = 0;
    }

    fn drain_into(&mut self, out: &mut Vec<Bytes>) {
        self.seal();
        out.extend(self.chunks.drain(..));
        self.pending = 0;
    }
}

/// Appends the wire form of one PDU to `out`, encoded as [`OutQueue`] does; `scratch`
/// lends its allocation to the small parts.
pub fn encode(
    bhs: &Bhs,
    data: &Bytes,
    header_digest: bool,
    data_digest: bool,
    scratch: &mut BytesMut,
    out: &mut Vec<Bytes>,
) {
    let mut q = OutQueue::new(header_digest, data_digest);
    q.tail = std::mem::take(scratch);
    q.push(bhs, data);
    q.drain_into(out);
    *scratch = q.tail;
}

/// Writes all buffers with vectored writes, at most 64 iovecs per system call.
pub async fn write_all_bufs<W: AsyncWrite + Unpin>(
    w: &mut W,
    bufs: &mut Vec<Bytes>,
) -> std::io::Result<()> {
    let mut start = 0;
    while start < bufs.len() {
        let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
        let mut n = 0;
        for b in bufs[start..].iter().take(MAX_IOVECS) {
            slices[n] = IoSlice::new(b);
            n += 1;
        }
        let mut written = w.write_vectored(&slices[..n]).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 {
            let first = &mut bufs[start];
            if written >= first.len() {
                written -= first.len();
                start += 1;
            } else {
                first.advance(written);
                written = 0;
            }
        }
    }
    bufs.clear();
    w.flush().await
}

/// Encodes and writes a single PDU (the login phase).
pub async fn write_pdu<W: AsyncWrite + Unpin>(
    w: &mut W,
    bhs: &Bhs,
    data: &Bytes,
    header_digest: bool,
    data_digest: bool,
) -> std::io::Result<()> {
    let mut scratch = BytesMut::new();
    let mut out = Vec::with_capacity(3);
    encode(
        bhs,
        data,
        header_digest,
        data_digest,
        &mut scratch,
        &mut out,
    );
    write_all_bufs(w, &mut out).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn roundtrip_with_digests_and_padding() {
        let mut bhs = Bhs::new(op::SCSI_CMD);
        bhs.set_itt(7);
        let data = Bytes::from(vec![0xabu8; 1001]);
        bhs.set_data_len(data.len());
        let mut wire = Vec::new();
        write_pdu(&mut wire, &bhs, &data, true, true)
            .await
            .expect("write");
        assert_eq!(wire.len(), 48 + 4 + 1001 + 3 + 4);
        let mut r = PduReader::new(&wire[..], 8192);
        r.header_digest = true;
        r.data_digest = true;
        match r.read().await.expect("read") {
            ReadOutcome::Pdu(p) => {
                assert_eq!(p.bhs.itt(), 7);
                assert_eq!(p.data, data);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(r.read().await.expect("eof"), ReadOutcome::Eof));
    }

    #[tokio::test]
    async fn corrupt_data_digest_is_reported_not_fatal() {
        let mut bhs = Bhs::new(op::NOP_OUT);
        let data = Bytes::from_static(b"ping");
        bhs.set_data_len(4);
        let mut wire = Vec::new();
        write_pdu(&mut wire, &bhs, &data, false, true)
            .await
            .expect("write");
        let n = wire.len();
        wire[n - 1] ^= 1;
        let mut r = PduReader::new(&wire[..], 8192);
        r.data_digest = true;
        assert!(matches!(
            r.read().await.expect("read"),
            ReadOutcome::DataDigestError(_)
        ));
    }

    /// Bytes come out of the queue in order whatever way the writes are cut, `pending`
    /// counts exactly what is left.
    #[test]
    fn out_queue_keeps_wire_order_and_counts_pending_bytes() {
        for (hd, dd) in [(false, false), (true, true)] {
            let pdus: Vec<(Bhs, Bytes)> = [0usize, 5, 4096, 10_000, 3]
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let mut b = Bhs::new(op::DATA_IN);
                    b.set_itt(i as u32);
                    b.set_data_len(n);
                    (b, Bytes::from(vec![i as u8 + 1; n]))
                })
                .collect();
            let mut want = Vec::new();
            let mut q = OutQueue::new(hd, dd);
            for (b, d) in &pdus {
                let mut one = Vec::new();
                encode(b, d, hd, dd, &mut BytesMut::new(), &mut one);
                want.extend(one.concat());
                q.push(b, d);
            }
            assert_eq!(q.pending(), want.len());
            let mut got = Vec::new();
            for cut in [1usize, 47, 100, 5000, 3, usize::MAX] {
                let mut iov = [IoSlice::new(&[]); MAX_IOVECS];
                let n = q.io_slices(&mut iov);
                let mut taken = 0;
                for s in &iov[..n] {
                    let k = s.len().min(cut - taken);
                    got.extend_from_slice(&s[..k]);
                    taken += k;
                    if taken == cut {
                        break;
                    }
                }
                q.advance(taken);
                assert_eq!(q.pending(), want.len() - got.len());
            }
            assert!(q.is_empty());
            assert_eq!(got, want);
        }
    }

    #[tokio::test]
    async fn truncated_header_is_an_error() {
        let wire = [0u8; 20];
        let mut r = PduReader::new(&wire[..], 8192);
        assert!(matches!(r.read().await, Err(PduError::Truncated { .. })));
    }
}
