//! The replica's gRPC contract, over real TCP to a real `zebu-replica` process: every bad
//! input is answered with the right status and the server keeps serving; the happy paths
//! (concurrent I/O, snapshots, layer copy between processes) move the right bytes; the CLI
//! refuses what it must with a one-line error.

use std::time::Duration;

use bytes::Bytes;
use tonic::Code;
use zebu_proto::replica::Status as DataStatus;
use zebu_proto::replica::data_request::Op;
use zebu_proto::replica::{
    self as pb, ReadOp, SnapshotCreateRequest, SnapshotDeleteRequest, SnapshotRevertRequest,
    WriteOp,
};
use zebu_tests::model::{BLOCK, block_data, blocks_data, decode};
use zebu_tests::{DataStream, ReplicaProcess, loopback, run_replica_cli};

const SIZE: u64 = 16 << 20;

fn start(tmp: &tempfile::TempDir, name: &str, ip: u8) -> ReplicaProcess {
    ReplicaProcess::start(&tmp.path().join(name), SIZE, loopback(ip)).expect("replica starts")
}

/// A good request still works on `stream`: write a block, read it back.
async fn assert_serves(stream: &mut DataStream) {
    let data = block_data(3, 99);
    stream
        .write(3 * BLOCK, data.clone())
        .await
        .expect("write after a bad request");
    let back = stream
        .read(3 * BLOCK, BLOCK)
        .await
        .expect("read after a bad request");
    assert_eq!(back.as_ref(), data.as_slice());
}

fn status_of(r: &pb::DataResponse) -> DataStatus {
    DataStatus::try_from(r.status).expect("known status")
}

