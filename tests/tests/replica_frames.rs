//! The data-frames transport against a real `zebu-replica serve` process, over real TCP on
//! the replica's one port and over its local Unix socket: the data it moves, requests
//! answered out of order, fencing across transports (frames and gRPC streams fence each
//! other), hostile input that ends only its own connection, the engine's local data path
//! across a kill -9 of that replica, and the engine's old gRPC data path surviving one.
//!
//! Run with `--test-threads=1` when other suites run at the same time: the tests use fixed
//! loopback addresses (127.0.0.40-49).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tonic::Code;
use zebu_engine::blockdev::BlockDevice;
use zebu_proto::frames::{
    self, Batch, Decoded, Hello, MAX_FRAME_PAYLOAD, Request, RequestHeader, RequestOp, Response,
};
use zebu_proto::ids::RequestId;
use zebu_proto::replica::{MAX_IO_BYTES, Status};
use zebu_testkit::workload::{Expect, RunId};
use zebu_tests::engine::{
    Background, Cluster, assert_clean_run, assert_verified, busy_workload, mode_in,
};
use zebu_tests::model::{BLOCK, block_data, decode};
use zebu_tests::{DataStream, ReplicaProcess, loopback, test_seed};

const SIZE: u64 = 64 << 20;
/// Every wait for the replica is bounded, so a hang fails the test instead of stalling it.
const WAIT: Duration = Duration::from_secs(10);

fn start(tmp: &tempfile::TempDir, ip: u8) -> ReplicaProcess {
    ReplicaProcess::start(&tmp.path().join("r"), SIZE, loopback(ip)).expect("replica starts")
}

trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// A raw frames connection (TCP, or the replica's local socket), as the engine's transport
/// speaks it but with every byte under the test's control.
struct Frames {
    stream: Box<dyn Duplex>,
    buf: BytesMut,
    next_id: u64,
}

impl Frames {
    async fn connect(addr: SocketAddr) -> Frames {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Frames::over(stream)
    }

    fn over(stream: impl Duplex + 'static) -> Frames {
        Frames {
            stream: Box::new(stream),
            buf: BytesMut::new(),
            next_id: 1,
        }
    }

    /// A connection to the local socket `@name` (as a hello answer names it) whose hello at
    /// `generation` was accepted; the answer names the same socket again.
    async fn open_local(name: &str, generation: u64) -> Frames {
        let stream = connect_local(name)
            .await
            .expect("connect to the local socket");
        let mut c = Frames::over(stream);
        let hello = Hello {
            version: frames::VERSION,
            generation,
            extensions: Default::default(),
        };
        c.send_raw(&hello.encode()).await;
        let answer = c.recv().await.expect("a hello answer");
        assert_eq!(answer.status, Status::Ok, "local hello refused: {answer}");
        assert_eq!(answer.message, name, "the answer names the same socket");
        c
    }

    /// Connects and sends a hello; returns the connection and the hello's answer.
    async fn hello(addr: SocketAddr, generation: u64) -> (Frames, Response) {
        Frames::hello_in(addr, generation, frames::VERSION).await
    }

    /// [`Frames::hello`] in protocol `version`.
    async fn hello_in(addr: SocketAddr, generation: u64, version: u32) -> (Frames, Response) {
        let mut c = Frames::connect(addr).await;
        let hello = Hello {
            version,
            generation,
            extensions: Default::default(),
        };
        c.send_raw(&hello.encode()).await;
        let answer = c.recv().await.expect("a hello answer");
        (c, answer)
    }

