//! Hostile and broken initiators against an in-process iSCSI target over real loopback TCP.
//! Each test speaks raw PDUs so it can send exactly the malformed thing it is about.

mod iscsi_common;

use std::time::Duration;

use iscsi_common::*;
use tokio::io::AsyncWriteExt;
use zebu_engine::iscsi::{Chap, chap};

#[tokio::test]
async fn write_then_read_returns_the_same_bytes() {
    let (addr, _stop) = start("127.0.0.21", None).await;
    let mut c = Client::login(addr).await;
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let (_, st) = c.scsi(&rw10(0x2a, 10, 8), 0, &pattern).await;
    assert_eq!(st, 0);
    let (data, st) = c.scsi(&rw10(0x28, 10, 8), 4096, &[]).await;
    assert_eq!(st, 0);
    assert_eq!(data, pattern);
}

#[tokio::test]
async fn unknown_opcode_is_rejected_and_the_connection_keeps_working() {
    let (addr, _stop) = start("127.0.0.22", None).await;
    let mut c = Client::login(addr).await;
    let mut b = bhs(0x1f, 0x80);
    put32(&mut b, 16, 77);
    c.send(b, &[]).await;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x3f, "Reject");
    assert_eq!(r.bhs[2], 0x05, "reason: command not supported");
    assert_eq!(r.data.len(), 48);
    assert_eq!(r.data[0] & 0x3f, 0x1f, "the rejected header is echoed");
    c.nop().await;
}

#[tokio::test]
async fn truncated_header_closes_only_that_connection() {
    let (addr, _stop) = start("127.0.0.23", None).await;
    let mut bad = Client::login(addr).await;
    bad.s
        .write_all(&[0x01, 0x80, 0, 0, 0, 0, 0, 0, 0, 1])
        .await
        .expect("partial");
    bad.s.shutdown().await.expect("half close");
    assert!(
        bad.recv_within(Duration::from_secs(5)).await.is_none(),
        "closed"
    );
    let mut good = Client::login(addr).await;
    good.nop().await;
}

#[tokio::test]
async fn data_segment_longer_than_negotiated_is_rejected_and_closed() {
    let (addr, _stop) = start("127.0.0.24", None).await;
    let mut c = Client::login(addr).await;
    let mut b = bhs(0x00, 0x80);
    put32(&mut b, 16, 5);
    put32(&mut b, 24, c.cmd_sn);
    let len = zebu_engine::iscsi::login::TARGET_MRDSL as usize + 4;
    b[5] = (len >> 16) as u8;
    b[6] = (len >> 8) as u8;
    b[7] = len as u8;
    c.s.write_all(&b).await.expect("header");
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x3f, "Reject");
    assert_eq!(r.bhs[2], 0x04, "protocol error");
    assert!(
        c.recv_within(Duration::from_secs(5)).await.is_none(),
        "then closed"
    );
    Client::login(addr).await.nop().await;
}

#[tokio::test]
async fn command_outside_cmdsn_window_is_ignored() {
    let (addr, _stop) = start("127.0.0.25", None).await;
    let mut c = Client::login(addr).await;
    let before = c.nop().await;
    let exp = before.u32_at(28);
    let max = before.u32_at(32);
    assert_eq!(exp, c.cmd_sn);
    // TEST UNIT READY far beyond MaxCmdSN: must be dropped without a response.
    let mut b = bhs(0x01, 0x80);
    b[8..16].copy_from_slice(&LUN1);
    put32(&mut b, 16, 999);
    put32(&mut b, 24, max.wrapping_add(100));
    c.send(b, &[]).await;
    // And one already used (too low).
    put32(&mut b, 16, 998);
    put32(&mut b, 24, exp.wrapping_sub(1));
    c.send(b, &[]).await;
    assert!(c.recv_within(Duration::from_millis(300)).await.is_none());
    let after = c.nop().await;
    assert_eq!(after.u32_at(28), exp + 1, "only the NOP consumed a CmdSN");
}