#[tokio::test]
async fn read_past_the_end_is_invalid_and_names_the_size() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 2);
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    for (offset, length) in [
        (SIZE, BLOCK),
        (SIZE - BLOCK, 2 * BLOCK),
        (u64::MAX - 10, BLOCK),
    ] {
        let resp = s.call(Op::Read(ReadOp { offset, length })).await.unwrap();
        assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
        assert!(
            resp.message
                .contains(&format!("outside the volume of {SIZE} bytes")),
            "{}",
            resp.message
        );
    }
    let resp = s
        .call(Op::Write(WriteOp {
            offset: SIZE,
            data: Bytes::from(vec![1; 4096]),
            crc32c: Vec::new(),
            flush_number: None,
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn zero_length_requests_are_invalid() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 3);
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    let resp = s
        .call(Op::Read(ReadOp {
            offset: 0,
            length: 0,
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    assert!(!resp.message.is_empty());
    let resp = s
        .call(Op::Write(WriteOp {
            offset: 0,
            data: Bytes::new(),
            crc32c: Vec::new(),
            flush_number: None,
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    let resp = s
        .call(Op::Unmap(pb::UnmapOp {
            offset: 0,
            length: 0,
            zero_fill: false,
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn unaligned_write_is_read_modify_write() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 4);
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    let base = blocks_data(0, 4, 7);
    s.write(0, base.clone()).await.unwrap();
    // 5000 bytes at 1000: spans three blocks, aligned at neither end.
    let patch: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8 + 1).collect();
    s.write(1000, patch.clone())
        .await
        .expect("unaligned write succeeds");
    let mut expect = base.clone();
    expect[1000..6000].copy_from_slice(&patch);
    let back = s.read(0, 4 * BLOCK).await.unwrap();
    assert!(
        back.as_ref() == expect.as_slice(),
        "unaligned write read back wrong"
    );
    // An unaligned read of the middle.
    let mid = s.read(999, 5002).await.unwrap();
    assert_eq!(mid.as_ref(), &expect[999..6001]);
    s.flush().await.unwrap();
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn oversized_message_ends_only_its_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 5);
    let mut client = r.client().await.unwrap();
    let mut other = DataStream::open(&mut client, 1).await.unwrap();

    // A read larger than one request may move is answered, and the stream goes on.
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    let resp = s
        .call(Op::Read(ReadOp {
            offset: 0,
            length: 12 << 20,
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    assert!(
        resp.message.contains("larger than the limit"),
        "{}",
        resp.message
    );
    assert_serves(&mut s).await;

    // A 20 MiB message is more than the transport accepts: that stream ends, clearly.
    let big = Bytes::from(vec![0xAB; 20 << 20]);
    let id = s
        .send(Op::Write(WriteOp {
            offset: 0,
            data: big,
            crc32c: Vec::new(),
            flush_number: None,
        }))
        .await
        .unwrap();
    let err = s.wait(id).await.expect_err("the stream must end");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("limit"), "{}", err.message());

    // Other streams and new ones keep working.
    assert_serves(&mut other).await;
    let mut again = DataStream::open(&mut client, 1).await.unwrap();
    assert_serves(&mut again).await;
}

#[tokio::test]
async fn lower_generation_is_refused_and_higher_fences_the_older_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 6);
    let mut client = r.client().await.unwrap();
    let mut g5 = DataStream::open(&mut client, 5).await.unwrap();
    assert_serves(&mut g5).await;

    let err = match DataStream::open(&mut client, 4).await {
        Ok(_) => panic!("generation 4 accepted after 5"),
        Err(e) => e,
    };
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains('4') && err.message().contains('5'),
        "{}",
        err.message()
    );
    // The refused stream did not disturb the accepted one.
    assert_serves(&mut g5).await;

    let mut g6 = DataStream::open(&mut client, 6).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), g5.recv())
        .await
        .expect("the older stream ends promptly");
    let err = ended.expect_err("the older stream ends with an error");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("superseded"), "{}", err.message());
    assert_serves(&mut g6).await;

    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.generation, 6);
}

#[tokio::test]
async fn unknown_snapshot_is_not_found() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 7);
    let mut client = r.client().await.unwrap();
    let err = client
        .snapshot_delete(SnapshotDeleteRequest {
            name: "nope".into(),
        })
        .await
        .expect_err("delete of an unknown snapshot");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("nope"), "{}", err.message());
    let err = client
        .snapshot_revert(SnapshotRevertRequest {
            name: "nope".into(),
        })
        .await
        .expect_err("revert to an unknown snapshot");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    // Creating the same name twice.
    let create = SnapshotCreateRequest {
        name: "s1".into(),
        user_created: true,
        ..Default::default()
    };
    client.snapshot_create(create.clone()).await.unwrap();
    let err = client
        .snapshot_create(create)
        .await
        .expect_err("duplicate name");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn io_after_close_is_unavailable_until_open() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 8);
    let mut client = r.client().await.unwrap();
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    s.write(0, block_data(0, 1)).await.unwrap();
    client.close(pb::CloseRequest {}).await.unwrap();
    // The open stream ends.
    let err = tokio::time::timeout(Duration::from_secs(5), s.recv())
        .await
        .expect("the stream ends promptly")
        .expect_err("the stream ends with an error");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // New streams are refused, control RPCs too; Info still answers.
    let err = DataStream::open(&mut client, 1)
        .await
        .err()
        .expect("refused while closed");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let err = client
        .snapshot_create(SnapshotCreateRequest {
            name: "x".into(),
            ..Default::default()
        })
        .await
        .expect_err("snapshot while closed");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert!(!info.open);
    assert_eq!(info.size, SIZE);

    let info = client.open(pb::OpenRequest {}).await.unwrap().into_inner();
    assert!(info.open);
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    assert_eq!(
        s.read(0, BLOCK).await.unwrap().as_ref(),
        block_data(0, 1).as_slice()
    );
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn many_requests_in_flight_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 9);
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    const N: u64 = 512;
    let mut ids = std::collections::HashMap::new();
    for b in 0..N {
        let id = s
            .send(Op::Write(WriteOp {
                offset: b * BLOCK,
                data: block_data(b, 1000 + b).into(),
                crc32c: Vec::new(),
                flush_number: None,
            }))
            .await
            .unwrap();
        ids.insert(id, b);
    }
    let mut out_of_order = false;
    let mut last = 0;
    for _ in 0..N {
        let resp = s.recv().await.unwrap();
        assert_eq!(status_of(&resp), DataStatus::Ok, "{resp:?}");
        assert!(ids.remove(&resp.id).is_some(), "unexpected id {}", resp.id);
        out_of_order |= resp.id < last;
        last = resp.id;
    }
    eprintln!("responses came out of order: {out_of_order}");
    let n = s.flush().await.unwrap();
    assert!(n >= 1);
    let mut reads = std::collections::HashMap::new();
    for b in (0..N).rev() {
        let id = s
            .send(Op::Read(ReadOp {
                offset: b * BLOCK,
                length: BLOCK,
            }))
            .await
            .unwrap();
        reads.insert(id, b);
    }
    for _ in 0..N {
        let resp = s.recv().await.unwrap();
        let b = reads.remove(&resp.id).expect("known id");
        assert_eq!(decode(b, &resp.data), Ok(1000 + b));
    }
    // A larger I/O in one request.
    let big = blocks_data(600, 256, 5);
    s.write(600 * BLOCK, big.clone()).await.unwrap();
    assert!(s.read(600 * BLOCK, 256 * BLOCK).await.unwrap().as_ref() == big.as_slice());
}

