//! `zebu-backup-run --job FILE`: carries out one backup or restore job (see
//! [`zebu_backup::job`]) and exits 0 when it is done, 1 when it failed (the report file says
//! why), 2 when the job file cannot be read.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "zebu-backup-run",
    about = "Runs one Zebu backup or restore job",
    version
)]
struct Args {
    /// The job file (JSON) the node agent wrote.
    #[arg(long)]
    job: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZEBU_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let spec: zebu_backup::JobSpec = match std::fs::read(&args.job)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("zebu-backup-run: job file {}: {e}", args.job.display());
            return ExitCode::from(2);
        }
    };
    // The agent waits for this line before it records the process as running.
    println!("started {}", std::process::id());
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zebu-backup-run: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(zebu_backup::run_job(&spec, &args.job)) {
        Ok(r) => {
            println!("done {:.1}", r.elapsed_secs);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("zebu-backup-run: {e}");
            println!("failed");
            ExitCode::FAILURE
        }
    }
}
