//! The instance manager: a small process whose only job is to be the parent of the node's
//! engine and replica processes, so that they do not belong to the manager.
//!
//! Why: in a pod, a container's processes die with the container (the runtime kills its
//! cgroup), so engines started by the manager container would stop on every manager
//! restart or upgrade, cutting every volume's I/O. The instance manager runs in a container
//! of its own that is never upgraded with the manager (`deploy/chart`), and the manager asks
//! it to start processes. Everything else stays with the agent, which needs only the host
//! PID namespace to see the processes: finding and adopting them by command line
//! ([`crate::process::find`]), reading what they announce from their stdout files, stopping
//! them with signals. The instance manager keeps no state: after its own restart (which
//! does stop its processes, like a node reboot) the agent starts them again as it would.
//!
//! Protocol, over a Unix socket (one request per connection, one JSON line each way):
//!
//! ```text
//! -> {"binary":"zebu-engine","args":[...],"stdout":"/data/logs/engine-v.out","log":"/data/logs/engine-v.log"}
//! <- {"pid":1234}            or    {"error":"..."}
//! ```
//!
//! `binary` is a bare name among [`ALLOWED`], looked up in the instance manager's own
//! binary directory: the socket starts data-plane processes, not arbitrary programs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::process::{self, ProcessError};

/// The binaries the instance manager starts.
pub const ALLOWED: [&str; 2] = ["zebu-engine", "zebu-replica"];

/// A request to start one process.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StartRequest {
    pub binary: String,
    pub args: Vec<String>,
    /// stdout goes here (truncated), stderr is appended to `log`.
    pub stdout: PathBuf,
    pub log: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StartReply {
    Pid(u32),
    Error(String),
}

#[derive(Debug, thiserror::Error)]
pub enum InstanceManagerError {
    #[error("instance manager socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Start the process `req` asks for, as a child of this process in its own process group.
fn start(req: &StartRequest) -> Result<u32, String> {
    if !ALLOWED.contains(&req.binary.as_str()) {
        return Err(format!(
            "{:?} is not a binary the instance manager starts ({})",
            req.binary,
            ALLOWED.join(", ")
        ));
    }
    let binary = process::binary(&req.binary).map_err(|e| e.to_string())?;
    let mut child = process::spawn(&req.binary, &binary, &req.args, &req.stdout, &req.log)
        .map_err(|e| e.to_string())?;
    let pid = child.id().ok_or("exited at once")?;
    tracing::info!(binary = req.binary, pid, args = ?req.args, "started");
    let name = req.binary.clone();
    // Reap it whenever it exits, so that it never lingers as a zombie (which the agent
    // would take for gone anyway: a zombie has no command line).
    tokio::spawn(async move {
        match child.wait().await {
            Ok(status) => tracing::info!(binary = name, pid, %status, "exited"),
            Err(e) => tracing::warn!(binary = name, pid, "waiting for it: {e}"),
        }
    });
    Ok(pid)
}

async fn handle(stream: UnixStream) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    // One request line; a client that sends more than this is not ours.
    let n = BufReader::new(read.take(64 * 1024))
        .read_line(&mut line)
        .await?;
    if n == 0 {
        return Ok(());
    }
    let reply = match serde_json::from_str::<StartRequest>(&line) {
        Ok(req) => match start(&req) {
            Ok(pid) => StartReply::Pid(pid),
            Err(e) => {
                tracing::warn!(binary = req.binary, "cannot start: {e}");
                StartReply::Error(e)
            }
        },
        Err(e) => StartReply::Error(format!("bad request: {e}")),
    };
    let mut out = serde_json::to_vec(&reply).map_err(std::io::Error::other)?;
    out.push(b'\n');
    write.write_all(&out).await
}

/// Serve start requests on `socket` until the process ends. A socket file left by an
/// earlier run is replaced.
pub async fn serve(socket: &Path) -> Result<(), InstanceManagerError> {
    let err = |source| InstanceManagerError::Socket {
        path: socket.to_path_buf(),
        source,
    };
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = UnixListener::bind(socket).map_err(err)?;
    tracing::info!(socket = %socket.display(), "instance manager serving");
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(async move {
                    if let Err(e) = handle(stream).await {
                        tracing::warn!("instance manager request: {e}");
                    }
                });
            }
            // Out of file descriptors and the like: wait and go on, never exit (that would
            // stop nothing, but no new process could start).
            Err(e) => {
                tracing::warn!("accepting a request: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }
}

/// Ask the instance manager at `socket` to start `binary` (a name in [`ALLOWED`]).
pub async fn request_start(
    socket: &Path,
    what: &str,
    req: &StartRequest,
) -> Result<u32, ProcessError> {
    let fail = |why: String| ProcessError::InstanceManager {
        what: what.to_string(),
        socket: socket.to_path_buf(),
        why,
    };
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| fail(format!("connecting: {e}")))?;
    let (read, mut write) = stream.into_split();
    let mut out = serde_json::to_vec(req).map_err(|e| fail(e.to_string()))?;
    out.push(b'\n');
    write
        .write_all(&out)
        .await
        .map_err(|e| fail(format!("sending: {e}")))?;
    let mut line = String::new();
    BufReader::new(read)
        .read_line(&mut line)
        .await
        .map_err(|e| fail(format!("reading the answer: {e}")))?;
    match serde_json::from_str::<StartReply>(&line) {
        Ok(StartReply::Pid(pid)) => Ok(pid),
        Ok(StartReply::Error(e)) => Err(fail(e)),
        Err(e) => Err(fail(format!("bad answer {line:?}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn it_starts_only_data_plane_binaries_and_answers_bad_requests_plainly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("im.sock");
        let server = tokio::spawn({
            let socket = socket.clone();
            async move { serve(&socket).await }
        });
        for _ in 0..100 {
            if socket.exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let req = StartRequest {
            binary: "sh".into(),
            args: vec!["-c".into(), "touch /tmp/should-not-exist".into()],
            stdout: dir.path().join("out"),
            log: dir.path().join("log"),
        };
        let e = request_start(&socket, "a shell", &req)
            .await
            .expect_err("refused");
        assert!(
            e.to_string()
                .contains("not a binary the instance manager starts"),
            "{e}"
        );
        assert!(
            !dir.path().join("out").exists(),
            "it opened files for a refused binary"
        );

        let mut raw = UnixStream::connect(&socket).await.expect("connect");
        raw.write_all(b"{not json\n").await.expect("write");
        let mut answer = String::new();
        BufReader::new(raw)
            .read_line(&mut answer)
            .await
            .expect("read");
        let reply: StartReply = serde_json::from_str(&answer).expect("a reply");
        assert!(
            matches!(&reply, StartReply::Error(e) if e.starts_with("bad request")),
            "{reply:?}"
        );
        server.abort();
    }
}
