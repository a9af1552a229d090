//! `zebu recurring-job ...`: schedules that take snapshots or backups of volumes and keep
//! the newest `--retain` of those they took (the REST routes `/v1/recurringjobs`).
//!
//! ```text
//! zebu recurring-job create nightly --task backup --cron '0 3 * * *' --retain 7 --group db
//! zebu recurring-job create quick --task snapshot --cron '@every 30s' --retain 3 --volume v1
//! zebu recurring-job ls | get NAME | rm NAME
//! ```

use clap::{Subcommand, ValueEnum};
use hyper::Method;
use zebu_types::requests::Items;
use zebu_types::requests::recurring::CreateRecurringJob;
use zebu_types::resources::{RecurringJob, RecurringTask};

use super::args::Output;
use super::render;
use crate::client::{Client, segment};

#[derive(Debug, Subcommand)]
pub enum RecurringCmd {
    /// Create a job (checked first: the schedule, retain, the volumes it applies to).
    Create {
        name: String,
        /// What it takes each time.
        #[arg(long, value_enum)]
        task: Task,
        /// When, in UTC: `0 3 * * *`, six fields with seconds first (`*/10 * * * * *`),
        /// `@hourly`, `@daily`, or `@every 30s` (also 5m, 2h).
        #[arg(long)]
        cron: String,
        /// How many of its snapshots or backups to keep per volume (1-250).
        #[arg(long)]
        retain: u32,
        /// How many volumes it works on at once (default 1).
        #[arg(long)]
        concurrency: Option<u32>,
        /// A volume it applies to, by name (repeatable).
        #[arg(long = "volume", value_name = "VOLUME")]
        volumes: Vec<String>,
        /// Volumes labelled `zebu.io/recurring-job-group.GROUP` (repeatable).
        #[arg(long = "group", value_name = "GROUP")]
        groups: Vec<String>,
        /// Volumes whose labels match this selector (`tier=gold`).
        #[arg(long)]
        selector: Option<String>,
        /// A label given to what it takes, KEY=VALUE (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
    },
    /// List the jobs.
    Ls,
    /// Show one job.
    Get { name: String },
    /// Delete a job (the snapshots and backups it took stay).
    Rm { name: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Task {
    Snapshot,
    Backup,
}

impl From<Task> for RecurringTask {
    fn from(t: Task) -> Self {
        match t {
            Task::Snapshot => RecurringTask::Snapshot,
            Task::Backup => RecurringTask::Backup,
        }
    }
}

pub async fn recurring(client: &Client, out: Output, cmd: RecurringCmd) -> anyhow::Result<()> {
    match cmd {
        RecurringCmd::Create {
            name,
            task,
            cron,
            retain,
            concurrency,
            volumes,
            groups,
            selector,
            labels,
        } => {
            let req = CreateRecurringJob {
                name,
                task: task.into(),
                cron,
                retain,
                concurrency,
                groups,
                volumes,
                selector,
                labels: super::backup::parse_labels(&labels)?,
            };
            let j: RecurringJob = client
                .call(Method::POST, "/v1/recurringjobs", Some(&req))
                .await?;
            render::one(out, &j, job_table)
        }
        RecurringCmd::Ls => {
            let items: Items<RecurringJob> = client
                .call(Method::GET, "/v1/recurringjobs", Client::NO_BODY)
                .await?;
            render::list(out, &items, job_table)
        }
        RecurringCmd::Get { name } => {
            let path = format!("/v1/recurringjobs/{}", segment(&name));
            let j: RecurringJob = client.call(Method::GET, &path, Client::NO_BODY).await?;
            render::one(out, &j, job_table)
        }
        RecurringCmd::Rm { name } => {
            let path = format!("/v1/recurringjobs/{}", segment(&name));
            let v: serde_json::Value = client.call(Method::DELETE, &path, Client::NO_BODY).await?;
            match out {
                Output::Table => render::emit(&format!("recurring job {name} deleted\n")),
                _ => render::value(out, &v),
            }
        }
    }
}

pub fn job_table(items: &[RecurringJob]) -> String {
    let rows = items
        .iter()
        .map(|j| {
            let s = &j.status;
            let mut applies: Vec<String> = j.spec.volumes.clone();
            applies.extend(j.spec.groups.iter().map(|g| format!("group:{g}")));
            applies.extend(j.spec.selector.iter().map(|s| format!("selector:{s}")));
            vec![
                j.metadata.name.clone(),
                j.spec.task.as_str().to_string(),
                j.spec.cron.clone(),
                j.spec.retain.to_string(),
                applies.join(","),
                s.runs.to_string(),
                s.last_run_at.clone().unwrap_or_else(|| "-".into()),
                s.next_run_at.clone().unwrap_or_else(|| "-".into()),
                if s.last_error.is_empty() {
                    "-".to_string()
                } else {
                    s.last_error.clone()
                },
            ]
        })
        .collect();
    render::render(
        &[
            "NAME", "TASK", "SCHEDULE", "RETAIN", "VOLUMES", "RUNS", "LAST", "NEXT", "ERROR",
        ],
        rows,
    )
}