    /// A connection whose hello was accepted.
    async fn open(addr: SocketAddr, generation: u64) -> Frames {
        let (c, answer) = Frames::hello(addr, generation).await;
        assert_eq!(answer.status, Status::Ok, "hello refused: {answer}");
        assert_eq!(answer.id, RequestId::HELLO);
        c
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    /// Sends `ops` as one batch of requests with fresh ids; returns the ids.
    async fn send(&mut self, ops: Vec<RequestOp>) -> Vec<u64> {
        let mut batch = Batch::default();
        let mut ids = Vec::new();
        for op in ops {
            let id = self.next_id;
            self.next_id += 1;
            batch.push_request(&Request {
                id: RequestId(id),
                op,
            });
            ids.push(id);
        }
        let bytes: Vec<u8> = batch
            .io_slices()
            .iter()
            .flat_map(|s| s.iter().copied())
            .collect();
        self.send_raw(&bytes).await;
        ids
    }

    /// The next response, or `None` when the server closed the connection.
    async fn recv(&mut self) -> Option<Response> {
        loop {
            match frames::decode_response(&mut self.buf).expect("a well-formed answer") {
                Decoded::Frame(r) => return Some(r),
                Decoded::Need(_) => {}
            }
            let n = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("the replica answers or closes within the wait")
                .unwrap_or(0);
            if n == 0 {
                assert!(self.buf.is_empty(), "connection ended mid-frame");
                return None;
            }
        }
    }

    async fn call(&mut self, op: RequestOp) -> Response {
        let id = self.send(vec![op]).await[0];
        let r = self.recv().await.expect("an answer");
        assert_eq!(r.id, RequestId(id), "answer {r} to a lone request");
        r
    }

    async fn write(&mut self, offset: u64, data: Vec<u8>) {
        let data = Bytes::from(data);
        let r = self
            .call(RequestOp::Write {
                offset,
                data,
                sums: None,
                flush: None,
            })
            .await;
        assert_eq!(r.status, Status::Ok, "{r}");
    }

    async fn read(&mut self, offset: u64, length: u64) -> Bytes {
        let r = self.call(RequestOp::Read { offset, length }).await;
        assert_eq!(r.status, Status::Ok, "{r}");
        r.data
    }

    /// Reads until the server closes; returns the END notice it sent, if any.
    async fn expect_end(&mut self) -> Option<Response> {
        let mut end = None;
        while let Some(r) = self.recv().await {
            if r.end {
                assert!(end.is_none(), "two END notices");
                end = Some(r);
            } else {
                assert!(end.is_none(), "an answer after END: {r}");
            }
        }
        end
    }
}

/// The replica still serves a fresh frames connection at `generation`.
async fn assert_serves(addr: SocketAddr, generation: u64, block: u64) {
    let mut c = Frames::open(addr, generation).await;
    c.write(block * BLOCK, block_data(block, 42)).await;
    assert_eq!(decode(block, &c.read(block * BLOCK, BLOCK).await), Ok(42));
}

#[tokio::test]
async fn frames_read_your_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, 40);
    let mut c = Frames::open(r.addr, 1).await;
    for b in 0..16 {
        c.write(b * BLOCK, block_data(b, 7)).await;
    }
    for b in 0..16 {
        assert_eq!(
            decode(b, &c.read(b * BLOCK, BLOCK).await),
            Ok(7),
            "block {b}"
        );
    }
    // A write large enough to travel as its own iovec, read back whole.
    let big: Vec<u8> = (0..256u64).flat_map(|b| block_data(100 + b, 9)).collect();
    c.write(100 * BLOCK, big.clone()).await;
    assert_eq!(
        c.read(100 * BLOCK, 256 * BLOCK).await.as_ref(),
        big.as_slice()
    );
    let r1 = c
        .call(RequestOp::Unmap {
            offset: 2 * BLOCK,
            length: 2 * BLOCK,
            zero_fill: false,
        })
        .await;
    assert_eq!(r1.status, Status::Ok, "{r1}");
    let r2 = c
        .call(RequestOp::Unmap {
            offset: 5 * BLOCK,
            length: BLOCK,
            zero_fill: true,
        })
        .await;
    assert_eq!(r2.status, Status::Ok, "{r2}");
    for b in [2, 3, 5] {
        assert!(
            c.read(b * BLOCK, BLOCK).await.iter().all(|&x| x == 0),
            "block {b} reads zeros"
        );
    }
    assert_eq!(decode(4, &c.read(4 * BLOCK, BLOCK).await), Ok(7));
    let f = c.call(RequestOp::Flush { flush_number: 0 }).await;
    assert_eq!(f.status, Status::Ok, "{f}");
    assert!(f.flush_number >= 1, "{f}");
    let g = c
        .call(RequestOp::Flush {
            flush_number: f.flush_number + 10,
        })
        .await;
    assert_eq!(g.flush_number, f.flush_number + 10, "{g}");
    // The same data through gRPC: one store, two transports.
    let mut s = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();
    assert_eq!(decode(4, &s.read(4 * BLOCK, BLOCK).await.unwrap()), Ok(7));
    // A clean close from the client ends the stream without an END notice.
    c.stream.shutdown().await.unwrap();
    assert_eq!(c.expect_end().await, None);
}

