//! The per-kind reflector cache: one LIST, then one WATCH from the list's resourceVersion,
//! applying every event to an in-memory map, re-listing after `410 Gone`.
//!
//! What it gives the store's readers (and why that is safe for the controllers):
//!
//! - **A consistent prefix.** The map is always the kind's state at one resourceVersion of
//!   the server (a list, then events applied in the order the watch delivers them), never a
//!   mix of two; it may lag the server by the watch latency, never run ahead of it.
//! - **Read your writes.** A write through the store returns only after the cache has
//!   applied that write's event (or re-listed since), so a controller that created a Replica
//!   counts it on its next pass and does not create it twice ([`Cache::wait_for`]).
//! - **Stale reads only cost a retry.** Every update carries the resourceVersion it read,
//!   and the API server refuses it with 409 if the object changed since: a decision made on
//!   a lagging cache cannot overwrite a newer state, it fails with
//!   [`StoreError::Conflict`] and the next pass decides again from a fresher cache.
//!
//! While the cache cannot list (the API server is down, or RBAC refuses `list`), readers get
//! that error (403 as [`StoreError::Forbidden`] naming `list` and the kind) and the task
//! keeps trying with a backoff; a watch that fails other than with 410 is re-opened from the
//! last version applied, so nothing is missed.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::{Api, DynamicObject, WatchEvent, WatchParams};
use serde_json::Value;
use tokio::sync::Notify;
use tokio::time::Instant;
use zebu_types::store::{StoreError, object_name, object_version};
use zebu_types::{Kind, ResourceVersion};

use crate::errors::{Call, code, map};

/// How many applied (name, resourceVersion) pairs are remembered, so a writer that looks
/// after a later event replaced its own still finds it.
const RECENT: usize = 1024;
/// Server-side limit of one watch request; the API server closes it then and the cache
/// watches again from its version.
const WATCH_SECONDS: u32 = 290;
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Why the cache serves nothing now.
#[derive(Debug, Clone)]
enum Failure {
    Forbidden { verb: &'static str, reason: String },
    Other(String),
}

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    /// The version the map reflects: of the last list, event or bookmark.
    version: ResourceVersion,
    synced: bool,
    failure: Option<Failure>,
    lists_begun: u64,
    /// `lists_begun` of the last list that completed.
    list_done: u64,
    /// `lists_begun` of the last list that failed.
    list_failed: u64,
    recent: VecDeque<(String, ResourceVersion)>,
    /// Events applied since the start, for tests and logs.
    applied: u64,
    relists: u64,
}

pub(crate) struct Cache {
    kind: Kind,
    state: Mutex<State>,
    changed: Notify,
}

/// An object from the server as the store hands it out: without `managedFields`, which no
/// Zebu type reads and which would double the cache's memory.
pub(crate) fn to_value(kind: Kind, o: DynamicObject) -> Result<Value, StoreError> {
    let name = o.metadata.name.clone().unwrap_or_default();
    let mut v = serde_json::to_value(o).map_err(|source| StoreError::Codec {
        what: format!("{kind} {name:?}"),
        source,
    })?;
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("managedFields");
    }
    Ok(v)
}

