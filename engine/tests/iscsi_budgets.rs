//! What one initiator can make the target hold: every command costs its own overhead as well
//! as its data, immediate commands included, and the target's memory stays bounded however
//! many commands an initiator sends; reads are charged what their CDB reads; task management
//! requests waiting for aborted commands are bounded; and a target serves a bounded number of
//! connections.
//!
//! The memory test runs the target in a child process (this test binary again, see
//! [`child_target`]) so the resident size it reads from `/proc/PID/status` is the target's
//! alone, not that of the other tests running in this process.

mod iscsi_common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use iscsi_common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture, MemDevice};
use zebu_engine::iscsi::session::{IMMEDIATE_DEPTH, MAX_PENDING_TMFS, OUT_BUDGET};

const TASK_SET_FULL: u8 = 0x28;

/// An immediate WRITE(10) of one block that announces EDTL 1 and sends no data.
fn dataless_write(itt: u32, cmd_sn: u32) -> [u8; 48] {
    let mut b = bhs(0x41, 0x80 | 0x20); // immediate SCSI command; F, W
    b[8..16].copy_from_slice(&LUN1);
    put32(&mut b, 16, itt);
    put32(&mut b, 20, 1);
    put32(&mut b, 24, cmd_sn);
    let cdb = rw10(0x2a, 0, 1);
    b[32..32 + cdb.len()].copy_from_slice(&cdb);
    b
}

const CHILD_ENV: &str = "ZEBU_TEST_ISCSI_CHILD_TARGET";

/// Not a test of its own: the body of the child process of
/// [`immediate_writes_that_never_send_data_leave_the_targets_memory_bounded`]. It serves a
/// target as the engine does (same heap settings, multi-threaded runtime) over a memory
/// device, prints its address, and stops when its stdin closes.
#[test]
#[ignore = "started as a child process by the memory test"]
fn child_target() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    zebu_engine::heap::keep_large_buffers();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let cfg =
            zebu_engine::iscsi::IscsiConfig::new("127.0.0.61:0".parse().expect("literal"), "vol");
        let server = zebu_engine::iscsi::IscsiServer::bind(cfg, Arc::new(MemDevice::new(8 << 20)))
            .await
            .expect("bind");
        println!("LISTENING {}", server.local_addr());
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        });
        server
            .serve(async {
                let _ = stdin_closed.await;
            })
            .await
            .expect("serve");
    });
}

struct ChildTarget {
    child: Child,
    addr: SocketAddr,
}

