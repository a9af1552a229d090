//! What an operation can fail with, and how that maps to HTTP statuses (the REST API) and
//! gRPC codes (CSI): the caller's mistakes are 4xx / InvalidArgument, NotFound,
//! AlreadyExists, FailedPrecondition; ours and the cluster's are 5xx / Unavailable, Internal.

use tonic::Code;
use zebu_types::Kind;
use zebu_types::settings::SettingError;
use zebu_types::store::StoreError;

use crate::engine_rpc::EngineRpcError;

/// An operation's failure. Every message names the object it is about.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The request itself is wrong (a bad name, size or count).
    #[error("{message}")]
    InvalidArgument { message: String },
    #[error("{} {name:?} not found", lower(*kind))]
    NotFound { kind: Kind, name: String },
    /// The request is fine but the object's state does not allow it now.
    #[error("{message}")]
    FailedPrecondition { volume: String, message: String },
    /// Others kept changing the object; trying again may work.
    #[error("{message}")]
    Aborted { message: String },
    /// Waited for the cluster to get there, and it did not in time.
    #[error("{message}")]
    DeadlineExceeded { volume: String, message: String },
    #[error("volume {volume:?}: {source}")]
    Engine {
        volume: String,
        #[source]
        source: EngineRpcError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("settings: {0}")]
    Settings(#[from] SettingError),
}

/// `volume`, as messages name kinds in running text.
fn lower(kind: Kind) -> String {
    kind.as_str().to_lowercase()
}

impl OpsError {
    pub fn invalid(message: impl Into<String>) -> Self {
        OpsError::InvalidArgument {
            message: message.into(),
        }
    }

    pub fn precondition(volume: &str, message: impl Into<String>) -> Self {
        OpsError::FailedPrecondition {
            volume: volume.to_string(),
            message: message.into(),
        }
    }

    pub fn not_found(kind: Kind, name: &str) -> Self {
        OpsError::NotFound {
            kind,
            name: name.to_string(),
        }
    }

    /// The gRPC code a CSI plugin answers with.
    pub fn grpc_code(&self) -> Code {
        match self {
            OpsError::InvalidArgument { .. } => Code::InvalidArgument,
            OpsError::NotFound { .. } => Code::NotFound,
            OpsError::FailedPrecondition { .. } => Code::FailedPrecondition,
            OpsError::Aborted { .. } => Code::Aborted,
            OpsError::DeadlineExceeded { .. } => Code::DeadlineExceeded,
            OpsError::Engine { source, .. } => match source {
                EngineRpcError::Call { code, .. } => match code {
                    Code::InvalidArgument
                    | Code::NotFound
                    | Code::AlreadyExists
                    | Code::FailedPrecondition
                    | Code::OutOfRange => *code,
                    _ => Code::Unavailable,
                },
                EngineRpcError::Connect { .. } | EngineRpcError::Timeout { .. } => {
                    Code::Unavailable
                }
            },
            OpsError::Store(e) => match e {
                StoreError::NotFound { .. } => Code::NotFound,
                StoreError::AlreadyExists { .. } => Code::AlreadyExists,
                StoreError::Conflict { .. } => Code::Aborted,
                StoreError::Invalid { .. } | StoreError::InvalidName { .. } => {
                    Code::InvalidArgument
                }
                StoreError::Expired { .. } => Code::OutOfRange,
                StoreError::Forbidden { .. } => Code::PermissionDenied,
                StoreError::Unavailable { .. } => Code::Unavailable,
                StoreError::Backend { .. } | StoreError::Codec { .. } => Code::Internal,
            },
            OpsError::Settings(_) => Code::Internal,
        }
    }

    /// The HTTP status the REST API answers with.
    pub fn http_status(&self) -> u16 {
        match self.grpc_code() {
            Code::InvalidArgument | Code::OutOfRange => {
                if matches!(self, OpsError::Store(StoreError::Expired { .. })) {
                    410
                } else {
                    400
                }
            }
            Code::NotFound => 404,
            Code::AlreadyExists | Code::FailedPrecondition | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::Unavailable => 503,
            Code::DeadlineExceeded => 504,
            _ => 500,
        }
    }
}

pub type OpsResult<T> = Result<T, OpsError>;

#[cfg(test)]
mod tests {
    use super::*;
    use zebu_types::ResourceVersion;

    #[test]
    fn every_error_maps_to_the_status_a_client_expects() {
        let engine = |code| OpsError::Engine {
            volume: "v".into(),
            source: EngineRpcError::Call {
                addr: "127.0.0.1:1".into(),
                call: "SnapshotDelete",
                code,
                message: "no snapshot nope".into(),
            },
        };
        let cases: Vec<(OpsError, u16, Code)> = vec![
            (OpsError::invalid("bad"), 400, Code::InvalidArgument),
            (OpsError::not_found(Kind::Volume, "v"), 404, Code::NotFound),
            (
                OpsError::precondition("v", "attached"),
                409,
                Code::FailedPrecondition,
            ),
            (
                OpsError::Aborted {
                    message: "busy".into(),
                },
                409,
                Code::Aborted,
            ),
            (
                OpsError::DeadlineExceeded {
                    volume: "v".into(),
                    message: "slow".into(),
                },
                504,
                Code::DeadlineExceeded,
            ),
            (
                engine(Code::FailedPrecondition),
                409,
                Code::FailedPrecondition,
            ),
            (engine(Code::NotFound), 404, Code::NotFound),
            (engine(Code::Internal), 503, Code::Unavailable),
            (
                StoreError::AlreadyExists {
                    kind: Kind::Volume,
                    name: "v".into(),
                }
                .into(),
                409,
                Code::AlreadyExists,
            ),
            (
                StoreError::Expired {
                    kind: Kind::Volume,
                    since: ResourceVersion::new("1"),
                }
                .into(),
                410,
                Code::OutOfRange,
            ),
            (
                StoreError::Forbidden {
                    verb: "list",
                    kind: Kind::Volume,
                    reason: "RBAC".into(),
                }
                .into(),
                403,
                Code::PermissionDenied,
            ),
            (
                StoreError::Unavailable {
                    reason: "down".into(),
                }
                .into(),
                503,
                Code::Unavailable,
            ),
        ];
        for (e, http, grpc) in cases {
            assert_eq!((e.http_status(), e.grpc_code()), (http, grpc), "{e}");
        }
        assert_eq!(
            OpsError::not_found(Kind::Volume, "nope").to_string(),
            "volume \"nope\" not found"
        );
    }
}
