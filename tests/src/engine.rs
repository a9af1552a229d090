//! Starting and driving `zebu-engine` processes in tests, and the checks the engine tests
//! share.
//!
//! # Engine processes
//!
//! [`EngineProcess::start`] runs `zebu-engine serve` with its NBD frontend and control server
//! on `127.0.0.1:0`, and reads the lines the engine prints (`nbd nbd://ADDR/NAME`,
//! `control ADDR`, `ready`) to learn the ports, so there is no race for free ports and a
//! restarted engine simply gets new ones. An engine that exits before `ready` (e.g. it
//! refuses stale replicas) is an error carrying its log, so tests can assert on the reason.
//! Its stderr is appended to a log file that survives restarts. The child is killed and
//! reaped when the handle drops. With [`EngineConfig::iscsi_listen`] set the engine also
//! serves iSCSI, and its `iscsi iscsi://ADDR/IQN/1` line gives [`EngineProcess::iscsi`].
//!
//! State is read over the control gRPC API ([`EngineProcess::info`],
//! [`EngineProcess::rebuild_status`]); membership changes go through the `zebu-engine` CLI
//! with `--json` ([`EngineProcess::cli`]) so the CLI is exercised too.
//!
//! # Workloads
//!
//! [`Background`] runs the verified workload of `zebu_testkit::workload` over an NBD
//! connection in a task until asked to stop, so a test can inject faults while it runs and
//! then look at the report. [`LatencyProbe`] issues small writes in a loop and timestamps each
//! one, to show how long a dying replica stalls the volume.
//!
//! # Comparing replicas
//!
//! [`Fingerprint::of`] reads a replica's Info (layers, sizes, epoch) and the CRC32C of every
//! 4 KiB block of the volume (`Checksums`) and of every layer's own data (`ReadLayer`), so
//! two replicas that should be identical can be compared field by field. [`replica_info`]
//! and [`chain_of`] read one replica's own view (layers, `rebuilt`/`incomplete` flags,
//! snapshot chain), to check every replica rather than only what the engine reports.
//!
//! [`fill`] writes a range once in 1 MiB blocks (fast, verifiable bulk data), and
//! [`EngineProcess::wait_rebuild`] polls the rebuild status every 5 ms so a test can strike
//! in the middle of a copy.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tonic::transport::Channel;
use zebu_engine::blockdev::BlockDevice;
use zebu_proto::engine as epb;
use zebu_proto::engine::engine_client::EngineClient;
use zebu_proto::replica as rpb;
use zebu_testkit::workload::{self, Model, NbdClient, RunReport, WorkloadConfig};

use crate::{bin_path, connect};

/// How long an engine may take to print `ready` (start includes reconciling replicas).
const ENGINE_START_TIMEOUT: Duration = Duration::from_secs(60);

/// How an engine is started.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub volume: String,
    pub size: u64,
    /// Replica addresses, `host:port`.
    pub replicas: Vec<String>,
    pub io_timeout: Duration,
    pub salvage: bool,
    /// Also serve the iSCSI frontend on this address (`127.0.0.1:0` picks a port); the
    /// URL the engine prints lands in [`EngineProcess::iscsi`].
    pub iscsi_listen: Option<SocketAddr>,
    /// More arguments for `zebu-engine serve` (e.g. `--data-transport grpc`).
    pub extra_args: Vec<String>,
}

impl EngineConfig {
    pub fn new(volume: &str, size: u64, replicas: &[SocketAddr]) -> EngineConfig {
        EngineConfig {
            volume: volume.to_string(),
            size,
            replicas: replicas.iter().map(|a| a.to_string()).collect(),
            io_timeout: Duration::from_secs(2),
            salvage: false,
            iscsi_listen: None,
            extra_args: Vec::new(),
        }
    }
}

/// A running `zebu-engine serve`.
pub struct EngineProcess {
    child: Child,
    /// The NBD frontend, `host:port`.
    pub nbd: String,
    /// The iSCSI frontend's URL, `iscsi://HOST:PORT/IQN/1`, when
    /// [`EngineConfig::iscsi_listen`] asked for it.
    pub iscsi: Option<String>,
    pub volume: String,
    pub control: SocketAddr,
    log: PathBuf,
}

