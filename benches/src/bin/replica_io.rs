//! Replica I/O benchmark: the replica's I/O back ends (or the whole store) against fio on the
//! same file, in the same run. Method and command: benches/README.md.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use zebu_benches::{MIB, Workload, select_workloads};
use zebu_replica::Replica;
use zebu_replica::io::{AlignedBuf, BackendKind, DataFile, IO_ALIGN, IoConfig, IoEngine};

#[derive(Parser, Debug)]
#[command(about = "4 KiB random and 1 MiB sequential I/O through the replica, against fio")]
struct Args {
    /// Directory for the test file (must be on the filesystem under test, not tmpfs).
    #[arg(long, default_value = "/var/tmp/zebu-bench-io")]
    dir: PathBuf,
    /// File (and, for --level store, volume) size, e.g. 1G, 256M.
    #[arg(long, default_value = "1G", value_parser = zebu_size::parse_nonzero)]
    size: u64,
    /// Seconds per row.
    #[arg(long, default_value_t = 5)]
    runtime: u64,
    /// Requests in flight per row.
    #[arg(long, default_value_t = 32)]
    iodepth: usize,
    /// `io` drives IoEngine directly; `store` drives zebu_replica::Replica.
    #[arg(long, value_enum, default_value_t = Level::Io)]
    level: Level,
    /// Back ends to measure.
    #[arg(long, value_delimiter = ',', default_values = ["uring", "threads"])]
    backends: Vec<String>,
    /// Threads of the thread-pool back end (default: IoConfig's).
    #[arg(long)]
    threads: Option<usize>,
    /// Rings of the io_uring back end (default: IoConfig's).
    #[arg(long)]
    rings: Option<usize>,
    /// Workloads to run (default all): randwrite, randread, seqwrite, seqread.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Skip the fio reference rows.
    #[arg(long)]
    no_fio: bool,
    /// `--level io` only: make the file sparse again (truncate to 0, then to `--size`) before
    /// every write row, fio's included, so that every write allocates blocks as the store's
    /// writes into fresh layer files do. Uses `<dir>/replica-io-sparse.dat`. Read rows then
    /// mostly read holes, so pair it with `--workloads randwrite,seqwrite`.
    #[arg(long)]
    sparse: bool,
    /// `--level store` only: hand `Replica::write` its payload in page-aligned memory
    /// (`AlignedBuf::into_bytes`), as a transport that receives into aligned buffers would, so
    /// the store writes it without a copy. By default the payload is an ordinary heap `Bytes`
    /// (as a gRPC message gives today), which the store copies into an aligned buffer.
    #[arg(long)]
    aligned_payload: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Level {
    Io,
    Store,
}

#[derive(Debug, Clone)]
struct Measurement {
    workload: &'static str,
    engine: String,
    ops: u64,
    bytes: u64,
    elapsed: Duration,
    mean_latency_us: f64,
    /// user+sys CPU seconds of whoever served the row: this process (the caller's thread, the
    /// back end's threads and the kernel's io-wq workers, which belong to the process) for
    /// Zebu rows, the fio child for fio rows.
    cpu_s: f64,
}

impl Measurement {
    /// CPU per request in µs.
    fn cpu_us_per_op(&self) -> f64 {
        self.cpu_s * 1e6 / self.ops.max(1) as f64
    }
    fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
    fn mib_s(&self) -> f64 {
        self.bytes as f64 / MIB as f64 / self.elapsed.as_secs_f64()
    }
}

/// user+sys CPU seconds used so far by this process (`RUSAGE_SELF`: every thread, io-wq
/// workers included) or by its waited-for children (`RUSAGE_CHILDREN`: the fio runs).
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage; getrusage writes only into it.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.size < MIB || !args.size.is_multiple_of(MIB) {
        bail!("--size must be a whole number of MiB");
    }
    let workloads = select_workloads(&args.workloads)?;
    let kinds: Vec<BackendKind> = args
        .backends
        .iter()
        .map(|b| b.parse().with_context(|| format!("--backends {b}")))
        .collect::<anyhow::Result<_>>()?;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("create {:?}", args.dir))?;

    // One thread drives the requests, as fio's single job does; the back ends run their own
    // threads (the ring thread, or the pool).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let results = rt.block_on(run(&args, &workloads, &kinds))?;

    print_table(&args, &results);
    if let Some(path) = &args.json {
        write_json(&args, &results, path)?;
    }
    Ok(())
}