#[tokio::test]
async fn snapshot_create_shows_in_info_and_revert_restores_it() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 10);
    let mut client = r.client().await.unwrap();
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    s.write(0, block_data(0, 1)).await.unwrap();
    let info = client
        .snapshot_create(SnapshotCreateRequest {
            name: "s1".into(),
            user_created: true,
            labels: [("k".to_string(), "v".to_string())].into(),
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = info
        .layers
        .iter()
        .map(|l| (l.name.as_str(), l.head))
        .collect();
    assert_eq!(names, [("s1", false), ("", true)]);
    let s1 = &info.layers[0];
    assert!(s1.user_created);
    assert_eq!(s1.labels.get("k").map(String::as_str), Some("v"));
    assert!(s1.data_bytes >= BLOCK);
    assert_eq!(info.layers[1].parent, s1.id);

    s.write(0, block_data(0, 2)).await.unwrap();
    assert_eq!(decode(0, &s.read(0, BLOCK).await.unwrap()), Ok(2));
    client
        .snapshot_revert(SnapshotRevertRequest { name: "s1".into() })
        .await
        .unwrap();
    assert_eq!(decode(0, &s.read(0, BLOCK).await.unwrap()), Ok(1));
    let info = client
        .snapshot_delete(SnapshotDeleteRequest { name: "s1".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(
        info.layers.iter().all(|l| l.name != "s1"),
        "{:?}",
        info.layers
    );
    assert_eq!(decode(0, &s.read(0, BLOCK).await.unwrap()), Ok(1));
}

#[tokio::test]
async fn layer_copies_between_replica_processes() {
    use futures::StreamExt;
    let tmp = tempfile::tempdir().unwrap();
    let src = start(&tmp, "src", 11);
    let dst = start(&tmp, "dst", 12);
    let mut sc = src.client().await.unwrap();
    let mut dc = dst.client().await.unwrap();
    let mut s = DataStream::open(&mut sc, 1).await.unwrap();
    // Sparse data: three separate extents, one of them 3 MiB (several chunks).
    s.write(0, blocks_data(0, 2, 1)).await.unwrap();
    s.write(100 * BLOCK, blocks_data(100, 768, 2))
        .await
        .unwrap();
    s.write(SIZE - BLOCK, block_data(SIZE / BLOCK - 1, 3))
        .await
        .unwrap();
    sc.snapshot_create(SnapshotCreateRequest {
        name: "base".into(),
        user_created: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let info = sc.info(pb::InfoRequest {}).await.unwrap().into_inner();
    let base = info
        .layers
        .iter()
        .find(|l| l.name == "base")
        .expect("base layer")
        .clone();

    let extents = sc
        .list_extents(pb::ListExtentsRequest {
            layer: "base".into(),
            offset: 0,
            length: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(extents.layer_size, SIZE);
    let listed: u64 = extents.extents.iter().map(|e| e.length).sum();
    assert_eq!(listed, (2 + 768 + 1) * BLOCK, "{:?}", extents.extents);

    let mut chunks = sc
        .read_layer(pb::ReadLayerRequest {
            layer: "base".into(),
            extents: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    let mut msgs = vec![pb::WriteLayerRequest {
        layer: "base".into(),
        parent: String::new(),
        user_created: base.user_created,
        created: base.created.clone(),
        labels: base.labels.clone(),
        size: base.size,
        chunk: None,
    }];
    let mut copied = 0;
    while let Some(c) = chunks.next().await {
        let c = c.unwrap();
        assert!(
            c.data.len() as u64 <= 1 << 20,
            "chunk of {} bytes",
            c.data.len()
        );
        copied += c.data.len() as u64;
        msgs.push(pb::WriteLayerRequest {
            chunk: Some(c),
            ..Default::default()
        });
    }
    assert_eq!(copied, listed);
    let resp = dc
        .write_layer(futures::stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.bytes_written, copied);

    let info = dc.info(pb::InfoRequest {}).await.unwrap().into_inner();
    let names: Vec<_> = info.layers.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["base", ""], "{:?}", info.layers);
    let mut d = DataStream::open(&mut dc, 1).await.unwrap();
    assert_eq!(
        d.read(0, 2 * BLOCK).await.unwrap().as_ref(),
        blocks_data(0, 2, 1).as_slice()
    );
    assert!(
        d.read(100 * BLOCK, 768 * BLOCK).await.unwrap().as_ref()
            == blocks_data(100, 768, 2).as_slice()
    );
    assert_eq!(
        decode(
            SIZE / BLOCK - 1,
            &d.read(SIZE - BLOCK, BLOCK).await.unwrap()
        ),
        Ok(3)
    );
    assert_eq!(
        d.read(2 * BLOCK, BLOCK).await.unwrap().as_ref(),
        &[0u8; 4096][..]
    );
}

#[tokio::test]
async fn sigterm_closes_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut r = start(&tmp, "r", 13);
    let mut client = r.client().await.unwrap();
    let mut s = DataStream::open(&mut client, 1).await.unwrap();
    s.write(0, block_data(0, 5)).await.unwrap();
    let status = r.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "exit {status}; log:\n{}", r.log());
    drop(r);
    let r = ReplicaProcess::start(&tmp.path().join("r"), SIZE, loopback(13)).unwrap();
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    assert_eq!(decode(0, &s.read(0, BLOCK).await.unwrap()), Ok(5));
}

fn one_line_error(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<_> = stderr
        .lines()
        .filter(|l| l.starts_with("zebu-replica: error:"))
        .collect();
    assert_eq!(lines.len(), 1, "stderr:\n{stderr}");
    lines[0].to_string()
}

#[test]
fn serve_refuses_a_replica_of_another_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let mut r = ReplicaProcess::start(&dir, SIZE, loopback(14)).unwrap();
    r.terminate(Duration::from_secs(10)).unwrap();
    let out = run_replica_cli(&[
        "serve",
        "--dir",
        dir.to_str().unwrap(),
        "--listen",
        "127.0.0.14:0",
        "--size",
        "32M",
    ]);
    assert!(!out.status.success());
    let line = one_line_error(&out);
    assert!(
        line.contains(&SIZE.to_string()) && line.contains(&(32u64 << 20).to_string()),
        "{line}"
    );
    assert!(out.stdout.is_empty(), "it must not claim to listen");
}

#[test]
fn serve_refuses_a_directory_that_is_not_a_replica() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a replica").unwrap();
    let out = run_replica_cli(&[
        "serve",
        "--dir",
        dir.to_str().unwrap(),
        "--listen",
        "127.0.0.15:0",
        "--size",
        "16M",
    ]);
    assert!(!out.status.success());
    let line = one_line_error(&out);
    assert!(line.contains("not a replica"), "{line}");
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "not a replica"
    );
}

#[test]
fn serve_refuses_a_bad_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let out = run_replica_cli(&[
        "serve",
        "--dir",
        dir.to_str().unwrap(),
        "--listen",
        "127.0.0.16:0",
        "--size",
        "10Q",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid size \"10Q\""), "{stderr}");
    assert!(!dir.exists(), "nothing may be created");
}

#[test]
fn info_prints_the_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let mut r = ReplicaProcess::start(&dir, SIZE, loopback(17)).unwrap();
    r.terminate(Duration::from_secs(10)).unwrap();
    let out = run_replica_cli(&["info", "--dir", dir.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["size"], SIZE);
    assert_eq!(v["layers"].as_array().map(Vec::len), Some(1));
}

/// Opens a raw data stream whose first messages are `first`; returns how it ended.
async fn raw_stream(r: &ReplicaProcess, first: Vec<pb::DataRequest>) -> tonic::Status {
    use futures::StreamExt;
    let mut client = r.client().await.unwrap();
    let stream = futures::stream::iter(first).chain(futures::stream::pending());
    let mut rx = match client.data(stream).await {
        Ok(resp) => resp.into_inner(),
        Err(status) => return status,
    };
    match rx.message().await {
        Ok(m) => panic!("expected the stream to end with an error, got {m:?}"),
        Err(status) => status,
    }
}

#[tokio::test]
async fn hello_must_come_first_and_speak_a_version_the_replica_knows() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 18);
    let read = pb::DataRequest {
        id: 1,
        op: Some(Op::Read(ReadOp {
            offset: 0,
            length: BLOCK,
        })),
    };
    let status = raw_stream(&r, vec![read]).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("hello"), "{}", status.message());

    let hello = pb::DataRequest {
        id: 0,
        op: Some(Op::Hello(pb::DataHello {
            protocol_version: pb::PROTOCOL_VERSION + 1,
            generation: 1,
            ..Default::default()
        })),
    };
    let status = raw_stream(&r, vec![hello]).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status
            .message()
            .contains(&format!("protocol version {}", pb::PROTOCOL_VERSION + 1)),
        "{}",
        status.message()
    );

    // A second hello on an accepted stream is a bad request, not the end of the stream.
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    let resp = s
        .call(Op::Hello(pb::DataHello {
            protocol_version: 1,
            generation: 1,
            ..Default::default()
        }))
        .await
        .unwrap();
    assert_eq!(status_of(&resp), DataStatus::Invalid, "{resp:?}");
    assert_serves(&mut s).await;
}

#[tokio::test]
async fn half_closed_stream_still_answers_requests_in_flight() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, "r", 19);
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    for b in 0..64 {
        s.send(Op::Write(WriteOp {
            offset: b * BLOCK,
            data: block_data(b, 7).into(),
            crc32c: Vec::new(),
            flush_number: None,
        }))
        .await
        .unwrap();
    }
    let mut rx = s.close_send();
    let mut answered = 0;
    while let Some(resp) = rx.message().await.expect("clean end") {
        assert_eq!(status_of(&resp), DataStatus::Ok, "{resp:?}");
        answered += 1;
    }
    assert_eq!(answered, 64);
}
