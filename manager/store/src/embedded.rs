//! The embedded store: one redb file, for a single host and for tests.
//!
//! Layout (three tables in one file):
//!
//! | table     | key                   | value                               |
//! |-----------|-----------------------|-------------------------------------|
//! | `objects` | `"Kind/name"`         | the object as JSON                  |
//! | `events`  | resourceVersion (u64) | the [`WatchEvent`] as JSON          |
//! | `meta`    | `"resourceVersion"`, `"prunedThrough"` | u64                |
//!
//! Commit point: every write (create, update, update_status, delete) is one
//! redb write transaction that bumps the global resourceVersion counter,
//! writes the object, and appends the event; redb's commit (durability
//! `Immediate`, an fsync'd two-phase commit) is the single moment it becomes
//! true. A crash before it leaves the previous state, after it the new one;
//! the call only returns `Ok` after the commit, so an acknowledged write
//! survives `kill -9` and power loss. The counter lives in the same
//! transaction, so resourceVersions never repeat across restarts.
//!
//! Watch: after commit, and still under the writer mutex, the event is sent
//! on an in-process broadcast channel, so broadcast order is resourceVersion
//! order. A watcher subscribes first and then reads the `events` table from a
//! snapshot for catch-up, dropping broadcast events it already saw; every
//! event is therefore delivered exactly once, in order. The event log keeps
//! the last [`EVENT_LOG_LIMIT`] changes; a watch from before that, or a
//! watcher that falls more than the broadcast capacity behind, gets
//! [`StoreError::Expired`] and must re-list.
//!
//! redb calls block, so the async [`Store`] methods run them on tokio's
//! blocking pool; the synchronous methods are public for tools and tests.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::stream;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde_json::Value;
use tokio::sync::broadcast;

use super::{EventType, Result, Store, StoreError, WatchEvent, WatchStream, validate_name};
use crate::resources::{API_VERSION, Kind};

const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_RV: &str = "resourceVersion";
const META_PRUNED: &str = "prunedThrough";

/// How many past changes the db keeps for watch catch-up.
pub const EVENT_LOG_LIMIT: u64 = 10_000;
/// How far a live watcher may fall behind before it must re-list.
const BROADCAST_CAPACITY: usize = 4096;

/// The one-file store. Cheap to clone; clones share the database.
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    /// Held across commit + broadcast so broadcast order = commit order.
    writer: Mutex<()>,
    events: broadcast::Sender<WatchEvent>,
    log_limit: u64,
}

fn key(kind: Kind, name: &str) -> String {
    format!("{kind}/{name}")
}

