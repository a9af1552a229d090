//! Engine benchmark: the replicator with 1 and 3 replicas on loopback, driven in-process
//! through its `BlockDevice` API, against fio on a plain file in the same run; rebuild
//! throughput; engine memory (in-process and as a `zebu-engine serve` process behind NBD);
//! replica CPU per GiB moved. Method, command and caveats: benches/README.md.
//!
//! The engine runs on this process's multi-thread tokio runtime, as it does in
//! `zebu-engine serve`; the load generator is `iodepth` tokio tasks, each keeping one
//! request in flight, like a frontend that gets `iodepth` requests from its initiator.
//! Replicas are real `zebu-replica serve` processes on 127.0.0.11-13, so every replica
//! request crosses a loopback TCP connection and the replica's own runtime, as in
//! production.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use zebu_benches::{GIB, KIB, MIB, WORKLOADS, Workload, select_workloads};
use zebu_engine::blockdev::BlockDevice;
use zebu_engine::replicator::{RebuildState, StartOptions, Volume, VolumeConfig};
use zebu_testkit::workload::NbdClient;
use zebu_tests::{ReplicaProcess, bin_path, loopback};

/// Replica `i` (0-based) listens on 127.0.0.(11 + i).
const FIRST_REPLICA_HOST: u8 = 11;
/// The `zebu-engine serve` process listens (NBD, control) here.
const ENGINE_HOST: &str = "127.0.0.14";
/// The goal from the issue: the engine process stays below this.
const RSS_GOAL_MIB: f64 = 64.0;

