use super::request::{OP_READ, OP_WRITE, REQ_FLAG_FLUSH, REQ_FLAG_SUMS, REQ_FLAG_ZERO_FILL};
use super::*;
use crate::ids::RequestId;
use crate::sums::{BlockSums, block_crc};
use bytes::{Bytes, BytesMut};
use proptest::prelude::*;

fn gather(b: &Batch) -> Vec<u8> {
    b.io_slices()
        .iter()
        .flat_map(|s| s.iter().copied())
        .collect()
}

fn frame_of_request(r: &Request) -> BytesMut {
    let mut b = Batch::default();
    b.push_request(r);
    BytesMut::from(&gather(&b)[..])
}

fn frame_of_response(r: &Response) -> BytesMut {
    let mut b = Batch::default();
    b.push_response(r);
    BytesMut::from(&gather(&b)[..])
}

fn one_request(buf: &mut BytesMut) -> Request {
    match decode_request(buf).expect("valid frame") {
        Decoded::Frame(r) => r,
        Decoded::Need(n) => panic!("incomplete: need {n} of {}", buf.len()),
    }
}

fn one_response(buf: &mut BytesMut) -> Response {
    match decode_response(buf).expect("valid frame") {
        Decoded::Frame(r) => r,
        Decoded::Need(n) => panic!("incomplete: need {n} of {}", buf.len()),
    }
}

#[test]
fn magic_differs_from_the_http2_preface() {
    assert_ne!(MAGIC[0], b"PRI * HTTP/2.0"[0]);
    let h = Hello::new(2, 0x0102_0304_0506_0708);
    let b = h.encode();
    assert_eq!(
        b.len(),
        HELLO_LEN,
        "versions 1 and 2 have no extension area"
    );
    assert_eq!(&b[..4], b"ZBDF");
    assert_eq!(&b[4..8], &[2, 0, 0, 0], "little-endian version");
    assert_eq!(b[8], 0x08, "little-endian generation");
    assert_eq!(
        decode_hello(&mut BytesMut::from(&b[..])),
        Ok(Decoded::Frame(h))
    );
    let mut bad = b;
    bad[0] = b'P';
    assert!(matches!(
        decode_hello(&mut BytesMut::from(&bad[..])),
        Err(FrameError::BadMagic(_))
    ));
}

#[test]
fn a_version_3_hello_carries_extensions_that_unknown_servers_skip_unless_critical() {
    let h = Hello {
        extensions: Extensions(vec![
            Extension {
                kind: 7,
                value: Bytes::from_static(b"volume-uuid"),
            },
            Extension {
                kind: EXTENSION_CRITICAL | 9,
                value: Bytes::new(),
            },
        ]),
        ..Hello::new(3, 42)
    };
    let b = h.encode();
    assert_eq!(b.len(), HELLO_LEN + 4 + (4 + 11) + 4);
    // Fed byte by byte, as a slow socket would: Need grows until the whole area is there.
    let mut buf = BytesMut::new();
    for (i, byte) in b.iter().enumerate() {
        assert!(
            matches!(decode_hello(&mut buf), Ok(Decoded::Need(n)) if n > i),
            "at {i}"
        );
        buf.extend_from_slice(&[*byte]);
    }
    let Ok(Decoded::Frame(back)) = decode_hello(&mut buf) else {
        panic!("a whole hello")
    };
    assert!(buf.is_empty());
    assert_eq!(back, h);
    assert_eq!(
        back.extensions.get(7).map(|v| &v[..]),
        Some(&b"volume-uuid"[..])
    );
    assert_eq!(back.extensions.unknown_critical(&[7]), Some(0x8009));
    assert_eq!(back.extensions.unknown_critical(&[7, 0x8009]), None);
    // An area over the limit, or entries that do not add up, end the connection.
    let mut big = Hello::new(3, 1).encode();
    big[16..20].copy_from_slice(&(MAX_HELLO_EXTENSIONS as u32 + 1).to_le_bytes());
    assert!(matches!(
        decode_hello(&mut BytesMut::from(&big[..])),
        Err(FrameError::TooLarge { .. })
    ));
    let mut cut = Hello::new(3, 1).encode();
    cut[16..20].copy_from_slice(&3u32.to_le_bytes());
    cut.extend_from_slice(&[1, 0, 9]);
    assert!(matches!(
        decode_hello(&mut BytesMut::from(&cut[..])),
        Err(FrameError::BadExtensions(_))
    ));
}

