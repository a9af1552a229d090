//! The transmission phase of one connection: one reader task, one writer task, and one
//! short task per request in between.
//!
//! ```text
//!   socket ──► reader ──spawn──► request task ──► device
//!                                     │ Reply {cookie, errno, data, permit}
//!   socket ◄── writer ◄──── mpsc ─────┘
//! ```
//!
//! The reader parses a request, takes permits from the connection's in-flight budget
//! (weighted by payload size, so a connection never holds more than
//! [`super::NbdConfig::max_inflight_bytes`] of request and reply data), reads a WRITE's
//! payload, and spawns the request. Requests run concurrently and reply in whatever order
//! they finish; the client matches replies by cookie. The permit travels with the reply and
//! is released only once the writer has put it on the socket, so read data waiting for the
//! socket counts against the budget too and a slow client slows its own reader.
//!
//! The writer batches: it writes every reply that is ready and flushes the socket when the
//! queue is empty, so a burst of 4 KiB replies costs few syscalls.
//!
//! The connection ends on NBD_CMD_DISC, EOF, a framing error (bad magic, a WRITE payload
//! over the limit: the byte stream can no longer be trusted), a write error on the socket,
//! or server shutdown. In every case the reader stops, requests already started finish and
//! their replies are sent if the socket still works, and then the socket closes. Errors on
//! one connection never touch another.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::NbdError;
use super::wire::*;
use crate::blockdev::{BlockDevice, BlockError};

/// Budget granularity: one permit per KiB in flight, plus one per request.
const PERMIT_UNIT: u64 = 1024;

/// Zeros for `NBD_CMD_WRITE_ZEROES` with `NO_HOLE`: the range is written in chunks of this
/// size, all sharing one static buffer.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

pub struct Limits {
    pub max_payload: u32,
    pub max_inflight_bytes: u64,
}

struct Reply {
    cookie: u64,
    error: u32,
    data: Option<Bytes>,
    _permit: OwnedSemaphorePermit,
}

