//! Helpers for end-to-end tests: start real zebu processes, wait for them, clean up.
//!
//! # Finding the binaries
//!
//! Cargo does not build another package's binaries for a test (and `CARGO_BIN_EXE_*` only
//! names the test's own package), so [`bin_path`] does it: unless `ZEBU_BIN_DIR` is set, the
//! first call for a binary runs `cargo build -p <name> --bin <name>` (the `cargo` that runs
//! the tests, from `$CARGO`) in the same profile as the test, so the binary is never stale,
//! and returns `target/<profile>/<name>` located from the test executable's own path
//! (`target/<profile>/deps/<test>-<hash>`). With `ZEBU_BIN_DIR=/some/dir` nothing is
//! built and `/some/dir/<name>` is used as is (for prebuilt or installed binaries).
//!
//! # Processes
//!
//! [`ReplicaProcess::start`] runs `zebu-replica serve` on `127.0.0.x:0` and reads the
//! `listening on ADDR` line to learn the port, so there is no race for free ports. Its
//! stderr goes to `<dir>.log` (printed by [`ReplicaProcess::log`]). The child is killed
//! (SIGKILL) and reaped when the handle drops, so a failing test leaks no process.
//! `ZEBU_REPLICA_IO=threads` (or `uring`) passes `--io` to every server the tests start.
//!
//! # Clients
//!
//! [`connect`] gives a gRPC client with the message limits raised; [`DataStream`] opens a
//! data stream, sends requests with ids and matches responses by id in any order.

pub mod engine;
pub mod iscsi;
pub mod model;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};
use zebu_proto::replica::data_request::Op;
use zebu_proto::replica::replica_client::ReplicaClient;
use zebu_proto::replica::{
    DataHello, DataRequest, DataResponse, FlushOp, PROTOCOL_VERSION, ReadOp, UnmapOp, WriteOp,
};

/// Client-side message limit: above the server's, so tests can send oversized messages
/// and receive the largest answers.
pub const CLIENT_MAX_MESSAGE: usize = 64 << 20;

/// How long a server may take to print `listening on`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The path of a zebu binary (`zebu-replica`, `zebu-engine`); see the module docs.
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("ZEBU_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(name) {
        return p.clone();
    }
    let exe = std::env::current_exe().expect("the test executable has a path");
    // target/<profile>/deps/<test>-<hash>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable lives in target/<profile>/deps");
    let profile = profile_dir
        .file_name()
        .and_then(|s| s.to_str())
        .expect("profile directory name")
        .to_string();
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // Every binary is named after its package, except the manager's CLI.
    let package = if name == "zebu" { "zebu-manager" } else { name };
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--quiet", "-p", package, "--bin", name]);
    // The `dev` profile builds into `debug`; every other profile into its own name.
    if profile != "debug" {
        cmd.args(["--profile", &profile]);
    }
    let status = cmd.status().expect("running cargo build");
    assert!(status.success(), "cargo build -p {name} failed: {status}");
    let path = profile_dir.join(name);
    built.insert(name.to_string(), path.clone());
    path
}

/// A loopback address `127.0.0.<n>` (tests use different ones to keep traffic apart).
pub fn loopback(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, n)
}

/// A running `zebu-replica serve`.
pub struct ReplicaProcess {
    child: Child,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    pub size: u64,
    log: PathBuf,
}

impl ReplicaProcess {
    /// Starts `zebu-replica serve --dir DIR --size SIZE` on `ip`, on a free port, and waits
    /// until it listens.
    pub fn start(dir: &Path, size: u64, ip: Ipv4Addr) -> anyhow::Result<ReplicaProcess> {
        Self::start_with(dir, size, ip, &[])
    }

    /// [`ReplicaProcess::start`] with extra arguments (e.g. `--io threads`).
    pub fn start_with(
        dir: &Path,
        size: u64,
        ip: Ipv4Addr,
        extra: &[&str],
    ) -> anyhow::Result<ReplicaProcess> {
        Self::start_at(dir, size, SocketAddr::from((ip, 0)), extra)
    }

