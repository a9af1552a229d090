//! What the replica's per-region flush bookkeeping costs random writes.
//!
//! Method: 4 KiB random writes at queue depth 32 for `--runtime` seconds on a `--size` file
//! (default 1 GiB, written in full first so no row pays block allocation), with a flush
//! after every `--flush-every` writes (default 100: a database committing often; the flush
//! is what makes the bookkeeping re-mark regions). Two rows in the same run, same back end,
//! same file system:
//! - `raw`: `IoEngine` writes to one `O_DIRECT` file, `fdatasync` every N writes — the disk
//!   work without any replica logic;
//! - `store`: `Replica::write` and `Replica::flush` — layer index, dirty-region write-ahead
//!   marks (group-committed), flush-number header.
//!
//! The ratio store/raw bounds what the bookkeeping costs (it also includes the index and the
//! I/O gate). Rows alternate `--rounds` times to even out the machine's noise.
//!
//! `cargo run --release -p zebu-benches --bin regions_cost -- --dir /var/tmp/zebu-regions`

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use zebu_replica::Replica;
use zebu_replica::io::{AlignedBuf, BackendKind, DataFile, IoEngine};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "/var/tmp/zebu-regions")]
    dir: PathBuf,
    /// Bytes (MiB granularity).
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    #[arg(long, default_value_t = 5)]
    runtime: u64,
    #[arg(long, default_value_t = 100)]
    flush_every: u64,
    #[arg(long, default_value_t = 32)]
    qd: u64,
    #[arg(long, default_value_t = 2)]
    rounds: u32,
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs `qd` workers issuing `op(offset)` until the deadline; every `flush_every` writes
/// overall, the worker that crossed the mark runs `flush()` inline. Returns IOPS.
async fn drive<W, F, WF, FF>(
    qd: u64,
    blocks: u64,
    runtime: Duration,
    flush_every: u64,
    write: W,
    flush: F,
) -> f64
where
    W: Fn(u64) -> WF + Send + Sync + 'static,
    F: Fn() -> FF + Send + Sync + 'static,
    WF: std::future::Future<Output = ()> + Send,
    FF: std::future::Future<Output = ()> + Send,
{
    let (write, flush) = (Arc::new(write), Arc::new(flush));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..qd)
        .map(|w| {
            let (write, flush, done) = (write.clone(), flush.clone(), done.clone());
            tokio::spawn(async move {
                let mut x = 0x9E37_79B9_7F4A_7C15 ^ (w + 1);
                while start.elapsed() < runtime {
                    write(next(&mut x) % blocks * 4096).await;
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if flush_every > 0 && n.is_multiple_of(flush_every) {
                        flush().await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let size = args.size_mib << 20;
        let blocks = size / 4096;
        let runtime = Duration::from_secs(args.runtime);
        let _ = std::fs::remove_dir_all(&args.dir);
        std::fs::create_dir_all(&args.dir)?;
        let io = IoEngine::new(BackendKind::Auto)?;
        let raw = Arc::new(DataFile::open(&args.dir.join("raw.dat"), true)?);
        raw.file().set_len(size)?;
        let store = Replica::create(&args.dir.join("store"), size, io.clone()).await?;
        let chunk = vec![0x5Au8; 1 << 20];
        for off in (0..size).step_by(1 << 20) {
            io.write_at(&raw, off, AlignedBuf::copy_from(&chunk)).await?;
            store.write(off, Bytes::from(chunk.clone())).await?;
        }
        io.sync(&raw).await?;
        store.flush(0).await?;
        println!(
            "regions_cost: {} MiB, 4 KiB random writes, QD {}, flush every {} writes, {} s per row, backend {}",
            args.size_mib, args.qd, args.flush_every, args.runtime, io.backend()
        );
        let (mut raw_sum, mut store_sum) = (0.0, 0.0);
        for round in 0..args.rounds {
            let (io1, f1, io2, f2) = (io.clone(), raw.clone(), io.clone(), raw.clone());
            let r = drive(
                args.qd,
                blocks,
                runtime,
                args.flush_every,
                move |off| {
                    let (io, f) = (io1.clone(), f1.clone());
                    async move {
                        let _ = io.write_at(&f, off, AlignedBuf::zeroed(4096)).await;
                    }
                },
                move || {
                    let (io, f) = (io2.clone(), f2.clone());
                    async move {
                        let _ = io.sync(&f).await;
                    }
                },
            )
            .await;
            let (s1, s2) = (store.clone(), store.clone());
            let s = drive(
                args.qd,
                blocks,
                runtime,
                args.flush_every,
                move |off| {
                    let s = s1.clone();
                    async move {
                        let _ = s.write(off, Bytes::from_static(&[0u8; 4096])).await;
                    }
                },
                move || {
                    let s = s2.clone();
                    async move {
                        let _ = s.flush(0).await;
                    }
                },
            )
            .await;
            println!("round {round}: raw {r:>8.0} IOPS   store {s:>8.0} IOPS   store/raw {:.2}", s / r);
            raw_sum += r;
            store_sum += s;
        }
        println!("mean: raw {:.0} IOPS, store {:.0} IOPS, store/raw {:.2}", raw_sum / f64::from(args.rounds),
            store_sum / f64::from(args.rounds), store_sum / raw_sum);
        let _ = std::fs::remove_dir_all(&args.dir);
        Ok(())
    })
}