impl EngineProcess {
    /// Starts the engine and waits for `ready`; its stderr is appended to `log`.
    pub fn start(cfg: &EngineConfig, log: &Path) -> anyhow::Result<EngineProcess> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(bin_path("zebu-engine"));
        cmd.arg("serve")
            .args(["--volume", &cfg.volume])
            .args(["--size", &cfg.size.to_string()]);
        for r in &cfg.replicas {
            cmd.args(["--replica", r]);
        }
        cmd.args(["--control", "127.0.0.1:0"])
            .args(["--frontend", "nbd"])
            .args(["--nbd-listen", "127.0.0.1:0"])
            .args(["--io-timeout", &format!("{}ms", cfg.io_timeout.as_millis())]);
        if cfg.salvage {
            cmd.arg("--salvage");
        }
        if let Some(addr) = cfg.iscsi_listen {
            cmd.args(["--frontend", "iscsi"])
                .args(["--iscsi-listen", &addr.to_string()]);
        }
        cmd.args(&cfg.extra_args);
        let mut child = cmd
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .context("spawning zebu-engine")?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        // Keeps reading after `ready` so the engine never writes into a closed pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    // Nobody listens any more; keep draining.
                    continue;
                }
            }
        });
        let deadline = Instant::now() + ENGINE_START_TIMEOUT;
        let (mut nbd, mut control, mut iscsi) = (None, None, None);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let line = line.trim().to_string();
                    if let Some(url) = line.strip_prefix("nbd ") {
                        // nbd://host:port/name
                        let rest = url.strip_prefix("nbd://").context("nbd line")?;
                        let hostport = rest.split('/').next().unwrap_or_default();
                        nbd = Some(hostport.to_string());
                    } else if let Some(url) = line.strip_prefix("iscsi ") {
                        iscsi = Some(url.to_string());
                    } else if let Some(a) = line.strip_prefix("control ") {
                        control = Some(a.parse::<SocketAddr>().context("control address")?);
                    } else if line == "ready" {
                        break;
                    }
                }
                Err(e) => {
                    let timed_out = matches!(e, std::sync::mpsc::RecvTimeoutError::Timeout);
                    if timed_out {
                        let _ = child.kill();
                    }
                    let status = child.wait().ok();
                    bail!(
                        "zebu-engine did not become ready ({}; exit {status:?}); log:\n{}",
                        if timed_out { "timed out" } else { "exited" },
                        crate::read_log(log)
                    );
                }
            }
        }
        let (Some(nbd), Some(control)) = (nbd, control) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("zebu-engine said ready without printing its nbd and control addresses");
        };
        if cfg.iscsi_listen.is_some() && iscsi.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            bail!("zebu-engine said ready without printing its iscsi URL");
        }
        Ok(EngineProcess {
            child,
            nbd,
            iscsi,
            volume: cfg.volume.clone(),
            control,
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// The engine's stderr so far (every start that used the same log file).
    pub fn log(&self) -> String {
        crate::read_log(&self.log)
    }

    /// `kill -9` and reap.
    pub fn kill9(&mut self) {
        let _ = kill(self.pid(), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM (the engine flushes every replica before it exits), then waits up to `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        kill(self.pid(), Signal::SIGTERM).context("SIGTERM")?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("zebu-engine did not exit within {timeout:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A control client.
    pub async fn client(&self) -> anyhow::Result<EngineClient<Channel>> {
        let channel = Channel::from_shared(format!("http://{}", self.control))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .with_context(|| format!("connecting to the engine at {}", self.control))?;
        Ok(EngineClient::new(channel))
    }

    pub async fn info(&self) -> anyhow::Result<epb::VolumeInfo> {
        let mut c = self.client().await?;
        Ok(c.info(epb::InfoRequest {}).await?.into_inner())
    }

    pub async fn rebuild_status(&self) -> anyhow::Result<epb::RebuildStatusResponse> {
        let mut c = self.client().await?;
        Ok(c.rebuild_status(epb::RebuildStatusRequest {})
            .await?
            .into_inner())
    }

    /// The mode (RW, WO, ERR) of the replica at `addr`, if the engine lists it.
    pub async fn mode_of(&self, addr: &str) -> anyhow::Result<Option<String>> {
        let info = self.info().await?;
        Ok(info
            .replicas
            .iter()
            .find(|r| r.address == addr)
            .map(|r| r.mode.clone()))
    }

    /// Runs `zebu-engine --control ADDR ARGS --json` and parses what it prints.
    pub async fn cli(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        let mut cmd = tokio::process::Command::new(bin_path("zebu-engine"));
        cmd.arg("--control")
            .arg(self.control.to_string())
            .args(args)
            .arg("--json")
            .stdin(Stdio::null());
        let out = cmd.output().await.context("running zebu-engine CLI")?;
        if !out.status.success() {
            bail!(
                "zebu-engine {args:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "zebu-engine {args:?} printed no JSON: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// Polls [`EngineProcess::info`] every 25 ms until `pred` holds; returns that info and
    /// how long it took. Errors (with the last info) after `timeout`.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&epb::VolumeInfo) -> bool,
    ) -> anyhow::Result<(epb::VolumeInfo, Duration)> {
        let started = Instant::now();
        loop {
            let info = self.info().await?;
            if pred(&info) {
                return Ok((info, started.elapsed()));
            }
            if started.elapsed() > timeout {
                bail!("condition not met within {timeout:?}; last info: {info:?}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the rebuild of `addr` is done (or failed: an error) and it is RW.
    pub async fn wait_rebuilt(
        &self,
        addr: &str,
        timeout: Duration,
    ) -> anyhow::Result<epb::RebuildStatusResponse> {
        let started = Instant::now();
        loop {
            let s = self.rebuild_status().await?;
            if s.state == "failed" {
                bail!("rebuild of {addr} failed: {s:?}");
            }
            if s.state == "done"
                && s.replica == addr
                && self.mode_of(addr).await?.as_deref() == Some("RW")
            {
                return Ok(s);
            }
            if started.elapsed() > timeout {
                let info = self.info().await?;
                bail!("rebuild of {addr} not done within {timeout:?}: {s:?}; {info:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A new NBD connection to the volume.
    pub async fn nbd_client(&self) -> anyhow::Result<NbdClient> {
        NbdClient::connect(&self.nbd, &self.volume)
            .await
            .with_context(|| format!("connecting to NBD {} export {}", self.nbd, self.volume))
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A verified workload running in a task until [`Background::stop`].
pub struct Background {
    cancel: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<(Model, RunReport, NbdClient)>,
}

impl Background {
    /// Starts `cfg` (its `cancel` is replaced) on `dev`, recording into `model`.
    pub fn spawn(dev: NbdClient, mut model: Model, mut cfg: WorkloadConfig) -> Background {
        let cancel = Arc::new(AtomicBool::new(false));
        cfg.cancel = Some(cancel.clone());
        let handle = tokio::spawn(async move {
            let report = workload::run_workload(&dev, &mut model, &cfg).await;
            (model, report, dev)
        });
        Background { cancel, handle }
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Asks the workload to stop, and waits for it (in-flight operations and the final flush
    /// finish).
    pub async fn stop(self) -> anyhow::Result<(Model, RunReport, NbdClient)> {
        self.cancel.store(true, Ordering::Relaxed);
        self.handle.await.context("the workload task panicked")
    }
}

/// A workload configuration for the engine tests: random 4 KiB writes with QD 32, a flush
/// every 100 writes, 10 % checked reads, running until stopped.
pub fn busy_workload(seed: u64) -> WorkloadConfig {
    WorkloadConfig {
        queue_depth: 32,
        flush_every: Some(100),
        read_percent: 10,
        stop: workload::StopAfter::Duration(Duration::from_secs(3600)),
        seed,
        ..WorkloadConfig::default()
    }
}

/// Fails with a readable list if the run saw I/O errors or wrong reads.
pub fn assert_clean_run(what: &str, report: &RunReport) {
    let errs: Vec<String> = report
        .io_errors
        .iter()
        .take(10)
        .map(|e| e.to_string())
        .collect();
    let bad: Vec<String> = report
        .bad_reads
        .iter()
        .take(10)
        .map(|w| w.to_string())
        .collect();
    assert!(
        report.io_errors.is_empty() && report.bad_reads.is_empty(),
        "{what}: {} I/O errors {errs:?}, {} wrong reads {bad:?}",
        report.io_errors.len(),
        report.bad_reads.len()
    );
}

/// Reads the whole range of `model` back through `dev` and fails on any wrong block.
pub async fn assert_verified(
    what: &str,
    dev: &NbdClient,
    model: &Model,
    expect: workload::Expect,
) -> workload::VerifyReport {
    let r = workload::verify(dev, model, expect, workload::Scope::Range, 32).await;
    let wrong: Vec<String> = r.wrong.iter().take(10).map(|w| w.to_string()).collect();
    let errs: Vec<String> = r.io_errors.iter().take(10).map(|e| e.to_string()).collect();
    assert!(
        r.passed(),
        "{what}: verify of {} blocks found {} wrong {wrong:?} and {} I/O errors {errs:?}",
        r.checked,
        r.wrong.len(),
        r.io_errors.len()
    );
    eprintln!("{what}: verified {} blocks ({expect:?})", r.checked);
    r
}

/// Latencies of single 4 KiB writes issued back to back by a few workers.
pub struct LatencyProbe {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<anyhow::Result<Vec<(Instant, Duration)>>>,
}

impl LatencyProbe {
    /// Writes 4 KiB blocks in `[offset, offset+len)` over `dev` with `workers` in flight;
    /// records (issue time, latency) of each.
    pub fn spawn(dev: Arc<NbdClient>, offset: u64, len: u64, workers: usize) -> LatencyProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = tokio::spawn(async move {
            let blocks = len / 4096;
            let mut tasks = Vec::new();
            for w in 0..workers as u64 {
                let dev = dev.clone();
                let s = s.clone();
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut i = w;
                    while !s.load(Ordering::Relaxed) {
                        let at = offset + (i % blocks) * 4096;
                        let t = Instant::now();
                        dev.write(at, Bytes::from(vec![(i % 251) as u8; 4096]))
                            .await
                            .with_context(|| format!("probe write at {at}"))?;
                        out.push((t, t.elapsed()));
                        i += workers as u64;
                    }
                    anyhow::Ok(out)
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.context("probe task panicked")??);
            }
            all.sort_by_key(|(t, _)| *t);
            Ok(all)
        });
        LatencyProbe { stop, handle }
    }

    pub async fn stop(self) -> anyhow::Result<Vec<(Instant, Duration)>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.await.context("probe panicked")?
    }
}

/// The `p`-th percentile (0..=100, nearest rank rounded down) of `lat`.
pub fn percentile(lat: &[Duration], p: u32) -> Duration {
    if lat.is_empty() {
        return Duration::ZERO;
    }
    let mut v = lat.to_vec();
    v.sort();
    // Nearest rank, in integers.
    let i = (v.len() - 1) * p.min(100) as usize / 100;
    v[i.min(v.len() - 1)]
}

/// Everything that must be equal between replicas that are in sync.
#[derive(Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub size: u64,
    pub epoch: u64,
    pub flush_number: u64,
    /// (name, user_created, data_bytes, size) of each layer, oldest first; the head is "".
    pub layers: Vec<(String, bool, u64, u64)>,
    /// CRC32C of every 4 KiB block of the volume as it reads.
    pub volume_crcs: Vec<u32>,
    /// Per layer name: CRC32C of each 4 KiB block the layer itself holds, by offset.
    pub layer_crcs: BTreeMap<String, BTreeMap<u64, u32>>,
}

impl Fingerprint {
    /// Reads the fingerprint of the replica at `addr` (it must not be taking writes).
    pub async fn of(addr: SocketAddr) -> anyhow::Result<Fingerprint> {
        let mut c = connect(addr).await?;
        let info = c.info(rpb::InfoRequest {}).await?.into_inner();
        let layers = info
            .layers
            .iter()
            .map(|l| (l.name.clone(), l.user_created, l.data_bytes, l.size))
            .collect();
        let mut volume_crcs = Vec::new();
        let step = 64 << 20;
        let mut at = 0;
        while at < info.size {
            let length = step.min(info.size - at);
            let r = c
                .checksums(rpb::ChecksumsRequest {
                    offset: at,
                    length,
                    block_size: 4096,
                })
                .await
                .with_context(|| format!("Checksums {at}+{length} on {addr}"))?
                .into_inner();
            volume_crcs.extend(r.crc32c);
            at += length;
        }
        let mut layer_crcs = BTreeMap::new();
        for l in &info.layers {
            let mut stream = c
                .read_layer(rpb::ReadLayerRequest {
                    layer: l.name.clone(),
                    extents: Vec::new(),
                })
                .await
                .with_context(|| format!("ReadLayer {:?} on {addr}", l.name))?
                .into_inner();
            let mut crcs = BTreeMap::new();
            while let Some(chunk) = stream.message().await? {
                for (i, b) in chunk.data.chunks(4096).enumerate() {
                    crcs.insert(chunk.offset + i as u64 * 4096, crc32c::crc32c(b));
                }
            }
            layer_crcs.insert(l.name.clone(), crcs);
        }
        Ok(Fingerprint {
            size: info.size,
            epoch: info.epoch,
            flush_number: info.flush_number,
            layers,
            volume_crcs,
            layer_crcs,
        })
    }

    /// A readable list of the differences (empty when equal).
    pub fn diff(&self, other: &Fingerprint) -> Vec<String> {
        let mut out = Vec::new();
        if self.size != other.size {
            out.push(format!("size {} vs {}", self.size, other.size));
        }
        if self.epoch != other.epoch {
            out.push(format!("epoch {} vs {}", self.epoch, other.epoch));
        }
        if self.flush_number != other.flush_number {
            out.push(format!(
                "flush number {} vs {}",
                self.flush_number, other.flush_number
            ));
        }
        if self.layers != other.layers {
            out.push(format!("layers {:?} vs {:?}", self.layers, other.layers));
        }
        let differing: Vec<usize> = self
            .volume_crcs
            .iter()
            .zip(&other.volume_crcs)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i)
            .collect();
        if !differing.is_empty() || self.volume_crcs.len() != other.volume_crcs.len() {
            out.push(format!(
                "{} volume blocks differ (first: {:?})",
                differing.len(),
                differing
                    .iter()
                    .take(8)
                    .map(|i| *i as u64 * 4096)
                    .collect::<Vec<_>>()
            ));
        }
        for (name, a) in &self.layer_crcs {
            let Some(b) = other.layer_crcs.get(name) else {
                continue; // already reported by the layer list
            };
            if a != b {
                let n = a
                    .iter()
                    .filter(|(off, crc)| b.get(off) != Some(crc))
                    .count()
                    + b.keys().filter(|off| !a.contains_key(off)).count();
                out.push(format!("layer {name:?}: {n} blocks differ"));
            }
        }
        out
    }
}

/// Three replicas on 127.0.0.11, .12 and .13 (each in its own directory of one temporary
/// directory) and one engine over them: the usual setup of an engine test.
pub struct Cluster {
    pub tmp: tempfile::TempDir,
    pub size: u64,
    pub cfg: EngineConfig,
    pub addrs: Vec<SocketAddr>,
    pub dirs: Vec<PathBuf>,
    pub replicas: Vec<Option<crate::ReplicaProcess>>,
    pub engine: Option<EngineProcess>,
    /// More `zebu-replica serve` arguments, for starts and restarts.
    pub replica_args: Vec<String>,
}

impl Cluster {
    /// Starts three fresh replicas of `size` bytes and an engine with a 2 s I/O timeout.
    pub fn start(volume: &str, size: u64) -> anyhow::Result<Cluster> {
        let mut c = Self::replicas_only(volume, size)?;
        c.start_engine()?;
        Ok(c)
    }

    /// Starts the three replicas but no engine (the caller adjusts `cfg` first).
    pub fn replicas_only(volume: &str, size: u64) -> anyhow::Result<Cluster> {
        Self::replicas_only_with(volume, size, &[])
    }

    /// [`Cluster::replicas_only`] with more `zebu-replica serve` arguments for every replica,
    /// kept for their restarts (e.g. `--cache direct`).
    pub fn replicas_only_with(
        volume: &str,
        size: u64,
        replica_args: &[&str],
    ) -> anyhow::Result<Cluster> {
        let tmp = tempfile::tempdir()?;
        let mut replicas = Vec::new();
        let mut dirs = Vec::new();
        for i in 0..3u8 {
            let dir = tmp.path().join(format!("r{}", i + 1));
            std::fs::create_dir_all(&dir)?;
            replicas.push(Some(crate::ReplicaProcess::start_with(
                &dir,
                size,
                crate::loopback(11 + i),
                replica_args,
            )?));
            dirs.push(dir);
        }
        let addrs: Vec<SocketAddr> = replicas.iter().flatten().map(|r| r.addr).collect();
        let cfg = EngineConfig::new(volume, size, &addrs);
        Ok(Cluster {
            tmp,
            size,
            cfg,
            addrs,
            dirs,
            replicas,
            engine: None,
            replica_args: replica_args.iter().map(|a| a.to_string()).collect(),
        })
    }

    pub fn engine_log_path(&self) -> PathBuf {
        self.tmp.path().join("engine.log")
    }

    /// Starts (or restarts) the engine with `self.cfg`.
    pub fn start_engine(&mut self) -> anyhow::Result<&EngineProcess> {
        let e = EngineProcess::start(&self.cfg, &self.engine_log_path())?;
        Ok(self.engine.insert(e))
    }

    pub fn engine(&self) -> &EngineProcess {
        self.engine.as_ref().expect("the test started the engine")
    }

    pub fn engine_mut(&mut self) -> &mut EngineProcess {
        self.engine.as_mut().expect("the test started the engine")
    }

    /// The address of replica `i` as the engine names it.
    pub fn addr(&self, i: usize) -> String {
        self.addrs[i].to_string()
    }

    pub fn replica(&self, i: usize) -> &crate::ReplicaProcess {
        self.replicas[i].as_ref().expect("replica is running")
    }

    pub fn kill_replica(&mut self, i: usize) {
        if let Some(mut r) = self.replicas[i].take() {
            r.kill9();
        }
    }

    /// Stops replica `i` cleanly (SIGTERM: it closes its store, so every flush it answered
    /// is recorded in its region record) and waits for it to exit.
    pub fn stop_replica(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut r) = self.replicas[i].take() {
            r.terminate(Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Starts replica `i` again on its address, in `dir` (its old one, or a fresh one).
    pub fn restart_replica_in(&mut self, i: usize, dir: &Path) -> anyhow::Result<()> {
        self.kill_replica(i);
        std::fs::create_dir_all(dir)?;
        // A killed server's port may linger for a moment; retry the bind briefly.
        let mut last = None;
        for _ in 0..50 {
            let args: Vec<&str> = self.replica_args.iter().map(String::as_str).collect();
            match crate::ReplicaProcess::start_at(dir, self.size, self.addrs[i], &args) {
                Ok(r) => {
                    self.replicas[i] = Some(r);
                    return Ok(());
                }
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    pub fn restart_replica(&mut self, i: usize) -> anyhow::Result<()> {
        let dir = self.dirs[i].clone();
        self.restart_replica_in(i, &dir)
    }

    /// The engine's and every replica's logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        s += &format!(
            "--- engine log ---\n{}\n",
            tail(&crate::read_log(&self.engine_log_path()), 60)
        );
        for d in &self.dirs {
            s += &format!(
                "--- {} ---\n{}\n",
                d.display(),
                tail(&crate::read_log(&d.with_extension("log")), 20)
            );
        }
        s
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// The mode of the replica at `addr` in `info` ("" when not listed).
pub fn mode_in<'a>(info: &'a epb::VolumeInfo, addr: &str) -> &'a str {
    info.replicas
        .iter()
        .find(|r| r.address == addr)
        .map_or("", |r| r.mode.as_str())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The engine first, so it does not see its replicas die one by one.
        let t = Instant::now();
        drop(self.engine.take());
        let engine_took = t.elapsed();
        let t = Instant::now();
        for r in &mut self.replicas {
            drop(r.take());
        }
        let replicas_took = t.elapsed();
        let t = Instant::now();
        let _ = std::fs::remove_dir_all(self.tmp.path());
        let files_took = t.elapsed();
        if engine_took + replicas_took + files_took > Duration::from_secs(1) {
            eprintln!(
                "cleanup was slow: engine {engine_took:?}, replicas {replicas_took:?}, \
                 files {files_took:?}"
            );
        }
    }
}

impl EngineProcess {
    /// Runs `zebu-engine --control ADDR ARGS` (text output) and returns its exit status,
    /// stdout and stderr, whatever the outcome: for tests of the CLI's error reporting.
    pub async fn cli_raw(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        tokio::process::Command::new(bin_path("zebu-engine"))
            .arg("--control")
            .arg(self.control.to_string())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .context("running zebu-engine CLI")
    }

    /// Polls [`EngineProcess::rebuild_status`] every 5 ms until `pred` holds; errors (with
    /// the last status) after `timeout`. Fast polling, so a test can act mid-rebuild.
    pub async fn wait_rebuild(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&epb::RebuildStatusResponse) -> bool,
    ) -> anyhow::Result<epb::RebuildStatusResponse> {
        let mut c = self.client().await?;
        let started = Instant::now();
        loop {
            let s = c
                .rebuild_status(epb::RebuildStatusRequest {})
                .await?
                .into_inner();
            if pred(&s) {
                return Ok(s);
            }
            if started.elapsed() > timeout {
                bail!("rebuild condition not met within {timeout:?}; last status: {s:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A replica's own Info, read over its control API.
pub async fn replica_info(addr: SocketAddr) -> anyhow::Result<rpb::InfoResponse> {
    let mut c = connect(addr).await?;
    Ok(c.info(rpb::InfoRequest {}).await?.into_inner())
}

/// The snapshot names along the head's chain of `info`, oldest first (the head excluded).
pub fn chain_of(info: &rpb::InfoResponse) -> Vec<String> {
    let by_id: BTreeMap<u64, &rpb::LayerInfo> = info.layers.iter().map(|l| (l.id, l)).collect();
    let mut out = Vec::new();
    let mut at = info
        .layers
        .iter()
        .find(|l| l.head)
        .and_then(|h| by_id.get(&h.parent).copied());
    // Bounded by the layer count, so a cycle in a broken answer cannot loop forever.
    while let Some(l) = at {
        if out.len() > info.layers.len() {
            break;
        }
        out.push(l.name.clone());
        at = by_id.get(&l.parent).copied();
    }
    out.reverse();
    out
}

/// Writes every block of `[start, start+len)` once, sequentially in 1 MiB blocks with 8 in
/// flight, and flushes; returns the model of what was written. Fills a volume fast with data
/// that can be verified later.
pub async fn fill(
    dev: &NbdClient,
    start: u64,
    len: u64,
    seed: u64,
) -> anyhow::Result<(Model, RunReport)> {
    let block = 1 << 20;
    let cfg = WorkloadConfig {
        block_size: block,
        range_start: start,
        range_len: Some(len),
        queue_depth: 8,
        pattern: workload::Pattern::Sequential,
        stop: workload::StopAfter::Ops(len / block),
        read_percent: 0,
        flush_every: None,
        seed,
        ..WorkloadConfig::default()
    };
    let mut model = cfg.new_model(dev.size(), workload::RunId::random())?;
    let report = workload::run_workload(dev, &mut model, &cfg).await;
    assert_clean_run(&format!("filling {start}+{len}"), &report);
    Ok((model, report))
}
