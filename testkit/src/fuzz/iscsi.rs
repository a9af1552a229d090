//! The iSCSI target's fuzz harnesses (`fuzz/`'s `iscsi_pdu` and `iscsi_login`).
//!
//! Each function takes the fuzzer's raw bytes, drives one part of the target that an
//! initiator controls, and panics only when an invariant is broken; bad input itself must
//! be answered with an error, never a panic. Everything runs on in-memory streams with
//! [`futures::executor::block_on`]: the code under test only awaits the byte stream, which
//! is always ready, so no runtime is needed and runs are deterministic.
//!
//! - [`pdu_stream`]: PDU framing (BHS, AHS, header and data digests, padding, data segment
//!   limit) over an arbitrary byte stream, with a re-encode round trip of every PDU read.
//! - [`login_exchange`]: the login state machine (stages, AuthMethod/CHAP, operational
//!   keys) fed a sequence of Login Request PDUs whose flags and text are fuzzer-chosen.
//! - [`text_keys`]: the `key=value` parser and the per-key negotiation alone.
//! - [`text_exchange`]: the full feature phase's Text exchange (requests continued with the
//!   C bit, answers sent in pieces) against a model of what the initiator sent.

use bytes::{Bytes, BytesMut};
use futures::executor::block_on;

use zebu_engine::iscsi::chap::Chap;
use zebu_engine::iscsi::login::{self, LoginConfig, Params, SessionKind, parse_keys};
use zebu_engine::iscsi::pdu::{
    BHS_LEN, Bhs, PduError, PduReader, RESERVED_TAG, ReadOutcome, encode, op, reject,
};
use zebu_engine::iscsi::text::{self, LOGIN_SEGMENT, TextStep};

/// Reads PDUs from `data` until the stream ends or framing fails.
///
/// Byte 0 picks header/data digests, bytes 1..4 the data segment limit; the rest is the
/// stream. Every PDU read is encoded again and must read back identically.
pub fn pdu_stream(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let hd = data[0] & 1 != 0;
    let dd = data[0] & 2 != 0;
    let max = (usize::from(data[1]) << 16) | (usize::from(data[2]) << 8) | usize::from(data[3]);
    let mut r = PduReader::new(&data[4..], max);
    r.header_digest = hd;
    r.data_digest = dd;
    loop {
        match block_on(r.read()) {
            Ok(ReadOutcome::Pdu(pdu)) => {
                assert_eq!(pdu.data.len(), pdu.bhs.data_len(), "data segment length");
                assert!(pdu.data.len() <= max, "data segment over the limit");
                roundtrip(&pdu.bhs, &pdu.data, hd, dd);
            }
            Ok(ReadOutcome::DataDigestError(bhs)) => assert!(dd && bhs.data_len() > 0),
            Ok(ReadOutcome::Eof) => return,
            Err(PduError::DataTooLong { len, max: m, .. }) => {
                assert!(len > m);
                return;
            }
            Err(_) => return,
        }
    }
}

fn roundtrip(bhs: &Bhs, data: &Bytes, hd: bool, dd: bool) {
    // AHS are skipped on read and never sent, so the copy carries none.
    let mut bhs = bhs.clone();
    bhs.0[4] = 0;
    let mut scratch = BytesMut::new();
    let mut bufs = Vec::new();
    encode(&bhs, data, hd, dd, &mut scratch, &mut bufs);
    let wire: Vec<u8> = bufs.concat();
    let mut r = PduReader::new(&wire[..], data.len());
    r.header_digest = hd;
    r.data_digest = dd;
    match block_on(r.read()) {
        Ok(ReadOutcome::Pdu(p)) => {
            assert_eq!(p.bhs, bhs, "header round trip");
            assert_eq!(&p.data, data, "data round trip");
        }
        other => panic!("re-encoded PDU did not read back: {other:?}"),
    }
    assert!(matches!(block_on(r.read()), Ok(ReadOutcome::Eof)));
}

/// The target name the login fuzzer's sessions ask for.
pub const FUZZ_TARGET: &str = "iqn.2025-01.io.zebu:fuzz";

