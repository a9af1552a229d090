//! Hostile and broken clients over raw TCP. Each case checks what the protocol asks for
//! (an error reply or a closed connection) and that a well-behaved connection opened
//! before the bad one keeps working afterwards.

mod nbd_common;

use std::sync::Arc;

use nbd_common::*;
use tokio::io::AsyncWriteExt;
use zebu_engine::blockdev::MemDevice;
use zebu_engine::nbd::wire::*;

const SIZE: u64 = 4 << 20;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

async fn setup() -> (TestServer, RawClient) {
    let server = TestServer::start(Arc::new(MemDevice::new(SIZE))).await;
    let (mut good, size, _) = RawClient::connect(server.addr).await;
    assert_eq!(size, SIZE);
    assert_eq!(good.write(1, 8192, &[0xab; 4096]).await, 0);
    (server, good)
}

/// The bystander connection still reads what it wrote.
async fn bystander_ok(good: &mut RawClient) {
    let data = good.read(2, 8192, 4096).await.expect("bystander read");
    assert!(data.iter().all(|&b| b == 0xab));
}

#[tokio::test]
async fn bad_request_magic_closes_only_that_connection() {
    let (server, mut good) = setup().await;
    let (mut bad, _, _) = RawClient::connect(server.addr).await;
    let mut req = [0u8; 28];
    req[0..4].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    bad.s.write_all(&req).await.expect("send");
    assert!(
        bad.closed_by_server().await,
        "bad magic must end the session"
    );
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn write_longer_than_max_payload_disconnects() {
    let (server, mut good) = setup().await;
    let (mut bad, _, _) = RawClient::connect(server.addr).await;
    // Claims a 4 GiB payload; the server must not try to buffer it.
    bad.send_request(CMD_WRITE, 0, 9, 0, u32::MAX, &[1, 2, 3])
        .await;
    assert!(bad.closed_by_server().await);
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn read_longer_than_max_payload_gets_einval_and_connection_continues() {
    let (server, mut good) = setup().await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    assert_eq!(c.read(5, 0, (32 << 20) + 1).await, Err(EINVAL));
    // Framing intact: the next request on the same connection works.
    assert!(
        c.read(6, 8192, 4096)
            .await
            .expect("read")
            .iter()
            .all(|&b| b == 0xab)
    );
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn unknown_command_gets_einval_and_connection_continues() {
    let (server, mut good) = setup().await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    c.send_request(0x7777, 0, 42, 0, 4096, &[]).await;
    assert_eq!(c.read_reply().await, (42, EINVAL));
    assert!(c.read(43, 8192, 16).await.is_ok());
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn read_past_end_gets_einval() {
    let (server, mut good) = setup().await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    assert_eq!(c.read(1, SIZE - 4096, 8192).await, Err(EINVAL));
    assert_eq!(c.read(2, SIZE, 1).await, Err(EINVAL));
    // offset + length overflows u64: must not wrap around to a valid range.
    assert_eq!(c.read(3, u64::MAX - 10, 4096).await, Err(EINVAL));
    // The last byte is still readable.
    assert_eq!(c.read(4, SIZE - 1, 1).await, Ok(vec![0]));
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn write_past_end_gets_enospc_and_payload_is_consumed() {
    let (server, mut good) = setup().await;
    let (mut c, _, _) = RawClient::connect(server.addr).await;
    assert_eq!(c.write(1, SIZE - 10, &[7; 4096]).await, ENOSPC);
    // Nothing of the refused write landed on the device.
    assert_eq!(c.read(2, SIZE - 10, 10).await, Ok(vec![0; 10]));
    c.send_request(CMD_TRIM, 0, 3, SIZE, 4096, &[]).await;
    assert_eq!(c.read_reply().await, (3, EINVAL));
    c.send_request(CMD_WRITE_ZEROES, 0, 4, SIZE - 1, 2, &[])
        .await;
    assert_eq!(c.read_reply().await, (4, ENOSPC));
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn disconnect_mid_request_leaves_device_untouched() {
    let (server, mut good) = setup().await;
    {
        let (mut c, _, _) = RawClient::connect(server.addr).await;
        // Full header announcing 64 KiB, then only half of the payload, then gone.
        let mut req = Vec::new();
        req.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&CMD_WRITE.to_be_bytes());
        req.extend_from_slice(&1u64.to_be_bytes());
        req.extend_from_slice(&(1u64 << 20).to_be_bytes());
        req.extend_from_slice(&(64u32 << 10).to_be_bytes());
        req.extend_from_slice(&[0x55; 32 << 10]);
        c.s.write_all(&req).await.expect("send");
        // A second client dies half-way through a header.
        let (mut d, _, _) = RawClient::connect(server.addr).await;
        d.s.write_all(&REQUEST_MAGIC.to_be_bytes())
            .await
            .expect("send");
    }
    bystander_ok(&mut good).await;
    let data = good.read(3, 1 << 20, 64 << 10).await.expect("read");
    assert!(
        data.iter().all(|&b| b == 0),
        "a half-received write must not be applied"
    );
    server.stop().await;
}

#[tokio::test]
async fn wrong_export_name_is_refused_with_err_unknown() {
    let (server, mut good) = setup().await;
    let mut c = RawClient::greet(server.addr).await;
    c.send_option(OPT_GO, &RawClient::go_data("nope")).await;
    let r = c.read_opt_reply().await;
    assert_eq!((r.option, r.reply_type), (OPT_GO, REP_ERR_UNKNOWN));
    // Same connection may try again with the right name.
    c.send_option(OPT_INFO, &RawClient::go_data(EXPORT)).await;
    let r = c.read_opt_reply().await;
    assert_eq!(r.reply_type, REP_INFO);

    // NBD_OPT_EXPORT_NAME has no error reply: the server closes.
    let mut e = RawClient::greet(server.addr).await;
    e.send_option(OPT_EXPORT_NAME, b"nope").await;
    assert!(e.closed_by_server().await);
    bystander_ok(&mut good).await;
    server.stop().await;
}

#[tokio::test]
async fn oversized_option_and_garbage_greeting_reply_are_survived() {
    let (server, mut good) = setup().await;
    let mut c = RawClient::greet(server.addr).await;
    // Option length of 1 GiB: refused by closing, not by allocating.
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&(1u32 << 30).to_be_bytes());
    c.s.write_all(&b).await.expect("send");
    assert!(c.closed_by_server().await);

    // Client flags the server never offered.
    let mut d = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let mut greeting = [0u8; 18];
    tokio::io::AsyncReadExt::read_exact(&mut d, &mut greeting)
        .await
        .expect("greeting");
    d.write_all(&0xffff_0000u32.to_be_bytes())
        .await
        .expect("send");
    let mut d = RawClient { s: d };
    assert!(d.closed_by_server().await);
    bystander_ok(&mut good).await;
    server.stop().await;
}
