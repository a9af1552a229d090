//! File I/O for layer files: one API over an io_uring back end and a thread-pool back end,
//! for files in the page cache or opened with `O_DIRECT` ([`CacheMode`]).
//!
//! Page-cache files (the replica's default) skip the back end where waiting is not needed: a
//! write is a copy into the page cache done by the caller, and a read whose bytes are all
//! cached is served inline (`preadv2(RWF_NOWAIT)`); only reads that would wait for the disk,
//! and `sync`, go to a back end. Measured through the engine over NBD against `Direct` in the
//! same hour (benches/README.md): 4 KiB random reads through one replica 1.7×, writes 1.3×,
//! through three replicas 2.3× and 1.8×, and half the latency of a QD 1 write: each request
//! used to cross to a ring thread and back, and every write into a sparse layer that
//! allocated a block was punted to a kernel worker thread.
//!
//! [`IoEngine::new`] with [`BackendKind::Auto`] tries io_uring and falls back to the thread
//! pool when the kernel refuses it (old kernel, seccomp, `io_uring_disabled`). Both back ends
//! take and return [`AlignedBuf`]s so that files opened with `O_DIRECT` work (allocating one
//! is cheap: freed ones are cached, see `buf`), and write a caller's `Bytes` in place when its
//! memory is aligned ([`IoEngine::write_bytes_at`]), so a payload received into an aligned
//! buffer is never copied; a file on a
//! filesystem that refuses `O_DIRECT` (overlayfs, tmpfs before Linux 6.6) is opened buffered
//! instead ([`DataFile::open`]).
//!
//! - `uring` — `IoConfig::uring_rings` rings, each owned by one thread that batches
//!   submissions from a channel and reaps completions; up to `IoConfig::uring_entries - 1`
//!   operations in flight per ring. Its module docs say why several rings, and what happens
//!   to writes that allocate blocks (they are faster through io_uring than through the pool).
//! - `threads` — a fixed pool of `IoConfig::threads` threads doing `pread`/`pwrite`.
//! - `request` — what both share: the request type, and the one place that decides what a
//!   short transfer, `EINTR`/`EAGAIN` or end-of-file means.
//! - `buf` — [`AlignedBuf`] and the cache of freed ones.
//!
//! Both back ends own the buffer and an `Arc` of the file from submission until completion, so
//! dropping an I/O future (cancellation) never frees memory or closes a descriptor the kernel
//! is still using; the operation finishes and its result is discarded. Errors are the kernel's
//! own `std::io::Error`s, unwrapped, so callers can match on `raw_os_error()` (e.g. `ENOSPC`).
//!
//! Choosing the back end: `BackendKind::Auto` reads the environment variable
//! [`BACKEND_ENV`] (`ZEBU_IO_BACKEND=uring|threads|auto`), and otherwise probes io_uring once
//! per process. An explicit `BackendKind::Uring`/`Threads` in code is not overridden.
//!
//! Flush point: [`IoEngine::sync`] is `fdatasync` issued after every write the caller has
//! seen complete; callers drain their own in-flight writes first. Operations in flight at the
//! same time are unordered, as on a disk.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use zebu_replica::io::{AlignedBuf, BackendKind, DataFile, IoEngine};
//! let io = IoEngine::new(BackendKind::Auto)?;
//! let file = Arc::new(DataFile::open("/var/tmp/layer".as_ref(), true)?);
//! let buf = io.write_at(&file, 0, AlignedBuf::copy_from(b"hello")).await?;
//! io.sync(&file).await?;
//! let back = io.read_at(&file, 0, buf).await?;
//! assert_eq!(&back[..5], b"hello");
//! # Ok(()) }
//! ```

mod buf;
mod request;
mod threads;
mod uring;

#[cfg(test)]
mod tests;

pub use buf::AlignedBuf;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::pathtime::PathTimes;
use request::Request;
use threads::ThreadPool;
use uring::UringBackend;

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

impl std::str::FromStr for BackendKind {
    type Err = std::io::Error;

    /// Accepts `auto`, `uring` (or `io_uring`) and `threads`, as [`BACKEND_ENV`] does.
    fn from_str(s: &str) -> std::io::Result<BackendKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(BackendKind::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(BackendKind::Uring),
            "threads" | "thread" => Ok(BackendKind::Threads),
            other => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("unknown I/O back end {other:?}; expected auto, uring or threads"),
            )),
        }
    }
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

