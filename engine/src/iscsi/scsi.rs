//! SCSI command execution (SPC-4 / SBC-3) against a [`BlockDevice`].
//!
//! The LU has 512-byte logical blocks grouped in 4096-byte physical blocks. [`Lun::execute`]
//! takes a CDB plus whatever Data-Out the initiator sent and returns a [`Reply`]: status,
//! optional sense, Data-In bytes, and the SCSI transfer length the CDB described. The
//! iSCSI layer compares that length with the Expected Data Transfer Length to report
//! residuals, so commands here never need to know about iSCSI.
//!
//! Writes move `min(CDB length, Data-Out received)` rounded down to whole blocks: this is what
//! SAM requires when the initiator's expected length disagrees with the CDB.

use std::sync::Arc;

use bytes::Bytes;

use super::pages::{self, Identity};
use super::sense::{Sense, status};
use crate::blockdev::{BlockDevice, BlockError};

pub const BLOCK_SIZE: u64 = 512;
/// Logical blocks per physical block exponent: 8 × 512 = 4096.
pub const LBPPBE: u8 = 3;
pub const MAX_TRANSFER_BLOCKS: u32 = 16384;
pub const OPTIMAL_TRANSFER_BLOCKS: u32 = 2048;
pub const MAX_UNMAP_BLOCKS: u32 = 0x0010_0000;
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// Below 65536 so a WRITE SAME never implies more than 32 MiB of zeroing per command.
pub const MAX_WRITE_SAME_BLOCKS: u64 = 0xffff;
/// Largest Data-Out the iSCSI layer collects for one command.
pub const MAX_DATA_OUT: u64 = MAX_TRANSFER_BLOCKS as u64 * BLOCK_SIZE;
/// WRITE SAME writes its pattern in chunks of this many blocks (1 MiB), so its memory does
/// not grow with the range.
const WRITE_SAME_CHUNK_BLOCKS: u64 = 2048;

/// The most memory a command's execution holds beyond its Data-Out, from its CDB alone:
/// the data a READ makes the device return (whatever the initiator's expected length; a
/// READ over the transfer limit is refused before reading) and the pattern buffer of a
/// WRITE SAME. Other commands hold at most a page or two. The iSCSI layer charges this
/// against its response budget before the command starts.
pub fn buffer_bytes(cdb: &[u8; 16]) -> u64 {
    match cdb[0] {
        0x08 | 0x28 | 0xa8 | 0x88 => (decode_rw(cdb).blocks * BLOCK_SIZE).min(MAX_DATA_OUT),
        0x41 => be(&cdb[7..9]).min(WRITE_SAME_CHUNK_BLOCKS) * BLOCK_SIZE,
        0x93 => be(&cdb[10..14]).min(WRITE_SAME_CHUNK_BLOCKS) * BLOCK_SIZE,
        _ => 0,
    }
}

/// The result of one command.
#[derive(Debug)]
pub struct Reply {
    pub status: u8,
    pub sense: Option<Sense>,
    /// Data-In, at most the transfer length the CDB asked for.
    pub data: Bytes,
    /// Bytes the CDB asked to transfer (in either direction), for residual accounting.
    pub transfer_len: u64,
}

impl Reply {
    fn good() -> Reply {
        Reply {
            status: status::GOOD,
            sense: None,
            data: Bytes::new(),
            transfer_len: 0,
        }
    }
    fn data(d: Vec<u8>, alloc: u64) -> Reply {
        let mut d = d;
        d.truncate(usize::try_from(alloc).unwrap_or(usize::MAX));
        Reply {
            status: status::GOOD,
            transfer_len: d.len() as u64,
            sense: None,
            data: Bytes::from(d),
        }
    }
    /// A status without sense data or Data-In (e.g. TASK SET FULL).
    pub fn status_only(status: u8) -> Reply {
        Reply {
            status,
            sense: None,
            data: Bytes::new(),
            transfer_len: 0,
        }
    }
    pub fn check(sense: Sense) -> Reply {
        Reply {
            status: status::CHECK_CONDITION,
            sense: Some(sense),
            data: Bytes::new(),
            transfer_len: 0,
        }
    }
    fn with_len(mut self, transfer_len: u64) -> Reply {
        self.transfer_len = transfer_len;
        self
    }
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x))
}

/// A block read or write decoded from any of the 6/10/12/16-byte CDB forms.
struct Rw {
    lba: u64,
    blocks: u64,
    fua: bool,
    protect: u8,
}

