//! Protocol behaviour over raw TCP: option negotiation, replies out of order, FUA and
//! zeroing semantics, and shutdown with clients attached.

mod nbd_common;

use std::sync::Arc;
use std::time::Duration;

use nbd_common::*;
use tokio::io::AsyncReadExt;
use zebu_engine::blockdev::MemDevice;
use zebu_engine::nbd::wire::*;

const SIZE: u64 = 8 << 20;

#[tokio::test]
async fn options_list_info_unsupported_and_abort() {
    let server = TestServer::start(Arc::new(MemDevice::new(SIZE))).await;
    let mut c = RawClient::greet(server.addr).await;

    c.send_option(OPT_LIST, &[]).await;
    let r = c.read_opt_reply().await;
    assert_eq!(r.reply_type, REP_SERVER);
    assert_eq!(&r.data[0..4], &(EXPORT.len() as u32).to_be_bytes());
    assert_eq!(&r.data[4..], EXPORT.as_bytes());
    assert_eq!(c.read_opt_reply().await.reply_type, REP_ACK);

    c.send_option(OPT_LIST, b"junk").await;
    assert_eq!(c.read_opt_reply().await.reply_type, REP_ERR_INVALID);

    // Structured replies (8) and an invented option are both unsupported.
    for opt in [8u32, 0xdead] {
        c.send_option(opt, &[]).await;
        let r = c.read_opt_reply().await;
        assert_eq!((r.option, r.reply_type), (opt, REP_ERR_UNSUP));
    }

    // INFO with a request for the name: export info, block sizes, name, then ACK.
    let mut d = Vec::new();
    d.extend_from_slice(&(EXPORT.len() as u32).to_be_bytes());
    d.extend_from_slice(EXPORT.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&INFO_NAME.to_be_bytes());
    c.send_option(OPT_INFO, &d).await;
    let mut seen = Vec::new();
    loop {
        let r = c.read_opt_reply().await;
        if r.reply_type == REP_ACK {
            break;
        }
        assert_eq!(r.reply_type, REP_INFO);
        let kind = u16::from_be_bytes([r.data[0], r.data[1]]);
        match kind {
            INFO_EXPORT => {
                assert_eq!(
                    u64::from_be_bytes(r.data[2..10].try_into().expect("8")),
                    SIZE
                );
                let flags = u16::from_be_bytes([r.data[10], r.data[11]]);
                for f in [
                    TFLAG_HAS_FLAGS,
                    TFLAG_SEND_FLUSH,
                    TFLAG_SEND_FUA,
                    TFLAG_SEND_TRIM,
                    TFLAG_SEND_WRITE_ZEROES,
                    TFLAG_CAN_MULTI_CONN,
                ] {
                    assert_ne!(flags & f, 0, "flag {f:#x} missing");
                }
            }
            INFO_BLOCK_SIZE => {
                let w = |i: usize| u32::from_be_bytes(r.data[i..i + 4].try_into().expect("4"));
                assert_eq!((w(2), w(6), w(10)), (1, 4096, 32 << 20));
            }
            INFO_NAME => assert_eq!(&r.data[2..], EXPORT.as_bytes()),
            other => panic!("unexpected info {other}"),
        }
        seen.push(kind);
    }
    assert_eq!(seen, vec![INFO_EXPORT, INFO_BLOCK_SIZE, INFO_NAME]);

    c.send_option(OPT_ABORT, &[]).await;
    assert_eq!(c.read_opt_reply().await.reply_type, REP_ACK);
    assert!(c.closed_by_server().await);
    server.stop().await;
}