/// How layer files meet the disk; the flush contract is the same for both (DESIGN §3: a
/// write is acknowledged once it is in the page cache or on disk, and `sync` makes every
/// completed write durable).
///
/// - `Page` (the default): buffered files. A write is a copy into the page cache, done
///   inline by the caller (no hand-off to another thread, no wait for the disk); a read of
///   cached data is served inline with `RWF_NOWAIT`, and only a read that would block goes to
///   the back end. Allocating a block of a sparse layer costs nothing at write time (the
///   filesystem allocates at writeback), where an `O_DIRECT` write that allocates blocks the
///   submitter or is punted to a kernel worker thread. The cost: the replica's node caches
///   the data it stores (reclaimable memory, not the process's RSS), and a flush writes back
///   everything written since the last one.
/// - `Direct`: `O_DIRECT` files (where the filesystem allows it), every read and write
///   through the back end; no page cache use, every write waits for the device.
///
/// The mode is the head's (a snapshot taken while running keeps the head's file as it was):
/// snapshot layers found at start are opened `O_DIRECT` ([`DataFile::open_read_only`]), and
/// so are layers a restore or a rebuild writes (`Replica::begin_layer`), whatever the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    Direct,
    #[default]
    Page,
}

impl std::str::FromStr for CacheMode {
    type Err = std::io::Error;

    /// Accepts `page` and `direct`.
    fn from_str(s: &str) -> std::io::Result<CacheMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "page" => Ok(CacheMode::Page),
            "direct" => Ok(CacheMode::Direct),
            other => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("unknown cache mode {other:?}; expected page or direct"),
            )),
        }
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheMode::Direct => "direct",
            CacheMode::Page => "page",
        })
    }
}

/// How long opening a layer file waits for an earlier holder to let go of it.
pub const LAYER_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Takes the exclusive `flock` of a layer file's open file description, waiting up to `wait`
/// for an earlier holder to release it.
///
/// Why: when a replica process dies (`kill -9`), the kernel reaps it without waiting for its
/// io_uring requests; their writes can land after the process is gone, even after a new
/// process has opened the directory and read those blocks, so data that a restarted replica
/// already served (or a catch-up already overwrote) could change under it. Every in-flight
/// request holds a reference to the `struct file` it was submitted on, and a `flock` is only
/// released when the last reference to its open file description goes, so a new process
/// that gets the lock knows that every write of the old one has completed. The same lock
/// keeps two live processes from serving one directory. A filesystem without `flock`
/// support (`ENOLCK`, `EOPNOTSUPP`) is used without it.
fn lock_layer(file: &File, path: &Path, wait: std::time::Duration) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        // SAFETY: `file` owns a valid descriptor for the duration of the call; flock reads
        // nothing else from this process.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) => {
                tracing::warn!(path = %path.display(), "no flock on this filesystem: {e}");
                return Ok(());
            }
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < deadline => {
                // Only right after a crash (or with a second process on the directory);
                // callers open layers on blocking threads.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Some(libc::EWOULDBLOCK) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!(
                        "{} is held by another open file: another process serves this \
                         directory, or the writes of one that died have not finished \
                         after {wait:?}",
                        path.display()
                    ),
                ));
            }
            _ => return Err(e),
        }
    }
}

/// An open layer file.
#[derive(Debug)]
pub struct DataFile {
    file: File,
    direct: bool,
}

impl DataFile {
    /// Opens (or creates) `path` read-write, with `O_DIRECT` where the filesystem allows it,
    /// and takes its exclusive lock (waiting up to [`LAYER_LOCK_WAIT`] for the I/O of an
    /// earlier holder to finish; see `lock_layer`).
    pub fn open(path: &Path, create: bool) -> std::io::Result<DataFile> {
        DataFile::open_as(path, create, CacheMode::Direct)
    }