/// A write with a flush (version 4) is answered once, with the flush number it made
/// durable; the replica records that number as for a flush, and it is still there after a
/// `kill -9` and a restart, as is the data. A flush number of 0 lets the replica pick its own + 1, as
/// for a flush.
#[tokio::test]
async fn a_write_with_a_flush_is_answered_with_the_number_it_made_durable() {
    let tmp = tempfile::tempdir().unwrap();
    let mut r = start(&tmp, 42);
    let mut c = Frames::open(r.addr, 1).await;
    let f = c.call(RequestOp::Flush { flush_number: 0 }).await;
    assert_eq!(f.status, Status::Ok, "{f}");
    let n = f.flush_number + 5;
    let w = c
        .call(RequestOp::Write {
            offset: 3 * BLOCK,
            data: Bytes::from(block_data(3, 11)),
            sums: None,
            flush: Some(n),
        })
        .await;
    assert_eq!(w.status, Status::Ok, "{w}");
    assert_eq!(
        w.flush_number, n,
        "the answer carries the number made durable: {w}"
    );
    let picked = c
        .call(RequestOp::Write {
            offset: 4 * BLOCK,
            data: Bytes::from(block_data(4, 12)),
            sums: None,
            flush: Some(0),
        })
        .await;
    assert_eq!(picked.status, Status::Ok, "{picked}");
    assert_eq!(picked.flush_number, n + 1, "{picked}");
    // A write alone does not move the number.
    c.write(5 * BLOCK, block_data(5, 13)).await;
    assert_eq!(flush_number(&r).await, n + 1, "the replica's flush number");
    // On disk the number is recorded with its checksums, within `SUMS_SYNC_INTERVAL` (50 ms;
    // `sumsync.rs`): wait well past it before the kill.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let addr = r.addr;
    r.kill9();
    drop(c);
    let r = ReplicaProcess::start_at(&tmp.path().join("r"), SIZE, addr, &[]).expect("restart");
    assert_eq!(
        flush_number(&r).await,
        n + 1,
        "the recorded flush number after kill -9"
    );
    let mut c = Frames::open(r.addr, 2).await;
    assert_eq!(decode(3, &c.read(3 * BLOCK, BLOCK).await), Ok(11));
    assert_eq!(decode(4, &c.read(4 * BLOCK, BLOCK).await), Ok(12));
}

/// The replica's flush number, as its Info reports it.
async fn flush_number(r: &ReplicaProcess) -> u64 {
    let mut client = r.client().await.expect("control client");
    let info = client.info(zebu_proto::replica::InfoRequest {}).await;
    info.expect("info").into_inner().flush_number
}

/// Reads `length` bytes at `offset` followed by a flush, taking the answers off the socket
/// byte by byte: the flush's header must come right after the read's header and whatever
/// payload that header announces as sent. Returns the read's ZEROS flag and the payload sent.
async fn read_on_wire(c: &mut Frames, offset: u64, length: u64) -> (bool, Vec<u8>) {
    let ids = c
        .send(vec![
            RequestOp::Read { offset, length },
            RequestOp::Flush { flush_number: 0 },
        ])
        .await;
    assert!(
        c.buf.is_empty(),
        "nothing buffered: the bytes are read here"
    );
    let mut head = [0u8; frames::RESPONSE_HEADER_LEN];
    let mut take = async |buf: &mut [u8]| {
        tokio::time::timeout(WAIT, c.stream.read_exact(buf))
            .await
            .expect("answered within the wait")
            .expect("read");
    };
    take(&mut head).await;
    let h = frames::ResponseHeader::decode(&head).expect("a header");
    assert_eq!(
        (h.id, h.status, u64::from(h.payload_len)),
        (ids[0], Status::Ok, length)
    );
    let mut payload = vec![0u8; if h.zeros { 0 } else { length as usize }];
    take(&mut payload).await;
    take(&mut head).await;
    let f = frames::ResponseHeader::decode(&head).expect("the flush's header");
    assert_eq!(
        f.id, ids[1],
        "the flush answer follows the read's announced bytes"
    );
    (h.zeros, payload)
}

