//! Setting: one named cluster-wide setting; see [`crate::settings`] for the typed view.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::resource;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SettingSpec {
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct SettingStatus {}

resource!(
    /// One named cluster-wide setting; see [`crate::settings`].
    Setting,
    SettingSpec,
    SettingStatus
);
