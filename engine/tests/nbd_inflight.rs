//! Many requests in flight on the NBD server: replies match their cookies whatever the mix
//! of sizes and completion order, and the byte budgets bound what a connection and an export
//! hold.

mod nbd_common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use nbd_common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{oneshot, watch};
use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture, MemDevice};
use zebu_engine::nbd::wire::*;
use zebu_engine::nbd::{NbdConfig, NbdServer};

const SIZE: u64 = 64 << 20;
const MIB: u64 = 1 << 20;

/// Delays every request by a few milliseconds chosen from its offset, so replies come back
/// in an order unrelated to the requests'.
struct Jittery(MemDevice);

fn jitter(offset: u64) -> Duration {
    Duration::from_micros((offset / 512).wrapping_mul(2_654_435_761) % 3000)
}

impl BlockDevice for Jittery {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            tokio::time::sleep(jitter(offset)).await;
            self.0.read(offset, len).await
        })
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            tokio::time::sleep(jitter(offset)).await;
            self.0.write(offset, data).await
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        self.0.unmap(offset, len)
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(())
        })
    }
}

/// Holds every write until the gate opens, and counts the write bytes it holds.
struct Gated {
    inner: MemDevice,
    gate: watch::Receiver<bool>,
    held: AtomicU64,
    peak: AtomicU64,
}

impl BlockDevice for Gated {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        self.inner.read(offset, len)
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            let n = data.len() as u64;
            let now = self.held.fetch_add(n, Ordering::SeqCst) + n;
            self.peak.fetch_max(now, Ordering::SeqCst);
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
            self.held.fetch_sub(n, Ordering::SeqCst);
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

fn request(command: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(28 + payload.len());
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&command.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&length.to_be_bytes());
    b.extend_from_slice(payload);
    b
}

/// A pattern that differs per region and per byte, so a reply carrying another request's
/// data (or data shifted by a few bytes) cannot pass.
fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i) * 7 / 5 + (offset >> 12)) as u8)
        .collect()
}

async fn read_header(rd: &mut OwnedReadHalf) -> (u64, u32) {
    assert_eq!(rd.read_u32().await.expect("magic"), SIMPLE_REPLY_MAGIC);
    let error = rd.read_u32().await.expect("error");
    (rd.read_u64().await.expect("cookie"), error)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_in_flight_requests_of_mixed_sizes_get_replies_matching_their_cookies() {
    let server = TestServer::start(Arc::new(Jittery(MemDevice::new(SIZE)))).await;
    let (c, _, _) = RawClient::connect(server.addr).await;
    let (mut rd, mut wr) = c.s.into_split();

    // Regions of mixed sizes, laid out without overlap: 512 B to 1 MiB + 4 KiB, some not
    // 4 KiB aligned.
    let sizes = [
        4096usize,
        512,
        65536,
        3000,
        (1 << 20) + 4096,
        131072,
        4096,
        700,
    ];
    let mut regions = Vec::new();
    let mut at = 0u64;
    for i in 0..160 {
        let len = sizes[i % sizes.len()];
        regions.push((at, len));
        at += len as u64 + 512;
    }
    assert!(at < SIZE);

    // Every write pipelined before any reply is read.
    let mut reqs = Vec::new();
    for (i, &(off, len)) in regions.iter().enumerate() {
        reqs.extend_from_slice(&request(
            CMD_WRITE,
            10_000 + i as u64,
            off,
            len as u32,
            &pattern(off, len),
        ));
    }
    let sender = tokio::spawn(async move {
        wr.write_all(&reqs).await.expect("send writes");
        wr
    });
    let mut seen = Vec::new();
    for _ in 0..regions.len() {
        let (cookie, error) = read_header(&mut rd).await;
        assert_eq!(error, 0, "write {cookie}");
        seen.push(cookie);
    }
    let mut wr = sender.await.expect("sender");
    seen.sort_unstable();
    assert_eq!(
        seen,
        (10_000..10_000 + regions.len() as u64).collect::<Vec<_>>()
    );

    // Reads of every region in reverse order, with reads past the end (EINVAL, no payload)
    // and flushes mixed in; all in flight at once.
    let mut expect: HashMap<u64, Option<(u64, usize)>> = HashMap::new();
    let mut reqs = Vec::new();
    for (i, &(off, len)) in regions.iter().enumerate().rev() {
        let cookie = 20_000 + i as u64;
        reqs.extend_from_slice(&request(CMD_READ, cookie, off, len as u32, &[]));
        expect.insert(cookie, Some((off, len)));
        if i % 17 == 0 {
            let bad = 30_000 + i as u64;
            reqs.extend_from_slice(&request(CMD_READ, bad, SIZE - 512, 4096, &[]));
            expect.insert(bad, None);
            let flush = 40_000 + i as u64;
            reqs.extend_from_slice(&request(CMD_FLUSH, flush, 0, 0, &[]));
            expect.insert(flush, None);
        }
    }
    let sender = tokio::spawn(async move {
        wr.write_all(&reqs).await.expect("send reads");
        wr
    });
    let mut order = Vec::new();
    while !expect.is_empty() {
        let (cookie, error) = read_header(&mut rd).await;
        order.push(cookie);
        let want = expect
            .remove(&cookie)
            .unwrap_or_else(|| panic!("reply for unknown or repeated cookie {cookie}"));
        match want {
            Some((off, len)) => {
                assert_eq!(error, 0, "read {cookie}");
                let mut buf = vec![0u8; len];
                rd.read_exact(&mut buf).await.expect("read payload");
                assert!(
                    buf == pattern(off, len),
                    "data of read {cookie} at {off}+{len}"
                );
            }
            None if cookie >= 40_000 => assert_eq!(error, 0, "flush {cookie}"),
            None => assert_eq!(error, NbdErrno::Inval as u32, "read past the end {cookie}"),
        }
    }
    // The jitter must actually have reordered something, or this test proves less.
    let mut sorted = order.clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    assert_ne!(order, sorted, "replies came back in request order");
    let _ = sender.await.expect("sender");
    server.stop().await;
}

/// Starts a server with small budgets; returns it, its address and a stop handle.
async fn budget_server(
    dev: Arc<dyn BlockDevice>,
    per_conn: u64,
    per_export: u64,
) -> (
    std::net::SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let mut cfg = NbdConfig::new("127.0.0.1:0".parse().expect("literal"), EXPORT);
    cfg.max_inflight_bytes = per_conn;
    cfg.max_volume_inflight_bytes = per_export;
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

/// Sends `n` 1 MiB writes from a task (the server may stop reading them); returns the
/// reading half.
async fn pipeline_writes(
    addr: std::net::SocketAddr,
    base: u64,
    first_cookie: u64,
    n: u64,
) -> (OwnedReadHalf, tokio::task::JoinHandle<()>) {
    let (c, _, _) = RawClient::connect(addr).await;
    let (rd, mut wr) = c.s.into_split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let off = base + i * MIB;
            let req = request(
                CMD_WRITE,
                first_cookie + i,
                off,
                MIB as u32,
                &pattern(off, MIB as usize),
            );
            wr.write_all(&req).await.expect("send write");
        }
        // Keep the write half open until the replies are read.
        std::future::pending::<()>().await;
    });
    (rd, sender)
}