impl ChildTarget {
    fn start() -> ChildTarget {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args(["child_target", "--exact", "--ignored", "--nocapture"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the child target");
        let out = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(out).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("child target printed its address")
                .expect("child stdout");
            if let Some(a) = line.strip_prefix("LISTENING ") {
                break a.parse().expect("address");
            }
        };
        // Keep its stdout drained: the test harness in it prints more and must not fail on
        // a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        ChildTarget { child, addr }
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("child's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS")
    }
}

impl Drop for ChildTarget {
    fn drop(&mut self) {
        // Closing stdin stops it; kill in case it does not.
        drop(self.child.stdin.take());
        for _ in 0..50 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `count` dataless immediate writes with fresh ITTs from `first_itt`, in batches,
/// reading every batch's answers before the next batch goes out (so the target's queue of
/// answers stays small and what is measured is what it keeps per command); returns the
/// R2Ts and TASK SET FULL responses seen.
async fn flood(c: &mut Client, first_itt: u32, count: u32) -> (u32, u32) {
    const BATCH: u32 = 10_000;
    let (mut r2t, mut full) = (0u32, 0u32);
    let mut sent = 0;
    while sent < count {
        let n = BATCH.min(count - sent);
        let mut wire = Vec::with_capacity(48 * n as usize);
        for i in 0..n {
            wire.extend_from_slice(&dataless_write(first_itt + sent + i, c.cmd_sn));
        }
        c.s.write_all(&wire).await.expect("send");
        sent += n;
        for _ in 0..n {
            let p = c.recv().await;
            match (p.opcode(), p.bhs[3]) {
                (0x31, _) => r2t += 1,
                (0x21, TASK_SET_FULL) => full += 1,
                (op, st) => panic!("unexpected answer: opcode {op:#x} status {st:#x}"),
            }
        }
    }
    (r2t, full)
}

/// Issue 18: immediate WRITE(10)s with EDTL 1 and no data grew the engine by ~300 bytes per
/// command without limit (13 -> 181 MB after 600,000): the write budget counted only data
/// bytes, and immediate commands are outside the CmdSN window. Now each command costs its
/// overhead too and immediate commands held at once are capped (TASK SET FULL beyond).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_writes_that_never_send_data_leave_the_targets_memory_bounded() {
    let target = ChildTarget::start();
    let mut c = Client::login(target.addr).await;
    // Warm up: the session's buffers and the allocator's arenas reach their working size.
    flood(&mut c, 1_000_000, 20_000).await;
    let before = target.rss_kib();

    let total = 600_000;
    let (r2t, full) = flood(&mut c, 2_000_000, total).await;
    let after = target.rss_kib();
    let grown = after.saturating_sub(before);
    eprintln!(
        "target VmRSS {before} KiB after the warm-up, +{grown} KiB after {total} more \
         dataless immediate writes ({r2t} R2Ts, {full} TASK SET FULL)"
    );
    assert!(
        grown < 8 * 1024,
        "the target grew by {grown} KiB for {total} dataless immediate writes \
         ({r2t} R2Ts, {full} TASK SET FULL)"
    );
    assert_eq!(r2t + full, total);
    assert_eq!(r2t, 0, "the cap was already reached in the warm-up");
    // Bounded, not just slow to grow: as many commands again leave it where it was.
    flood(&mut c, 3_000_000, total).await;
    let again = target.rss_kib().saturating_sub(after);
    eprintln!("+{again} KiB after {total} more");
    assert!(
        again < 4 * 1024,
        "the target grew by {again} KiB more for the next {total} commands"
    );

    // The session and the target still serve.
    c.nop().await;
    let mut fresh = Client::login(target.addr).await;
    let pattern = vec![0x3cu8; 4096];
    let (_, st) = fresh.scsi(&rw10(0x2a, 64, 8), 0, &pattern).await;
    assert_eq!(st, 0);
    let (data, st) = fresh.scsi(&rw10(0x28, 64, 8), 4096, &[]).await;
    assert_eq!((st, data), (0, pattern));
}

#[tokio::test]
async fn immediate_commands_over_the_cap_get_task_set_full_until_one_completes() {
    let (addr, _stop) = start("127.0.0.62", None).await;
    let mut c = Client::login(addr).await;
    let cap = IMMEDIATE_DEPTH;
    let mut wire = Vec::new();
    for i in 0..cap + 5 {
        let mut b = dataless_write(100 + i, c.cmd_sn);
        put32(&mut b, 20, 512); // a whole block this time, sent later as Data-Out
        wire.extend_from_slice(&b);
    }
    c.s.write_all(&wire).await.expect("send");
    let (mut r2t, mut full) = (Vec::new(), 0);
    for _ in 0..cap + 5 {
        let p = c.recv().await;
        match (p.opcode(), p.bhs[3]) {
            (0x31, _) => r2t.push((p.u32_at(16), p.u32_at(20))),
            (0x21, TASK_SET_FULL) => full += 1,
            (op, st) => panic!("unexpected answer: opcode {op:#x} status {st:#x}"),
        }
    }
    assert_eq!((r2t.len() as u32, full), (cap, 5));

    // The data of one pending write completes it; its slot serves the next command.
    let (itt, ttt) = r2t[0];
    let mut d = bhs(0x05, 0x80);
    d[8..16].copy_from_slice(&LUN1);
    put32(&mut d, 16, itt);
    put32(&mut d, 20, ttt);
    c.send(d, &[0x77; 512]).await;
    let p = c.recv().await;
    assert_eq!((p.opcode(), p.u32_at(16), p.bhs[3]), (0x21, itt, 0), "GOOD");
    c.send(dataless_write(999, c.cmd_sn), &[]).await;
    let p = c.recv().await;
    assert_eq!(
        (p.opcode(), p.u32_at(16)),
        (0x31, 999),
        "R2T: the slot came back"
    );
    let (data, st) = c.scsi(&rw10(0x28, 0, 1), 512, &[]).await;
    assert_eq!((st, data), (0, vec![0x77; 512]));
}

/// Holds every read until the gate opens, and counts the reads it holds.
struct GatedReads {
    inner: MemDevice,
    gate: watch::Receiver<bool>,
    held: AtomicU64,
}

impl BlockDevice for GatedReads {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            self.held.fetch_add(1, Ordering::SeqCst);
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
            self.held.fetch_sub(1, Ordering::SeqCst);
            self.inner.read(offset, len).await
        })
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        self.inner.write(offset, data)
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        self.inner.unmap(offset, len)
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        self.inner.flush()
    }
}

