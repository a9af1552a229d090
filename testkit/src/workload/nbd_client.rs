//! An NBD client that presents a remote export as a [`BlockDevice`].
//!
//! The workload driver uses it to hammer an NBD server (Zebu's engine, or `nbdkit` in tests)
//! through the same trait that frontends use, so one driver checks both in-process devices
//! and real servers.
//!
//! Protocol subset (see the NBD protocol document, "fixed newstyle" negotiation):
//! - handshake: server greeting `NBDMAGIC` + `IHAVEOPT` + handshake flags; we require
//!   `FIXED_NEWSTYLE` and echo `NO_ZEROES` when offered;
//! - `NBD_OPT_GO` with the export name, falling back to `NBD_OPT_EXPORT_NAME` when the server
//!   answers `NBD_REP_ERR_UNSUP` (old servers);
//! - transmission: READ, WRITE (optionally FUA), FLUSH, TRIM, DISC with *simple* replies only.
//!   Structured replies are never requested, so a structured reply is a protocol violation.
//!
//! Concurrency: many requests are in flight on one TCP connection. Callers register a
//! pending entry (keyed by the request handle) and hand the encoded request to a writer task
//! over a channel; a reader task reads replies in whatever order the server sends them and
//! completes the matching entry. A request is therefore written whole even if its caller's
//! future is dropped halfway, which keeps the byte stream in sync.
//!
//! When the connection breaks (EOF, I/O error, protocol violation) every pending and future
//! request fails with [`BlockError::Unavailable`]: the client never reconnects by itself,
//! because a data-safety test must see the outage.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use zebu_engine::blockdev::{BlockDevice, BlockError, BoxFuture};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_GO: u32 = 7;

const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const INFO_EXPORT: u16 = 0;

/// Transmission flags the server sends for the export.
const TFLAG_READ_ONLY: u16 = 1 << 1;
const TFLAG_SEND_FLUSH: u16 = 1 << 2;
const TFLAG_SEND_FUA: u16 = 1 << 3;
const TFLAG_SEND_TRIM: u16 = 1 << 5;

const CMD_FLAG_FUA: u16 = 1;

/// Requests larger than this are refused locally; servers commonly cap payloads at 32 MiB.
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;

/// Longest option-reply payload we accept during negotiation (a hostile server could
/// otherwise make us allocate 4 GiB).
const MAX_OPTION_REPLY: u32 = 64 << 10;

/// Errors while connecting and negotiating. Once connected, errors are [`BlockError`]s.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("NBD {context} with {addr}: {source}")]
    Io {
        addr: String,
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("NBD server {addr} broke the protocol: {detail}")]
    Protocol { addr: String, detail: String },
    #[error("NBD server {addr} refused export {export:?} (reply {reply:#x}): {message}")]
    Refused {
        addr: String,
        export: String,
        reply: u32,
        message: String,
    },
}

/// The request types we send (NBD command numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Command {
    Read = 0,
    Write = 1,
    Disc = 2,
    Flush = 3,
    Trim = 4,
}

impl Command {
    fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disconnect",
            Command::Flush => "flush",
            Command::Trim => "trim",
        }
    }
}

/// One encoded request for the writer task: the 28-byte header and, for writes, the payload.
struct Outgoing {
    header: [u8; 28],
    payload: Option<Bytes>,
}

fn encode_header(flags: u16, cmd: Command, handle: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&(cmd as u16).to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

struct Pending {
    cmd: Command,
    offset: u64,
    /// Bytes of data that follow a successful reply (reads only).
    read_len: u32,
    reply: oneshot::Sender<Result<Bytes, BlockError>>,
}

/// Requests awaiting a reply, and why the connection died if it did. One lock covers both so
/// a request can never be registered after the reader drained the table.
#[derive(Default)]
struct PendingTable {
    map: HashMap<u64, Pending>,
    dead: Option<String>,
}

struct Shared {
    addr: String,
    table: std::sync::Mutex<PendingTable>,
    next_handle: AtomicU64,
    /// Set once DISC is sent, so the server closing the connection is not reported as a loss.
    disconnecting: AtomicBool,
}

impl Shared {
    fn table(&self) -> std::sync::MutexGuard<'_, PendingTable> {
        self.table
            .lock()
            .expect("invariant: pending table lock not poisoned")
    }

    /// Marks the connection dead and fails everything pending.
    fn kill(&self, why: String) {
        let drained: Vec<Pending> = {
            let mut t = self.table();
            if t.dead.is_none() {
                if self.disconnecting.load(Ordering::Relaxed) {
                    tracing::debug!(addr = %self.addr, reason = %why, "NBD connection closed");
                } else {
                    tracing::warn!(addr = %self.addr, reason = %why, "NBD connection lost");
                }
                t.dead = Some(why.clone());
            }
            t.map.drain().map(|(_, p)| p).collect()
        };
        for p in drained {
            let _ = p.reply.send(Err(BlockError::Unavailable(format!(
                "NBD connection to {} lost during {} at {}: {why}",
                self.addr,
                p.cmd.name(),
                p.offset
            ))));
        }
    }
}

