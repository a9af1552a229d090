//! The body of `POST /v1/recurringjobs`, checked by the ops layer. Unknown fields are
//! refused, as for every request.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::resources::RecurringTask;

/// `POST /v1/recurringjobs`: a schedule of snapshots or backups of some volumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateRecurringJob {
    pub name: String,
    pub task: RecurringTask,
    /// See `RecurringJobSpec::cron`.
    pub cron: String,
    /// How many of its snapshots or backups to keep per volume (1..=250).
    pub retain: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}
