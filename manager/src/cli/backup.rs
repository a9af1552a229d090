//! `zebu backup ...`: the backup target, backups of volumes, and restores
//! (`zebu volume create NAME --from-backup BACKUP` lands here too).
//!
//! `zebu backup create VOLUME --wait` follows the backup until it is completed or failed:
//! on a terminal an `indicatif` bar with bytes, rate and ETA; otherwise one plain line per
//! change (`backup NAME: 42% 108 MiB/256 MiB, 35.0 MiB/s, ETA 7s`), then one line with what
//! it read and uploaded. Exit code 1 if the backup failed.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Subcommand;
use hyper::Method;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use zebu_types::requests::Items;
use zebu_types::requests::backup::{
    CreateBackup, GcReportLine, RestoreBackup, SetBackupTarget, VerifyReport,
};
use zebu_types::resources::{Backup, BackupState, BackupTarget, Volume};
use zebu_types::size::ByteSize;

use super::args::{MAX_WAIT_SECS, Output};
use super::render::{self, emit};
use crate::client::{Client, ClientError, segment};

#[derive(Debug, Subcommand)]
pub enum BackupCmd {
    /// The backup target.
    #[command(subcommand)]
    Target(TargetCmd),
    /// Back up a volume (a new snapshot of it, unless --snapshot names one).
    Create {
        volume: String,
        #[arg(long)]
        snapshot: Option<String>,
        /// The backup's name (default: the volume's and the time).
        #[arg(long)]
        name: Option<String>,
        /// A label stored with the backup, KEY=VALUE (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// Follow the backup until it is done.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits.
        #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_SECS))]
        timeout: u64,
    },
    /// List backups, of one volume or all.
    Ls { volume: Option<String> },
    /// Show one backup.
    Get { name: String },
    /// Delete a backup from the target.
    Rm { name: String },
    /// Read every chunk of a backup from the target and check it.
    Verify { name: String },
    /// Run garbage collection over the target now (packs no backup references go after
    /// the target's margin, at a second pass).
    Gc {
        /// Wait for the pass to end and show what it did.
        #[arg(long)]
        wait: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TargetCmd {
    /// Set the target, after checking it answers: s3://BUCKET@REGION/PREFIX or file:///PATH.
    Set {
        url: String,
        /// On one host: a file of AWS_*=value lines; in Kubernetes: a Secret's name.
        #[arg(long)]
        credentials: Option<String>,
        /// Seconds between reads of the target's list of backups.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86400))]
        poll_interval: Option<u64>,
        /// Seconds between GC runs over the target (0: only `zebu backup gc`).
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
        gc_interval: Option<u64>,
        /// GC's safety margin, seconds: no pack younger is condemned, no condemnation
        /// younger is carried out.
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
        gc_margin: Option<u64>,
        /// Seconds a backup's session marker protects its packs without a heartbeat.
        #[arg(long, value_parser = clap::value_parser!(u64).range(2..=86400))]
        session_ttl: Option<u64>,
    },
    /// Show the target.
    Get,
}

async fn list(client: &Client, volume: Option<&str>) -> Result<Items<Backup>, ClientError> {
    client.list_backups(volume).await
}

async fn get(client: &Client, name: &str) -> Result<Backup, ClientError> {
    client.get_backup(name).await
}

/// `POST /v1/backups/{backup}/restore`: the new volume.
pub async fn restore(
    client: &Client,
    backup: &str,
    req: &RestoreBackup,
) -> Result<Volume, ClientError> {
    let path = format!("/v1/backups/{}/restore", segment(backup));
    client.call(Method::POST, &path, Some(req)).await
}

pub(crate) fn parse_labels(labels: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    labels
        .iter()
        .map(|l| match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => bail!("label {l:?} is not KEY=VALUE"),
        })
        .collect()
}

pub async fn backup(client: &Client, out: Output, cmd: BackupCmd) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Target(TargetCmd::Set {
            url,
            credentials,
            poll_interval,
            gc_interval,
            gc_margin,
            session_ttl,
        }) => {
            let req = SetBackupTarget {
                url,
                credential_secret: credentials,
                poll_interval,
                gc_interval,
                gc_margin,
                session_ttl,
            };
            let t: BackupTarget = client
                .call(Method::PUT, "/v1/backuptarget", Some(&req))
                .await?;
            render::one(out, &t, target_table)
        }
        BackupCmd::Target(TargetCmd::Get) => {
            let t: BackupTarget = client.get_backup_target().await?;
            render::one(out, &t, target_table)
        }
        BackupCmd::Create {
            volume,
            snapshot,
            name,
            labels,
            wait,
            timeout,
        } => {
            let req = CreateBackup {
                volume,
                snapshot,
                name,
                labels: parse_labels(&labels)?,
            };
            let b: Backup = client.create_backup(&req).await?;
            if !wait {
                return render::one(out, &b, backup_table);
            }
            let done = follow(client, &b.metadata.name, Duration::from_secs(timeout), out).await?;
            render::one(out, &done, backup_table)?;
            if done.status.state != BackupState::Completed {
                bail!(
                    "backup {} failed: {}",
                    done.metadata.name,
                    done.status.error
                );
            }
            Ok(())
        }
        BackupCmd::Ls { volume } => {
            render::list(out, &list(client, volume.as_deref()).await?, backup_table)
        }
        BackupCmd::Get { name } => render::one(out, &get(client, &name).await?, backup_table),
        BackupCmd::Rm { name } => {
            let v = client.delete_backup(&name).await?;
            render::value(out, &v)
        }
        BackupCmd::Gc { wait } => {
            let path = format!("/v1/backuptarget/gc?wait={wait}");
            let r: GcReportLine = client.call(Method::POST, &path, Client::NO_BODY).await?;
            match out {
                Output::Table if wait => emit(&format!("backup GC: {}\n", r.summary))?,
                Output::Table => emit("backup GC started\n")?,
                _ => render::value(out, &r)?,
            }
            if !r.ok {
                bail!("backup GC failed: {}", r.summary);
            }
            Ok(())
        }
        BackupCmd::Verify { name } => {
            let path = format!("/v1/backups/{}/verify", segment(&name));
            let r: VerifyReport = client.call(Method::POST, &path, Client::NO_BODY).await?;
            match out {
                Output::Table if r.ok => emit(&format!(
                    "backup {}: ok, {} chunks, {} checked\n",
                    r.backup,
                    r.chunks,
                    ByteSize(r.bytes)
                ))?,
                Output::Table => {}
                _ => render::value(out, &r)?,
            }
            if !r.ok {
                bail!("backup {} is damaged: {}", r.backup, r.error);
            }
            Ok(())
        }
    }
}

