//! Text that does not fit one PDU: our answers split with the C (continue) bit, and requests
//! the initiator continues gathered before they are answered (RFC 7143 §6.1-6.2, text format
//! and negotiation; §11.10-11.13, the Text and Login PDUs).
//!
//! A receiver bounds the data segments it accepts (its MaxRecvDataSegmentLength; 8,192 bytes
//! during login). An answer to many keys — an initiator may send thousands, each answered
//! `NotUnderstood` — can be far longer, so it goes out in pieces:
//!
//! ```text
//!   I: request (text complete)            T: piece 1, C=1 (login: T=0; Text: F=0, a TTT)
//!   I: empty request (Text: same TTT)     T: piece 2, C=1
//!   ...                                   T: last piece, C=0 (login: T as negotiated; Text: F=1)
//! ```
//!
//! Pieces are cut after a key's closing NUL where one is in reach, so an initiator that
//! parses each PDU on its own still sees whole keys; only a single key longer than a piece is
//! cut inside. The other way round, a request sent with C=1 is answered with an empty
//! response (login: no transit; Text: F=0 and a TTT to continue with) until its last piece,
//! and the gathered text is bounded by [`MAX_TEXT`].
//!
//! [`TextExchange`] is the Text Request side (full feature phase); the login phase uses
//! [`next_piece`] directly, as its exchange is the login itself.

use bytes::Bytes;

use super::login::{SessionKind, parse_keys, push_key};
use super::pdu::{RESERVED_TAG, reject};

/// Most text one request may carry across its Continue PDUs. Real initiators send well under
/// 4 KiB; without a bound a peer could grow it without limit.
pub const MAX_TEXT: usize = 64 * 1024;

/// The largest data segment of a login PDU we send: the 8,192 bytes RFC 7143 lets a login
/// PDU carry (§13.12, MaxRecvDataSegmentLength), whatever larger value the initiator
/// declared; one that declares less gets less.
pub const LOGIN_SEGMENT: usize = 8192;

/// Cuts the next piece of at most `max` bytes off the front of `text`: up to the last key
/// boundary (a NUL) within `max` bytes, or `max` bytes when no key ends that early.
pub fn next_piece(text: &mut Bytes, max: usize) -> Bytes {
    let max = max.max(1);
    if text.len() <= max {
        return text.split_to(text.len());
    }
    let cut = text[..max]
        .iter()
        .rposition(|b| *b == 0)
        .map_or(max, |nul| nul + 1);
    text.split_to(cut)
}

/// A fresh target transfer tag: never the reserved value, which means "no tag".
pub fn take_ttt(next: &mut u32) -> u32 {
    if *next == RESERVED_TAG {
        *next = 1;
    }
    let t = *next;
    *next = next.wrapping_add(1);
    t
}

/// What to answer one Text Request PDU with.
#[derive(Debug, PartialEq, Eq)]
pub enum TextStep {
    /// A Text Response: `data`, the F and C bits, and the target transfer tag.
    Respond {
        data: Bytes,
        final_bit: bool,
        cont: bool,
        ttt: u32,
    },
    /// Reject the PDU with this reason; the exchange is over.
    Reject(u8),
}

/// One Text Request sequence and its response (RFC 7143 allows one at a time per
/// connection). It starts with a request whose TTT is the reserved value and ends when the
/// last piece of the answer is sent, or when a request breaks its rules.
#[derive(Debug)]
pub struct TextExchange {
    itt: u32,
    ttt: u32,
    /// The request's text so far (while the initiator continues it).
    gathered: Vec<u8>,
    /// What is left to send of the answer, once the request is complete.
    answer: Option<Bytes>,
}

/// Handles one Text Request PDU: `ttt` and `cont` from its header, `data` its data segment.
/// `max` is the initiator's MaxRecvDataSegmentLength, `next_ttt` the connection's tag
/// source, and `answer` computes the answer to a complete request.
pub fn step(
    exchange: &mut Option<TextExchange>,
    (itt, ttt, cont): (u32, u32, bool),
    data: &[u8],
    max: usize,
    next_ttt: &mut u32,
    answer: impl FnOnce(&[u8]) -> Vec<u8>,
) -> TextStep {
    if ttt == RESERVED_TAG {
        // A new exchange; one still open is abandoned, as RFC 7143 §11.10.4 lets the
        // initiator do.
        *exchange = Some(TextExchange {
            itt,
            ttt: take_ttt(next_ttt),
            gathered: Vec::new(),
            answer: None,
        });
    }
    let Some(x) = exchange
        .as_mut()
        .filter(|x| x.itt == itt && (ttt == RESERVED_TAG || x.ttt == ttt))
    else {
        // Not the tag we handed out for this task.
        return TextStep::Reject(reject::INVALID_FIELD);
    };
    if x.answer.is_none() {
        if x.gathered.len() + data.len() > MAX_TEXT {
            *exchange = None;
            return TextStep::Reject(reject::PROTOCOL_ERROR);
        }
        x.gathered.extend_from_slice(data);
        if cont {
            return TextStep::Respond {
                data: Bytes::new(),
                final_bit: false,
                cont: false,
                ttt: x.ttt,
            };
        }
        x.answer = Some(Bytes::from(answer(&std::mem::take(&mut x.gathered))));
    } else if cont || !data.is_empty() {
        // While we send pieces the initiator may only ask for the next one.
        *exchange = None;
        return TextStep::Reject(reject::PROTOCOL_ERROR);
    }
    let rest = x
        .answer
        .as_mut()
        .expect("invariant: the answer was computed above");
    let piece = next_piece(rest, max);
    if rest.is_empty() {
        *exchange = None;
        TextStep::Respond {
            data: piece,
            final_bit: true,
            cont: false,
            ttt: RESERVED_TAG,
        }
    } else {
        TextStep::Respond {
            data: piece,
            final_bit: false,
            cont: true,
            ttt: x.ttt,
        }
    }
}