async fn run(
    args: &Args,
    workloads: &[Workload],
    kinds: &[BackendKind],
) -> anyhow::Result<Vec<Measurement>> {
    let mut engines = Vec::new();
    for &kind in kinds {
        let mut config = IoConfig::default();
        if let Some(threads) = args.threads {
            config.threads = threads;
        }
        if let Some(rings) = args.rings {
            config.uring_rings = rings;
        }
        let io = IoEngine::with_config(kind, config).with_context(|| format!("{kind:?} engine"))?;
        engines.push(io);
    }

    if args.sparse && args.level != Level::Io {
        bail!("--sparse applies to --level io only");
    }
    let file_path = if args.sparse {
        let path = args.dir.join("replica-io-sparse.dat");
        make_sparse(&path, args.size)?;
        path
    } else {
        let path = args.dir.join("replica-io.dat");
        prepare_file(&path, args.size)?;
        path
    };
    let mut targets = Vec::new();
    for io in &engines {
        let target = match args.level {
            Level::Io => {
                let file = Arc::new(DataFile::open(&file_path, false)?);
                if !file.is_direct() {
                    eprintln!("warning: {file_path:?} refused O_DIRECT; measuring the page cache");
                }
                Target::Io {
                    io: io.clone(),
                    file,
                }
            }
            Level::Store => {
                let dir = args.dir.join(format!("store-{}", io.backend()));
                if dir.exists() {
                    std::fs::remove_dir_all(&dir).with_context(|| format!("clear {dir:?}"))?;
                }
                let replica = Replica::create(&dir, args.size, io.clone())
                    .await
                    .with_context(|| format!("create replica in {dir:?}"))?;
                let target = Target::Store { replica };
                fill_store(&target, args.size).await?;
                target
            }
        };
        targets.push((io.backend().to_string(), target));
    }

    let mut results = Vec::new();
    for w in workloads {
        let resparse = args.sparse && w.write;
        if !args.no_fio {
            if resparse {
                make_sparse(&file_path, args.size)?;
            }
            let m = run_fio(args, w, &file_path)?;
            report_row(&m);
            results.push(m);
        }
        for (name, target) in &targets {
            if resparse {
                make_sparse(&file_path, args.size)?;
            }
            let m = run_row(args, w, name, target).await?;
            report_row(&m);
            results.push(m);
        }
    }
    Ok(results)
}

fn report_row(m: &Measurement) {
    eprintln!(
        "{:<10} {:<8} {:>10.0} IOPS {:>9.1} MiB/s {:>8.1} µs CPU/op",
        m.workload,
        m.engine,
        m.iops(),
        m.mib_s(),
        m.cpu_us_per_op()
    );
}

/// Creates the file at full size with non-zero data, so reads hit written blocks (an
/// unwritten extent reads as zeros without touching the disk) and writes overwrite allocated
/// blocks, as fio's own layout would. A file already of the right size is reused.
fn prepare_file(path: &Path, size: u64) -> anyhow::Result<()> {
    if std::fs::metadata(path)
        .map(|m| m.len() == size)
        .unwrap_or(false)
    {
        return Ok(());
    }
    eprintln!("preparing {path:?} ({} MiB)", size / MIB);
    use std::io::Write;
    let mut f = std::fs::File::create(path).with_context(|| format!("create {path:?}"))?;
    let mut rng = StdRng::seed_from_u64(42);
    let mut chunk = vec![0u8; MIB as usize];
    for _ in 0..size / MIB {
        rng.fill(&mut chunk[..]);
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    Ok(())
}

/// Frees every block of the file and gives it its size back, keeping the inode (the open
/// `DataFile`s of the targets stay valid): the next writes all allocate.
fn make_sparse(path: &Path, size: u64) -> anyhow::Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("open {path:?}"))?;
    f.set_len(0).with_context(|| format!("truncate {path:?}"))?;
    f.set_len(size)
        .with_context(|| format!("extend {path:?}"))?;
    f.sync_all()?;
    Ok(())
}