#[derive(Parser, Debug)]
#[command(about = "Engine I/O, rebuild, memory and CPU, against fio on a plain file")]
struct Args {
    /// Directory for the plain file and the replicas (the filesystem under test, not tmpfs).
    #[arg(long, default_value = "/var/tmp/zebu-bench-engine")]
    dir: PathBuf,
    /// Plain file and volume size for the I/O rows, e.g. 1G.
    #[arg(long, default_value = "1G", value_parser = zebu_size::parse_nonzero)]
    size: u64,
    /// Seconds per row.
    #[arg(long, default_value_t = 5)]
    runtime: u64,
    /// Requests in flight per row.
    #[arg(long, default_value_t = 32)]
    iodepth: usize,
    /// Replica counts to measure (each at most 3).
    #[arg(long, value_delimiter = ',', default_values = ["1", "3"])]
    replicas: Vec<usize>,
    /// Workloads to run (default all): randwrite, randread, seqwrite, seqread.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Volume size of the rebuild measurement.
    #[arg(long, default_value = "4G", value_parser = zebu_size::parse_nonzero)]
    rebuild_size: u64,
    /// Bytes written (from offset 0) before the rebuild.
    #[arg(long, default_value = "2G", value_parser = zebu_size::parse_nonzero)]
    rebuild_fill: u64,
    #[arg(long)]
    no_fio: bool,
    #[arg(long)]
    no_rebuild: bool,
    /// Skip the `zebu-engine serve` process (NBD) measurement.
    #[arg(long)]
    no_serve: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One measured row.
#[derive(Debug, Clone)]
struct Row {
    workload: &'static str,
    /// `fio`, `engine-1r`, `engine-3r`, `nbd-3r`.
    target: String,
    ops: u64,
    bytes: u64,
    elapsed: Duration,
    mean_latency_us: f64,
    /// user+sys seconds of all replica processes during the row.
    replica_cpu_s: Option<f64>,
    /// user+sys seconds of the engine during the row (in-process: this whole process,
    /// load generator included).
    engine_cpu_s: Option<f64>,
}

impl Row {
    fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
    fn mib_s(&self) -> f64 {
        self.bytes as f64 / MIB as f64 / self.elapsed.as_secs_f64()
    }
    fn per_gib(&self, cpu: Option<f64>) -> Option<f64> {
        cpu.map(|c| c / (self.bytes as f64 / GIB as f64).max(1e-9))
    }
}

#[derive(Debug, Default, Clone)]
struct RebuildResult {
    fill_bytes: u64,
    fill_seconds: f64,
    bytes_total: u64,
    bytes_copied: u64,
    seconds: f64,
    replica_cpu_s: f64,
    state: String,
}

#[derive(Debug, Default, Clone)]
struct Memory {
    /// This process before the first `Volume::start`, and after the in-process runs (kB).
    before_rss_kb: u64,
    before_hwm_kb: u64,
    after_rss_kb: u64,
    after_hwm_kb: u64,
    /// The `zebu-engine serve` process: idle after start, and after the NBD rows (kB).
    serve_idle_rss_kb: Option<u64>,
    serve_rss_kb: Option<u64>,
    serve_hwm_kb: Option<u64>,
}

#[derive(Debug, Default)]
struct Report {
    load_start: String,
    load_end: String,
    rows: Vec<Row>,
    rebuild: Option<RebuildResult>,
    memory: Memory,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.size < MIB || !args.size.is_multiple_of(MIB) {
        bail!("--size must be a whole number of MiB");
    }
    if args.rebuild_fill > args.rebuild_size || !args.rebuild_fill.is_multiple_of(MIB) {
        bail!("--rebuild-fill must be whole MiB and at most --rebuild-size");
    }
    if args.replicas.iter().any(|&n| n == 0 || n > 3) {
        bail!("--replicas takes counts from 1 to 3");
    }
    // The replica and engine binaries sit next to this one (target/release); zebu-tests'
    // bin_path looks there when ZEBU_BIN_DIR says so.
    if std::env::var_os("ZEBU_BIN_DIR").is_none() {
        let exe = std::env::current_exe().context("locating this executable")?;
        let dir = exe.parent().context("executable directory")?.to_path_buf();
        // SAFETY: no other thread exists yet (the runtime is built below), so nothing can
        // read the environment concurrently.
        unsafe { std::env::set_var("ZEBU_BIN_DIR", &dir) };
    }
    for name in ["zebu-replica", "zebu-engine"] {
        let p = bin_path(name);
        if !p.exists() {
            bail!(
                "{} is missing; build it first: cargo build --release -p zebu-replica \
                 -p zebu-engine --bins",
                p.display()
            );
        }
    }
    let workloads = select_workloads(&args.workloads)?;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("create {:?}", args.dir))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let report = rt.block_on(run(&args, &workloads))?;
    print_report(&args, &report);
    if let Some(path) = &args.json {
        write_json(&args, &report, path)?;
    }
    Ok(())
}

async fn run(args: &Args, workloads: &[Workload]) -> anyhow::Result<Report> {
    let mut report = Report {
        load_start: load_average(),
        ..Default::default()
    };
    // Write payloads are slices of one random buffer, allocated before the memory
    // baseline so that the RSS growth is the engine's, not the load generator's.
    let pattern = random_bytes(2 * MIB, 7);

    if !args.no_fio {
        let file = args.dir.join("plain.dat");
        prepare_file(&file, args.size)?;
        for w in workloads {
            let row = run_fio(args, w, &file)?;
            progress(&row);
            report.rows.push(row);
        }
    }

    (report.memory.before_rss_kb, report.memory.before_hwm_kb) = self_memory()?;
    for &n in &args.replicas {
        let rows = engine_rows(args, workloads, n, &pattern).await?;
        report.rows.extend(rows);
    }
    if !args.no_rebuild {
        report.rebuild = Some(rebuild(args, &pattern).await?);
    }
    (report.memory.after_rss_kb, report.memory.after_hwm_kb) = self_memory()?;

    if !args.no_serve {
        let rows = serve_rows(args, workloads, &pattern, &mut report.memory).await?;
        report.rows.extend(rows);
    }
    report.load_end = load_average();
    // Same workload together, in the order the table is read.
    report
        .rows
        .sort_by_key(|r| WORKLOADS.iter().position(|w| w.name == r.workload));
    Ok(report)
}