impl Cache {
    pub fn new(kind: Kind) -> Arc<Self> {
        Arc::new(Cache {
            kind,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is only ever replaced whole or changed by one insert/remove, so a
        // panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until the cache serves (its first list is applied), or say why it cannot.
    pub async fn ready(&self, timeout: Duration) -> Result<(), StoreError> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.lock();
                if st.synced {
                    return Ok(());
                }
                if let Some(f) = &st.failure {
                    return Err(self.error(f));
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(StoreError::Unavailable {
                    reason: format!(
                        "no list of {} from the API server within {timeout:?}",
                        self.kind.plural()
                    ),
                });
            }
        }
    }

    fn error(&self, f: &Failure) -> StoreError {
        match f {
            Failure::Forbidden { verb, reason } => StoreError::Forbidden {
                verb,
                kind: self.kind,
                reason: reason.clone(),
            },
            Failure::Other(reason) => StoreError::Unavailable {
                reason: reason.clone(),
            },
        }
    }

    pub fn get(&self, name: &str) -> Option<Value> {
        self.lock().objects.get(name).cloned()
    }

    /// Every object `keep` accepts, by name, and the version they reflect.
    pub fn list(&self, keep: impl Fn(&Value) -> bool) -> (Vec<Value>, ResourceVersion) {
        let st = self.lock();
        let items = st.objects.values().filter(|o| keep(o)).cloned().collect();
        (items, st.version.clone())
    }

    /// Events applied and lists repeated after an expiry, since the cache started.
    pub fn counters(&self) -> (u64, u64) {
        let st = self.lock();
        (st.applied, st.relists)
    }

    /// Wait (at most `timeout`) until the cache reflects a write: `Some(rv)` the object
    /// `name` at version `rv`, `None` its removal. True when it does, or when the cache does
    /// not serve and has no list under way (the list that makes it serve begins after the
    /// write, so includes it; until then readers get its error, not a stale state). A list
    /// under way when the write returned may predate it: that one is not enough.
    pub async fn wait_for(
        &self,
        name: &str,
        version: Option<&ResourceVersion>,
        timeout: Duration,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        let begun = self.lock().lists_begun;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.lock();
                // A list begun after the write returned includes it.
                let listing = st.lists_begun > st.list_done.max(st.list_failed);
                if (!st.synced && !listing) || st.list_done > begun {
                    return true;
                }
                let seen = match version {
                    Some(rv) => {
                        st.objects.get(name).map(object_version).as_ref() == Some(rv)
                            || st.recent.iter().any(|(n, v)| n == name && v == rv)
                    }
                    None => !st.objects.contains_key(name),
                };
                if seen {
                    return true;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    fn fail(&self, verb: &'static str, e: kube::Error) {
        let err = map(Call::new(verb, self.kind, ""), e);
        let failure = match err {
            StoreError::Forbidden { verb, reason, .. } => Failure::Forbidden { verb, reason },
            other => Failure::Other(other.to_string()),
        };
        tracing::warn!(kind = %self.kind, "cache: cannot {verb}: {}", self.error(&failure));
        let mut st = self.lock();
        if matches!(failure, Failure::Forbidden { .. }) || !st.synced {
            // Refused rights are reported at once, even over a cache that still holds
            // objects: serving them would hide that this manager can no longer see changes.
            st.synced = false;
            st.failure = Some(failure);
        }
        drop(st);
        self.changed.notify_waiters();
    }

    fn apply(&self, object: Value, deleted: bool) {
        let name = object_name(&object).to_string();
        let rv = object_version(&object);
        let mut st = self.lock();
        if deleted {
            st.objects.remove(&name);
        } else {
            st.objects.insert(name.clone(), object);
        }
        st.version = rv.clone();
        st.applied += 1;
        if st.recent.len() == RECENT {
            st.recent.pop_front();
        }
        st.recent.push_back((name, rv));
        drop(st);
        self.changed.notify_waiters();
    }

    /// The reflector task: list, follow, list again; never returns (the store aborts it).
    pub async fn run(self: Arc<Self>, api: Api<DynamicObject>) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let begun = {
                let mut st = self.lock();
                st.lists_begun += 1;
                st.lists_begun
            };
            let list = match api.list(&kube::api::ListParams::default()).await {
                Ok(l) => l,
                Err(e) => {
                    self.lock().list_failed = begun;
                    self.fail("list", e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            };
            let mut objects = BTreeMap::new();
            let mut bad = None;
            for o in list.items {
                match to_value(self.kind, o) {
                    Ok(v) => {
                        objects.insert(object_name(&v).to_string(), v);
                    }
                    Err(e) => bad = Some(e),
                }
            }
            if let Some(e) = bad {
                tracing::warn!(kind = %self.kind, "cache: {e}");
            }
            {
                let mut st = self.lock();
                if st.list_done > 0 {
                    st.relists += 1;
                }
                st.objects = objects;
                st.version =
                    ResourceVersion::new(list.metadata.resource_version.unwrap_or_default());
                st.synced = true;
                st.failure = None;
                st.list_done = begun;
            }
            self.changed.notify_waiters();
            backoff = BACKOFF_MIN;
            self.follow(&api).await;
        }
    }

    /// Apply watch events from the cache's version until the server says it expired (or
    /// refuses the watch); then the caller lists again.
    async fn follow(&self, api: &Api<DynamicObject>) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let since = self.lock().version.clone();
            let params = WatchParams::default().timeout(WATCH_SECONDS);
            let stream = match api.watch(&params, since.as_str()).await {
                Ok(s) => s,
                Err(e) if code(&e) == Some(410) => return,
                Err(e) if code(&e) == Some(403) => {
                    self.fail("watch", e);
                    return;
                }
                Err(e) => {
                    tracing::warn!(kind = %self.kind, "cache: watch from {since}: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            };
            backoff = BACKOFF_MIN;
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                match item {
                    Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                        match to_value(self.kind, o) {
                            Ok(v) => self.apply(v, false),
                            Err(e) => tracing::warn!(kind = %self.kind, "cache: {e}"),
                        }
                    }
                    Ok(WatchEvent::Deleted(o)) => match to_value(self.kind, o) {
                        Ok(v) => self.apply(v, true),
                        Err(e) => tracing::warn!(kind = %self.kind, "cache: {e}"),
                    },
                    Ok(WatchEvent::Bookmark(b)) => {
                        self.lock().version = ResourceVersion::new(b.metadata.resource_version);
                    }
                    Ok(WatchEvent::Error(s)) if s.code == 410 => return,
                    Ok(WatchEvent::Error(s)) => {
                        tracing::warn!(kind = %self.kind, "cache: watch error: {} {}", s.code, s.message);
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(kind = %self.kind, "cache: watch ended: {e}");
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn setting(name: &str, rv: &str) -> Value {
        json!({"kind": "Setting", "metadata": {"name": name, "resourceVersion": rv}})
    }

    const SHORT: Duration = Duration::from_millis(50);

    /// `wait_for(name, rv)` (up to 10 s) in a task of its own, given `SHORT` to get waiting.
    async fn wait_in_background(
        cache: &Arc<Cache>,
        name: &'static str,
        rv: &'static str,
    ) -> tokio::task::JoinHandle<bool> {
        let c = cache.clone();
        let task = tokio::spawn(async move {
            c.wait_for(
                name,
                Some(&ResourceVersion::new(rv)),
                Duration::from_secs(10),
            )
            .await
        });
        tokio::time::sleep(SHORT).await;
        task
    }

    /// A write that returns while the cache's first list is under way is not visible when
    /// that list ends (its snapshot may predate the write), only when the watch applies it.
    #[tokio::test]
    async fn a_write_during_the_first_list_waits_for_its_event_not_for_the_list() {
        let cache = Cache::new(Kind::Setting);
        let rv = ResourceVersion::new("7");
        // Nothing listed yet, no list under way: the first list will include the write.
        assert!(cache.wait_for("a", Some(&rv), SHORT).await);

        cache.lock().lists_begun = 1;
        assert!(
            !cache.wait_for("a", Some(&rv), SHORT).await,
            "visible while the first list, begun before the write, is under way"
        );
        {
            // That list ends without the object.
            let mut st = cache.lock();
            st.synced = true;
            st.list_done = 1;
        }
        assert!(!cache.wait_for("a", Some(&rv), SHORT).await);
        let waiter = wait_in_background(&cache, "a", "7").await;
        cache.apply(setting("a", "7"), false);
        assert!(
            waiter.await.expect("waiter"),
            "the watch's event makes it visible"
        );
    }

    #[tokio::test]
    async fn a_cache_that_cannot_list_does_not_hold_up_writes() {
        let cache = Cache::new(Kind::Setting);
        let rv = ResourceVersion::new("7");
        {
            // Its first list failed; it waits out a backoff before the next.
            let mut st = cache.lock();
            st.lists_begun = 1;
            st.list_failed = 1;
            st.failure = Some(Failure::Other("down".into()));
        }
        assert!(cache.wait_for("a", Some(&rv), SHORT).await);
        // A list begun after the write includes it.
        cache.lock().lists_begun = 2;
        let waiter = wait_in_background(&cache, "a", "7").await;
        assert!(!waiter.is_finished());
        {
            let mut st = cache.lock();
            st.lists_begun = 3;
            st.list_done = 3;
            st.synced = true;
        }
        cache.changed.notify_waiters();
        assert!(waiter.await.expect("waiter"));
    }
}
