//! The block-device view every frontend has of a volume.
//!
//! Frontends (iSCSI, NBD) see the replicator only through [`BlockDevice`]. [`MemDevice`]
//! and [`FileDevice`] are simple implementations for frontend tests and benchmarks against a
//! plain file.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

/// Errors a block device returns to a frontend.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("range {offset}+{length} is outside the device of {size} bytes")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("I/O error: {0}")]
    Io(String),
    #[error("no space left: {0}")]
    NoSpace(String),
    /// The volume has no replica able to serve (faulted).
    #[error("volume unavailable: {0}")]
    Unavailable(String),
    /// No replica holds a good copy of these blocks (every copy failed its checksum): the
    /// data is lost and must not be returned. Frontends report an unrecovered read error
    /// (iSCSI MEDIUM ERROR 11/00, NBD EIO), never the bad bytes.
    #[error("unrecoverable read error at {offset}+{length}: {detail}")]
    Medium {
        offset: u64,
        length: u64,
        detail: String,
    },
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A volume as frontends see it. Offsets and lengths are in bytes; implementations accept
/// any alignment but are fastest at multiples of 4096.
pub trait BlockDevice: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>>;
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>>;
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>>;
    /// Makes every write acknowledged before it durable.
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>>;
    /// Writes `data` durably (FUA): when it returns, this write survives a crash. Here a
    /// write and then a flush of everything; a device that can do better overrides it.
    fn write_fua(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.write(offset, data).await?;
            self.flush().await
        })
    }
    /// Where the device counts the time of writes and flushes (`pathtime.rs`), for the
    /// frontend to add its own part; `None` for devices that keep no counters.
    fn path_counters(&self) -> Option<&crate::pathtime::PathCounters> {
        None
    }
}

/// A device held in memory, for frontend tests.
pub struct MemDevice {
    data: std::sync::Mutex<Vec<u8>>,
}

impl MemDevice {
    pub fn new(size: u64) -> MemDevice {
        let size = usize::try_from(size).expect("invariant: test devices fit in memory");
        MemDevice {
            data: std::sync::Mutex::new(vec![0; size]),
        }
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, BlockError> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(BlockError::OutOfRange {
                offset,
                length: len,
                size,
            }),
        }
    }
}

impl BlockDevice for MemDevice {
    fn size(&self) -> u64 {
        self.data
            .lock()
            .expect("invariant: lock not poisoned")
            .len() as u64
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            let r = self.range(offset, len)?;
            let data = self.data.lock().expect("invariant: lock not poisoned");
            Ok(Bytes::copy_from_slice(&data[r]))
        })
    }
    fn write(&self, offset: u64, buf: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            let r = self.range(offset, buf.len() as u64)?;
            self.data.lock().expect("invariant: lock not poisoned")[r].copy_from_slice(&buf);
            Ok(())
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            let r = self.range(offset, len)?;
            self.data.lock().expect("invariant: lock not poisoned")[r].fill(0);
            Ok(())
        })
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async { Ok(()) })
    }
}

/// A device backed by a plain file with buffered I/O, for frontend tests and as a reference in
/// benchmarks (`engine/examples/nbd_file.rs`).
///
/// Reads and writes of up to [`FileDevice::INLINE_MAX`] bytes run inline on the calling
/// task: they copy to or from the page cache, which costs a few µs for 4 KiB, while handing
/// them to a blocking thread cost two thread wake-ups and context switches per request —
/// profiles of 4 KiB random writes through the NBD server showed that hand-off as most of
/// the server's CPU time (`finish_task_switch` and futex). The price is that a read missing
/// the page cache, or a write throttled by dirty-page writeback, stalls that runtime worker
/// for the duration; acceptable for a test and benchmark device, not for the replicas, which
/// use their own I/O engine. Larger transfers, `flush` (fsync) and `unmap` (fallocate) go to
/// the blocking pool.
pub struct FileDevice {
    file: std::sync::Arc<std::fs::File>,
    size: u64,
}

impl FileDevice {
    /// Opens `path`, creating it sparse at `size` bytes if missing.
    pub fn open(path: &std::path::Path, size: u64) -> std::io::Result<FileDevice> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if file.metadata()?.len() < size {
            file.set_len(size)?;
        }
        let size = file.metadata()?.len();
        Ok(FileDevice {
            file: std::sync::Arc::new(file),
            size,
        })
    }

    /// Largest read or write done inline (see the type's docs).
    pub const INLINE_MAX: u64 = 256 * 1024;

    fn check(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(BlockError::OutOfRange {
                offset,
                length: len,
                size: self.size,
            }),
        }
    }

    /// Runs `f` on the file: inline when `inline`, else on the blocking pool.
    async fn run<T: Send + 'static>(
        &self,
        inline: bool,
        f: impl FnOnce(&std::fs::File) -> std::io::Result<T> + Send + 'static,
    ) -> Result<T, BlockError> {
        let res = if inline {
            f(&self.file)
        } else {
            let file = self.file.clone();
            tokio::task::spawn_blocking(move || f(&file))
                .await
                .map_err(|e| BlockError::Io(e.to_string()))?
        };
        res.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                BlockError::NoSpace(e.to_string())
            } else {
                BlockError::Io(e.to_string())
            }
        })
    }
}

impl BlockDevice for FileDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, BlockError>> {
        Box::pin(async move {
            self.check(offset, len)?;
            self.run(len <= Self::INLINE_MAX, move |f| {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; len as usize];
                f.read_exact_at(&mut buf, offset)?;
                Ok(Bytes::from(buf))
            })
            .await
        })
    }
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.check(offset, data.len() as u64)?;
            self.run(data.len() as u64 <= Self::INLINE_MAX, move |f| {
                use std::os::unix::fs::FileExt;
                f.write_all_at(&data, offset)
            })
            .await
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move {
            self.check(offset, len)?;
            self.run(false, move |f| {
                use std::os::fd::AsRawFd;
                // SAFETY: fallocate on an fd we own; arguments are plain integers.
                let rc = unsafe {
                    libc::fallocate(
                        f.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        offset as libc::off_t,
                        len as libc::off_t,
                    )
                };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
            .await
        })
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), BlockError>> {
        Box::pin(async move { self.run(false, |f| f.sync_data()).await })
    }
}