#[test]
fn every_request_round_trips() {
    let reqs = [
        Request {
            id: RequestId(1),
            op: RequestOp::Read {
                offset: 4096,
                length: 8192,
            },
        },
        Request {
            id: RequestId(2),
            op: RequestOp::Write {
                offset: 12288,
                data: Bytes::from(vec![7u8; 4096]),
                sums: None,
                flush: None,
            },
        },
        Request {
            id: RequestId(22),
            op: RequestOp::Write {
                offset: 0,
                data: Bytes::from(vec![8u8; 3 * 4096]),
                sums: BlockSums::of(&[8u8; 3 * 4096]),
                flush: None,
            },
        },
        Request {
            id: RequestId(24),
            op: RequestOp::Write {
                offset: 4096,
                data: Bytes::from(vec![9u8; 2 * 4096]),
                sums: BlockSums::of(&[9u8; 2 * 4096]),
                flush: Some(41),
            },
        },
        Request {
            id: RequestId(23),
            op: RequestOp::Ping,
        },
        Request {
            id: RequestId(3),
            op: RequestOp::Unmap {
                offset: 0,
                length: 1 << 20,
                zero_fill: true,
            },
        },
        Request {
            id: RequestId(4),
            op: RequestOp::Unmap {
                offset: 0,
                length: 1 << 20,
                zero_fill: false,
            },
        },
        Request {
            id: RequestId(u64::MAX),
            op: RequestOp::Flush { flush_number: 77 },
        },
    ];
    let mut batch = Batch::default();
    for r in &reqs {
        batch.push_request(r);
    }
    assert_eq!(batch.frames(), reqs.len());
    let mut buf = BytesMut::from(&gather(&batch)[..]);
    assert_eq!(buf.len(), batch.len());
    for r in &reqs {
        assert_eq!(&one_request(&mut buf), r);
    }
    assert!(buf.is_empty());
    assert_eq!(
        decode_request(&mut buf),
        Ok(Decoded::Need(REQUEST_HEADER_LEN))
    );
}

#[test]
fn a_partial_request_asks_for_the_rest_and_consumes_nothing() {
    let r = Request {
        id: RequestId(5),
        op: RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![1u8; 100]),
            sums: None,
            flush: None,
        },
    };
    let full = frame_of_request(&r);
    for cut in [
        0,
        1,
        REQUEST_HEADER_LEN - 1,
        REQUEST_HEADER_LEN,
        full.len() - 1,
    ] {
        let mut part = BytesMut::from(&full[..cut]);
        let want = if cut < REQUEST_HEADER_LEN {
            REQUEST_HEADER_LEN
        } else {
            full.len()
        };
        assert_eq!(
            decode_request(&mut part),
            Ok(Decoded::Need(want)),
            "cut {cut}"
        );
        assert_eq!(part.len(), cut, "nothing consumed at cut {cut}");
    }
}

#[test]
fn large_writes_are_sent_without_a_copy() {
    let data = Bytes::from(vec![9u8; 1 << 20]);
    let r = Request {
        id: RequestId(6),
        op: RequestOp::Write {
            offset: 0,
            data: data.clone(),
            sums: BlockSums::of(&data),
            flush: None,
        },
    };
    let mut b = Batch::default();
    b.push_request(&r);
    let slices = b.io_slices();
    assert_eq!(
        slices.len(),
        2,
        "header and sums staged, the data its own slice"
    );
    assert_eq!(slices[0].len(), REQUEST_HEADER_LEN + 256 * 4);
    assert_eq!(
        slices[1].as_ptr(),
        data.as_ptr(),
        "the payload slice is the caller's buffer"
    );
    let mut buf = BytesMut::from(&gather(&b)[..]);
    assert_eq!(one_request(&mut buf), r);
}

