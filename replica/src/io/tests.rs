//! Tests of what the back ends share with the callers: shared (zero-copy) writes, recycled
//! buffers, and what happens when a caller gives up on a request. Both back ends run every
//! test; the suite in `replica/tests/io_backends.rs` covers the rest.

use std::sync::Arc;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const BLOCK: usize = IO_ALIGN;

fn engine(kind: BackendKind) -> IoEngine {
    let config = IoConfig {
        uring_rings: 2,
        ..IoConfig::default()
    };
    IoEngine::with_config(kind, config).expect("start I/O engine")
}

/// On the disk filesystem, which allows `O_DIRECT` (tmpfs may not).
fn direct_file(dir: &tempfile::TempDir) -> Arc<DataFile> {
    let file = DataFile::open(&dir.path().join("f"), true).expect("create");
    assert!(file.is_direct(), "/var/tmp allows O_DIRECT");
    Arc::new(file)
}

/// One submitting thread, as the replica's connection tasks are.
fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
}

fn disk_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("zebu-io-unit")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random()).collect()
}

/// A buffer full of garbage, standing in for a recycled one: any byte a read fails to
/// overwrite shows.
fn garbage(len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::for_overwrite(len);
    b.fill(0xEE);
    b
}

/// Several OS threads, each with its own runtime and many requests in flight, write
/// disjoint ranges: half from aligned `Bytes` (written without a copy), half from ordinary
/// heap `Bytes` (copied), in lengths from 1 to 64 blocks. Every byte of the file must then
/// be what its writer sent, read back both through the engine (into recycled buffers) and
/// with plain `std::fs::read`.
fn concurrent_shared_writes_from_many_threads(kind: BackendKind) {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 48;
    const SLOT: usize = 64 * BLOCK;
    let dir = disk_dir();
    let io = engine(kind);
    let file = direct_file(&dir);
    let submitters: Vec<_> = (0..THREADS)
        .map(|t| {
            let (io, file) = (io.clone(), file.clone());
            std::thread::spawn(move || {
                let rt = rt();
                rt.block_on(async {
                    let writes = (0..PER_THREAD).map(|i| {
                        let (io, file) = (io.clone(), file.clone());
                        async move {
                            let n = t * PER_THREAD + i;
                            let len = (1 + (n as usize * 7) % 64) * BLOCK;
                            let data = pattern(n, len);
                            let bytes = if n.is_multiple_of(2) {
                                AlignedBuf::copy_from(&data).into_bytes()
                            } else {
                                Bytes::from(data)
                            };
                            io.write_bytes_at(&file, n * SLOT as u64, bytes)
                                .await
                                .expect("shared write");
                        }
                    });
                    futures::future::join_all(writes).await;
                });
            })
        })
        .collect();
    for s in submitters {
        s.join().expect("submitter thread");
    }
    let rt = rt();
    rt.block_on(io.sync(&file)).expect("sync");
    let on_disk = std::fs::read(dir.path().join("f")).expect("read file");
    for n in 0..THREADS * PER_THREAD {
        let len = (1 + (n as usize * 7) % 64) * BLOCK;
        let at = n as usize * SLOT;
        let want = pattern(n, len);
        assert!(on_disk[at..at + len] == want[..], "write {n} on disk");
        let back = rt
            .block_on(io.read_at(&file, at as u64, garbage(len)))
            .expect("read");
        assert!(back[..] == want[..], "write {n} read through the engine");
    }
}

