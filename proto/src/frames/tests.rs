use super::*;
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
    let h = Hello {
        version: 2,
        generation: 0x0102_0304_0506_0708,
    };
    let b = h.encode();
    assert_eq!(&b[..4], b"ZBDF");
    assert_eq!(&b[4..8], &[2, 0, 0, 0], "little-endian version");
    assert_eq!(b[8], 0x08, "little-endian generation");
    assert_eq!(Hello::decode(&b), Ok(h));
    let mut bad = b;
    bad[0] = b'P';
    assert!(matches!(Hello::decode(&bad), Err(FrameError::BadMagic(_))));
}

#[test]
fn every_request_round_trips() {
    let reqs = [
        Request {
            id: 1,
            op: RequestOp::Read {
                offset: 4096,
                length: 8192,
            },
        },
        Request {
            id: 2,
            op: RequestOp::Write {
                offset: 12288,
                data: Bytes::from(vec![7u8; 4096]),
            },
        },
        Request {
            id: 3,
            op: RequestOp::Unmap {
                offset: 0,
                length: 1 << 20,
                zero_fill: true,
            },
        },
        Request {
            id: 4,
            op: RequestOp::Unmap {
                offset: 0,
                length: 1 << 20,
                zero_fill: false,
            },
        },
        Request {
            id: u64::MAX,
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
        id: 5,
        op: RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![1u8; 100]),
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
        id: 6,
        op: RequestOp::Write {
            offset: 0,
            data: data.clone(),
        },
    };
    let mut b = Batch::default();
    b.push_request(&r);
    let slices = b.io_slices();
    assert_eq!(slices.len(), 2);
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
        id: 1,
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
        length: u64::MAX,
        ..too_big
    };
    assert_eq!(RequestHeader::decode(&huge_read.encode()), Ok(huge_read));
    assert_eq!(huge_read.payload_len(), 0);
}

#[test]
fn responses_round_trip_with_message_and_data() {
    let resps = [
        Response::ok(0),
        Response {
            data: Bytes::from(vec![3u8; 4096]),
            ..Response::ok(10)
        },
        Response {
            data: Bytes::from(vec![4u8; 1 << 20]),
            ..Response::ok(11)
        },
        Response {
            flush_number: 42,
            ..Response::ok(12)
        },
        Response::failed(
            13,
            Status::Invalid,
            "read of 9 bytes is larger than … the limit",
        ),
        Response::failed(14, Status::NoSpace, "disk full"),
        Response {
            end: true,
            ..Response::failed(0, Status::Unavailable, "fenced: generation 1 < 2")
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
        ..Response::ok(5)
    };
    // Zeros that are real data (not from `zeros`) are sent as they are.
    let written_zeros = Response {
        data: Bytes::from(vec![0u8; 4096]),
        ..Response::ok(6)
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
    let r = Response::failed(1, Status::IoError, msg);
    let mut buf = frame_of_response(&r);
    let back = one_response(&mut buf);
    assert!(back.message.len() <= MAX_MESSAGE_LEN);
    assert!(back.message.len() >= MAX_MESSAGE_LEN - 1);
    assert!(back.message.chars().all(|c| c == 'é'));
}

#[test]
fn malformed_response_headers_are_errors() {
    let good = Response::ok(1).header().encode();
    let mut h = good;
    h[0] = 5;
    assert_eq!(
        ResponseHeader::decode(&h),
        Err(FrameError::UnknownStatus(5))
    );
    let mut h = good;
    h[1] = 4;
    assert!(matches!(
        ResponseHeader::decode(&h),
        Err(FrameError::BadFlags { .. })
    ));
    // ZEROS is for data, which only an OK answer has.
    let mut h = Response::failed(1, Status::IoError, "x").header();
    h.zeros = true;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::BadFlags { .. })
    ));
    let mut h = good;
    h[30] = 1;
    assert_eq!(ResponseHeader::decode(&h), Err(FrameError::Reserved));
    let mut h = Response::ok(1).header();
    h.message_len = MAX_MESSAGE_LEN as u32 + 1;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::TooLarge { .. })
    ));
    let mut h = Response::ok(1).header();
    h.payload_len = MAX_IO_BYTES as u32 + 1;
    assert!(matches!(
        ResponseHeader::decode(&h.encode()),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn display_leaves_out_payloads() {
    let r = Request {
        id: 3,
        op: RequestOp::Write {
            offset: 8192,
            data: Bytes::from(vec![0xAB; 4096]),
        },
    };
    assert_eq!(r.to_string(), "#3 write 8192+4096");
    let a = Response {
        data: Bytes::from(vec![0xAB; 4096]),
        ..Response::ok(3)
    };
    assert_eq!(a.to_string(), "#3 STATUS_OK 4096 bytes");
}

fn arb_request() -> impl Strategy<Value = Request> {
    let op = prop_oneof![
        (any::<u64>(), any::<u64>())
            .prop_map(|(offset, length)| RequestOp::Read { offset, length }),
        (
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..40_000)
        )
            .prop_map(|(offset, d)| RequestOp::Write {
                offset,
                data: Bytes::from(d)
            }),
        (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(offset, length, zero_fill)| {
            RequestOp::Unmap {
                offset,
                length,
                zero_fill,
            }
        }),
        any::<u64>().prop_map(|flush_number| RequestOp::Flush { flush_number }),
    ];
    (any::<u64>(), op).prop_map(|(id, op)| Request { id, op })
}

fn arb_response() -> impl Strategy<Value = Response> {
    (
        any::<u64>(),
        0i32..5,
        any::<bool>(),
        "\\PC{0,40}",
        any::<u64>(),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..40_000).prop_map(Bytes::from),
            (0usize..40_000).prop_map(zeros),
        ],
    )
        .prop_map(|(id, s, end, message, flush_number, data)| Response {
            id,
            status: Status::try_from(s).expect("0..5 are statuses"),
            end,
            message,
            flush_number,
            data,
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
        let left_out: usize = resps
            .iter()
            .filter(|r| version >= ZEROS_VERSION && r.status == Status::Ok && is_zeros(&r.data))
            .map(|r| r.data.len())
            .sum();
        let full: usize = resps
            .iter()
            .map(|r| RESPONSE_HEADER_LEN + r.wire_message().len() + r.data.len())
            .sum();
        prop_assert_eq!(bytes.len(), full - left_out);
        prop_assert_eq!(decode_all(&bytes, step, decode_response)?, resps);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), step in 1usize..64) {
        let _ = decode_all(&bytes, step, decode_request);
        let _ = decode_all(&bytes, step, decode_response);
        if let Some(h) = bytes.first_chunk::<HELLO_LEN>() {
            let _ = Hello::decode(h);
        }
    }

    #[test]
    fn arbitrary_headers_never_panic(
        mut head in proptest::array::uniform32(any::<u8>()),
        op in 0u8..6,
        zero in any::<bool>(),
    ) {
        // Bias towards headers that pass the cheap checks, so the deeper ones run too.
        head[0] = op;
        if zero {
            head[2..8].fill(0);
        }
        let mut req = BytesMut::from(&head[..]);
        req.extend_from_slice(&[0u8; 8]);
        let _ = decode_request(&mut req);
        let mut resp = BytesMut::from(&head[..]);
        let _ = decode_response(&mut resp);
    }
}