/// Version 2 answers a read of never-written or punched space with a ZEROS flag and no
/// payload on the wire; written zeros are data; a version-1 client gets every byte; other
/// versions are refused with the versions spoken.
#[tokio::test]
async fn holes_are_answered_without_payload_from_version_2_on() {
    const MIB: u64 = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, 46);
    let (mut c, answer) = Frames::hello_in(r.addr, 1, 2).await;
    assert_eq!(answer.status, Status::Ok, "{answer}");
    c.write(0, block_data(0, 3)).await;
    // Block 2 punched (a hole again), block 3 unmapped by writing zeros (data).
    for (block, zero_fill) in [(2, false), (3, true)] {
        let r = c
            .call(RequestOp::Unmap {
                offset: block * BLOCK,
                length: BLOCK,
                zero_fill,
            })
            .await;
        assert_eq!(r.status, Status::Ok, "{r}");
    }
    let (zeros, _) = read_on_wire(&mut c, 16 * MIB, MIB).await;
    assert!(zeros, "never-written space travels as a flag");
    let (zeros, _) = read_on_wire(&mut c, 2 * BLOCK, BLOCK).await;
    assert!(zeros, "punched space travels as a flag");
    let (zeros, data) = read_on_wire(&mut c, 3 * BLOCK, BLOCK).await;
    assert!(!zeros, "written zeros are data");
    assert!(data.iter().all(|&b| b == 0));
    let (zeros, data) = read_on_wire(&mut c, 0, BLOCK).await;
    assert!(!zeros);
    assert_eq!(decode(0, &data), Ok(3));

    let (mut v1, answer) = Frames::hello_in(r.addr, 1, 1).await;
    assert_eq!(
        answer.status,
        Status::Ok,
        "version 1 is still spoken: {answer}"
    );
    let (zeros, data) = read_on_wire(&mut v1, 16 * MIB, MIB).await;
    assert!(!zeros, "a version-1 client gets the bytes");
    assert!(data.iter().all(|&b| b == 0));

    let (mut v4, answer) = Frames::hello_in(r.addr, 1, frames::VERSION + 1).await;
    assert_ne!(answer.status, Status::Ok);
    assert!(
        answer
            .message
            .contains(&format!("protocol version {}", frames::VERSION + 1)),
        "{answer}"
    );
    assert!(v4.expect_end().await.is_none(), "nothing after the refusal");
}

#[tokio::test]
async fn many_requests_in_flight_are_answered_out_of_order_by_id() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, 41);
    let mut c = Frames::open(r.addr, 1).await;
    let blocks = 300u64;
    let writes = (0..blocks)
        .map(|b| RequestOp::Write {
            offset: b * BLOCK,
            data: Bytes::from(block_data(b, 3)),
            sums: None,
            flush: None,
        })
        .collect();
    let ids = c.send(writes).await;
    let mut seen = HashSet::new();
    for _ in 0..ids.len() {
        let a = c.recv().await.expect("an answer");
        assert_eq!(a.status, Status::Ok, "{a}");
        assert!(
            ids.contains(&a.id.0) && seen.insert(a.id.0),
            "unexpected or repeated {a}"
        );
    }
    // A big read first, then many small ones in the same batch: the small ones finish first
    // (the server answers in completion order), and every answer finds its request by id.
    let mut out_of_order = false;
    for attempt in 0..5 {
        let mut ops = vec![RequestOp::Read {
            offset: 0,
            length: MAX_IO_BYTES,
        }];
        ops.extend((0..blocks).map(|b| RequestOp::Read {
            offset: b * BLOCK,
            length: BLOCK,
        }));
        let ids = c.send(ops).await;
        let block_of: HashMap<u64, u64> = ids[1..].iter().copied().zip(0..blocks).collect();
        let mut order = Vec::new();
        for _ in 0..ids.len() {
            let a = c.recv().await.expect("an answer");
            assert_eq!(a.status, Status::Ok, "{a}");
            if a.id.0 == ids[0] {
                assert_eq!(a.data.len() as u64, MAX_IO_BYTES);
                for b in 0..blocks {
                    let at = (b * BLOCK) as usize;
                    assert_eq!(decode(b, &a.data[at..at + BLOCK as usize]), Ok(3));
                }
            } else {
                let b = block_of[&a.id.0];
                assert_eq!(decode(b, &a.data), Ok(3), "answer {a} carries block {b}");
            }
            order.push(a.id.0);
        }
        let sorted = {
            let mut v = order.clone();
            v.sort();
            v
        };
        assert_eq!(sorted, ids, "every request answered exactly once");
        if order != ids {
            eprintln!("attempt {attempt}: answers came out of order");
            out_of_order = true;
            break;
        }
    }
    assert!(
        out_of_order,
        "five batches were all answered in issue order"
    );
}