/// A connected NBD export. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct NbdClient {
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Outgoing>,
    writer: tokio::task::JoinHandle<()>,
    size: u64,
    flags: u16,
}

impl NbdClient {
    /// Connects to `addr` (host:port) and opens export `export`.
    pub async fn connect(addr: &str, export: &str) -> Result<NbdClient, NbdError> {
        let io = |context: &'static str| {
            let addr = addr.to_string();
            move |source| NbdError::Io {
                addr,
                context,
                source,
            }
        };
        let mut stream = TcpStream::connect(addr).await.map_err(io("connect"))?;
        stream.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
        let (size, flags) = negotiate(&mut stream, addr, export).await?;
        tracing::debug!(addr, export, size, flags, "NBD export opened");

        let shared = Arc::new(Shared {
            addr: addr.to_string(),
            table: std::sync::Mutex::new(PendingTable::default()),
            next_handle: AtomicU64::new(1),
            disconnecting: AtomicBool::new(false),
        });
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(reader_task(shared.clone(), rd));
        let writer = tokio::spawn(writer_task(shared.clone(), wr, rx));
        Ok(NbdClient {
            shared,
            tx,
            writer,
            size,
            flags,
        })
    }

    /// The transmission flags the server advertised for the export.
    pub fn transmission_flags(&self) -> u16 {
        self.flags
    }

    /// Writes `data` at `offset` with FUA: durable when acknowledged (the device's
    /// `write_fua`).
    async fn fua_write(&self, offset: u64, data: Bytes) -> Result<(), BlockError> {
        if self.flags & TFLAG_SEND_FUA == 0 {
            return Err(BlockError::Io(format!(
                "NBD server {} does not support FUA writes",
                self.shared.addr
            )));
        }
        self.write_with(offset, data, CMD_FLAG_FUA).await
    }

    /// Sends DISC once every request already queued is written, and waits until it is sent.
    /// In-flight requests still get their replies if the server sends them before closing.
    pub async fn disconnect(self) {
        let NbdClient { tx, writer, .. } = self;
        drop(tx);
        let _ = writer.await;
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<u32, BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => {}
            _ => {
                return Err(BlockError::OutOfRange {
                    offset,
                    length: len,
                    size: self.size,
                });
            }
        }
        if len > MAX_REQUEST_BYTES {
            return Err(BlockError::Io(format!(
                "NBD request of {len} bytes at {offset} exceeds the {MAX_REQUEST_BYTES}-byte limit"
            )));
        }
        Ok(len as u32)
    }

    async fn write_with(&self, offset: u64, data: Bytes, flags: u16) -> Result<(), BlockError> {
        if self.flags & TFLAG_READ_ONLY != 0 {
            return Err(BlockError::Io(format!(
                "NBD export at {} is read-only",
                self.shared.addr
            )));
        }
        let len = self.check_range(offset, data.len() as u64)?;
        self.request(Command::Write, flags, offset, len, Some(data))
            .await
            .map(drop)
    }

    /// Registers, sends and waits for one request.
    async fn request(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<Bytes>,
    ) -> Result<Bytes, BlockError> {
        let handle = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = oneshot::channel();
        {
            let mut t = self.shared.table();
            if let Some(why) = &t.dead {
                return Err(BlockError::Unavailable(format!(
                    "NBD connection to {} is down: {why}",
                    self.shared.addr
                )));
            }
            t.map.insert(
                handle,
                Pending {
                    cmd,
                    offset,
                    read_len: if cmd == Command::Read { len } else { 0 },
                    reply: reply_tx,
                },
            );
        }
        let out = Outgoing {
            header: encode_header(flags, cmd, handle, offset, len),
            payload,
        };
        if self.tx.send(out).is_err() {
            self.shared.table().map.remove(&handle);
            return Err(BlockError::Unavailable(format!(
                "NBD connection to {} is closed",
                self.shared.addr
            )));
        }
        reply_rx.await.unwrap_or_else(|_| {
            Err(BlockError::Unavailable(format!(
                "NBD connection to {} dropped the {} at {offset}",
                self.shared.addr,
                cmd.name()
            )))
        })
    }
}

