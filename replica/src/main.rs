//! `zebu-replica`: serve one replica directory (gRPC and data frames on one port), or print
//! its info.
//!
//! ```text
//! zebu-replica serve --dir /var/lib/zebu/r1 --listen 127.0.0.1:9500 --size 10G
//! zebu-replica info --dir /var/lib/zebu/r1 --json
//! ```
//!
//! `serve` creates the replica when the directory is missing or empty, prints exactly one
//! line `listening on ADDR` (the bound address, so `--listen 127.0.0.1:0` works) to stdout
//! once the socket is bound, and closes the replica cleanly on SIGTERM or SIGINT. Failures
//! are reported as one line on stderr and a non-zero exit. Logs go to stderr, filtered by
//! `RUST_LOG` (default `info`). On SIGUSR1 `serve` logs one line `path times {JSON}`: the
//! counters of where its writes and flushes spent their time (`zebu_replica::pathtime`).

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};
use zebu_replica::io::{BackendKind, CacheMode, IoConfig, IoEngine};
use zebu_replica::server::ReplicaServer;
use zebu_replica::{Replica, ReplicaInfo};

/// How long open connections may hold back the exit after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[derive(Parser)]
#[command(name = "zebu-replica", version, about = "One copy of a Zebu volume")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the replica in DIR over gRPC and data frames, on one port (creating it when DIR
    /// is missing or empty).
    Serve {
        #[arg(long)]
        dir: PathBuf,
        /// Address to listen on, e.g. 127.0.0.1:9500 (port 0 picks a free port).
        #[arg(long)]
        listen: SocketAddr,
        /// Volume size: bytes, or with a binary unit K, M, G, T, P (e.g. 10G).
        #[arg(long, value_parser = zebu_size::parse_nonzero)]
        size: u64,
        /// File I/O back end.
        #[arg(long, value_enum, default_value_t = IoArg::Auto)]
        io: IoArg,
        /// How the head's layer file meets the disk: `page` writes into the page cache and
        /// makes it durable at each flush; `direct` opens it with O_DIRECT. Both keep the
        /// flush contract. Snapshot layers found at start, and layers written by a restore
        /// or a rebuild, use O_DIRECT either way.
        #[arg(long, value_enum, default_value_t = CacheArg::Page)]
        cache: CacheArg,
        /// Keep and check block checksums. `off` is for measuring what they cost: nothing
        /// read is verified, and every layer's checksums are computed anew the next time the
        /// replica serves with them on.
        #[arg(long, value_enum, default_value_t = OnOff::On)]
        checksums: OnOff,
        /// The volume's secret, in a file only its owner may read: then only clients that
        /// prove they hold it are served, on every port (zebu_proto::auth). Never on the
        /// command line.
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// Serve the port over TLS only, with this certificate chain (PEM, leaf first);
        /// needs --tls-key. Engines then need the CA that signed it (`--tls-ca`). The local
        /// socket stays plaintext (it never leaves the host).
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key of --tls-cert (PEM).
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
    },
    /// Print a replica's size, layer chain, generation, epoch and flush number.
    Info {
        #[arg(long)]
        dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum IoArg {
    Auto,
    Uring,
    Threads,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, ValueEnum)]
enum CacheArg {
    Page,
    Direct,
}

impl From<CacheArg> for CacheMode {
    fn from(a: CacheArg) -> CacheMode {
        match a {
            CacheArg::Page => CacheMode::Page,
            CacheArg::Direct => CacheMode::Direct,
        }
    }
}

