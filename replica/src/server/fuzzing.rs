//! Fuzzing harnesses (doc-hidden): the frames decoders on arbitrary bytes, and a whole
//! frames connection of a real replica server fed arbitrary bytes. The cargo-fuzz targets in
//! `fuzz/` only forward their input here, so the harness compiles and is tested with the
//! replica (see the tests below, which also run it on seeded random inputs).
//!
//! Invariants checked, on every input:
//! - decoding never panics; every frame decoded re-encodes to a frame that decodes equal;
//! - a volume claim in a hello's extensions decodes or is refused, never panics;
//! - the server answers with a byte stream that decodes as whole responses, each one valid
//!   (a server that sends a malformed answer, panics or hangs on its input fails);
//! - a client without the volume's secret changes nothing on a replica that requires it;
//! - that replica proves it holds the secret, and welcomes an engine that holds it at the
//!   accepted generation or one more, whatever the requests before did.
//!
//! A replica that requires the secret answers each hello with a fresh nonce, so a fuzzer
//! could never get past it on its own: [`frames_connection`] lets the first input byte choose
//! between the raw stream and a hello the harness says itself, as the engine does.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use zebu_proto::auth::{self, Secret};
use zebu_proto::frames::{self, Decoded, Hello, Response, VolumeClaim};
use zebu_proto::replica::Status;

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

/// The volume the secured replica belongs to, and its secret.
const FUZZ_VOLUME: &str = "0f0e0d0c-fuzz-4000-8000-000000000018";
const FUZZ_SECRET: &[u8] = b"the fuzz harness's volume secret, 48 bytes long.";
/// How long one input may take, all exchanges included.
const INPUT_TIMEOUT: Duration = Duration::from_secs(20);

struct Fixture {
    rt: tokio::runtime::Runtime,
    /// Started with [`FUZZ_SECRET`], belonging to [`FUZZ_VOLUME`]: what the manager runs.
    secured: ReplicaServer,
    /// Started without a secret and belonging to no volume: a replica made before volume
    /// identity, served to every protocol version.
    open: ReplicaServer,
    secret: Secret,
}

/// Two replicas (16 MiB each, in temporary directories removed at exit) served for every
/// input.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("invariant: a runtime for the fuzz harness");
        let base = std::env::temp_dir().join(format!(
            "zebu-fuzz-replica.{}.{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let secret = Secret::from_bytes(FUZZ_SECRET).expect("invariant: a long enough secret");
        let (secured, open) = rt.block_on(async {
            let io = IoEngine::new(BackendKind::Threads).expect("invariant: an I/O engine");
            let make = |name: &str| {
                let dir = base.join(name);
                let io = io.clone();
                async move {
                    let r: Arc<Replica> = Replica::create(&dir, 16 << 20, io)
                        .await
                        .expect("invariant: a replica in the temporary directory");
                    (dir, r)
                }
            };
            let (dir, r) = make("secured").await;
            r.claim_volume(Some(&VolumeClaim {
                uuid: FUZZ_VOLUME.into(),
                adopt: false,
            }))
            .await
            .expect("invariant: a fresh replica takes a volume");
            let secured = ReplicaServer::with_secret(&dir, io.clone(), r, Some(secret.clone()));
            let (dir, r) = make("open").await;
            (secured, ReplicaServer::new(&dir, io, r))
        });
        Fixture {
            rt,
            secured,
            open,
            secret,
        }
    })
}

/// What a client that does not hold the secret must never change.
#[derive(Debug, PartialEq)]
struct Untouchable {
    accepted: u64,
    volume_uuid: Option<String>,
    generation: u64,
    epoch: u64,
    epoch_members: Vec<String>,
    flush_number: u64,
    dirty_regions: Vec<u64>,
}

async fn untouchable(server: &ReplicaServer) -> Untouchable {
    let state = server.shared.state.read().await;
    let info = state
        .replica
        .as_ref()
        .expect("invariant: the harness never closes its replicas")
        .info();
    Untouchable {
        accepted: state.generation,
        volume_uuid: info.volume_uuid,
        generation: info.generation,
        epoch: info.epoch,
        epoch_members: info.epoch_members,
        flush_number: info.flush_number,
        dirty_regions: info.dirty_regions,
    }
}