enum Target {
    Io { io: IoEngine, file: Arc<DataFile> },
    Store { replica: Arc<Replica> },
}

impl Target {
    async fn write(
        &self,
        offset: u64,
        buf: AlignedBuf,
        data: &Bytes,
    ) -> anyhow::Result<AlignedBuf> {
        match self {
            Target::Io { io, file } => Ok(io.write_at(file, offset, buf).await?),
            Target::Store { replica } => {
                replica.write(offset, data.clone()).await?;
                Ok(buf)
            }
        }
    }

    async fn read(&self, offset: u64, buf: AlignedBuf) -> anyhow::Result<AlignedBuf> {
        match self {
            Target::Io { io, file } => Ok(io.read_at(file, offset, buf).await?),
            Target::Store { replica } => {
                let data = replica.read(offset, buf.len() as u64).await?;
                if data.len() != buf.len() {
                    bail!("store read {} bytes, asked {}", data.len(), buf.len());
                }
                Ok(buf)
            }
        }
    }

    /// The flush point that ends a write row (fio: `--end_fsync=1`).
    async fn flush(&self) -> anyhow::Result<()> {
        match self {
            Target::Io { io, file } => io.sync(file).await?,
            Target::Store { replica } => {
                replica.flush(0).await?;
            }
        }
        Ok(())
    }
}

/// Writes the whole volume once so that store reads resolve to data, as for the plain file.
async fn fill_store(target: &Target, size: u64) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(43);
    let mut chunk = vec![0u8; MIB as usize];
    for i in 0..size / MIB {
        rng.fill(&mut chunk[..]);
        let data = Bytes::copy_from_slice(&chunk);
        target
            .write(i * MIB, AlignedBuf::zeroed(IO_ALIGN), &data)
            .await?;
    }
    target.flush().await
}

/// `iodepth` tasks each keep one request in flight until the deadline.
async fn run_row(
    args: &Args,
    w: &Workload,
    engine: &str,
    target: &Target,
) -> anyhow::Result<Measurement> {
    let blocks = args.size / w.block;
    let next_seq = AtomicU64::new(0);
    let cpu0 = cpu_seconds(libc::RUSAGE_SELF);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.runtime);
    let workers = (0..args.iodepth).map(|i| {
        let next_seq = &next_seq;
        async move {
            let mut rng = StdRng::seed_from_u64(1000 + i as u64);
            let mut buf = AlignedBuf::zeroed(w.block as usize);
            rng.fill(&mut buf[..]);
            let data = if args.aligned_payload {
                AlignedBuf::copy_from(&buf).into_bytes()
            } else {
                Bytes::copy_from_slice(&buf)
            };
            let (mut ops, mut busy) = (0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let block = if w.random {
                    rng.random_range(0..blocks)
                } else {
                    next_seq.fetch_add(1, Ordering::Relaxed) % blocks
                };
                let t0 = Instant::now();
                buf = if w.write {
                    target.write(block * w.block, buf, &data).await?
                } else {
                    target.read(block * w.block, buf).await?
                };
                busy += t0.elapsed();
                ops += 1;
            }
            anyhow::Ok((ops, busy))
        }
    });
    let per_worker = futures::future::try_join_all(workers).await?;
    if w.write {
        target.flush().await?;
    }
    let elapsed = start.elapsed();
    let cpu_s = cpu_seconds(libc::RUSAGE_SELF) - cpu0;
    let ops: u64 = per_worker.iter().map(|(ops, _)| ops).sum();
    let busy: Duration = per_worker.iter().map(|(_, busy)| *busy).sum();
    Ok(Measurement {
        workload: w.name,
        engine: engine.to_string(),
        ops,
        bytes: ops * w.block,
        elapsed,
        mean_latency_us: busy.as_secs_f64() * 1e6 / ops.max(1) as f64,
        cpu_s,
    })
}

