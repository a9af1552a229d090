//! Scrub operations: start, stop and watch the scrub of an attached volume, and keep the
//! last finished one in the volume's status.
//!
//! A scrub runs inside the volume's engine (engine control protocol 2 and later): every
//! allocated 4 KiB block of every replica is checked against its checksum, the replicas are
//! compared, and damage is repaired from a good copy, at a limited rate. The engine keeps its
//! report only while it runs, so every call here that sees a finished report copies it into
//! [`VolumeStatus::last_scrub`](zebu_types::resources::VolumeStatus) ([`Ops::record_scrub`]),
//! as the scrub schedule controller does on its rounds: the report outlives the engine.
//!
//! An engine older than protocol 2 has no scrub: starting one is refused with that reason.

use std::time::{Duration, UNIX_EPOCH};

use zebu_proto::engine as pb;
use zebu_types::requests::StartScrub;
use zebu_types::resources::{ScrubInfo, ScrubReport, ScrubState, Volume};
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::time::format_rfc3339;

use crate::{Ops, OpsError, OpsResult, engine_rpc};

/// Data blocks are 4 KiB on every replica.
const BLOCK: u64 = 4096;
/// Tries at a status write that lost a race with the volume controller's own.
const RECORD_TRIES: usize = 5;

fn rfc3339_ms(ms: i64) -> String {
    let ms = u64::try_from(ms).unwrap_or(0);
    format_rfc3339(UNIX_EPOCH + Duration::from_millis(ms))
}

/// An engine's scrub report as the manager keeps it; `None` for "no scrub since the engine
/// started" (and for a state this manager does not know, which it cannot describe).
pub fn report_of(r: &pb::ScrubReport) -> Option<ScrubReport> {
    let state = match pb::ScrubState::try_from(r.state).ok()? {
        pb::ScrubState::Unspecified => return None,
        pb::ScrubState::Running => ScrubState::Running,
        pb::ScrubState::Done => ScrubState::Done,
        pb::ScrubState::Stopped => ScrubState::Stopped,
        pb::ScrubState::Failed => ScrubState::Failed,
    };
    Some(ScrubReport {
        state,
        started: rfc3339_ms(r.started_unix_ms),
        finished: (r.finished_unix_ms > 0).then(|| rfc3339_ms(r.finished_unix_ms)),
        started_unix_ms: r.started_unix_ms,
        bytes_scanned: r.bytes_scanned,
        bytes_total: r.bytes_total,
        blocks_checked: r.bytes_verified / BLOCK,
        bytes_per_second: r.bytes_per_second,
        rate_limit: r.rate_limit,
        mismatches: r.corrupt_found,
        repaired: r.repaired,
        unrecoverable: r.unrecoverable,
        divergent: r.divergent,
        divergent_repaired: r.divergent_repaired,
        bytes_unverified: r.bytes_unverified,
        replicas: r.replicas.clone(),
        error: r.error.clone(),
    })
}

/// The engine's current scrub and the finished one to record, from its `ScrubStatus`.
fn reports_of(info: &pb::ScrubInfo) -> (Option<ScrubReport>, Option<ScrubReport>) {
    let current = info.current.as_ref().and_then(report_of);
    // The current one when it has finished (stopped and failed ones count: their findings
    // are real), else the last that ran to its end.
    let finished = current
        .clone()
        .filter(|c| c.state != ScrubState::Running)
        .or_else(|| info.last_done.as_ref().and_then(report_of));
    (current, finished)
}

/// Whether `new` should replace `old` as a volume's last scrub: it is another, later scrub.
fn newer(old: Option<&ScrubReport>, new: &ScrubReport) -> bool {
    match old {
        None => true,
        Some(o) => new.started_unix_ms > o.started_unix_ms,
    }
}

impl Ops {
    /// The control address of the running engine of an attached `volume`, if it can scrub.
    async fn scrub_engine(&self, volume: &str) -> OpsResult<String> {
        let v = self.get_volume(volume).await?;
        if v.metadata.is_deleting() {
            return Err(OpsError::precondition(
                volume,
                format!("volume {volume:?} is being deleted"),
            ));
        }
        let control = self
            .running_engine(volume)
            .await?
            .and_then(|e| e.status.control_address)
            .ok_or_else(|| {
                OpsError::precondition(
                    volume,
                    format!(
                        "volume {volume:?} is not attached: its engine runs the scrub (zebu volume attach {volume})"
                    ),
                )
            })?;
        let info = engine_rpc::info(&control)
            .await
            .map_err(Self::scrub_engine_err(volume))?;
        if info.protocol_version < engine_rpc::SCRUB_PROTOCOL_VERSION {
            return Err(OpsError::precondition(
                volume,
                format!(
                    "the engine of volume {volume:?} speaks control protocol {} and cannot scrub (protocol {} can): upgrade it, then detach and attach the volume",
                    info.protocol_version,
                    engine_rpc::SCRUB_PROTOCOL_VERSION
                ),
            ));
        }
        Ok(control)
    }

    fn scrub_engine_err(volume: &str) -> impl FnOnce(engine_rpc::EngineRpcError) -> OpsError {
        let volume = volume.to_string();
        move |source| OpsError::Engine { volume, source }
    }

    /// What the engine said, with its finished report recorded and the recorded one beside it.
    async fn scrub_info(&self, volume: &str, info: &pb::ScrubInfo) -> OpsResult<ScrubInfo> {
        let (current, finished) = reports_of(info);
        let last = match finished {
            Some(f) => self.record_scrub(volume, &f).await?,
            None => self.get_volume(volume).await?.status.last_scrub.map(|b| *b),
        };
        Ok(ScrubInfo { current, last })
    }