fn decode_rw(cdb: &[u8]) -> Rw {
    match cdb[0] {
        0x08 | 0x0a => {
            let blocks = u64::from(cdb[4]);
            Rw {
                lba: be(&cdb[1..4]) & 0x1f_ffff,
                // A 6-byte transfer length of 0 means 256 blocks.
                blocks: if blocks == 0 { 256 } else { blocks },
                fua: false,
                protect: 0,
            }
        }
        0x28 | 0x2a | 0x2e | 0x2f | 0x34 | 0x35 => Rw {
            lba: be(&cdb[2..6]),
            blocks: be(&cdb[7..9]),
            fua: cdb[1] & 0x08 != 0,
            protect: cdb[1] >> 5,
        },
        0xa8 | 0xaa | 0xae | 0xaf => Rw {
            lba: be(&cdb[2..6]),
            blocks: be(&cdb[6..10]),
            fua: cdb[1] & 0x08 != 0,
            protect: cdb[1] >> 5,
        },
        _ => Rw {
            lba: be(&cdb[2..10]),
            blocks: be(&cdb[10..14]),
            fua: cdb[1] & 0x08 != 0,
            protect: cdb[1] >> 5,
        },
    }
}

fn map_err(e: &BlockError, write: bool) -> Sense {
    match e {
        BlockError::OutOfRange { .. } => Sense::LBA_OUT_OF_RANGE,
        BlockError::NoSpace(_) => Sense::SPACE_ALLOCATION_FAILED,
        BlockError::Unavailable(_) => Sense::NOT_READY_INTERVENTION,
        BlockError::Io(_) if write => Sense::WRITE_ERROR,
        BlockError::Io(_) => Sense::READ_ERROR,
        BlockError::Medium { .. } => Sense::READ_ERROR,
    }
}

/// The single logical unit a target exports.
pub struct Lun {
    dev: Arc<dyn BlockDevice>,
    pub id: Identity,
}

impl Lun {
    pub fn new(dev: Arc<dyn BlockDevice>, id: Identity) -> Lun {
        Lun { dev, id }
    }

    pub fn blocks(&self) -> u64 {
        self.dev.size() / BLOCK_SIZE
    }