fn run_fio(args: &Args, w: &Workload, file: &Path) -> anyhow::Result<Measurement> {
    // fio is waited for before `run_fio` returns, so its CPU is in RUSAGE_CHILDREN by then.
    let cpu0 = cpu_seconds(libc::RUSAGE_CHILDREN);
    let f = zebu_benches::run_fio(w, file, args.size, args.runtime, args.iodepth)?;
    let cpu_s = cpu_seconds(libc::RUSAGE_CHILDREN) - cpu0;
    Ok(Measurement {
        workload: w.name,
        engine: "fio".into(),
        ops: f.ops,
        bytes: f.bytes,
        elapsed: f.elapsed,
        mean_latency_us: f.mean_latency_us,
        cpu_s,
    })
}

fn fio_row<'a>(results: &'a [Measurement], workload: &str) -> Option<&'a Measurement> {
    results
        .iter()
        .find(|m| m.workload == workload && m.engine == "fio")
}

fn fio_iops(results: &[Measurement], workload: &str) -> Option<f64> {
    fio_row(results, workload).map(Measurement::iops)
}

fn print_table(args: &Args, results: &[Measurement]) {
    println!(
        "\nreplica_io --level {:?}{}: {} MiB file in {}, iodepth {}, {} s per row, {} io_uring rings",
        args.level,
        if args.sparse { " --sparse" } else { "" },
        args.size / MIB,
        args.dir.display(),
        args.iodepth,
        args.runtime,
        args.rings.unwrap_or(IoConfig::default().uring_rings),
    );
    println!(
        "{:<10} {:<9} {:>10} {:>10} {:>12} {:>8} {:>11} {:>10}",
        "workload", "engine", "IOPS", "MiB/s", "mean lat µs", "vs fio", "µs CPU/op", "CPU vs fio"
    );
    for m in results {
        let fio = fio_row(results, m.workload);
        let ratio = fio
            .map(|f| format!("{:.2}", m.iops() / f.iops()))
            .unwrap_or_else(|| "-".into());
        let cpu_ratio = fio
            .filter(|f| f.cpu_s > 0.0)
            .map(|f| format!("{:.2}", m.cpu_us_per_op() / f.cpu_us_per_op()))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<10} {:<9} {:>10.0} {:>10.1} {:>12.1} {:>8} {:>11.1} {:>10}",
            m.workload,
            m.engine,
            m.iops(),
            m.mib_s(),
            m.mean_latency_us,
            ratio,
            m.cpu_us_per_op(),
            cpu_ratio
        );
    }
}

fn write_json(args: &Args, results: &[Measurement], path: &Path) -> anyhow::Result<()> {
    let rows: Vec<_> = results
        .iter()
        .map(|m| {
            json!({
                "workload": m.workload,
                "engine": m.engine,
                "ops": m.ops,
                "bytes": m.bytes,
                "seconds": m.elapsed.as_secs_f64(),
                "iops": m.iops(),
                "mib_per_s": m.mib_s(),
                "mean_latency_us": m.mean_latency_us,
                "ratio_to_fio": fio_iops(results, m.workload).map(|f| m.iops() / f),
                "cpu_s": m.cpu_s,
                "cpu_us_per_op": m.cpu_us_per_op(),
                "cpu_ratio_to_fio": fio_row(results, m.workload)
                    .filter(|f| f.cpu_s > 0.0)
                    .map(|f| m.cpu_us_per_op() / f.cpu_us_per_op()),
            })
        })
        .collect();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let doc = json!({
        "benchmark": "replica_io",
        "level": format!("{:?}", args.level).to_lowercase(),
        "dir": args.dir,
        "size_bytes": args.size,
        "iodepth": args.iodepth,
        "runtime_s": args.runtime,
        "sparse": args.sparse,
        "aligned_payload": args.aligned_payload,
        "uring_rings": args.rings.unwrap_or(IoConfig::default().uring_rings),
        "kernel": kernel,
        "results": rows,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("write {path:?}"))?;
    Ok(())
}
