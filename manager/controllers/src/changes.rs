//! Waking a control loop when the objects it reads change, instead of at its next period.
//!
//! A loop that only runs every second makes every step of an operation that crosses loops
//! (volume created → replicas scheduled → processes started → restore job started → job
//! done → status written) wait up to a period; a restore of a 1 GiB volume spent about two
//! of its five seconds so. [`Changes`] watches the kinds a loop reads ([`KindWatcher`], so
//! it behaves the same on every store) and lets the loop sleep until one of them changes or
//! its period ends, whichever is first: the period stays as the floor that catches what no
//! event shows (a process that exited, a file that changed).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zebu_types::store::{KindWatcher, WatchChange, WatchEvent};
use zebu_types::{Kind, Store};

/// How long a loop waits after a change before its pass: a burst of writes (a volume and
/// its three replicas, a status and its owner's) lands as one pass, not one per write.
pub const SETTLE: Duration = Duration::from_millis(20);

/// How long a watch that failed waits before it tries again.
const RETRY: Duration = Duration::from_secs(1);

/// Which changes of a kind wake the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Every write.
    Any,
    /// An object created or removed, its spec changed (a new `metadata.generation`), or its
    /// deletion begun: not a write of its status alone. For a loop that writes the status
    /// of the kind itself (a restore's progress in its volume's status), which would
    /// otherwise wake itself after every pass.
    Spec,
}

/// Watches some kinds of a store for one loop; see the module docs. Dropping it stops the
/// watches.
pub struct Changes {
    seen: watch::Receiver<u64>,
    watchers: Vec<JoinHandle<()>>,
}

/// What [`Wake::Spec`] compares: the generation and whether deletion has begun.
fn spec_mark(o: &Value) -> (Option<u64>, bool) {
    let meta = o.get("metadata");
    let generation = meta
        .and_then(|m| m.get("generation"))
        .and_then(Value::as_u64);
    let deleting = meta.and_then(|m| m.get("deletionTimestamp")).is_some();
    (generation, deleting)
}

fn name_of(o: &Value) -> String {
    o.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// Whether a change wakes a loop that watches with `wake`; `marks` follows the objects for
/// [`Wake::Spec`].
fn wakes(wake: Wake, marks: &mut HashMap<String, (Option<u64>, bool)>, c: &WatchChange) -> bool {
    match c {
        WatchChange::Listed(items) => {
            marks.clear();
            if wake == Wake::Spec {
                marks.extend(items.iter().map(|o| (name_of(o), spec_mark(o))));
            }
            true
        }
        WatchChange::Event(WatchEvent::Bookmark(_)) => false,
        WatchChange::Event(WatchEvent::Added(o)) => {
            if wake == Wake::Spec {
                marks.insert(name_of(o), spec_mark(o));
            }
            true
        }
        WatchChange::Event(WatchEvent::Deleted(o)) => {
            marks.remove(&name_of(o));
            true
        }
        WatchChange::Event(WatchEvent::Modified(o)) => match wake {
            Wake::Any => true,
            Wake::Spec => {
                let mark = spec_mark(o);
                marks.insert(name_of(o), mark) != Some(mark)
            }
        },
    }
}

impl Changes {
    /// Starts a watch of each kind (each lists first: that counts as a change, so the
    /// loop's first wait after its start may end at once).
    pub fn watch(store: Arc<dyn Store>, kinds: &[(Kind, Wake)]) -> Self {
        let (tx, seen) = watch::channel(0u64);
        let tx = Arc::new(tx);
        let watchers = kinds
            .iter()
            .map(|&(kind, wake)| {
                let store = store.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut w = KindWatcher::new(store, kind);
                    let mut marks = HashMap::new();
                    loop {
                        match w.next().await {
                            Ok(c) => {
                                if wakes(wake, &mut marks, &c) {
                                    tx.send_modify(|n| *n = n.wrapping_add(1));
                                }
                            }
                            Err(e) => {
                                tracing::warn!(%kind, "watch: {e}");
                                tokio::time::sleep(RETRY).await;
                            }
                        }
                    }
                })
            })
            .collect();
        Changes { seen, watchers }
    }

    /// Waits until a watched change came since the last call returned (then [`SETTLE`]
    /// longer), or `period` passed, whichever is first.
    pub async fn wait(&mut self, period: Duration) {
        let changed = async {
            if self.seen.changed().await.is_ok() {
                tokio::time::sleep(SETTLE).await;
                self.seen.mark_unchanged();
            } else {
                // Every watch task is gone (the runtime is shutting down): the period only.
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(period) => {}
        }
    }
}

impl Drop for Changes {
    fn drop(&mut self) {
        for w in &self.watchers {
            w.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use zebu_store::EmbeddedStore;
    use zebu_types::resources::{Backup, BackupSpec, Setting, SettingSpec};
    use zebu_types::store::TypedStore;

    /// Waits (at most `period`) and says how long it took.
    async fn timed(c: &mut Changes, period: Duration) -> Duration {
        let t = Instant::now();
        c.wait(period).await;
        t.elapsed()
    }

    #[tokio::test]
    async fn a_spec_watch_wakes_for_creations_and_spec_changes_not_for_status_or_other_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).unwrap());
        let mut c = Changes::watch(store.clone(), &[(Kind::Backup, Wake::Spec)]);
        // The first list counts as a change; let it pass.
        c.wait(Duration::from_secs(5)).await;
        let quiet = Duration::from_millis(300);
        let loud = Duration::from_secs(30);

        // A write of a kind not watched: the wait lasts its whole period.
        let setting = Setting::new("s1", SettingSpec { value: "1".into() });
        store.create_as(&setting).await.unwrap();
        let waited = timed(&mut c, quiet).await;
        assert!(
            waited >= quiet - Duration::from_millis(10),
            "a setting ended the wait after {waited:?}"
        );

        // A backup created 100 ms into a 30 s wait ends it.
        let writer = {
            let store = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let b = Backup::new(
                    "b1",
                    BackupSpec {
                        volume: "v1".into(),
                        snapshot: "s".into(),
                        backup_target: "default".into(),
                        labels: Default::default(),
                    },
                );
                store.create_as(&b).await.unwrap()
            })
        };
        let waited = timed(&mut c, loud).await;
        let mut b = writer.await.unwrap();
        assert!(
            (Duration::from_millis(100)..Duration::from_secs(10)).contains(&waited),
            "a backup was created 100 ms in, and the wait lasted {waited:?}"
        );

        // Its status written (progress): no wake.
        b.status.progress = 42;
        let b = store.update_status_as(&b).await.unwrap();
        let waited = timed(&mut c, quiet).await;
        assert!(
            waited >= quiet - Duration::from_millis(10),
            "a status write ended the wait after {waited:?}"
        );

        // Its spec changed, before the loop waits: the next wait ends at once.
        let mut b2 = b.clone();
        b2.spec.labels.insert("k".into(), "v".into());
        store.update_as(&b2).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let waited = timed(&mut c, loud).await;
        assert!(
            waited < Duration::from_secs(10),
            "a spec change was missed: {waited:?}"
        );

        // Deleted: a wake.
        store.delete(Kind::Backup, "b1").await.unwrap();
        let waited = timed(&mut c, loud).await;
        assert!(
            waited < Duration::from_secs(10),
            "a deletion was missed: {waited:?}"
        );
    }
}
