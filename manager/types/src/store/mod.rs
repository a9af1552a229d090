//! The store contract: where resources live, and how controllers learn that they changed.
//!
//! [`Store`] is deliberately small and Kubernetes-shaped, honest for a cluster, so the same
//! controllers and operations run against the embedded one-file store on a single host and
//! against the Kubernetes API server:
//!
//! - A store holds the objects of one namespace ([`Store::namespace`], normally
//!   [`crate::DEFAULT_NAMESPACE`]); it stamps `metadata.namespace` and refuses an object that
//!   names another.
//! - `get` / `list` read current objects. `list` takes a [`LabelSelector`] and returns, with
//!   the items, the [`ResourceVersion`] the list reflects, to start a `watch` from.
//!   resourceVersions are opaque strings: hand them back, never compute with them.
//! - `create` assigns `uid`, `creationTimestamp`, `resourceVersion` and `generation` 1; it
//!   ignores `status` (as a Kubernetes status subresource does): status is written by
//!   `update_status` only.
//! - `update` replaces metadata and spec (never status), bumping `generation` when spec
//!   changes; `update_status` replaces status (never spec). Both fail with
//!   [`StoreError::Conflict`] unless the caller's `resourceVersion` is the stored one, and with
//!   [`StoreError::Invalid`] when it has none. That is the optimistic concurrency every writer
//!   relies on: read, decide, write back; on conflict, read again.
//! - `delete` removes the object, or, while `finalizers` remain, only stamps
//!   `deletionTimestamp` (and bumps `generation`, as the Kubernetes API server does, so a
//!   controller's `observedGeneration` shows whether it has seen the delete); the object goes away with the update that removes the last
//!   finalizer. No finalizer may be added to an object being deleted.
//! - `watch` is per kind: every change of that kind after a resourceVersion, in order,
//!   without gaps, and now and then a [`WatchEvent::Bookmark`] that only moves the version on.
//!   A watch that ends is resumed from the last version seen; if the store can no longer tell
//!   what happened since then it yields [`StoreError::Expired`] (Kubernetes' "410 Gone") and
//!   ends, and the watcher lists again. [`KindWatcher`] does all of that.
//!
//! The trait works on JSON objects (what both backends hold natively: a Kubernetes store
//! passes them through as dynamic objects) and is object-safe, so the backend is chosen at
//! run time and everything above holds an `Arc<dyn Store>`; [`TypedStore`] adds typed helpers
//! over any [`Resource`]. Boxed futures cost one allocation per call, nothing next to a
//! database commit or an HTTP round trip, and keep generics out of every layer above.

mod selector;
mod watcher;

use std::future::Future;
use std::pin::Pin;

use futures::Stream;
use serde_json::Value;

pub use selector::{LabelSelector, SelectorError};
pub use watcher::{KindWatcher, WatchChange};

use crate::meta::NameError;
use crate::resources::Resource;
use crate::{Kind, ResourceVersion};

/// Errors from a store. Each names the object or kind it is about.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{kind} {name:?} not found")]
    NotFound { kind: Kind, name: String },
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: Kind, name: String },
    #[error("conflict updating {kind} {name:?}: it changed since resourceVersion {given} was read")]
    Conflict {
        kind: Kind,
        name: String,
        given: ResourceVersion,
    },
    #[error("invalid {}: {reason}", kind.map_or("object".to_string(), |k| k.to_string()))]
    Invalid { kind: Option<Kind>, reason: String },
    #[error("invalid {kind} name: {source}")]
    InvalidName {
        kind: Kind,
        #[source]
        source: NameError,
    },
    #[error(
        "watch of {kind} from resourceVersion {since} expired: the changes since are no longer kept; list again"
    )]
    Expired { kind: Kind, since: ResourceVersion },
    /// The backend refused the caller's rights (Kubernetes RBAC).
    #[error("forbidden: cannot {verb} {kind}: {reason}")]
    Forbidden {
        verb: &'static str,
        kind: Kind,
        reason: String,
    },
    /// The backend cannot be reached just now; worth trying again.
    #[error("store unavailable: {reason}")]
    Unavailable { reason: String },
    #[error("store error while {context}: {source}")]
    Backend {
        context: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cannot encode or decode {what}: {source}")]
    Codec {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    pub fn invalid(kind: Option<Kind>, reason: impl Into<String>) -> Self {
        StoreError::Invalid {
            kind,
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListParams {
    /// Only objects whose labels match.
    pub label_selector: Option<LabelSelector>,
}

impl ListParams {
    pub fn all() -> Self {
        ListParams::default()
    }
    pub fn selected(selector: LabelSelector) -> Self {
        ListParams {
            label_selector: Some(selector),
        }
    }
}

/// The objects of one kind, sorted by name, and the version the list reflects.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectList {
    pub items: Vec<Value>,
    pub resource_version: ResourceVersion,
}

/// One change to an object of the watched kind. `Deleted` carries the last stored state.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent {
    Added(Value),
    Modified(Value),
    Deleted(Value),
    /// Nothing of this kind changed up to this version; resume from here.
    Bookmark(ResourceVersion),
}

impl WatchEvent {
    /// The version to resume a watch from after this event.
    pub fn resource_version(&self) -> ResourceVersion {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => {
                object_version(o)
            }
            WatchEvent::Bookmark(rv) => rv.clone(),
        }
    }

    /// The object, for every event but a bookmark.
    pub fn object(&self) -> Option<&Value> {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => Some(o),
            WatchEvent::Bookmark(_) => None,
        }
    }

    /// `ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`: the words of a Kubernetes watch.
    pub fn type_name(&self) -> &'static str {
        match self {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            WatchEvent::Deleted(_) => "DELETED",
            WatchEvent::Bookmark(_) => "BOOKMARK",
        }
    }
}

