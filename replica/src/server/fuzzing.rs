//! Fuzzing harnesses (doc-hidden): the frames decoders on arbitrary bytes, and a whole
//! frames connection of a real replica server fed arbitrary bytes. The cargo-fuzz targets in
//! `fuzz/` only forward their input here, so the harness compiles and is tested with the
//! replica (see the tests below, which also run it on seeded random inputs).
//!
//! Invariants checked, on every input:
//! - decoding never panics; every frame decoded re-encodes to a frame that decodes equal;
//! - a volume claim in a hello's extensions decodes or is refused, never panics;
//! - the server answers with a byte stream that decodes as whole responses, each one valid
//!   (a server that sends a malformed answer, panics or hangs on its input fails).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zebu_proto::frames::{self, Decoded, VolumeClaim};

use super::ReplicaServer;
use crate::io::{BackendKind, IoEngine};
use crate::store::Replica;

/// The frames decoders on `data` as a request stream, a hello, and a response stream.
pub fn decoders(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    if let Ok(Decoded::Frame(h)) = frames::decode_hello(&mut buf) {
        let _ = VolumeClaim::from_extensions(&h.extensions);
        let mut again = BytesMut::from(&h.encode()[..]);
        match frames::decode_hello(&mut again) {
            Ok(Decoded::Frame(back)) => assert_eq!(back, h, "a hello re-encodes equal"),
            other => panic!("a decoded hello does not decode again: {other:?}"),
        }
    }
    let mut buf = BytesMut::from(data);
    while let Ok(Decoded::Frame(req)) = frames::decode_request(&mut buf) {
        let mut one = BytesMut::from(&req.header().encode()[..]);
        if let frames::RequestOp::Write { data, .. } = &req.op {
            if let Some(s) = req.sums() {
                one.extend_from_slice(s.as_bytes());
            }
            one.extend_from_slice(data);
        }
        match frames::decode_request(&mut one) {
            Ok(Decoded::Frame(back)) => assert_eq!(back, req, "a request re-encodes equal"),
            other => panic!("a decoded request does not decode again: {other:?}"),
        }
    }
    let mut buf = BytesMut::from(data);
    while let Ok(Decoded::Frame(_)) = frames::decode_response(&mut buf) {}
}

struct Fixture {
    rt: tokio::runtime::Runtime,
    server: ReplicaServer,
}

/// One replica (16 MiB, in a temporary directory removed at exit) served for every input.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("invariant: a runtime for the fuzz harness");
        let dir = std::env::temp_dir().join(format!(
            "zebu-fuzz-replica.{}.{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let server = rt.block_on(async {
            let io = IoEngine::new(BackendKind::Threads).expect("invariant: an I/O engine");
            let r: Arc<Replica> = Replica::create(&dir, 16 << 20, io.clone())
                .await
                .expect("invariant: a replica in the temporary directory");
            ReplicaServer::new(&dir, io, r)
        });
        Fixture { rt, server }
    })
}

/// Feeds `data` to a frames connection of a real replica server as the client's whole
/// stream, then checks the server's answers (module docs).
pub fn frames_connection(data: &[u8]) {
    let f = fixture();
    let out = f.rt.block_on(async {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (srd, swr) = tokio::io::split(server);
        let shared = f.server.shared.clone();
        let serve = tokio::spawn(super::frames::serve(shared, srd, swr, "fuzz"));
        let (mut crd, mut cwr) = tokio::io::split(client);
        let send = async {
            let _ = cwr.write_all(data).await;
            let _ = cwr.shutdown().await;
        };
        let mut out = Vec::new();
        let recv = crd.read_to_end(&mut out);
        let run = async {
            let (_, r) = tokio::join!(send, recv);
            let _ = r;
            serve.await
        };
        match tokio::time::timeout(Duration::from_secs(20), run).await {
            Ok(Ok(())) => out,
            Ok(Err(e)) => panic!("the frames server task failed: {e}"),
            Err(_) => panic!("the frames server did not finish within 20 s"),
        }
    });
    let mut buf = BytesMut::from(&out[..]);
    loop {
        match frames::decode_response(&mut buf) {
            Ok(Decoded::Frame(_)) => {}
            Ok(Decoded::Need(_)) if buf.is_empty() => break,
            Ok(Decoded::Need(n)) => panic!("the server's answers end inside a frame ({n} needed)"),
            Err(e) => panic!("the server sent a malformed answer: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use zebu_proto::frames::{Hello, Request, RequestOp};

    use super::*;

    /// A valid stream (hello, write, read, flush, ping) and its cuts and bit flips, then
    /// seeded random inputs: the stable counterpart of the cargo-fuzz targets.
    #[test]
    fn harnesses_hold_on_valid_damaged_and_random_input() {
        let mut valid = Hello::new(frames::VERSION, 1).encode();
        let reqs = [
            Request {
                id: 1,
                op: RequestOp::Write {
                    offset: 4096,
                    data: bytes::Bytes::from(vec![7u8; 4096]),
                    sums: None,
                },
            },
            Request {
                id: 2,
                op: RequestOp::Read {
                    offset: 0,
                    length: 8192,
                },
            },
            Request {
                id: 3,
                op: RequestOp::Flush {
                    flush_number: u64::MAX,
                },
            },
            Request {
                id: 4,
                op: RequestOp::Ping,
            },
        ];
        for r in &reqs {
            valid.extend_from_slice(&r.header().encode());
            if let RequestOp::Write { data, .. } = &r.op {
                valid.extend_from_slice(data);
            }
        }
        decoders(&valid);
        frames_connection(&valid);
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x18_f022);
        for _ in 0..64 {
            let mut v = valid.clone();
            let cut = rng.random_range(0..v.len());
            v.truncate(cut);
            if !v.is_empty() {
                let at = rng.random_range(0..v.len());
                v[at] ^= 1 << rng.random_range(0..8);
            }
            decoders(&v);
            frames_connection(&v);
        }
        for _ in 0..64 {
            let len = rng.random_range(0..512);
            let mut v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if rng.random_bool(0.5) && v.len() >= 4 {
                v[..4].copy_from_slice(&frames::MAGIC);
            }
            decoders(&v);
            frames_connection(&v);
        }
    }
}