impl BlockDevice for NbdClient {
    fn size(&self) -> u64 {
        self.size
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            let len = self.check_range(offset, len)?;
            if len == 0 {
                return Ok(Bytes::new());
            }
            self.request(Command::Read, 0, offset, len, None).await
        })
    }

    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(self.write_with(offset, data, 0))
    }

    fn write_fua(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(self.fua_write(offset, data))
    }

    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            if self.flags & TFLAG_SEND_TRIM == 0 {
                return Err(BlockError::Io(format!(
                    "NBD server {} does not support trim",
                    self.shared.addr
                )));
            }
            let len = self.check_range(offset, len)?;
            self.request(Command::Trim, 0, offset, len, None)
                .await
                .map(drop)
        })
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            // Without SEND_FLUSH the protocol forbids the command; pretending success would
            // let a data-safety test believe writes are durable when nothing said so.
            if self.flags & TFLAG_SEND_FLUSH == 0 {
                return Err(BlockError::Io(format!(
                    "NBD server {} does not support flush",
                    self.shared.addr
                )));
            }
            self.request(Command::Flush, 0, 0, 0, None).await.map(drop)
        })
    }
}

/// Maps an NBD error number (errno values fixed by the protocol) to a [`BlockError`].
fn server_error(addr: &str, cmd: Command, offset: u64, code: u32) -> BlockError {
    let name = match code {
        1 => "EPERM",
        5 => "EIO",
        12 => "ENOMEM",
        22 => "EINVAL",
        28 => "ENOSPC",
        75 => "EOVERFLOW",
        95 => "ENOTSUP",
        108 => "ESHUTDOWN",
        _ => "unknown error",
    };
    let msg = format!(
        "NBD server {addr} failed {} at {offset}: {name} ({code})",
        cmd.name()
    );
    match code {
        28 => BlockError::NoSpace(msg),
        108 => BlockError::Unavailable(msg),
        _ => BlockError::Io(msg),
    }
}

async fn reader_task(shared: Arc<Shared>, rd: OwnedReadHalf) {
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let why = loop {
        match read_one_reply(&shared, &mut rd).await {
            Ok(()) => {}
            Err(why) => break why,
        }
    };
    shared.kill(why);
}

async fn read_one_reply(shared: &Shared, rd: &mut BufReader<OwnedReadHalf>) -> Result<(), String> {
    let mut hdr = [0u8; 16];
    rd.read_exact(&mut hdr).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            "server closed the connection".to_string()
        } else {
            format!("reading a reply: {e}")
        }
    })?;
    let magic = u32::from_be_bytes(hdr[0..4].try_into().expect("invariant: 4-byte slice"));
    if magic == STRUCTURED_REPLY_MAGIC {
        return Err("structured reply although none was negotiated".into());
    }
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(format!("bad reply magic {magic:#x}"));
    }
    let error = u32::from_be_bytes(hdr[4..8].try_into().expect("invariant: 4-byte slice"));
    let handle = u64::from_be_bytes(hdr[8..16].try_into().expect("invariant: 8-byte slice"));
    let pending = shared
        .table()
        .map
        .remove(&handle)
        .ok_or_else(|| format!("reply for unknown handle {handle}"))?;
    let result = if error != 0 {
        Err(server_error(
            &shared.addr,
            pending.cmd,
            pending.offset,
            error,
        ))
    } else if pending.read_len > 0 {
        let mut buf = BytesMut::zeroed(pending.read_len as usize);
        if let Err(e) = rd.read_exact(&mut buf).await {
            let msg = format!("reading {} bytes of read data: {e}", pending.read_len);
            let _ = pending
                .reply
                .send(Err(BlockError::Unavailable(msg.clone())));
            return Err(msg);
        }
        Ok(buf.freeze())
    } else {
        Ok(Bytes::new())
    };
    // The caller may have given up on the request; its reply is then simply dropped.
    let _ = pending.reply.send(result);
    Ok(())
}

async fn writer_task(
    shared: Arc<Shared>,
    wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    let result: std::io::Result<()> = async {
        while let Some(first) = rx.recv().await {
            // Batch whatever is already queued into one flush: with many requests in flight
            // this turns one syscall per request into one per batch.
            let mut next = Some(first);
            while let Some(out) = next {
                wr.write_all(&out.header).await?;
                if let Some(p) = &out.payload {
                    wr.write_all(p).await?;
                }
                next = rx.try_recv().ok();
            }
            wr.flush().await?;
        }
        // Every client handle is gone: say goodbye properly.
        shared.disconnecting.store(true, Ordering::Relaxed);
        wr.write_all(&encode_header(0, Command::Disc, 0, 0, 0))
            .await?;
        wr.flush().await?;
        wr.shutdown().await
    }
    .await;
    if let Err(e) = result {
        shared.kill(format!("writing a request: {e}"));
    }
}