/// Feeds `data` to a frames connection of a real replica server, then checks the server's
/// answers (module docs). The first byte chooses how:
///
/// - `0 mod 4`: the rest is the client's whole stream, hello included, to the replica that
///   requires the volume's secret: the fuzzer cannot compute a proof, so this drives the
///   hello decoding, the challenge and the refusals, and checks that the client changed
///   nothing (generation, volume, epoch, flush number, dirty regions);
/// - otherwise the harness says hello itself, as an engine does, and the rest of the input
///   is the request stream after the welcome, so the fuzzer reaches the request handling:
///   `1 mod 4` to the open replica (no secret, no volume; protocol version 1 to 3 chosen by
///   the second byte), `2` and `3 mod 4` to the secured one, with the challenge-response of
///   `zebu_proto::auth` and the volume's claim. The second byte also chooses the generation
///   (the accepted one, one more, or one refused: lower or too far ahead); a hello at the
///   accepted generation or one more must be welcomed.
pub fn frames_connection(data: &[u8]) {
    check_answers(&answers(data));
}

/// Everything the server sent for `data` (see [`frames_connection`]), after the hello
/// exchange in the modes where the harness says hello.
fn answers(data: &[u8]) -> Vec<u8> {
    let f = fixture();
    let Some((&mode, rest)) = data.split_first() else {
        return Vec::new();
    };
    f.rt.block_on(async {
        let run = async {
            match mode % 4 {
                0 => {
                    let before = untouchable(&f.secured).await;
                    let out = converse(&f.secured, rest).await;
                    let after = untouchable(&f.secured).await;
                    assert_eq!(
                        before, after,
                        "a client without the volume's secret changed the replica"
                    );
                    out
                }
                m => {
                    let (&choice, requests) = rest.split_first().unwrap_or((&0, &[]));
                    let server = if m == 1 { &f.open } else { &f.secured };
                    let accepted = server.shared.state.read().await.generation;
                    let (generation, must_welcome) = match (choice >> 2) & 7 {
                        0..=3 => (accepted, true),
                        4 | 5 => (accepted + 1, true),
                        6 => (accepted.saturating_sub(1), accepted == 0),
                        _ => (
                            accepted.saturating_add(zebu_proto::numbers::MAX_JUMP + 1),
                            false,
                        ),
                    };
                    let (version, claim, secret) = if m == 1 {
                        (frames::MIN_VERSION + u32::from(choice % 3), None, None)
                    } else {
                        let claim = VolumeClaim {
                            uuid: FUZZ_VOLUME.into(),
                            adopt: choice & 1 == 1,
                        };
                        (frames::VERSION, Some(claim), Some(&f.secret))
                    };
                    let hello = Engine {
                        version,
                        generation,
                        claim,
                        secret,
                        must_welcome,
                    };
                    engine_session(server, hello, requests).await
                }
            }
        };
        tokio::time::timeout(INPUT_TIMEOUT, run)
            .await
            .unwrap_or_else(|_| panic!("the frames server did not finish within {INPUT_TIMEOUT:?}"))
    })
}

/// Runs one frames connection of `server` with `input` as the client's whole stream;
/// returns everything the server sent.
async fn converse(server: &ReplicaServer, input: &[u8]) -> Vec<u8> {
    let (client, conn) = tokio::io::duplex(1 << 20);
    let (srd, swr) = tokio::io::split(conn);
    let serve = tokio::spawn(super::frames::serve(
        server.shared.clone(),
        srd,
        swr,
        "fuzz",
    ));
    let (mut crd, mut cwr) = tokio::io::split(client);
    let send = async {
        let _ = cwr.write_all(input).await;
        let _ = cwr.shutdown().await;
    };
    let mut out = Vec::new();
    let (_, _) = tokio::join!(send, crd.read_to_end(&mut out));
    if let Err(e) = serve.await {
        panic!("the frames server task failed: {e}");
    }
    out
}

/// The hello an engine says, as the harness says it for the fuzzer.
struct Engine<'a> {
    version: u32,
    generation: u64,
    claim: Option<VolumeClaim>,
    secret: Option<&'a Secret>,
    must_welcome: bool,
}