    fn check_range(&self, lba: u64, blocks: u64) -> Result<(), Sense> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.blocks() => Ok(()),
            _ => Err(Sense::LBA_OUT_OF_RANGE),
        }
    }

    /// Runs one command. `data_out` is the Data-Out the initiator sent (possibly shorter or
    /// longer than the CDB implies).
    pub async fn execute(&self, cdb: &[u8; 16], data_out: Bytes) -> Reply {
        match self.dispatch(cdb, data_out).await {
            Ok(r) => r,
            Err(sense) => Reply::check(sense),
        }
    }

    async fn dispatch(&self, cdb: &[u8; 16], data_out: Bytes) -> Result<Reply, Sense> {
        let op = cdb[0];
        match op {
            0x00 | 0x1b | 0x1e => Ok(Reply::good()), // TEST UNIT READY, START STOP, PREVENT ALLOW
            0x03 => {
                let desc = cdb[1] & 0x01 != 0;
                let none = Sense {
                    key: 0,
                    asc: 0,
                    ascq: 0,
                };
                let d = if desc {
                    none.descriptor().to_vec()
                } else {
                    none.fixed().to_vec()
                };
                Ok(Reply::data(d, u64::from(cdb[4])))
            }
            0x12 => self.inquiry(cdb),
            0x1a | 0x5a => {
                let ten = op == 0x5a;
                let alloc = if ten {
                    be(&cdb[7..9])
                } else {
                    u64::from(cdb[4])
                };
                Ok(Reply::data(
                    pages::mode_sense(cdb, ten, self.blocks())?,
                    alloc,
                ))
            }
            0x15 | 0x55 => {
                // Accepted and ignored: no page we report is changeable.
                let len = if op == 0x55 {
                    be(&cdb[7..9])
                } else {
                    u64::from(cdb[4])
                };
                Ok(Reply::good().with_len(len))
            }
            0x25 => Ok(Reply::data(pages::read_capacity10(self.blocks()), 8)),
            0x9e => match cdb[1] & 0x1f {
                0x10 => Ok(Reply::data(
                    pages::read_capacity16(self.blocks()),
                    be(&cdb[10..14]),
                )),
                0x12 => self.get_lba_status(cdb),
                _ => Err(Sense::INVALID_FIELD_IN_CDB),
            },
            0xa0 => {
                let alloc = be(&cdb[6..10]);
                if alloc < 16 {
                    return Err(Sense::INVALID_FIELD_IN_CDB);
                }
                Ok(Reply::data(pages::report_luns(), alloc))
            }
            0xa3 if cdb[1] & 0x1f == 0x0c => Ok(Reply::data(
                pages::report_supported_opcodes(cdb)?,
                be(&cdb[6..10]),
            )),
            0x08 | 0x28 | 0xa8 | 0x88 => self.read(cdb).await,
            0x0a | 0x2a | 0xaa | 0x8a | 0x2e | 0xae | 0x8e => self.write(cdb, data_out).await,
            0x2f | 0xaf | 0x8f => self.verify(cdb, data_out).await,
            0x34 | 0x90 => {
                let rw = decode_rw(cdb);
                self.check_range(rw.lba, rw.blocks)?;
                Ok(Reply::good())
            }
            0x35 | 0x91 => {
                let rw = decode_rw(cdb);
                self.check_range(rw.lba, rw.blocks)?;
                self.dev.flush().await.map_err(|e| map_err(&e, true))?;
                Ok(Reply::good())
            }
            0x41 | 0x93 => self.write_same(cdb, data_out).await,
            0x42 => self.unmap(cdb, data_out).await,
            0x5e => persistent_reserve_in(cdb),
            _ => Err(Sense::INVALID_OPCODE),
        }
    }

    fn inquiry(&self, cdb: &[u8; 16]) -> Result<Reply, Sense> {
        let alloc = be(&cdb[3..5]);
        if cdb[1] & 0x01 == 0 {
            if cdb[2] != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB);
            }
            return Ok(Reply::data(pages::standard_inquiry(), alloc));
        }
        match pages::vpd(cdb[2], &self.id) {
            Some(d) => Ok(Reply::data(d, alloc)),
            None => Err(Sense::INVALID_FIELD_IN_CDB),
        }
    }

    fn get_lba_status(&self, cdb: &[u8; 16]) -> Result<Reply, Sense> {
        let lba = be(&cdb[2..10]);
        let alloc = be(&cdb[10..14]);
        if lba >= self.blocks() {
            return Err(Sense::LBA_OUT_OF_RANGE);
        }
        // We do not track allocation; report everything from `lba` on as mapped.
        let count = u32::try_from(self.blocks() - lba).unwrap_or(u32::MAX);
        let mut d = vec![0u8; 24];
        d[0..4].copy_from_slice(&20u32.to_be_bytes());
        d[8..16].copy_from_slice(&lba.to_be_bytes());
        d[16..20].copy_from_slice(&count.to_be_bytes());
        Ok(Reply::data(d, alloc))
    }

    fn check_rw(&self, rw: &Rw) -> Result<(), Sense> {
        if rw.protect != 0 {
            // No protection information on this LU.
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        self.check_range(rw.lba, rw.blocks)?;
        if rw.blocks > u64::from(MAX_TRANSFER_BLOCKS) {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        Ok(())
    }

    async fn read(&self, cdb: &[u8; 16]) -> Result<Reply, Sense> {
        let rw = decode_rw(cdb);
        self.check_rw(&rw)?;
        if rw.blocks == 0 {
            return Ok(Reply::good());
        }
        let data = self
            .dev
            .read(rw.lba * BLOCK_SIZE, rw.blocks * BLOCK_SIZE)
            .await
            .map_err(|e| map_err(&e, false))?;
        Ok(Reply {
            status: status::GOOD,
            sense: None,
            transfer_len: rw.blocks * BLOCK_SIZE,
            data,
        })
    }

    async fn write(&self, cdb: &[u8; 16], data_out: Bytes) -> Result<Reply, Sense> {
        let rw = decode_rw(cdb);
        self.check_rw(&rw)?;
        let want = rw.blocks * BLOCK_SIZE;
        let moved = want.min(data_out.len() as u64) / BLOCK_SIZE * BLOCK_SIZE;
        if moved > 0 {
            let data = data_out.slice(..moved as usize);
            let offset = rw.lba * BLOCK_SIZE;
            // FUA: durable when answered; the device does the write and its flush together.
            let done = if rw.fua {
                self.dev.write_fua(offset, data).await
            } else {
                self.dev.write(offset, data).await
            };
            done.map_err(|e| map_err(&e, true))?;
        }
        Ok(Reply::good().with_len(want))
    }

    async fn verify(&self, cdb: &[u8; 16], data_out: Bytes) -> Result<Reply, Sense> {
        let rw = decode_rw(cdb);
        self.check_rw(&rw)?;
        let bytchk = (cdb[1] >> 1) & 0x03;
        match bytchk {
            0 => Ok(Reply::good()),
            1 => {
                let want = rw.blocks * BLOCK_SIZE;
                if rw.blocks == 0 {
                    return Ok(Reply::good());
                }
                let n = want.min(data_out.len() as u64);
                let have = self
                    .dev
                    .read(rw.lba * BLOCK_SIZE, n)
                    .await
                    .map_err(|e| map_err(&e, false))?;
                if have[..] != data_out[..n as usize] {
                    return Ok(Reply::check(Sense::MISCOMPARE_DURING_VERIFY).with_len(want));
                }
                Ok(Reply::good().with_len(want))
            }
            _ => Err(Sense::INVALID_FIELD_IN_CDB),
        }
    }

    async fn write_same(&self, cdb: &[u8; 16], data_out: Bytes) -> Result<Reply, Sense> {
        let sixteen = cdb[0] == 0x93;
        let (lba, blocks) = if sixteen {
            (be(&cdb[2..10]), be(&cdb[10..14]))
        } else {
            (be(&cdb[2..6]), be(&cdb[7..9]))
        };
        let unmap = cdb[1] & 0x08 != 0;
        let ndob = sixteen && cdb[1] & 0x01 != 0;
        if cdb[1] >> 5 != 0 || cdb[1] & 0x10 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB); // WRPROTECT or ANCHOR
        }
        let transfer_len = if ndob { 0 } else { BLOCK_SIZE };
        if blocks == 0 || blocks > MAX_WRITE_SAME_BLOCKS {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        self.check_range(lba, blocks)?;
        let block = if ndob {
            Bytes::from(vec![0u8; BLOCK_SIZE as usize])
        } else if data_out.len() as u64 != BLOCK_SIZE {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        } else {
            data_out.slice(..BLOCK_SIZE as usize)
        };
        let zero = block.iter().all(|b| *b == 0);
        if unmap && zero {
            // LBPRZ=1: unmapped blocks read back as zeros, which is what was asked for.
            self.dev
                .unmap(lba * BLOCK_SIZE, blocks * BLOCK_SIZE)
                .await
                .map_err(|e| map_err(&e, true))?;
            return Ok(Reply::good().with_len(transfer_len));
        }
        // Write the pattern in chunks of up to 1 MiB so memory stays bounded.
        let chunk_blocks = blocks.min(WRITE_SAME_CHUNK_BLOCKS);
        let mut chunk = Vec::with_capacity((chunk_blocks * BLOCK_SIZE) as usize);
        for _ in 0..chunk_blocks {
            chunk.extend_from_slice(&block);
        }
        let chunk = Bytes::from(chunk);
        let mut done = 0;
        while done < blocks {
            let n = (blocks - done).min(WRITE_SAME_CHUNK_BLOCKS);
            self.dev
                .write(
                    (lba + done) * BLOCK_SIZE,
                    chunk.slice(..(n * BLOCK_SIZE) as usize),
                )
                .await
                .map_err(|e| map_err(&e, true))?;
            done += n;
        }
        Ok(Reply::good().with_len(transfer_len))
    }

    async fn unmap(&self, cdb: &[u8; 16], data_out: Bytes) -> Result<Reply, Sense> {
        let param_len = be(&cdb[7..9]);
        if cdb[1] & 0x01 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB); // ANCHOR
        }
        if param_len == 0 {
            return Ok(Reply::good());
        }
        let p = &data_out[..data_out.len().min(param_len as usize)];
        if p.len() < 8 {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        let desc_len = be(&p[2..4]) as usize;
        let descs = &p[8..(8 + desc_len).min(p.len())];
        if descs.len() / 16 > MAX_UNMAP_DESCRIPTORS as usize {
            return Err(Sense::INVALID_FIELD_IN_PARAM_LIST);
        }
        let mut ranges = Vec::with_capacity(descs.len() / 16);
        for d in descs.chunks_exact(16) {
            let lba = be(&d[0..8]);
            let blocks = be(&d[8..12]);
            if blocks > u64::from(MAX_UNMAP_BLOCKS) {
                return Err(Sense::INVALID_FIELD_IN_PARAM_LIST);
            }
            self.check_range(lba, blocks)?;
            ranges.push((lba, blocks));
        }
        for (lba, blocks) in ranges {
            if blocks > 0 {
                self.dev
                    .unmap(lba * BLOCK_SIZE, blocks * BLOCK_SIZE)
                    .await
                    .map_err(|e| map_err(&e, true))?;
            }
        }
        Ok(Reply::good().with_len(param_len))
    }
}

