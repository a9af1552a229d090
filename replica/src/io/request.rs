//! What a back end is asked to do, and the transfer rules both back ends share.
//!
//! A [`Request`] owns everything the operation touches until it completes: the buffer (so the
//! kernel or a worker thread never touches memory the caller has freed: an [`AlignedBuf`], or
//! for [`Request::WriteShared`] a reference-counted `Bytes` the kernel only reads) and an `Arc` of
//! the file (so the descriptor cannot be closed and reused for another file while the
//! operation is queued or in flight). The caller only holds the receiving end of a oneshot;
//! dropping it (cancelling the future) does not cancel the operation, it only discards the
//! result once the operation has finished.
//!
//! [`Transfer`] is the single place that decides what a partial result means, so that the
//! io_uring and thread-pool back ends cannot drift apart: a short transfer continues from
//! where it stopped, `EINTR`/`EAGAIN` retry, a read that reaches end-of-file zero-fills the
//! rest of the buffer, and a write that makes no progress is an error.

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::{AlignedBuf, DataFile, IO_ALIGN};

/// How many times in a row one operation may get `EAGAIN` before it is failed. Regular files
/// only return it under memory pressure; retrying forever would hide a stuck device.
const MAX_EAGAIN_RETRIES: u32 = 1000;

/// One operation for a back end.
pub(super) enum Request {
    Read {
        file: Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
        reply: oneshot::Sender<io::Result<AlignedBuf>>,
    },
    Write {
        file: Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
        reply: oneshot::Sender<io::Result<AlignedBuf>>,
    },
    /// A write straight from the caller's memory, without a copy. The `Bytes` keeps that
    /// memory alive until the write completes; for an `O_DIRECT` file its address and length
    /// are multiples of [`IO_ALIGN`] (checked by `IoEngine::write_bytes_at`).
    WriteShared {
        file: Arc<DataFile>,
        offset: u64,
        data: Bytes,
        reply: oneshot::Sender<io::Result<()>>,
    },
    Sync {
        file: Arc<DataFile>,
        reply: oneshot::Sender<io::Result<()>>,
    },
}

/// Whether a [`Transfer`] reads into or writes from its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    Read,
    Write,
}

/// A request taken apart: a transfer and who to answer, or a sync.
pub(super) enum Work {
    Transfer(Transfer, Reply),
    Sync(Arc<DataFile>, oneshot::Sender<io::Result<()>>),
}

impl Request {
    pub(super) fn into_work(self, max_chunk: usize) -> Work {
        let (file, offset, mem, reply) = match self {
            Request::Read {
                file,
                offset,
                buf,
                reply,
            } => (file, offset, Memory::ReadInto(buf), Reply::Buffer(reply)),
            Request::Write {
                file,
                offset,
                buf,
                reply,
            } => (file, offset, Memory::WriteFrom(buf), Reply::Buffer(reply)),
            Request::WriteShared {
                file,
                offset,
                data,
                reply,
            } => (file, offset, Memory::WriteShared(data), Reply::Done(reply)),
            Request::Sync { file, reply } => return Work::Sync(file, reply),
        };
        Work::Transfer(Transfer::with_memory(file, offset, mem, max_chunk), reply)
    }
}

/// The memory of a transfer. The direction is part of it, so that a read into shared
/// (read-only) memory cannot be expressed.
pub(super) enum Memory {
    ReadInto(AlignedBuf),
    WriteFrom(AlignedBuf),
    WriteShared(Bytes),
}

impl Memory {
    pub(super) fn len(&self) -> usize {
        match self {
            Memory::ReadInto(b) | Memory::WriteFrom(b) => b.len(),
            Memory::WriteShared(b) => b.len(),
        }
    }
}

/// Who waits for a transfer: a caller that gets its buffer back, or one that only learns
/// the outcome (a shared write).
pub(super) enum Reply {
    Buffer(oneshot::Sender<io::Result<AlignedBuf>>),
    Done(oneshot::Sender<io::Result<()>>),
}

/// What to do after one system call (or one io_uring completion) of a transfer.
#[derive(Debug)]
pub(super) enum Step {
    /// Issue [`Transfer::next_chunk`] again.
    Continue,
    /// The buffer is complete.
    Finished,
    Failed(io::Error),
}

