//! The same suite against both I/O back ends, on real files: O_DIRECT on the real filesystem
//! (under /var/tmp, which is not tmpfs here) and buffered on tmpfs (/dev/shm).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zebu_replica::io::{AlignedBuf, Backend, BackendKind, DataFile, IO_ALIGN, IoConfig, IoEngine};

const BLOCK: usize = IO_ALIGN;

fn engine(kind: BackendKind) -> IoEngine {
    let io = IoEngine::new(kind).expect("start I/O engine");
    let want = match kind {
        BackendKind::Uring => Backend::Uring,
        _ => Backend::Threads,
    };
    assert_eq!(io.backend(), want);
    io
}

/// A directory on the disk-backed filesystem (tempfile's default /tmp may be tmpfs elsewhere).
fn disk_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("zebu-io-test")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp")
}

fn shm_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("zebu-io-test")
        .tempdir_in("/dev/shm")
        .expect("tempdir in /dev/shm")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random()).collect()
}

/// Rounds of many concurrent reads and writes on disjoint block ranges, checked against a
/// `Vec<u8>` model of the file. Ranges within a round are disjoint because concurrent
/// operations on overlapping ranges have no defined order.
async fn random_ops_match_model(io: &IoEngine, file: Arc<DataFile>, seed: u64) {
    const BLOCKS: usize = 1024;
    let mut model = vec![0u8; BLOCKS * BLOCK];
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..8u64 {
        // Cut the file into random runs of 1..=8 blocks; each run is read or written.
        let mut ops = Vec::new();
        let mut block = 0;
        while block < BLOCKS {
            let len = rng.random_range(1..=8).min(BLOCKS - block);
            ops.push((block, len, rng.random_bool(0.5)));
            block += len;
        }
        assert!(ops.len() > 200, "enough operations to fill the queue");
        let futures = ops.iter().map(|&(block, len, write)| {
            let io = io.clone();
            let file = file.clone();
            let offset = block * BLOCK;
            let expected = model[offset..offset + len * BLOCK].to_vec();
            let data = pattern(round * 1_000_000 + block as u64, len * BLOCK);
            async move {
                if write {
                    let buf = io
                        .write_at(&file, offset as u64, AlignedBuf::copy_from(&data))
                        .await
                        .expect("write");
                    assert_eq!(buf.len(), len * BLOCK, "write returns its buffer");
                    Some((offset, data))
                } else {
                    let mut buf = AlignedBuf::zeroed(len * BLOCK);
                    buf.fill(0xEE);
                    let buf = io.read_at(&file, offset as u64, buf).await.expect("read");
                    assert!(
                        buf[..] == expected[..],
                        "round {round}: read of blocks {block}+{len} differs from the model"
                    );
                    None
                }
            }
        });
        for (offset, data) in join_all(futures).await.into_iter().flatten() {
            model[offset..offset + data.len()].copy_from_slice(&data);
        }
    }
    // Whole-file read at the end, in one request larger than any single write.
    let buf = io
        .read_at(&file, 0, AlignedBuf::zeroed(BLOCKS * BLOCK))
        .await
        .expect("read all");
    assert!(buf[..] == model[..], "final contents differ from the model");
}

/// A file whose size is not a multiple of the block size: the tail reads as data then zeros,
/// and a read wholly past the end is all zeros — whatever the buffer held before.
async fn reads_past_eof_are_zero_filled(io: &IoEngine, path: &Path, direct_expected: bool) {
    let data = pattern(7, 2 * BLOCK + 1000);
    std::fs::write(path, &data).expect("write test file");
    let file = Arc::new(DataFile::open(path, false).expect("open"));
    assert_eq!(file.is_direct(), direct_expected);

    let mut buf = AlignedBuf::zeroed(8 * BLOCK);
    buf.fill(0xAA);
    let buf = io.read_at(&file, 0, buf).await.expect("read across EOF");
    assert!(buf[..data.len()] == data[..], "data before EOF");
    assert!(buf[data.len()..].iter().all(|&b| b == 0), "zeros after EOF");

    let mut buf = AlignedBuf::zeroed(2 * BLOCK);
    buf.fill(0xAA);
    let buf = io
        .read_at(&file, 2 * BLOCK as u64, buf)
        .await
        .expect("read of the tail block");
    assert!(buf[..1000] == data[2 * BLOCK..], "tail data");
    assert!(buf[1000..].iter().all(|&b| b == 0), "zeros after the tail");

    let mut buf = AlignedBuf::zeroed(4 * BLOCK);
    buf.fill(0xAA);
    let buf = io
        .read_at(&file, 64 * BLOCK as u64, buf)
        .await
        .expect("read past EOF");
    assert!(buf.iter().all(|&b| b == 0), "all zeros past EOF");
}