fn progress(r: &Row) {
    eprintln!(
        "{:<10} {:<10} {:>9.0} IOPS {:>8.1} MiB/s",
        r.workload,
        r.target,
        r.iops(),
        r.mib_s()
    );
}

fn random_bytes(len: u64, seed: u64) -> Bytes {
    let mut v = vec![0u8; len as usize];
    StdRng::seed_from_u64(seed).fill(&mut v[..]);
    Bytes::from(v)
}

/// Starts `n` replicas of `size` bytes in fresh directories `<dir>/<prefix>-<i>`.
fn start_replicas(
    dir: &Path,
    prefix: &str,
    n: usize,
    size: u64,
) -> anyhow::Result<Vec<ReplicaProcess>> {
    (0..n)
        .map(|i| {
            let d = dir.join(format!("{prefix}-{i}"));
            fresh_dir(&d)?;
            ReplicaProcess::start(&d, size, loopback(FIRST_REPLICA_HOST + i as u8))
                .with_context(|| format!("starting replica {i} in {}", d.display()))
        })
        .collect()
}

fn fresh_dir(d: &Path) -> anyhow::Result<()> {
    if d.exists() {
        std::fs::remove_dir_all(d).with_context(|| format!("clear {}", d.display()))?;
    }
    let _ = std::fs::remove_file(d.with_extension("log"));
    Ok(())
}

async fn start_volume(
    name: &str,
    size: u64,
    replicas: &[ReplicaProcess],
) -> anyhow::Result<Arc<Volume>> {
    let (volume, stale) = Volume::start(StartOptions {
        config: VolumeConfig {
            name: name.to_string(),
            size,
            io_timeout: Duration::from_secs(30),
            local_hosts: Vec::new(),
            data_transport: Default::default(),
            checksums: true,
            volume_uuid: None,
        },
        replicas: replicas.iter().map(|r| r.addr.to_string()).collect(),
        salvage: false,
    })
    .await
    .with_context(|| format!("starting volume {name}"))?;
    if !stale.is_empty() {
        bail!("volume {name}: fresh replicas reported stale: {stale:?}");
    }
    Ok(volume)
}

/// The four workloads through an in-process volume over `n` replicas. The volume is written
/// in full first, so reads hit data as they do on the plain file.
async fn engine_rows(
    args: &Args,
    workloads: &[Workload],
    n: usize,
    pattern: &Bytes,
) -> anyhow::Result<Vec<Row>> {
    let replicas = start_replicas(&args.dir, &format!("io{n}r"), n, args.size)?;
    let volume = start_volume(&format!("bench{n}r"), args.size, &replicas).await?;
    let dev: Arc<dyn BlockDevice> = volume.clone();
    let t = Instant::now();
    fill(&dev, args.size, args.iodepth, pattern).await?;
    eprintln!(
        "engine-{n}r: filled {} MiB in {:.1} s",
        args.size / MIB,
        t.elapsed().as_secs_f64()
    );
    let pids: Vec<i32> = replicas.iter().map(|r| r.pid().as_raw()).collect();
    let mut rows = Vec::new();
    for w in workloads {
        let rep0 = cpu_seconds(&pids)?;
        let eng0 = cpu_seconds(&[std::process::id() as i32])?;
        let mut row = run_row(&dev, w, args, pattern, format!("engine-{n}r")).await?;
        row.replica_cpu_s = Some(cpu_seconds(&pids)? - rep0);
        row.engine_cpu_s = Some(cpu_seconds(&[std::process::id() as i32])? - eng0);
        progress(&row);
        rows.push(row);
    }
    drop(dev);
    drop(volume);
    drop(replicas);
    Ok(rows)
}