/// An object's `metadata.resourceVersion` (empty when it has none).
pub fn object_version(object: &Value) -> ResourceVersion {
    ResourceVersion::new(
        object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or(""),
    )
}

/// An object's `metadata.name` (empty when it has none).
pub fn object_name(object: &Value) -> &str {
    object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent>> + Send>>;
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The store contract; see the module docs.
pub trait Store: Send + Sync {
    /// The namespace this store's objects live in.
    fn namespace(&self) -> &str;
    fn get<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>>;
    fn list<'a>(&'a self, kind: Kind, params: &'a ListParams) -> BoxFuture<'a, Result<ObjectList>>;
    /// Changes of `kind` after `since` (a version from a list, an object or an event).
    fn watch<'a>(
        &'a self,
        kind: Kind,
        since: &'a ResourceVersion,
    ) -> BoxFuture<'a, Result<WatchStream>>;
    fn create(&self, object: Value) -> BoxFuture<'_, Result<Value>>;
    fn update(&self, object: Value) -> BoxFuture<'_, Result<Value>>;
    fn update_status(&self, object: Value) -> BoxFuture<'_, Result<Value>>;
    /// `Some(object)` when finalizers keep it (now with `deletionTimestamp`), `None` when it
    /// is gone.
    fn delete<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>>;
    /// Where this store keeps volume secrets (issue 18; [`crate::secrets`]); `None`: it keeps
    /// none, and volumes are made without a secret.
    fn secrets(&self) -> Option<std::sync::Arc<dyn crate::secrets::SecretKeeper>> {
        None
    }
    /// The data of the Secret `name` in this store's namespace, for what names a Secret
    /// (a backup target's `credentialSecret`). A store that keeps no Secrets (the embedded
    /// one: on one host such a name is a file's path) answers [`SecretLookup::NotServed`].
    fn secret<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<SecretLookup>> {
        let _ = name;
        Box::pin(async { Ok(SecretLookup::NotServed) })
    }
}

/// What [`Store::secret`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretLookup {
    /// This store keeps no Secrets.
    NotServed,
    /// There is no Secret of that name.
    Missing,
    /// Its `data`, decoded, by key.
    Found(std::collections::BTreeMap<String, Vec<u8>>),
}

/// Encode a resource for the store.
pub fn to_value<R: Resource>(r: &R) -> Result<Value> {
    serde_json::to_value(r).map_err(|source| StoreError::Codec {
        what: format!("{} {:?}", R::KIND, r.name()),
        source,
    })
}

/// Decode a stored object as a resource.
pub fn from_value<R: Resource>(v: Value) -> Result<R> {
    let what = format!("{} {:?}", R::KIND, object_name(&v));
    serde_json::from_value(v).map_err(|source| StoreError::Codec { what, source })
}

/// Typed helpers over any [`Store`], `dyn Store` included.
pub trait TypedStore: Store {
    fn get_as<R: Resource>(&self, name: &str) -> impl Future<Output = Result<Option<R>>> + Send {
        async move { self.get(R::KIND, name).await?.map(from_value).transpose() }
    }
    fn list_as<R: Resource>(&self) -> impl Future<Output = Result<Vec<R>>> + Send {
        async move {
            let list = self.list(R::KIND, &ListParams::all()).await?;
            list.items.into_iter().map(from_value).collect()
        }
    }
    fn list_selected<R: Resource>(
        &self,
        selector: &LabelSelector,
    ) -> impl Future<Output = Result<Vec<R>>> + Send {
        async move {
            let params = ListParams::selected(selector.clone());
            let list = self.list(R::KIND, &params).await?;
            list.items.into_iter().map(from_value).collect()
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

impl<S: Store + ?Sized> TypedStore for S {}
