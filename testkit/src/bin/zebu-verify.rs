//! `zebu-verify`: drive a verified workload against an NBD export, and check it later.
//!
//! `run` writes stamped blocks and saves what was acknowledged and flushed to a JSON state
//! file; `check` (possibly in another process, after an engine restart or crash) reads the
//! export back and lists every block that holds something it must not. Exit status: 0 when
//! clean, 1 when the workload saw errors or wrong data, 2 for bad usage.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use zebu_engine::blockdev::BlockDevice;
use zebu_engine::cli_args::{parse_bytes, parse_duration};
use zebu_testkit::workload::{
    self, Expect, Model, NbdClient, Pattern, RunId, Scope, StopAfter, WorkloadConfig,
};

/// How many wrong blocks and errors to list before summarising the rest as a count.
const LIST_LIMIT: usize = 20;

#[derive(Parser)]
#[command(name = "zebu-verify", about = "Verified block workload over NBD")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the workload and save the state.
    Run(RunArgs),
    /// Read every block back and compare with a saved state.
    Check(CheckArgs),
}

#[derive(Args)]
struct Target {
    /// NBD server, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    nbd: String,
    /// Export (volume) name.
    #[arg(long, default_value = "")]
    export: String,
    /// Workload state file.
    #[arg(long, default_value = "zebu-verify.state.json")]
    state: PathBuf,
    /// Operations (or read requests when checking) in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    qd: u32,
}