/// The full feature phase's answer to a complete Text Request: SendTargets, and
/// `NotUnderstood` for every other key.
pub fn answer(request: &[u8], target_iqn: &str, portal: &str, kind: SessionKind) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in parse_keys(request) {
        if k == "SendTargets" {
            if v == "All" || v == target_iqn || (v.is_empty() && kind == SessionKind::Normal) {
                push_key(&mut out, "TargetName", target_iqn);
                push_key(&mut out, "TargetAddress", &format!("{portal},1"));
            }
        } else {
            push_key(&mut out, &k, "NotUnderstood");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_end_at_key_boundaries_and_rejoin_to_the_text() {
        let mut text = Vec::new();
        for i in 0..500 {
            push_key(&mut text, &format!("X-key{i}"), "NotUnderstood");
        }
        // One key longer than a piece is cut inside it.
        push_key(&mut text, &"L".repeat(300), "v");
        let mut rest = Bytes::from(text.clone());
        let mut pieces = Vec::new();
        while !rest.is_empty() {
            pieces.push(next_piece(&mut rest, 256));
        }
        assert!(pieces.iter().all(|p| !p.is_empty() && p.len() <= 256));
        let cut_inside = pieces.iter().filter(|p| p.last() != Some(&0)).count();
        assert_eq!(cut_inside, 1, "only the long key is cut inside");
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn ttt_skips_the_reserved_value() {
        let mut n = RESERVED_TAG;
        assert_eq!(take_ttt(&mut n), 1);
        assert_eq!(take_ttt(&mut n), 2);
        let mut n = RESERVED_TAG - 1;
        assert_eq!(take_ttt(&mut n), RESERVED_TAG - 1);
        assert_eq!(take_ttt(&mut n), 1);
    }

    fn respond(step: TextStep) -> (Bytes, bool, bool, u32) {
        match step {
            TextStep::Respond {
                data,
                final_bit,
                cont,
                ttt,
            } => (data, final_bit, cont, ttt),
            other => panic!("expected a response, got {other:?}"),
        }
    }

    #[test]
    fn an_exchange_gathers_continued_requests_and_sends_its_answer_in_pieces() {
        let mut x = None;
        let mut next = 1;
        let echo = |req: &[u8]| req.repeat(4);
        let first = respond(step(
            &mut x,
            (7, RESERVED_TAG, true),
            b"a=1\0",
            8,
            &mut next,
            echo,
        ));
        assert_eq!((first.0.len(), first.1, first.2), (0, false, false));
        let ttt = first.3;
        assert_ne!(ttt, RESERVED_TAG);
        // The rest of the request completes it; its 32-byte answer comes in 8-byte pieces.
        let (p1, f1, c1, t1) = respond(step(&mut x, (7, ttt, false), b"b=2\0", 8, &mut next, echo));
        assert_eq!(
            (&p1[..], f1, c1, t1),
            (&b"a=1\0b=2\0"[..], false, true, ttt)
        );
        let mut got = p1.to_vec();
        loop {
            let (p, f, c, t) = respond(step(&mut x, (7, ttt, false), b"", 8, &mut next, echo));
            got.extend_from_slice(&p);
            if !c {
                assert!(f);
                assert_eq!(t, RESERVED_TAG);
                break;
            }
        }
        assert_eq!(got, b"a=1\0b=2\0".repeat(4));
        assert!(x.is_none(), "the exchange is over");
        // A tag from the finished exchange is refused.
        assert_eq!(
            step(&mut x, (7, ttt, false), b"", 8, &mut next, echo),
            TextStep::Reject(reject::INVALID_FIELD)
        );
    }

    #[test]
    fn rule_breaking_requests_are_rejected() {
        let echo = |req: &[u8]| req.repeat(100);
        let mut next = 1;
        // Text while pieces are still being sent.
        let mut x = None;
        let (_, _, cont, ttt) = respond(step(
            &mut x,
            (1, RESERVED_TAG, false),
            b"k=v\0",
            64,
            &mut next,
            echo,
        ));
        assert!(cont);
        assert_eq!(
            step(&mut x, (1, ttt, false), b"more=1\0", 64, &mut next, echo),
            TextStep::Reject(reject::PROTOCOL_ERROR)
        );
        assert!(x.is_none());
        // A request gathered past the bound.
        let mut x = None;
        let big = vec![b'a'; MAX_TEXT / 2 + 1];
        let (_, _, _, ttt) = respond(step(
            &mut x,
            (2, RESERVED_TAG, true),
            &big,
            64,
            &mut next,
            echo,
        ));
        assert_eq!(
            step(&mut x, (2, ttt, true), &big, 64, &mut next, echo),
            TextStep::Reject(reject::PROTOCOL_ERROR)
        );
        // Another task's tag.
        let mut x = None;
        let (_, _, _, ttt) = respond(step(
            &mut x,
            (3, RESERVED_TAG, true),
            b"k=v\0",
            64,
            &mut next,
            echo,
        ));
        assert_eq!(
            step(&mut x, (4, ttt, false), b"", 64, &mut next, echo),
            TextStep::Reject(reject::INVALID_FIELD)
        );
    }
}