/// Writes `[0, len)` with 1 MiB writes, `iodepth` in flight, then flushes.
async fn fill(
    dev: &Arc<dyn BlockDevice>,
    len: u64,
    iodepth: usize,
    pattern: &Bytes,
) -> anyhow::Result<()> {
    let next = Arc::new(AtomicU64::new(0));
    let chunks = len / MIB;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..iodepth {
        let (dev, next, pattern) = (dev.clone(), next.clone(), pattern.clone());
        tasks.spawn(async move {
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= chunks {
                    return anyhow::Ok(());
                }
                let off = ((c + i as u64) % 256) * 4 * KIB;
                dev.write(c * MIB, pattern.slice(off as usize..(off + MIB) as usize))
                    .await
                    .with_context(|| format!("fill write at {}", c * MIB))?;
            }
        });
    }
    while let Some(res) = tasks.join_next().await {
        res.context("fill task")??;
    }
    dev.flush().await.context("flush after fill")?;
    Ok(())
}

/// `iodepth` tasks each keep one request in flight until the deadline; write rows end with
/// one flush counted in the row's time (fio: `--end_fsync=1`).
async fn run_row(
    dev: &Arc<dyn BlockDevice>,
    w: &Workload,
    args: &Args,
    pattern: &Bytes,
    target: String,
) -> anyhow::Result<Row> {
    let blocks = dev.size() / w.block;
    let next_seq = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.runtime);
    let w = *w;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.iodepth {
        let (dev, next_seq, pattern) = (dev.clone(), next_seq.clone(), pattern.clone());
        tasks.spawn(async move {
            let mut rng = StdRng::seed_from_u64(1000 + i as u64);
            let (mut ops, mut busy) = (0u64, Duration::ZERO);
            while Instant::now() < deadline {
                let block = if w.random {
                    rng.random_range(0..blocks)
                } else {
                    next_seq.fetch_add(1, Ordering::Relaxed) % blocks
                };
                let offset = block * w.block;
                let t0 = Instant::now();
                if w.write {
                    let at = rng.random_range(0..256u64) * 4 * KIB;
                    let data = pattern.slice(at as usize..(at + w.block) as usize);
                    dev.write(offset, data)
                        .await
                        .with_context(|| format!("write at {offset}"))?;
                } else {
                    let data = dev
                        .read(offset, w.block)
                        .await
                        .with_context(|| format!("read at {offset}"))?;
                    if data.len() as u64 != w.block {
                        bail!("read at {offset} returned {} bytes", data.len());
                    }
                }
                busy += t0.elapsed();
                ops += 1;
            }
            anyhow::Ok((ops, busy))
        });
    }
    let (mut ops, mut busy) = (0u64, Duration::ZERO);
    while let Some(res) = tasks.join_next().await {
        let (o, b) = res.context("row task")??;
        ops += o;
        busy += b;
    }
    if w.write {
        dev.flush().await.context("flush at the end of the row")?;
    }
    Ok(Row {
        workload: w.name,
        target,
        ops,
        bytes: ops * w.block,
        elapsed: start.elapsed(),
        mean_latency_us: busy.as_secs_f64() * 1e6 / ops.max(1) as f64,
        replica_cpu_s: None,
        engine_cpu_s: None,
    })
}

