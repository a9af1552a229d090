//! Data-In payloads that describe the logical unit: INQUIRY (standard and VPD pages),
//! MODE SENSE pages, READ CAPACITY, REPORT LUNS and REPORT SUPPORTED OPERATION CODES.
//!
//! Everything here is a pure function of the LU's identity and capacity, so it is easy to
//! test; [`super::scsi`] decides which one a CDB asks for and trims to the allocation length.

use super::scsi::{
    BLOCK_SIZE, LBPPBE, MAX_TRANSFER_BLOCKS, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS,
    MAX_WRITE_SAME_BLOCKS, OPTIMAL_TRANSFER_BLOCKS,
};
use super::sense::Sense;

/// Identity of the logical unit, derived from the volume name so it is stable across restarts.
#[derive(Clone, Debug)]
pub struct Identity {
    pub volume: String,
    pub target_iqn: String,
    /// NAA IEEE Registered (type 5) identifier.
    pub naa: [u8; 8],
    pub serial: String,
}

impl Identity {
    pub fn new(volume: &str, target_iqn: &str) -> Identity {
        // FNV-1a over the name: stable, no dependency, and spread enough for an identifier.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in volume.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // NAA 5, then a 24-bit company id (locally chosen), then 36 bits of the hash.
        let v = (5u64 << 60) | (0x00_5a_42u64 << 36) | (h & 0x0f_ffff_ffff);
        Identity {
            volume: volume.to_string(),
            target_iqn: target_iqn.to_string(),
            naa: v.to_be_bytes(),
            serial: format!("{h:016x}"),
        }
    }
}

pub fn standard_inquiry() -> Vec<u8> {
    let mut d = vec![0u8; 96];
    d[0] = 0x00; // connected, direct-access block device
    d[2] = 0x06; // SPC-4
    d[3] = 0x12; // HISUP, response data format 2
    d[4] = (d.len() - 5) as u8;
    d[7] = 0x02; // CMDQUE
    d[8..16].copy_from_slice(b"ZEBU    ");
    d[16..32].copy_from_slice(b"VOLUME          ");
    d[32..36].copy_from_slice(b"0001");
    // Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3.
    for (i, v) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
        d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
    }
    d
}

pub const SUPPORTED_VPD: [u8; 6] = [0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2];

fn vpd_header(page: u8, body: Vec<u8>) -> Vec<u8> {
    let mut d = vec![0x00, page];
    d.extend_from_slice(&(body.len() as u16).to_be_bytes());
    d.extend(body);
    d
}

pub fn vpd(page: u8, id: &Identity) -> Option<Vec<u8>> {
    let body = match page {
        0x00 => SUPPORTED_VPD.to_vec(),
        0x80 => id.serial.as_bytes().to_vec(),
        0x83 => device_identification(id),
        0xb0 => block_limits(),
        0xb1 => {
            let mut b = vec![0u8; 0x3c];
            b[1] = 0x01; // non-rotating medium
            b
        }
        0xb2 => vec![
            0x00,
            0x80 | 0x40 | 0x20 | 0x04, // LBPU, LBPWS, LBPWS10, LBPRZ=1
            0x02,                      // thin provisioned
            0x00,
        ],
        _ => return None,
    };
    Some(vpd_header(page, body))
}

fn designator(out: &mut Vec<u8>, proto_codeset: u8, piv_assoc_type: u8, value: &[u8]) {
    out.extend_from_slice(&[proto_codeset, piv_assoc_type, 0, value.len() as u8]);
    out.extend_from_slice(value);
}

fn device_identification(id: &Identity) -> Vec<u8> {
    let mut b = Vec::new();
    // NAA, binary, associated with the LU.
    designator(&mut b, 0x01, 0x03, &id.naa);
    // T10 vendor id, ASCII: vendor followed by the volume name.
    let mut t10 = b"ZEBU    ".to_vec();
    t10.extend_from_slice(id.volume.as_bytes());
    t10.truncate(250);
    designator(&mut b, 0x02, 0x01, &t10);
    // Relative target port 1, associated with the target port, protocol iSCSI.
    designator(&mut b, 0x51, 0x94, &[0, 0, 0, 1]);
    // Target port group 1 (needed by multipath tools that read ALUA groups).
    designator(&mut b, 0x51, 0x95, &[0, 0, 0, 1]);
    // SCSI name string of the target device: the IQN, NUL padded to a multiple of 4.
    let mut name = id.target_iqn.as_bytes().to_vec();
    name.truncate(220);
    name.push(0);
    while !name.len().is_multiple_of(4) {
        name.push(0);
    }
    designator(&mut b, 0x53, 0xa8, &name);
    b
}