#[tokio::test]
async fn frames_and_grpc_streams_fence_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, 42);
    let mut client = r.client().await.unwrap();

    // gRPC at generation 1, then frames at 2: the gRPC stream ends, fenced.
    let mut old = DataStream::open(&mut client, 1).await.unwrap();
    old.write(0, block_data(0, 1)).await.unwrap();
    let mut f2 = Frames::open(r.addr, 2).await;
    let err = tokio::time::timeout(WAIT, old.recv())
        .await
        .expect("the old stream ends")
        .expect_err("the old stream ends with an error");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("fenced"), "{}", err.message());
    f2.write(0, block_data(0, 2)).await;

    // gRPC at 3: the frames stream at 2 gets END (fenced) and is closed.
    let mut g3 = DataStream::open(&mut client, 3).await.unwrap();
    let end = f2.expect_end().await.expect("an END notice");
    assert_eq!(end.status, Status::Unavailable, "{end}");
    assert!(
        end.message
            .contains("fenced: generation 2 was superseded by generation 3"),
        "{end}"
    );
    assert_eq!(decode(0, &g3.read(0, BLOCK).await.unwrap()), Ok(2));

    // A lower generation is refused on frames, with the reason, and the connection closed.
    let (mut low, answer) = Frames::hello(r.addr, 2).await;
    assert_eq!(answer.id, RequestId::HELLO);
    assert_eq!(answer.status, Status::Unavailable, "{answer}");
    assert!(
        answer
            .message
            .contains("generation 2 is lower than the accepted generation 3"),
        "{answer}"
    );
    assert_eq!(low.recv().await, None, "the refused connection is closed");
    // ... and on gRPC.
    let refused = DataStream::open(&mut client, 2)
        .await
        .err()
        .expect("refused");
    assert_eq!(refused.code(), Code::FailedPrecondition);

    // Another frames stream of the accepted generation runs beside the gRPC one.
    let mut f3 = Frames::open(r.addr, 3).await;
    assert_eq!(decode(0, &f3.read(0, BLOCK).await), Ok(2));
    g3.write(BLOCK, block_data(1, 5)).await.unwrap();
    assert_eq!(decode(1, &f3.read(BLOCK, BLOCK).await), Ok(5));

    // A replica close ends frames streams too; after Open, new ones work.
    client
        .close(zebu_proto::replica::CloseRequest {})
        .await
        .unwrap();
    let end = f3.expect_end().await.expect("an END notice on close");
    assert_eq!(end.status, Status::Unavailable, "{end}");
    let (_, answer) = Frames::hello(r.addr, 3).await;
    assert_eq!(
        answer.status,
        Status::Unavailable,
        "hello to a closed replica: {answer}"
    );
    client
        .open(zebu_proto::replica::OpenRequest {})
        .await
        .unwrap();
    assert_serves(r.addr, 3, 9).await;
}

/// Connects to the local socket `@name`.
async fn connect_local(name: &str) -> std::io::Result<UnixStream> {
    let abstract_name = name.strip_prefix('@').expect("an abstract socket name");
    UnixStream::connect(format!("\0{abstract_name}")).await
}