#[test]
fn malformed_request_headers_are_errors() {
    let good = Request {
        id: RequestId(1),
        op: RequestOp::Read {
            offset: 0,
            length: 4096,
        },
    }
    .header()
    .encode();
    let mut h = good;
    h[0] = 9;
    assert_eq!(RequestHeader::decode(&h), Err(FrameError::UnknownOp(9)));
    let mut h = good;
    h[0] = 0;
    assert_eq!(RequestHeader::decode(&h), Err(FrameError::UnknownOp(0)));
    let mut h = good;
    h[5] = 1;
    assert_eq!(RequestHeader::decode(&h), Err(FrameError::Reserved));
    let mut h = good;
    h[1] = REQ_FLAG_ZERO_FILL; // zero_fill on a read
    assert!(matches!(
        RequestHeader::decode(&h),
        Err(FrameError::BadFlags { .. })
    ));
    let mut h = good;
    h[1] = REQ_FLAG_SUMS; // sums on a read
    assert!(matches!(
        RequestHeader::decode(&h),
        Err(FrameError::BadFlags { .. })
    ));
    let mut h = good;
    h[1] = REQ_FLAG_FLUSH; // a flush after a read
    assert!(matches!(
        RequestHeader::decode(&h),
        Err(FrameError::BadFlags { .. })
    ));
    // Sums on a write that is not whole blocks: the sums' length cannot be known.
    let mut h = good;
    h[0] = OP_WRITE;
    h[1] = REQ_FLAG_SUMS;
    h[24..32].copy_from_slice(&4097u64.to_le_bytes());
    assert_eq!(
        RequestHeader::decode(&h),
        Err(FrameError::SumsUnaligned { len: 4097 })
    );
    let too_big = RequestHeader {
        op: OP_WRITE,
        flags: 0,
        id: 1,
        offset: 0,
        length: MAX_FRAME_PAYLOAD + 1,
        flush_number: 0,
    };
    assert!(matches!(
        RequestHeader::decode(&too_big.encode()),
        Err(FrameError::TooLarge { .. })
    ));
    // Over the I/O limit but within the frame limit: frames intact (the server says INVALID).
    let over_io = RequestHeader {
        length: MAX_IO_BYTES + 4096,
        ..too_big
    };
    assert_eq!(RequestHeader::decode(&over_io.encode()), Ok(over_io));
    // A read's length is not a payload and has no frame limit.
    let huge_read = RequestHeader {
        op: OP_READ,
        flags: 0,
        length: u64::MAX,
        ..too_big
    };
    assert_eq!(RequestHeader::decode(&huge_read.encode()), Ok(huge_read));
    assert_eq!(huge_read.payload_len(), 0);
}

#[test]
fn responses_round_trip_with_message_and_data() {
    let resps = [
        Response::ok(RequestId(0)),
        Response {
            data: Bytes::from(vec![3u8; 4096]),
            ..Response::ok(RequestId(10))
        },
        Response {
            data: Bytes::from(vec![4u8; 1 << 20]),
            ..Response::ok(RequestId(11))
        },
        Response {
            flush_number: 42,
            ..Response::ok(RequestId(12))
        },
        Response::failed(
            RequestId(13),
            Status::Invalid,
            "read of 9 bytes is larger than … the limit",
        ),
        Response::failed(RequestId(14), Status::NoSpace, "disk full"),
        Response {
            data: Bytes::from(vec![5u8; 3 * 4096]),
            corrupt: vec![0, 2],
            ..Response::failed(
                RequestId(15),
                Status::Corrupt,
                "2 blocks fail their checksum",
            )
        },
        Response {
            end: true,
            ..Response::failed(
                RequestId(0),
                Status::Unavailable,
                "fenced: generation 1 < 2",
            )
        },
    ];
    let mut batch = Batch::default();
    for r in &resps {
        batch.push_response(r);
    }
    let mut buf = BytesMut::from(&gather(&batch)[..]);
    for r in &resps {
        assert_eq!(&one_response(&mut buf), r);
    }
    assert!(buf.is_empty());
}

#[test]
fn holes_travel_as_a_flag_to_version_2_peers_only() {
    const MIB: usize = 1 << 20;
    let hole = Response {
        data: zeros(MIB),
        ..Response::ok(RequestId(5))
    };
    // Zeros that are real data (not from `zeros`) are sent as they are.
    let written_zeros = Response {
        data: Bytes::from(vec![0u8; 4096]),
        ..Response::ok(RequestId(6))
    };
    let mut v2 = Batch::for_version(2);
    v2.push_response(&hole);
    v2.push_response(&written_zeros);
    let bytes = gather(&v2);
    assert_eq!(bytes.len(), v2.len());
    assert_eq!(
        bytes.len(),
        2 * RESPONSE_HEADER_LEN + 4096,
        "no payload for the hole"
    );
    let mut buf = BytesMut::from(&bytes[..]);
    let back = one_response(&mut buf);
    assert_eq!(back, hole);
    assert!(is_zeros(&back.data), "the receiver's zeros cost no memory");
    assert_eq!(back.data.len(), MIB);
    assert_eq!(one_response(&mut buf), written_zeros);
    assert!(buf.is_empty());

    let mut v1 = Batch::for_version(1);
    v1.push_response(&hole);
    let bytes = gather(&v1);
    assert_eq!(
        bytes.len(),
        RESPONSE_HEADER_LEN + MIB,
        "version 1 gets the bytes"
    );
    let back = one_response(&mut BytesMut::from(&bytes[..]));
    assert_eq!(back, hole);
    assert!(!is_zeros(&back.data));
}