/// Runs one login over a sequence of Login Request PDUs built from `data`.
///
/// Byte 0 selects the target's authentication (bit 0: CHAP required, bit 1: mutual CHAP
/// configured) and whether the first PDU gets a valid InitiatorName/TargetName prefix
/// (bit 2), so the fuzzer reaches the later stages quickly. The rest is a list of records
/// `[flags, version, len_hi, len_lo, text...]`: one Login Request each, with the flags
/// byte as BHS byte 1 (T, C, CSG, NSG) and `len` bytes of key text as its data segment.
pub fn login_exchange(data: &[u8]) {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let chap = Chap {
        user: "user".to_string(),
        secret: "secret-of-12".to_string(),
        mutual: (mode & 2 != 0).then(|| ("tgt".to_string(), "tsecret-of-12".to_string())),
    };
    let mut wire = Vec::new();
    let mut first = true;
    while rest.len() >= 4 {
        let flags = rest[0];
        let version = rest[1];
        let len = (usize::from(rest[2]) << 8) | usize::from(rest[3]);
        rest = &rest[4..];
        let text_len = len.min(rest.len());
        let mut text = Vec::new();
        if first && mode & 4 != 0 {
            text.extend_from_slice(b"InitiatorName=iqn.fuzz:init\0TargetName=");
            text.extend_from_slice(FUZZ_TARGET.as_bytes());
            text.push(0);
        }
        first = false;
        text.extend_from_slice(&rest[..text_len]);
        rest = &rest[text_len..];
        let mut bhs = Bhs::new(op::LOGIN_REQ | 0x40);
        bhs.0[1] = flags;
        bhs.0[3] = version;
        bhs.0[8..14].copy_from_slice(&[0x40, 0, 0, 1, 0, 0]);
        bhs.set_itt(1);
        let text = Bytes::from(text);
        if text.len() > login::TARGET_MRDSL as usize {
            break;
        }
        bhs.set_data_len(text.len());
        let mut scratch = BytesMut::new();
        let mut bufs = Vec::new();
        encode(&bhs, &text, false, false, &mut scratch, &mut bufs);
        for b in bufs {
            wire.extend_from_slice(&b);
        }
    }
    let mut reader = PduReader::new(&wire[..], login::TARGET_MRDSL as usize);
    let mut out: Vec<u8> = Vec::new();
    let next_tsih = || 7u16;
    let cfg = LoginConfig {
        target_iqn: FUZZ_TARGET,
        chap: (mode & 1 != 0).then_some(&chap),
        next_tsih: &next_tsih,
    };
    let result = block_on(login::login(&mut reader, &mut out, &cfg));
    if let Ok(l) = &result {
        check_params(&l.params);
        assert_eq!(l.tsih, 7);
        if mode & 1 != 0 && l.kind == login::SessionKind::Normal {
            panic!("a normal session logged in without CHAP");
        }
    }
    // Every response must be a well-formed Login Response, with a data segment an initiator
    // accepts during login, and a continued one must not transit.
    let mut r = PduReader::new(&out[..], 1 << 24);
    loop {
        match block_on(r.read()) {
            Ok(ReadOutcome::Pdu(p)) => {
                assert_eq!(p.bhs.opcode(), op::LOGIN_RESP);
                assert_eq!(p.bhs.0.len(), BHS_LEN);
                assert!(p.data.len() <= LOGIN_SEGMENT, "{} bytes", p.data.len());
                assert!(
                    p.bhs.flags() & 0xc0 != 0xc0,
                    "a login response with both C and T"
                );
                let _ = parse_keys(&p.data);
            }
            Ok(ReadOutcome::Eof) => break,
            other => panic!("target wrote a malformed login response: {other:?}"),
        }
    }
}