/// Every hello answer names the replica's local socket. A stream there reaches the same
/// replica (writes on either read back on the other), is fenced by a higher generation said
/// over TCP like any stream, and garbage on it ends only that connection. The name goes with
/// the process: after a kill -9 nothing answers at it.
#[tokio::test]
async fn the_local_socket_serves_the_same_replica_and_is_fenced_with_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut r = start(&tmp, 44);
    let (mut tcp, answer) = Frames::hello(r.addr, 1).await;
    assert_eq!(answer.status, Status::Ok, "{answer}");
    let name = answer.message.clone();
    assert!(
        name.starts_with("@zebu-replica."),
        "the hello answer names no local socket: {answer}"
    );

    let mut local = Frames::open_local(&name, 1).await;
    local.write(3 * BLOCK, block_data(3, 7)).await;
    assert_eq!(decode(3, &tcp.read(3 * BLOCK, BLOCK).await), Ok(7));
    tcp.write(4 * BLOCK, block_data(4, 8)).await;
    assert_eq!(decode(4, &local.read(4 * BLOCK, BLOCK).await), Ok(8));

    let mut junk = Frames::over(connect_local(&name).await.expect("connect"));
    junk.send_raw(b"GET / HTTP/1.1\r\n\r\n").await;
    assert_eq!(
        junk.recv().await,
        None,
        "garbage gets its connection closed"
    );
    assert_eq!(decode(3, &local.read(3 * BLOCK, BLOCK).await), Ok(7));

    let _g2 = Frames::open(r.addr, 2).await;
    let end = local.expect_end().await.expect("an END notice");
    assert!(
        end.message
            .contains("fenced: generation 1 was superseded by generation 2"),
        "{end}"
    );
    // ... and a stale hello is refused there as on TCP.
    let mut stale = Frames::over(connect_local(&name).await.expect("connect"));
    stale
        .send_raw(
            &Hello {
                version: frames::VERSION,
                generation: 1,
                extensions: Default::default(),
            }
            .encode(),
        )
        .await;
    let refusal = stale.recv().await.expect("a refusal");
    assert_eq!(refusal.status, Status::Unavailable, "{refusal}");

    r.kill9();
    let gone = connect_local(&name).await;
    assert!(
        gone.is_err(),
        "the local socket outlived its replica process"
    );
}

/// Runs a busy workload on `c`'s engine, kills replica `victim` with -9 in the middle and
/// checks that it goes ERR within the I/O timeout, that no acknowledged write was lost and
/// that the other replicas stayed RW.
async fn kill_under_load(
    c: &mut Cluster,
    victim: usize,
    what: &str,
    seed: u64,
) -> anyhow::Result<()> {
    let dev = c.engine().nbd_client().await?;
    let cfg = busy_workload(seed);
    let model = cfg.new_model(dev.size(), RunId::random())?;
    let bg = Background::spawn(dev, model, cfg);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let addr = c.addr(victim);
    c.kill_replica(victim);
    let deadline = c.cfg.io_timeout + Duration::from_secs(1);
    c.engine()
        .wait_until(deadline, |i| mode_in(i, &addr) == "ERR")
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", c.logs()))?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (model, report, dev) = bg.stop().await?;
    assert_clean_run(&format!("{what} across a kill -9"), &report);
    assert!(report.writes > 500, "too few writes: {report:?}");
    assert_verified(
        &format!("{what} after kill -9"),
        &dev,
        &model,
        Expect::Exact,
    )
    .await;
    let info = c.engine().info().await?;
    for i in (0..3).filter(|&i| i != victim) {
        assert_eq!(mode_in(&info, &c.addr(i)), "RW", "replica {i}");
    }
    Ok(())
}

/// An engine told that one replica is local (`--local-host`) moves that replica's data over
/// its local socket and the others' over TCP; a kill -9 of the local replica under a busy
/// workload makes it ERR within the I/O timeout, like a remote one, and loses no
/// acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_uses_the_local_socket_of_a_local_replica_and_survives_its_kill9()
-> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::replicas_only("local-kill9", 128 << 20)?;
    let local = c.addr(0);
    let host = local.rsplit_once(':').expect("host:port").0.to_string();
    c.cfg.extra_args = vec!["--local-host".into(), host];
    c.start_engine()?;
    let info = c.engine().info().await?;
    let path_of = |addr: &str| {
        info.replicas
            .iter()
            .find(|r| r.address == addr)
            .map(|r| r.data_path.clone())
    };
    assert_eq!(path_of(&local).as_deref(), Some("frames/local"), "{info:?}");
    for i in 1..3 {
        assert_eq!(
            path_of(&c.addr(i)).as_deref(),
            Some("frames/tcp"),
            "{info:?}"
        );
    }
    let listed = c.engine().cli(&["replica", "ls"]).await?;
    assert!(
        listed.to_string().contains("frames/local"),
        "replica ls: {listed}"
    );

    kill_under_load(&mut c, 0, "local data path", seed).await
}

