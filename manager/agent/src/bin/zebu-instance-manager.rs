//! `zebu-instance-manager --socket PATH`: the parent of a node's engine and replica
//! processes, apart from the manager; see `zebu_agent::instance_manager`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "zebu-instance-manager",
    about = "Starts a node's engine and replica processes for its manager",
    version
)]
struct Args {
    /// The Unix socket to serve start requests on (in the node's data directory).
    #[arg(long)]
    socket: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZEBU_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zebu-instance-manager: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(zebu_agent::instance_manager::serve(&args.socket)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zebu-instance-manager: {e}");
            ExitCode::FAILURE
        }
    }
}
