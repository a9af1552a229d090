//! The bodies of standby (disaster-recovery) volume operations (`/v1/standby`), checked
//! by the ops layer. Unknown fields are refused, as for every request.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::SizeInput;
use crate::resources::Frontend;

/// `POST /v1/standby`: a new volume that follows the backups of `source` until activated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateStandby {
    /// The new volume's name.
    pub volume: String,
    /// The volume whose backups it follows (as they are in the backup target: the volume
    /// need not exist in this cluster).
    pub source: String,
    /// Defaults to the volume size of the source's newest backup; never smaller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeInput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Frontend>,
}
