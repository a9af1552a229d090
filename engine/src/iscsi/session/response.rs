//! Answers to SCSI commands: Data-In cut by the initiator's MaxRecvDataSegmentLength and
//! MaxBurstLength, with the status in the last PDU when the command succeeded, or a SCSI
//! Response with sense data; residual counts against the expected transfer length.

use bytes::Bytes;

use super::{Cmd, LUN1, Session, Sn};
use crate::iscsi::Target;
use crate::iscsi::pdu::{Bhs, COPY_MAX, RESERVED_TAG, op};
use crate::iscsi::scsi::Reply;
use crate::iscsi::sense::{Sense, status};

impl Session<'_> {
    /// Queues Data-In (status in the last PDU when the command succeeded) and/or a SCSI
    /// Response.
    pub(super) fn respond(&mut self, cmd: &Cmd, reply: Reply) {
        let edtl = u64::from(cmd.edtl);
        let (res_flags, res_count) = residual(reply.transfer_len, edtl);
        let data = &reply.data[..reply.data.len().min(cmd.edtl as usize)];
        let mut data_sn = 0u32;
        if !data.is_empty() {
            let seg = self.params.initiator_mrdsl as usize;
            let burst = self.params.max_burst as usize;
            let with_status = reply.status == status::GOOD;
            let mut off = 0usize;
            while off < data.len() {
                let n = seg.min(data.len() - off).min(burst - off % burst);
                let last = off + n == data.len();
                let mut b = Bhs::new(op::DATA_IN);
                let mut flags = 0u8;
                if last || (off + n).is_multiple_of(burst) {
                    flags |= 0x80;
                }
                let sn = if last && with_status {
                    flags |= 0x01 | res_flags;
                    b.0[3] = reply.status;
                    b.set_u32(44, res_count);
                    Sn::Advance
                } else {
                    Sn::Reserved
                };
                b.0[1] = flags;
                b.set_itt(cmd.itt);
                b.set_u32(20, RESERVED_TAG);
                b.set_u32(36, data_sn);
                b.set_u32(40, off as u32);
                b.set_data_len(n);
                if n <= COPY_MAX {
                    self.send_copy(b, &data[off..off + n], sn);
                } else {
                    self.send(b, &reply.data.slice(off..off + n), sn);
                }
                data_sn += 1;
                off += n;
            }
            if with_status {
                return;
            }
        }
        let mut b = Bhs::new(op::SCSI_RESP);
        b.0[1] = 0x80 | res_flags;
        b.0[3] = reply.status;
        b.set_itt(cmd.itt);
        b.set_u32(36, data_sn);
        b.set_u32(44, res_count);
        match reply.sense {
            Some(s) => {
                // Sense data is preceded by its length (RFC 7143 §11.4.7.2).
                let sense = s.fixed();
                let mut payload = [0u8; 2 + 18];
                payload[..2].copy_from_slice(&(sense.len() as u16).to_be_bytes());
                payload[2..].copy_from_slice(&sense);
                b.set_data_len(payload.len());
                self.send_copy(b, &payload, Sn::Advance);
            }
            None => self.send_copy(b, &[], Sn::Advance),
        }
    }
}

pub(super) async fn execute(target: &Target, cmd: &Cmd, data: Bytes) -> Reply {
    let lun = &target.lun;
    if cmd.lun == LUN1 {
        return lun.execute(&cmd.cdb, data).await;
    }
    match cmd.cdb[0] {
        // REPORT LUNS and REQUEST SENSE work on any LUN; INQUIRY reports "no LU here".
        0xa0 | 0x03 => lun.execute(&cmd.cdb, data).await,
        0x12 => {
            let mut r = lun.execute(&cmd.cdb, data).await;
            if r.status == status::GOOD && !r.data.is_empty() && cmd.cdb[1] & 1 == 0 {
                let mut d = r.data.to_vec();
                d[0] = 0x7f;
                r.data = Bytes::from(d);
            }
            r
        }
        _ => Reply::check(Sense::LUN_NOT_SUPPORTED),
    }
}

/// Residual flags (byte 1 of SCSI Response / Data-In) and count.
fn residual(transfer_len: u64, edtl: u64) -> (u8, u32) {
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    if transfer_len > edtl {
        (0x04, clamp(transfer_len - edtl))
    } else if transfer_len < edtl {
        (0x02, clamp(edtl - transfer_len))
    } else {
        (0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residuals() {
        assert_eq!(residual(512, 0), (0x04, 512));
        assert_eq!(residual(512, 10000), (0x02, 9488));
        assert_eq!(residual(512, 512), (0, 0));
    }
}
