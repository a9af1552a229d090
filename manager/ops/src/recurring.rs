//! RecurringJobs: schedules that take snapshots or backups of volumes and keep the newest
//! `retain` of those they took (DESIGN §5, §6). The operations check and record; the
//! recurring controller (`zebu-controllers`' `recurring` module) runs each job when due.
//!
//! - **Schedule** ([`Schedule`]): a cron expression in UTC (the `croner` crate: five fields,
//!   or six with seconds first, and `@hourly`-style nicknames), or `@every DURATION`
//!   (`30s`, `5m`, `2h`) for a fixed interval. A schedule that never fires is refused.
//! - **Which volumes** ([`volumes_of`]): those named in `volumes`, those labelled with one
//!   of `groups` (label `zebu.io/recurring-job-group.<g>`), those the `selector` matches.
//! - **What it made** ([`made_by`]): every backup and snapshot a job takes carries the label
//!   [`RECURRING_JOB_LABEL`] naming it (snapshots: their name starts with the job's
//!   prefix, since a snapshot has no labels of its own); retention counts only those, so a
//!   user's own backups are never deleted by a job.
//! - **Delete**: removes the job; what it made stays.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use zebu_types::names::{RECURRING_GROUP_LABEL_PREFIX, RECURRING_JOB_LABEL};
use zebu_types::requests::recurring::CreateRecurringJob;
use zebu_types::resources::{
    Backup, RecurringJob, RecurringJobSpec, RecurringTask, Snapshot, Volume,
};
use zebu_types::store::{LabelSelector, StoreError, TypedStore};
use zebu_types::{Kind, validate_label};

use crate::snapshot::SNAPSHOT_NAME_ANNOTATION;
use crate::volume::check_name;
use crate::{Ops, OpsError, OpsResult};

/// The most snapshots or backups a job may keep per volume.
pub const MAX_RETAIN: u32 = 250;
/// The shortest `@every` interval.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// When a job runs.
#[derive(Debug, Clone)]
pub enum Schedule {
    /// Every so long, counted from the job's creation.
    Every(Duration),
    Cron(Box<croner::Cron>),
}

fn parse_interval(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        _ => return None,
    };
    Some(Duration::from_secs(secs))
}

impl Schedule {
    /// Parses a job's `cron` field; the error says what is wrong in one line.
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let t = text.trim();
        if let Some(rest) = t.strip_prefix("@every") {
            let d = parse_interval(rest).ok_or_else(|| {
                format!("schedule {text:?}: @every takes an interval like 30s, 5m or 2h")
            })?;
            if d < MIN_INTERVAL {
                return Err(format!("schedule {text:?}: the interval is under 1 s"));
            }
            return Ok(Schedule::Every(d));
        }
        let parser = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .build();
        let cron = parser
            .parse(t)
            .map_err(|e| format!("schedule {text:?} is not a cron expression: {e}"))?;
        let s = Schedule::Cron(Box::new(cron));
        let now = SystemTime::now();
        if s.next_after(now, now).is_none() {
            return Err(format!("schedule {text:?} never fires"));
        }
        Ok(s)
    }

    /// The first run strictly after `after`; `origin` anchors `@every` (the job's creation).
    pub fn next_after(&self, after: SystemTime, origin: SystemTime) -> Option<SystemTime> {
        match self {
            Schedule::Every(d) => {
                let since = after.duration_since(origin).unwrap_or_default();
                let n = since.as_nanos() / d.as_nanos().max(1) + 1;
                let nanos = u64::try_from(d.as_nanos().checked_mul(n)?).ok()?;
                origin.checked_add(Duration::from_nanos(nanos))
            }
            Schedule::Cron(c) => {
                let t: DateTime<Utc> = after.into();
                c.find_next_occurrence(&t, false).ok().map(Into::into)
            }
        }
    }
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Schedule::parse(s)
    }
}