async fn settle(dev: &GatedReads) -> u64 {
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = dev.held.load(Ordering::SeqCst);
        if now == last {
            return now;
        }
        last = now;
    }
}

/// A READ whose CDB asks for 8 MiB with an expected length of 0 makes the device read 8 MiB
/// all the same: it must cost the response budget 8 MiB, not just its EDTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_cost_what_their_cdb_reads_not_only_their_expected_length() {
    let (open, gate) = watch::channel(false);
    let dev = Arc::new(GatedReads {
        inner: MemDevice::new(16 << 20),
        gate,
        held: AtomicU64::new(0),
    });
    let (addr, _stop) = start_with("127.0.0.63", dev.clone(), |_| {}).await;
    let mut c = Client::login(addr).await;
    let count = 40u32;
    let blocks = 16384u16; // 8 MiB, the most one command may read
    let mut wire = Vec::new();
    for i in 0..count {
        let mut b = bhs(0x01, 0x80); // F; EDTL 0, so neither R nor W
        b[8..16].copy_from_slice(&LUN1);
        put32(&mut b, 16, 500 + i);
        put32(&mut b, 24, c.cmd_sn);
        c.cmd_sn += 1;
        let cdb = rw10(0x28, 0, blocks);
        b[32..32 + cdb.len()].copy_from_slice(&cdb);
        wire.extend_from_slice(&b);
    }
    c.s.write_all(&wire).await.expect("send");
    let held = settle(&dev).await;
    let most = OUT_BUDGET / (u64::from(blocks) * 512) + 1;
    assert!(
        held <= most,
        "{held} reads of 8 MiB run at once; the response budget allows {most}"
    );
    assert!(held > 0);
    open.send(true).expect("gate");
    for _ in 0..count {
        let p = c.recv().await;
        assert_eq!((p.opcode(), p.bhs[3]), (0x21, 0), "SCSI Response, GOOD");
        assert_eq!(p.bhs[1] & 0x04, 0x04, "residual overflow");
        assert_eq!(p.u32_at(44), u32::from(blocks) * 512);
    }
    c.nop().await;
}

/// ABORT TASK SET while a command is stuck in the device: each TMF waits for it, and an
/// initiator could queue them without end. Beyond the cap they are answered at once with
/// "function rejected"; the ones within it are answered when the command finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_management_requests_waiting_for_a_stuck_command_are_bounded() {
    let (open, gate) = watch::channel(false);
    let dev = Arc::new(GatedReads {
        inner: MemDevice::new(8 << 20),
        gate,
        held: AtomicU64::new(0),
    });
    let (addr, _stop) = start_with("127.0.0.64", dev.clone(), |_| {}).await;
    let mut c = Client::login(addr).await;
    let mut b = bhs(0x01, 0x80 | 0x40);
    b[8..16].copy_from_slice(&LUN1);
    put32(&mut b, 16, 7);
    put32(&mut b, 20, 4096);
    put32(&mut b, 24, c.cmd_sn);
    c.cmd_sn += 1;
    let cdb = rw10(0x28, 0, 8);
    b[32..32 + cdb.len()].copy_from_slice(&cdb);
    c.send(b, &[]).await;
    assert_eq!(settle(&dev).await, 1, "the READ is stuck in the device");

    let extra = 7;
    let mut wire = Vec::new();
    for i in 0..MAX_PENDING_TMFS as u32 + extra {
        let mut t = bhs(0x42, 0x80 | 0x02); // immediate ABORT TASK SET
        t[8..16].copy_from_slice(&LUN1);
        put32(&mut t, 16, 1000 + i);
        put32(&mut t, 20, 0xffff_ffff);
        put32(&mut t, 24, c.cmd_sn);
        wire.extend_from_slice(&t);
    }
    c.s.write_all(&wire).await.expect("send");
    for _ in 0..extra {
        let p = c.recv().await;
        assert_eq!((p.opcode(), p.bhs[2]), (0x22, 255), "function rejected");
    }
    assert!(
        c.recv_within(Duration::from_millis(500)).await.is_none(),
        "the TMFs within the cap wait for the aborted READ"
    );
    open.send(true).expect("gate");
    for _ in 0..MAX_PENDING_TMFS {
        let p = c.recv().await;
        assert_eq!((p.opcode(), p.bhs[2]), (0x22, 0), "function complete");
    }
    c.nop().await;
}

