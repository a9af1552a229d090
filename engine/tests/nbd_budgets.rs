//! Clients that pipeline requests and never read the replies: what they hold counts against
//! their own connection only, so every other client of the export keeps being served; a
//! connection whose replies stay unread past the reply timeout is dropped; and the number of
//! connections an export serves is bounded.

mod nbd_common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use nbd_common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};
use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture, MemDevice};
use zebu_engine::nbd::wire::*;
use zebu_engine::nbd::{NbdConfig, NbdServer};

const SIZE: u64 = 64 << 20;
const MIB: u32 = 1 << 20;

fn request(command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&command.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&length.to_be_bytes());
    b
}

/// Bytes that differ per offset, so a reply with another region's data cannot pass.
fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i) % 251) as u8 ^ (offset >> 20) as u8)
        .collect()
}

/// Starts a server with `tune` applied to the default configuration.
async fn server(
    dev: Arc<dyn BlockDevice>,
    tune: impl FnOnce(&mut NbdConfig),
) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let mut cfg = NbdConfig::new("127.0.0.1:0".parse().expect("literal"), EXPORT);
    tune(&mut cfg);
    let server = NbdServer::bind(cfg, dev).await.expect("bind");
    let addr = server.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .run(async move {
                let _ = stopped.await;
            })
            .await
            .expect("server ran");
    });
    (addr, stop, task)
}

async fn stop(stop: oneshot::Sender<()>, task: tokio::task::JoinHandle<()>) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("server stops")
        .expect("server task");
}

/// A client that sends `n` pipelined 1 MiB READs and then reads nothing.
async fn greedy(addr: SocketAddr, first_cookie: u64, n: u64) -> RawClient {
    let (mut c, _, _) = RawClient::connect(addr).await;
    let mut reqs = Vec::new();
    for i in 0..n {
        reqs.extend(request(
            CMD_READ,
            first_cookie + i,
            (i % 32) * u64::from(MIB),
            MIB,
        ));
    }
    // Small enough to sit in the socket buffers even when the server stops reading.
    c.s.write_all(&reqs).await.expect("send reads");
    c
}

/// Reads `n` 1 MiB READ replies and checks each against the device's pattern.
async fn drain(c: &mut RawClient, first_cookie: u64, n: u64) {
    let mut seen = Vec::new();
    for _ in 0..n {
        let (cookie, error) = c.read_reply().await;
        assert_eq!(error, 0, "read {cookie}");
        let i = cookie - first_cookie;
        let mut buf = vec![0u8; MIB as usize];
        c.s.read_exact(&mut buf).await.expect("payload");
        let off = (i % 32) * u64::from(MIB);
        assert!(buf == pattern(off, MIB as usize), "data of read {cookie}");
        seen.push(cookie);
    }
    seen.sort_unstable();
    assert_eq!(seen, (first_cookie..first_cookie + n).collect::<Vec<_>>());
}

async fn filled_device() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(SIZE));
    for i in 0..32u64 {
        let off = i * u64::from(MIB);
        dev.write(off, pattern(off, MIB as usize).into())
            .await
            .expect("fill");
    }
    dev
}