#[test]
fn zeros_are_recognised_by_where_they_live() {
    assert!(is_zeros(&zeros(4096)));
    assert!(is_zeros(&zeros(MAX_IO_BYTES as usize)));
    assert!(is_zeros(&zeros(8192).slice(4096..)));
    assert!(!is_zeros(&zeros(0)), "nothing to leave out");
    assert!(!is_zeros(&Bytes::from(vec![0u8; 4096])));
    let big = zeros(MAX_IO_BYTES as usize + 1);
    assert_eq!(big.len(), MAX_IO_BYTES as usize + 1);
    assert!(big.iter().all(|&b| b == 0));
    assert!(!is_zeros(&big));
}

#[test]
fn long_messages_are_cut_on_a_char_boundary() {
    let msg = "é".repeat(MAX_MESSAGE_LEN); // 2 bytes each
    let r = Response::failed(RequestId(1), Status::IoError, msg);
    let mut buf = frame_of_response(&r);
    let back = one_response(&mut buf);
    assert!(back.message.len() <= MAX_MESSAGE_LEN);
    assert!(back.message.len() >= MAX_MESSAGE_LEN - 1);
    assert!(back.message.chars().all(|c| c == 'é'));
}

#[test]
fn malformed_response_headers_are_errors() {
    let good = Response::ok(RequestId(1)).header().encode();
    let mut h = good;
    h[0] = 6;
    assert_eq!(
        ResponseHeader::decode(&h),
        Err(FrameError::UnknownStatus(6))
    );
    let mut h = good;
    h[1] = 4;
    assert!(matches!(
        ResponseHeader::decode(&h),
        Err(FrameError::BadFlags { .. })
    ));
    // ZEROS is for data, which only an OK answer has.
    let mut h = Response::failed(RequestId(1), Status::IoError, "x").header();
    h.zeros = true;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::BadFlags { .. })
    ));
    let mut h = good;
    h[2] = 1;
    assert_eq!(ResponseHeader::decode(&h), Err(FrameError::Reserved));
    // A corrupt-block list belongs to CORRUPT answers only, and is bounded.
    let mut h = good;
    h[28] = 1;
    assert!(matches!(
        ResponseHeader::decode(&h),
        Err(FrameError::StrayCorruptList { .. })
    ));
    let mut h = Response::failed(RequestId(1), Status::Corrupt, "x").header();
    h.corrupt_count = MAX_CORRUPT + 1;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::TooLarge { .. })
    ));
    let mut h = Response::ok(RequestId(1)).header();
    h.message_len = MAX_MESSAGE_LEN as u32 + 1;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::TooLarge { .. })
    ));
    let mut h = Response::ok(RequestId(1)).header();
    h.payload_len = MAX_IO_BYTES as u32 + 1;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn display_leaves_out_payloads() {
    let r = Request {
        id: RequestId(3),
        op: RequestOp::Write {
            offset: 8192,
            data: Bytes::from(vec![0xAB; 4096]),
            sums: BlockSums::of(&[0xAB; 4096]),
            flush: None,
        },
    };
    assert_eq!(r.to_string(), "#3 write 8192+4096 with sums");
    let a = Response {
        data: Bytes::from(vec![0xAB; 4096]),
        ..Response::ok(RequestId(3))
    };
    assert_eq!(a.to_string(), "#3 STATUS_OK 4096 bytes");
}

fn arb_request() -> impl Strategy<Value = Request> {
    let op = prop_oneof![
        (any::<u64>(), any::<u64>())
            .prop_map(|(offset, length)| RequestOp::Read { offset, length }),
        (
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..40_000),
            any::<bool>(),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(|(offset, mut d, sums, flush)| {
                if sums {
                    d.resize(d.len().div_ceil(4096).max(1) * 4096, 3);
                }
                let sums = if sums { BlockSums::of(&d) } else { None };
                RequestOp::Write {
                    offset,
                    data: Bytes::from(d),
                    sums,
                    flush,
                }
            }),
        Just(RequestOp::Ping),
        (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(offset, length, zero_fill)| {
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            }
        }),
        any::<u64>().prop_map(|flush_number| RequestOp::Flush { flush_number }),
    ];
    (any::<u64>(), op).prop_map(|(id, op)| Request {
        id: RequestId(id),
        op,
    })
}

