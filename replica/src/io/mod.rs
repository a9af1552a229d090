//! File I/O for layer files: one API over an io_uring back end and a thread-pool back end.
//!
//! [`IoEngine::new`] with [`BackendKind::Auto`] tries io_uring and falls back to the thread
//! pool when the kernel refuses it (old kernel, seccomp, `io_uring_disabled`). Both back ends
//! take and return [`AlignedBuf`]s so that files opened with `O_DIRECT` work; a file on a
//! filesystem that refuses `O_DIRECT` (tmpfs, overlayfs) is opened buffered instead
//! ([`DataFile::open`]).
//!
//! Flush point: [`IoEngine::sync`] is `fdatasync` issued after every write the caller has
//! seen complete; callers drain their own in-flight writes first.

mod buf;

pub use buf::AlignedBuf;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

/// Alignment and granularity of every buffer, offset and length given to the back ends.
pub const IO_ALIGN: usize = 4096;

/// Which back end to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// io_uring if the kernel allows it, else the thread pool.
    Auto,
    Uring,
    Threads,
}

/// The back end an [`IoEngine`] actually runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Uring,
    Threads,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Uring => "io_uring",
            Backend::Threads => "threads",
        })
    }
}

/// An open layer file.
#[derive(Debug)]
pub struct DataFile {
    file: File,
    direct: bool,
}

impl DataFile {
    /// Opens (or creates) `path` read-write, with `O_DIRECT` where the filesystem allows it.
    pub fn open(path: &Path, create: bool) -> std::io::Result<DataFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true).write(true).create(create);
        match opts.clone().custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => Ok(DataFile { file, direct: true }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(DataFile {
                file: opts.open(path)?,
                direct: false,
            }),
            Err(e) => Err(e),
        }
    }

    /// Whether the file was opened with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// Submits reads, writes and syncs of [`DataFile`]s. Cheap to clone.
#[derive(Clone, Debug)]
pub struct IoEngine {
    backend: Backend,
}

impl IoEngine {
    pub fn new(kind: BackendKind) -> std::io::Result<IoEngine> {
        let backend = match kind {
            BackendKind::Uring => Backend::Uring,
            BackendKind::Auto | BackendKind::Threads => Backend::Threads,
        };
        Ok(IoEngine { backend })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Reads `buf.len()` bytes at `offset`; bytes past the end of the file read as zeros.
    pub async fn read_at(
        &self,
        file: &Arc<DataFile>,
        offset: u64,
        mut buf: AlignedBuf,
    ) -> std::io::Result<AlignedBuf> {
        let file = file.clone();
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            let mut done = 0;
            while done < buf.len() {
                let n = file.file.read_at(&mut buf[done..], offset + done as u64)?;
                if n == 0 {
                    buf[done..].fill(0);
                    break;
                }
                done += n;
            }
            Ok(buf)
        })
        .await
        .map_err(std::io::Error::other)?
    }

    /// Writes all of `buf` at `offset` and gives the buffer back.
    pub async fn write_at(
        &self,
        file: &Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
    ) -> std::io::Result<AlignedBuf> {
        let file = file.clone();
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            file.file.write_all_at(&buf, offset)?;
            Ok(buf)
        })
        .await
        .map_err(std::io::Error::other)?
    }

    /// `fdatasync`: every write that completed before this call is durable when it returns.
    pub async fn sync(&self, file: &Arc<DataFile>) -> std::io::Result<()> {
        let file = file.clone();
        tokio::task::spawn_blocking(move || file.file.sync_data())
            .await
            .map_err(std::io::Error::other)?
    }
}