/// The volumes a job applies to, by name, group label or selector (no volume twice).
pub fn volumes_of<'a>(spec: &RecurringJobSpec, volumes: &'a [Volume]) -> Vec<&'a Volume> {
    let selector = spec
        .selector
        .as_deref()
        .and_then(|s| s.parse::<LabelSelector>().ok());
    volumes
        .iter()
        .filter(|v| !v.metadata.is_deleting())
        .filter(|v| {
            spec.volumes.contains(&v.metadata.name)
                || spec.groups.iter().any(|g| {
                    v.metadata
                        .labels
                        .contains_key(&format!("{RECURRING_GROUP_LABEL_PREFIX}{g}"))
                })
                || selector
                    .as_ref()
                    .is_some_and(|s| s.matches(&v.metadata.labels))
        })
        .collect()
}

/// The prefix of the names of the snapshots and backups job `job` takes.
pub fn name_prefix(job: &str) -> String {
    format!("{job}-")
}

/// The backups of `volume` that job `job` took, oldest first.
pub fn made_by<'a>(job: &str, volume: &str, backups: &'a [Backup]) -> Vec<&'a Backup> {
    let mut mine: Vec<&Backup> = backups
        .iter()
        .filter(|b| {
            b.spec.volume == volume
                && b.spec.labels.get(RECURRING_JOB_LABEL).map(String::as_str) == Some(job)
        })
        .collect();
    mine.sort_by(|a, b| {
        (&a.metadata.creation_timestamp, &a.metadata.name)
            .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
    });
    mine
}

/// The snapshots of `volume` that job `job` took (their names in the layer chain), oldest
/// first.
pub fn snapshots_made_by(job: &str, volume: &str, records: &[Snapshot]) -> Vec<String> {
    let prefix = name_prefix(job);
    let mut mine: Vec<(&Option<String>, String)> = records
        .iter()
        .filter(|s| s.spec.volume == volume && !s.metadata.is_deleting())
        .filter_map(|s| {
            let n = s.metadata.annotations.get(SNAPSHOT_NAME_ANNOTATION)?;
            (n.starts_with(&prefix) && n[prefix.len()..].starts_with("rj"))
                .then(|| (&s.metadata.creation_timestamp, n.clone()))
        })
        .collect();
    mine.sort();
    mine.into_iter().map(|(_, n)| n).collect()
}

/// A name for what job `job` takes now: `<job>-rj<unix seconds><4 hex>`, a DNS label.
pub fn new_name(job: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    format!("{}rj{secs}{:04x}", name_prefix(job), rand::random::<u16>())
}

impl Ops {
    /// Records a new RecurringJob after checking it.
    pub async fn create_recurring_job(&self, req: CreateRecurringJob) -> OpsResult<RecurringJob> {
        validate_label(&req.name).map_err(|e| OpsError::invalid(format!("recurring job {e}")))?;
        // `<job>-rj<10 digits><4 hex>` must stay a DNS label.
        if req.name.len() > 63 - 17 {
            return Err(OpsError::invalid(format!(
                "recurring job name {:?} is longer than 46 characters (the names of what it takes add 17)",
                req.name
            )));
        }
        Schedule::parse(&req.cron).map_err(OpsError::invalid)?;
        if !(1..=MAX_RETAIN).contains(&req.retain) {
            return Err(OpsError::invalid(format!(
                "retain {} is out of range 1..={MAX_RETAIN}",
                req.retain
            )));
        }
        let concurrency = req.concurrency.unwrap_or(1);
        if !(1..=100).contains(&concurrency) {
            return Err(OpsError::invalid(format!(
                "concurrency {concurrency} is out of range 1..=100"
            )));
        }
        if req.groups.is_empty() && req.volumes.is_empty() && req.selector.is_none() {
            return Err(OpsError::invalid(
                "a recurring job needs volumes: --volume V, --group G or a selector",
            ));
        }
        for g in &req.groups {
            validate_label(g).map_err(|e| OpsError::invalid(format!("group {e}")))?;
        }
        for v in &req.volumes {
            check_name("volume", v)?;
        }
        if let Some(s) = &req.selector {
            s.parse::<LabelSelector>()
                .map_err(|e| OpsError::invalid(format!("selector {s:?}: {e}")))?;
        }
        if req.task == RecurringTask::Backup {
            self.get_backup_target().await?;
        }
        let job = RecurringJob::new(
            req.name.clone(),
            RecurringJobSpec {
                task: req.task,
                cron: req.cron.trim().to_string(),
                retain: req.retain,
                concurrency,
                groups: req.groups,
                volumes: req.volumes,
                selector: req.selector,
                labels: req.labels,
            },
        );
        match self.store.create_as(&job).await {
            Ok(j) => {
                tracing::info!(job = %req.name, task = req.task.as_str(), cron = %j.spec.cron, retain = j.spec.retain, "recurring job created");
                Ok(j)
            }
            Err(e) => Err(e.into()),
        }
    }

