//! Small pieces the NBD server and the iSCSI target share in their connection loops: both
//! serve a connection from one task that waits for the socket to be readable (room for more
//! requests) and/or writable (answers queued), and both queue answers as a list of byte
//! chunks written with vectored writes.

use std::collections::VecDeque;

use bytes::{Buf, Bytes};
use tokio::io::Interest;

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