async fn errors_propagate(io: &IoEngine, dir: &Path) {
    let path = dir.join("ro");
    std::fs::write(path.clone(), vec![1u8; BLOCK]).expect("create");
    let ro = Arc::new(DataFile::open_read_only(&path).expect("open read-only"));
    let err = io
        .write_at(&ro, 0, AlignedBuf::zeroed(BLOCK))
        .await
        .expect_err("write to a read-only descriptor");
    assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
    // The engine is still usable after an error, and the file is unchanged.
    let buf = io
        .read_at(&ro, 0, AlignedBuf::zeroed(BLOCK))
        .await
        .expect("read after failed write");
    assert!(buf.iter().all(|&b| b == 1));

    let sub = dir.join("subdir");
    std::fs::create_dir(&sub).expect("mkdir");
    let d = Arc::new(DataFile::open_read_only(&sub).expect("open a directory"));
    let err = io
        .read_at(&d, 0, AlignedBuf::zeroed(BLOCK))
        .await
        .expect_err("read of a directory");
    assert_eq!(err.raw_os_error(), Some(libc::EISDIR), "{err}");
}

async fn sync_makes_writes_visible_after_reopen(io: &IoEngine, path: &Path) {
    let file = Arc::new(DataFile::open(path, true).expect("create"));
    let data = pattern(11, 4 * BLOCK);
    io.write_at(&file, BLOCK as u64, AlignedBuf::copy_from(&data))
        .await
        .expect("write");
    io.sync(&file).await.expect("sync");
    io.sync(&file)
        .await
        .expect("second sync with nothing dirty");
    drop(file);
    let on_disk = std::fs::read(path).expect("read back");
    assert_eq!(on_disk.len(), 5 * BLOCK);
    assert!(on_disk[..BLOCK].iter().all(|&b| b == 0));
    assert!(on_disk[BLOCK..] == data[..]);
}

/// Requests split into one-block pieces go through the same path as short transfers.
async fn split_transfers_round_trip(kind: BackendKind, path: &Path) {
    let config = IoConfig {
        max_chunk: BLOCK,
        uring_entries: 4,
        uring_rings: 2,
        threads: 2,
        ..IoConfig::default()
    };
    let io = IoEngine::with_config(kind, config).expect("engine");
    let file = Arc::new(DataFile::open(path, true).expect("create"));
    let writes = (0..64u64).map(|i| {
        let io = io.clone();
        let file = file.clone();
        async move {
            let data = pattern(100 + i, 16 * BLOCK);
            io.write_at(&file, i * 16 * BLOCK as u64, AlignedBuf::copy_from(&data))
                .await
                .expect("split write");
        }
    });
    join_all(writes).await;
    let reads = (0..64u64).map(|i| {
        let io = io.clone();
        let file = file.clone();
        async move {
            let buf = io
                .read_at(&file, i * 16 * BLOCK as u64, AlignedBuf::zeroed(16 * BLOCK))
                .await
                .expect("split read");
            assert!(buf[..] == pattern(100 + i, 16 * BLOCK)[..], "piece {i}");
        }
    });
    join_all(reads).await;
}

/// Dropping I/O futures mid-flight neither breaks the engine nor loses the operations'
/// memory safety; dropping every engine clone stops the back end without hanging.
async fn cancelled_requests_and_shutdown(kind: BackendKind, path: &Path) {
    let io = engine(kind);
    let file = Arc::new(DataFile::open(path, true).expect("create"));
    for i in 0..200u64 {
        let fut = io.write_at(&file, i * BLOCK as u64, AlignedBuf::zeroed(BLOCK));
        // Poll once (submits), then drop: the operation must still complete safely.
        let _ = tokio::time::timeout(std::time::Duration::ZERO, fut).await;
    }
    let data = pattern(5, BLOCK);
    io.write_at(&file, 0, AlignedBuf::copy_from(&data))
        .await
        .expect("write after cancellations");
    let buf = io
        .read_at(&file, 0, AlignedBuf::zeroed(BLOCK))
        .await
        .expect("read after cancellations");
    assert!(buf[..] == data[..]);
    let clone = io.clone();
    drop(io);
    clone
        .sync(&file)
        .await
        .expect("a clone keeps the engine running");
    let dropper = std::thread::spawn(move || drop(clone));
    dropper.join().expect("engine drop joins its threads");
}