/// Progress of one read or write of a whole buffer.
pub(super) struct Transfer {
    pub(super) file: Arc<DataFile>,
    pub(super) offset: u64,
    pub(super) mem: Memory,
    /// Bytes of `buf` already transferred.
    pub(super) done: usize,
    /// Largest length issued at once (a multiple of [`IO_ALIGN`]).
    max_chunk: usize,
    eagain_in_a_row: u32,
}

impl Transfer {
    #[cfg(test)]
    pub(super) fn new(
        direction: Direction,
        file: Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
        max_chunk: usize,
    ) -> Transfer {
        let mem = match direction {
            Direction::Read => Memory::ReadInto(buf),
            Direction::Write => Memory::WriteFrom(buf),
        };
        Transfer::with_memory(file, offset, mem, max_chunk)
    }

    pub(super) fn with_memory(
        file: Arc<DataFile>,
        offset: u64,
        mem: Memory,
        max_chunk: usize,
    ) -> Transfer {
        Transfer {
            file,
            offset,
            mem,
            done: 0,
            max_chunk,
            eagain_in_a_row: 0,
        }
    }

    pub(super) fn direction(&self) -> Direction {
        match self.mem {
            Memory::ReadInto(_) => Direction::Read,
            Memory::WriteFrom(_) | Memory::WriteShared(_) => Direction::Write,
        }
    }

    /// File offset and length of the next piece to transfer, starting at `self.done`.
    pub(super) fn next_chunk(&self) -> (u64, usize) {
        let len = (self.mem.len() - self.done).min(self.max_chunk);
        (self.offset + self.done as u64, len)
    }

    /// Applies the result of transferring [`Transfer::next_chunk`]: `Ok(n)` bytes moved, or
    /// the error the kernel returned.
    pub(super) fn advance(&mut self, result: io::Result<usize>) -> Step {
        let n = match result {
            Ok(n) => n,
            Err(e) => return self.on_error(e),
        };
        self.eagain_in_a_row = 0;
        let (_, asked) = self.next_chunk();
        if n > asked {
            // The kernel never reports more than it was asked for; if it did, `done` would
            // run past the buffer.
            return Step::Failed(io::Error::other(format!(
                "kernel reported {n} bytes for a {asked}-byte transfer"
            )));
        }
        match self.direction() {
            Direction::Write if n == 0 => Step::Failed(io::Error::new(
                io::ErrorKind::WriteZero,
                format!(
                    "write at offset {} made no progress",
                    self.offset + self.done as u64
                ),
            )),
            Direction::Write => {
                self.done += n;
                if self.done == self.mem.len() {
                    Step::Finished
                } else {
                    Step::Continue
                }
            }
            Direction::Read if n == 0 => self.end_of_file(),
            Direction::Read => {
                self.done += n;
                if self.done == self.mem.len() {
                    Step::Finished
                } else if n < asked && self.file.is_direct() && !self.done.is_multiple_of(IO_ALIGN)
                {
                    // An O_DIRECT read ends short of an alignment boundary only at
                    // end-of-file (a file whose size is not a multiple of the block size).
                    // Asking again from this unaligned offset would fail with EINVAL.
                    self.end_of_file()
                } else {
                    Step::Continue
                }
            }
        }
    }

    /// Only reads reach end-of-file (`advance` sends writes that stop short elsewhere).
    fn end_of_file(&mut self) -> Step {
        if let Memory::ReadInto(buf) = &mut self.mem {
            buf[self.done..].fill(0);
        }
        self.done = self.mem.len();
        Step::Finished
    }

    fn on_error(&mut self, e: io::Error) -> Step {
        match e.raw_os_error() {
            Some(libc::EINTR) => Step::Continue,
            Some(libc::EAGAIN) if self.eagain_in_a_row < MAX_EAGAIN_RETRIES => {
                self.eagain_in_a_row += 1;
                Step::Continue
            }
            _ => Step::Failed(e),
        }
    }

    /// Hands the buffer (or the error) to whoever asked. Called only once the kernel is done
    /// with the memory; the shared `Bytes` of a [`Memory::WriteShared`] is released here.
    pub(super) fn finish(self, reply: Reply, step: Step) {
        let outcome = match step {
            Step::Finished => Ok(()),
            Step::Failed(e) => Err(e),
            Step::Continue => Err(io::Error::other("invariant: finish called mid-transfer")),
        };
        // The receiver is gone when the caller cancelled; the result is then dropped here,
        // after the operation has really finished.
        match reply {
            Reply::Buffer(reply) => {
                let result = outcome.and_then(|()| match self.mem {
                    Memory::ReadInto(buf) | Memory::WriteFrom(buf) => Ok(buf),
                    Memory::WriteShared(_) => Err(io::Error::other(
                        "invariant: a shared write answered with a buffer",
                    )),
                });
                let _ = reply.send(result);
            }
            Reply::Done(reply) => {
                let _ = reply.send(outcome);
            }
        }
    }
}