/// A shared write whose caller stops waiting (the future is dropped after submission) and
/// drops its own reference to the payload must still write the payload: the request holds
/// the memory until the kernel is done. Were it released early, the cache would hand the
/// same memory out again and the scribbling below would land in the file.
fn dropped_shared_write_keeps_its_memory(kind: BackendKind) {
    let dir = disk_dir();
    let io = engine(kind);
    let file = direct_file(&dir);
    let rt = rt();
    let len = 16 * BLOCK;
    let rounds = 64u64;
    let mut abandoned = 0;
    for n in 0..rounds {
        let bytes = AlignedBuf::copy_from(&pattern(n, len)).into_bytes();
        let fut = io.write_bytes_at(&file, n * len as u64, bytes);
        // Poll once (submits), then drop the future: the payload's last user is the request.
        if futures::FutureExt::now_or_never(fut).is_none() {
            abandoned += 1;
        }
        let mut scribble = AlignedBuf::for_overwrite(len);
        scribble.fill(0x99);
    }
    // Most are (a direct write takes far longer than one poll); one suffices to test the path.
    assert!(
        abandoned > 0,
        "none of {rounds} writes was still in flight when dropped"
    );
    // A sync only covers writes that completed; wait for the dropped ones by reading each
    // range until it is no longer zero (bounded), then check every byte.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    for n in 0..rounds {
        let want = pattern(n, len);
        loop {
            let back = rt
                .block_on(io.read_at(&file, n * len as u64, AlignedBuf::zeroed(len)))
                .expect("read");
            if back[..] == want[..] {
                break;
            }
            assert!(
                back.iter().all(|&b| b == 0),
                "write {n} landed with wrong bytes (its memory was reused)"
            );
            assert!(
                std::time::Instant::now() < deadline,
                "write {n} never landed"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Reads into buffers of garbage (as recycled ones may be) return exactly the file: every byte of the range,
/// and zeros past end-of-file.
///
/// Buffered and direct files both: this kernel's `O_DIRECT` read zero-fills the caller's
/// memory past end-of-file by itself, a buffered read leaves it as it was, so only the
/// buffered file shows whether the back end fills it.
fn reads_into_recycled_buffers_are_exact(kind: BackendKind) {
    let dir = disk_dir();
    let io = engine(kind);
    let direct = direct_file(&dir);
    let buffered = Arc::new(DataFile::open_buffered(&dir.path().join("b"), true).expect("create"));
    for file in [direct, buffered] {
        reads_into_garbage_are_exact(&io, &file);
    }
}

fn reads_into_garbage_are_exact(io: &IoEngine, file: &Arc<DataFile>) {
    let data = pattern(77, 3 * BLOCK);
    let rt = rt();
    rt.block_on(io.write_at(file, 0, AlignedBuf::copy_from(&data)))
        .expect("write");
    let back = rt
        .block_on(io.read_at(file, 0, garbage(8 * BLOCK)))
        .expect("read");
    assert!(back[..3 * BLOCK] == data[..]);
    assert!(
        back[3 * BLOCK..].iter().all(|&b| b == 0),
        "past EOF is zeros"
    );
}

/// An unaligned payload on an `O_DIRECT` file goes through a copy and still lands whole.
fn unaligned_shared_write_is_copied(kind: BackendKind) {
    let dir = disk_dir();
    let io = engine(kind);
    let file = direct_file(&dir);
    let rt = rt();
    let backing = Bytes::from(pattern(3, 2 * BLOCK + 1));
    // A slice one byte into the allocation cannot be page aligned.
    let data = backing.slice(1..);
    assert_ne!(data.as_ptr() as usize % IO_ALIGN, 0);
    rt.block_on(io.write_bytes_at(&file, BLOCK as u64, data.clone()))
        .expect("unaligned write");
    let back = rt
        .block_on(io.read_at(&file, BLOCK as u64, AlignedBuf::zeroed(2 * BLOCK)))
        .expect("read");
    assert!(back[..] == data[..]);
}

/// A page-cache file (`CacheMode::Page`): writes are copied in by the caller, reads are served
/// inline when cached and by the back end when not (here: after the cache of the middle
/// of the file was dropped), and a read that spans both is exact either way.
fn page_cache_reads_hit_and_miss_alike(kind: BackendKind) {
    use std::os::unix::fs::FileExt;
    const BLOCKS: usize = 64;
    let dir = disk_dir();
    let io = engine(kind);
    let path = dir.path().join("page");
    let file = Arc::new(DataFile::open_as(&path, true, CacheMode::Page).expect("create"));
    assert!(!file.is_direct());
    let rt = rt();
    let data = pattern(11, BLOCKS * BLOCK);
    // Half from aligned buffers, half from unaligned `Bytes` (fine without O_DIRECT).
    let half = BLOCKS / 2 * BLOCK;
    rt.block_on(io.write_at(&file, 0, AlignedBuf::copy_from(&data[..half])))
        .expect("write");
    let backing = Bytes::from([&[0u8][..], &data[half..]].concat());
    rt.block_on(io.write_bytes_at(&file, half as u64, backing.slice(1..)))
        .expect("write bytes");
    // Already visible to anyone reading the file: the write is in the page cache.
    let mut seen = vec![0u8; data.len()];
    std::fs::File::open(&path)
        .expect("open")
        .read_exact_at(&mut seen, 0)
        .expect("plain read");
    assert!(seen == data);
    rt.block_on(io.sync(&file)).expect("sync");
    // Drop the (now clean) cached pages of blocks 16..48: reads there must go to the back end.
    // SAFETY: a plain advice call on a descriptor `file` owns.
    let r = unsafe {
        libc::posix_fadvise(
            file.raw_fd(),
            (16 * BLOCK) as libc::off_t,
            (32 * BLOCK) as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    assert_eq!(r, 0, "fadvise");
    for (from, blocks) in [(0, 8), (12, 8), (20, 4), (40, 24), (0, BLOCKS), (60, 8)] {
        let back = rt
            .block_on(io.read_at(&file, (from * BLOCK) as u64, garbage(blocks * BLOCK)))
            .expect("read");
        let end = ((from + blocks) * BLOCK).min(data.len());
        let inside = end - from * BLOCK;
        assert!(
            back[..inside] == data[from * BLOCK..end],
            "blocks {from}..{} differ",
            from + blocks
        );
        assert!(back[inside..].iter().all(|&b| b == 0), "past EOF is zeros");
    }
}

#[test]
fn cache_modes_parse() {
    assert_eq!("page".parse::<CacheMode>().ok(), Some(CacheMode::Page));
    assert_eq!(
        " Direct ".parse::<CacheMode>().ok(),
        Some(CacheMode::Direct)
    );
    assert!("writeback".parse::<CacheMode>().is_err());
    assert_eq!(CacheMode::default(), CacheMode::Page);
}

#[test]
fn backend_names_parse() {
    assert_eq!(
        "uring".parse::<BackendKind>().ok(),
        Some(BackendKind::Uring)
    );
    assert_eq!(
        "io_uring".parse::<BackendKind>().ok(),
        Some(BackendKind::Uring)
    );
    assert_eq!(
        " Threads ".parse::<BackendKind>().ok(),
        Some(BackendKind::Threads)
    );
    assert_eq!("auto".parse::<BackendKind>().ok(), Some(BackendKind::Auto));
    let err = "spdk".parse::<BackendKind>().expect_err("unknown name");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

macro_rules! suite {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn concurrent_shared_writes_from_many_threads_match_byte_for_byte() {
                concurrent_shared_writes_from_many_threads($kind);
            }

            #[test]
            fn dropped_shared_write_completes_with_its_own_memory() {
                dropped_shared_write_keeps_its_memory($kind);
            }

            #[test]
            fn reads_into_recycled_buffers_return_exactly_the_file() {
                reads_into_recycled_buffers_are_exact($kind);
            }

            #[test]
            fn page_cache_file_reads_cached_and_uncached_ranges_exactly() {
                page_cache_reads_hit_and_miss_alike($kind);
            }

            #[test]
            fn unaligned_payload_on_direct_file_is_copied_and_lands() {
                unaligned_shared_write_is_copied($kind);
            }
        }
    };
}

suite!(uring, BackendKind::Uring);
suite!(threads, BackendKind::Threads);

/// A layer file is held by one open file description at a time: a second open waits, gives
/// up with a message that says why, and succeeds once the first holder (and every request
/// that still referenced it) is gone.
#[test]
fn a_layer_file_is_locked_until_every_reference_to_its_holder_is_gone() {
    let dir = disk_dir();
    let path = dir.path().join("layer");
    let first = Arc::new(DataFile::open(&path, true).expect("create"));
    let in_flight = first.clone(); // as a request in flight holds it
    let second = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("plain open");
    let started = std::time::Instant::now();
    let err = lock_layer(&second, &path, std::time::Duration::from_millis(200))
        .expect_err("held by the first open");
    assert!(started.elapsed() >= std::time::Duration::from_millis(200));
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    assert!(err.to_string().contains("another process"), "{err}");
    drop(first);
    lock_layer(&second, &path, std::time::Duration::from_millis(200))
        .expect_err("a reference from a request in flight still holds it");
    // The last reference goes while the second open is waiting: it gets the lock.
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(in_flight);
    });
    lock_layer(&second, &path, std::time::Duration::from_secs(5)).expect("released");
    release.join().expect("release thread");
}

#[test]
fn a_request_is_alone_only_while_its_connection_has_nothing_else_in_flight() {
    let load = ConnectionLoad::default();
    let alone = || async { ConnectionLoad::current_is_alone() };
    rt().block_on(async {
        // Outside any connection (gRPC, a rebuild, the store's own tasks): never alone.
        assert!(!alone().await);
        let first = load.enter();
        assert!(load.scope(alone()).await, "one request in flight is alone");
        let second = load.enter();
        assert!(!load.scope(alone()).await, "two in flight are not");
        drop(first);
        assert!(load.scope(alone()).await, "the other answered: alone again");
        drop(second);
        assert!(
            !load.scope(alone()).await,
            "nothing counted: not a request of it"
        );
    });
}