    /// [`ReplicaProcess::start_with`] on a given `ip:port`: restarts a replica where its
    /// engine expects it.
    pub fn start_at(
        dir: &Path,
        size: u64,
        listen: SocketAddr,
        extra: &[&str],
    ) -> anyhow::Result<ReplicaProcess> {
        let log = dir.with_extension("log");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("creating {}", log.display()))?;
        // ZEBU_REPLICA_IO=threads|uring runs every test on one I/O back end.
        let io: Vec<String> = match std::env::var("ZEBU_REPLICA_IO") {
            Ok(kind) => vec!["--io".into(), kind],
            Err(_) => Vec::new(),
        };
        let mut child = Command::new(bin_path("zebu-replica"))
            .arg("serve")
            .arg("--dir")
            .arg(dir)
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--size")
            .arg(size.to_string())
            .args(io)
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .context("spawning zebu-replica")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let r = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = tx.send(r);
        });
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("reading the server's stdout: {e}");
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("zebu-replica did not listen within {START_TIMEOUT:?}");
            }
        };
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            let status = child.wait().ok();
            let tail = read_log(&log);
            bail!("zebu-replica did not start ({status:?}); stdout {line:?}; log:\n{tail}");
        };
        let addr: SocketAddr = addr.parse().context("parsing the listen address")?;
        Ok(ReplicaProcess {
            child,
            addr,
            dir: dir.to_path_buf(),
            size,
            log,
        })
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        read_log(&self.log)
    }

    /// `kill -9` and reap.
    pub fn kill9(&mut self) {
        let _ = kill(self.pid(), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// Freezes the process (SIGSTOP): it keeps its sockets but answers nothing.
    pub fn pause(&self) {
        let _ = kill(self.pid(), Signal::SIGSTOP);
    }

    /// Undoes [`ReplicaProcess::pause`].
    pub fn resume(&self) {
        let _ = kill(self.pid(), Signal::SIGCONT);
    }

    /// SIGTERM, then waits up to `timeout` for the exit.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        kill(self.pid(), Signal::SIGTERM).context("SIGTERM")?;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if std::time::Instant::now() > deadline {
                bail!("zebu-replica did not exit within {timeout:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A gRPC client connected to this server.
    pub async fn client(&self) -> anyhow::Result<ReplicaClient<Channel>> {
        connect(self.addr).await
    }
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no log: {e})"))
}

/// Runs `zebu-replica ARGS` to completion (for CLI tests).
pub fn run_replica_cli(args: &[&str]) -> std::process::Output {
    Command::new(bin_path("zebu-replica"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("running zebu-replica")
}

/// A replica client with raised message limits.
pub async fn connect(addr: SocketAddr) -> anyhow::Result<ReplicaClient<Channel>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    Ok(ReplicaClient::new(channel)
        .max_decoding_message_size(CLIENT_MAX_MESSAGE)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE))
}

/// One open data stream: requests go out with fresh ids, responses are matched by id.
pub struct DataStream {
    tx: mpsc::Sender<DataRequest>,
    rx: Streaming<DataResponse>,
    next_id: u64,
    /// Responses received while waiting for another id.
    early: HashMap<u64, DataResponse>,
}

impl DataStream {
    /// Opens a data stream with `generation` and waits for the hello answer, naming the
    /// volume the replica records (as its volume's engine would). A refused hello comes back
    /// as the `Status` that ended the stream.
    pub async fn open(
        client: &mut ReplicaClient<Channel>,
        generation: u64,
    ) -> Result<DataStream, Status> {
        let uuid = client
            .info(zebu_proto::replica::InfoRequest {})
            .await?
            .into_inner()
            .volume_uuid;
        DataStream::open_for(client, generation, &uuid).await
    }

    /// [`DataStream::open`] naming volume `uuid` (empty: none) in the hello.
    pub async fn open_for(
        client: &mut ReplicaClient<Channel>,
        generation: u64,
        uuid: &str,
    ) -> Result<DataStream, Status> {
        let (tx, rx) = mpsc::channel(1024);
        tx.send(DataRequest {
            id: 0,
            op: Some(Op::Hello(DataHello {
                protocol_version: PROTOCOL_VERSION,
                generation,
                volume_uuid: uuid.to_string(),
                adopt_volume: false,
            })),
        })
        .await
        .map_err(|_| Status::internal("request channel closed"))?;
        let mut rx = client.data(ReceiverStream::new(rx)).await?.into_inner();
        match rx.message().await? {
            Some(r) if r.id == 0 && r.status == 0 => {}
            Some(r) => return Err(Status::internal(format!("bad hello answer {r:?}"))),
            None => return Err(Status::internal("stream ended without a hello answer")),
        }
        Ok(DataStream {
            tx,
            rx,
            next_id: 1,
            early: HashMap::new(),
        })
    }

    /// Sends one raw request (the id is chosen here) and returns its id.
    pub async fn send(&mut self, op: Op) -> Result<u64, Status> {
        let id = self.next_id;
        self.next_id += 1;
        self.send_with_id(id, op).await?;
        Ok(id)
    }

    /// Sends a request with a caller-chosen id.
    pub async fn send_with_id(&mut self, id: u64, op: Op) -> Result<(), Status> {
        self.tx
            .send(DataRequest { id, op: Some(op) })
            .await
            .map_err(|_| Status::cancelled("data stream closed"))
    }

    /// The next response, whatever its id (buffered ones first).
    pub async fn recv(&mut self) -> Result<DataResponse, Status> {
        if let Some(&id) = self.early.keys().next() {
            return Ok(self.early.remove(&id).expect("key just seen"));
        }
        self.rx
            .message()
            .await?
            .ok_or_else(|| Status::cancelled("data stream ended"))
    }

    /// The response to `id`, buffering others.
    pub async fn wait(&mut self, id: u64) -> Result<DataResponse, Status> {
        if let Some(r) = self.early.remove(&id) {
            return Ok(r);
        }
        loop {
            let r = self
                .rx
                .message()
                .await?
                .ok_or_else(|| Status::cancelled("data stream ended"))?;
            if r.id == id {
                return Ok(r);
            }
            self.early.insert(r.id, r);
        }
    }

    /// Sends `op` and waits for its answer.
    pub async fn call(&mut self, op: Op) -> Result<DataResponse, Status> {
        let id = self.send(op).await?;
        self.wait(id).await
    }

    /// Reads; a non-OK answer becomes an error carrying its message.
    pub async fn read(&mut self, offset: u64, length: u64) -> anyhow::Result<Bytes> {
        let r = self.call(Op::Read(ReadOp { offset, length })).await?;
        check(&r)?;
        Ok(r.data)
    }

    pub async fn write(&mut self, offset: u64, data: impl Into<Bytes>) -> anyhow::Result<()> {
        let data = data.into();
        let r = self
            .call(Op::Write(WriteOp {
                offset,
                data,
                crc32c: Vec::new(),
                flush_number: None,
            }))
            .await?;
        check(&r)
    }

    pub async fn unmap(&mut self, offset: u64, length: u64) -> anyhow::Result<()> {
        let r = self
            .call(Op::Unmap(UnmapOp {
                offset,
                length,
                zero_fill: false,
            }))
            .await?;
        check(&r)
    }

    /// Flushes; returns the durable flush number.
    pub async fn flush(&mut self) -> anyhow::Result<u64> {
        let r = self.call(Op::Flush(FlushOp { flush_number: 0 })).await?;
        check(&r)?;
        Ok(r.flush_number)
    }

    /// Stops sending; the server answers what is in flight and ends the stream.
    pub fn close_send(self) -> Streaming<DataResponse> {
        self.rx
    }
}

/// An error for a non-OK data response.
pub fn check(r: &DataResponse) -> anyhow::Result<()> {
    if r.status != 0 {
        bail!(
            "request {} failed: status {} ({})",
            r.id,
            r.status,
            r.message
        );
    }
    Ok(())
}

/// A pseudo-random seed for a randomized test, from `ZEBU_TEST_SEED` or the clock;
/// printed so a failure can be replayed.
pub fn test_seed() -> u64 {
    let seed = std::env::var("ZEBU_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("seed {seed} (replay with ZEBU_TEST_SEED={seed})");
    seed
}