/// Converts an io_uring completion result (`-errno` or a byte count) to a `Result`.
pub(super) fn cqe_result(res: i32) -> io::Result<usize> {
    usize::try_from(res).map_err(|_| io::Error::from_raw_os_error(res.wrapping_neg()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(direct: bool) -> Arc<DataFile> {
        let tmp = tempfile::tempfile().expect("tempfile");
        Arc::new(DataFile::from_parts(tmp, direct))
    }

    #[test]
    fn short_read_continues_from_where_it_stopped() {
        let mut t = Transfer::new(
            Direction::Read,
            file(true),
            8192,
            AlignedBuf::zeroed(16384),
            usize::MAX,
        );
        assert!(matches!(t.advance(Ok(4096)), Step::Continue));
        assert_eq!(t.next_chunk(), (8192 + 4096, 12288));
        assert!(matches!(t.advance(Ok(12288)), Step::Finished));
    }

    #[test]
    fn unaligned_short_direct_read_is_end_of_file_and_zero_fills() {
        let mut buf = AlignedBuf::zeroed(8192);
        buf.fill(0xAA);
        let mut t = Transfer::new(Direction::Read, file(true), 0, buf, usize::MAX);
        assert!(matches!(t.advance(Ok(5000)), Step::Finished));
        let Memory::ReadInto(buf) = &t.mem else {
            panic!("a read transfer")
        };
        assert!(buf[..5000].iter().all(|&b| b == 0xAA));
        assert!(buf[5000..].iter().all(|&b| b == 0));
    }

    #[test]
    fn zero_byte_read_is_end_of_file() {
        let mut buf = AlignedBuf::zeroed(8192);
        buf.fill(0xAA);
        let mut t = Transfer::new(Direction::Read, file(false), 0, buf, usize::MAX);
        assert!(matches!(t.advance(Ok(4096)), Step::Continue));
        assert!(matches!(t.advance(Ok(0)), Step::Finished));
        let Memory::ReadInto(buf) = &t.mem else {
            panic!("a read transfer")
        };
        assert!(buf[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn interrupted_and_would_block_retry_but_other_errors_fail() {
        let mut t = Transfer::new(
            Direction::Write,
            file(false),
            0,
            AlignedBuf::zeroed(4096),
            usize::MAX,
        );
        let eintr = io::Error::from_raw_os_error(libc::EINTR);
        assert!(matches!(t.advance(Err(eintr)), Step::Continue));
        let eagain = io::Error::from_raw_os_error(libc::EAGAIN);
        assert!(matches!(t.advance(Err(eagain)), Step::Continue));
        let eio = io::Error::from_raw_os_error(libc::EIO);
        match t.advance(Err(eio)) {
            Step::Failed(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO)),
            other => panic!("expected failure, got {other:?}"),
        }
    }

    #[test]
    fn endless_eagain_eventually_fails() {
        let mut t = Transfer::new(
            Direction::Read,
            file(false),
            0,
            AlignedBuf::zeroed(4096),
            usize::MAX,
        );
        for _ in 0..MAX_EAGAIN_RETRIES {
            let e = io::Error::from_raw_os_error(libc::EAGAIN);
            assert!(matches!(t.advance(Err(e)), Step::Continue));
        }
        let e = io::Error::from_raw_os_error(libc::EAGAIN);
        assert!(matches!(t.advance(Err(e)), Step::Failed(_)));
    }

    #[test]
    fn write_without_progress_fails() {
        let mut t = Transfer::new(
            Direction::Write,
            file(false),
            0,
            AlignedBuf::zeroed(4096),
            usize::MAX,
        );
        match t.advance(Ok(0)) {
            Step::Failed(e) => assert_eq!(e.kind(), io::ErrorKind::WriteZero),
            other => panic!("expected failure, got {other:?}"),
        }
    }

    #[test]
    fn chunks_are_capped() {
        let t = Transfer::new(
            Direction::Read,
            file(false),
            0,
            AlignedBuf::zeroed(65536),
            4096,
        );
        assert_eq!(t.next_chunk(), (0, 4096));
    }
}
