//! Small pieces the NBD server and the iSCSI target share in their connection loops: both
//! serve a connection from one task that waits for the socket to be readable (room for more
//! requests) and/or writable (answers queued), both queue answers as a list of byte chunks
//! written with vectored writes, both refuse connections over their limit, and both drop a
//! client that leaves its answers unread ([`StallWatch`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::Interest;
use tokio::net::TcpStream;
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

/// Bytes the kernel holds in `stream`'s send queue that the peer has not acknowledged yet
/// (`SIOCOUTQ`); None if the kernel does not say.
pub(crate) fn unacked_bytes(stream: &TcpStream) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: the descriptor is `stream`'s open socket, valid while the borrow lasts;
    // SIOCOUTQ (TIOCOUTQ) writes one c_int through the pointer, which points to `n`.
    let r = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r != 0 {
        return None;
    }
    usize::try_from(n).ok()
}

/// Tells a client that does not read its answers from one that reads slowly.
///
/// The connection loop sees progress only when a write to the socket succeeds, and the
/// kernel wakes a writer only once a good part of the send buffer is free: a client reading
/// a few hundred KB/s can leave a writer asleep for seconds with megabytes buffered. So when
/// the stall clock runs out, the kernel's count of unacknowledged bytes decides: if the
/// client took any since the clock started, it is reading and the clock starts again;
/// otherwise it has taken nothing for the whole timeout and the caller drops it.
pub(crate) struct StallWatch {
    timeout: Duration,
    /// When answers started waiting without progress, and the send queue then.
    since: Option<(Instant, Option<usize>)>,
}

impl StallWatch {
    pub(crate) fn new(timeout: Duration) -> StallWatch {
        StallWatch {
            timeout,
            since: None,
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Caps the timeout (the server is shutting down: a client that reads nothing must not
    /// hold the shutdown up for the whole timeout).
    pub(crate) fn shorten(&mut self, limit: Duration) {
        self.timeout = self.timeout.min(limit);
    }

    /// Bytes were written: whatever wait there was is over.
    pub(crate) fn progressed(&mut self) {
        self.since = None;
    }

    /// The deadline of the current wait, starting the clock if it is not running. Called
    /// only when the loop is about to wait with answers queued, so the clock and the system
    /// call cost nothing while the socket keeps up.
    pub(crate) fn deadline(&mut self, stream: &TcpStream) -> Instant {
        let (t, _) = *self
            .since
            .get_or_insert_with(|| (Instant::now(), unacked_bytes(stream)));
        t + self.timeout
    }

    /// At the deadline: true if the client took nothing since the clock started; otherwise
    /// the clock starts again from now.
    pub(crate) fn expired(&mut self, stream: &TcpStream) -> bool {
        let now = unacked_bytes(stream);
        match self.since {
            Some((_, Some(before))) if now.is_some_and(|n| n < before) => {
                self.since = Some((Instant::now(), now));
                false
            }
            _ => true,
        }
    }
}

/// How long a connection may still take to hand its last answers to its client once the
/// server shuts down, when that client reads nothing at all.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

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

    /// The kernel's count is what tells a slow reader from one that reads nothing: it stays
    /// put while the peer reads nothing, and falls as soon as it reads.
    #[tokio::test]
    async fn unacked_bytes_fall_only_when_the_peer_reads() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut peer = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (ours, _) = listener.accept().await.expect("accept");
        // Fill every buffer between the two sockets. The receiving kernel may still take in
        // (and acknowledge) a little while it packs its queue, so fill until the count
        // settles.
        let chunk = vec![7u8; 1 << 16];
        let mut full = 0;
        for _ in 0..50 {
            loop {
                match ours.try_write(&chunk) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("write: {e}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = unacked_bytes(&ours).expect("SIOCOUTQ");
            if now == full {
                break;
            }
            full = now;
        }
        assert!(full > 0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            unacked_bytes(&ours),
            Some(full),
            "nothing read, nothing acknowledged"
        );

        let mut watch = StallWatch::new(Duration::from_millis(10));
        watch.deadline(&ours);
        assert!(watch.expired(&ours), "the peer took nothing");
        watch.progressed();
        watch.deadline(&ours);
        // Half of what is buffered, so the read cannot wait for bytes never sent.
        let mut buf = vec![0u8; full / 2];
        let mut read = 0;
        while read < buf.len() {
            read += peer.read(&mut buf[read..]).await.expect("read");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(unacked_bytes(&ours).expect("SIOCOUTQ") < full);
        assert!(!watch.expired(&ours), "the peer read: not stalled");
        assert!(watch.expired(&ours), "and nothing more since");
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
