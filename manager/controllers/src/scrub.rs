//! The scrub schedule: scrub every attached, healthy volume once per `scrub-interval` (a
//! cluster setting, seconds; 0 turns it off), and record every scrub that finishes in its
//! volume's status, whoever started it.
//!
//! [`due`] is the pure part: a volume is due when its last recorded scrub *started* an
//! interval ago (a failed or stopped one counts, so a scrub that keeps failing is not
//! restarted in a loop), or, never scrubbed, when it was created an interval ago. [`round`]
//! is the rest, and needs the engines: every few seconds (not every controller pass) it asks
//! the engine of each volume this manager drives for its scrub status, records finished
//! reports (`zebu_ops::Ops::record_scrub`), and, if no scrub is running on any of them,
//! starts one on the most overdue healthy volume: never two at once from one manager, so a
//! scrub's reads do not pile up on shared disks. An engine older than control protocol 2
//! has no scrub: it is skipped, with the reason logged once.
//!
//! Rounds run in a task of their own, so a slow engine (each call is bounded by
//! `engine_rpc`'s timeout) never holds up the controllers' pass; a round still running
//! when the next is due is not doubled.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use zebu_ops::{Ops, engine_rpc, scrub::report_of};
use zebu_proto::engine as pb;
use zebu_types::Store;
use zebu_types::resources::{
    EngineState, EngineVolumeState, Robustness, ScrubState, Volume, VolumeState,
};
use zebu_types::time::parse_rfc3339;

use crate::World;

/// How often a round asks the engines.
const ROUND: Duration = Duration::from_secs(5);

/// How overdue `v` is for a scheduled scrub at `now`, `None` when it is not due (or the
/// schedule is off: `interval_secs` 0).
pub fn due(interval_secs: u64, v: &Volume, now: SystemTime) -> Option<Duration> {
    if interval_secs == 0 {
        return None;
    }
    let since = match &v.status.last_scrub {
        // The milliseconds, not the RFC 3339 text: that is whole seconds, and counting from
        // the truncated second started the next scrub up to a second before the interval.
        Some(last) if last.started_unix_ms > 0 => u64::try_from(last.started_unix_ms)
            .ok()
            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms)),
        Some(last) => parse_rfc3339(&last.started),
        None => v
            .metadata
            .creation_timestamp
            .as_deref()
            .and_then(parse_rfc3339),
    };
    // No time to go by (a record written by hand): due now.
    let since = since.unwrap_or(SystemTime::UNIX_EPOCH);
    let next = since + Duration::from_secs(interval_secs);
    now.duration_since(next).ok()
}

/// A volume a round looks at: attached with a running engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub volume: String,
    pub control: String,
    /// Overdue and healthy as the store has it (the engine is asked again before a start).
    pub overdue: Option<Duration>,
}

/// The volumes of `driven` a round asks about, from the world alone.
pub fn candidates(w: &World, driven: &[Volume]) -> Vec<Candidate> {
    driven
        .iter()
        .filter(|v| !v.metadata.is_deleting() && v.status.state == VolumeState::Attached)
        .filter_map(|v| {
            let name = v.metadata.name.as_str();
            let e = w.engines_of(name).find(|e| {
                !e.metadata.is_deleting()
                    && e.status.state == EngineState::Running
                    && e.status.control_address.is_some()
            })?;
            let healthy = v.status.robustness == Robustness::Healthy
                && e.status.volume_state == Some(EngineVolumeState::Healthy);
            Some(Candidate {
                volume: name.to_string(),
                control: e.status.control_address.clone()?,
                overdue: healthy
                    .then(|| due(w.settings.scrub_interval, v, w.now))
                    .flatten(),
            })
        })
        .collect()
}

/// What the controllers keep between rounds.
pub struct ScrubScheduler {
    ops: Ops,
    next: Instant,
    round: Option<tokio::task::JoinHandle<()>>,
    /// Volumes whose engine cannot scrub, logged once each.
    refused: Arc<Mutex<BTreeSet<String>>>,
}

impl ScrubScheduler {
    pub fn new(store: Arc<dyn Store>) -> Self {
        ScrubScheduler {
            ops: Ops::new(store),
            next: Instant::now(),
            round: None,
            refused: Arc::default(),
        }
    }

    /// Called from every controller pass with the volumes this manager drives; starts a round
    /// when one is due and none is running.
    pub fn pass(&mut self, w: &World, driven: &[Volume]) {
        if Instant::now() < self.next || self.round.as_ref().is_some_and(|r| !r.is_finished()) {
            return;
        }
        self.next = Instant::now() + ROUND;
        let found = candidates(w, driven);
        if found.is_empty() {
            return;
        }
        let ops = self.ops.clone();
        let refused = self.refused.clone();
        self.round = Some(tokio::spawn(round(ops, found, refused)));
    }
}