/// 3 replicas, `rebuild_fill` written, one replica killed and replaced by a fresh one, the
/// full rebuild timed from `start_rebuild` until its status says done.
async fn rebuild(args: &Args, pattern: &Bytes) -> anyhow::Result<RebuildResult> {
    let size = args.rebuild_size;
    let mut replicas = start_replicas(&args.dir, "rebuild", 3, size)?;
    let volume = start_volume("benchrebuild", size, &replicas).await?;
    let dev: Arc<dyn BlockDevice> = volume.clone();
    let t = Instant::now();
    fill(&dev, args.rebuild_fill, args.iodepth, pattern).await?;
    let mut out = RebuildResult {
        fill_bytes: args.rebuild_fill,
        fill_seconds: t.elapsed().as_secs_f64(),
        ..Default::default()
    };
    eprintln!(
        "rebuild: filled {} MiB in {:.1} s",
        args.rebuild_fill / MIB,
        out.fill_seconds
    );

    let gone = replicas.pop().context("invariant: three replicas")?;
    let gone_addr = gone.addr.to_string();
    drop(gone); // SIGKILL and reap
    volume
        .remove_replica(&gone_addr)
        .await
        .map_err(|e| anyhow::anyhow!("removing the killed replica {gone_addr}: {e}"))?;
    let fresh_dir_path = args.dir.join("rebuild-fresh");
    fresh_dir(&fresh_dir_path)?;
    let fresh = ReplicaProcess::start(&fresh_dir_path, size, loopback(FIRST_REPLICA_HOST + 2))
        .context("starting the fresh replica")?;
    replicas.push(fresh);
    let pids: Vec<i32> = replicas.iter().map(|r| r.pid().as_raw()).collect();
    let fresh_addr = replicas[2].addr.to_string();

    let cpu0 = cpu_seconds(&pids)?;
    let t = Instant::now();
    volume
        .start_rebuild(&fresh_addr)
        .await
        .map_err(|e| anyhow::anyhow!("starting the rebuild of {fresh_addr}: {e}"))?;
    let status = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = volume.rebuild_status();
        if !s.state.is_running() {
            break s;
        }
    };
    out.seconds = t.elapsed().as_secs_f64();
    out.replica_cpu_s = cpu_seconds(&pids)? - cpu0;
    out.bytes_total = status.bytes_total;
    out.bytes_copied = status.bytes_copied;
    match &status.state {
        RebuildState::Done => out.state = "done".into(),
        RebuildState::Failed(e) => bail!("rebuild of {fresh_addr} failed: {e}"),
        other => bail!("rebuild of {fresh_addr} ended {other:?}"),
    }
    eprintln!(
        "rebuild: {} MiB copied in {:.1} s",
        out.bytes_copied / MIB,
        out.seconds
    );
    Ok(out)
}

/// A `zebu-engine serve` child, killed and reaped on drop.
struct EngineProcess {
    child: Child,
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `zebu-engine serve` with an NBD frontend over 3 fresh replicas and returns it
/// with its NBD address (`host:port`).
fn start_engine(
    args: &Args,
    name: &str,
    replicas: &[ReplicaProcess],
) -> anyhow::Result<(EngineProcess, String)> {
    let log = args.dir.join("serve-engine.log");
    let log_file = std::fs::File::create(&log).with_context(|| format!("create {log:?}"))?;
    let mut cmd = Command::new(bin_path("zebu-engine"));
    cmd.arg("serve")
        .args(["--volume", name, "--size", &args.size.to_string()])
        .args(["--control-listen", &format!("{ENGINE_HOST}:0")])
        .args([
            "--frontend",
            "nbd",
            "--nbd-listen",
            &format!("{ENGINE_HOST}:0"),
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file));
    for r in replicas {
        cmd.args(["--replica", &r.addr.to_string()]);
    }
    let mut child = cmd.spawn().context("spawning zebu-engine serve")?;
    let stdout = child.stdout.take().context("engine stdout")?;
    let engine = EngineProcess { child };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut nbd = None;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(url) = line.strip_prefix("nbd nbd://") {
                nbd = url.split('/').next().map(str::to_string);
            }
            if line == "ready" {
                let _ = tx.send(nbd.take());
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Some(addr)) => Ok((engine, addr)),
        Ok(None) => bail!("zebu-engine printed no nbd endpoint; log in {log:?}"),
        Err(_) => bail!("zebu-engine was not ready within 30 s; log in {log:?}"),
    }
}