/// Sends `bytes` after a good hello and expects an END with INVALID, then a closed connection.
async fn expect_rejected(addr: SocketAddr, what: &str, bytes: &[u8], then_close: bool) {
    let mut c = Frames::open(addr, 1).await;
    c.send_raw(bytes).await;
    if then_close {
        c.stream.shutdown().await.unwrap();
    }
    let end = c.expect_end().await;
    let end = end.unwrap_or_else(|| panic!("{what}: closed without an END notice"));
    assert_eq!(end.status, Status::Invalid, "{what}: {end}");
    eprintln!("{what}: {end}");
}

#[tokio::test]
async fn hostile_input_ends_only_its_connection() {
    let tmp = tempfile::tempdir().unwrap();
    let r = start(&tmp, 43);
    // A good connection of each kind, open through everything below.
    let mut good = Frames::open(r.addr, 1).await;
    good.write(0, block_data(0, 11)).await;
    let mut grpc = DataStream::open(&mut r.client().await.unwrap(), 1)
        .await
        .unwrap();

    // Garbage first bytes: HTTP/1 (goes to tonic), and a wrong magic starting like ours.
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"ZZZZ0123456789abcdef",
        b"Z",
    ] {
        let mut c = Frames::connect(r.addr).await;
        c.send_raw(garbage).await;
        c.stream.shutdown().await.unwrap();
        let mut rest = Vec::new();
        // Whatever tonic says to HTTP/1 (if anything), the connection must end.
        let _ = tokio::time::timeout(WAIT, c.stream.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("{garbage:?}: the replica keeps a garbage connection"));
    }

    // An oversized write length: the payload cannot be skipped.
    let huge = RequestHeader {
        op: 2,
        flags: 0,
        id: 1,
        offset: 0,
        length: MAX_FRAME_PAYLOAD + 1,
        flush_number: 0,
    };
    expect_rejected(r.addr, "oversized length", &huge.encode(), false).await;
    // An unknown op.
    let mut unknown = huge.encode();
    unknown[0] = 77;
    expect_rejected(r.addr, "unknown op", &unknown, false).await;
    // Non-zero reserved bytes.
    let mut reserved = Request {
        id: RequestId(1),
        op: RequestOp::Flush { flush_number: 0 },
    }
    .header()
    .encode();
    reserved[3] = 1;
    expect_rejected(r.addr, "reserved bytes", &reserved, false).await;
    // A truncated header, then EOF; and a write whose payload is cut short.
    let read = Request {
        id: RequestId(1),
        op: RequestOp::Read {
            offset: 0,
            length: BLOCK,
        },
    };
    expect_rejected(
        r.addr,
        "truncated header",
        &read.header().encode()[..20],
        true,
    )
    .await;
    let mut cut_write = Request {
        id: RequestId(1),
        op: RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![1u8; 8192]),
            sums: None,
            flush: None,
        },
    }
    .header()
    .encode()
    .to_vec();
    cut_write.extend_from_slice(&[1u8; 100]);
    expect_rejected(r.addr, "EOF mid-payload", &cut_write, true).await;

    // A write and a read over MAX_IO_BYTES that frame correctly: answered INVALID, the
    // connection goes on.
    let mut c = Frames::open(r.addr, 1).await;
    let over = c
        .call(RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![5u8; (MAX_IO_BYTES + BLOCK) as usize]),
            sums: None,
            flush: None,
        })
        .await;
    assert_eq!(over.status, Status::Invalid, "{over}");
    assert!(over.message.contains("larger than the limit"), "{over}");
    let over = c
        .call(RequestOp::Read {
            offset: 0,
            length: MAX_IO_BYTES + BLOCK,
        })
        .await;
    assert_eq!(over.status, Status::Invalid, "{over}");
    let past_end = c
        .call(RequestOp::Read {
            offset: SIZE,
            length: BLOCK,
        })
        .await;
    assert_eq!(past_end.status, Status::Invalid, "{past_end}");
    assert_eq!(
        decode(0, &c.read(0, BLOCK).await),
        Ok(11),
        "nothing was written"
    );

    // Everything else kept working.
    assert_eq!(decode(0, &good.read(0, BLOCK).await), Ok(11));
    assert_eq!(decode(0, &grpc.read(0, BLOCK).await.unwrap()), Ok(11));
    assert_serves(r.addr, 1, 7).await;
    let log = r.log();
    assert!(
        log.contains("frames connection ends on bad input"),
        "log:\n{log}"
    );
    assert!(!log.contains("panicked"), "log:\n{log}");
}

