//! kube-rs errors as [`StoreError`]s: the API server's status codes mapped to what the store
//! contract promises (409 → conflict or already-exists, 410 → expired, 403 → forbidden
//! naming the verb and kind, ...).

use zebu_types::store::StoreError;
use zebu_types::{Kind, ResourceVersion};

/// What a request was, for the error it may become.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    pub verb: &'static str,
    pub kind: Kind,
    pub name: &'a str,
    /// The resourceVersion the caller handed in (updates) or watches from.
    pub version: Option<&'a ResourceVersion>,
}

impl<'a> Call<'a> {
    pub fn new(verb: &'static str, kind: Kind, name: &'a str) -> Self {
        Call {
            verb,
            kind,
            name,
            version: None,
        }
    }
    pub fn at(mut self, version: &'a ResourceVersion) -> Self {
        self.version = Some(version);
        self
    }
}

/// The status code of an API answer, if the error is one.
pub(crate) fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Map an error of `call` to the store's error.
pub(crate) fn map(call: Call<'_>, e: kube::Error) -> StoreError {
    let Call {
        verb,
        kind,
        name,
        version,
    } = call;
    let version = version.cloned().unwrap_or_default();
    match e {
        kube::Error::Api(status) => {
            let reason = if status.message.is_empty() {
                status.reason.clone()
            } else {
                status.message.clone()
            };
            match status.code {
                404 => StoreError::NotFound {
                    kind,
                    name: name.to_string(),
                },
                409 if status.reason == "AlreadyExists" => StoreError::AlreadyExists {
                    kind,
                    name: name.to_string(),
                },
                409 => StoreError::Conflict {
                    kind,
                    name: name.to_string(),
                    given: version,
                },
                410 => StoreError::Expired {
                    kind,
                    since: version,
                },
                401 | 403 => StoreError::Forbidden { verb, kind, reason },
                400 | 422 => StoreError::Invalid {
                    kind: Some(kind),
                    reason: format!("{name:?}: {reason}"),
                },
                429 | 500 | 502 | 503 | 504 => StoreError::Unavailable {
                    reason: format!("{verb} {kind}: {} {reason}", status.code),
                },
                _ => StoreError::Backend {
                    context: verb,
                    source: Box::new(kube::Error::Api(status)),
                },
            }
        }
        e @ (kube::Error::HyperError(_) | kube::Error::Service(_)) => StoreError::Unavailable {
            reason: format!("{verb} {kind}: {e}"),
        },
        e => StoreError::Backend {
            context: verb,
            source: Box::new(e),
        },
    }
}