/// The workloads through a real `zebu-engine serve` process over NBD, for its memory and
/// CPU. The volume is not pre-filled: the sequential write row runs first.
async fn serve_rows(
    args: &Args,
    workloads: &[Workload],
    pattern: &Bytes,
    memory: &mut Memory,
) -> anyhow::Result<Vec<Row>> {
    let replicas = start_replicas(&args.dir, "serve", 3, args.size)?;
    let name = "benchserve";
    let (engine, nbd_addr) = start_engine(args, name, &replicas)?;
    let engine_pid = engine.child.id() as i32;
    memory.serve_idle_rss_kb = Some(proc_memory(engine_pid)?.0);
    let client = NbdClient::connect(&nbd_addr, name)
        .await
        .with_context(|| format!("NBD connect to {nbd_addr}"))?;
    let dev: Arc<dyn BlockDevice> = Arc::new(client);
    let pids: Vec<i32> = replicas.iter().map(|r| r.pid().as_raw()).collect();
    let mut order: Vec<Workload> = workloads.to_vec();
    order.sort_by_key(|w| !w.write);
    let mut rows = Vec::new();
    for w in &order {
        let rep0 = cpu_seconds(&pids)?;
        let eng0 = cpu_seconds(&[engine_pid])?;
        let mut row = run_row(&dev, w, args, pattern, "nbd-3r".into()).await?;
        row.replica_cpu_s = Some(cpu_seconds(&pids)? - rep0);
        row.engine_cpu_s = Some(cpu_seconds(&[engine_pid])? - eng0);
        progress(&row);
        rows.push(row);
    }
    let (rss, hwm) = proc_memory(engine_pid)?;
    memory.serve_rss_kb = Some(rss);
    memory.serve_hwm_kb = Some(hwm);
    drop(dev);
    drop(engine);
    drop(replicas);
    Ok(rows)
}

/// Sum of user+sys seconds of the processes `pids` (fields 14 and 15 of /proc/PID/stat).
fn cpu_seconds(pids: &[i32]) -> anyhow::Result<f64> {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut total = 0.0;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .with_context(|| format!("reading /proc/{pid}/stat"))?;
        // The command name may hold spaces; the fields after it are fixed.
        let rest = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .context("malformed /proc/PID/stat")?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| -> anyhow::Result<f64> {
            // Field 3 (state) is the first after ')'.
            fields
                .get(n - 3)
                .and_then(|s| s.parse::<u64>().ok())
                .map(|v| v as f64)
                .with_context(|| format!("/proc/{pid}/stat field {n}"))
        };
        total += (field(14)? + field(15)?) / ticks;
    }
    Ok(total)
}

/// (VmRSS, VmHWM) of `pid` in kB.
fn proc_memory(pid: i32) -> anyhow::Result<(u64, u64)> {
    parse_status(&std::fs::read_to_string(format!("/proc/{pid}/status"))?)
}

fn self_memory() -> anyhow::Result<(u64, u64)> {
    parse_status(&std::fs::read_to_string("/proc/self/status")?)
}

fn parse_status(status: &str) -> anyhow::Result<(u64, u64)> {
    let get = |key: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{key} in /proc/PID/status"))
    };
    Ok((get("VmRSS:")?, get("VmHWM:")?))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The plain file at full size with non-zero data, so fio reads hit written blocks; reused
/// when its size matches.
fn prepare_file(path: &Path, size: u64) -> anyhow::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == size) {
        return Ok(());
    }
    eprintln!("preparing {} ({} MiB)", path.display(), size / MIB);
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

fn run_fio(args: &Args, w: &Workload, file: &Path) -> anyhow::Result<Row> {
    let f = zebu_benches::run_fio(w, file, args.size, args.runtime, args.iodepth)?;
    Ok(Row {
        workload: w.name,
        target: "fio".into(),
        ops: f.ops,
        bytes: f.bytes,
        elapsed: f.elapsed,
        mean_latency_us: f.mean_latency_us,
        replica_cpu_s: None,
        engine_cpu_s: None,
    })
}

fn fio_iops(rows: &[Row], workload: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.workload == workload && r.target == "fio")
        .map(Row::iops)
}

fn row_iops(rows: &[Row], workload: &str, target: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.workload == workload && r.target == target)
        .map(Row::iops)
}

/// A goal from the issue: (description, measured, target).
struct Goal {
    what: String,
    measured: Option<f64>,
    target: Option<f64>,
    unit: &'static str,
    higher_is_better: bool,
}

