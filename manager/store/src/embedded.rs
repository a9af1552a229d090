//! The embedded store: one redb file, for a single host and for tests.
//!
//! Layout (three tables in one file):
//!
//! | table     | key                   | value                                          |
//! |-----------|-----------------------|------------------------------------------------|
//! | `objects` | `"Kind/name"`         | the object as JSON                             |
//! | `events`  | version (u64)         | the change as JSON: type, kind, name, version, object |
//! | `meta`    | `"resourceVersion"`, `"prunedThrough"` | u64                           |
//!
//! resourceVersions are one counter for the whole file, handed out as decimal strings; to
//! callers they are opaque ([`ResourceVersion`]), and only this module parses them.
//!
//! Commit point: every write (create, update, update_status, delete) is one redb write
//! transaction that bumps the counter, writes the object, and appends the event; redb's
//! commit (durability `Immediate`, an fsync'd two-phase commit) is the single moment it
//! becomes true. A crash before it leaves the previous state, after it the new one; the call
//! only returns `Ok` after the commit, so an acknowledged write survives `kill -9` and power
//! loss. The counter lives in the same transaction, so versions never repeat across
//! restarts.
//!
//! Watch (per kind): after commit, and still under the writer mutex, the event is sent on an
//! in-process broadcast channel, so broadcast order is version order. A watcher subscribes
//! first and then reads the `events` table from a snapshot for catch-up, dropping broadcast
//! events it already saw; every event of its kind is therefore delivered exactly once, in
//! order. Events of other kinds are skipped, and a [`WatchEvent::Bookmark`] is sent at the
//! end of the catch-up and after every [`BOOKMARK_EVERY`] skipped events, so a watcher of a
//! quiet kind keeps a version that is still in the log when it resumes. The log keeps the
//! last [`EVENT_LOG_LIMIT`] changes; a watch from before that, or a watcher that falls more
//! than the broadcast capacity behind, gets [`StoreError::Expired`] and must list again.
//!
//! Objects stored by earlier versions (no namespace, no generation) read as if they had
//! been created now: the store's namespace and generation 1.
//!
//! redb calls block, so the async [`Store`] methods run them on tokio's blocking pool; the
//! synchronous methods are public for tools and tests.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt as _;
use futures::stream;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::broadcast;

use zebu_types::store::{
    BoxFuture, ListParams, ObjectList, Result, Store, StoreError, WatchEvent, WatchStream,
    object_version,
};
use zebu_types::{API_VERSION, DEFAULT_NAMESPACE, Kind, ResourceVersion, validate_object_name};

const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_RV: &str = "resourceVersion";
const META_PRUNED: &str = "prunedThrough";

/// How many past changes the db keeps for watch catch-up.
pub const EVENT_LOG_LIMIT: u64 = 10_000;
/// How far a live watcher may fall behind before it must list again.
const BROADCAST_CAPACITY: usize = 4096;
/// A watcher is sent a bookmark after this many changes of other kinds, well inside
/// [`EVENT_LOG_LIMIT`], so its resume point never falls out of the log while its kind is quiet.
pub const BOOKMARK_EVERY: u64 = 1000;

/// The one-file store. Cheap to clone; clones share the database.
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    namespace: String,
    /// Held across commit + broadcast so broadcast order = commit order.
    writer: Mutex<()>,
    events: broadcast::Sender<StoredEvent>,
    log_limit: u64,
    /// Volume secrets: files in `secrets/` next to the database file (issue 18).
    secrets: Arc<zebu_types::secrets::FileSecrets>,
}

/// What a change did; the event log's `type` (the words the first format used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One row of the event log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredEvent {
    #[serde(rename = "type")]
    type_: EventType,
    kind: Kind,
    name: String,
    resource_version: u64,
    object: Value,
}

impl StoredEvent {
    fn into_watch_event(self) -> WatchEvent {
        match self.type_ {
            EventType::Added => WatchEvent::Added(self.object),
            EventType::Modified => WatchEvent::Modified(self.object),
            EventType::Deleted => WatchEvent::Deleted(self.object),
        }
    }
}

fn key(kind: Kind, name: &str) -> String {
    format!("{kind}/{name}")
}

fn version(n: u64) -> ResourceVersion {
    ResourceVersion::new(n.to_string())
}

fn db_err(context: &'static str) -> impl Fn(redb::Error) -> StoreError {
    move |source| StoreError::Backend {
        context,
        source: Box::new(source),
    }
}