impl From<IoArg> for BackendKind {
    fn from(a: IoArg) -> BackendKind {
        match a {
            IoArg::Auto => BackendKind::Auto,
            IoArg::Uring => BackendKind::Uring,
            IoArg::Threads => BackendKind::Threads,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `info` prints a report: only problems belong next to it by default.
    let default_filter = match cli.command {
        Command::Serve { .. } => "info",
        Command::Info { .. } => "warn",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zebu-replica: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve {
                dir,
                listen,
                size,
                io,
                cache,
                checksums,
                secret_file,
                tls_cert,
                tls_key,
            } => {
                let config = IoConfig {
                    cache: cache.into(),
                    checksums: checksums == OnOff::On,
                    ..IoConfig::default()
                };
                let secret = match secret_file {
                    Some(p) => {
                        Some(zebu_proto::auth::Secret::load(&p).context("cannot read the secret")?)
                    }
                    None => None,
                };
                let tls = match (tls_cert, tls_key) {
                    (Some(cert), Some(key)) => {
                        Some(zebu_proto::tls::acceptor(&cert, &key).context("cannot set up TLS")?)
                    }
                    _ => None,
                };
                serve(&dir, listen, size, io.into(), config, secret, tls).await
            }
            Command::Info { dir, json } => print_info(&dir, json).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: scripts and tests show it as is.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("zebu-replica: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(
    dir: &Path,
    listen: SocketAddr,
    size: u64,
    io: BackendKind,
    config: IoConfig,
    secret: Option<zebu_proto::auth::Secret>,
    tls: Option<zebu_proto::tls::TlsAcceptor>,
) -> anyhow::Result<()> {
    let io = IoEngine::with_config(io, config).context("cannot start the I/O engine")?;
    info!(backend = %io.backend(), cache = %io.cache(), "I/O engine ready");
    // Where writes and flushes spend their time (`pathtime.rs`), on demand: `kill -USR1`
    // (set up before `listening on` is printed, so a signal sent after it never kills us).
    let times = io.times().clone();
    let mut sigusr1 = signal(SignalKind::user_defined1()).context("cannot handle SIGUSR1")?;
    tokio::spawn(async move {
        while sigusr1.recv().await.is_some() {
            info!("path times {}", times.to_json());
        }
    });
    let replica = Replica::open_or_create(dir, size, io.clone())
        .await
        .context("cannot open the replica")?;
    if secret.is_some() {
        info!("authentication on: only clients holding the volume's secret are served");
    }
    let mut server = ReplicaServer::with_secret(dir, io, replica, secret);
    if let Some(tls) = tls {
        info!("TLS on: the port serves TLS clients only");
        server = server.with_tls(tls);
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let bound = listener
        .local_addr()
        .context("cannot read the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {bound}").context("stdout")?;
        out.flush().context("stdout")?;
    }
    info!(%bound, dir = %dir.display(), "serving");

    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let closer = server.clone();
    let on_signal = tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => info!("SIGTERM: closing"),
            _ = sigint.recv() => info!("SIGINT: closing"),
        }
        // Closing first ends every data stream, so the graceful shutdown can finish.
        let closed = closer.close().await;
        let _ = stop_tx.send(true);
        closed
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    // gRPC and data frames on the one port.
    let serving = server.serve(listener, stopped(stop_rx.clone()));
    let served = tokio::select! {
        r = serving => r.context("server failed"),
        _ = async {
            stopped(stop_rx).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            warn!("clients still connected {SHUTDOWN_GRACE:?} after the shutdown; stopping anyway");
            Ok(())
        }
    };
    if on_signal.is_finished() {
        on_signal
            .await
            .context("signal task")?
            .context("closing the replica")?;
    }
    served?;
    server.close().await.context("closing the replica")?;
    info!("stopped");
    Ok(())
}

#[derive(serde::Serialize)]
struct LayerOut<'a> {
    id: u64,
    name: &'a str,
    parent: u64,
    head: bool,
    user_created: bool,
    data_bytes: u64,
    created: &'a str,
    size: u64,
}

async fn print_info(dir: &Path, json: bool) -> anyhow::Result<()> {
    let io = IoEngine::new(BackendKind::Threads).context("cannot start the I/O engine")?;
    let replica = Replica::open(dir, io)
        .await
        .context("cannot open the replica")?;
    let info = replica.info();
    replica.close().await.context("closing the replica")?;
    let text = if json {
        info_json(&info)?
    } else {
        info_text(&info)
    };
    println!("{text}");
    Ok(())
}

fn info_json(info: &ReplicaInfo) -> anyhow::Result<String> {
    let layers: Vec<LayerOut<'_>> = info
        .layers
        .iter()
        .map(|l| LayerOut {
            id: l.id,
            name: &l.name,
            parent: l.parent,
            head: l.head,
            user_created: l.user_created,
            data_bytes: l.data_bytes,
            created: &l.created,
            size: l.size,
        })
        .collect();
    let v = serde_json::json!({
        "replica_id": info.replica_id,
        "size": info.size,
        "generation": info.generation,
        "epoch": info.epoch,
        "epoch_members": info.epoch_members,
        "flush_number": info.flush_number,
        "layers": layers,
        "dirty_regions": info.dirty_regions.len(),
    });
    serde_json::to_string_pretty(&v).context("encoding JSON")
}

fn info_text(info: &ReplicaInfo) -> String {
    let mut s = format!(
        "replica     {}\nsize        {} bytes\ngeneration  {}\nepoch       {} (members: {})\n\
         flush       {}\nlayers (oldest first):\n",
        info.replica_id,
        info.size,
        info.generation,
        info.epoch,
        info.epoch_members.join(", "),
        info.flush_number,
    );
    for l in &info.layers {
        let name = if l.head { "(head)" } else { l.name.as_str() };
        s.push_str(&format!(
            "  {name:<24} id {:<4} parent {:<4} {:>14} data bytes{}\n",
            l.id,
            l.parent,
            l.data_bytes,
            if l.user_created { "  user" } else { "" }
        ));
    }
    s.pop();
    s
}