    /// Opens (or creates) `path` read-write as `cache` says: [`CacheMode::Direct`] as
    /// [`DataFile::open`], [`CacheMode::Page`] through the page cache. Either way it takes
    /// the file's exclusive lock (see `lock_layer`).
    pub fn open_as(path: &Path, create: bool, cache: CacheMode) -> std::io::Result<DataFile> {
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true).write(true).create(create);
        match cache {
            CacheMode::Direct => DataFile::open_direct_if_allowed(path, &opts),
            CacheMode::Page => {
                let file = opts.open(path)?;
                lock_layer(&file, path, LAYER_LOCK_WAIT)?;
                // No readahead: the engine reads what it needs, and readahead would fill the
                // page cache with large folios, which make later small writes slow (see
                // `PAGE_WRITE_PIECE`). Advice only: a filesystem that ignores it is fine.
                // SAFETY: a plain advice call on a descriptor `file` owns.
                let r =
                    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
                if r != 0 {
                    tracing::debug!(path = %path.display(), errno = r, "posix_fadvise(RANDOM) refused");
                }
                Ok(DataFile {
                    file,
                    direct: false,
                })
            }
        }
    }

    /// Whether the file was opened with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Opens (or creates) `path` read-write without `O_DIRECT`, whatever the filesystem
    /// allows: for small metadata files, where the page cache is cheaper.
    pub fn open_buffered(path: &Path, create: bool) -> std::io::Result<DataFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .open(path)?;
        Ok(DataFile {
            file,
            direct: false,
        })
    }

    /// Opens `path` read-only, with `O_DIRECT` where the filesystem allows it (snapshot layers),
    /// and takes its exclusive lock as [`DataFile::open`] does.
    pub fn open_read_only(path: &Path) -> std::io::Result<DataFile> {
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true);
        DataFile::open_direct_if_allowed(path, &opts)
    }

    /// Filesystems without direct I/O refuse `O_DIRECT` at open with `EINVAL`; those files are
    /// used through the page cache instead (and `sync` still makes them durable).
    fn open_direct_if_allowed(
        path: &Path,
        opts: &std::fs::OpenOptions,
    ) -> std::io::Result<DataFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let (file, direct) = match opts.clone().custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => (file, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (opts.open(path)?, false),
            Err(e) => return Err(e),
        };
        lock_layer(&file, path, LAYER_LOCK_WAIT)?;
        Ok(DataFile { file, direct })
    }

    #[cfg(test)]
    fn from_parts(file: File, direct: bool) -> DataFile {
        DataFile { file, direct }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// Environment variable that forces the back end chosen by [`BackendKind::Auto`]:
/// `uring`, `threads`, or `auto` (probe). Read by [`IoEngine::new`] and nowhere else.
pub const BACKEND_ENV: &str = "ZEBU_IO_BACKEND";

/// Tuning of an [`IoEngine`]; [`IoConfig::default`] suits a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoConfig {
    /// SQ size of the io_uring ring; one entry is kept for the wake-up read, the rest bound
    /// the operations in flight (more wait in a queue).
    pub uring_entries: u32,
    /// Rings of the io_uring back end, each with its own thread (see the `uring` module docs
    /// for why more than one). Default: one per CPU, at most 4.
    pub uring_rings: usize,
    /// Threads of the thread-pool back end, which is also its maximum queue depth.
    pub threads: usize,
    /// Largest length given to the kernel in one call; longer requests are issued in pieces,
    /// through the same path as a short transfer. Rounded down to [`IO_ALIGN`], at most 1 GiB.
    pub max_chunk: usize,
    /// How the layer files a [`Replica`](crate::Replica) opens with this engine meet the disk.
    pub cache: CacheMode,
    /// Whether a [`Replica`](crate::Replica) opened with this engine keeps and checks block
    /// checksums (the default). Off is for measuring what they cost: the replica then marks
    /// every layer unverified before it serves (so the sums it stops keeping are never
    /// trusted again) and a later open with checksums on computes them anew.
    pub checksums: bool,
    /// How often a replica fdatasyncs the checksum file of its flushed writes and records
    /// those flushes (`store/sumsync.rs`). Tests that model a power cut between a flush and
    /// that fdatasync set it long.
    pub sums_sync_interval: std::time::Duration,
}

impl Default for IoConfig {
    fn default() -> IoConfig {
        IoConfig {
            uring_entries: 256,
            uring_rings: default_rings(),
            threads: 8,
            max_chunk: MAX_CHUNK,
            cache: CacheMode::default(),
            checksums: true,
            sums_sync_interval: crate::store::SUMS_SYNC_INTERVAL,
        }
    }
}