#[tokio::test]
async fn wrong_chap_secret_fails_login_with_0201() {
    let chap_cfg = Chap {
        user: "alice".into(),
        secret: "correct-horse-1".into(),
        mutual: None,
    };
    let (addr, _stop) = start("127.0.0.26", Some(chap_cfg)).await;
    for (secret, ok) in [("wrong-secret-12", false), ("correct-horse-1", true)] {
        let mut c = Client::connect(addr).await;
        let r = c
            .login_pdu(
                0x01, // CSG=0, NSG=1, no transit yet
                &[
                    ("InitiatorName", "iqn.2025-01.test:chap"),
                    ("TargetName", IQN),
                    ("SessionType", "Normal"),
                    ("AuthMethod", "CHAP,None"),
                ],
            )
            .await;
        assert!(parse_keys(&r.data).contains(&("AuthMethod".into(), "CHAP".into())));
        let r = c.login_pdu(0x01, &[("CHAP_A", "5")]).await;
        let k = parse_keys(&r.data);
        let get = |n: &str| {
            k.iter()
                .find(|(x, _)| x == n)
                .map(|(_, v)| v.clone())
                .expect(n)
        };
        let id: u8 = get("CHAP_I").parse().expect("id");
        let challenge = chap::decode_binary(&get("CHAP_C")).expect("challenge");
        let resp = chap::response(id, secret.as_bytes(), &challenge);
        let r = c
            .login_pdu(
                0x81,
                &[("CHAP_N", "alice"), ("CHAP_R", &chap::to_hex(&resp))],
            )
            .await;
        let status = u16::from_be_bytes([r.bhs[36], r.bhs[37]]);
        if ok {
            assert_eq!(status, 0);
            assert_eq!(r.bhs[1] & 0x80, 0x80, "transit allowed after CHAP");
        } else {
            assert_eq!(status, 0x0201);
            assert!(
                c.recv_within(Duration::from_secs(5)).await.is_none(),
                "closed"
            );
        }
    }
}

#[tokio::test]
async fn connection_dropped_mid_write_leaves_other_sessions_unaffected() {
    let (addr, _stop) = start("127.0.0.27", None).await;
    let mut other = Client::login(addr).await;
    let mut victim = Client::login(addr).await;
    // WRITE(10) of 8 blocks with only one block of immediate data; the rest would follow
    // after an R2T, but the initiator vanishes.
    let mut b = bhs(0x01, 0xa0);
    b[8..16].copy_from_slice(&LUN1);
    put32(&mut b, 16, 42);
    put32(&mut b, 20, 4096);
    put32(&mut b, 24, victim.cmd_sn);
    b[32..42].copy_from_slice(&rw10(0x2a, 0, 8));
    victim.send(b, &[0xee; 512]).await;
    let r2t = victim.recv().await;
    assert_eq!(r2t.opcode(), 0x31, "R2T for the rest");
    assert_eq!(
        r2t.u32_at(40),
        512,
        "buffer offset after the immediate data"
    );
    assert_eq!(r2t.u32_at(44), 4096 - 512);
    drop(victim);
    let pattern = vec![0x5au8; 4096];
    let (_, st) = other.scsi(&rw10(0x2a, 0, 8), 0, &pattern).await;
    assert_eq!(st, 0);
    let (data, _) = other.scsi(&rw10(0x28, 0, 8), 4096, &[]).await;
    assert_eq!(data, pattern, "the abandoned write did not land");
    Client::login(addr).await.nop().await;
}

/// An initiator that opens many large writes and never sends their data must not make the
/// target buffer more than the per-connection write budget; writes over it get TASK SET
/// FULL, and the budget comes back when a pending write is aborted.
#[tokio::test]
async fn writes_that_never_send_data_are_bounded_by_the_write_budget() {
    let (addr, _stop) = start("127.0.0.27", None).await;
    let mut c = Client::login(addr).await;
    let edtl: u32 = 8 << 20; // MAX_DATA_OUT, the whole 8 MiB LUN
    // Each pending write is charged its length and its own state.
    let fits = zebu_engine::iscsi::session::WRITE_BUDGET
        / (edtl as usize + zebu_engine::iscsi::session::CMD_COST as usize);
    let open_write = |c: &mut Client| {
        let mut b = bhs(0x01, 0x80 | 0x20); // F, W: no unsolicited data follows
        b[8..16].copy_from_slice(&LUN1);
        let itt = c.next_itt();
        put32(&mut b, 16, itt);
        put32(&mut b, 20, edtl);
        put32(&mut b, 24, c.cmd_sn);
        c.cmd_sn += 1;
        let cdb = rw10(0x2a, 0, (edtl / 512) as u16);
        b[32..32 + cdb.len()].copy_from_slice(&cdb);
        (b, itt)
    };
    let mut itts = Vec::new();
    for _ in 0..fits {
        let (b, itt) = open_write(&mut c);
        c.send(b, &[]).await;
        let r = c.recv().await;
        assert_eq!(r.opcode(), 0x31, "R2T for a write within the budget");
        assert_eq!(r.u32_at(16), itt);
        itts.push(itt);
    }
    let (b, itt) = open_write(&mut c);
    c.send(b, &[]).await;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x21, "SCSI Response for the write over budget");
    assert_eq!(r.u32_at(16), itt);
    assert_eq!(r.bhs[3], 0x28, "TASK SET FULL");

    // ABORT TASK on one pending write gives its share back.
    let mut t = bhs(0x02, 0x80 | 0x01);
    t[8..16].copy_from_slice(&LUN1);
    let tmf_itt = c.next_itt();
    put32(&mut t, 16, tmf_itt);
    put32(&mut t, 20, itts[0]);
    put32(&mut t, 24, c.cmd_sn);
    c.cmd_sn += 1;
    c.send(t, &[]).await;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x22);
    assert_eq!(r.bhs[2], 0, "task aborted");
    let (b, itt) = open_write(&mut c);
    c.send(b, &[]).await;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x31, "budget released by the abort");
    assert_eq!(r.u32_at(16), itt);
}