    pub async fn list_recurring_jobs(&self) -> OpsResult<Vec<RecurringJob>> {
        let mut all = self.store.list_as::<RecurringJob>().await?;
        all.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(all)
    }

    pub async fn get_recurring_job(&self, name: &str) -> OpsResult<RecurringJob> {
        check_name("recurring job", name)?;
        self.store
            .get_as::<RecurringJob>(name)
            .await?
            .ok_or_else(|| OpsError::not_found(Kind::RecurringJob, name))
    }

    /// Deletes a job; the snapshots and backups it took stay.
    pub async fn delete_recurring_job(&self, name: &str) -> OpsResult<()> {
        check_name("recurring job", name)?;
        match self.store.delete(Kind::RecurringJob, name).await {
            Ok(_) => {
                tracing::info!(job = %name, "recurring job deleted");
                Ok(())
            }
            Err(StoreError::NotFound { .. }) => Err(OpsError::not_found(Kind::RecurringJob, name)),
            Err(e) => Err(e.into()),
        }
    }
}

/// The labels of what a job takes: its own labels and [`RECURRING_JOB_LABEL`].
pub fn labels_for(job: &RecurringJob) -> BTreeMap<String, String> {
    let mut l = job.spec.labels.clone();
    l.insert(RECURRING_JOB_LABEL.to_string(), job.metadata.name.clone());
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SystemTime {
        zebu_types::time::parse_rfc3339(s).expect("time")
    }

    #[test]
    fn schedules_parse_and_fire_when_they_say() {
        let origin = at("2026-12-02T08:00:00Z");
        let every = Schedule::parse("@every 5s").expect("every");
        assert_eq!(
            every.next_after(at("2026-12-02T08:00:07Z"), origin),
            Some(at("2026-12-02T08:00:10Z"))
        );
        assert_eq!(
            every.next_after(origin, origin),
            Some(at("2026-12-02T08:00:05Z"))
        );
        let nightly = Schedule::parse("0 3 * * *").expect("cron");
        assert_eq!(
            nightly.next_after(at("2026-12-02T08:00:00Z"), origin),
            Some(at("2026-12-03T03:00:00Z"))
        );
        let secs = Schedule::parse("*/10 * * * * *").expect("seconds");
        assert_eq!(
            secs.next_after(at("2026-12-02T08:00:01Z"), origin),
            Some(at("2026-12-02T08:00:10Z"))
        );
        for bad in [
            "@every",
            "@every 0s",
            "@every 5x",
            "61 * * * *",
            "not cron",
            "",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Schedule::parse("@hourly").is_ok());
    }

    #[test]
    fn a_new_name_is_a_dns_label_with_the_jobs_prefix() {
        let job = "j".repeat(46);
        let n = new_name(&job);
        assert!(validate_label(&n).is_ok(), "{n}");
        assert!(n.starts_with(&name_prefix(&job)));
    }
}