#[tokio::test]
async fn export_name_option_enters_transmission() {
    let server = TestServer::start(Arc::new(MemDevice::new(SIZE))).await;
    let mut c = RawClient::greet(server.addr).await;
    c.send_option(OPT_EXPORT_NAME, EXPORT.as_bytes()).await;
    let size = c.s.read_u64().await.expect("size");
    let flags = c.s.read_u16().await.expect("flags");
    assert_eq!(size, SIZE);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    // NO_ZEROES was negotiated, so the next bytes are the reply to our first request.
    assert_eq!(c.write(1, 0, b"hello").await, 0);
    assert_eq!(c.read(2, 0, 5).await, Ok(b"hello".to_vec()));
    c.send_request(CMD_DISC, 0, 3, 0, 0, &[]).await;
    assert!(c.closed_by_server().await);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_come_back_out_of_order() {
    let mut dev = Recording::new(MemDevice::new(SIZE));
    dev.slow_read_offset = Some((0, Duration::from_millis(500)));
    let server = TestServer::start(Arc::new(dev)).await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    assert_eq!(c.write(1, 4096, &[9; 4096]).await, 0);
    // Slow read first, fast read second: the fast one must not wait behind the slow one.
    c.send_request(CMD_READ, 0, 100, 0, 4096, &[]).await;
    c.send_request(CMD_READ, 0, 200, 4096, 4096, &[]).await;
    let (first, e) = c.read_reply().await;
    assert_eq!((first, e), (200, 0));
    let mut buf = vec![0; 4096];
    c.s.read_exact(&mut buf).await.expect("payload");
    assert!(buf.iter().all(|&b| b == 9));
    let (second, e) = c.read_reply().await;
    assert_eq!((second, e), (100, 0));
    c.s.read_exact(&mut buf).await.expect("payload");
    assert!(buf.iter().all(|&b| b == 0));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_pipelined_writes_all_answered_and_applied() {
    let server = TestServer::start(Arc::new(MemDevice::new(SIZE))).await;
    let (c, _, _) = RawClient::connect(server.addr).await;
    let n = 512u64;
    // Send everything before reading any reply.
    let mut reqs = Vec::new();
    for i in 0..n {
        let mut b = Vec::new();
        b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&CMD_WRITE.to_be_bytes());
        b.extend_from_slice(&(1000 + i).to_be_bytes());
        b.extend_from_slice(&(i * 4096).to_be_bytes());
        b.extend_from_slice(&4096u32.to_be_bytes());
        b.extend_from_slice(&[(i % 251) as u8; 4096]);
        reqs.extend_from_slice(&b);
    }
    let (mut rd, mut wr) = c.s.into_split();
    let sender = tokio::spawn(async move {
        tokio::io::AsyncWriteExt::write_all(&mut wr, &reqs)
            .await
            .expect("send");
        wr
    });
    let mut cookies = Vec::new();
    for _ in 0..n {
        assert_eq!(rd.read_u32().await.expect("magic"), SIMPLE_REPLY_MAGIC);
        assert_eq!(rd.read_u32().await.expect("error"), 0);
        cookies.push(rd.read_u64().await.expect("cookie"));
    }
    cookies.sort_unstable();
    assert_eq!(cookies, (1000..1000 + n).collect::<Vec<_>>());
    let wr = sender.await.expect("sender");
    let mut c = RawClient {
        s: rd.reunite(wr).expect("same stream"),
    };
    for i in [0u64, 1, 250, 251, 511] {
        let data = c.read(5000 + i, i * 4096, 4096).await.expect("read");
        assert!(data.iter().all(|&b| b == (i % 251) as u8), "block {i}");
    }
    server.stop().await;
}

#[tokio::test]
async fn fua_flushes_before_reply_and_zeroes_honour_no_hole() {
    let dev = Arc::new(Recording::new(MemDevice::new(SIZE)));
    let server = TestServer::start(dev.clone()).await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;

    c.send_request(CMD_WRITE, CMD_FLAG_FUA, 1, 0, 4096, &[1; 4096])
        .await;
    assert_eq!(c.read_reply().await, (1, 0));
    assert_eq!(dev.calls(), vec!["write 0 4096", "flush"]);

    c.send_request(CMD_FLUSH, 0, 2, 0, 0, &[]).await;
    assert_eq!(c.read_reply().await, (2, 0));
    assert_eq!(dev.flushes.load(std::sync::atomic::Ordering::SeqCst), 2);

    // Without NO_HOLE a zero request may punch a hole ...
    c.send_request(CMD_WRITE_ZEROES, 0, 3, 0, 4096, &[]).await;
    assert_eq!(c.read_reply().await, (3, 0));
    assert_eq!(dev.calls().last().map(String::as_str), Some("unmap 0 4096"));
    // ... with NO_HOLE it writes zeros, split in 1 MiB chunks, and FUA flushes after.
    assert_eq!(c.write(4, 0, &[5; 4096]).await, 0);
    let before = dev.calls().len();
    c.send_request(
        CMD_WRITE_ZEROES,
        CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
        5,
        0,
        (2 << 20) + 4096,
        &[],
    )
    .await;
    assert_eq!(c.read_reply().await, (5, 0));
    assert_eq!(
        dev.calls()[before..].to_vec(),
        vec![
            "write 0 1048576",
            "write 1048576 1048576",
            "write 2097152 4096",
            "flush"
        ]
    );
    assert_eq!(c.read(6, 0, 4096).await, Ok(vec![0; 4096]));

    c.send_request(CMD_TRIM, 0, 7, 4096, 8192, &[]).await;
    assert_eq!(c.read_reply().await, (7, 0));
    assert_eq!(
        dev.calls().last().map(String::as_str),
        Some("unmap 4096 8192")
    );
    server.stop().await;
}

#[tokio::test]
async fn shutdown_closes_attached_clients() {
    let server = TestServer::start(Arc::new(MemDevice::new(SIZE))).await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    // A client stuck in the handshake must not hold shutdown up either.
    let mut h = RawClient::greet(server.addr).await;
    assert_eq!(c.write(1, 0, &[1; 512]).await, 0);
    server.stop().await;
    assert!(c.closed_by_server().await);
    assert!(h.closed_by_server().await);
}

#[tokio::test]
async fn flush_on_one_connection_covers_writes_completed_on_another() {
    // What CAN_MULTI_CONN promises: every connection reaches the same device, and a FLUSH
    // anywhere reaches the device after the writes already replied to elsewhere.
    let dev = Arc::new(Recording::new(MemDevice::new(SIZE)));
    let server = TestServer::start(dev.clone()).await;
    let (mut a, _, flags) = RawClient::connect(server.addr).await;
    let (mut b, _, _) = RawClient::connect(server.addr).await;
    assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
    assert_eq!(a.write(1, 0, &[3; 4096]).await, 0);
    b.send_request(CMD_FLUSH, 0, 2, 0, 0, &[]).await;
    assert_eq!(b.read_reply().await, (2, 0));
    assert_eq!(dev.calls(), vec!["write 0 4096", "flush"]);
    // And B reads A's data.
    assert_eq!(b.read(3, 0, 4096).await, Ok(vec![3; 4096]));
    server.stop().await;
}