fn arb_response() -> impl Strategy<Value = Response> {
    (
        any::<u64>(),
        0i32..6,
        any::<bool>(),
        "\\PC{0,40}",
        any::<u64>(),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..40_000).prop_map(Bytes::from),
            (0usize..40_000).prop_map(zeros),
        ],
        proptest::collection::vec(0u32..2048, 0..20),
    )
        .prop_map(|(id, s, end, message, flush_number, data, corrupt)| {
            let status = Status::try_from(s).expect("0..6 are statuses");
            Response {
                id: RequestId(id),
                status,
                end,
                message,
                flush_number,
                data,
                corrupt: if status == Status::Corrupt {
                    corrupt
                } else {
                    Vec::new()
                },
            }
        })
}

/// Decodes frames off `bytes` fed in pieces of `step`, as a socket would deliver them.
fn decode_all<T>(
    bytes: &[u8],
    step: usize,
    decode: fn(&mut BytesMut) -> Result<Decoded<T>, FrameError>,
) -> Result<Vec<T>, FrameError> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in bytes.chunks(step.max(1)) {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match decode(&mut buf)? {
                Decoded::Frame(f) => {
                    assert!(buf.len() < before, "a frame consumes bytes");
                    out.push(f)
                }
                Decoded::Need(n) => {
                    assert!(n > buf.len(), "Need asks for more than is buffered");
                    assert_eq!(buf.len(), before, "Need consumes nothing");
                    break;
                }
            }
        }
    }
    Ok(out)
}

proptest! {
    #[test]
    fn requests_round_trip(reqs in proptest::collection::vec(arb_request(), 1..8), step in 1usize..5000) {
        let mut batch = Batch::default();
        for r in &reqs {
            batch.push_request(r);
        }
        let bytes = gather(&batch);
        prop_assert_eq!(bytes.len(), batch.len());
        prop_assert_eq!(decode_all(&bytes, step, decode_request)?, reqs);
    }

    #[test]
    fn responses_round_trip(
        resps in proptest::collection::vec(arb_response(), 1..8),
        step in 1usize..5000,
        version in MIN_VERSION..=VERSION,
    ) {
        let mut batch = Batch::for_version(version);
        for r in &resps {
            batch.push_response(r);
        }
        let bytes = gather(&batch);
        prop_assert_eq!(bytes.len(), batch.len());
        // What a peer of this version is sent: CORRUPT becomes IO_ERROR below version 3.
        let sent: Vec<Response> = resps
            .iter()
            .map(|r| r.for_version(version).unwrap_or_else(|| r.clone()))
            .collect();
        let left_out: usize = sent
            .iter()
            .filter(|r| version >= ZEROS_VERSION && r.status == Status::Ok && is_zeros(&r.data))
            .map(|r| r.data.len())
            .sum();
        let full: usize = sent
            .iter()
            .map(|r| RESPONSE_HEADER_LEN + r.wire_message().len() + r.corrupt.len() * 4 + r.data.len())
            .sum();
        prop_assert_eq!(bytes.len(), full - left_out);
        prop_assert_eq!(decode_all(&bytes, step, decode_response)?, sent);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), step in 1usize..64) {
        let _ = decode_all(&bytes, step, decode_request);
        let _ = decode_all(&bytes, step, decode_response);
        let _ = decode_all(&bytes, step, decode_hello);
        let mut hello = BytesMut::from(&b"ZBDF\x03\0\0\0\0\0\0\0\0\0\0\0"[..]);
        hello.extend_from_slice(&bytes);
        let _ = decode_hello(&mut hello);
        let _ = Extensions::decode(Bytes::from(bytes));
    }

    #[test]
    fn arbitrary_headers_never_panic(
        mut head in proptest::array::uniform32(any::<u8>()),
        op in 0u8..7,
        zero in any::<bool>(),
    ) {
        // Bias towards headers that pass the cheap checks, so the deeper ones run too.
        head[0] = op;
        if zero {
            head[2..8].fill(0);
            head[2..4].fill(0);
        }
        let mut req = BytesMut::from(&head[..]);
        req.extend_from_slice(&[0u8; 8]);
        let _ = decode_request(&mut req);
        let mut resp = BytesMut::from(&head[..]);
        let _ = decode_response(&mut resp);
    }
}