/// The engine's gRPC data path (no longer the default) still survives a replica kill -9
/// under a verified workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_over_grpc_data_path_survives_replica_kill9() -> anyhow::Result<()> {
    let seed = test_seed();
    let mut c = Cluster::replicas_only("grpc-kill9", 128 << 20)?;
    c.cfg.extra_args = vec!["--data-transport".into(), "grpc".into()];
    c.start_engine()?;
    kill_under_load(&mut c, 2, "gRPC data path", seed).await?;
    // The surviving replicas served a gRPC data stream, not frames.
    let r0 = c.replica(0).log();
    assert!(r0.contains("data stream accepted"), "replica log:\n{r0}");
    assert!(!r0.contains("frames stream accepted"), "replica log:\n{r0}");
    Ok(())
}

/// Writes of 64 KiB and more are read by the replica straight into memory aligned for
/// direct I/O. However the bytes arrive (one batch, or cut at odd places with pauses, so that
/// the header and part of the payload come in one read and the rest later), the data written
/// is the data sent; a connection cut in the middle of such a payload ends only itself.
#[tokio::test]
async fn large_writes_arrive_intact_however_the_bytes_are_cut() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let r = start(&tmp, 45);
    let mut c = Frames::open(r.addr, 1).await;
    // Aligned sizes take the direct path; the odd one and the small one do not.
    let sizes: [usize; 5] = [64 << 10, 1 << 20, (1 << 20) + 4096, (1 << 20) + 1, 8192];
    let mut offset = 0u64;
    let mut expected = Vec::new();
    for (round, cut) in [None, Some(1000usize), Some(4093), Some(70_000)]
        .into_iter()
        .enumerate()
    {
        let mut batch = Batch::default();
        let mut writes = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let data: Vec<u8> = (0..len)
                .map(|b| (b as u64 * 31 + i as u64 * 7 + round as u64 * 13) as u8)
                .collect();
            let id = c.next_id;
            c.next_id += 1;
            batch.push_request(&Request {
                id: RequestId(id),
                op: RequestOp::Write {
                    offset,
                    data: Bytes::from(data.clone()),
                    sums: None,
                    flush: None,
                },
            });
            writes.push(id);
            expected.push((offset, data));
            offset += (len as u64).div_ceil(BLOCK) * BLOCK;
        }
        let bytes: Vec<u8> = batch
            .io_slices()
            .iter()
            .flat_map(|s| s.iter().copied())
            .collect();
        match cut {
            None => c.send_raw(&bytes).await,
            Some(step) => {
                for piece in bytes.chunks(step) {
                    c.send_raw(piece).await;
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
        }
        let mut answered = Vec::new();
        for _ in &writes {
            let a = c.recv().await.expect("an answer");
            assert_eq!(a.status, Status::Ok, "{a}");
            answered.push(a.id.0);
        }
        answered.sort_unstable();
        assert_eq!(answered, writes);
    }
    for (off, data) in &expected {
        let got = c.read(*off, data.len() as u64).await;
        assert!(
            got[..] == data[..],
            "{} bytes written at {off} read back differently",
            data.len()
        );
    }

    // Cut in the middle of a large payload: that connection ends, another one serves.
    let mut cut_write = Request {
        id: RequestId(1),
        op: RequestOp::Write {
            offset: 0,
            data: Bytes::from(vec![9u8; 1 << 20]),
            sums: None,
            flush: None,
        },
    }
    .header()
    .encode()
    .to_vec();
    cut_write.extend_from_slice(&[9u8; 300_000]);
    expect_rejected(r.addr, "EOF mid large payload", &cut_write, true).await;
    let (off, data) = &expected[1];
    let got = c.read(*off, data.len() as u64).await;
    assert!(got[..] == data[..], "the cut write changed nothing");
}