/// Serves requests on `stream` until the connection ends. Returns `Ok` on an orderly end
/// (DISC, EOF between requests, shutdown) and the reason otherwise.
pub async fn serve_connection(
    stream: TcpStream,
    dev: Arc<dyn BlockDevice>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let (rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let writer_gone = Arc::new(Notify::new());
    let writer = tokio::spawn(write_replies(wr, rx, writer_gone.clone()));

    let budget_permits = (limits.max_inflight_bytes / PERMIT_UNIT).max(1);
    let budget = Arc::new(Semaphore::new(budget_permits as usize));
    let mut reader = Reader {
        rd: BufReader::with_capacity(256 * 1024, rd),
        dev,
        tx,
        budget,
        budget_permits,
        max_payload: limits.max_payload,
    };

    let result = tokio::select! {
        r = reader.run() => r,
        _ = shutdown.wait_for(|stop| *stop) => {
            tracing::debug!("server shutting down: closing connection");
            Ok(())
        }
        () = writer_gone.notified() => Err(NbdError::Protocol("reply writer stopped".to_owned())),
    };
    // Dropping the reader drops its reply sender; the writer ends once every request task
    // has sent its reply and dropped its own sender.
    drop(reader);
    match writer.await {
        Ok(Ok(())) => result,
        Ok(Err(e)) => result.and(Err(e)),
        Err(join) => result.and(Err(NbdError::Protocol(format!("writer task: {join}")))),
    }
}

struct Reader {
    rd: BufReader<OwnedReadHalf>,
    dev: Arc<dyn BlockDevice>,
    tx: mpsc::UnboundedSender<Reply>,
    budget: Arc<Semaphore>,
    budget_permits: u64,
    max_payload: u32,
}

impl Reader {
    async fn run(&mut self) -> Result<(), NbdError> {
        let size = self.dev.size();
        loop {
            let mut hb = [0u8; RequestHeader::LEN];
            match self.rd.read_exact(&mut hb).await {
                Ok(_) => {}
                // A client that closes between requests without DISC is rude but harmless.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
            let h = RequestHeader::parse(&hb);
            if h.magic != REQUEST_MAGIC {
                // Framing is lost: the protocol says to terminate the session.
                return Err(NbdError::Protocol(format!(
                    "bad request magic {:#x}",
                    h.magic
                )));
            }
            tracing::trace!(request = %h, "nbd request");

            let payload_len = if h.command == CMD_WRITE || h.command == CMD_READ {
                u64::from(h.length)
            } else {
                0
            };
            if payload_len > u64::from(self.max_payload) {
                if h.command == CMD_WRITE {
                    // Skipping up to 4 GiB of payload is not worth it; a client that ignores
                    // the advertised limit gets a hard disconnect, as the protocol allows.
                    return Err(NbdError::Protocol(format!(
                        "WRITE of {} bytes exceeds the maximum payload {}",
                        h.length, self.max_payload
                    )));
                }
                tracing::debug!(request = %h, "READ over the maximum payload");
                self.reply_now(h.cookie, NbdErrno::Inval).await?;
                continue;
            }
            let permits = (payload_len / PERMIT_UNIT + 1).min(self.budget_permits);
            let permit = self
                .budget
                .clone()
                .acquire_many_owned(permits as u32)
                .await
                .expect("invariant: the budget semaphore is never closed");

            let in_range = h.length > 0
                && h.offset
                    .checked_add(u64::from(h.length))
                    .is_some_and(|end| end <= size);
            let fua = h.flags & CMD_FLAG_FUA != 0;
            let op = match h.command {
                CMD_READ if in_range => Op::Read {
                    offset: h.offset,
                    len: u64::from(h.length),
                },
                CMD_WRITE => {
                    // The payload follows the header whatever we think of the request.
                    let data = self.read_payload(h.length as usize).await?;
                    if in_range {
                        Op::Write {
                            offset: h.offset,
                            data,
                            fua,
                        }
                    } else {
                        Op::Fail(range_errno(h.command, h.length))
                    }
                }
                CMD_FLUSH => Op::Flush,
                CMD_TRIM if in_range => Op::Trim {
                    offset: h.offset,
                    len: u64::from(h.length),
                    fua,
                },
                CMD_WRITE_ZEROES if in_range => Op::Zero {
                    offset: h.offset,
                    len: u64::from(h.length),
                    no_hole: h.flags & CMD_FLAG_NO_HOLE != 0,
                    fua,
                },
                CMD_READ | CMD_TRIM | CMD_WRITE_ZEROES => {
                    Op::Fail(range_errno(h.command, h.length))
                }
                CMD_DISC => {
                    tracing::debug!("client sent DISC");
                    return Ok(());
                }
                _ => {
                    // The command may have carried a payload we cannot know about; the
                    // protocol asks for EINVAL and we keep going, trusting the framing.
                    tracing::debug!(request = %h, "unknown command");
                    Op::Fail(NbdErrno::Inval)
                }
            };
            if let Op::Fail(errno) = op {
                tracing::debug!(request = %h, ?errno, "request refused");
                let _ = self.tx.send(Reply {
                    cookie: h.cookie,
                    error: errno as u32,
                    data: None,
                    _permit: permit,
                });
                continue;
            }
            let dev = self.dev.clone();
            let tx = self.tx.clone();
            let cookie = h.cookie;
            tokio::spawn(async move {
                let (error, data) = match op.execute(&*dev).await {
                    Ok(data) => (0, data),
                    Err((errno, e)) => {
                        tracing::warn!(cookie, error = %e, "nbd request failed");
                        (errno as u32, None)
                    }
                };
                // The writer may be gone (client disconnected); the work is done anyway.
                let _ = tx.send(Reply {
                    cookie,
                    error,
                    data,
                    _permit: permit,
                });
            });
        }
    }

    /// Reads exactly `len` payload bytes without zero-filling the buffer first (that memset
    /// costs as much as the copy for 1 MiB writes). `take` keeps the read from running into
    /// the next request even if the buffer got more capacity than asked for.
    async fn read_payload(&mut self, len: usize) -> Result<Bytes, NbdError> {
        let mut buf = BytesMut::with_capacity(len);
        while buf.len() < len {
            let want = (len - buf.len()) as u64;
            let n = (&mut self.rd).take(want).read_buf(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
        Ok(buf.freeze())
    }

    async fn reply_now(&self, cookie: u64, errno: NbdErrno) -> Result<(), NbdError> {
        let permit = self
            .budget
            .clone()
            .acquire_owned()
            .await
            .expect("invariant: the budget semaphore is never closed");
        self.tx
            .send(Reply {
                cookie,
                error: errno as u32,
                data: None,
                _permit: permit,
            })
            .map_err(|_| NbdError::Protocol("reply writer stopped".to_owned()))
    }
}

/// The protocol's choice for a range past the end: writes report no space, reads and
/// trims an invalid argument. A zero-length request is invalid whatever the command.
fn range_errno(command: u16, length: u32) -> NbdErrno {
    match command {
        CMD_WRITE | CMD_WRITE_ZEROES if length > 0 => NbdErrno::NoSpc,
        _ => NbdErrno::Inval,
    }
}

enum Op {
    Read {
        offset: u64,
        len: u64,
    },
    Write {
        offset: u64,
        data: Bytes,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Zero {
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
    },
    Fail(NbdErrno),
}

impl Op {
    async fn execute(self, dev: &dyn BlockDevice) -> Result<Option<Bytes>, (NbdErrno, BlockError)> {
        let fua = match self {
            Op::Read { offset, len } => {
                let data = dev.read(offset, len).await.map_err(errno)?;
                if data.len() as u64 != len {
                    // A short read would desynchronise the stream; report it instead.
                    return Err((
                        NbdErrno::Io,
                        BlockError::Io(format!(
                            "device returned {} bytes for a read of {len}",
                            data.len()
                        )),
                    ));
                }
                return Ok(Some(data));
            }
            Op::Write { offset, data, fua } => {
                dev.write(offset, data).await.map_err(errno)?;
                fua
            }
            Op::Flush => true,
            Op::Trim { offset, len, fua } => {
                dev.unmap(offset, len).await.map_err(errno)?;
                fua
            }
            Op::Zero {
                offset,
                len,
                no_hole,
                fua,
            } => {
                if no_hole {
                    // The client wants the blocks allocated: write real zeros.
                    let mut done = 0u64;
                    while done < len {
                        let n = (len - done).min(ZEROS.len() as u64);
                        let chunk = Bytes::from_static(&ZEROS[..n as usize]);
                        dev.write(offset + done, chunk).await.map_err(errno)?;
                        done += n;
                    }
                } else {
                    // The device reads unmapped ranges as zeros, so a hole is a valid zero.
                    dev.unmap(offset, len).await.map_err(errno)?;
                }
                fua
            }
            Op::Fail(e) => {
                return Err((e, BlockError::Io("refused".to_owned())));
            }
        };
        if fua {
            dev.flush().await.map_err(errno)?;
        }
        Ok(None)
    }
}

fn errno(e: BlockError) -> (NbdErrno, BlockError) {
    let n = match &e {
        BlockError::OutOfRange { .. } => NbdErrno::Inval,
        BlockError::NoSpace(_) => NbdErrno::NoSpc,
        // A faulted volume fails I/O like a dead disk; EIO is what filesystems expect.
        BlockError::Io(_) | BlockError::Unavailable(_) => NbdErrno::Io,
    };
    (n, e)
}

async fn write_replies(
    wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    gone: Arc<Notify>,
) -> Result<(), NbdError> {
    let mut w = BufWriter::with_capacity(256 * 1024, wr);
    let result = async {
        while let Some(r) = rx.recv().await {
            write_one(&mut w, r).await?;
            while let Ok(r) = rx.try_recv() {
                write_one(&mut w, r).await?;
            }
            w.flush().await?;
        }
        w.shutdown().await?;
        Ok::<(), NbdError>(())
    }
    .await;
    if let Err(e) = &result {
        tracing::debug!(error = %e, "reply writer stopped");
    }
    // Wakes the reader if it is still waiting for requests on a connection we can no
    // longer answer. notify_one stores the wake-up if nobody is waiting yet.
    gone.notify_one();
    result
}

async fn write_one(w: &mut BufWriter<OwnedWriteHalf>, r: Reply) -> Result<(), NbdError> {
    w.write_all(&simple_reply(r.cookie, r.error)).await?;
    if let Some(data) = &r.data {
        w.write_all(data).await?;
    }
    Ok(())
}