fn goals(report: &Report) -> Vec<Goal> {
    let rows = &report.rows;
    let mib = |kb: u64| kb as f64 / 1024.0;
    let serve_mem = report
        .memory
        .serve_hwm_kb
        .max(report.memory.serve_rss_kb)
        .map(mib);
    vec![
        Goal {
            what: "3-replica randwrite IOPS >= 0.8 x (fio / 3)".into(),
            measured: row_iops(rows, "randwrite", "engine-3r"),
            target: fio_iops(rows, "randwrite").map(|f| 0.8 * f / 3.0),
            unit: "IOPS",
            higher_is_better: true,
        },
        Goal {
            what: "3-replica randread IOPS >= 0.7 x fio".into(),
            measured: row_iops(rows, "randread", "engine-3r"),
            target: fio_iops(rows, "randread").map(|f| 0.7 * f),
            unit: "IOPS",
            higher_is_better: true,
        },
        Goal {
            what: "1-replica randread IOPS >= 0.7 x fio".into(),
            measured: row_iops(rows, "randread", "engine-1r"),
            target: fio_iops(rows, "randread").map(|f| 0.7 * f),
            unit: "IOPS",
            higher_is_better: true,
        },
        Goal {
            what: format!("zebu-engine serve peak RSS (VmHWM) < {RSS_GOAL_MIB} MiB"),
            measured: serve_mem,
            target: Some(RSS_GOAL_MIB),
            unit: "MiB",
            higher_is_better: false,
        },
        Goal {
            what: format!("in-process RSS growth < {RSS_GOAL_MIB} MiB"),
            measured: Some(mib(report.memory.after_rss_kb) - mib(report.memory.before_rss_kb))
                .filter(|_| report.memory.after_rss_kb > 0),
            target: Some(RSS_GOAL_MIB),
            unit: "MiB",
            higher_is_better: false,
        },
    ]
}

