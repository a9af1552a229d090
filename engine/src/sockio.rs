//! Small pieces the NBD server and the iSCSI target share in their connection loops: both
//! serve a connection from one task that waits for the socket to be readable (room for more
//! requests) and/or writable (answers queued), both queue answers as a list of byte chunks
//! written with vectored writes, and both refuse connections over their limit.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::Interest;
use tokio::time::Instant;

/// What to wait for on the socket: readable when the loop wants input, writable when it has
/// output queued; `None` when neither (the loop then waits only for running commands).
pub(crate) fn interest(want_read: bool, want_write: bool) -> Option<Interest> {
    match (want_read, want_write) {
        (true, true) => Some(Interest::READABLE | Interest::WRITABLE),
        (true, false) => Some(Interest::READABLE),
        (false, true) => Some(Interest::WRITABLE),
        (false, false) => None,
    }
}

/// Drops the first `n` bytes of `chunks` (they were written): whole chunks first, then the
/// front of a partly written one. Returns how many bytes of `n` were not there (0 when the
/// caller's accounting is right).
pub(crate) fn consume(chunks: &mut VecDeque<Bytes>, n: usize) -> usize {
    let mut left = n;
    while left > 0 {
        let Some(front) = chunks.front_mut() else {
            break;
        };
        if front.len() <= left {
            left -= front.len();
            chunks.pop_front();
        } else {
            front.advance(left);
            left = 0;
        }
    }
    left
}

/// Logs refused connections without letting a flood of them flood the log: the first one,
/// then at most one line per interval with the count since.
#[derive(Default)]
pub(crate) struct Refusals {
    last_log: Option<Instant>,
    since: u64,
}

impl Refusals {
    const INTERVAL: Duration = Duration::from_secs(10);

    pub(crate) fn note(&mut self, peer: SocketAddr, max: usize) {
        self.since += 1;
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Self::INTERVAL)
        {
            tracing::warn!(
                %peer,
                max_connections = max,
                refused = self.since,
                "too many connections: refusing"
            );
            self.last_log = Some(now);
            self.since = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consume_drops_whole_then_partial_chunks() {
        let mut q: VecDeque<Bytes> = [&b"abc"[..], b"de", b"fghij"]
            .into_iter()
            .map(Bytes::from_static)
            .collect();
        assert_eq!(consume(&mut q, 4), 0);
        assert_eq!(q, [Bytes::from_static(b"e"), Bytes::from_static(b"fghij")]);
        assert_eq!(consume(&mut q, 3), 0);
        assert_eq!(q, [Bytes::from_static(b"hij")]);
        assert_eq!(consume(&mut q, 5), 2, "two bytes more than queued");
        assert!(q.is_empty());
    }

    #[test]
    fn interest_matches_what_the_loop_wants() {
        assert_eq!(interest(false, false), None);
        assert_eq!(interest(true, false), Some(Interest::READABLE));
        assert_eq!(interest(false, true), Some(Interest::WRITABLE));
        assert_eq!(
            interest(true, true),
            Some(Interest::READABLE | Interest::WRITABLE)
        );
    }
}
