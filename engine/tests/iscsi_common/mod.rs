//! Shared helpers for the iSCSI integration tests: an in-process target on a loopback
//! address and a raw PDU client, so each test can send exactly the (mal)formed thing it is
//! about.
#![allow(dead_code)] // Each test crate uses a different subset.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use zebu_engine::blockdev::{BlockDevice, MemDevice};
use zebu_engine::iscsi::{Chap, IscsiConfig, IscsiServer};

pub const IQN: &str = "iqn.2025-01.io.zebu:vol";
pub const LUN1: [u8; 8] = [0, 1, 0, 0, 0, 0, 0, 0];

pub async fn start(ip: &str, chap: Option<Chap>) -> (SocketAddr, oneshot::Sender<()>) {
    start_with(ip, Arc::new(MemDevice::new(8 << 20)), |c| c.chap = chap).await
}

/// Starts a target over `dev` with `tune` applied to the default configuration.
pub async fn start_with(
    ip: &str,
    dev: Arc<dyn BlockDevice>,
    tune: impl FnOnce(&mut IscsiConfig),
) -> (SocketAddr, oneshot::Sender<()>) {
    let mut cfg = IscsiConfig::new(format!("{ip}:0").parse().expect("addr"), "vol");
    tune(&mut cfg);
    let server = IscsiServer::bind(cfg, dev).await.expect("bind");
    let addr = server.local_addr();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server.serve(async {
        let _ = rx.await;
    }));
    (addr, tx)
}

pub struct Pdu {
    pub bhs: [u8; 48],
    pub data: Vec<u8>,
}

impl Pdu {
    pub fn u32_at(&self, off: usize) -> u32 {
        u32::from_be_bytes(self.bhs[off..off + 4].try_into().expect("4 bytes"))
    }
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }
}

pub struct Client {
    pub s: TcpStream,
    pub cmd_sn: u32,
    pub itt: u32,
}

pub fn bhs(opcode: u8, flags: u8) -> [u8; 48] {
    let mut b = [0u8; 48];
    b[0] = opcode;
    b[1] = flags;
    b
}

pub fn put32(b: &mut [u8; 48], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

pub fn keys(kv: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in kv {
        out.extend_from_slice(format!("{k}={v}").as_bytes());
        out.push(0);
    }
    out
}

pub fn parse_keys(d: &[u8]) -> Vec<(String, String)> {
    d.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let s = String::from_utf8_lossy(s).to_string();
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Client {
        Client {
            s: TcpStream::connect(addr).await.expect("connect"),
            cmd_sn: 1,
            itt: 1,
        }
    }

    pub async fn send(&mut self, mut b: [u8; 48], data: &[u8]) {
        let len = data.len();
        b[5] = (len >> 16) as u8;
        b[6] = (len >> 8) as u8;
        b[7] = len as u8;
        let mut wire = b.to_vec();
        wire.extend_from_slice(data);
        wire.resize(48 + len.div_ceil(4) * 4, 0);
        self.s.write_all(&wire).await.expect("send");
    }

    /// Reads one PDU; None on EOF or after `wait` without one.
    pub async fn recv_within(&mut self, wait: Duration) -> Option<Pdu> {
        let mut b = [0u8; 48];
        match tokio::time::timeout(wait, self.s.read_exact(&mut b)).await {
            Ok(Ok(_)) => {}
            _ => return None,
        }
        let len = (usize::from(b[5]) << 16) | (usize::from(b[6]) << 8) | usize::from(b[7]);
        let mut data = vec![0u8; len.div_ceil(4) * 4];
        // A connection closed in the middle of a PDU counts as closed too.
        self.s.read_exact(&mut data).await.ok()?;
        data.truncate(len);
        Some(Pdu { bhs: b, data })
    }

    pub async fn recv(&mut self) -> Pdu {
        self.recv_within(Duration::from_secs(5))
            .await
            .expect("a PDU from the target")
    }

    pub async fn login_pdu(&mut self, flags: u8, kv: &[(&str, &str)]) -> Pdu {
        let mut b = bhs(0x43, flags);
        b[8..14].copy_from_slice(&[0x80, 0, 0, 0x12, 0x34, 0x56]);
        put32(&mut b, 16, self.itt);
        put32(&mut b, 24, self.cmd_sn);
        self.send(b, &keys(kv)).await;
        self.recv().await
    }

    /// Logs in without authentication straight to the full feature phase.
    pub async fn login(addr: SocketAddr) -> Client {
        let mut c = Client::connect(addr).await;
        let r = c
            .login_pdu(
                0x83, // T, CSG=0, NSG=3
                &[
                    ("InitiatorName", "iqn.2025-01.test:hostile"),
                    ("TargetName", IQN),
                    ("SessionType", "Normal"),
                    ("AuthMethod", "None"),
                ],
            )
            .await;
        assert_eq!(r.opcode(), 0x23);
        assert_eq!(&r.bhs[36..38], &[0, 0], "login status");
        assert_eq!(r.bhs[1] & 0x83, 0x83, "transit to full feature phase");
        c
    }

    pub fn next_itt(&mut self) -> u32 {
        self.itt += 1;
        self.itt
    }

    pub async fn nop(&mut self) -> Pdu {
        let mut b = bhs(0x00, 0x80);
        let itt = self.next_itt();
        put32(&mut b, 16, itt);
        put32(&mut b, 20, 0xffff_ffff);
        put32(&mut b, 24, self.cmd_sn);
        self.cmd_sn += 1;
        self.send(b, b"ping").await;
        let r = self.recv().await;
        assert_eq!(r.opcode(), 0x20, "NOP-In");
        assert_eq!(r.u32_at(16), itt);
        assert_eq!(r.data, b"ping");
        r
    }

    /// Sends a SCSI command with immediate data and returns (Data-In bytes, status).
    pub async fn scsi(&mut self, cdb: &[u8], read_len: u32, write: &[u8]) -> (Vec<u8>, u8) {
        let flags =
            0x80 | if read_len > 0 { 0x40 } else { 0 } | if write.is_empty() { 0 } else { 0x20 };
        let mut b = bhs(0x01, flags);
        b[8..16].copy_from_slice(&LUN1);
        let itt = self.next_itt();
        put32(&mut b, 16, itt);
        put32(&mut b, 20, read_len.max(write.len() as u32));
        put32(&mut b, 24, self.cmd_sn);
        self.cmd_sn += 1;
        b[32..32 + cdb.len()].copy_from_slice(cdb);
        self.send(b, write).await;
        let mut data = Vec::new();
        loop {
            let r = self.recv().await;
            assert_eq!(r.u32_at(16), itt);
            match r.opcode() {
                0x25 => {
                    data.extend_from_slice(&r.data);
                    if r.bhs[1] & 0x01 != 0 {
                        return (data, r.bhs[3]);
                    }
                }
                0x21 => return (data, r.bhs[3]),
                op => panic!("unexpected opcode {op:#x}"),
            }
        }
    }
}

pub fn rw10(op: u8, lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![op, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&blocks.to_be_bytes());
    c.push(0);
    c
}