macro_rules! suite {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn random_concurrent_ops_match_model_on_direct_file() {
                let dir = disk_dir();
                let file = Arc::new(DataFile::open(&dir.path().join("f"), true).expect("open"));
                assert!(
                    file.is_direct(),
                    "/var/tmp is a disk filesystem that allows O_DIRECT"
                );
                random_ops_match_model(&engine($kind), file, 1).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn random_concurrent_ops_match_model_on_buffered_tmpfs_file() {
                let dir = shm_dir();
                // tmpfs accepts O_DIRECT since Linux 6.6, so force the buffered path that
                // `DataFile::open` falls back to where O_DIRECT is refused.
                let path = dir.path().join("f");
                let file = Arc::new(DataFile::open_buffered(&path, true).expect("open"));
                assert!(!file.is_direct());
                random_ops_match_model(&engine($kind), file, 2).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn random_concurrent_ops_match_model_on_tmpfs_file() {
                let dir = shm_dir();
                let path = dir.path().join("f");
                let file = Arc::new(DataFile::open(&path, true).expect("open"));
                random_ops_match_model(&engine($kind), file, 3).await;
            }

            #[tokio::test]
            async fn reads_past_eof_are_zero_filled_on_direct_file() {
                let dir = disk_dir();
                reads_past_eof_are_zero_filled(&engine($kind), &dir.path().join("f"), true).await;
            }

            #[tokio::test]
            async fn reads_past_eof_are_zero_filled_on_buffered_file() {
                let dir = shm_dir();
                let path = dir.path().join("f");
                std::fs::write(&path, b"").expect("create");
                let io = engine($kind);
                let data = pattern(9, BLOCK + 100);
                let file = Arc::new(DataFile::open_buffered(&path, false).expect("open"));
                io.write_at(&file, 0, AlignedBuf::copy_from(&data))
                    .await
                    .expect("write");
                // Cut the file to an unaligned length, as a crash mid-extend might.
                file.file().set_len(data.len() as u64).expect("truncate");
                let mut buf = AlignedBuf::zeroed(4 * BLOCK);
                buf.fill(0xAA);
                let buf = io.read_at(&file, 0, buf).await.expect("read");
                assert!(buf[..data.len()] == data[..]);
                assert!(buf[data.len()..].iter().all(|&b| b == 0));
            }

            #[tokio::test]
            async fn errors_propagate_and_engine_survives() {
                let dir = disk_dir();
                errors_propagate(&engine($kind), dir.path()).await;
            }

            #[tokio::test]
            async fn unaligned_offset_on_direct_file_is_einval() {
                let dir = disk_dir();
                let file = Arc::new(DataFile::open(&dir.path().join("f"), true).expect("open"));
                assert!(file.is_direct());
                let err = engine($kind)
                    .write_at(&file, 1, AlignedBuf::zeroed(BLOCK))
                    .await
                    .expect_err("O_DIRECT write at offset 1");
                assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
            }

            #[tokio::test]
            async fn sync_succeeds_and_data_is_in_the_file() {
                let dir = disk_dir();
                sync_makes_writes_visible_after_reopen(&engine($kind), &dir.path().join("f")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn requests_split_into_pieces_round_trip() {
                let dir = disk_dir();
                split_transfers_round_trip($kind, &dir.path().join("f")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cancelled_requests_complete_and_shutdown_joins() {
                let dir = disk_dir();
                cancelled_requests_and_shutdown($kind, &dir.path().join("f")).await;
            }
        }
    };
}

suite!(uring, BackendKind::Uring);
suite!(threads, BackendKind::Threads);

#[tokio::test]
async fn auto_picks_a_working_backend() {
    let io = IoEngine::new(BackendKind::Auto).expect("auto");
    let dir = disk_dir();
    let path: PathBuf = dir.path().join("f");
    let file = Arc::new(DataFile::open(&path, true).expect("open"));
    let data = pattern(3, BLOCK);
    io.write_at(&file, 0, AlignedBuf::copy_from(&data))
        .await
        .expect("write");
    let buf = io
        .read_at(&file, 0, AlignedBuf::zeroed(BLOCK))
        .await
        .expect("read");
    assert!(buf[..] == data[..]);
    // When io_uring works here and nothing forces the choice, Auto must not settle for less.
    if std::env::var_os("ZEBU_IO_BACKEND").is_none() && IoEngine::new(BackendKind::Uring).is_ok() {
        assert_eq!(io.backend(), Backend::Uring);
    }
}