/// Ask each candidate's engine, record what finished, start one scrub if none runs.
async fn round(ops: Ops, found: Vec<Candidate>, refused: Arc<Mutex<BTreeSet<String>>>) {
    let mut running = false;
    let mut ready = Vec::new();
    for c in found {
        let volume = c.volume.as_str();
        let info = match engine_rpc::info(&c.control).await {
            Ok(i) => i,
            Err(e) => {
                tracing::debug!(volume, "scrub schedule: {e}");
                continue;
            }
        };
        if info.protocol_version < engine_rpc::SCRUB_PROTOCOL_VERSION {
            if refused
                .lock()
                .expect("invariant: refused lock")
                .insert(c.volume.clone())
            {
                tracing::warn!(
                    volume,
                    protocol_version = info.protocol_version,
                    "scrub schedule: skipping the volume: its engine speaks control protocol {} and has no scrub (protocol {} has)",
                    info.protocol_version,
                    engine_rpc::SCRUB_PROTOCOL_VERSION
                );
            }
            continue;
        }
        let status = match engine_rpc::scrub_status(&c.control).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(volume, "scrub schedule: {e}");
                continue;
            }
        };
        let current = status.current.as_ref().and_then(report_of);
        let finished = current
            .clone()
            .filter(|r| r.state != ScrubState::Running)
            .or_else(|| status.last_done.as_ref().and_then(report_of));
        if let Some(f) = finished
            && let Err(e) = ops.record_scrub(volume, &f).await
        {
            tracing::warn!(volume, "scrub schedule: recording the last scrub: {e}");
        }
        if current.is_some_and(|r| r.state == ScrubState::Running) {
            running = true;
        } else if let Some(overdue) = c.overdue
            && crate::engine_status::volume_state_of(&info) == Some(EngineVolumeState::Healthy)
        {
            ready.push((overdue, c));
        }
    }
    if running {
        return;
    }
    let Some((overdue, c)) = ready.into_iter().max_by_key(|(o, _)| *o) else {
        return;
    };
    match engine_rpc::scrub_start(&c.control, 0).await {
        Ok(info) => tracing::info!(
            volume = %c.volume,
            overdue_secs = overdue.as_secs(),
            started_unix_ms = info.current.as_ref().map_or(0, |r: &pb::ScrubReport| r.started_unix_ms),
            "scheduled scrub started"
        ),
        Err(e) => tracing::warn!(volume = %c.volume, "scheduled scrub: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zebu_types::resources::{ScrubReport, VolumeSpec};
    use zebu_types::size::ByteSize;
    use zebu_types::time::format_rfc3339;

    fn volume(created: SystemTime, last_started: Option<SystemTime>) -> Volume {
        let mut v = Volume::new(
            "v",
            VolumeSpec {
                size: ByteSize(1 << 30),
                number_of_replicas: 3,
                frontend: Default::default(),
                node_selector: vec![],
                disk_selector: vec![],
                data_locality: Default::default(),
                stale_replica_timeout: 60,
                node_id: None,
                disable_frontend: false,
            },
        );
        v.metadata.creation_timestamp = Some(format_rfc3339(created));
        v.status.last_scrub = last_started.map(|t| {
            Box::new(ScrubReport {
                state: ScrubState::Failed,
                started: format_rfc3339(t),
                finished: None,
                started_unix_ms: 0,
                bytes_scanned: 0,
                bytes_total: 0,
                blocks_checked: 0,
                bytes_per_second: 0,
                rate_limit: 0,
                mismatches: 0,
                repaired: 0,
                unrecoverable: 0,
                divergent: 0,
                divergent_repaired: 0,
                bytes_unverified: 0,
                replicas: vec![],
                error: "replica went away".into(),
            })
        });
        v
    }

    #[test]
    fn a_volume_is_due_an_interval_after_its_last_scrub_started_or_its_creation() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let s = Duration::from_secs;
        // Never scrubbed: counted from creation.
        assert_eq!(due(100, &volume(t0, None), t0 + s(99)), None);
        assert_eq!(due(100, &volume(t0, None), t0 + s(100)), Some(s(0)));
        assert_eq!(due(100, &volume(t0, None), t0 + s(130)), Some(s(30)));
        // Scrubbed (even a failed scrub): counted from its start.
        let v = volume(t0, Some(t0 + s(500)));
        assert_eq!(due(100, &v, t0 + s(550)), None);
        assert_eq!(due(100, &v, t0 + s(610)), Some(s(10)));
        // The milliseconds of the start count, not its whole-second text.
        let mut v = volume(t0, Some(t0 + s(500)));
        if let Some(last) = v.status.last_scrub.as_mut() {
            last.started_unix_ms = 1_700_000_500_900;
        }
        let ms = Duration::from_millis;
        assert_eq!(due(100, &v, t0 + s(600) + ms(899)), None);
        assert_eq!(due(100, &v, t0 + s(600) + ms(900)), Some(s(0)));
        // Off.
        assert_eq!(due(0, &volume(t0, None), t0 + s(1_000_000)), None);
    }
}