async fn settle(dev: &Gated) -> u64 {
    // The held count stops changing once the server has stopped reading.
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = dev.held.load(Ordering::SeqCst);
        if now == last {
            return now;
        }
        last = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_bytes_in_flight_are_bounded_per_connection_and_per_export() {
    let (open, gate) = watch::channel(false);
    let dev = Arc::new(Gated {
        inner: MemDevice::new(SIZE),
        gate,
        held: AtomicU64::new(0),
        peak: AtomicU64::new(0),
    });
    // 1 MiB writes cost 1 MiB + 1 KiB: three fit in 4 MiB, five in 6 MiB.
    let (addr, stop, task) = budget_server(dev.clone(), 4 * MIB, 6 * MIB).await;

    let (mut rd_a, send_a) = pipeline_writes(addr, 0, 100, 20).await;
    assert_eq!(
        settle(&dev).await,
        3 * MIB,
        "one connection holds what its budget allows"
    );
    let (mut rd_b, send_b) = pipeline_writes(addr, 20 * MIB, 200, 20).await;
    assert_eq!(
        settle(&dev).await,
        5 * MIB,
        "the second connection gets what is left of the export's budget"
    );
    assert!(dev.peak.load(Ordering::SeqCst) <= 6 * MIB);

    open.send(true).expect("gate");
    for (rd, first) in [(&mut rd_a, 100u64), (&mut rd_b, 200)] {
        let mut cookies = Vec::new();
        for _ in 0..20 {
            let (cookie, error) = read_header(rd).await;
            assert_eq!(error, 0);
            cookies.push(cookie);
        }
        cookies.sort_unstable();
        assert_eq!(cookies, (first..first + 20).collect::<Vec<_>>());
    }
    assert!(dev.peak.load(Ordering::SeqCst) <= 6 * MIB);
    for (i, off) in [(0u64, 0u64), (19, 19 * MIB), (25, 25 * MIB)] {
        let got = dev.inner.read(off, MIB).await.expect("read back");
        assert!(got == pattern(off, MIB as usize), "region {i}");
    }

    // Every unit came back: with the gate closed again, a fresh connection reaches its own
    // limit, not less.
    send_a.abort();
    send_b.abort();
    drop((rd_a, rd_b));
    open.send(false).expect("gate");
    let (mut rd_c, send_c) = pipeline_writes(addr, 40 * MIB, 300, 6).await;
    assert_eq!(settle(&dev).await, 3 * MIB, "budget leaked");
    open.send(true).expect("gate");
    for _ in 0..6 {
        assert_eq!(read_header(&mut rd_c).await.1, 0);
    }
    send_c.abort();

    // A write larger than the whole connection budget takes all of it and still completes,
    // as does one that fills the budget exactly after another is in flight.
    let (c, _, _) = RawClient::connect(addr).await;
    let mut c = c;
    let big = pattern(48 * MIB, 5 * MIB as usize);
    assert_eq!(c.write(400, 48 * MIB, &big).await, 0);
    let exact = 4 * MIB - 2 * 1024 - 64 * 1024;
    let (rd, mut wr) = c.s.into_split();
    let mut rd = rd;
    let mut reqs = request(CMD_WRITE, 401, 0, 64 * 1024, &pattern(0, 64 * 1024));
    reqs.extend(request(
        CMD_WRITE,
        402,
        MIB,
        exact as u32,
        &pattern(MIB, exact as usize),
    ));
    wr.write_all(&reqs).await.expect("send");
    let mut got = vec![read_header(&mut rd).await, read_header(&mut rd).await];
    got.sort_unstable();
    assert_eq!(got, vec![(401, 0), (402, 0)]);
    let back = dev.inner.read(48 * MIB, 5 * MIB).await.expect("read back");
    assert!(back == big);
    drop((rd, wr));

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("server stops")
        .expect("server task");
}