/// PERSISTENT RESERVE IN: we keep no registrations or reservations, and say so.
fn persistent_reserve_in(cdb: &[u8; 16]) -> Result<Reply, Sense> {
    let alloc = be(&cdb[7..9]);
    let d = match cdb[1] & 0x1f {
        // READ KEYS, READ RESERVATION, READ FULL STATUS: generation 0, empty list.
        0 | 1 | 3 => vec![0u8; 8],
        // REPORT CAPABILITIES: length 8, no capabilities.
        2 => vec![0, 8, 0, 0, 0, 0, 0, 0],
        _ => return Err(Sense::INVALID_FIELD_IN_CDB),
    };
    Ok(Reply::data(d, alloc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockdev::MemDevice;

    fn lun() -> Lun {
        Lun::new(
            Arc::new(MemDevice::new(1 << 20)),
            Identity::new("t", "iqn.2025-01.io.zebu:t"),
        )
    }

    fn cdb(b: &[u8]) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..b.len()].copy_from_slice(b);
        c
    }

    #[tokio::test]
    async fn write_then_read_back() {
        let l = lun();
        let data = Bytes::from(vec![7u8; 1024]);
        let r = l
            .execute(&cdb(&[0x2a, 0, 0, 0, 0, 4, 0, 0, 2, 0]), data.clone())
            .await;
        assert_eq!(r.status, status::GOOD);
        let r = l
            .execute(&cdb(&[0x28, 0, 0, 0, 0, 4, 0, 0, 2, 0]), Bytes::new())
            .await;
        assert_eq!(r.data, data);
    }

    #[tokio::test]
    async fn read_past_end_is_lba_out_of_range() {
        let l = lun();
        let r = l
            .execute(&cdb(&[0x28, 0, 0, 0, 0x07, 0xff, 0, 0, 2, 0]), Bytes::new())
            .await;
        assert_eq!(r.sense, Some(Sense::LBA_OUT_OF_RANGE));
    }

    #[test]
    fn buffer_bytes_follow_the_cdb_not_the_expected_length() {
        // READ(10) of 16384 blocks, READ(16) of 8, one over the limit, a WRITE SAME(10) of
        // 0xffff blocks, a WRITE(10) (its buffer is its Data-Out, charged apart).
        assert_eq!(
            buffer_bytes(&cdb(&[0x28, 0, 0, 0, 0, 0, 0, 0x40, 0])),
            8 << 20
        );
        let mut r16 = [0u8; 16];
        r16[0] = 0x88;
        r16[13] = 8;
        assert_eq!(buffer_bytes(&r16), 4096);
        assert_eq!(
            buffer_bytes(&cdb(&[0x28, 0, 0, 0, 0, 0, 0, 0xff, 0xff])),
            MAX_DATA_OUT
        );
        assert_eq!(
            buffer_bytes(&cdb(&[0x41, 0, 0, 0, 0, 0, 0, 0xff, 0xff])),
            1 << 20
        );
        assert_eq!(buffer_bytes(&cdb(&[0x2a, 0, 0, 0, 0, 0, 0, 0x40, 0])), 0);
    }

    #[tokio::test]
    async fn unknown_opcode_is_invalid_opcode() {
        let r = lun().execute(&cdb(&[0xee]), Bytes::new()).await;
        assert_eq!(r.sense, Some(Sense::INVALID_OPCODE));
    }

    #[tokio::test]
    async fn write_same_unmap_zeroes() {
        let l = lun();
        l.execute(
            &cdb(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0]),
            Bytes::from(vec![9u8; 512]),
        )
        .await;
        let r = l
            .execute(
                &cdb(&[0x41, 0x08, 0, 0, 0, 0, 0, 0, 1, 0]),
                Bytes::from(vec![0u8; 512]),
            )
            .await;
        assert_eq!(r.status, status::GOOD);
        let r = l
            .execute(&cdb(&[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0]), Bytes::new())
            .await;
        assert!(r.data.iter().all(|b| *b == 0));
    }
}