fn encode(what: &str, v: &impl Serialize) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|source| StoreError::Codec {
        what: what.to_string(),
        source,
    })
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Codec {
        what: what.to_string(),
        source,
    })
}

/// A version this store issued, as its number.
fn parse_version(kind: Kind, rv: &ResourceVersion) -> Result<u64> {
    rv.as_str().parse().map_err(|_| {
        StoreError::invalid(
            Some(kind),
            format!(
                "resourceVersion {:?} was not issued by this store",
                rv.as_str()
            ),
        )
    })
}

fn meta_mut(kind: Kind, object: &mut Value) -> Result<&mut serde_json::Map<String, Value>> {
    object
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| StoreError::invalid(Some(kind), "metadata is not an object"))
}

fn finalizers(object: &Value) -> Vec<String> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn generation(object: &Value) -> i64 {
    object
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1)
        .max(1)
}

/// What a write does to the stored object.
enum Write {
    Put(Value),
    Remove(Value),
}

impl EmbeddedStore {
    /// Open the store file, creating it if missing, for the default namespace.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, DEFAULT_NAMESPACE, EVENT_LOG_LIMIT)
    }

    /// [`EmbeddedStore::open`] for `namespace`, keeping only `log_limit` past events.
    pub fn open_with(path: impl AsRef<Path>, namespace: &str, log_limit: u64) -> Result<Self> {
        let log_limit = log_limit.max(1);
        let db = Database::create(path.as_ref())
            .map_err(redb::Error::from)
            .map_err(db_err("opening the database file"))?;
        // Create the tables so read transactions never see them missing.
        let init = db_err("initialising tables");
        let txn = db.begin_write().map_err(|e| init(e.into()))?;
        {
            txn.open_table(OBJECTS).map_err(|e| init(e.into()))?;
            txn.open_table(EVENTS).map_err(|e| init(e.into()))?;
            txn.open_table(META).map_err(|e| init(e.into()))?;
        }
        txn.commit().map_err(|e| init(e.into()))?;
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        let secrets_dir = path
            .as_ref()
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join("secrets");
        Ok(EmbeddedStore {
            inner: Arc::new(Inner {
                db,
                namespace: namespace.to_string(),
                writer: Mutex::new(()),
                events,
                log_limit,
                secrets: Arc::new(zebu_types::secrets::FileSecrets::new(secrets_dir)),
            }),
        })
    }

    /// The current version of the whole store.
    pub fn current_version(&self) -> Result<ResourceVersion> {
        let err = db_err("reading the resourceVersion");
        let txn = self.inner.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let rv = meta
            .get(META_RV)
            .map_err(|e| err(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        Ok(version(rv))
    }

    /// Stamp what a stored object may lack from an earlier version of the store.
    fn normalize(&self, kind: Kind, mut object: Value) -> Result<Value> {
        let ns = self.inner.namespace.clone();
        let g = generation(&object);
        let meta = meta_mut(kind, &mut object)?;
        meta.entry("namespace").or_insert(Value::from(ns));
        meta.insert("generation".into(), Value::from(g));
        Ok(object)
    }

    pub fn get_sync(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let err = db_err("reading an object");
        let txn = self.inner.db.begin_read().map_err(|e| err(e.into()))?;
        let table = txn.open_table(OBJECTS).map_err(|e| err(e.into()))?;
        let k = key(kind, name);
        match table.get(k.as_str()).map_err(|e| err(e.into()))? {
            Some(bytes) => Ok(Some(self.normalize(kind, decode(&k, bytes.value())?)?)),
            None => Ok(None),
        }
    }

    pub fn list_sync(&self, kind: Kind, params: &ListParams) -> Result<ObjectList> {
        let err = db_err("listing objects");
        let txn = self.inner.db.begin_read().map_err(|e| err(e.into()))?;
        let table = txn.open_table(OBJECTS).map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let rv = meta
            .get(META_RV)
            .map_err(|e| err(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        // '0' is the character after '/', so this range is exactly "Kind/…".
        let lo = format!("{kind}/");
        let hi = format!("{kind}0");
        let mut items = Vec::new();
        for entry in table
            .range(lo.as_str()..hi.as_str())
            .map_err(|e| err(e.into()))?
        {
            let (k, v) = entry.map_err(|e| err(e.into()))?;
            let object: Value = decode(k.value(), v.value())?;
            if params
                .label_selector
                .as_ref()
                .is_none_or(|s| s.matches_object(&object))
            {
                items.push(self.normalize(kind, object)?);
            }
        }
        Ok(ObjectList {
            items,
            resource_version: version(rv),
        })
    }

    /// Kind and name of an incoming object, validated, and its namespace checked.
    fn identify(&self, object: &mut Value) -> Result<(Kind, String)> {
        let kind_str = object
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| StoreError::invalid(None, "object has no \"kind\""))?;
        let kind = Kind::parse(kind_str)
            .ok_or_else(|| StoreError::invalid(None, format!("unknown kind {kind_str:?}")))?;
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .ok_or_else(|| StoreError::invalid(Some(kind), "no metadata.name"))?
            .to_string();
        validate_object_name(&name).map_err(|source| StoreError::InvalidName { kind, source })?;
        let ns = self.inner.namespace.clone();
        let meta = meta_mut(kind, object)?;
        match meta.get("namespace").and_then(Value::as_str) {
            Some(given) if given != ns => {
                return Err(StoreError::invalid(
                    Some(kind),
                    format!("{name:?} is in namespace {given:?}; this store holds {ns:?}"),
                ));
            }
            _ => {
                meta.insert("namespace".into(), Value::from(ns));
            }
        }
        object["apiVersion"] = Value::from(API_VERSION);
        Ok((kind, name))
    }

    pub fn create_sync(&self, mut object: Value) -> Result<Value> {
        let (kind, name) = self.identify(&mut object)?;
        if !object_version(&object).is_empty() {
            return Err(StoreError::invalid(
                Some(kind),
                format!("{name:?}: resourceVersion must not be set on create"),
            ));
        }
        self.write(kind, &name, "creating an object", |stored, rv| {
            if stored.is_some() {
                return Err(StoreError::AlreadyExists {
                    kind,
                    name: name.clone(),
                });
            }
            // Status is written by update_status only, as with a status subresource.
            if let Some(o) = object.as_object_mut() {
                o.remove("status");
            }
            let meta = meta_mut(kind, &mut object)?;
            meta.insert("uid".into(), Value::from(new_uid()));
            meta.insert(
                "creationTimestamp".into(),
                Value::from(zebu_types::time::now_rfc3339()),
            );
            meta.insert("resourceVersion".into(), Value::from(rv.to_string()));
            meta.insert("generation".into(), Value::from(1));
            meta.remove("deletionTimestamp");
            Ok((EventType::Added, Write::Put(object)))
        })
    }

    pub fn update_sync(&self, object: Value) -> Result<Value> {
        self.update_part(object, false)
    }

    pub fn update_status_sync(&self, object: Value) -> Result<Value> {
        self.update_part(object, true)
    }

    /// `status_only`: take only `status` from the caller; otherwise take everything but
    /// `status`. Store-owned metadata is always kept.
    fn update_part(&self, mut object: Value, status_only: bool) -> Result<Value> {
        let (kind, name) = self.identify(&mut object)?;
        let given = object_version(&object);
        if given.is_empty() {
            return Err(StoreError::invalid(
                Some(kind),
                format!("{name:?}: resourceVersion must be set for an update"),
            ));
        }
        let given_n = parse_version(kind, &given)?;
        let context = if status_only {
            "updating a status"
        } else {
            "updating an object"
        };
        self.write(kind, &name, context, |stored, rv| {
            let stored = stored.ok_or_else(|| StoreError::NotFound {
                kind,
                name: name.clone(),
            })?;
            let mut stored = self.normalize(kind, stored)?;
            if parse_version(kind, &object_version(&stored))? != given_n {
                return Err(StoreError::Conflict {
                    kind,
                    name: name.clone(),
                    given: given.clone(),
                });
            }
            let mut next = if status_only {
                stored["status"] = object
                    .get_mut("status")
                    .map(Value::take)
                    .unwrap_or(Value::Null);
                stored
            } else {
                let deleting = stored.pointer("/metadata/deletionTimestamp").is_some();
                if deleting {
                    let had = finalizers(&stored);
                    if let Some(new) = finalizers(&object).into_iter().find(|f| !had.contains(f)) {
                        return Err(StoreError::invalid(
                            Some(kind),
                            format!(
                                "{name:?} is being deleted: no finalizer may be added ({new:?})"
                            ),
                        ));
                    }
                }
                let spec_changed = stored.get("spec") != object.get("spec");
                match stored.get_mut("status").map(Value::take) {
                    Some(status) => object["status"] = status,
                    None => {
                        if let Some(o) = object.as_object_mut() {
                            o.remove("status");
                        }
                    }
                }
                let old = meta_mut(kind, &mut stored)?.clone();
                let g = generation(&stored) + i64::from(spec_changed);
                let meta = meta_mut(kind, &mut object)?;
                for owned in ["uid", "creationTimestamp", "deletionTimestamp"] {
                    match old.get(owned) {
                        Some(v) => meta.insert(owned.into(), v.clone()),
                        None => meta.remove(owned),
                    };
                }
                meta.insert("generation".into(), Value::from(g));
                object
            };
            meta_mut(kind, &mut next)?
                .insert("resourceVersion".into(), Value::from(rv.to_string()));
            let deleting = next.pointer("/metadata/deletionTimestamp").is_some();
            if deleting && finalizers(&next).is_empty() {
                Ok((EventType::Deleted, Write::Remove(next)))
            } else {
                Ok((EventType::Modified, Write::Put(next)))
            }
        })
    }

    pub fn delete_sync(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let owned = name.to_string();
        let result = self.write(kind, name, "deleting an object", move |stored, rv| {
            let stored = stored.ok_or_else(|| StoreError::NotFound {
                kind,
                name: owned.clone(),
            })?;
            let mut stored = self.normalize(kind, stored)?;
            let meta = meta_mut(kind, &mut stored)?;
            meta.insert("resourceVersion".into(), Value::from(rv.to_string()));
            if finalizers(&stored).is_empty() {
                return Ok((EventType::Deleted, Write::Remove(stored)));
            }
            let g = generation(&stored);
            let meta = meta_mut(kind, &mut stored)?;
            if !meta.contains_key("deletionTimestamp") {
                meta.insert(
                    "deletionTimestamp".into(),
                    Value::from(zebu_types::time::now_rfc3339()),
                );
                // As the Kubernetes API server does: being deleted is a change a controller
                // must observe, so it is a new generation.
                meta.insert("generation".into(), Value::from(g + 1));
            }
            Ok((EventType::Modified, Write::Put(stored)))
        })?;
        let gone = result.pointer("/metadata/deletionTimestamp").is_none()
            || finalizers(&result).is_empty();
        Ok(if gone { None } else { Some(result) })
    }

    /// One write transaction: read the stored object, let `f` decide, bump the counter,
    /// store the result and its event, commit, broadcast.
    fn write(
        &self,
        kind: Kind,
        name: &str,
        context: &'static str,
        f: impl FnOnce(Option<Value>, u64) -> Result<(EventType, Write)>,
    ) -> Result<Value> {
        let err = db_err(context);
        // A poisoned mutex only means another writer panicked between commit and
        // broadcast; the db itself is consistent, so carry on.
        let _guard = self
            .inner
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let txn = self.inner.db.begin_write().map_err(|e| err(e.into()))?;
        let k = key(kind, name);
        let event = {
            let mut objects = txn.open_table(OBJECTS).map_err(|e| err(e.into()))?;
            let mut events = txn.open_table(EVENTS).map_err(|e| err(e.into()))?;
            let mut meta = txn.open_table(META).map_err(|e| err(e.into()))?;
            let stored: Option<Value> = match objects.get(k.as_str()).map_err(|e| err(e.into()))? {
                Some(bytes) => Some(decode(&k, bytes.value())?),
                None => None,
            };
            let rv = meta
                .get(META_RV)
                .map_err(|e| err(e.into()))?
                .map(|g| g.value())
                .unwrap_or(0)
                + 1;
            let (type_, write) = f(stored, rv)?;
            let object = match write {
                Write::Put(object) => {
                    objects
                        .insert(k.as_str(), encode(&k, &object)?.as_slice())
                        .map_err(|e| err(e.into()))?;
                    object
                }
                Write::Remove(object) => {
                    objects.remove(k.as_str()).map_err(|e| err(e.into()))?;
                    object
                }
            };
            meta.insert(META_RV, rv).map_err(|e| err(e.into()))?;
            let event = StoredEvent {
                type_,
                kind,
                name: name.to_string(),
                resource_version: rv,
                object,
            };
            events
                .insert(rv, encode(&k, &event)?.as_slice())
                .map_err(|e| err(e.into()))?;
            // Trim the log to its limit; in steady state one entry per write.
            if rv > self.inner.log_limit {
                let floor = rv - self.inner.log_limit;
                let mut pruned = None;
                loop {
                    let first = events
                        .first()
                        .map_err(|e| err(e.into()))?
                        .map(|(k, _)| k.value());
                    match first {
                        Some(first) if first <= floor => {
                            events.remove(first).map_err(|e| err(e.into()))?;
                            pruned = Some(first);
                        }
                        _ => break,
                    }
                }
                if let Some(p) = pruned {
                    meta.insert(META_PRUNED, p).map_err(|e| err(e.into()))?;
                }
            }
            event
        };
        txn.commit().map_err(|e| err(e.into()))?;
        let object = event.object.clone();
        let rv = event.resource_version;
        // No receivers is fine: nobody is watching.
        let _ = self.inner.events.send(event);
        tracing::debug!(%kind, name, rv, "{context}");
        Ok(object)
    }

    /// Events of `kind` after `since` from the db, plus a subscription that continues from
    /// there; see the module docs.
    pub fn watch_sync(&self, kind: Kind, since: &ResourceVersion) -> Result<WatchStream> {
        let since_n = parse_version(kind, since)?;
        let rx = self.inner.events.subscribe();
        let err = db_err("reading the event log");
        let txn = self.inner.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let pruned_through = meta
            .get(META_PRUNED)
            .map_err(|e| err(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        if since_n < pruned_through {
            return Err(StoreError::Expired {
                kind,
                since: since.clone(),
            });
        }
        let events = txn.open_table(EVENTS).map_err(|e| err(e.into()))?;
        let mut catch_up = Vec::new();
        let mut last = since_n;
        let mut skipped = false;
        for entry in events.range(since_n + 1..).map_err(|e| err(e.into()))? {
            let (rv, bytes) = entry.map_err(|e| err(e.into()))?;
            let event: StoredEvent = decode("an event", bytes.value())?;
            last = rv.value();
            if event.kind == kind {
                catch_up.push(Ok(event.into_watch_event()));
                skipped = false;
            } else {
                skipped = true;
            }
        }
        if skipped {
            catch_up.push(Ok(WatchEvent::Bookmark(version(last))));
        }
        struct Live {
            rx: broadcast::Receiver<StoredEvent>,
            last: u64,
            skipped: u64,
            kind: Kind,
            done: bool,
        }
        let live = Live {
            rx,
            last,
            skipped: 0,
            kind,
            done: false,
        };
        let live = stream::unfold(live, |mut st| async move {
            if st.done {
                return None;
            }
            loop {
                match st.rx.recv().await {
                    Ok(ev) if ev.resource_version <= st.last => continue,
                    Ok(ev) => {
                        st.last = ev.resource_version;
                        if ev.kind == st.kind {
                            st.skipped = 0;
                            return Some((Ok(ev.into_watch_event()), st));
                        }
                        st.skipped += 1;
                        if st.skipped >= BOOKMARK_EVERY {
                            st.skipped = 0;
                            let rv = version(st.last);
                            return Some((Ok(WatchEvent::Bookmark(rv)), st));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        st.done = true;
                        let since = version(st.last);
                        let kind = st.kind;
                        return Some((Err(StoreError::Expired { kind, since }), st));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(Box::pin(stream::iter(catch_up).chain(live)))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(EmbeddedStore) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(me))
            .await
            .map_err(|e| StoreError::Backend {
                context: "running a store call",
                source: Box::new(e),
            })?
    }
}

/// A random RFC 4122 version-4 UUID string.
fn new_uid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

impl Store for EmbeddedStore {
    fn namespace(&self) -> &str {
        &self.inner.namespace
    }
    fn get<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>> {
        let name = name.to_string();
        Box::pin(self.blocking(move |s| s.get_sync(kind, &name)))
    }
    fn list<'a>(&'a self, kind: Kind, params: &'a ListParams) -> BoxFuture<'a, Result<ObjectList>> {
        let params = params.clone();
        Box::pin(self.blocking(move |s| s.list_sync(kind, &params)))
    }
    fn watch<'a>(
        &'a self,
        kind: Kind,
        since: &'a ResourceVersion,
    ) -> BoxFuture<'a, Result<WatchStream>> {
        let since = since.clone();
        Box::pin(self.blocking(move |s| s.watch_sync(kind, &since)))
    }
    fn create(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.blocking(move |s| s.create_sync(object)))
    }
    fn update(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.blocking(move |s| s.update_sync(object)))
    }
    fn update_status(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.blocking(move |s| s.update_status_sync(object)))
    }
    fn delete<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>> {
        let name = name.to_string();
        Box::pin(self.blocking(move |s| s.delete_sync(kind, &name)))
    }
    fn secrets(&self) -> Option<Arc<dyn zebu_types::secrets::SecretKeeper>> {
        Some(self.inner.secrets.clone())
    }
}

#[cfg(test)]
mod tests;