/// Drives [`text::step`] with Text Request PDUs built from `data`, checking each answer
/// against a model of the initiator's side.
///
/// Byte 0 is the initiator's MaxRecvDataSegmentLength in units of 16 bytes (at least one);
/// the rest is a list of records `[flags, len, text...]`, one Text Request each: flags bit 0
/// sets C (the request continues), bit 1 sends the reserved TTT (a new exchange) instead of
/// the last tag the target handed out, bit 2 uses another ITT. Every answer piece must fit
/// the limit; a piece with C must carry a tag and the final one none; the request the
/// target answers must be exactly the text sent since the exchange began; and the pieces of
/// an answer must rejoin to the answer of that request.
pub fn text_exchange(data: &[u8]) {
    let Some((&unit, mut rest)) = data.split_first() else {
        return;
    };
    let max = usize::from(unit.max(1)) * 16;
    let mut exchange = None;
    let mut next_ttt = 1u32;
    // The initiator's side: the tag to continue with, what it sent of the current request,
    // and, once answered, the whole answer and what arrived of it.
    let mut tag = RESERVED_TAG;
    let mut sent = Vec::new();
    let mut answer: Option<(Vec<u8>, Vec<u8>)> = None;
    while rest.len() >= 2 {
        let flags = rest[0];
        let len = usize::from(rest[1]).min(rest.len() - 2);
        let piece = &rest[2..2 + len];
        rest = &rest[2 + len..];
        let cont = flags & 1 != 0;
        let ttt = if flags & 2 != 0 { RESERVED_TAG } else { tag };
        let itt = if flags & 4 != 0 { 2 } else { 1 };
        if ttt == RESERVED_TAG {
            sent.clear();
            answer = None;
        }
        let mut asked = None;
        let step = text::step(
            &mut exchange,
            (itt, ttt, cont),
            piece,
            max,
            &mut next_ttt,
            |request| {
                let a = text::answer(request, FUZZ_TARGET, "127.0.0.1:3260", SessionKind::Normal);
                asked = Some((request.to_vec(), a.clone()));
                a
            },
        );
        match step {
            TextStep::Respond {
                data,
                final_bit,
                cont: more,
                ttt: t,
            } => {
                assert!(data.len() <= max, "{} bytes over {max}", data.len());
                assert!(!(final_bit && more), "F and C together");
                assert_eq!(t == RESERVED_TAG, final_bit, "a tag unless final");
                match (&mut answer, asked) {
                    (_, Some((request, whole))) => {
                        sent.extend_from_slice(piece);
                        assert_eq!(request, sent, "the target answered another request");
                        answer = Some((whole, data.to_vec()));
                    }
                    (Some((_, got)), None) => got.extend_from_slice(&data),
                    (None, None) => {
                        // The request continues: an empty answer to ask for the rest.
                        assert!(cont && data.is_empty() && !final_bit && !more);
                        sent.extend_from_slice(piece);
                    }
                }
                if final_bit {
                    let (whole, got) = answer.take().expect("a final piece ends an answer");
                    assert_eq!(got, whole, "the pieces do not rejoin to the answer");
                    sent.clear();
                }
                tag = t;
            }
            TextStep::Reject(reject::INVALID_FIELD) => {
                // A tag or task the exchange does not have: it goes on untouched.
                assert!(ttt != RESERVED_TAG);
            }
            TextStep::Reject(reason) => {
                assert_eq!(reason, reject::PROTOCOL_ERROR);
                assert!(exchange.is_none(), "a protocol error ends the exchange");
                tag = RESERVED_TAG;
                sent.clear();
                answer = None;
            }
        }
    }
}

/// Parses `data` as login text and negotiates every key on fresh parameters.
pub fn text_keys(data: &[u8]) {
    let mut p = Params::default();
    for (k, v) in parse_keys(data) {
        assert!(!k.contains('\0') && !v.contains('\0'));
        let _ = login::negotiate(&mut p, &k, &v);
    }
    login::finish_params(&mut p);
    check_params(&p);
}

/// Invariants every negotiated parameter set must hold for the session code to be safe.
fn check_params(p: &Params) {
    assert!((512..1 << 24).contains(&p.initiator_mrdsl), "{p:?}");
    assert!((512..1 << 24).contains(&p.max_burst), "{p:?}");
    assert!((512..1 << 24).contains(&p.first_burst), "{p:?}");
    assert!(
        p.first_burst <= p.max_burst,
        "FirstBurstLength > MaxBurstLength: {p:?}"
    );
    assert!((1..=16).contains(&p.max_outstanding_r2t), "{p:?}");
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Records `[flags, len, text]` for [`text_exchange`].
    fn records(rs: &[(u8, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (flags, text) in rs {
            out.push(*flags);
            out.push(u8::try_from(text.len()).expect("short text"));
            out.extend_from_slice(text);
        }
        out
    }

    #[test]
    fn text_exchange_model_follows_a_well_behaved_initiator() {
        let mut data = vec![2]; // 32-byte pieces
        data.extend(records(&[
            (2 | 1, b"X-a=1\0X-b=2\0"),
            (1, b"X-c=3\0"),
            (0, b"X-d=4\0SendTargets=All\0"),
            (0, b""),
            (0, b""),
            (0, b""),
            (0, b""),
            (0, b""),
            (2, b"X-e=5\0"),
        ]));
        text_exchange(&data);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn text_exchange_never_breaks_its_invariants(
            data in proptest::collection::vec(any::<u8>(), 0..600)
        ) {
            text_exchange(&data);
        }

        #[test]
        fn login_exchange_never_breaks_its_invariants(
            data in proptest::collection::vec(any::<u8>(), 0..600)
        ) {
            login_exchange(&data);
        }
    }
}
