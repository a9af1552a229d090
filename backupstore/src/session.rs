//! Session markers: how a running writer tells GC which packs it may still reference.
//!
//! A writer creates `families/FAMILY/sessions/ID.json` before it reads the family index,
//! records the server's time of that first put as its start, and rewrites the marker every
//! `heartbeat` so its modification time stays fresh. It deletes the marker after its
//! manifest is committed (or when it gives up). GC reads the markers: one whose modification
//! time is within `ttl` of the server's present is *live*, and a live session that started
//! before a condemnation was written blocks that condemnation (see [`crate::gc`]). Both times
//! are the server's, so the writer's and GC's clocks never need to agree.
//!
//! A writer that cannot keep its marker fresh (heartbeats failing, or it was stopped for
//! longer than half the ttl) refuses to commit: GC may have stopped waiting for it.
//!
//! Ending a session stops the heartbeat and waits for a put it has in flight *before* it
//! deletes the marker. Aborting the heartbeat task is not enough: a put already handed to
//! the target (a blocking file write, a request the server has received) completes anyway,
//! and one that lands after the delete brings the marker back. Such a marker, of a session
//! that started before every later condemnation, held back GC's deletions for a whole ttl
//! (it once made `mostly_dead_packs_are_repacked_and_every_backup_still_restores` fail).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::error::{BackupError, Result};
use crate::ids::{FamilyId, SessionId};
use crate::target::Target;

/// How long a marker stays live without a heartbeat, and how often it is refreshed.
#[derive(Clone, Copy, Debug)]
pub struct SessionTimes {
    pub ttl: Duration,
    pub heartbeat: Duration,
}

impl Default for SessionTimes {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(600),
            heartbeat: Duration::from_secs(60),
        }
    }
}

/// The marker's body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SessionBody {
    pub session: String,
    /// What the session is doing (a backup name, or "gc repack").
    pub purpose: String,
    /// Server time of the marker's first put, ms since the epoch; absent until known.
    pub started_ms: Option<i64>,
    pub pid: u32,
    /// The ttl this writer keeps to (it refreshes well within it and refuses to commit after
    /// half of it without a refresh); GC judges the marker by it.
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// How long [`Session::end`] waits for a heartbeat put in flight before deleting the marker
/// anyway (a marker that reappears then only delays GC by a ttl; it is never unsafe).
const STOP_WAIT: Duration = Duration::from_secs(30);

/// The relative key of a session marker.
pub fn session_rel(family: &FamilyId, id: SessionId) -> String {
    format!("families/{family}/sessions/{id}.json")
}

/// A registered session with its heartbeat running.
pub struct Session {
    target: Arc<Target>,
    pub id: SessionId,
    key: object_store::path::Path,
    times: SessionTimes,
    born: Instant,
    /// Milliseconds after `born` of the last successful heartbeat.
    last_ok: Arc<AtomicU64>,
    /// Dropping or sending it stops the heartbeat between puts.
    stop: Option<oneshot::Sender<()>>,
    beat: Option<JoinHandle<()>>,
}

impl Session {
    /// Creates the marker and starts the heartbeat.
    pub async fn start(
        target: Arc<Target>,
        family: &FamilyId,
        purpose: &str,
        times: SessionTimes,
    ) -> Result<Self> {
        let id = SessionId::random();
        let key = target.key(&session_rel(family, id));
        let mut body = SessionBody {
            session: id.to_string(),
            purpose: purpose.to_string(),
            started_ms: None,
            pid: std::process::id(),
            ttl_ms: Some(times.ttl.as_millis() as u64),
        };
        let born = Instant::now();
        let json =
            |b: &SessionBody| Bytes::from(serde_json::to_vec(b).expect("invariant: serialises"));
        if !target.put_create(&key, json(&body)).await? {
            return Err(BackupError::Task(format!("session id {id} collided")));
        }
        let meta = target
            .head(&key)
            .await?
            .ok_or_else(|| BackupError::Task(format!("session marker {key} vanished")))?;
        body.started_ms = Some(meta.last_modified.timestamp_millis());
        target.put(&key, json(&body)).await?;
        let last_ok = Arc::new(AtomicU64::new(0));
        let (stop, mut stopped) = oneshot::channel::<()>();
        let beat = {
            let (target, key, last_ok) = (target.clone(), key.clone(), last_ok.clone());
            let payload = json(&body);
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        () = tokio::time::sleep(times.heartbeat) => {}
                    }
                    // Never cancelled half way by `end`, which waits for it (module docs).
                    let t = born.elapsed().as_millis() as u64;
                    match target.put(&key, payload.clone()).await {
                        Ok(()) => last_ok.store(t, Ordering::Release),
                        Err(e) => tracing::warn!(%key, error = %e, "session heartbeat failed"),
                    }
                }
            })
        };
        tracing::debug!(session = %id, purpose, "session started");
        Ok(Self {
            target,
            id,
            key,
            times,
            born,
            last_ok,
            stop: Some(stop),
            beat: Some(beat),
        })
    }

    /// Fails unless the marker was refreshed recently enough that every GC still counts it live.
    pub fn check_alive(&self) -> Result<()> {
        let since = self
            .born
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ok.load(Ordering::Acquire)));
        if since < self.times.ttl / 2 {
            Ok(())
        } else {
            Err(BackupError::SessionExpired {
                session: self.id.to_string(),
                reason: format!("last heartbeat {since:?} ago, ttl {:?}", self.times.ttl),
            })
        }
    }

    /// Stops the heartbeat, waits for a put it has in flight, and deletes the marker.
    pub async fn end(mut self) -> Result<()> {
        drop(self.stop.take());
        if let Some(mut beat) = self.beat.take()
            && tokio::time::timeout(STOP_WAIT, &mut beat).await.is_err()
        {
            tracing::warn!(session = %self.id, "a session heartbeat did not finish within {STOP_WAIT:?}; deleting the marker anyway");
            beat.abort();
        }
        self.target.delete(&self.key).await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // A dropped (not ended) session stops refreshing; GC treats it as dead after the ttl.
        if let Some(beat) = &self.beat {
            beat.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::TargetConfig;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ended_session_marker_never_comes_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = TargetConfig::with_settings(
            format!("file://{}", dir.path().display()),
            crate::target::S3Settings::default(),
        );
        let target = Arc::new(Target::open(&cfg).await.expect("file target"));
        let family = FamilyId::new("f").expect("family id");
        // A heartbeat every millisecond: most ends meet a put in flight (a blocking file
        // write that aborting the task does not stop).
        let times = SessionTimes {
            ttl: Duration::from_secs(6),
            heartbeat: Duration::from_millis(1),
        };
        for round in 0..40u64 {
            let s = Session::start(target.clone(), &family, "test", times)
                .await
                .expect("session starts");
            tokio::time::sleep(Duration::from_millis(round % 7)).await;
            let key = s.key.clone();
            s.end().await.expect("session ends");
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(
                target.head(&key).await.expect("head").is_none(),
                "round {round}: the marker of an ended session is back"
            );
        }
    }
}