/// Rings for the io_uring back end: one per CPU, at most 4. Every request wakes a ring thread
/// twice (submission, completion); more ring threads than CPUs only add context switches and
/// shrink the batch each wake carries (measured on 2 cores: 4 rings cost 2–3× the CPU per
/// 4 KiB request of 2 rings, for no more IOPS; benches/README.md, `replica_io`).
fn default_rings() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// io_uring lengths are `u32`; a whole, aligned GiB stays well below that.
const MAX_CHUNK: usize = 1 << 30;

/// Submits reads, writes and syncs of [`DataFile`]s. Cheap to clone; the back end's threads
/// stop when the last clone drops (after finishing what was submitted).
#[derive(Clone)]
pub struct IoEngine {
    inner: Arc<Executor>,
    cache: CacheMode,
    checksums: bool,
    sums_sync_interval: std::time::Duration,
    /// Where writes and flushes spend their time, for every replica served with this engine
    /// (`pathtime.rs`).
    times: Arc<PathTimes>,
}

enum Executor {
    Uring(UringBackend),
    Threads(ThreadPool),
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoEngine")
            .field("backend", &self.backend())
            .field("cache", &self.cache)
            .finish()
    }
}

impl IoEngine {
    /// Starts an engine with the default [`IoConfig`].
    pub fn new(kind: BackendKind) -> std::io::Result<IoEngine> {
        IoEngine::with_config(kind, IoConfig::default())
    }

    pub fn with_config(kind: BackendKind, config: IoConfig) -> std::io::Result<IoEngine> {
        let max_chunk = (config.max_chunk.min(MAX_CHUNK) / IO_ALIGN).max(1) * IO_ALIGN;
        let kind = match kind {
            BackendKind::Auto => match std::env::var(BACKEND_ENV) {
                Ok(value) => value.parse().map_err(|e: std::io::Error| {
                    std::io::Error::new(e.kind(), format!("{BACKEND_ENV}: {e}"))
                })?,
                Err(_) => BackendKind::Auto,
            },
            explicit => explicit,
        };
        let executor = match kind {
            BackendKind::Uring => Executor::Uring(UringBackend::start(
                config.uring_entries,
                config.uring_rings,
                max_chunk,
            )?),
            BackendKind::Threads => {
                Executor::Threads(ThreadPool::start(config.threads, max_chunk)?)
            }
            BackendKind::Auto if uring_allowed() => {
                match UringBackend::start(config.uring_entries, config.uring_rings, max_chunk) {
                    Ok(uring) => Executor::Uring(uring),
                    Err(e) => {
                        // The probe passed, so this is a resource limit (e.g. locked memory on
                        // kernels before 5.12); the thread pool still works.
                        tracing::warn!(error = %e, "io_uring ring setup failed; using threads");
                        Executor::Threads(ThreadPool::start(config.threads, max_chunk)?)
                    }
                }
            }
            BackendKind::Auto => Executor::Threads(ThreadPool::start(config.threads, max_chunk)?),
        };
        Ok(IoEngine {
            inner: Arc::new(executor),
            cache: config.cache,
            checksums: config.checksums,
            sums_sync_interval: config.sums_sync_interval,
            times: Arc::default(),
        })
    }

    /// How layer files opened for this engine meet the disk ([`IoConfig::cache`]).
    pub fn cache(&self) -> CacheMode {
        self.cache
    }

    /// Whether replicas opened with this engine keep checksums ([`IoConfig::checksums`]).
    pub fn checksums(&self) -> bool {
        self.checksums
    }

    /// [`IoConfig::sums_sync_interval`].
    pub fn sums_sync_interval(&self) -> std::time::Duration {
        self.sums_sync_interval
    }

    /// The write and flush step counters of this process (`pathtime.rs`).
    pub fn times(&self) -> &Arc<PathTimes> {
        &self.times
    }

    pub fn backend(&self) -> Backend {
        match *self.inner {
            Executor::Uring(_) => Backend::Uring,
            Executor::Threads(_) => Backend::Threads,
        }
    }

    fn submit(&self, req: Request) {
        match &*self.inner {
            Executor::Uring(uring) => uring.submit(req),
            Executor::Threads(pool) => pool.submit(req),
        }
    }

