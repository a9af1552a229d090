//! Text longer than the initiator accepts in one PDU: login and Text responses are split
//! with the C (continue) bit into data segments no larger than the initiator's
//! MaxRecvDataSegmentLength (and 8,192 bytes during login, RFC 7143), and requests the
//! initiator continues with the C bit are gathered before they are answered.

mod iscsi_common;

use std::collections::HashMap;

use iscsi_common::*;

/// 5,000 keys nobody knows, as in issue 18 (their answers make a ~109 KB response).
fn unknown_keys() -> Vec<(String, String)> {
    (0..5000)
        .map(|i| (format!("X-k{i:04}"), "v".to_owned()))
        .collect()
}

fn encode(kv: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in kv {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

fn login_bhs(c: &Client, flags: u8) -> [u8; 48] {
    let mut b = bhs(0x43, flags);
    b[8..14].copy_from_slice(&[0x80, 0, 0, 0x12, 0x34, 0x56]);
    put32(&mut b, 16, c.itt);
    put32(&mut b, 24, c.cmd_sn);
    b
}

/// Sends `text` as one login request split into Continue PDUs of at most 8,192 bytes (as an
/// initiator must), reading the target's empty answer to each Continue PDU.
async fn send_login_text(c: &mut Client, flags: u8, text: &[u8]) {
    let pieces: Vec<&[u8]> = text.chunks(8192).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        let f = if last { flags } else { (flags & 0x0f) | 0x40 };
        c.send(login_bhs(c, f), piece).await;
        if !last {
            let r = c.recv().await;
            assert_eq!(r.opcode(), 0x23);
            assert_eq!(&r.bhs[36..38], &[0, 0], "login status");
            assert!(r.data.is_empty(), "an empty answer to a Continue PDU");
        }
    }
}

/// Reads a login response that may come in pieces, asking for each next piece with an empty
/// login request; returns the whole text, the final response, and the pieces' lengths.
async fn recv_login_text(c: &mut Client, flags: u8) -> (Vec<u8>, Pdu, Vec<usize>) {
    let mut text = Vec::new();
    let mut sizes = Vec::new();
    loop {
        let r = c.recv().await;
        assert_eq!(r.opcode(), 0x23);
        assert_eq!(&r.bhs[36..38], &[0, 0], "login status");
        text.extend_from_slice(&r.data);
        sizes.push(r.data.len());
        if r.bhs[1] & 0x40 == 0 {
            return (text, r, sizes);
        }
        assert_eq!(r.bhs[1] & 0x80, 0, "a response with C set must not transit");
        // The initiator answers a partial response with an empty request.
        c.send(login_bhs(c, flags), &[]).await;
    }
}

fn check_answers(text: &[u8], keys: &[(String, String)]) -> HashMap<String, String> {
    let answers: Vec<(String, String)> = parse_keys(text);
    let map: HashMap<String, String> = answers.iter().cloned().collect();
    assert_eq!(map.len(), answers.len(), "every key answered once");
    for (k, _) in keys {
        assert_eq!(
            map.get(k).map(String::as_str),
            Some("NotUnderstood"),
            "answer for {k}"
        );
    }
    map
}

#[tokio::test]
async fn login_response_over_8192_bytes_is_split_with_the_continue_bit() {
    let (addr, _stop) = start("127.0.0.71", None).await;
    let mut c = Client::connect(addr).await;
    let mut kv: Vec<(String, String)> = [
        ("InitiatorName", "iqn.2025-01.test:text"),
        ("TargetName", IQN),
        ("SessionType", "Normal"),
        ("AuthMethod", "None"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let unknown = unknown_keys();
    kv.extend(unknown.iter().cloned());
    let flags = 0x83; // T, CSG=0, NSG=3
    send_login_text(&mut c, flags, &encode(&kv)).await;
    let (text, last, sizes) = recv_login_text(&mut c, flags).await;
    assert!(text.len() > 100_000, "{} bytes of answers", text.len());
    assert!(sizes.len() > 1, "one response of {} bytes", text.len());
    assert!(
        sizes.iter().all(|&n| n <= 8192),
        "login data segments over 8,192 bytes: {sizes:?}"
    );
    let map = check_answers(&text, &unknown);
    assert_eq!(map.get("AuthMethod").map(String::as_str), Some("None"));
    assert_eq!(
        last.bhs[1] & 0x83,
        0x83,
        "the last piece transits to full feature"
    );
    assert_ne!(
        &last.bhs[14..16],
        &[0, 0],
        "TSIH given with the final response"
    );
    c.nop().await;
}

/// The initiator's own MaxRecvDataSegmentLength, when it declares a smaller one, bounds the
/// pieces too.
#[tokio::test]
async fn login_response_pieces_respect_a_smaller_declared_mrdsl() {
    let (addr, _stop) = start("127.0.0.72", None).await;
    let mut c = Client::connect(addr).await;
    let r = c
        .login_pdu(
            0x81, // T, CSG=0, NSG=1
            &[
                ("InitiatorName", "iqn.2025-01.test:text"),
                ("TargetName", IQN),
                ("AuthMethod", "None"),
            ],
        )
        .await;
    assert_eq!(r.bhs[1] & 0x83, 0x81);
    let mut kv = vec![("MaxRecvDataSegmentLength".to_owned(), "1024".to_owned())];
    let unknown: Vec<(String, String)> = unknown_keys().into_iter().take(600).collect();
    kv.extend(unknown.iter().cloned());
    let flags = 0x87; // T, CSG=1, NSG=3
    send_login_text(&mut c, flags, &encode(&kv)).await;
    let (text, last, sizes) = recv_login_text(&mut c, flags).await;
    assert!(sizes.len() > 1);
    assert!(sizes.iter().all(|&n| n <= 1024), "pieces: {sizes:?}");
    check_answers(&text, &unknown);
    assert_eq!(last.bhs[1] & 0x83, 0x83);
    c.nop().await;
}

fn text_bhs(c: &Client, flags: u8, itt: u32, ttt: u32) -> [u8; 48] {
    let mut b = bhs(0x04, flags);
    put32(&mut b, 16, itt);
    put32(&mut b, 20, ttt);
    put32(&mut b, 24, c.cmd_sn);
    b
}

/// In the full feature phase a Text Response is bounded by the initiator's
/// MaxRecvDataSegmentLength (8,192 by default): longer text comes in pieces with the C bit
/// and a target transfer tag the initiator returns, with an empty Text Request, to get the
/// next piece. A request the initiator itself continues with the C bit is answered only
/// once it is complete.
#[tokio::test]
async fn text_response_over_the_initiators_mrdsl_is_split_and_continued_requests_gathered() {
    let (addr, _stop) = start("127.0.0.73", None).await;
    let mut c = Client::login(addr).await;
    let unknown = unknown_keys();
    let text = encode(&unknown);
    let itt = c.next_itt();

    // The request in two pieces: the first with C (F clear) gets an empty response.
    let (first, second) = text.split_at(text.len() / 2);
    let cut = first.iter().rposition(|b| *b == 0).expect("a key boundary") + 1;
    let (first, second) = (&text[..cut], [&first[cut..], second].concat());
    c.send(text_bhs(&c, 0x40, itt, 0xffff_ffff), first).await;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x24, "Text Response");
    assert!(
        r.data.is_empty(),
        "nothing answered before the request is complete"
    );
    assert_eq!(r.bhs[1] & 0xc0, 0, "neither F nor C");
    let ttt = r.u32_at(20);
    assert_ne!(ttt, 0xffff_ffff, "a transfer tag to continue with");
    c.cmd_sn += 1;
    c.send(text_bhs(&c, 0x80, itt, ttt), &second).await;

    let mut answers = Vec::new();
    let mut sizes = Vec::new();
    loop {
        let r = c.recv().await;
        assert_eq!(r.opcode(), 0x24, "Text Response");
        assert_eq!(r.u32_at(16), itt);
        answers.extend_from_slice(&r.data);
        sizes.push(r.data.len());
        if r.bhs[1] & 0x40 == 0 {
            assert_eq!(r.bhs[1] & 0x80, 0x80, "the last piece is final");
            assert_eq!(r.u32_at(20), 0xffff_ffff, "no tag on the final piece");
            break;
        }
        assert_eq!(r.bhs[1] & 0x80, 0, "F is clear while C is set");
        let ttt = r.u32_at(20);
        assert_ne!(ttt, 0xffff_ffff);
        c.cmd_sn += 1;
        c.send(text_bhs(&c, 0x80, itt, ttt), &[]).await;
    }
    c.cmd_sn += 1;
    assert!(sizes.len() > 1);
    assert!(sizes.iter().all(|&n| n <= 8192), "pieces: {sizes:?}");
    check_answers(&answers, &unknown);

    // SendTargets still works on the same connection afterwards.
    let itt = c.next_itt();
    c.send(
        text_bhs(&c, 0x80, itt, 0xffff_ffff),
        &keys(&[("SendTargets", "All")]),
    )
    .await;
    c.cmd_sn += 1;
    let r = c.recv().await;
    assert_eq!(r.opcode(), 0x24);
    let kv = parse_keys(&r.data);
    assert!(
        kv.contains(&("TargetName".to_owned(), IQN.to_owned())),
        "{kv:?}"
    );
    c.nop().await;
}
