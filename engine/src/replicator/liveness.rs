//! Replica liveness without I/O: every [`ping_interval`] the engine pings each RW and WO
//! replica over its data path, with the I/O timeout, so a dead replica (connection gone:
//! the ping fails at once) or a hung one (SIGSTOP, a stuck disk thread: no answer) goes ERR
//! within one interval plus the I/O timeout even when the volume is idle, and the manager,
//! which restarts and re-adds replicas the engine has as ERR, does not wait for a write to
//! learn of it. A failed ping records the new membership at once, as a failed write would
//! before its acknowledgement.
//!
//! A ping is the `Ping` op from protocol version 3 on (a header each way) and a 4 KiB read
//! for older replicas. Pings take their ids from a space of their own (top bit set), so they
//! do not count as requests: an idle volume stays idle to [`Volume::requests_started`] (which
//! the heap trim watches).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Mode, Volume, timed};

/// The longest time between two pings of a replica.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(2);
/// Ping ids: the top bit set, so they never meet the volume's request ids.
const PING_ID_BASE: u64 = 1 << 63;

/// How often replicas are pinged: every 2 s, or half the I/O timeout if that is shorter.
pub(super) fn ping_interval(io_timeout: Duration) -> Duration {
    MAX_PING_INTERVAL
        .min(io_timeout / 2)
        .max(Duration::from_millis(100))
}

impl Volume {
    /// Starts pinging the replicas until the volume is dropped.
    pub fn start_liveness(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let interval = ping_interval(self.io_timeout());
        tokio::spawn(ping_loop(weak, interval));
    }

    /// Pings every RW and WO replica once; those that fail go ERR.
    pub async fn ping_replicas(&self) {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let targets = self.with_mode(&[Mode::RW, Mode::WO]);
        let pings = targets.iter().map(|r| {
            let p = r.data.clone();
            let id =
                zebu_proto::ids::RequestId(PING_ID_BASE | NEXT.fetch_add(1, Ordering::Relaxed));
            timed(
                r,
                Box::pin(async move { p.ping(id).await }),
                self.io_timeout(),
            )
        });
        let results = futures::future::join_all(pings).await;
        let mut failed = false;
        for (r, res) in targets.iter().zip(results) {
            if let Err(e) = res {
                self.fail(r, &format!("ping: {e}"));
                failed = true;
            }
        }
        if failed && let Err(e) = self.commit_membership().await {
            tracing::warn!(volume = %self.name(), "after a failed ping: {e}");
        }
    }
}

async fn ping_loop(volume: Weak<Volume>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(v) = volume.upgrade() else { return };
        v.ping_replicas().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_follows_the_io_timeout_within_bounds() {
        assert_eq!(
            ping_interval(Duration::from_secs(5)),
            Duration::from_secs(2)
        );
        assert_eq!(
            ping_interval(Duration::from_secs(2)),
            Duration::from_secs(1)
        );
        assert_eq!(
            ping_interval(Duration::from_millis(50)),
            Duration::from_millis(100)
        );
    }
}