    /// Reads `buf.len()` bytes at `offset`; bytes past the end of the file read as zeros.
    pub async fn read_at(
        &self,
        file: &Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
    ) -> std::io::Result<AlignedBuf> {
        let mut buf = buf;
        if !file.is_direct() && read_cached(file, offset, &mut buf) {
            return Ok(buf);
        }
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Read {
            file: file.clone(),
            offset,
            buf,
            reply,
        });
        rx.await.map_err(|_| backend_stopped())?
    }

    /// Writes all of `buf` at `offset` and gives the buffer back.
    pub async fn write_at(
        &self,
        file: &Arc<DataFile>,
        offset: u64,
        buf: AlignedBuf,
    ) -> std::io::Result<AlignedBuf> {
        if !file.is_direct() {
            write_cached(file, offset, &buf)?;
            return Ok(buf);
        }
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Write {
            file: file.clone(),
            offset,
            buf,
            reply,
        });
        rx.await.map_err(|_| backend_stopped())?
    }

    /// Writes all of `data` at `offset`, straight from its memory when the file can take it
    /// (a buffered file, or an `O_DIRECT` file and `data` at an address and of a length that
    /// are multiples of [`IO_ALIGN`], as [`AlignedBuf::into_bytes`] gives); otherwise from an
    /// aligned copy. The `Bytes` is held until the write completes, even if this future is
    /// dropped.
    pub async fn write_bytes_at(
        &self,
        file: &Arc<DataFile>,
        offset: u64,
        data: Bytes,
    ) -> std::io::Result<()> {
        if !file.is_direct() {
            return write_cached(file, offset, &data);
        }
        let aligned = (data.as_ptr() as usize).is_multiple_of(IO_ALIGN)
            && data.len().is_multiple_of(IO_ALIGN);
        if file.is_direct() && !aligned {
            // A copy may be longer than `data` (padded to the alignment), exactly as a
            // caller's own `AlignedBuf::copy_from` would be.
            self.write_at(file, offset, AlignedBuf::copy_from(&data))
                .await?;
            return Ok(());
        }
        let (reply, rx) = oneshot::channel();
        self.submit(Request::WriteShared {
            file: file.clone(),
            offset,
            data,
            reply,
        });
        rx.await.map_err(|_| backend_stopped())?
    }

    /// `fdatasync` for a caller that waits on it (a flush being answered): the call is made
    /// on a runtime thread, the runtime's other work moved off that thread meanwhile
    /// (`block_in_place`), where the runtime has more than one thread; elsewhere as
    /// [`IoEngine::sync`]. Made by the calling task itself when it serves a frames
    /// connection with nothing else in flight ([`ConnectionLoad`]), else by a task of its own.
    ///
    /// Why: through a ring, an `fdatasync` crosses four threads (the caller, the ring's
    /// thread, an io-wq worker, which io_uring always gives a sync to, and back), and on a
    /// VM every wake-up of a halted vCPU is an interrupt through the hypervisor. Measured at
    /// QD 1 write + flush on three replicas (benches/README.md, durable-bench). A task of its
    /// own when the connection has other requests, because `block_in_place` blocks the whole
    /// task that calls it: a frames connection runs all its requests in one task, and its
    /// reads and writes must go on while a flush waits for the disk. Alone, the call saves
    /// that task's wake-up; a request that arrives meanwhile waits in the socket for the one
    /// `fdatasync`, as it would wait for a disk that is flushing.
    pub async fn sync_waited(&self, file: &Arc<DataFile>) -> std::io::Result<()> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let multi =
            Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
        if !multi {
            return self.sync(file).await;
        }
        if ConnectionLoad::current_is_alone() {
            return tokio::task::block_in_place(|| file.file().sync_data());
        }
        let file = file.clone();
        tokio::spawn(async move { tokio::task::block_in_place(|| file.file().sync_data()) })
            .await
            .map_err(|e| std::io::Error::other(format!("the fdatasync task failed: {e}")))?
    }

    /// `fdatasync`: every write that completed before this call is durable when it returns.
    pub async fn sync(&self, file: &Arc<DataFile>) -> std::io::Result<()> {
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Sync {
            file: file.clone(),
            reply,
        });
        rx.await.map_err(|_| backend_stopped())?
    }
}