fn block_limits() -> Vec<u8> {
    let mut b = vec![0u8; 0x3c];
    // Offsets below are page offsets minus the 4-byte header.
    b[0] = 0x01; // WSNZ: a zero-length WRITE SAME is an error, never "to the end"
    b[2..4].copy_from_slice(&(1u16 << LBPPBE).to_be_bytes());
    b[4..8].copy_from_slice(&MAX_TRANSFER_BLOCKS.to_be_bytes());
    b[8..12].copy_from_slice(&OPTIMAL_TRANSFER_BLOCKS.to_be_bytes());
    b[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
    b[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
    b[24..28].copy_from_slice(&(1u32 << LBPPBE).to_be_bytes()); // optimal unmap granularity
    b[28..32].copy_from_slice(&0x8000_0000u32.to_be_bytes()); // UGAVALID, alignment 0
    b[32..40].copy_from_slice(&MAX_WRITE_SAME_BLOCKS.to_be_bytes());
    b
}

pub fn read_capacity10(blocks: u64) -> Vec<u8> {
    let last = u32::try_from(blocks.saturating_sub(1)).unwrap_or(u32::MAX);
    let mut d = last.to_be_bytes().to_vec();
    d.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
    d
}

pub fn read_capacity16(blocks: u64) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    d[0..8].copy_from_slice(&blocks.saturating_sub(1).to_be_bytes());
    d[8..12].copy_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
    d[13] = LBPPBE;
    d[14] = 0x80 | 0x40; // LBPME, LBPRZ
    d
}

pub fn report_luns() -> Vec<u8> {
    let mut d = vec![0u8; 16];
    d[3] = 8;
    d[9] = 1; // LUN 1, peripheral device addressing
    d
}

/// Mode page codes we implement, in the order "all pages" returns them.
const MODE_PAGES: [u8; 4] = [0x01, 0x08, 0x0a, 0x1c];

fn mode_page(page: u8, changeable: bool) -> Vec<u8> {
    let mut p = match page {
        0x01 => vec![0u8; 12],
        0x08 => vec![0u8; 20],
        0x0a => vec![0u8; 12],
        _ => vec![0u8; 12],
    };
    p[0] = page;
    p[1] = (p.len() - 2) as u8;
    if changeable {
        return p;
    }
    match page {
        0x08 => p[2] = 0x04, // WCE: writes are acknowledged before SYNCHRONIZE CACHE
        0x0a => {
            p[3] = 0x10; // unrestricted reordering
            p[8] = 0xff; // busy timeout period: unlimited
            p[9] = 0xff;
        }
        _ => {}
    }
    p
}

/// MODE SENSE(6) if `ten` is false, else MODE SENSE(10).
pub fn mode_sense(cdb: &[u8], ten: bool, blocks: u64) -> Result<Vec<u8>, Sense> {
    let dbd = cdb[1] & 0x08 != 0;
    let llbaa = ten && cdb[1] & 0x10 != 0;
    let pc = cdb[2] >> 6;
    let page = cdb[2] & 0x3f;
    let subpage = cdb[3];
    if pc == 3 {
        return Err(Sense::SAVING_PARAMS_UNSUPPORTED);
    }
    let changeable = pc == 1;
    let mut pages = Vec::new();
    if page == 0x3f {
        if subpage != 0 && subpage != 0xff {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        for p in MODE_PAGES {
            pages.extend(mode_page(p, changeable));
        }
    } else if MODE_PAGES.contains(&page) && subpage == 0 {
        pages.extend(mode_page(page, changeable));
    } else {
        return Err(Sense::INVALID_FIELD_IN_CDB);
    }
    let mut bd = Vec::new();
    if !dbd {
        if llbaa {
            bd.extend_from_slice(&blocks.to_be_bytes());
            bd.extend_from_slice(&[0, 0, 0, 0]);
            bd.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
        } else {
            let n = u32::try_from(blocks).ok().filter(|n| *n <= 0x00ff_ffff);
            bd.push(0);
            bd.extend_from_slice(&n.unwrap_or(0x00ff_ffff).to_be_bytes()[1..]);
            bd.push(0);
            bd.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes()[1..]);
        }
    }
    let device_specific = 0x10; // DPOFUA
    let mut d = Vec::new();
    if ten {
        let total = 8 + bd.len() + pages.len();
        d.extend_from_slice(&((total - 2) as u16).to_be_bytes());
        d.extend_from_slice(&[0, device_specific, u8::from(llbaa), 0]);
        d.extend_from_slice(&(bd.len() as u16).to_be_bytes());
    } else {
        let total = 4 + bd.len() + pages.len();
        d.extend_from_slice(&[(total - 1) as u8, 0, device_specific, bd.len() as u8]);
    }
    d.extend(bd);
    d.extend(pages);
    Ok(d)
}

/// One supported command: opcode, service action, and the CDB usage bitmap (SPC-4 6.35.3).
struct OpInfo {
    op: u8,
    sa: Option<u16>,
    usage: &'static [u8],
}

const RW10: [u8; 10] = [0, 0x18, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07];
const RW12: [u8; 12] = [
    0, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0x07,
];
const RW16: [u8; 16] = [
    0, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0x07,
];

macro_rules! with_op {
    ($op:expr, $tmpl:expr) => {{
        const U: [u8; $tmpl.len()] = {
            let mut u = $tmpl;
            u[0] = $op;
            u
        };
        &U
    }};
}

const OPS: &[OpInfo] = &[
    OpInfo {
        op: 0x00,
        sa: None,
        usage: &[0x00, 0, 0, 0, 0, 0x07],
    },
    OpInfo {
        op: 0x03,
        sa: None,
        usage: &[0x03, 0x01, 0, 0, 0xff, 0x07],
    },
    OpInfo {
        op: 0x08,
        sa: None,
        usage: &[0x08, 0x1f, 0xff, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x0a,
        sa: None,
        usage: &[0x0a, 0x1f, 0xff, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x12,
        sa: None,
        usage: &[0x12, 0x01, 0xff, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x15,
        sa: None,
        usage: &[0x15, 0x11, 0, 0, 0xff, 0x07],
    },
    OpInfo {
        op: 0x1a,
        sa: None,
        usage: &[0x1a, 0x08, 0xff, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x1b,
        sa: None,
        usage: &[0x1b, 0x01, 0, 0x0f, 0xf7, 0x07],
    },
    OpInfo {
        op: 0x1e,
        sa: None,
        usage: &[0x1e, 0, 0, 0, 0x03, 0x07],
    },
    OpInfo {
        op: 0x25,
        sa: None,
        usage: &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0x07],
    },
    OpInfo {
        op: 0x28,
        sa: None,
        usage: with_op!(0x28, RW10),
    },
    OpInfo {
        op: 0x2a,
        sa: None,
        usage: with_op!(0x2a, RW10),
    },
    OpInfo {
        op: 0x2e,
        sa: None,
        usage: &[0x2e, 0x12, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x2f,
        sa: None,
        usage: &[0x2f, 0x16, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x34,
        sa: None,
        usage: &[0x34, 0x02, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x35,
        sa: None,
        usage: &[0x35, 0x02, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x41,
        sa: None,
        usage: &[0x41, 0x08, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x42,
        sa: None,
        usage: &[0x42, 0, 0, 0, 0, 0, 0x1f, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x55,
        sa: None,
        usage: &[0x55, 0x11, 0, 0, 0, 0, 0, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x5a,
        sa: None,
        usage: &[0x5a, 0x18, 0xff, 0xff, 0, 0, 0, 0xff, 0xff, 0x07],
    },
    OpInfo {
        op: 0x88,
        sa: None,
        usage: with_op!(0x88, RW16),
    },
    OpInfo {
        op: 0x8a,
        sa: None,
        usage: with_op!(0x8a, RW16),
    },
    OpInfo {
        op: 0x8e,
        sa: None,
        usage: &[
            0x8e, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0x8f,
        sa: None,
        usage: &[
            0x8f, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0x90,
        sa: None,
        usage: &[
            0x90, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0x91,
        sa: None,
        usage: &[
            0x91, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0x93,
        sa: None,
        usage: &[
            0x93, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0x9e,
        sa: Some(0x10),
        usage: &[
            0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0x07,
        ],
    },
    OpInfo {
        op: 0x9e,
        sa: Some(0x12),
        usage: &[
            0x9e, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
            0x07,
        ],
    },
    OpInfo {
        op: 0xa0,
        sa: None,
        usage: &[0xa0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0x07],
    },
    OpInfo {
        op: 0xa3,
        sa: Some(0x0c),
        usage: &[
            0xa3, 0x0c, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0x07,
        ],
    },
    OpInfo {
        op: 0xa8,
        sa: None,
        usage: with_op!(0xa8, RW12),
    },
    OpInfo {
        op: 0xaa,
        sa: None,
        usage: with_op!(0xaa, RW12),
    },
    OpInfo {
        op: 0xae,
        sa: None,
        usage: &[
            0xae, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0x07,
        ],
    },
    OpInfo {
        op: 0xaf,
        sa: None,
        usage: &[
            0xaf, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0x07,
        ],
    },
];

/// Command timeouts descriptor (all zero: no recommendation).
const TIMEOUTS: [u8; 12] = [0, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

/// REPORT SUPPORTED OPERATION CODES (SPC-4 6.35).
pub fn report_supported_opcodes(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    let rctd = cdb[2] & 0x80 != 0;
    let options = cdb[2] & 0x07;
    let req_op = cdb[3];
    let req_sa = u16::from_be_bytes([cdb[4], cdb[5]]);
    let mut d = Vec::new();
    match options {
        0 => {
            d.extend_from_slice(&[0, 0, 0, 0]);
            for o in OPS {
                d.push(o.op);
                d.push(0);
                d.extend_from_slice(&o.sa.unwrap_or(0).to_be_bytes());
                d.push(0);
                d.push(u8::from(o.sa.is_some()) | if rctd { 0x02 } else { 0 });
                d.extend_from_slice(&(o.usage.len() as u16).to_be_bytes());
                if rctd {
                    d.extend_from_slice(&TIMEOUTS);
                }
            }
            let len = (d.len() - 4) as u32;
            d[0..4].copy_from_slice(&len.to_be_bytes());
        }
        1..=3 => {
            let has_sa = OPS.iter().any(|o| o.op == req_op && o.sa.is_some());
            let found = match options {
                1 if has_sa => return Err(Sense::INVALID_FIELD_IN_CDB),
                1 => OPS.iter().find(|o| o.op == req_op && o.sa.is_none()),
                2 if !has_sa && OPS.iter().any(|o| o.op == req_op) => {
                    return Err(Sense::INVALID_FIELD_IN_CDB);
                }
                _ => OPS
                    .iter()
                    .find(|o| o.op == req_op && o.sa.is_none_or(|sa| sa == req_sa)),
            };
            match found {
                Some(o) => {
                    d.push(0);
                    d.push(0x03 | if rctd { 0x80 } else { 0 });
                    d.extend_from_slice(&(o.usage.len() as u16).to_be_bytes());
                    d.extend_from_slice(o.usage);
                    if rctd {
                        d.extend_from_slice(&TIMEOUTS);
                    }
                }
                None => d.extend_from_slice(&[0, 0x01, 0, 0]),
            }
        }
        _ => return Err(Sense::INVALID_FIELD_IN_CDB),
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naa_id_is_stable_and_distinct() {
        let a = Identity::new("vol", "iqn.x:vol");
        let b = Identity::new("vol", "iqn.x:vol");
        let c = Identity::new("vol2", "iqn.x:vol2");
        assert_eq!(a.naa, b.naa);
        assert_ne!(a.naa, c.naa);
        assert_eq!(a.naa[0] >> 4, 5);
    }

    #[test]
    fn usage_data_starts_with_its_opcode() {
        for o in OPS {
            assert_eq!(o.usage[0], o.op, "opcode {:#x}", o.op);
        }
    }

    #[test]
    fn mode_sense_all_pages_lengths_add_up() {
        let cdb = [0x1a, 0, 0x3f, 0, 0xff, 0];
        let d = mode_sense(&cdb, false, 1000).expect("all pages");
        assert_eq!(usize::from(d[0]) + 1, d.len());
        let cdb10 = [0x5a, 0, 0x08, 0, 0, 0, 0, 0xff, 0xff, 0];
        let d = mode_sense(&cdb10, true, 1000).expect("caching");
        assert_eq!(usize::from(u16::from_be_bytes([d[0], d[1]])) + 2, d.len());
        assert_eq!(d[16], 0x08);
        assert_eq!(d[18] & 0x04, 0x04, "WCE set");
    }
}
