//! Running the host's tools (`iscsiadm`, `mount`, `mkfs.*`, `losetup`, `nbdfuse`...), each
//! bounded by a timeout, with what they printed kept for the error.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// A tool that could not be run, failed or hung.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExecError {
    #[error("cannot run {command}: {reason}")]
    Spawn { command: String, reason: String },
    #[error("{command} exited with {code}: {stderr}")]
    Failed {
        command: String,
        code: i32,
        stderr: String,
    },
    #[error("{command} did not finish within {secs} s")]
    Timeout { command: String, secs: u64 },
}

impl ExecError {
    /// The exit status, for tools whose codes mean something (`iscsiadm`, `blkid`).
    pub fn code(&self) -> Option<i32> {
        match self {
            ExecError::Failed { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// How long one tool may take unless told otherwise: mkfs of a large volume is the slowest.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Run `program args...`; its stdout on success.
pub async fn run(program: &str, args: &[&str]) -> Result<String, ExecError> {
    run_for(program, args, DEFAULT_TIMEOUT).await
}

pub async fn run_for(program: &str, args: &[&str], limit: Duration) -> Result<String, ExecError> {
    let command = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    tracing::debug!(%command, "running");
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ExecError::Spawn {
            command: command.clone(),
            reason: e.to_string(),
        })?;
    let out = match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => {
            return Err(ExecError::Spawn {
                command,
                reason: e.to_string(),
            });
        }
        Err(_) => {
            return Err(ExecError::Timeout {
                command,
                secs: limit.as_secs(),
            });
        }
    };
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if stderr.is_empty() {
        stderr = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    Err(ExecError::Failed {
        command,
        code: out.status.code().unwrap_or(-1),
        stderr,
    })
}
