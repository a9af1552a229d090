//! Shared helpers for the NBD integration tests: an in-process server on a loopback port,
//! a raw protocol client for hostile inputs, and device wrappers that record or delay calls.
#![allow(dead_code)] // Each test crate uses a different subset.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture};
use zebu_engine::nbd::wire::*;
use zebu_engine::nbd::{NbdConfig, NbdError, NbdServer};

pub const EXPORT: &str = "vol";

pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), NbdError>>>,
}

impl TestServer {
    pub async fn start(dev: Arc<dyn BlockDevice>) -> TestServer {
        let cfg = NbdConfig::new("127.0.0.1:0".parse().expect("literal address"), EXPORT);
        let server = NbdServer::bind(cfg, dev).await.expect("bind loopback");
        let addr = server.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = stopped.await;
        }));
        TestServer {
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn uri(&self) -> String {
        format!("nbd://{}/{}", self.addr, EXPORT)
    }

    /// Stops the server and checks it shut down cleanly and promptly.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), t)
                .await
                .expect("server stops within 10 s")
                .expect("server task did not panic")
                .expect("server returned Ok");
        }
    }
}

/// A raw NBD client that speaks only what the tests need, so they can also speak it wrong.
pub struct RawClient {
    pub s: TcpStream,
}

pub struct OptReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl RawClient {
    /// Connects and completes the greeting (fixed newstyle, no zeroes).
    pub async fn greet(addr: SocketAddr) -> RawClient {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(s.read_u64().await.expect("magic"), NBD_MAGIC);
        assert_eq!(s.read_u64().await.expect("ihaveopt"), IHAVEOPT);
        let flags = s.read_u16().await.expect("flags");
        assert_eq!(flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        s.write_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .await
            .expect("client flags");
        RawClient { s }
    }

    pub async fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).await.expect("send option");
    }

    pub async fn read_opt_reply(&mut self) -> OptReply {
        assert_eq!(
            self.s.read_u64().await.expect("reply magic"),
            OPT_REPLY_MAGIC
        );
        let option = self.s.read_u32().await.expect("option");
        let reply_type = self.s.read_u32().await.expect("type");
        let len = self.s.read_u32().await.expect("len");
        let mut data = vec![0; len as usize];
        self.s.read_exact(&mut data).await.expect("reply data");
        OptReply {
            option,
            reply_type,
            data,
        }
    }

    pub fn go_data(name: &str) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        d
    }

    /// Greets and selects the export with NBD_OPT_GO; returns the size and flags.
    pub async fn connect(addr: SocketAddr) -> (RawClient, u64, u16) {
        let mut c = RawClient::greet(addr).await;
        c.send_option(OPT_GO, &RawClient::go_data(EXPORT)).await;
        let mut export = None;
        loop {
            let r = c.read_opt_reply().await;
            assert_eq!(r.option, OPT_GO);
            match r.reply_type {
                REP_INFO => {
                    let kind = u16::from_be_bytes([r.data[0], r.data[1]]);
                    if kind == INFO_EXPORT {
                        let size = u64::from_be_bytes(r.data[2..10].try_into().expect("8"));
                        let flags = u16::from_be_bytes([r.data[10], r.data[11]]);
                        export = Some((size, flags));
                    }
                }
                REP_ACK => break,
                other => panic!("unexpected reply {other:#x} to GO"),
            }
        }
        let (size, flags) = export.expect("INFO_EXPORT sent before ACK");
        (c, size, flags)
    }

    pub async fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let mut b = Vec::with_capacity(28 + payload.len());
        b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&command.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        b.extend_from_slice(payload);
        self.s.write_all(&b).await.expect("send request");
    }

    /// Reads a simple reply header: (cookie, error).
    pub async fn read_reply(&mut self) -> (u64, u32) {
        let magic = self.s.read_u32().await.expect("reply magic");
        assert_eq!(magic, SIMPLE_REPLY_MAGIC);
        let error = self.s.read_u32().await.expect("error");
        let cookie = self.s.read_u64().await.expect("cookie");
        (cookie, error)
    }

    pub async fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.send_request(CMD_WRITE, 0, cookie, offset, data.len() as u32, data)
            .await;
        let (c, e) = self.read_reply().await;
        assert_eq!(c, cookie);
        e
    }

    pub async fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        self.send_request(CMD_READ, 0, cookie, offset, len, &[])
            .await;
        let (c, e) = self.read_reply().await;
        assert_eq!(c, cookie);
        if e != 0 {
            return Err(e);
        }
        let mut buf = vec![0; len as usize];
        self.s.read_exact(&mut buf).await.expect("read payload");
        Ok(buf)
    }

    /// True if the server closed the connection (EOF or reset) within five seconds.
    pub async fn closed_by_server(&mut self) -> bool {
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(5), self.s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(_)) | Err(_) => false,
        }
    }
}

/// Counts the calls a device receives, in order, for checking FUA and zeroing behaviour.
pub struct Recording<D> {
    pub inner: D,
    pub log: std::sync::Mutex<Vec<String>>,
    pub flushes: AtomicU64,
    /// Reads at this offset are delayed, to force replies out of order.
    pub slow_read_offset: Option<(u64, Duration)>,
}

impl<D: BlockDevice> Recording<D> {
    pub fn new(inner: D) -> Recording<D> {
        Recording {
            inner,
            log: std::sync::Mutex::new(Vec::new()),
            flushes: AtomicU64::new(0),
            slow_read_offset: None,
        }
    }
    fn note(&self, s: String) {
        self.log.lock().expect("log lock").push(s);
    }
    pub fn calls(&self) -> Vec<String> {
        self.log.lock().expect("log lock").clone()
    }
}

impl<D: BlockDevice> BlockDevice for Recording<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            if let Some((slow, delay)) = self.slow_read_offset
                && slow == offset
            {
                tokio::time::sleep(delay).await;
            }
            self.note(format!("read {offset} {len}"));
            self.inner.read(offset, len).await
        })
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        self.note(format!("write {offset} {}", data.len()));
        self.inner.write(offset, data)
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        self.note(format!("unmap {offset} {len}"));
        self.inner.unmap(offset, len)
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        self.note("flush".to_owned());
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
}