fn encode(what: &str, v: &impl serde::Serialize) -> Result<Vec<u8>> {
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

/// Kind and name of an incoming object, validated.
fn identify(object: &Value) -> Result<(Kind, String)> {
    let kind_str = object
        .get("kind")
        .and_then(Value::as_str)
        .ok_or_else(|| StoreError::Invalid("object has no \"kind\"".into()))?;
    let kind = Kind::parse(kind_str)
        .ok_or_else(|| StoreError::Invalid(format!("unknown kind {kind_str:?}")))?;
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .ok_or_else(|| StoreError::Invalid(format!("{kind} has no metadata.name")))?;
    validate_name(name).map_err(|e| StoreError::Invalid(format!("{kind}: {e}")))?;
    Ok((kind, name.to_string()))
}

fn given_rv(object: &Value) -> u64 {
    object
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn meta_mut(object: &mut Value) -> Result<&mut serde_json::Map<String, Value>> {
    object
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| StoreError::Invalid("metadata is not an object".into()))
}

fn finalizers_empty(object: &Value) -> bool {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_none_or(|a| a.is_empty())
}

/// What a write does to the stored object.
enum Write {
    Put(Value),
    Remove(Value),
}

impl EmbeddedStore {
    /// Open the store file, creating it if missing.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with_log_limit(path, EVENT_LOG_LIMIT)
    }

    /// [`EmbeddedStore::open`] keeping only `log_limit` past events (tests).
    pub fn open_with_log_limit(path: impl AsRef<Path>, log_limit: u64) -> Result<Self> {
        let log_limit = log_limit.max(1);
        let db = Database::create(path.as_ref())
            .map_err(redb::Error::from)
            .map_err(StoreError::db("opening the database file"))?;
        // Create the tables so read transactions never see them missing.
        let txn = db
            .begin_write()
            .map_err(redb::Error::from)
            .map_err(StoreError::db("initialising tables"))?;
        {
            let init = |e: redb::TableError| StoreError::db("initialising tables")(e.into());
            txn.open_table(OBJECTS).map_err(init)?;
            txn.open_table(EVENTS).map_err(init)?;
            txn.open_table(META).map_err(init)?;
        }
        txn.commit()
            .map_err(redb::Error::from)
            .map_err(StoreError::db("initialising tables"))?;
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        Ok(EmbeddedStore {
            inner: Arc::new(Inner {
                db,
                writer: Mutex::new(()),
                events,
                log_limit,
            }),
        })
    }

    /// The current global resourceVersion (0 for an empty store).
    pub fn resource_version(&self) -> Result<u64> {
        let err = StoreError::db("reading the resourceVersion");
        let txn = self.inner.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn
            .open_table(META)
            .map_err(|e| StoreError::db("reading the resourceVersion")(e.into()))?;
        let rv = meta
            .get(META_RV)
            .map_err(|e| StoreError::db("reading the resourceVersion")(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        Ok(rv)
    }

    pub fn get_sync(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let db_err = |e: redb::Error| StoreError::db("reading an object")(e);
        let txn = self.inner.db.begin_read().map_err(|e| db_err(e.into()))?;
        let table = txn.open_table(OBJECTS).map_err(|e| db_err(e.into()))?;
        let k = key(kind, name);
        match table.get(k.as_str()).map_err(|e| db_err(e.into()))? {
            Some(bytes) => Ok(Some(decode(&k, bytes.value())?)),
            None => Ok(None),
        }
    }

    pub fn list_sync(&self, kind: Kind) -> Result<(Vec<Value>, u64)> {
        let db_err = |e: redb::Error| StoreError::db("listing objects")(e);
        let txn = self.inner.db.begin_read().map_err(|e| db_err(e.into()))?;
        let table = txn.open_table(OBJECTS).map_err(|e| db_err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| db_err(e.into()))?;
        let rv = meta
            .get(META_RV)
            .map_err(|e| db_err(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        // '0' is the character after '/', so this range is exactly "Kind/…".
        let lo = format!("{kind}/");
        let hi = format!("{kind}0");
        let mut out = Vec::new();
        for entry in table
            .range(lo.as_str()..hi.as_str())
            .map_err(|e| db_err(e.into()))?
        {
            let (k, v) = entry.map_err(|e| db_err(e.into()))?;
            out.push(decode(k.value(), v.value())?);
        }
        Ok((out, rv))
    }

    pub fn create_sync(&self, mut object: Value) -> Result<Value> {
        let (kind, name) = identify(&object)?;
        self.write(kind, &name, "creating an object", |stored, rv| {
            if stored.is_some() {
                return Err(StoreError::AlreadyExists {
                    kind,
                    name: name.clone(),
                });
            }
            object["apiVersion"] = Value::from(API_VERSION);
            let meta = meta_mut(&mut object)?;
            meta.insert("uid".into(), Value::from(new_uid()));
            meta.insert(
                "creationTimestamp".into(),
                Value::from(crate::time::now_rfc3339()),
            );
            meta.insert("resourceVersion".into(), Value::from(rv.to_string()));
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

    /// `status_only`: take only `status` from the caller; otherwise take
    /// everything but `status`. Store-owned metadata is always kept.
    fn update_part(&self, mut object: Value, status_only: bool) -> Result<Value> {
        let (kind, name) = identify(&object)?;
        let given = given_rv(&object);
        let context = if status_only {
            "updating a status"
        } else {
            "updating an object"
        };
        self.write(kind, &name, context, |stored, rv| {
            let mut stored = stored.ok_or_else(|| StoreError::NotFound {
                kind,
                name: name.clone(),
            })?;
            let stored_rv = given_rv(&stored);
            if given != stored_rv {
                return Err(StoreError::Conflict {
                    kind,
                    name: name.clone(),
                    stored: stored_rv,
                    given,
                });
            }
            let mut next = if status_only {
                stored["status"] = object
                    .get_mut("status")
                    .map(Value::take)
                    .unwrap_or(Value::Null);
                stored
            } else {
                object["status"] = stored
                    .get_mut("status")
                    .map(Value::take)
                    .unwrap_or_default();
                object["apiVersion"] = Value::from(API_VERSION);
                let old = meta_mut(&mut stored)?.clone();
                let meta = meta_mut(&mut object)?;
                for owned in ["uid", "creationTimestamp", "deletionTimestamp"] {
                    match old.get(owned) {
                        Some(v) => meta.insert(owned.into(), v.clone()),
                        None => meta.remove(owned),
                    };
                }
                object
            };
            meta_mut(&mut next)?.insert("resourceVersion".into(), Value::from(rv.to_string()));
            let deleting = next.pointer("/metadata/deletionTimestamp").is_some();
            if deleting && finalizers_empty(&next) {
                Ok((EventType::Deleted, Write::Remove(next)))
            } else {
                Ok((EventType::Modified, Write::Put(next)))
            }
        })
    }

    pub fn delete_sync(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let owned = name.to_string();
        let result = self.write(kind, name, "deleting an object", move |stored, rv| {
            let mut stored = stored.ok_or_else(|| StoreError::NotFound {
                kind,
                name: owned.clone(),
            })?;
            let meta = meta_mut(&mut stored)?;
            meta.insert("resourceVersion".into(), Value::from(rv.to_string()));
            if finalizers_empty(&stored) {
                return Ok((EventType::Deleted, Write::Remove(stored)));
            }
            let meta = meta_mut(&mut stored)?;
            if !meta.contains_key("deletionTimestamp") {
                meta.insert(
                    "deletionTimestamp".into(),
                    Value::from(crate::time::now_rfc3339()),
                );
            }
            Ok((EventType::Modified, Write::Put(stored)))
        })?;
        let gone =
            result.pointer("/metadata/deletionTimestamp").is_none() || finalizers_empty(&result);
        Ok(if gone { None } else { Some(result) })
    }

    /// One write transaction: read the stored object, let `f` decide, bump
    /// the counter, store the result and its event, commit, broadcast.
    fn write(
        &self,
        kind: Kind,
        name: &str,
        context: &'static str,
        f: impl FnOnce(Option<Value>, u64) -> Result<(EventType, Write)>,
    ) -> Result<Value> {
        let db_err = |e: redb::Error| StoreError::db(context)(e);
        // A poisoned mutex only means another writer panicked between commit
        // and broadcast; the db itself is consistent, so carry on.
        let _guard = self
            .inner
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let txn = self.inner.db.begin_write().map_err(|e| db_err(e.into()))?;
        let k = key(kind, name);
        let event = {
            let mut objects = txn.open_table(OBJECTS).map_err(|e| db_err(e.into()))?;
            let mut events = txn.open_table(EVENTS).map_err(|e| db_err(e.into()))?;
            let mut meta = txn.open_table(META).map_err(|e| db_err(e.into()))?;
            let stored: Option<Value> =
                match objects.get(k.as_str()).map_err(|e| db_err(e.into()))? {
                    Some(bytes) => Some(decode(&k, bytes.value())?),
                    None => None,
                };
            let rv = meta
                .get(META_RV)
                .map_err(|e| db_err(e.into()))?
                .map(|g| g.value())
                .unwrap_or(0)
                + 1;
            let (type_, write) = f(stored, rv)?;
            let object = match write {
                Write::Put(object) => {
                    objects
                        .insert(k.as_str(), encode(&k, &object)?.as_slice())
                        .map_err(|e| db_err(e.into()))?;
                    object
                }
                Write::Remove(object) => {
                    objects.remove(k.as_str()).map_err(|e| db_err(e.into()))?;
                    object
                }
            };
            meta.insert(META_RV, rv).map_err(|e| db_err(e.into()))?;
            let event = WatchEvent {
                type_,
                kind,
                name: name.to_string(),
                resource_version: rv,
                object,
            };
            events
                .insert(rv, encode(&k, &event)?.as_slice())
                .map_err(|e| db_err(e.into()))?;
            // Trim the log to its limit; in steady state one entry per write.
            if rv > self.inner.log_limit {
                let floor = rv - self.inner.log_limit;
                let mut pruned = None;
                loop {
                    let first = events
                        .first()
                        .map_err(|e| db_err(e.into()))?
                        .map(|(k, _)| k.value());
                    match first {
                        Some(first) if first <= floor => {
                            events.remove(first).map_err(|e| db_err(e.into()))?;
                            pruned = Some(first);
                        }
                        _ => break,
                    }
                }
                if let Some(p) = pruned {
                    meta.insert(META_PRUNED, p).map_err(|e| db_err(e.into()))?;
                }
            }
            event
        };
        txn.commit().map_err(|e| db_err(e.into()))?;
        let object = event.object.clone();
        let rv = event.resource_version;
        // No receivers is fine: nobody is watching.
        let _ = self.inner.events.send(event);
        tracing::debug!(%kind, name, rv, "{context}");
        Ok(object)
    }

    /// Events after `since` from the db, plus a subscription that continues
    /// from there.
    fn watch_sync(&self, kind: Option<Kind>, since: u64) -> Result<WatchStream> {
        let rx = self.inner.events.subscribe();
        let db_err = |e: redb::Error| StoreError::db("reading the event log")(e);
        let txn = self.inner.db.begin_read().map_err(|e| db_err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| db_err(e.into()))?;
        let pruned_through = meta
            .get(META_PRUNED)
            .map_err(|e| db_err(e.into()))?
            .map(|g| g.value())
            .unwrap_or(0);
        if since < pruned_through {
            return Err(StoreError::Expired {
                since,
                pruned_through,
            });
        }
        let events = txn.open_table(EVENTS).map_err(|e| db_err(e.into()))?;
        let mut catch_up = Vec::new();
        let mut last = since;
        for entry in events.range(since + 1..).map_err(|e| db_err(e.into()))? {
            let (rv, bytes) = entry.map_err(|e| db_err(e.into()))?;
            let event: WatchEvent = decode("an event", bytes.value())?;
            last = rv.value();
            if kind.is_none_or(|k| k == event.kind) {
                catch_up.push(event);
            }
        }
        struct State {
            catch_up: std::vec::IntoIter<WatchEvent>,
            rx: broadcast::Receiver<WatchEvent>,
            last: u64,
            kind: Option<Kind>,
            done: bool,
        }
        let state = State {
            catch_up: catch_up.into_iter(),
            rx,
            last,
            kind,
            done: false,
        };
        let s = stream::unfold(state, |mut st| async move {
            if st.done {
                return None;
            }
            if let Some(ev) = st.catch_up.next() {
                return Some((Ok(ev), st));
            }
            loop {
                match st.rx.recv().await {
                    Ok(ev) if ev.resource_version <= st.last => continue,
                    Ok(ev) => {
                        st.last = ev.resource_version;
                        if st.kind.is_none_or(|k| k == ev.kind) {
                            return Some((Ok(ev), st));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        st.done = true;
                        let since = st.last;
                        return Some((
                            Err(StoreError::Expired {
                                since,
                                pruned_through: since + 1,
                            }),
                            st,
                        ));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(Box::pin(s))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(EmbeddedStore) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(me))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
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
    async fn get(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let name = name.to_string();
        self.blocking(move |s| s.get_sync(kind, &name)).await
    }
    async fn list(&self, kind: Kind) -> Result<(Vec<Value>, u64)> {
        self.blocking(move |s| s.list_sync(kind)).await
    }
    async fn watch(&self, kind: Option<Kind>, since: u64) -> Result<WatchStream> {
        self.blocking(move |s| s.watch_sync(kind, since)).await
    }
    async fn create(&self, object: Value) -> Result<Value> {
        self.blocking(move |s| s.create_sync(object)).await
    }
    async fn update(&self, object: Value) -> Result<Value> {
        self.blocking(move |s| s.update_sync(object)).await
    }
    async fn update_status(&self, object: Value) -> Result<Value> {
        self.blocking(move |s| s.update_status_sync(object)).await
    }
    async fn delete(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let name = name.to_string();
        self.blocking(move |s| s.delete_sync(kind, &name)).await
    }
}

#[cfg(test)]
mod tests;
