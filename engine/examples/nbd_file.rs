//! Serves a file (or memory) over NBD with the engine's NBD frontend, without replicas.
//!
//! ```text
//! cargo run -p zebu-engine --example nbd_file -- \
//!     --listen 127.0.0.1:10809 --name vol --size 1G [--file /tmp/vol.img]
//! ```
//!
//! Prints `nbd://ADDR/NAME` on stdout once listening (so `--listen 127.0.0.1:0` works for
//! scripts), and stops cleanly on SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use zebu_engine::blockdev::{BlockDevice, FileDevice, MemDevice};
use zebu_engine::nbd::{NbdConfig, NbdServer};

#[derive(Parser)]
struct Args {
    /// Address to listen on (port 0 picks one).
    #[arg(long)]
    listen: SocketAddr,
    /// Export name.
    #[arg(long)]
    name: String,
    /// Device size: bytes, or with a K/M/G/T suffix (powers of 1024).
    #[arg(long, value_parser = zebu_engine::cli_args::parse_size)]
    size: u64,
    /// Backing file (created sparse if missing); without it the device lives in memory.
    #[arg(long)]
    file: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // As `zebu-engine serve` does, so this target alone is measured as the engine runs it
    // (the runtime's threads exist already; the thresholds bind their arenas too).
    zebu_engine::heap::keep_large_buffers();
    let dev: Arc<dyn BlockDevice> = match &args.file {
        Some(path) => Arc::new(
            FileDevice::open(path, args.size)
                .with_context(|| format!("opening {}", path.display()))?,
        ),
        None => Arc::new(MemDevice::new(args.size)),
    };
    let server = NbdServer::bind(NbdConfig::new(args.listen, args.name.clone()), dev).await?;
    println!("nbd://{}/{}", server.local_addr(), args.name);

    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    server.run(shutdown).await?;
    Ok(())
}
