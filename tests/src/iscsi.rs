//! A small iSCSI initiator for end-to-end tests: one login without authentication, then
//! READ(16) with its SCSI status and sense data, so a test sees exactly what a real initiator
//! is told (the data, or a CHECK CONDITION with sense key, ASC and ASCQ). RFC 7143 framing:
//! a 48-byte basic header segment, then the data segment padded to 4 bytes; no digests.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const OP_LOGIN: u8 = 0x03;
const OP_SCSI_CMD: u8 = 0x01;
const OP_LOGIN_RESP: u8 = 0x23;
const OP_SCSI_RESP: u8 = 0x21;
const OP_DATA_IN: u8 = 0x25;
const IMMEDIATE: u8 = 0x40;
/// The volume's LUN, in the SAM single-level format.
const LUN1: [u8; 8] = [0, 1, 0, 0, 0, 0, 0, 0];
/// The logical block size the target reports.
pub const LBA: u64 = 512;
const WAIT: Duration = Duration::from_secs(30);

/// Fixed-format sense data: what failed, in SCSI's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field (the first LBA in error) when its VALID bit is set.
    pub information: Option<u32>,
}

/// How a command ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// SCSI status: 0 GOOD, 2 CHECK CONDITION.
    pub status: u8,
    pub data: Vec<u8>,
    pub sense: Option<Sense>,
}

/// One logged-in session with one connection.
pub struct IscsiClient {
    s: TcpStream,
    cmd_sn: u32,
    itt: u32,
}

struct Pdu {
    bhs: [u8; 48],
    data: Vec<u8>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl IscsiClient {
    /// Connects to `portal` and logs in to `iqn` straight to the full feature phase.
    pub async fn login(portal: SocketAddr, iqn: &str) -> anyhow::Result<IscsiClient> {
        let s = TcpStream::connect(portal)
            .await
            .with_context(|| format!("connect {portal}"))?;
        s.set_nodelay(true)?;
        let mut c = IscsiClient {
            s,
            cmd_sn: 1,
            itt: 1,
        };
        let mut b = [0u8; 48];
        b[0] = OP_LOGIN | IMMEDIATE;
        b[1] = 0x80 | 0x03; // T, CSG 0 (security), NSG 3 (full feature)
        b[8..14].copy_from_slice(&[0x80, 0x00, 0x17, 0x00, 0x00, 0x01]); // ISID
        b[16..20].copy_from_slice(&c.itt.to_be_bytes());
        b[24..28].copy_from_slice(&c.cmd_sn.to_be_bytes());
        let mut keys = Vec::new();
        for (k, v) in [
            ("InitiatorName", "iqn.2025-01.io.zebu:tests"),
            ("TargetName", iqn),
            ("SessionType", "Normal"),
            ("AuthMethod", "None"),
            ("HeaderDigest", "None"),
            ("DataDigest", "None"),
            ("MaxRecvDataSegmentLength", "262144"),
        ] {
            keys.extend_from_slice(format!("{k}={v}").as_bytes());
            keys.push(0);
        }
        c.send(b, &keys).await?;
        let r = c.recv().await?;
        if r.bhs[0] & 0x3f != OP_LOGIN_RESP {
            bail!("login answered with opcode {:#x}", r.bhs[0]);
        }
        if r.bhs[36] != 0 || r.bhs[37] != 0 {
            bail!(
                "login refused: status class {} detail {}",
                r.bhs[36],
                r.bhs[37]
            );
        }
        if r.bhs[1] & 0x83 != 0x83 {
            bail!("the target did not move to the full feature phase");
        }
        Ok(c)
    }

    async fn send(&mut self, mut b: [u8; 48], data: &[u8]) -> anyhow::Result<()> {
        let len = data.len();
        b[5] = (len >> 16) as u8;
        b[6] = (len >> 8) as u8;
        b[7] = len as u8;
        let mut wire = b.to_vec();
        wire.extend_from_slice(data);
        wire.resize(48 + len.div_ceil(4) * 4, 0);
        self.s.write_all(&wire).await.context("send a PDU")
    }

    async fn recv(&mut self) -> anyhow::Result<Pdu> {
        let mut bhs = [0u8; 48];
        tokio::time::timeout(WAIT, self.s.read_exact(&mut bhs))
            .await
            .context("no PDU from the target in time")?
            .context("read a PDU header")?;
        let ahs = usize::from(bhs[4]) * 4;
        let len = (usize::from(bhs[5]) << 16) | (usize::from(bhs[6]) << 8) | usize::from(bhs[7]);
        let mut rest = vec![0u8; ahs + len.div_ceil(4) * 4];
        self.s
            .read_exact(&mut rest)
            .await
            .context("read a data segment")?;
        let data = rest[ahs..ahs + len].to_vec();
        Ok(Pdu { bhs, data })
    }

    /// READ(16) of `len` bytes at byte `offset` (both multiples of [`LBA`]).
    pub async fn read(&mut self, offset: u64, len: u32) -> anyhow::Result<Outcome> {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x88;
        cdb[2..10].copy_from_slice(&(offset / LBA).to_be_bytes());
        cdb[10..14].copy_from_slice(&(len / LBA as u32).to_be_bytes());
        let mut b = [0u8; 48];
        b[0] = OP_SCSI_CMD;
        b[1] = 0x80 | 0x40 | 0x01; // F, R, SIMPLE task attribute
        b[8..16].copy_from_slice(&LUN1);
        self.itt += 1;
        let itt = self.itt;
        b[16..20].copy_from_slice(&itt.to_be_bytes());
        b[20..24].copy_from_slice(&len.to_be_bytes());
        b[24..28].copy_from_slice(&self.cmd_sn.to_be_bytes());
        self.cmd_sn += 1;
        b[32..48].copy_from_slice(&cdb);
        self.send(b, &[]).await?;
        let mut data = Vec::new();
        loop {
            let r = self.recv().await?;
            if be32(&r.bhs, 16) != itt {
                continue; // e.g. a NOP-In
            }
            match r.bhs[0] & 0x3f {
                OP_DATA_IN => {
                    data.extend_from_slice(&r.data);
                    if r.bhs[1] & 0x01 != 0 {
                        return Ok(Outcome {
                            status: r.bhs[3],
                            data,
                            sense: None,
                        });
                    }
                }
                OP_SCSI_RESP => {
                    return Ok(Outcome {
                        status: r.bhs[3],
                        data,
                        sense: parse_sense(&r.data),
                    });
                }
                op => bail!("unexpected opcode {op:#x} answering a READ"),
            }
        }
    }
}

/// The sense data of a SCSI Response's data segment: a 2-byte length, then fixed-format
/// sense (response code 0x70/0x71).
fn parse_sense(d: &[u8]) -> Option<Sense> {
    let len = usize::from(u16::from_be_bytes([*d.first()?, *d.get(1)?]));
    let s = d.get(2..2 + len)?;
    if s.len() < 14 || (s[0] & 0x7e) != 0x70 {
        return None;
    }
    Some(Sense {
        key: s[2] & 0x0f,
        asc: s[12],
        ascq: s[13],
        information: (s[0] & 0x80 != 0).then(|| be32(s, 3)),
    })
}