/// Runs the fixed-newstyle handshake; returns the export size and transmission flags.
async fn negotiate(s: &mut TcpStream, addr: &str, export: &str) -> Result<(u64, u16), NbdError> {
    let io = |context: &'static str| {
        let addr = addr.to_string();
        move |source| NbdError::Io {
            addr,
            context,
            source,
        }
    };
    let proto = |detail: String| NbdError::Protocol {
        addr: addr.to_string(),
        detail,
    };

    let magic = s.read_u64().await.map_err(io("reading the greeting"))?;
    let opt_magic = s.read_u64().await.map_err(io("reading the greeting"))?;
    if magic != NBDMAGIC || opt_magic != IHAVEOPT {
        return Err(proto(format!(
            "not a newstyle NBD server (greeting {magic:#x} {opt_magic:#x})"
        )));
    }
    let hflags = s.read_u16().await.map_err(io("reading the greeting"))?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto("server does not offer fixed newstyle".into()));
    }
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let cflags = u32::from(FLAG_FIXED_NEWSTYLE)
        | if no_zeroes {
            u32::from(FLAG_NO_ZEROES)
        } else {
            0
        };
    s.write_u32(cflags)
        .await
        .map_err(io("sending client flags"))?;

    // NBD_OPT_GO: name length, name, zero information requests.
    let mut data = BytesMut::new();
    data.put_u32(export.len() as u32);
    data.put_slice(export.as_bytes());
    data.put_u16(0);
    send_option(s, OPT_GO, &data)
        .await
        .map_err(io("sending NBD_OPT_GO"))?;

    let mut export_info: Option<(u64, u16)> = None;
    loop {
        let rmagic = s.read_u64().await.map_err(io("reading an option reply"))?;
        let opt = s.read_u32().await.map_err(io("reading an option reply"))?;
        let rtype = s.read_u32().await.map_err(io("reading an option reply"))?;
        let rlen = s.read_u32().await.map_err(io("reading an option reply"))?;
        if rmagic != OPT_REPLY_MAGIC || opt != OPT_GO {
            return Err(proto(format!(
                "bad option reply (magic {rmagic:#x}, option {opt})"
            )));
        }
        if rlen > MAX_OPTION_REPLY {
            return Err(proto(format!("option reply of {rlen} bytes")));
        }
        let mut payload = vec![0u8; rlen as usize];
        s.read_exact(&mut payload)
            .await
            .map_err(io("reading an option reply"))?;
        match rtype {
            REP_ACK => break,
            REP_INFO => {
                if payload.len() >= 2 && u16::from_be_bytes([payload[0], payload[1]]) == INFO_EXPORT
                {
                    if payload.len() != 12 {
                        return Err(proto(format!("NBD_INFO_EXPORT of {} bytes", payload.len())));
                    }
                    let size = u64::from_be_bytes(
                        payload[2..10].try_into().expect("invariant: 8-byte slice"),
                    );
                    let flags = u16::from_be_bytes([payload[10], payload[11]]);
                    export_info = Some((size, flags));
                }
                // Other information (name, description, block sizes) is not needed.
            }
            REP_ERR_UNSUP => {
                tracing::debug!(addr, "server lacks NBD_OPT_GO, using NBD_OPT_EXPORT_NAME");
                return export_name(s, addr, export, no_zeroes).await;
            }
            t if t & (1 << 31) != 0 => {
                return Err(NbdError::Refused {
                    addr: addr.to_string(),
                    export: export.to_string(),
                    reply: t,
                    message: String::from_utf8_lossy(&payload).into_owned(),
                });
            }
            t => return Err(proto(format!("unexpected option reply type {t}"))),
        }
    }
    export_info.ok_or_else(|| proto("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into()))
}

async fn send_option(s: &mut TcpStream, opt: u32, data: &[u8]) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(16 + data.len());
    buf.put_u64(IHAVEOPT);
    buf.put_u32(opt);
    buf.put_u32(data.len() as u32);
    buf.put_slice(data);
    s.write_all(&buf).await
}

/// The old way to enter transmission: no reply on success, the server just closes on refusal.
async fn export_name(
    s: &mut TcpStream,
    addr: &str,
    export: &str,
    no_zeroes: bool,
) -> Result<(u64, u16), NbdError> {
    let io = |context: &'static str| {
        let addr = addr.to_string();
        move |source| NbdError::Io {
            addr,
            context,
            source,
        }
    };
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())
        .await
        .map_err(io("sending NBD_OPT_EXPORT_NAME"))?;
    let size = s
        .read_u64()
        .await
        .map_err(io("reading the export size (export refused?)"))?;
    let flags = s.read_u16().await.map_err(io("reading export flags"))?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        s.read_exact(&mut zeroes)
            .await
            .map_err(io("reading handshake padding"))?;
    }
    Ok((size, flags))
}
