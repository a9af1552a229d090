//! The store: where resources live, and how controllers learn that they changed.
//!
//! The [`Store`] trait is deliberately small and Kubernetes-shaped, so the same
//! controllers run against the embedded one-file store on a single host and
//! against the Kubernetes API server in a cluster:
//!
//! - `get` / `list` read current objects; `list` also returns the store's
//!   resourceVersion at the time of the read, to start a `watch` from.
//! - `create` assigns `uid`, `creationTimestamp` and `resourceVersion`.
//! - `update` replaces metadata and spec (never status) and `update_status`
//!   replaces status (never spec); both fail with [`StoreError::Conflict`]
//!   unless the caller's `resourceVersion` is the stored one. That is the
//!   optimistic concurrency every controller relies on: read, decide, write
//!   back; on conflict, read again.
//! - `delete` removes the object, or, while `finalizers` remain, only stamps
//!   `deletionTimestamp`; the object goes away with the update that removes
//!   the last finalizer. That lets a node agent stop a replica process and
//!   remove its files before the Replica record disappears.
//! - `watch` yields every change after a resourceVersion, in resourceVersion
//!   order, without gaps; if the store can no longer tell what happened since
//!   then it yields [`StoreError::Expired`] once and ends, and the watcher
//!   re-lists (the Kubernetes "410 Gone" contract).
//!
//! The trait works on JSON objects keyed by kind and name (what both backends
//! store natively); [`TypedStore`] adds typed helpers over any [`Resource`].

pub mod embedded;

use std::future::Future;
use std::pin::Pin;

use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::resources::{Kind, Resource};

pub use embedded::EmbeddedStore;

/// Errors from a store. Each names the object it is about.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{kind} {name:?} not found")]
    NotFound { kind: Kind, name: String },
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: Kind, name: String },
    #[error(
        "conflict updating {kind} {name:?}: stored resourceVersion is {stored}, update was based on {given}"
    )]
    Conflict {
        kind: Kind,
        name: String,
        stored: u64,
        given: u64,
    },
    #[error("invalid object: {0}")]
    Invalid(String),
    #[error(
        "watch from resourceVersion {since} expired: changes up to {pruned_through} are no longer kept; list again"
    )]
    Expired { since: u64, pruned_through: u64 },
    #[error("store database error while {context}: {source}")]
    Db {
        context: &'static str,
        #[source]
        source: Box<redb::Error>,
    },
    #[error("cannot encode or decode {what}: {source}")]
    Codec {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("store task failed: {0}")]
    Task(String),
}

impl StoreError {
    pub(crate) fn db(context: &'static str) -> impl FnOnce(redb::Error) -> StoreError {
        move |source| StoreError::Db {
            context,
            source: Box::new(source),
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change. `object` is the object after the change (for `Deleted`, the
/// last stored state).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchEvent {
    #[serde(rename = "type")]
    pub type_: EventType,
    pub kind: Kind,
    pub name: String,
    pub resource_version: u64,
    pub object: Value,
}

pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent>> + Send>>;

/// The store contract; see the module docs.
pub trait Store: Send + Sync + 'static {
    fn get(&self, kind: Kind, name: &str) -> impl Future<Output = Result<Option<Value>>> + Send;
    /// All objects of a kind, sorted by name, and the resourceVersion the
    /// list reflects.
    fn list(&self, kind: Kind) -> impl Future<Output = Result<(Vec<Value>, u64)>> + Send;
    /// Changes with resourceVersion > `since`, of one kind or of all.
    fn watch(
        &self,
        kind: Option<Kind>,
        since: u64,
    ) -> impl Future<Output = Result<WatchStream>> + Send;
    fn create(&self, object: Value) -> impl Future<Output = Result<Value>> + Send;
    fn update(&self, object: Value) -> impl Future<Output = Result<Value>> + Send;
    fn update_status(&self, object: Value) -> impl Future<Output = Result<Value>> + Send;
    /// `Some(object)` when finalizers keep it (now with `deletionTimestamp`),
    /// `None` when it is gone.
    fn delete(&self, kind: Kind, name: &str) -> impl Future<Output = Result<Option<Value>>> + Send;
}

fn to_value<R: Resource>(r: &R) -> Result<Value> {
    serde_json::to_value(r).map_err(|source| StoreError::Codec {
        what: format!("{} {:?}", R::KIND, r.name()),
        source,
    })
}

pub(crate) fn from_value<R: Resource>(v: Value) -> Result<R> {
    let what = format!(
        "{} {:?}",
        R::KIND,
        v.pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("?")
    );
    serde_json::from_value(v).map_err(|source| StoreError::Codec { what, source })
}

/// Typed helpers over any [`Store`].
pub trait TypedStore: Store {
    fn get_as<R: Resource>(&self, name: &str) -> impl Future<Output = Result<Option<R>>> + Send {
        async move { self.get(R::KIND, name).await?.map(from_value).transpose() }
    }
    fn list_as<R: Resource>(&self) -> impl Future<Output = Result<Vec<R>>> + Send {
        async move {
            let (items, _) = self.list(R::KIND).await?;
            items.into_iter().map(from_value).collect()
        }
    }
    fn create_as<R: Resource>(&self, r: &R) -> impl Future<Output = Result<R>> + Send {
        async move { from_value(self.create(to_value(r)?).await?) }
    }
    fn update_as<R: Resource>(&self, r: &R) -> impl Future<Output = Result<R>> + Send {
        async move { from_value(self.update(to_value(r)?).await?) }
    }
    fn update_status_as<R: Resource>(&self, r: &R) -> impl Future<Output = Result<R>> + Send {
        async move { from_value(self.update_status(to_value(r)?).await?) }
    }
}

impl<S: Store> TypedStore for S {}

/// Kubernetes object names: lowercase letters, digits, `-` and `.`, starting
/// and ending with a letter or digit, at most 253 characters (a DNS-1123
/// subdomain). Names become paths and process arguments, so nothing else.
pub fn validate_name(name: &str) -> std::result::Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if name.is_empty() {
        return Err("name is empty".into());
    }
    if name.len() > 253 {
        return Err(format!("name {name:?} is longer than 253 characters"));
    }
    if !name.chars().all(ok_char)
        || !name.starts_with(alnum)
        || !name.ends_with(alnum)
        || name.contains("..")
    {
        return Err(format!(
            "name {name:?} is not valid: use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::validate_name;

    #[test]
    fn names_are_dns_subdomains() {
        for good in ["a", "vol-1", "pvc-0b1c.x", "0"] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "A",
            "-a",
            "a-",
            "a/b",
            "a_b",
            "a..b",
            "a b",
            &"a".repeat(254),
        ] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
