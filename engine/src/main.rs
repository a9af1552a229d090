//! `zebu-engine`: serve one volume over its replicas, or talk to a running engine.
//!
//! ```text
//! zebu-engine serve --volume vol --size 10G --replica 127.0.0.11:9501 --replica 127.0.0.12:9501 \
//!     --control 127.0.0.1:9600 --frontend nbd --nbd-listen 127.0.0.1:10809
//! zebu-engine --control 127.0.0.1:9600 info --json
//! zebu-engine --control 127.0.0.1:9600 scrub start --rate 64M
//! zebu-engine --control 127.0.0.1:9600 scrub status --json
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tokio::signal::unix::{SignalKind, signal};
use zebu_engine::blockdev::BlockDevice;
use zebu_engine::busypoll::{self, BusyPoll, Polled};
use zebu_engine::cli_args::{parse_bytes, parse_duration, parse_size};
use zebu_engine::control::ControlService;
use zebu_engine::iscsi::{IscsiConfig, IscsiServer, chap::Chap, target_iqn};
use zebu_engine::nbd::{NbdConfig, NbdServer};
use zebu_engine::replicator::{DataTransport, StartOptions, Volume, VolumeConfig};
use zebu_proto::engine as pb;
use zebu_proto::engine::engine_client::EngineClient;

#[derive(Parser)]
#[command(name = "zebu-engine", about = "The Zebu volume engine", version)]
struct Cli {
    /// The control address of a running engine (for the client commands).
    #[arg(long, global = true)]
    control: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FrontendKind {
    Nbd,
    Iscsi,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a volume.
    Serve(Box<ServeArgs>),
    /// Volume state, replicas and their modes.
    Info,
    /// Replica membership.
    #[command(subcommand)]
    Replica(ReplicaCmd),
    /// Snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Grow the volume.
    Expand {
        #[arg(value_parser = parse_size)]
        size: u64,
    },
    /// Progress of the current or last rebuild.
    RebuildStatus,
    /// Check every block of every replica against its checksum, compare the replicas and
    /// repair what can be.
    #[command(subcommand)]
    Scrub(ScrubCmd),
}

#[derive(Subcommand)]
enum ScrubCmd {
    /// Start a scrub in the background.
    Start {
        /// Data read per second, summed over the replicas (e.g. 64M; 0: the engine's default).
        #[arg(long, value_parser = parse_bytes, default_value = "0")]
        rate: u64,
    },
    /// Stop the running scrub.
    Stop,
    /// The running (or last) scrub and the last one that finished.
    Status,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long)]
    volume: String,
    /// The volume's uuid (the manager gives it). Without it the engine takes the uuid its
    /// replicas record, or makes one at the volume's first start; replicas of another
    /// volume are refused either way.
    #[arg(long, value_parser = parse_volume_uuid)]
    volume_uuid: Option<String>,
    /// The volume's secret, in a file only its owner may read: every connection to a
    /// replica proves it (replicas started with the same file refuse clients without it).
    /// Never on the command line.
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// Connect to the replicas over TLS, trusting only the certificates in this PEM file
    /// (for replicas started with --tls-cert); each replica's certificate must name the
    /// host of its --replica address (an IP address needs an IP subject alternative name).
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// A replica address (host:port); repeat for each replica.
    #[arg(long = "replica", required = true)]
    replicas: Vec<String>,
    /// Where the control server listens.
    #[arg(long = "control-listen", alias = "listen-control")]
    control_listen: Option<SocketAddr>,
    /// Frontends to run (repeatable); none serves only the control API.
    #[arg(long = "frontend")]
    frontends: Vec<FrontendKind>,
    #[arg(long, default_value = "0.0.0.0:10809")]
    nbd_listen: SocketAddr,
    #[arg(long, default_value = "0.0.0.0:3260")]
    iscsi_listen: SocketAddr,
    #[arg(long, requires = "chap_secret")]
    chap_user: Option<String>,
    #[arg(long, requires = "chap_user")]
    chap_secret: Option<String>,
    #[arg(long, requires_all = ["mutual_secret", "chap_user"])]
    mutual_user: Option<String>,
    #[arg(long, requires = "mutual_user")]
    mutual_secret: Option<String>,
    /// A replica that does not answer within this is dropped.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    io_timeout: Duration,
    /// Start even if the replicas cannot be shown current (logged); for operators.
    #[arg(long)]
    salvage: bool,
    /// Busy polling, for latency-bound volumes: keep one CPU awake for this many
    /// microseconds (200 is a good start) after a request starts or finishes, while at most
    /// 4 are in flight. Lower latency at queue depth 1 (NBD, 1 replica: p50 107 -> 62 us)
    /// for up to one CPU of spinning; off (0) by default because, where the replicas share
    /// the engine's CPUs, it cost 3-replica random writes at queue depth 32 about 10 %.
    #[arg(long, default_value_t = 0)]
    busy_poll_us: u64,
    /// A host address of this machine (repeatable): replicas there count as local. Reads go
    /// to them first, and their data moves over the replica's local Unix socket, not TCP.
    #[arg(long = "local-host")]
    local_hosts: Vec<String>,
    /// Transport of the data path to the replicas: frames (binary frames on plain TCP) or
    /// grpc (the gRPC Data stream). Control calls always use gRPC.
    #[arg(long, default_value = "frames")]
    data_transport: DataTransport,
    /// Compute and send the block checksums of every write. `off` is for measuring what
    /// checksums cost (with replicas started with `--checksums off` too).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    checksums: OnOff,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Subcommand)]