#[test]
fn older_peers_get_writes_without_sums_and_corrupt_answers_as_io_errors() {
    let data = Bytes::from(vec![1u8; 8192]);
    let w = Request {
        id: RequestId(1),
        op: RequestOp::Write {
            offset: 0,
            data: data.clone(),
            sums: BlockSums::of(&data),
            flush: None,
        },
    };
    let mut v2 = Batch::for_version(2);
    v2.push_request(&w);
    let bytes = gather(&v2);
    assert_eq!(
        bytes.len(),
        REQUEST_HEADER_LEN + 8192,
        "no sums on the wire"
    );
    assert_eq!(
        one_request(&mut BytesMut::from(&bytes[..])),
        w.clone().for_version(2)
    );
    let mut v3 = Batch::for_version(3);
    v3.push_request(&w);
    assert_eq!(gather(&v3).len(), REQUEST_HEADER_LEN + 8 + 8192);
    assert_eq!(one_request(&mut BytesMut::from(&gather(&v3)[..])), w);

    let bad = Response {
        data: Bytes::from(vec![9u8; 8192]),
        corrupt: vec![1],
        ..Response::failed(RequestId(2), Status::Corrupt, "block 1 fails its checksum")
    };
    for version in [1, 2] {
        let mut b = Batch::for_version(version);
        b.push_response(&bad);
        let back = one_response(&mut BytesMut::from(&gather(&b)[..]));
        assert_eq!(back.status, Status::IoError);
        assert_eq!(back.message, bad.message);
        assert!(back.corrupt.is_empty() && back.data.is_empty());
    }
    let mut b = Batch::for_version(3);
    b.push_response(&bad);
    assert_eq!(one_response(&mut BytesMut::from(&gather(&b)[..])), bad);
}

#[test]
fn a_request_with_sums_that_do_not_fit_its_data_goes_without_them() {
    let r = Request {
        id: RequestId(1),
        op: RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![1u8; 8192]),
            sums: Some(BlockSums::from_crcs([block_crc(&[1u8; 4096])])),
            flush: None,
        },
    };
    assert!(r.sums().is_none());
    let back = one_request(&mut frame_of_request(&r));
    assert!(matches!(back.op, RequestOp::Write { sums: None, .. }));
}

#[test]
fn grpc_messages_convert_to_the_one_request_type_and_back() {
    use crate::replica as pb;
    let data = Bytes::from(vec![4u8; 8192]);
    let reqs = [
        Request {
            id: RequestId(1),
            op: RequestOp::Write {
                offset: 4096,
                data: data.clone(),
                sums: BlockSums::of(&data),
                flush: None,
            },
        },
        Request {
            id: RequestId(2),
            op: RequestOp::Read {
                offset: 0,
                length: 4096,
            },
        },
        Request {
            id: RequestId(3),
            op: RequestOp::Unmap {
                offset: 0,
                length: 4096,
                zero_fill: true,
            },
        },
        Request {
            id: RequestId(4),
            op: RequestOp::Flush { flush_number: 9 },
        },
        Request {
            id: RequestId(5),
            op: RequestOp::Ping,
        },
        Request {
            id: RequestId(6),
            op: RequestOp::Write {
                offset: 0,
                data: data.clone(),
                sums: None,
                flush: Some(10),
            },
        },
    ];
    for r in reqs {
        let msg = pb::DataRequest::from(r.clone());
        assert_eq!(Request::try_from(msg), Ok(r));
    }
    let hello = pb::DataRequest {
        id: 0,
        op: Some(pb::data_request::Op::Hello(pb::DataHello::default())),
    };
    assert_eq!(Request::try_from(hello), Err(GrpcRequestError::Hello));
    let none = pb::DataRequest { id: 1, op: None };
    assert_eq!(Request::try_from(none), Err(GrpcRequestError::NoOp));
    let short = pb::DataRequest {
        id: 1,
        op: Some(pb::data_request::Op::Write(pb::WriteOp {
            offset: 0,
            data: data.clone(),
            crc32c: vec![1],
            flush_number: None,
        })),
    };
    assert!(matches!(
        Request::try_from(short),
        Err(GrpcRequestError::SumsMismatch { sums: 1, len: 8192 })
    ));
    let resp = Response {
        data: data.clone(),
        corrupt: vec![1],
        ..Response::failed(RequestId(7), Status::Corrupt, "bad")
    };
    assert_eq!(Response::from(pb::DataResponse::from(resp.clone())), resp);
}
