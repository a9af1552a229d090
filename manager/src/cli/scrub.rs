//! `zebu volume scrub NAME [--wait] [--stop] [--rate R]`: start, follow or stop the scrub of
//! an attached volume (see `zebu_ops::scrub`), over the REST API.
//!
//! Without `--wait` it starts one and prints where it is; with `--wait` it prints a line as
//! the scrub advances (every 5 % or 10 s) and its findings at the end, as they are recorded
//! in the volume's status. `-o json|yaml` prints the API's answers instead.

use std::time::Duration;

use anyhow::bail;
use zebu_types::requests::{SizeInput, StartScrub};
use zebu_types::resources::{ScrubInfo, ScrubReport, ScrubState};
use zebu_types::size::ByteSize;

use super::args::Output;
use super::render::{self, emit};
use crate::client::Client;

/// How often `--wait` asks.
const POLL: Duration = Duration::from_millis(500);
/// The longest `--wait` stays quiet while the scrub runs.
const QUIET: Duration = Duration::from_secs(10);

/// What the command line asked.
pub struct How {
    pub wait: bool,
    pub stop: bool,
    pub rate: Option<ByteSize>,
    pub timeout: Duration,
}

fn percent(r: &ScrubReport) -> u64 {
    (r.bytes_scanned.saturating_mul(100))
        .checked_div(r.bytes_total)
        .unwrap_or(100)
}

/// One line: where a scrub is and what it found.
pub fn line(volume: &str, r: &ScrubReport) -> String {
    let mut s = format!(
        "scrub of {volume} {}: {}% of {} scanned, {} blocks checked at {}/s (limit {}/s); {} mismatches, {} repaired, {} unrecoverable",
        r.state.as_str(),
        percent(r),
        ByteSize(r.bytes_total),
        r.blocks_checked,
        mib(r.bytes_per_second),
        mib(r.rate_limit),
        r.mismatches,
        r.repaired,
        r.unrecoverable,
    );
    if r.divergent > 0 {
        s.push_str(&format!(
            "; {} divergent, {} set right",
            r.divergent, r.divergent_repaired
        ));
    }
    if r.bytes_unverified > 0 {
        s.push_str(&format!(
            "; {} not checked (checksums still being computed)",
            ByteSize(r.bytes_unverified)
        ));
    }
    match &r.finished {
        Some(f) => s.push_str(&format!("; {} to {f}", r.started)),
        None => s.push_str(&format!("; started {}", r.started)),
    }
    if !r.error.is_empty() {
        s.push_str(&format!("; error: {}", r.error));
    }
    s
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

pub async fn scrub(client: &Client, out: Output, name: &str, how: How) -> anyhow::Result<()> {
    if how.stop {
        let info = client.stop_scrub(name).await?;
        return show(out, name, &info);
    }
    let req = StartScrub {
        rate: how.rate.map(SizeInput::from),
    };
    let started = client.start_scrub(name, &req).await?;
    let Some(mine) = started.current.clone() else {
        bail!("the engine of volume {name} started a scrub but reports none");
    };
    if !how.wait {
        return show(out, name, &started);
    }
    let deadline = tokio::time::Instant::now() + how.timeout;
    let mut shown = (u64::MAX, tokio::time::Instant::now());
    loop {
        let info = client.scrub_status(name).await?;
        let current = info
            .current
            .clone()
            .filter(|c| c.started_unix_ms == mine.started_unix_ms);
        let Some(current) = current else {
            // The engine that ran it is gone (restarted): its last report is all there is.
            show(out, name, &info)?;
            bail!("the engine of volume {name} restarted during the scrub; run it again");
        };
        if current.state != ScrubState::Running {
            // Recorded by the status call that saw it end: print what the volume keeps.
            let last = info
                .last
                .clone()
                .filter(|l| l.started_unix_ms == mine.started_unix_ms)
                .unwrap_or(current);
            show(
                out,
                name,
                &ScrubInfo {
                    current: None,
                    last: Some(last.clone()),
                },
            )?;
            if last.state == ScrubState::Failed {
                bail!("scrub of volume {name} failed: {}", last.error);
            }
            if last.left_damage() {
                bail!(
                    "scrub of volume {name} found damage it could not repair ({} blocks with no good copy, {} divergent blocks without a majority)",
                    last.unrecoverable,
                    last.divergent - last.divergent_repaired
                );
            }
            return Ok(());
        }
        let p = percent(&current);
        let now = tokio::time::Instant::now();
        if out == Output::Table
            && (p >= shown.0.saturating_add(5) || shown.0 == u64::MAX || now - shown.1 >= QUIET)
        {
            emit(&format!("{}\n", line(name, &current)))?;
            shown = (p, now);
        }
        if now >= deadline {
            bail!(
                "scrub of volume {name} still running after {} s ({p}%); it goes on (zebu volume scrub {name} --stop ends it)",
                how.timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

fn show(out: Output, name: &str, info: &ScrubInfo) -> anyhow::Result<()> {
    if out != Output::Table {
        return render::value(out, info);
    }
    let mut text = String::new();
    if let Some(c) = &info.current {
        text.push_str(&line(name, c));
        text.push('\n');
    }
    if let Some(l) = &info.last
        && info.current.as_ref() != Some(l)
    {
        text.push_str("last: ");
        text.push_str(&line(name, l));
        text.push('\n');
    }
    if text.is_empty() {
        text = format!("volume {name} has not been scrubbed\n");
    }
    emit(&text)
}
