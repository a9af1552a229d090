//! Where the engine's part of a write and a flush goes (issue 19's breakdown), as counters
//! shown in the engine's `Info` beside the checksum counters.
//!
//! For each write and each flush a frontend hands the volume, three spans are added up, in
//! nanoseconds:
//!
//! ```text
//!   frontend    request parsed ─► device call ─┐          ┌─► reply queued for the socket
//!   replicator                     Volume::write/flush ──────┘   (gate, range lock, CRC32C,
//!                                                                 membership, group commit)
//!   transport                        └─ sent to the replicas ─► the last answer
//!                                       (network + the replica's own work, fdatasync too)
//! ```
//!
//! `frontend` is the frontend's own time around the device call (`frontend_total - replicator`
//! per request, reported as the total of requests that went through a frontend);
//! `replicator` is the whole device call; `transport` is the part of it spent waiting for
//! the replicas (the slowest one: they run in parallel). So the engine's own bookkeeping in a
//! write is `replicator - transport`, and what the replicas and the network cost is
//! `transport`. Flushes answered by another caller's flush (group commit) count in
//! `flushes_shared` and add only their wait to `replicator`.
//!
//! Relaxed atomics: two `fetch_add`s per span, cheap beside a network round trip.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The counters of one kind of request.
#[derive(Default)]
pub struct Spans {
    count: AtomicU64,
    frontend_ns: AtomicU64,
    replicator_ns: AtomicU64,
    transport_ns: AtomicU64,
}

/// What [`Spans`] hold at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpanTotals {
    /// Requests counted (device calls).
    pub count: u64,
    /// Frontend time around the device call, summed over requests that came from a frontend.
    pub frontend_ns: u64,
    /// Time inside the device call.
    pub replicator_ns: u64,
    /// Of that, waiting for the replicas' answers.
    pub transport_ns: u64,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Spans {
    pub fn device_call(&self, took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.replicator_ns.fetch_add(ns(took), Ordering::Relaxed);
    }

    pub fn transport(&self, took: Duration) {
        self.transport_ns.fetch_add(ns(took), Ordering::Relaxed);
    }

    pub fn frontend(&self, took: Duration) {
        self.frontend_ns.fetch_add(ns(took), Ordering::Relaxed);
    }

    pub fn totals(&self) -> SpanTotals {
        SpanTotals {
            count: self.count.load(Ordering::Relaxed),
            frontend_ns: self.frontend_ns.load(Ordering::Relaxed),
            replicator_ns: self.replicator_ns.load(Ordering::Relaxed),
            transport_ns: self.transport_ns.load(Ordering::Relaxed),
        }
    }
}

/// The write and flush counters of one volume.
#[derive(Default)]
pub struct PathCounters {
    pub writes: Spans,
    pub flushes: Spans,
    /// Flushes answered by a flush that started after they arrived (group commit).
    flushes_shared: AtomicU64,
}

/// What [`PathCounters`] hold at one moment, for `Info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathTotals {
    pub writes: SpanTotals,
    pub flushes: SpanTotals,
    pub flushes_shared: u64,
}

impl PathCounters {
    pub fn flush_shared(&self) {
        self.flushes_shared.fetch_add(1, Ordering::Relaxed);
    }

    pub fn totals(&self) -> PathTotals {
        PathTotals {
            writes: self.writes.totals(),
            flushes: self.flushes.totals(),
            flushes_shared: self.flushes_shared.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_add_up() {
        let c = PathCounters::default();
        c.writes.device_call(Duration::from_micros(100));
        c.writes.transport(Duration::from_micros(60));
        c.writes.frontend(Duration::from_micros(5));
        c.flushes.device_call(Duration::from_micros(900));
        c.flush_shared();
        let t = c.totals();
        assert_eq!(t.writes.count, 1);
        assert_eq!(t.writes.replicator_ns, 100_000);
        assert_eq!(t.writes.transport_ns, 60_000);
        assert_eq!(t.writes.frontend_ns, 5_000);
        assert_eq!(t.flushes.count, 1);
        assert_eq!(t.flushes_shared, 1);
    }
}