#[tokio::test]
async fn connections_over_the_limit_are_refused_and_a_closed_one_frees_its_slot() {
    let (addr, _stop) = start_with("127.0.0.65", Arc::new(MemDevice::new(8 << 20)), |c| {
        c.max_connections = 2;
    })
    .await;
    let mut a = Client::login(addr).await;
    let b = Client::login(addr).await;
    let mut third = TcpStream::connect(addr).await.expect("connect");
    let mut one = [0u8; 1];
    assert!(
        matches!(
            tokio::time::timeout(Duration::from_secs(5), third.read(&mut one)).await,
            Ok(Ok(0)) | Ok(Err(_))
        ),
        "a third connection was served"
    );
    a.nop().await;
    drop(b);
    let mut admitted = false;
    for _ in 0..50 {
        let mut c = Client::connect(addr).await;
        let mut req = bhs(0x43, 0x83);
        put32(&mut req, 16, 1);
        c.send(
            req,
            &keys(&[
                ("InitiatorName", "iqn.2025-01.test:slots"),
                ("TargetName", IQN),
                ("AuthMethod", "None"),
            ]),
        )
        .await;
        if c.recv_within(Duration::from_secs(2)).await.is_some() {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(admitted, "no slot after a connection closed");
    a.nop().await;
}

/// Non-immediate READ(10)s of 1 MiB at LBA 0, pipelined.
fn pipelined_reads(c: &mut Client, first_itt: u32, n: u32) -> Vec<u8> {
    let mut wire = Vec::new();
    for i in 0..n {
        let mut b = bhs(0x01, 0x80 | 0x40);
        b[8..16].copy_from_slice(&LUN1);
        put32(&mut b, 16, first_itt + i);
        put32(&mut b, 20, 1 << 20);
        put32(&mut b, 24, c.cmd_sn);
        c.cmd_sn += 1;
        let cdb = rw10(0x28, 0, 2048);
        b[32..32 + cdb.len()].copy_from_slice(&cdb);
        wire.extend_from_slice(&b);
    }
    wire
}

/// An initiator that never reads its responses holds only its own budgets, but also a
/// connection slot: past the response timeout its connection is closed and the slot serves
/// the next initiator. One that reads, however slowly, keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_that_leaves_responses_unread_past_the_timeout_is_disconnected() {
    let (addr, _stop) = start_with("127.0.0.66", Arc::new(MemDevice::new(8 << 20)), |c| {
        c.max_connections = 1;
        c.response_timeout = Duration::from_secs(1);
    })
    .await;
    let mut stuck = Client::login(addr).await;
    let wire = pipelined_reads(&mut stuck, 100, 64);
    stuck.s.write_all(&wire).await.expect("send");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut finished = 0;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let Some(p) = stuck.recv_within(Duration::from_secs(5)).await else {
                return true;
            };
            if p.opcode() == 0x25 && p.bhs[1] & 0x01 != 0 {
                finished += 1;
            }
        }
    })
    .await
    .unwrap_or(false);
    assert!(closed, "the target kept the stalled connection");
    assert!(finished < 64, "all {finished} READs were answered");

    // Its slot is free again (the only one), and a slow reader keeps its connection: at
    // ~800 KB/s the kernel lets the target write again only every second or so (it waits
    // for a third of the send buffer to be free), which the target must not take for a
    // client that reads nothing.
    let mut slow = Client::login(addr).await;
    let reads = 12;
    let wire = pipelined_reads(&mut slow, 500, reads);
    slow.s.write_all(&wire).await.expect("send");
    let mut done = 0;
    let mut since_pause = 0;
    let read_slowly = async {
        while done < reads {
            let p = slow
                .recv_within(Duration::from_secs(10))
                .await
                .expect("an answer, not a closed connection");
            since_pause += 48 + p.data.len();
            if since_pause >= 16 * 1024 {
                since_pause = 0;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if p.opcode() == 0x25 && p.bhs[1] & 0x01 != 0 {
                assert_eq!(p.bhs[3], 0, "GOOD");
                done += 1;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read_slowly)
        .await
        .expect("the slow reader got every answer");
    slow.nop().await;
}