/// Says `hello` on a new frames connection of `server` (answering the challenge with the
/// secret), then sends `requests` and returns every answer after the hello's.
async fn engine_session(server: &ReplicaServer, hello: Engine<'_>, requests: &[u8]) -> Vec<u8> {
    let (client, conn) = tokio::io::duplex(1 << 20);
    let (srd, swr) = tokio::io::split(conn);
    let serve = tokio::spawn(super::frames::serve(
        server.shared.clone(),
        srd,
        swr,
        "fuzz",
    ));
    let (mut crd, mut cwr) = tokio::io::split(client);
    let mut first = Hello::new(hello.version, hello.generation);
    if let Some(c) = &hello.claim {
        first.extensions.0.push(c.to_extension());
    }
    let nc = auth::nonce();
    if hello.secret.is_some() {
        first.extensions.0.push(frames::Extension {
            kind: auth::EXT_AUTH,
            value: bytes::Bytes::copy_from_slice(&nc),
        });
    }
    let mut buf = BytesMut::new();
    let _ = cwr.write_all(&first.encode()).await;
    let mut answer = recv(&mut crd, &mut buf).await;
    if let (Some(secret), Some(a)) = (hello.secret, &answer)
        && a.status == Status::Ok
    {
        let ext = frames::Extensions::decode(a.data.clone())
            .unwrap_or_else(|e| panic!("the replica's challenge does not decode: {e}"));
        let challenge = ext
            .get(auth::EXT_AUTH)
            .unwrap_or_else(|| panic!("the replica answered the nonce without a challenge"));
        let volume = hello.claim.as_ref().map_or("", |c| c.uuid.as_str());
        let ns = secret
            .check_server(&nc, challenge, volume)
            .unwrap_or_else(|e| panic!("the replica's proof does not check: {e}"));
        let proof = secret.client_proof(&nc, &ns, volume, hello.version, hello.generation);
        let mut second = Hello::new(hello.version, hello.generation);
        second.extensions.0.push(frames::Extension {
            kind: auth::EXT_AUTH,
            value: bytes::Bytes::copy_from_slice(&proof),
        });
        let _ = cwr.write_all(&second.encode()).await;
        answer = recv(&mut crd, &mut buf).await;
    }
    let welcomed = answer
        .as_ref()
        .is_some_and(|a| a.status == Status::Ok && !a.end);
    if hello.must_welcome {
        assert!(
            welcomed,
            "an engine holding the secret at generation {} was not welcomed: {answer:?}",
            hello.generation
        );
    }
    if welcomed {
        let send = async {
            let _ = cwr.write_all(requests).await;
            let _ = cwr.shutdown().await;
        };
        let mut rest = Vec::new();
        let (_, _) = tokio::join!(send, crd.read_to_end(&mut rest));
        buf.extend_from_slice(&rest);
    } else {
        drop(cwr);
        let mut rest = Vec::new();
        let _ = crd.read_to_end(&mut rest).await;
        buf.extend_from_slice(&rest);
    }
    if let Err(e) = serve.await {
        panic!("the frames server task failed: {e}");
    }
    buf.to_vec()
}

/// One answer off the connection (the bytes after it stay in `buf`), `None` at its end.
async fn recv<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut BytesMut) -> Option<Response> {
    loop {
        match frames::decode_response(buf) {
            Ok(Decoded::Frame(r)) => return Some(r),
            Ok(Decoded::Need(_)) => {}
            Err(e) => panic!("the server sent a malformed hello answer: {e}"),
        }
        match rd.read_buf(buf).await {
            Ok(0) | Err(_) if buf.is_empty() => return None,
            Ok(0) | Err(_) => panic!("the server's hello answer ends inside a frame"),
            Ok(_) => {}
        }
    }
}

