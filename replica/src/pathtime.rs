//! Where the replica's part of a write and a flush goes (issue 19's breakdown), as counters
//! that stay on: per step, how many times it ran and the nanoseconds it took in total.
//!
//! ```text
//!  socket ─► frame decoded ──queued──► store call ──────────────store──────────────► done ──answer──► on the socket
//!                                       write: mark (regions.dat, may fdatasync), data (pwrite / O_DIRECT)
//!                                       flush: lock (one flush at a time), drain (earlier writes),
//!                                              sync (head fdatasync ‖ sums write-back), check (fstat),
//!                                              record (regions.dat header)
//! ```
//!
//! - `queued`: from the moment the connection decoded the request to the moment the store
//!   call starts (the request's budget, the connection task polling it, the state guard).
//! - `store`: the store call, split into the steps above; `sync` is the head's fdatasync and
//!   the write-back of the staged sums run in parallel, `head sync` / `sums sync` each of them
//!   (so `sync` ≈ the larger).
//! - `answer`: from the store's answer to the end of the write that put it on the socket
//!   (answers ready at once share one vectored write).
//!
//! What the engine's counters call `transport` (`engine/src/pathtime.rs`) minus what these
//! add up to is the way there and back: sockets, and the wake-ups of the threads on both
//! ends. Only the frames transport counts `queued` and `answer` (the gRPC one is the slow
//! fallback); the store steps are counted whatever the transport.
//!
//! Relaxed atomics, two `fetch_add`s per step: a few nanoseconds beside a system call.
//! `zebu-replica serve` logs them as one JSON line on `SIGUSR1` (and when it stops).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One measured step of a write or a flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    WriteQueued,
    WriteStore,
    /// Waiting for the write's regions to be durably marked dirty (`regions.rs`).
    WriteMark,
    /// The data write into the head.
    WriteData,
    WriteAnswer,
    FlushQueued,
    FlushStore,
    /// Waiting for the flush under way, if any (one flush runs at a time).
    FlushLock,
    /// Waiting for the writes tagged with this flush's number to complete.
    FlushDrain,
    /// The head's fdatasync and the write-back of its staged sums, in parallel.
    FlushSync,
    FlushHeadSync,
    /// Writing back the staged sums into the checksum file (its fdatasync follows in the
    /// background, `store/sumsync.rs`).
    FlushSumsSync,
    /// `fstat` of the open files (`health.rs`).
    FlushCheck,
    /// Recording the flush number in `regions.dat`.
    FlushRecord,
    FlushAnswer,
    /// A commit of `regions.dat` pages (write + fdatasync) for region marks.
    MarkCommit,
}

impl Step {
    pub const ALL: [Step; 16] = [
        Step::WriteQueued,
        Step::WriteStore,
        Step::WriteMark,
        Step::WriteData,
        Step::WriteAnswer,
        Step::FlushQueued,
        Step::FlushStore,
        Step::FlushLock,
        Step::FlushDrain,
        Step::FlushSync,
        Step::FlushHeadSync,
        Step::FlushSumsSync,
        Step::FlushCheck,
        Step::FlushRecord,
        Step::FlushAnswer,
        Step::MarkCommit,
    ];

    /// The step's name in the JSON line.
    pub fn name(self) -> &'static str {
        match self {
            Step::WriteQueued => "writeQueued",
            Step::WriteStore => "writeStore",
            Step::WriteMark => "writeMark",
            Step::WriteData => "writeData",
            Step::WriteAnswer => "writeAnswer",
            Step::FlushQueued => "flushQueued",
            Step::FlushStore => "flushStore",
            Step::FlushLock => "flushLock",
            Step::FlushDrain => "flushDrain",
            Step::FlushSync => "flushSync",
            Step::FlushHeadSync => "flushHeadSync",
            Step::FlushSumsSync => "flushSumsSync",
            Step::FlushCheck => "flushCheck",
            Step::FlushRecord => "flushRecord",
            Step::FlushAnswer => "flushAnswer",
            Step::MarkCommit => "markCommit",
        }
    }
}

/// One step's counters, a cache line to itself: the replica's threads add to different steps
/// at once, and counters sharing a line would make every add a cache-line transfer.
#[repr(align(64))]
struct Counter {
    count: AtomicU64,
    ns: AtomicU64,
}

/// The counters of one replica process (shared through its [`IoEngine`](crate::io::IoEngine)).
pub struct PathTimes {
    steps: [Counter; Step::ALL.len()],
}

impl Default for PathTimes {
    fn default() -> PathTimes {
        PathTimes::new()
    }
}

impl PathTimes {
    pub const fn new() -> PathTimes {
        PathTimes {
            steps: [const {
                Counter {
                    count: AtomicU64::new(0),
                    ns: AtomicU64::new(0),
                }
            }; Step::ALL.len()],
        }
    }

    pub fn add(&self, step: Step, took: Duration) {
        let c = &self.steps[step as usize];
        c.count.fetch_add(1, Ordering::Relaxed);
        c.ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Adds the time since `since` to `step`.
    pub fn since(&self, step: Step, since: Instant) {
        self.add(step, since.elapsed());
    }

    /// `(count, total ns)` of one step.
    pub fn get(&self, step: Step) -> (u64, u64) {
        let c = &self.steps[step as usize];
        (
            c.count.load(Ordering::Relaxed),
            c.ns.load(Ordering::Relaxed),
        )
    }

    /// Every step as `{"name": {"count": n, "ns": t}, ...}`, one line.
    pub fn to_json(&self) -> String {
        let steps: serde_json::Map<String, serde_json::Value> = Step::ALL
            .iter()
            .map(|s| {
                let (count, ns) = self.get(*s);
                (
                    s.name().to_string(),
                    serde_json::json!({"count": count, "ns": ns}),
                )
            })
            .collect();
        serde_json::Value::Object(steps).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_has_its_own_slot_and_adds_up() {
        for (i, s) in Step::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{s:?} is out of order in Step::ALL");
        }
        let t = PathTimes::default();
        t.add(Step::FlushHeadSync, Duration::from_micros(300));
        t.add(Step::FlushHeadSync, Duration::from_micros(200));
        t.add(Step::WriteData, Duration::from_nanos(7));
        assert_eq!(t.get(Step::FlushHeadSync), (2, 500_000));
        assert_eq!(t.get(Step::WriteData), (1, 7));
        assert_eq!(t.get(Step::FlushSumsSync), (0, 0));
        let json: serde_json::Value = serde_json::from_str(&t.to_json()).expect("valid JSON");
        assert_eq!(json["flushHeadSync"]["count"], 2);
        assert_eq!(json["flushHeadSync"]["ns"], 500_000);
        assert_eq!(json["markCommit"]["count"], 0);
    }
}