/// One round of a normal client's I/O, each request within a few seconds (a liveness bound,
/// not a speed check: it fails only when the client is stalled outright).
async fn normal_io(c: &mut RawClient, round: u64) {
    let off = 40 * u64::from(MIB) + round * 65536;
    let data = pattern(off, 65536);
    let io = async {
        assert_eq!(c.write(round * 3, off, &data).await, 0);
        assert_eq!(c.read(round * 3 + 1, off, 65536).await.expect("read"), data);
        let big = c.read(round * 3 + 2, 0, MIB).await.expect("1 MiB read");
        assert!(big == pattern(0, MIB as usize));
    };
    tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .unwrap_or_else(|_| panic!("round {round} of a normal client stalled"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_replies_do_not_stall_other_clients_of_the_export() {
    let dev = filled_device().await;
    // The default budgets: 16 MiB per connection, 24 MiB for the export.
    let (addr, stop_tx, task) = server(dev, |_| {}).await;
    let mut greedy_clients = Vec::new();
    for g in 0..3u64 {
        greedy_clients.push(greedy(addr, 1000 * (g + 1), 64).await);
    }
    // Let them fill whatever they can.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let (mut normal, _, _) = RawClient::connect(addr).await;
    for round in 0..20 {
        normal_io(&mut normal, round).await;
    }
    // A client connected after the greedy ones also gets served.
    let (mut late, _, _) = RawClient::connect(addr).await;
    normal_io(&mut late, 100).await;

    // The greedy clients lost nothing: once they read, every reply arrives, with its data.
    for (g, c) in greedy_clients.iter_mut().enumerate() {
        drain(c, 1000 * (g as u64 + 1), 64).await;
    }
    normal_io(&mut normal, 200).await;
    drop((normal, late, greedy_clients));
    stop(stop_tx, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_that_leaves_replies_unread_past_the_reply_timeout_is_dropped() {
    let dev = filled_device().await;
    let (addr, stop_tx, task) = server(dev, |c| c.reply_timeout = Duration::from_secs(1)).await;
    let mut g = greedy(addr, 1, 64).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // What the socket buffers held still arrives, then the server's close: not all 64.
    let mut replies = 0;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut h = [0u8; 16];
            if g.s.read_exact(&mut h).await.is_err() {
                return true;
            }
            let mut buf = vec![0u8; MIB as usize];
            if g.s.read_exact(&mut buf).await.is_err() {
                return true;
            }
            replies += 1;
        }
    })
    .await
    .unwrap_or(false);
    assert!(closed, "the server kept the stalled connection open");
    assert!(
        replies < 64,
        "all {replies} replies arrived: nothing was dropped"
    );

    // Everything it held was given back: a fresh connection gets its whole budget.
    let mut fresh = greedy(addr, 500, 12).await;
    drain(&mut fresh, 500, 12).await;
    let (mut normal, _, _) = RawClient::connect(addr).await;
    normal_io(&mut normal, 0).await;
    drop((fresh, normal));
    stop(stop_tx, task).await;
}

/// The timeout is about replies nobody reads, not about slow readers: a client that keeps
/// reading, however slowly, keeps its connection. At ~800 KB/s the kernel lets the server
/// write again only every second or so (it waits for a third of the send buffer to be
/// free), which the server must not take for a client that reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_reader_that_keeps_reading_is_not_dropped() {
    let dev = filled_device().await;
    let (addr, stop_tx, task) = server(dev, |c| c.reply_timeout = Duration::from_secs(1)).await;
    let n = 16;
    let mut c = greedy(addr, 1, n).await;
    let mut got = 0u64;
    let slow = async {
        while got < n {
            let (cookie, error) = c.read_reply().await;
            assert_eq!(error, 0);
            let off = ((cookie - 1) % 32) * u64::from(MIB);
            let mut buf = vec![0u8; MIB as usize];
            // 16 KiB at a time, one piece every 20 ms: far slower than the server.
            for piece in buf.chunks_mut(16384) {
                c.s.read_exact(piece).await.expect("payload");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(buf == pattern(off, MIB as usize));
            got += 1;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), slow)
        .await
        .expect("slow reader finished");
    assert_eq!(got, n);
    drop(c);
    stop(stop_tx, task).await;
}

/// True if the server closes `s` without sending anything.
async fn refused(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test]
async fn connections_over_the_limit_are_refused_and_a_closed_one_frees_its_slot() {
    let (addr, stop_tx, task) = server(Arc::new(MemDevice::new(SIZE)), |c| {
        c.max_connections = 2;
    })
    .await;
    let (mut a, _, _) = RawClient::connect(addr).await;
    let (b, _, _) = RawClient::connect(addr).await;
    let mut third = TcpStream::connect(addr).await.expect("connect");
    assert!(refused(&mut third).await, "a third connection was served");

    // The two admitted connections work.
    assert_eq!(a.write(1, 0, &[7; 4096]).await, 0);
    drop(b);
    // The slot comes back once the server has seen the close.
    let mut admitted = None;
    for _ in 0..50 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut magic = [0u8; 8];
        if tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut magic))
            .await
            .is_ok_and(|r| r.is_ok())
        {
            admitted = Some(magic);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        admitted.map(u64::from_be_bytes),
        Some(NBD_MAGIC),
        "no slot after a connection closed"
    );
    assert_eq!(a.read(2, 0, 4096).await.expect("read"), vec![7; 4096]);
    drop(a);
    stop(stop_tx, task).await;
}

/// The engine waits for its NBD server to stop before its final flush: a client that reads
/// nothing must not hold that up for the whole reply timeout (60 s by default), only for a
/// short grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_the_reply_timeout_for_a_client_that_reads_nothing() {
    let server = TestServer::start(filled_device().await).await;
    let _stuck = greedy(server.addr, 1, 64).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // TestServer::stop requires the server to stop within 10 s.
    server.stop().await;
}

/// Holds every write until the gate opens, and counts the writes it holds.
struct GatedWrites {
    inner: MemDevice,
    gate: watch::Receiver<bool>,
    held: AtomicU64,
}

impl BlockDevice for GatedWrites {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        self.inner.read(offset, len)
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.held.fetch_add(1, Ordering::SeqCst);
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
            self.held.fetch_sub(1, Ordering::SeqCst);
            self.inner.write(offset, data).await
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        self.inner.unmap(offset, len)
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        self.inner.flush()
    }
}

/// A WRITE_ZEROES with NO_HOLE carries no payload but makes the device write real zeros,
/// one 1 MiB chunk at a time: it must cost its budgets that chunk, or a client could keep
/// thousands of them running from 28-byte requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeroing_requests_cost_the_zeros_they_have_in_flight() {
    let (open, gate) = watch::channel(false);
    let dev = Arc::new(GatedWrites {
        inner: MemDevice::new(SIZE),
        gate,
        held: AtomicU64::new(0),
    });
    let (addr, stop_tx, task) = server(dev.clone(), |_| {}).await;
    let (mut c, _, _) = RawClient::connect(addr).await;
    let n = 100u64;
    let mut reqs = Vec::new();
    for i in 0..n {
        let mut r = request(
            CMD_WRITE_ZEROES,
            10 + i,
            (i % 16) * 4 * u64::from(MIB),
            4 * MIB,
        );
        r[4..6].copy_from_slice(&CMD_FLAG_NO_HOLE.to_be_bytes());
        reqs.extend(r);
    }
    c.s.write_all(&reqs).await.expect("send");
    let mut held = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = dev.held.load(Ordering::SeqCst);
        if now == held {
            break;
        }
        held = now;
    }
    // 16 MiB per connection, 1 MiB (plus a unit) per request: at most 15 at once.
    assert!(
        held > 0 && held <= 16,
        "{held} zeroing requests write at once"
    );
    open.send(true).expect("gate");
    for _ in 0..n {
        let (_, error) = c.read_reply().await;
        assert_eq!(error, 0);
    }
    drop(c);
    stop(stop_tx, task).await;
}
