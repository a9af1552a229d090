//! Serves a file-backed (or in-memory) volume as an iSCSI target, for conformance tests
//! and benchmarks of the iSCSI frontend alone.
//!
//! ```text
//! cargo run -p zebu-engine --example iscsi_file -- --listen 127.0.0.1:3260 --volume vol \
//!     --size 1G [--file /tmp/vol.img] [--chap-user u --chap-secret s]
//! ```
//! Prints `LISTENING <addr>` on stdout once the portal is bound.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use zebu_engine::blockdev::{BlockDevice, FileDevice, MemDevice};
use zebu_engine::iscsi::{Chap, IscsiConfig, IscsiServer};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    volume: String,
    /// Size with an optional K, M, G or T suffix (powers of 1024).
    #[arg(long)]
    size: String,
    /// Backing file (created sparse if missing); memory when absent.
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    #[arg(long, requires = "chap_secret")]
    chap_user: Option<String>,
    #[arg(long, requires = "chap_user")]
    chap_secret: Option<String>,
    /// Target credentials for mutual CHAP.
    #[arg(long, requires = "mutual_secret")]
    mutual_user: Option<String>,
    #[arg(long, requires = "mutual_user")]
    mutual_secret: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // As `zebu-engine serve` does, so this target alone is measured as the engine runs it
    // (the runtime's threads exist already; the thresholds bind their arenas too).
    zebu_engine::heap::keep_large_buffers();
    let size = zebu_engine::cli_args::parse_size(&args.size).map_err(anyhow::Error::msg)?;
    let dev: Arc<dyn BlockDevice> = match &args.file {
        Some(p) => {
            Arc::new(FileDevice::open(p, size).with_context(|| format!("opening {}", p.display()))?)
        }
        None => Arc::new(MemDevice::new(size)),
    };
    let mut cfg = IscsiConfig::new(args.listen, &args.volume);
    if let (Some(user), Some(secret)) = (args.chap_user, args.chap_secret) {
        cfg.chap = Some(Chap {
            user,
            secret,
            mutual: args.mutual_user.zip(args.mutual_secret),
        });
    }
    let server = IscsiServer::bind(cfg, dev).await?;
    println!("LISTENING {}", server.local_addr());
    server
        .serve(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