enum ReplicaCmd {
    Ls,
    /// Add a replica and bring it in sync in the background. A replica that cannot join
    /// (unreachable or not answering, not a replica, another volume's, another size, a
    /// member already) is refused at once, changing nothing, and the command exits non-zero
    /// with the reason.
    Add {
        address: String,
        /// Also wait until it is in sync; if the rebuild fails later, exit non-zero with the
        /// reason.
        #[arg(long)]
        wait: bool,
    },
    Rm {
        address: String,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    Create { name: String },
    Ls,
    Rm { name: String },
    Revert { name: String },
    Purge,
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                std::process::ExitCode::from(2)
            } else {
                std::process::ExitCode::SUCCESS
            };
        }
    };
    if matches!(cli.cmd, Cmd::Serve(_)) && !zebu_engine::heap::keep_large_buffers() {
        eprintln!("zebu-engine: note: the allocator did not take the large-buffer settings");
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zebu-engine: error: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(async move {
        match cli.cmd {
            Cmd::Serve(args) => serve(*args, cli.control).await,
            cmd => client(cmd, cli.control, cli.json).await,
        }
    });
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zebu-engine: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A rebuild's state from the engine's answer: the enum, or the word an engine before
/// protocol 3 sends instead.
fn rebuild_state(s: &pb::RebuildStatusResponse) -> pb::RebuildState {
    match s.rebuild_state() {
        pb::RebuildState::Unspecified => match s.state.as_str() {
            "running" => pb::RebuildState::Running,
            "done" => pb::RebuildState::Done,
            "failed" => pb::RebuildState::Failed,
            _ => pb::RebuildState::Idle,
        },
        known => known,
    }
}

/// Polls the rebuild status until the add of `address` is done (then the volume's info) or
/// failed (then its reason as the error).
async fn wait_added(
    c: &mut EngineClient<tonic::transport::Channel>,
    address: &str,
) -> anyhow::Result<pb::VolumeInfo> {
    loop {
        let s = c
            .rebuild_status(pb::RebuildStatusRequest {})
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        let state = rebuild_state(&s);
        if s.replica == address && state == pb::RebuildState::Failed {
            anyhow::bail!("adding replica {address} failed: {}", s.error);
        }
        if s.replica != address || state != pb::RebuildState::Running {
            return Ok(c
                .info(pb::InfoRequest {})
                .await
                .map_err(|s| anyhow::anyhow!("{}", s.message()))?
                .into_inner());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A `--volume-uuid` that is not one.
#[derive(Debug, thiserror::Error)]
#[error("invalid volume uuid {0:?}: expected 1-64 letters, digits and dashes")]
struct InvalidUuid(String);

fn parse_volume_uuid(s: &str) -> Result<String, InvalidUuid> {
    if zebu_proto::frames::valid_volume_uuid(s) {
        Ok(s.to_string())
    } else {
        Err(InvalidUuid(s.to_string()))
    }
}

async fn serve(args: ServeArgs, control: Option<String>) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // The same replica twice would be two members writing one directory (issue 18: it was
    // accepted, and the volume read degraded).
    let mut seen = std::collections::BTreeSet::new();
    for r in &args.replicas {
        if !seen.insert(r.as_str()) {
            anyhow::bail!("--replica {r} is given twice; name each replica once");
        }
    }
    let control_addr: SocketAddr = match (args.control_listen, control) {
        (Some(a), _) => a,
        (None, Some(c)) => c
            .parse()
            .with_context(|| format!("--control {c:?} is not host:port"))?,
        (None, None) => anyhow::bail!("give the control address with --control HOST:PORT"),
    };
    if let Some(p) = &args.secret_file {
        let secret = zebu_proto::auth::Secret::load(p).context("cannot read the volume secret")?;
        zebu_engine::replicator::set_volume_secret(secret)?;
        tracing::info!("authentication on: every replica connection proves the volume's secret");
    }
    if let Some(p) = &args.tls_ca {
        let tls = zebu_proto::tls::connector(p).context("cannot set up TLS to the replicas")?;
        zebu_engine::replicator::set_replica_tls(tls)?;
        tracing::info!(
            "TLS on: every replica connection is TLS, checked against {}",
            p.display()
        );
    }
    let config = VolumeConfig {
        name: args.volume.clone(),
        size: args.size,
        io_timeout: args.io_timeout,
        local_hosts: args.local_hosts.clone(),
        data_transport: args.data_transport,
        checksums: args.checksums == OnOff::On,
        volume_uuid: args.volume_uuid.clone(),
    };
    let (volume, stale) = Volume::start(StartOptions {
        config,
        replicas: args.replicas.clone(),
        salvage: args.salvage,
    })
    .await?;
    let counted = volume.clone();
    tokio::spawn(zebu_engine::heap::trim_when_idle(move || {
        counted.requests_started()
    }));
    let dev: Arc<dyn BlockDevice> = match args.busy_poll_us {
        0 => volume.clone(),
        us => {
            let poll = BusyPoll::start(
                Duration::from_micros(us),
                busypoll::MAX_INFLIGHT,
                busypoll::SHALLOW_FOR,
            )
            .context("starting the busy-poll thread")?;
            Arc::new(Polled::new(volume.clone(), poll))
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let mut tasks = tokio::task::JoinSet::new();
    let mut frontends = Vec::new();
    if args.frontends.contains(&FrontendKind::Nbd) {
        let server = NbdServer::bind(
            NbdConfig::new(args.nbd_listen, args.volume.clone()),
            dev.clone(),
        )
        .await?;
        let endpoint = format!("nbd://{}/{}", server.local_addr(), args.volume);
        println!("nbd {endpoint}");
        frontends.push(pb::Frontend {
            kind: "nbd".into(),
            endpoint,
        });
        let stop = stopped();
        tasks.spawn(async move { server.run(stop).await.map_err(anyhow::Error::from) });
    }
    if args.frontends.contains(&FrontendKind::Iscsi) {
        let mut cfg = IscsiConfig::new(args.iscsi_listen, &args.volume);
        if let (Some(user), Some(secret)) = (args.chap_user.clone(), args.chap_secret.clone()) {
            let mutual = args.mutual_user.clone().zip(args.mutual_secret.clone());
            cfg.chap = Some(Chap {
                user,
                secret,
                mutual,
            });
        }
        let server = IscsiServer::bind(cfg, dev.clone()).await?;
        let endpoint = format!(
            "iscsi://{}/{}/1",
            server.local_addr(),
            target_iqn(&args.volume)
        );
        println!("iscsi {endpoint}");
        frontends.push(pb::Frontend {
            kind: "iscsi".into(),
            endpoint,
        });
        let stop = stopped();
        tasks.spawn(async move { server.serve(stop).await.map_err(anyhow::Error::from) });
    }
    let listener = tokio::net::TcpListener::bind(control_addr)
        .await
        .with_context(|| format!("binding the control address {control_addr}"))?;
    println!("control {}", listener.local_addr()?);
    let svc = ControlService::new(volume.clone(), frontends).into_server();
    let stop = stopped();
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                stop,
            )
            .await
            .map_err(anyhow::Error::from)
    });
    println!("ready");
    // Replicas that were given but are not current are brought back one after another.
    if !stale.is_empty() {
        let v = volume.clone();
        tokio::spawn(async move {
            for addr in stale {
                if let Err(e) = v.rebuild(&addr).await {
                    tracing::warn!(replica = %addr, "cannot bring the replica back: {e}");
                }
            }
        });
    }
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        Some(res) = tasks.join_next() => {
            res.context("a server task panicked")??;
            anyhow::bail!("a server stopped unexpectedly");
        }
    }
    tracing::info!("stopping: flushing the volume");
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    volume.flush_all().await.context("final flush")?;
    Ok(())
}

async fn client(cmd: Cmd, control: Option<String>, json: bool) -> anyhow::Result<()> {
    let addr = control.context("give the engine's control address with --control HOST:PORT")?;
    let mut c = EngineClient::connect(format!("http://{addr}"))
        .await
        .with_context(|| format!("cannot reach the engine at {addr}"))?;
    let st = |s: tonic::Status| anyhow::anyhow!("{}", s.message());
    match cmd {
        Cmd::Serve(_) => unreachable!("handled in main"),
        Cmd::Info | Cmd::Replica(ReplicaCmd::Ls) => {
            let i = c.info(pb::InfoRequest {}).await.map_err(st)?.into_inner();
            print_info(&i, json, matches!(cmd, Cmd::Replica(_)));
        }
        Cmd::Replica(ReplicaCmd::Add { address, wait }) => {
            let mut i = c
                .replica_add(pb::ReplicaAddRequest {
                    address: address.clone(),
                })
                .await
                .map_err(st)?
                .into_inner();
            if wait {
                i = wait_added(&mut c, &address).await?;
            }
            print_info(&i, json, true);
        }
        Cmd::Replica(ReplicaCmd::Rm { address }) => {
            let i = c
                .replica_remove(pb::ReplicaRemoveRequest { address })
                .await
                .map_err(st)?
                .into_inner();
            print_info(&i, json, true);
        }
        Cmd::Snapshot(s) => {
            let list = match s {
                SnapshotCmd::Create { name } => {
                    c.snapshot_create(pb::SnapshotCreateRequest {
                        name,
                        labels: Default::default(),
                    })
                    .await
                }
                SnapshotCmd::Ls => c.snapshot_list(pb::SnapshotListRequest {}).await,
                SnapshotCmd::Rm { name } => {
                    c.snapshot_delete(pb::SnapshotDeleteRequest { name }).await
                }
                SnapshotCmd::Revert { name } => {
                    c.snapshot_revert(pb::SnapshotRevertRequest { name }).await
                }
                SnapshotCmd::Purge => c.snapshot_purge(pb::SnapshotPurgeRequest {}).await,
            }
            .map_err(st)?
            .into_inner();
            print_snapshots(&list, json);
        }
        Cmd::Expand { size } => {
            let i = c
                .expand(pb::ExpandRequest { size })
                .await
                .map_err(st)?
                .into_inner();
            print_info(&i, json, false);
        }
        Cmd::Scrub(s) => {
            let st = match s {
                ScrubCmd::Start { rate } => {
                    c.scrub_start(pb::ScrubStartRequest {
                        rate_bytes_per_second: rate,
                    })
                    .await
                }
                ScrubCmd::Stop => c.scrub_stop(pb::ScrubStopRequest {}).await,
                ScrubCmd::Status => c.scrub_status(pb::ScrubStatusRequest {}).await,
            }
            .map_err(st)?
            .into_inner();
            print_scrub(&st, json);
        }
        Cmd::RebuildStatus => {
            let s = c
                .rebuild_status(pb::RebuildStatusRequest {})
                .await
                .map_err(st)?
                .into_inner();
            if json {
                println!(
                    "{}",
                    serde_json::json!({"replica": s.replica, "state": s.state, "kind": s.kind, "bytesDone": s.bytes_done,
                        "bytesTotal": s.bytes_total, "bytesCopied": s.bytes_copied, "error": s.error})
                );
            } else {
                let pct = if s.bytes_total > 0 {
                    100.0 * s.bytes_done as f64 / s.bytes_total as f64
                } else {
                    0.0
                };
                println!(
                    "{} {} {}: {} of {} bytes ({pct:.0}%), {} copied{}",
                    s.state,
                    s.kind,
                    s.replica,
                    s.bytes_done,
                    s.bytes_total,
                    s.bytes_copied,
                    if s.error.is_empty() {
                        String::new()
                    } else {
                        format!(", error: {}", s.error)
                    }
                );
            }
        }
    }
    Ok(())
}

fn print_info(i: &pb::VolumeInfo, json: bool, replicas_only: bool) {
    let g = i.integrity.unwrap_or_default();
    let integrity = serde_json::json!({"corruptReads": g.corrupt_reads,
        "repairedBlocks": g.repaired_blocks, "unrecoverableBlocks": g.unrecoverable_blocks});
    let p = i.data_path.unwrap_or_default();
    let spans = |s: Option<pb::PathSpans>| {
        let s = s.unwrap_or_default();
        serde_json::json!({"count": s.count, "frontendNs": s.frontend_ns,
            "replicatorNs": s.replicator_ns, "transportNs": s.transport_ns})
    };
    let data_path = serde_json::json!({"writes": spans(p.writes), "flushes": spans(p.flushes),
        "flushesShared": p.flushes_shared});
    let reps: Vec<serde_json::Value> = i
        .replicas
        .iter()
        .map(|r| serde_json::json!({"address": r.address, "id": r.id, "mode": r.mode, "reason": r.reason, "dataPath": r.data_path}))
        .collect();
    if json {
        let v = if replicas_only {
            serde_json::Value::Array(reps)
        } else {
            serde_json::json!({
                "name": i.name, "size": i.size, "state": i.state, "generation": i.generation, "epoch": i.epoch,
                "members": i.members, "flushNumber": i.flush_number, "replicas": reps,
                "integrity": integrity, "dataPath": data_path,
                "frontends": i.frontends.iter().map(|f| serde_json::json!({"kind": f.kind, "endpoint": f.endpoint})).collect::<Vec<_>>(),
            })
        };
        println!("{v}");
        return;
    }
    if !replicas_only {
        println!(
            "volume {} ({} bytes): {}, generation {}, epoch {}",
            i.name, i.size, i.state, i.generation, i.epoch
        );
        let g = i.integrity.unwrap_or_default();
        println!(
            "checksums: {} corrupt reads, {} blocks repaired, {} blocks unrecoverable",
            g.corrupt_reads, g.repaired_blocks, g.unrecoverable_blocks
        );
        let p = i.data_path.unwrap_or_default();
        for (what, s) in [("writes", p.writes), ("flushes", p.flushes)] {
            let s = s.unwrap_or_default();
            let avg = |ns: u64| ns / s.count.max(1) / 1000;
            println!(
                "{what}: {} (mean µs: frontend {}, replicator {}, of it transport {})",
                s.count,
                avg(s.frontend_ns),
                avg(s.replicator_ns),
                avg(s.transport_ns)
            );
        }
        println!("flushes shared (group commit): {}", p.flushes_shared);
        for f in &i.frontends {
            println!("frontend {} {}", f.kind, f.endpoint);
        }
    }
    println!("{:<24} {:<4} {:<12} REASON", "ADDRESS", "MODE", "DATA PATH");
    for r in &i.replicas {
        println!(
            "{:<24} {:<4} {:<12} {}",
            r.address, r.mode, r.data_path, r.reason
        );
    }
}

fn print_snapshots(l: &pb::Snapshots, json: bool) {
    if json {
        let v: Vec<serde_json::Value> = l
            .snapshots
            .iter()
            .map(|s| serde_json::json!({"name": s.name, "parent": s.parent, "userCreated": s.user_created,
                "created": s.created, "dataBytes": s.data_bytes, "head": s.head}))
            .collect();
        println!("{}", serde_json::Value::Array(v));
        return;
    }
    println!(
        "{:<28} {:<28} {:>6} {:>14} CREATED",
        "NAME", "PARENT", "USER", "DATA BYTES"
    );
    for s in &l.snapshots {
        let name = if s.head { "(head)" } else { s.name.as_str() };
        println!(
            "{:<28} {:<28} {:>6} {:>14} {}",
            name, s.parent, s.user_created, s.data_bytes, s.created
        );
    }
}

fn scrub_json(r: &pb::ScrubReport) -> serde_json::Value {
    let state = pb::ScrubState::try_from(r.state).unwrap_or(pb::ScrubState::Unspecified);
    serde_json::json!({
        "state": scrub_state_name(state), "startedUnixMs": r.started_unix_ms,
        "finishedUnixMs": r.finished_unix_ms, "bytesScanned": r.bytes_scanned,
        "bytesTotal": r.bytes_total, "bytesVerified": r.bytes_verified,
        "bytesPerSecond": r.bytes_per_second, "rateLimit": r.rate_limit,
        "corruptFound": r.corrupt_found, "repaired": r.repaired,
        "unrecoverable": r.unrecoverable, "divergent": r.divergent,
        "divergentRepaired": r.divergent_repaired, "bytesUnverified": r.bytes_unverified,
        "replicas": r.replicas, "error": r.error,
    })
}

fn scrub_state_name(s: pb::ScrubState) -> &'static str {
    match s {
        pb::ScrubState::Unspecified => "none",
        pb::ScrubState::Running => "running",
        pb::ScrubState::Done => "done",
        pb::ScrubState::Stopped => "stopped",
        pb::ScrubState::Failed => "failed",
    }
}

fn print_scrub(s: &pb::ScrubInfo, json: bool) {
    if json {
        let v = serde_json::json!({
            "current": s.current.as_ref().map(scrub_json),
            "lastDone": s.last_done.as_ref().map(scrub_json),
        });
        println!("{v}");
        return;
    }
    for (what, r) in [("scrub", &s.current), ("last done", &s.last_done)] {
        let Some(r) = r else { continue };
        let state = pb::ScrubState::try_from(r.state).unwrap_or(pb::ScrubState::Unspecified);
        let pct = if r.bytes_total > 0 {
            100.0 * r.bytes_scanned as f64 / r.bytes_total as f64
        } else {
            0.0
        };
        println!(
            "{what}: {} {pct:.0}% ({} of {} bytes), {} bytes checked at {} B/s; {} corrupt, {} repaired, {} unrecoverable, {} divergent ({} repaired){}",
            scrub_state_name(state),
            r.bytes_scanned,
            r.bytes_total,
            r.bytes_verified,
            r.bytes_per_second,
            r.corrupt_found,
            r.repaired,
            r.unrecoverable,
            r.divergent,
            r.divergent_repaired,
            if r.error.is_empty() {
                String::new()
            } else {
                format!("; error: {}", r.error)
            }
        );
    }
}