    /// Start a scrub of attached `volume`; refused while one runs.
    pub async fn start_scrub(&self, volume: &str, req: StartScrub) -> OpsResult<ScrubInfo> {
        let rate = match &req.rate {
            Some(r) => r
                .resolve()
                .map_err(|e| OpsError::invalid(format!("scrub rate: {e}")))?
                .bytes(),
            None => 0,
        };
        if req.rate.is_some() && rate < BLOCK {
            return Err(OpsError::invalid(format!(
                "scrub rate {rate} bytes per second is below one 4 KiB block per second"
            )));
        }
        let control = self.scrub_engine(volume).await?;
        let info = engine_rpc::scrub_start(&control, rate)
            .await
            .map_err(Self::scrub_engine_err(volume))?;
        tracing::info!(volume, rate, "scrub started");
        self.scrub_info(volume, &info).await
    }

    /// Stop the running scrub of `volume` (its report says how far it got).
    pub async fn stop_scrub(&self, volume: &str) -> OpsResult<ScrubInfo> {
        let control = self.scrub_engine(volume).await?;
        let info = engine_rpc::scrub_stop(&control)
            .await
            .map_err(Self::scrub_engine_err(volume))?;
        tracing::info!(volume, "scrub stop asked");
        self.scrub_info(volume, &info).await
    }

    /// The running engine's scrub and the volume's last recorded one; for a volume that is not
    /// attached, the recorded one alone.
    pub async fn scrub_status(&self, volume: &str) -> OpsResult<ScrubInfo> {
        let v = self.get_volume(volume).await?;
        let Some(control) = self
            .running_engine(volume)
            .await?
            .and_then(|e| e.status.control_address)
        else {
            return Ok(ScrubInfo {
                current: None,
                last: v.status.last_scrub.map(|b| *b),
            });
        };
        let info = engine_rpc::scrub_status(&control)
            .await
            .map_err(Self::scrub_engine_err(volume))?;
        self.scrub_info(volume, &info).await
    }

    /// Record `report` as `volume`'s last scrub unless a later one is recorded already;
    /// answers what is recorded afterwards.
    pub async fn record_scrub(
        &self,
        volume: &str,
        report: &ScrubReport,
    ) -> OpsResult<Option<ScrubReport>> {
        for _ in 0..RECORD_TRIES {
            let v: Volume = self.get_volume(volume).await?;
            if !newer(v.status.last_scrub.as_deref(), report) {
                return Ok(v.status.last_scrub.map(|b| *b));
            }
            let mut next = v;
            next.status.last_scrub = Some(Box::new(report.clone()));
            match self.store().update_status_as(&next).await {
                Ok(_) => {
                    tracing::info!(
                        volume,
                        state = report.state.as_str(),
                        blocks_checked = report.blocks_checked,
                        mismatches = report.mismatches,
                        repaired = report.repaired,
                        unrecoverable = report.unrecoverable,
                        bytes_per_second = report.bytes_per_second,
                        "scrub recorded"
                    );
                    return Ok(Some(report.clone()));
                }
                // The volume controller wrote its status meanwhile: read it again.
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(OpsError::aborted(format!(
            "volume {volume:?}: its status kept changing while the scrub report was recorded; try again"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pb_report(state: pb::ScrubState, started: i64) -> pb::ScrubReport {
        pb::ScrubReport {
            state: state as i32,
            started_unix_ms: started,
            finished_unix_ms: if state == pb::ScrubState::Running {
                0
            } else {
                started + 1500
            },
            bytes_verified: 10 * BLOCK,
            corrupt_found: 3,
            repaired: 3,
            ..Default::default()
        }
    }

    #[test]
    fn a_finished_current_scrub_is_recorded_and_a_running_one_falls_back_to_the_last_done() {
        let done = pb_report(pb::ScrubState::Done, 1_000);
        let info = pb::ScrubInfo {
            current: Some(pb_report(pb::ScrubState::Running, 5_000)),
            last_done: Some(done.clone()),
        };
        let (current, finished) = reports_of(&info);
        assert_eq!(current.expect("running").state, ScrubState::Running);
        let f = finished.expect("last done");
        assert_eq!(f.started_unix_ms, 1_000);
        assert_eq!(f.blocks_checked, 10);
        assert_eq!((f.mismatches, f.repaired), (3, 3));
        assert_eq!(f.finished.as_deref(), Some("1970-01-01T00:00:02Z"));

        let stopped = pb::ScrubInfo {
            current: Some(pb_report(pb::ScrubState::Stopped, 7_000)),
            last_done: Some(done),
        };
        let (_, finished) = reports_of(&stopped);
        assert_eq!(finished.expect("stopped").state, ScrubState::Stopped);

        let never = pb::ScrubInfo {
            current: Some(pb::ScrubReport::default()),
            last_done: None,
        };
        assert_eq!(reports_of(&never), (None, None));
    }

    #[test]
    fn only_a_later_scrub_replaces_the_recorded_one() {
        let r = |ms| report_of(&pb_report(pb::ScrubState::Done, ms)).expect("done");
        assert!(newer(None, &r(1)));
        assert!(newer(Some(&r(1)), &r(2)));
        assert!(!newer(Some(&r(2)), &r(2)));
        assert!(!newer(Some(&r(3)), &r(2)));
    }
}