/// Resident memory of this process in KiB (the target runs in it).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// An initiator that pipelines many large READs and never reads the answers must stop
/// being read once the target holds its response budget: the target's memory stays
/// bounded (not one buffer per READ sent), and another session on the same target keeps
/// working meanwhile. Reading the answers later lets the slow session go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_that_does_not_read_replies_is_throttled_and_blocks_nobody() {
    let (addr, _stop) = start("127.0.0.28", None).await;
    let mut slow = Client::login(addr).await;
    let mut other = Client::login(addr).await;
    let pattern = vec![0xa5u8; 4096];
    let (_, st) = other.scsi(&rw10(0x2a, 0, 8), 0, &pattern).await;
    assert_eq!(st, 0);
    let rss_before = rss_kib();

    // Immediate READ(10)s of 1 MiB, so the CmdSN window does not limit them (only the
    // response budget does): 600 MiB of Data-In if the target buffered them all.
    let read_len: u32 = 1 << 20;
    let count = 600u32;
    let mut wire = Vec::new();
    for i in 0..count {
        let mut b = bhs(0x41, 0x80 | 0x40); // immediate SCSI command; F, R
        b[8..16].copy_from_slice(&LUN1);
        put32(&mut b, 16, 1000 + i);
        put32(&mut b, 20, read_len);
        put32(&mut b, 24, slow.cmd_sn);
        let cdb = rw10(0x28, 0, (read_len / 512) as u16);
        b[32..32 + cdb.len()].copy_from_slice(&cdb);
        wire.extend_from_slice(&b);
    }
    slow.s.write_all(&wire).await.expect("send READs");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Another session is served normally while the slow one is stuck.
    for _ in 0..3 {
        let (data, st) = other.scsi(&rw10(0x28, 0, 8), 4096, &[]).await;
        assert_eq!(st, 0);
        assert_eq!(data, pattern);
    }
    other.nop().await;

    let budget_kib = zebu_engine::iscsi::session::OUT_BUDGET / 1024;
    let grown = rss_kib().saturating_sub(rss_before);
    // The budget, one command over it, socket buffers and whatever the other tests in
    // this process hold: far below the 600 MiB the READs asked for.
    assert!(
        grown < budget_kib * 6,
        "target memory grew by {grown} KiB with a response budget of {budget_kib} KiB"
    );

    // Reading the answers lets the target go on: every READ is answered, with the data.
    let mut answered = 0;
    let mut first = Vec::new();
    while answered < count {
        let r = slow
            .recv_within(Duration::from_secs(20))
            .await
            .expect("Data-In once the initiator reads again");
        assert_eq!(r.opcode(), 0x25, "Data-In");
        let itt = r.u32_at(16);
        assert!((1000..1000 + count).contains(&itt));
        if itt == 1000 && r.u32_at(40) == 0 {
            first = r.data[..4096].to_vec();
        }
        if r.bhs[1] & 0x01 != 0 {
            assert_eq!(r.bhs[3], 0, "GOOD");
            answered += 1;
        }
    }
    assert_eq!(first, pattern, "the first READ's data");
    slow.nop().await;
}