/// Everything the server sent decodes as whole, valid responses.
fn check_answers(out: &[u8]) {
    let mut buf = BytesMut::from(out);
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
    use zebu_proto::frames::{Request, RequestOp};
    use zebu_proto::ids::RequestId;

    use super::*;

    /// The tests share the fixture's replicas: one at a time, so one's writes do not land
    /// between another's write and read.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Write 4 KiB of 7s at 4096, read 8 KiB at 0, flush at u64::MAX (refused), ping.
    fn requests() -> Vec<u8> {
        let reqs = [
            Request {
                id: RequestId(1),
                op: RequestOp::Write {
                    offset: 4096,
                    data: bytes::Bytes::from(vec![7u8; 4096]),
                    sums: None,
                    flush: None,
                },
            },
            Request {
                id: RequestId(2),
                op: RequestOp::Read {
                    offset: 0,
                    length: 8192,
                },
            },
            Request {
                id: RequestId(3),
                op: RequestOp::Flush {
                    flush_number: u64::MAX,
                },
            },
            Request {
                id: RequestId(4),
                op: RequestOp::Ping,
            },
        ];
        let mut v = Vec::new();
        for r in &reqs {
            v.extend_from_slice(&r.header().encode());
            if let RequestOp::Write { data, .. } = &r.op {
                v.extend_from_slice(data);
            }
        }
        v
    }

    fn decoded(out: &[u8]) -> Vec<Response> {
        let mut buf = BytesMut::from(out);
        let mut all = Vec::new();
        while let Ok(Decoded::Frame(r)) = frames::decode_response(&mut buf) {
            all.push(r);
        }
        all
    }

    /// The modes where the harness says hello get past it to the store: a write in one input
    /// is read back by the next (requests of one stream run concurrently, so not in one). The
    /// raw mode to the secured replica is refused before any request runs.
    #[test]
    fn the_engine_modes_reach_the_request_handling_and_the_raw_mode_does_not() {
        let _one = serial();
        for mode in [1u8, 2, 3] {
            let offset = u64::from(mode) << 20;
            let pattern = 0x70 + mode;
            let write = Request {
                id: RequestId(1),
                op: RequestOp::Write {
                    offset,
                    data: bytes::Bytes::from(vec![pattern; 4096]),
                    sums: None,
                    flush: None,
                },
            };
            let mut input = vec![mode, 0];
            input.extend_from_slice(&write.header().encode());
            input.extend_from_slice(&[pattern; 4096]);
            let got = decoded(&answers(&input));
            assert!(
                got.iter()
                    .any(|r| r.id == RequestId(1) && r.status == Status::Ok),
                "mode {mode}: the write is answered OK: {got:?}"
            );
            let read = Request {
                id: RequestId(2),
                op: RequestOp::Read {
                    offset,
                    length: 4096,
                },
            };
            let mut input = vec![mode, 0];
            input.extend_from_slice(&read.header().encode());
            let got = decoded(&answers(&input));
            let read = got
                .iter()
                .find(|r| r.id == RequestId(2))
                .unwrap_or_else(|| panic!("mode {mode}: no answer to the read: {got:?}"));
            assert_eq!(read.status, Status::Ok, "mode {mode}: {read:?}");
            assert!(
                read.data.len() == 4096 && read.data.iter().all(|&b| b == pattern),
                "mode {mode}: the read returns the write"
            );
        }
        let mut raw = vec![0u8];
        let mut hello = Hello::new(frames::VERSION, 1 << 20);
        hello.extensions.0.push(
            VolumeClaim {
                uuid: FUZZ_VOLUME.into(),
                adopt: false,
            }
            .to_extension(),
        );
        raw.extend_from_slice(&hello.encode());
        raw.extend_from_slice(&requests());
        let got = decoded(&answers(&raw));
        assert!(
            got.len() == 1 && got[0].end && got[0].status != Status::Ok,
            "a hello without the proof is refused and nothing else answered: {got:?}"
        );
    }

    /// Valid streams for every mode, their cuts and bit flips, then seeded random inputs:
    /// the stable counterpart of the cargo-fuzz targets.
    #[test]
    fn harnesses_hold_on_valid_damaged_and_random_input() {
        let _one = serial();
        let reqs = requests();
        let mut raw = vec![0u8];
        raw.extend_from_slice(&Hello::new(frames::VERSION, 1).encode());
        raw.extend_from_slice(&reqs);
        let mut valid = vec![raw];
        for mode in 1u8..4 {
            for choice in [0u8, 1, 2, 0x10, 0x18, 0x1c] {
                let mut v = vec![mode, choice];
                v.extend_from_slice(&reqs);
                valid.push(v);
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x18_f022);
        for v in &valid {
            decoders(&v[1..]);
            frames_connection(v);
            for _ in 0..8 {
                let mut v = v.clone();
                let cut = rng.random_range(1..v.len());
                v.truncate(cut);
                if v.len() > 2 {
                    let at = rng.random_range(2..v.len());
                    v[at] ^= 1 << rng.random_range(0..8);
                }
                decoders(&v);
                frames_connection(&v);
            }
        }
        for _ in 0..64 {
            let len = rng.random_range(0..512);
            let mut v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if rng.random_bool(0.5) && v.len() >= 5 {
                v[1..5].copy_from_slice(&frames::MAGIC);
            }
            decoders(&v);
            frames_connection(&v);
        }
    }
}