fn verdict(g: &Goal) -> (&'static str, Option<f64>) {
    match (g.measured, g.target) {
        (Some(m), Some(t)) => {
            let ok = if g.higher_is_better { m >= t } else { m < t };
            (if ok { "PASS" } else { "FAIL" }, Some(m / t))
        }
        _ => ("n/a", None),
    }
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map(|v| format!("{v:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

fn print_report(args: &Args, report: &Report) {
    let rows = &report.rows;
    println!(
        "\nengine_bench: {} MiB file/volume in {}, iodepth {}, {} s per row",
        args.size / MIB,
        args.dir.display(),
        args.iodepth,
        args.runtime
    );
    println!(
        "load average (1/5/15 min): {} at start, {} at end; {} CPUs",
        report.load_start,
        report.load_end,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<10} {:<10} {:>9} {:>8} {:>10} {:>7} {:>13} {:>13}",
        "workload",
        "target",
        "IOPS",
        "MiB/s",
        "mean lat µs",
        "vs fio",
        "repl cpu s/GiB",
        "eng cpu s/GiB"
    );
    for r in rows {
        let ratio = fio_iops(rows, r.workload).map(|f| r.iops() / f);
        println!(
            "{:<10} {:<10} {:>9.0} {:>8.1} {:>10.0} {:>7} {:>13} {:>13}",
            r.workload,
            r.target,
            r.iops(),
            r.mib_s(),
            r.mean_latency_us,
            opt(ratio, 2),
            opt(r.per_gib(r.replica_cpu_s), 2),
            opt(r.per_gib(r.engine_cpu_s), 2),
        );
    }
    if let Some(rb) = &report.rebuild {
        let gib = rb.bytes_copied as f64 / GIB as f64;
        println!(
            "rebuild ({} MiB volume, {} MiB written at {:.0} MiB/s): {} MiB copied in {:.1} s = \
             {:.0} MiB/s; replica CPU {:.2} s/GiB copied",
            args.rebuild_size / MIB,
            rb.fill_bytes / MIB,
            rb.fill_bytes as f64 / MIB as f64 / rb.fill_seconds.max(1e-9),
            rb.bytes_copied / MIB,
            rb.seconds,
            rb.bytes_copied as f64 / MIB as f64 / rb.seconds.max(1e-9),
            rb.replica_cpu_s / gib.max(1e-9),
        );
    }
    let m = &report.memory;
    let mib = |kb: u64| kb as f64 / 1024.0;
    println!(
        "in-process RSS: {:.1} MiB before Volume::start, {:.1} MiB after the runs (growth \
         {:.1} MiB); VmHWM {:.1} -> {:.1} MiB",
        mib(m.before_rss_kb),
        mib(m.after_rss_kb),
        mib(m.after_rss_kb) - mib(m.before_rss_kb),
        mib(m.before_hwm_kb),
        mib(m.after_hwm_kb),
    );
    if let (Some(idle), Some(rss), Some(hwm)) =
        (m.serve_idle_rss_kb, m.serve_rss_kb, m.serve_hwm_kb)
    {
        println!(
            "zebu-engine serve (NBD, 3 replicas): VmRSS {:.1} MiB idle, {:.1} MiB after the \
             NBD rows; VmHWM {:.1} MiB",
            mib(idle),
            mib(rss),
            mib(hwm)
        );
    }
    println!("goals:");
    for g in goals(report) {
        let (v, ratio) = verdict(&g);
        println!(
            "  {:<4} {:<48} measured {:>9} {:<4} target {:>9}  (x{})",
            v,
            g.what,
            opt(g.measured, 1),
            g.unit,
            opt(g.target, 1),
            opt(ratio, 2)
        );
    }
}

fn write_json(args: &Args, report: &Report, path: &Path) -> anyhow::Result<()> {
    let rows: Vec<_> = report
        .rows
        .iter()
        .map(|r| {
            json!({
                "workload": r.workload,
                "target": r.target,
                "ops": r.ops,
                "bytes": r.bytes,
                "seconds": r.elapsed.as_secs_f64(),
                "iops": r.iops(),
                "mib_per_s": r.mib_s(),
                "mean_latency_us": r.mean_latency_us,
                "ratio_to_fio": fio_iops(&report.rows, r.workload).map(|f| r.iops() / f),
                "replica_cpu_s": r.replica_cpu_s,
                "replica_cpu_s_per_gib": r.per_gib(r.replica_cpu_s),
                "engine_cpu_s": r.engine_cpu_s,
                "engine_cpu_s_per_gib": r.per_gib(r.engine_cpu_s),
            })
        })
        .collect();
    let rebuild = report.rebuild.as_ref().map(|rb| {
        json!({
            "volume_bytes": args.rebuild_size,
            "fill_bytes": rb.fill_bytes,
            "fill_seconds": rb.fill_seconds,
            "bytes_total": rb.bytes_total,
            "bytes_copied": rb.bytes_copied,
            "seconds": rb.seconds,
            "mib_per_s": rb.bytes_copied as f64 / MIB as f64 / rb.seconds.max(1e-9),
            "replica_cpu_s": rb.replica_cpu_s,
            "state": rb.state,
        })
    });
    let m = &report.memory;
    let goals: Vec<_> = goals(report)
        .iter()
        .map(|g| {
            let (v, ratio) = verdict(g);
            json!({"goal": g.what, "measured": g.measured, "target": g.target,
                   "unit": g.unit, "verdict": v, "ratio": ratio})
        })
        .collect();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let doc = json!({
        "benchmark": "engine_bench",
        "dir": args.dir,
        "size_bytes": args.size,
        "iodepth": args.iodepth,
        "runtime_s": args.runtime,
        "kernel": kernel,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "load_average_start": report.load_start,
        "load_average_end": report.load_end,
        "results": rows,
        "rebuild": rebuild,
        "memory_kb": {
            "in_process_before_rss": m.before_rss_kb,
            "in_process_before_hwm": m.before_hwm_kb,
            "in_process_after_rss": m.after_rss_kb,
            "in_process_after_hwm": m.after_hwm_kb,
            "serve_idle_rss": m.serve_idle_rss_kb,
            "serve_rss": m.serve_rss_kb,
            "serve_hwm": m.serve_hwm_kb,
        },
        "goals": goals,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("write {path:?}"))?;
    Ok(())
}