tokio::task_local! {
    /// The load of the frames connection whose task polls the current request, if any.
    static CONNECTION: ConnectionLoad;
}

/// The requests a frames connection has read and not yet answered: whether a flush may
/// block the connection's task for its `fdatasync` ([`IoEngine::sync_waited`]).
#[derive(Clone, Debug, Default)]
pub struct ConnectionLoad(Arc<AtomicUsize>);

/// One request counted in a [`ConnectionLoad`] until this is dropped.
#[derive(Debug)]
pub struct LoadGuard(Arc<AtomicUsize>);

impl ConnectionLoad {
    /// Counts one request read off the connection, until the guard is dropped.
    pub fn enter(&self) -> LoadGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        LoadGuard(self.0.clone())
    }

    /// Runs `f` (one request of this connection) with this load as the current one.
    pub fn scope<F: std::future::Future>(
        &self,
        f: F,
    ) -> tokio::task::futures::TaskLocalFuture<ConnectionLoad, F> {
        CONNECTION.scope(self.clone(), f)
    }

    /// True when the current request is the only one its connection has in flight.
    fn current_is_alone() -> bool {
        CONNECTION
            .try_with(|c| c.0.load(Ordering::Relaxed) == 1)
            .unwrap_or(false)
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A write to a buffered file: a copy into the page cache, done by the caller. It blocks only
/// where the kernel throttles writers (too much dirty memory), which then holds back the
/// whole replica as it should.
///
/// Written in pieces of at most [`PAGE_WRITE_PIECE`] bytes, so that the page cache holds the
/// file in small folios (see there).
fn write_cached(file: &DataFile, offset: u64, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut at = offset;
    for piece in data.chunks(PAGE_WRITE_PIECE) {
        file.file().write_all_at(piece, at)?;
        at += piece.len() as u64;
    }
    Ok(())
}

/// Largest piece of a page-cache write handed to the kernel at once.
///
/// Why: the page cache sizes a new folio by the write that creates it, so one 1 MiB write
/// leaves a 1 MiB folio, and ext4 (Linux 6.16 and later, with large folios) walks every
/// block of a folio on each write into it. Measured through the engine over NBD with three
/// replicas (4 KiB random writes at QD 32 into a volume filled beforehand): 15.2k IOPS after
/// a fill in 1 MiB writes, with 18 % of all CPU in `ext4_block_write_begin`, against 37.0k
/// after a fill in 4 KiB writes. Pieces of 16 KiB keep folios at four blocks at most, for one
/// `pwrite` per 16 KiB of a large write. Reads are kept from building large folios too, by
/// `POSIX_FADV_RANDOM` on the file (no readahead), see [`DataFile::open_as`].
pub const PAGE_WRITE_PIECE: usize = 16 << 10;

/// Serves a read of a buffered file from the page cache, inline, when every byte is cached
/// (`preadv2(RWF_NOWAIT)` never waits for the disk). `false` when it is not, or on any
/// error: the back end then does the whole read (and reports the error, if it persists).
fn read_cached(file: &DataFile, offset: u64, buf: &mut AlignedBuf) -> bool {
    let Ok(at) = libc::off_t::try_from(offset) else {
        return false;
    };
    let want = buf.len();
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: want,
    };
    loop {
        // SAFETY: `iov` points at `want` writable bytes of `buf`, which we borrow mutably for
        // the whole call; the descriptor is owned by `file`, alive for the call.
        let n = unsafe { libc::preadv2(file.raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
        if n >= 0 {
            // A short read is a partly cached range or the end of the file: the back end
            // knows what both mean.
            return usize::try_from(n).is_ok_and(|n| n == want);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return false;
        }
    }
}

fn backend_stopped() -> std::io::Error {
    std::io::Error::other("the I/O back end stopped before answering")
}

/// Whether io_uring works here, probed once per process: the answer cannot change while we
/// run, and probing sets up a ring, so it is cached (and the fallback logged) once.
fn uring_allowed() -> bool {
    static PROBE: OnceLock<bool> = OnceLock::new();
    *PROBE.get_or_init(|| match uring::probe() {
        Ok(()) => {
            tracing::info!("I/O back end: io_uring");
            true
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "io_uring is not available (kernel, seccomp or io_uring_disabled); \
                 using the thread-pool I/O back end"
            );
            false
        }
    })
}