/// Follows a backup until it is completed or failed, showing its progress on stderr.
async fn follow(
    client: &Client,
    name: &str,
    limit: Duration,
    out: Output,
) -> anyhow::Result<Backup> {
    let tty = std::io::stderr().is_terminal() && out == Output::Table;
    let bar = tty.then(|| {
        let b = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(
                "backup {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}, ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(name.to_string());
        b
    });
    let start = Instant::now();
    let mut last_line = String::new();
    loop {
        let b = get(client, name).await?;
        let s = &b.status;
        let (done, total) = (s.bytes_done, s.bytes_total);
        match &bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(done.min(total));
            }
            None => {
                let secs = start.elapsed().as_secs_f64();
                let rate = if secs > 0.2 { done as f64 / secs } else { 0.0 };
                let eta = if rate > 0.0 && total > done {
                    format!("{:.0}s", (total - done) as f64 / rate)
                } else {
                    "?".to_string()
                };
                let line = format!(
                    "backup {name}: {} {}% {}/{}, {:.1} MiB/s, ETA {eta}\n",
                    s.state,
                    s.progress,
                    ByteSize(done),
                    ByteSize(total),
                    rate / f64::from(1u32 << 20)
                );
                if line != last_line && out == Output::Table {
                    eprint!("{line}");
                    last_line = line;
                }
            }
        }
        if matches!(s.state, BackupState::Completed | BackupState::Error) {
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            return Ok(b);
        }
        if start.elapsed() > limit {
            bail!(
                "backup {name} is still {} after {} s ({}%)",
                s.state,
                limit.as_secs(),
                s.progress
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub fn backup_table(items: &[Backup]) -> String {
    let rows = items
        .iter()
        .map(|b| {
            let s = &b.status;
            vec![
                b.metadata.name.clone(),
                b.spec.volume.clone(),
                b.spec.snapshot.clone(),
                if b.metadata.is_deleting() {
                    "deleting".to_string()
                } else {
                    s.state.to_string()
                },
                format!("{}%", s.progress),
                s.size.to_string(),
                s.read.to_string(),
                s.uploaded.to_string(),
                s.parent.clone().unwrap_or_else(|| "-".into()),
                match (&s.next_retry_at, s.error.is_empty()) {
                    (Some(at), _) => format!(
                        "{} (attempt {}, next at {at})",
                        if s.error.is_empty() {
                            "retrying"
                        } else {
                            s.error.as_str()
                        },
                        s.attempts + 1
                    ),
                    (None, true) => "-".into(),
                    (None, false) => s.error.clone(),
                },
            ]
        })
        .collect();
    render::render(
        &[
            "NAME", "VOLUME", "SNAPSHOT", "STATE", "PROGRESS", "SIZE", "READ", "UPLOADED",
            "PARENT", "ERROR",
        ],
        rows,
    )
}

pub fn target_table(items: &[BackupTarget]) -> String {
    let rows = items
        .iter()
        .map(|t| {
            let avail = t
                .status
                .conditions
                .iter()
                .find(|c| c.type_ == "Available")
                .map_or("unknown".to_string(), |c| {
                    format!("{:?} {}", c.status, c.message).trim().to_string()
                });
            vec![
                t.spec.url.clone(),
                t.status.backups.to_string(),
                t.status
                    .last_synced_at
                    .clone()
                    .unwrap_or_else(|| "-".into()),
                avail,
            ]
        })
        .collect();
    render::render(&["URL", "BACKUPS", "SYNCED", "AVAILABLE"], rows)
}
