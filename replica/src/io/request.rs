//! What a back end is asked to do, and the transfer rules both back ends share.
//!
//! A [`Request`] owns everything the operation touches until it completes: the buffer (so the
//! kernel or a worker thread never writes into memory the caller has freed) and an `Arc` of
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
    pub(super) direction: Direction,
    pub(super) file: Arc<DataFile>,
    pub(super) offset: u64,
    pub(super) buf: AlignedBuf,
    /// Bytes of `buf` already transferred.
    pub(super) done: usize,
    /// Largest length issued at once (a multiple of [`IO_ALIGN`]).
    max_chunk: usize,
    eagain_in_a_row: u32,
}

impl Transfer {
    pub(super) fn new(
        direction: Direction,
        file: Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
        max_chunk: usize,
    ) -> Transfer {
        Transfer {
            direction,
            file,
            offset,
            buf,
            done: 0,
            max_chunk,
            eagain_in_a_row: 0,
        }
    }

    /// File offset and length of the next piece to transfer, starting at `self.done`.
    pub(super) fn next_chunk(&self) -> (u64, usize) {
        let len = (self.buf.len() - self.done).min(self.max_chunk);
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
        match self.direction {
            Direction::Write if n == 0 => Step::Failed(io::Error::new(
                io::ErrorKind::WriteZero,
                format!(
                    "write at offset {} made no progress",
                    self.offset + self.done as u64
                ),
            )),
            Direction::Write => {
                self.done += n;
                if self.done == self.buf.len() {
                    Step::Finished
                } else {
                    Step::Continue
                }
            }
            Direction::Read if n == 0 => self.end_of_file(),
            Direction::Read => {
                self.done += n;
                if self.done == self.buf.len() {
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

    fn end_of_file(&mut self) -> Step {
        self.buf[self.done..].fill(0);
        self.done = self.buf.len();
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

    /// Hands the buffer (or the error) to whoever asked.
    pub(super) fn finish(self, reply: oneshot::Sender<io::Result<AlignedBuf>>, step: Step) {
        let result = match step {
            Step::Finished => Ok(self.buf),
            Step::Failed(e) => Err(e),
            Step::Continue => Err(io::Error::other("invariant: finish called mid-transfer")),
        };
        // The receiver is gone when the caller cancelled; the result is then dropped here,
        // after the operation has really finished.
        let _ = reply.send(result);
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
        assert!(t.buf[..5000].iter().all(|&b| b == 0xAA));
        assert!(t.buf[5000..].iter().all(|&b| b == 0));
    }

    #[test]
    fn zero_byte_read_is_end_of_file() {
        let mut buf = AlignedBuf::zeroed(8192);
        buf.fill(0xAA);
        let mut t = Transfer::new(Direction::Read, file(false), 0, buf, usize::MAX);
        assert!(matches!(t.advance(Ok(4096)), Step::Continue));
        assert!(matches!(t.advance(Ok(0)), Step::Finished));
        assert!(t.buf[4096..].iter().all(|&b| b == 0));
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