#[derive(Clone, Copy, ValueEnum)]
enum PatternArg {
    Random,
    Seq,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    target: Target,
    /// Bytes per block (multiple of 4096).
    #[arg(long, default_value = "4096", value_parser = parse_bytes)]
    block_size: u64,
    /// First byte of the range to use (multiple of the block size).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    offset: u64,
    /// Bytes of the export to use (K/M/G suffixes); default: all of it.
    #[arg(long, value_parser = parse_bytes)]
    size_range: Option<u64>,
    /// Run for this long (e.g. 10s, 500ms, 2m).
    #[arg(long, value_parser = parse_duration, conflicts_with = "ops")]
    duration: Option<Duration>,
    /// Run this many reads, writes and unmaps.
    #[arg(long)]
    ops: Option<u64>,
    /// Flush after every N writes (0 = never by count).
    #[arg(long, default_value_t = 100)]
    flush_every: u64,
    /// Also flush when this long has passed since the last flush.
    #[arg(long, value_parser = parse_duration)]
    flush_interval: Option<Duration>,
    #[arg(long, value_enum, default_value = "random")]
    pattern: PatternArg,
    /// Percentage of operations that read and check a block.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=100))]
    read_percent: u8,
    /// Percentage of operations that unmap (trim) a block.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    unmap_percent: u8,
    /// Percentage of writes sent with FUA (durable when acknowledged, flush or no flush).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    fua_percent: u8,
    /// Do not flush after the last operation (leave writes unflushed for a crash test).
    #[arg(long)]
    no_final_flush: bool,
    /// Continue from an existing state file instead of starting a new run.
    #[arg(long)]
    resume: bool,
    /// Exit 0 even when operations failed (for runs the test deliberately interrupts).
    #[arg(long)]
    allow_errors: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    target: Target,
    /// Accept anything between the last flushed write and the newest issued one.
    #[arg(long)]
    after_crash: bool,
    /// Check only blocks the workload touched (default: its whole range).
    #[arg(long)]
    touched_only: bool,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help and --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or("error: bad arguments");
            eprintln!(
                "zebu-verify: {} (see --help)",
                first.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("zebu-verify: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.cmd {
            Cmd::Run(a) => run(a).await,
            Cmd::Check(a) => check(a).await,
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("zebu-verify: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn connect(t: &Target) -> anyhow::Result<NbdClient> {
    NbdClient::connect(&t.nbd, &t.export)
        .await
        .with_context(|| format!("connecting to export {:?} at {}", t.export, t.nbd))
}

fn print_list<T: std::fmt::Display>(what: &str, items: &[T]) {
    for i in items.iter().take(LIST_LIMIT) {
        println!("  {what}: {i}");
    }
    if items.len() > LIST_LIMIT {
        println!("  ... and {} more", items.len() - LIST_LIMIT);
    }
}

async fn run(a: RunArgs) -> anyhow::Result<bool> {
    let dev = connect(&a.target).await?;
    let cfg = WorkloadConfig {
        block_size: a.block_size,
        range_start: a.offset,
        range_len: a.size_range,
        queue_depth: a.target.qd as usize,
        pattern: match a.pattern {
            PatternArg::Random => Pattern::Random,
            PatternArg::Seq => Pattern::Sequential,
        },
        stop: match (a.duration, a.ops) {
            (Some(d), _) => StopAfter::Duration(d),
            (None, Some(n)) => StopAfter::Ops(n),
            (None, None) => StopAfter::Duration(Duration::from_secs(10)),
        },
        read_percent: a.read_percent,
        unmap_percent: a.unmap_percent,
        fua_percent: a.fua_percent,
        flush_every: (a.flush_every > 0).then_some(a.flush_every),
        flush_interval: a.flush_interval,
        final_flush: !a.no_final_flush,
        stop_on_error: true,
        seed: a.seed,
        cancel: None,
    };
    let mut model = if a.resume {
        let m = Model::load(&a.target.state)?;
        check_same_layout(&m, &cfg, dev.size())?;
        m
    } else {
        cfg.new_model(dev.size(), RunId::random())?
    };
    let report = workload::run_workload(&dev, &mut model, &cfg).await;
    save(&model, &a.target.state)?;
    dev.disconnect().await;

    println!(
        "run {:016x}: {} ops ({} writes, {} reads, {} unmaps, {} flushes) in {:.2}s = {:.0} IOPS; {} I/O errors, {} wrong reads; state saved to {}",
        model.run.0,
        report.ops(),
        report.writes,
        report.reads,
        report.unmaps,
        report.flushes,
        report.elapsed.as_secs_f64(),
        report.iops(),
        report.io_errors.len(),
        report.bad_reads.len(),
        a.target.state.display()
    );
    print_list("I/O error", &report.io_errors);
    print_list("WRONG read", &report.bad_reads);
    Ok(report.bad_reads.is_empty() && (a.allow_errors || report.io_errors.is_empty()))
}

fn check_same_layout(m: &Model, cfg: &WorkloadConfig, size: u64) -> anyhow::Result<()> {
    let fresh = cfg.new_model(size, m.run)?;
    anyhow::ensure!(
        fresh.block_size == m.block_size
            && fresh.first_block == m.first_block
            && fresh.block_count == m.block_count,
        "--resume with a different block size or range than the saved state \
         ({} blocks of {} bytes from block {})",
        m.block_count,
        m.block_size,
        m.first_block
    );
    Ok(())
}

fn save(model: &Model, path: &Path) -> anyhow::Result<()> {
    model
        .save(path)
        .with_context(|| format!("saving the workload state to {}", path.display()))
}

async fn check(a: CheckArgs) -> anyhow::Result<bool> {
    let mut model = Model::load(&a.target.state)?;
    let dev = connect(&a.target).await?;
    let expect = if a.after_crash {
        Expect::AfterCrash
    } else {
        Expect::Exact
    };
    let scope = if a.touched_only {
        Scope::Touched
    } else {
        Scope::Range
    };
    let report = workload::verify(&dev, &model, expect, scope, a.target.qd as usize).await;
    dev.disconnect().await;

    println!(
        "check of run {:016x}: {} blocks checked, {} wrong, {} I/O errors",
        model.run.0,
        report.checked,
        report.wrong.len(),
        report.io_errors.len()
    );
    print_list("WRONG", &report.wrong);
    print_list("I/O error", &report.io_errors);
    if report.passed() && a.after_crash {
        // Record which of the acceptable versions survived, so a resumed run and the next
        // check start from what the device really holds.
        for (b, c) in &report.found {
            model.settle(*b, *c);
        }
        save(&model, &a.target.state)?;
    }
    Ok(report.passed())
}
