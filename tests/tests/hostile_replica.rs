//! Hostile and careless input at the replica ports (issue 18): a replica of another volume,
//! counters at the edge of u64, ranges that wrap or pass a layer's end. Each is sent by a
//! test client (or another volume's engine) to the replicas of a running volume; each must
//! be refused, change nothing, and leave the volume serving, also after an engine restart
//! without `--salvage`.
//!
//! Run with `--test-threads=1`: the tests use fixed loopback addresses.

use std::time::Duration;

use bytes::Bytes;
use zebu_engine::blockdev::BlockDevice;
use zebu_proto::ids::RequestId;
use zebu_proto::replica as rpb;
use zebu_proto::replica::data_request::Op;
use zebu_tests::engine::{Cluster, Fingerprint, mode_in};
use zebu_tests::{DataStream, connect};

const MIB: u64 = 1 << 20;

fn fill(byte: u8, len: u64) -> Bytes {
    Bytes::from(vec![byte; len as usize])
}

/// Writes `byte` over `0..len` through the volume's NBD export and flushes.
async fn write_through(c: &Cluster, byte: u8, len: u64) -> anyhow::Result<()> {
    let dev = c.engine().nbd_client().await?;
    dev.write(0, fill(byte, len)).await?;
    dev.flush().await?;
    dev.disconnect().await;
    Ok(())
}

/// Reads `0..len` through the volume's NBD export and checks every byte is `byte`.
async fn expect_through(c: &Cluster, byte: u8, len: u64, what: &str) -> anyhow::Result<()> {
    let dev = c.engine().nbd_client().await?;
    let got = dev.read(0, len).await?;
    dev.disconnect().await;
    anyhow::ensure!(
        got.iter().all(|&b| b == byte),
        "{what}: the volume does not read back its own data (first byte {:#04x}, want {byte:#04x})",
        got.first().copied().unwrap_or(0)
    );
    Ok(())
}

async fn info(addr: std::net::SocketAddr) -> anyhow::Result<rpb::InfoResponse> {
    Ok(connect(addr)
        .await?
        .info(rpb::InfoRequest {})
        .await?
        .into_inner())
}

/// Finding 1: `replica add` of another volume's replica. Before, it succeeded, fenced the
/// other volume's engine and served that volume's bytes. Now the adding engine refuses in
/// one line naming both uuids, and the other volume's replica is exactly as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_of_another_volume_is_refused_and_left_untouched() -> anyhow::Result<()> {
    let a = Cluster::start("vol-a", 64 * MIB)?;
    let b = Cluster::start("vol-b", 64 * MIB)?;
    write_through(&a, 0xaa, MIB).await?;
    write_through(&b, 0xbb, MIB).await?;

    let victim = a.replica(0).addr;
    let before = info(victim).await?;
    assert!(
        !before.volume_uuid.is_empty(),
        "a served replica records its volume"
    );
    let print_before = Fingerprint::of(victim).await?;
    let b_uuid = info(b.replica(0).addr).await?.volume_uuid;
    assert_ne!(before.volume_uuid, b_uuid, "two volumes, two uuids");

    // `replica add` waits for the rebuild to take or fail.
    let added = b
        .engine()
        .cli(&["replica", "add", "--wait", &victim.to_string()])
        .await;
    let err = match added {
        Ok(v) => panic!(
            "vol-b took vol-a's replica: {v}\n{}\n{}",
            a.logs(),
            b.logs()
        ),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains(&before.volume_uuid) && err.contains(&b_uuid),
        "the refusal names both uuids: {err}"
    );

    let after = info(victim).await?;
    assert_eq!(
        after.generation, before.generation,
        "vol-a's replica was fenced"
    );
    assert_eq!(after.epoch, before.epoch);
    assert_eq!(after.volume_uuid, before.volume_uuid);
    let d = print_before.diff(&Fingerprint::of(victim).await?);
    assert!(d.is_empty(), "vol-a's replica changed: {d:#?}");
    let ia = a.engine().info().await?;
    assert_eq!(ia.state, "healthy", "{ia:?}");
    assert_eq!(mode_in(&ia, &victim.to_string()), "RW", "{ia:?}");
    let ib = b.engine().info().await?;
    assert_eq!(ib.state, "healthy", "{ib:?}");
    assert!(
        !ib.replicas.iter().any(|r| r.address == victim.to_string()),
        "vol-b lists vol-a's replica: {ib:?}"
    );
    expect_through(&a, 0xaa, MIB, "vol-a").await?;
    expect_through(&b, 0xbb, MIB, "vol-b").await?;

    // A hello naming vol-b at vol-a's replica, and one naming no volume: refused, nothing
    // fenced (a generation far above the current one would fence vol-a's engine).
    let mut c = connect(victim).await?;
    let g = before.generation + 1;
    let wrong = DataStream::open_for(&mut c, g, &b_uuid).await;
    let status = wrong.err().expect("a hello for another volume is refused");
    assert!(status.message().contains(&before.volume_uuid), "{status:?}");
    assert!(
        DataStream::open_for(&mut c, g, "").await.is_err(),
        "a hello naming no volume"
    );
    assert_eq!(info(victim).await?.generation, before.generation);
    expect_through(&a, 0xaa, MIB, "vol-a after the hellos").await?;
    Ok(())
}

/// The CLI's answer must be a failure with a one-line error; returns the line.
fn one_line_failure(out: &std::process::Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(
        !out.status.success(),
        "{what}: exit 0: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(err.lines().count(), 1, "{what}: {err:?}");
    assert!(err.starts_with("zebu-engine: error: "), "{what}: {err:?}");
    err
}

/// Finding 8, the engine's part: `replica add` of an address where nothing listens, or of
/// the engine's own control or NBD port, answered rc 0 (the failure showed only in
/// rebuild-status), and the same `--replica` given twice was accepted (the volume then read
/// degraded). Now `replica add` asks the replica before anything changes, so each of these
/// exits non-zero with the reason and the volume keeps its three RW members; and an engine
/// given one replica twice refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_add_of_nothing_or_the_engines_own_ports_fails_and_a_repeated_replica_is_refused()
-> anyhow::Result<()> {
    let c = Cluster::start("vol-add", 64 * MIB)?;
    write_through(&c, 0x2e, MIB).await?;
    let before = c.engine().info().await?;
    let nobody = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.to_string()
    };
    let own_control = c.engine().control.to_string();
    let own_nbd = c.engine().nbd.clone();
    for (what, addr) in [
        ("nothing listens", nobody.as_str()),
        ("the engine's control port", own_control.as_str()),
        ("the engine's NBD port", own_nbd.as_str()),
    ] {
        let out = c.engine().cli_raw(&["replica", "add", addr]).await?;
        let err = one_line_failure(&out, what);
        assert!(
            err.contains(addr),
            "{what}: the error names the address: {err}"
        );
        let i = c.engine().info().await?;
        assert_eq!(i.state, "healthy", "{what}: {i:?}");
        assert_eq!(i.members, before.members, "{what}: {i:?}");
        assert!(
            !i.replicas.iter().any(|r| r.address == addr),
            "{what}: listed as a replica: {i:?}"
        );
        let st = c.engine().rebuild_status().await?;
        assert_ne!(st.state, "running", "{what}: {st:?}");
    }
    expect_through(&c, 0x2e, MIB, "after the refused adds").await?;

    // One replica twice on the command line: refused before anything is contacted.
    let r0 = c.addr(0);
    let out = tokio::process::Command::new(zebu_tests::bin_path("zebu-engine"))
        .args(["serve", "--volume", "vol-twice", "--size", "64M"])
        .args([
            "--control",
            "127.0.0.1:0",
            "--replica",
            &r0,
            "--replica",
            &r0,
        ])
        .output()
        .await?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an engine started on one replica twice"
    );
    assert!(err.contains("given twice") && err.contains(&r0), "{err}");
    assert_eq!(
        info(c.replica(0).addr).await?.generation,
        c.engine().info().await?.generation,
        "the refused engine fenced the volume's replica"
    );
    expect_through(&c, 0x2e, MIB, "after the refused engine").await?;
    Ok(())
}

/// The first message of a `ReadLayer` stream, or how it failed, within 10 s.
async fn first_chunk(
    c: &mut rpb::replica_client::ReplicaClient<tonic::transport::Channel>,
    extents: Vec<rpb::Extent>,
) -> Result<Option<rpb::LayerChunk>, tonic::Status> {
    let call = async {
        let mut s = c
            .read_layer(rpb::ReadLayerRequest {
                layer: String::new(),
                extents,
            })
            .await?
            .into_inner();
        s.message().await
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer in 10 s")))
}

/// Findings 2 and 6: a flush number, a generation and an epoch at 2^64-1, and ranges that
/// wrap 64 bits or pass the layer's end. Before, each of the first three made the volume
/// unservable for good (through restarts and `--salvage`), a ReadLayer streamed zeros
/// without end, and ranges past the end answered zeros. Now each is refused, and the volume
/// serves, restarts without `--salvage` and reads back what it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counters_and_ranges_at_the_edge_are_refused_and_the_volume_restarts() -> anyhow::Result<()>
{
    let mut c = Cluster::start("vol-edge", 64 * MIB)?;
    write_through(&c, 0x5a, MIB).await?;
    let addrs: Vec<_> = (0..3).map(|i| c.replica(i).addr).collect();
    let before = info(addrs[0]).await?;

    // A flush at u64::MAX, in a stream of the engine's own generation and volume.
    let mut r0 = connect(addrs[0]).await?;
    let mut s = DataStream::open_for(&mut r0, before.generation, &before.volume_uuid)
        .await
        .map_err(|s| anyhow::anyhow!("hello refused: {s:?}"))?;
    let flush = s
        .call(Op::Flush(rpb::FlushOp {
            flush_number: u64::MAX,
        }))
        .await?;
    assert_ne!(
        flush.status,
        rpb::Status::Ok as i32,
        "flush u64::MAX accepted: {flush:?}"
    );
    assert!(flush.message.contains("implausibly far"), "{flush:?}");
    drop(s);

    // A hello at generation u64::MAX.
    let mut r1 = connect(addrs[1]).await?;
    let uuid = info(addrs[1]).await?.volume_uuid;
    let hello = DataStream::open_for(&mut r1, u64::MAX, &uuid).await;
    let status = hello
        .err()
        .expect("a hello at generation u64::MAX is refused");
    assert!(status.message().contains("implausibly far"), "{status:?}");
    assert_eq!(info(addrs[1]).await?.generation, before.generation);

    // SetEpoch at u64::MAX with bogus members, and a plausible epoch without this replica.
    let mut r2 = connect(addrs[2]).await?;
    let e = r2
        .set_epoch(rpb::SetEpochRequest {
            epoch: u64::MAX,
            members: vec!["bogus".into()],
        })
        .await;
    assert!(e.is_err(), "SetEpoch(u64::MAX) accepted");
    let e = r2
        .set_epoch(rpb::SetEpochRequest {
            epoch: before.epoch + 1,
            members: vec!["bogus".into()],
        })
        .await;
    assert!(e.is_err(), "SetEpoch naming other members accepted");
    assert_eq!(info(addrs[2]).await?.epoch, before.epoch);

    // Ranges: a ReadLayer of 2^64-4096 bytes, one past the head's end, Checksums at the
    // top of the u64 range.
    let huge = first_chunk(
        &mut r0,
        vec![rpb::Extent {
            offset: 0,
            length: u64::MAX - 4095,
        }],
    )
    .await;
    assert_eq!(
        huge.as_ref().err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument),
        "ReadLayer of 2^64-4096 bytes: {:?}",
        huge.map(|c| c.map(|c| (c.offset, c.data.len())))
    );
    let past = first_chunk(
        &mut r0,
        vec![rpb::Extent {
            offset: 64 * MIB,
            length: 4096,
        }],
    )
    .await;
    assert_eq!(
        past.as_ref().err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument),
        "ReadLayer past the end: {:?}",
        past.map(|c| c.map(|c| (c.offset, c.data.len())))
    );
    let sums = r0
        .checksums(rpb::ChecksumsRequest {
            offset: u64::MAX - 4095,
            length: 4096,
            block_size: 4096,
        })
        .await;
    assert_eq!(
        sums.as_ref().err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument),
        "Checksums at 2^64-4096: {sums:?}"
    );

    // The volume serves, and restarts without --salvage with its data.
    let i = c.engine().info().await?;
    assert_eq!(i.state, "healthy", "{i:?}\n{}", c.logs());
    write_through(&c, 0x6b, MIB / 2).await?;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    c.start_engine()?;
    let i = c.engine().info().await?;
    assert_eq!(i.state, "healthy", "after a restart: {i:?}\n{}", c.logs());
    let dev = c.engine().nbd_client().await?;
    let got = dev.read(0, MIB).await?;
    assert!(got[..(MIB / 2) as usize].iter().all(|&b| b == 0x6b));
    assert!(got[(MIB / 2) as usize..].iter().all(|&b| b == 0x5a));
    dev.write(MIB, fill(0x7c, 4096)).await?;
    dev.flush().await?;
    dev.disconnect().await;
    Ok(())
}

/// Finding 6's last case: a WriteLayer chunk at offset 2^64-4096 passed the bounds check
/// (`offset + len` wrapped) and failed as INTERNAL. It must be refused as out of range
/// (InvalidArgument, naming the range), write nothing, and leave the replica serving; the
/// same chunk inside the layer is accepted, so the refusal is the range's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_write_that_would_wrap_64_bits_is_out_of_range_and_changes_nothing()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let size = 4 * MIB;
    let r =
        zebu_tests::ReplicaProcess::start(&tmp.path().join("r"), size, zebu_tests::loopback(21))?;
    let mut c = r.client().await?;
    let header = rpb::WriteLayerRequest {
        layer: "edge".into(),
        size,
        ..Default::default()
    };
    let chunk = |offset: u64| rpb::WriteLayerRequest {
        chunk: Some(rpb::LayerChunk {
            offset,
            data: fill(0x99, 4096),
            ..Default::default()
        }),
        ..Default::default()
    };
    for offset in [u64::MAX - 4095, size] {
        let e = c
            .write_layer(tokio_stream::iter(vec![header.clone(), chunk(offset)]))
            .await
            .err()
            .unwrap_or_else(|| {
                panic!("a layer chunk at {offset} of a {size}-byte layer was written")
            });
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{offset}: {e:?}");
        assert!(e.message().contains(&offset.to_string()), "{offset}: {e:?}");
    }
    // Nothing reads back from the refused chunks, and a chunk inside the layer is written.
    let mut d = DataStream::open(&mut c, 1)
        .await
        .map_err(|s| anyhow::anyhow!("hello refused: {s:?}"))?;
    let head = d.read(0, size).await?;
    assert!(head.iter().all(|&b| b == 0), "the head changed");
    drop(d);
    let ok = c
        .write_layer(tokio_stream::iter(vec![header.clone(), chunk(size - 4096)]))
        .await
        .map_err(|s| anyhow::anyhow!("a chunk inside the layer was refused: {s:?}"))?
        .into_inner();
    assert_eq!(ok.bytes_written, 4096);
    let info = c.info(rpb::InfoRequest {}).await?.into_inner();
    assert!(info.open, "{info:?}");
    Ok(())
}

/// Runs `zebu-replica serve` on a damaged directory: it must exit non-zero within 5 s
/// (not wait on a lock of its own); returns its stderr.
fn serve_damaged(dir: &std::path::Path, size: u64) -> anyhow::Result<String> {
    let err = dir.with_extension("err");
    let mut child = std::process::Command::new(zebu_tests::bin_path("zebu-replica"))
        .arg("serve")
        .arg("--dir")
        .arg(dir)
        .args(["--listen", "127.0.0.21:0", "--size", &size.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err)?)
        .spawn()?;
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if start.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "zebu-replica still running after 5 s on a damaged directory: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&err)?;
    anyhow::ensure!(!status.success(), "served a damaged directory: {text}");
    Ok(text)
}

/// Finding 8's replica part: a `replica.json` listing one layer id twice made the replica
/// wait 10 s on its own lock and report that another process served the directory; an
/// empty `regions.dat` gave "failed to fill whole buffer". Each is now refused at once,
/// naming the file and what is wrong with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn damaged_replica_records_are_named_not_mistaken_for_a_busy_directory() -> anyhow::Result<()>
{
    let tmp = tempfile::tempdir()?;
    let size = 4 * MIB;
    let fresh = |name: &str| -> anyhow::Result<std::path::PathBuf> {
        let dir = tmp.path().join(name);
        let r = zebu_tests::ReplicaProcess::start(&dir, size, zebu_tests::loopback(21))?;
        drop(r);
        Ok(dir)
    };

    let dir = fresh("dup")?;
    let meta_path = dir.join("replica.json");
    let mut meta: serde_json::Value = serde_json::from_slice(&std::fs::read(&meta_path)?)?;
    let layers = meta["layers"]
        .as_array_mut()
        .ok_or_else(|| anyhow::anyhow!("replica.json has no layers"))?;
    let mut twin = layers[0].clone();
    twin["name"] = serde_json::Value::String("twin".into());
    layers.push(twin);
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta)?)?;
    let err = serve_damaged(&dir, size)?;
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("replica.json") && last.contains("twice"),
        "the error names the file and the repeated id: {err}"
    );
    assert!(!err.contains("another process"), "{err}");

    let dir = fresh("regions")?;
    std::fs::File::create(dir.join("regions.dat"))?;
    let err = serve_damaged(&dir, size)?;
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("regions.dat"),
        "the error names the file: {err}"
    );
    assert!(!last.contains("fill whole buffer"), "a raw message: {err}");
    Ok(())
}

/// The head layer file of the replica in `dir`, as its `replica.json` names it.
fn head_file(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("replica.json"))?)?;
    let head = meta["head"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("replica.json without a head: {meta}"))?;
    Ok(dir.join(format!("layer-{head:06}.img")))
}

/// Finding 7: a layer file unlinked, and another truncated, under running replicas. Before,
/// writes and flushes kept answering OK (the data was gone after a restart) and truncated
/// blocks read as zeros with status OK. Now each replica notices (at the next flush, or on
/// its timer while idle), fails its requests, goes ERR at the engine, and the volume serves
/// its data from the replica left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_notice_their_layer_files_going_away() -> anyhow::Result<()> {
    let c = Cluster::start("vol-lost", 64 * MIB)?;
    write_through(&c, 0x3c, 4 * MIB).await?;
    let (a0, a1, a2) = (c.addr(0), c.addr(1), c.addr(2));

    // Unlinked, then a write and a flush through the volume: the flush must not be an OK
    // over a file that is gone.
    std::fs::remove_file(head_file(&c.dirs[0])?)?;
    let dev = c.engine().nbd_client().await?;
    dev.write(0, fill(0x4d, MIB)).await?;
    dev.flush().await?;
    c.engine()
        .wait_until(Duration::from_secs(10), |i| mode_in(i, &a0) == "ERR")
        .await
        .map_err(|e| anyhow::anyhow!("unlinked head not noticed: {e}\n{}", c.logs()))?;

    // Truncated while idle: the timer notices without any I/O.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(head_file(&c.dirs[1])?)?;
    f.set_len(4096)?;
    drop(f);
    c.engine()
        .wait_until(Duration::from_secs(15), |i| mode_in(i, &a1) == "ERR")
        .await
        .map_err(|e| anyhow::anyhow!("truncated head not noticed: {e}\n{}", c.logs()))?;
    let i = c.engine().info().await?;
    assert_eq!(mode_in(&i, &a2), "RW", "{i:?}");
    let reason = |a: &str| {
        i.replicas
            .iter()
            .find(|r| r.address == a)
            .map(|r| r.reason.clone())
            .unwrap_or_default()
    };
    eprintln!("reasons: {} / {}", reason(&a0), reason(&a1));

    // Each lost replica answers errors itself, also to a direct client.
    let r = info(c.replica(1).addr).await?;
    let mut s = DataStream::open_for(
        &mut connect(c.replica(1).addr).await?,
        r.generation,
        &r.volume_uuid,
    )
    .await;
    if let Ok(s) = &mut s {
        let got = s
            .call(Op::Read(rpb::ReadOp {
                offset: 0,
                length: 4096 * 4,
            }))
            .await?;
        assert_ne!(
            got.status,
            rpb::Status::Ok as i32,
            "a truncated replica read OK: {got:?}"
        );
    }

    let got = dev.read(0, 4 * MIB).await?;
    assert!(
        got[..MIB as usize].iter().all(|&b| b == 0x4d),
        "the write after the unlink"
    );
    assert!(
        got[MIB as usize..].iter().all(|&b| b == 0x3c),
        "the data from before"
    );
    dev.disconnect().await;
    Ok(())
}

fn vm_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/{pid}/status"))
}

/// Finding 5, the replica side: eight frames connections, each holding a 16 MiB write whose
/// data is sent all but its last 4 KiB. Before, each allocated its 16 MiB at the header
/// (7 → 139 MB); now the payload buffers are taken from one budget for the port
/// (`PORT_BYTES_RECEIVING`, 32 MiB), before they exist, and the replica's memory stays
/// bounded however many such connections there are. A normal client is served meanwhile
/// once they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partly_sent_writes_on_many_connections_take_one_bounded_budget() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use zebu_proto::frames::{self, Hello, Request, RequestOp};

    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("r");
    let r = zebu_tests::ReplicaProcess::start(&dir, 64 * MIB, zebu_tests::loopback(11))?;
    let pid = r.pid().as_raw().cast_unsigned();
    let before = vm_rss_kib(pid)?;
    let len = 16 * MIB;
    let mut conns = Vec::new();
    for i in 0..8u64 {
        let mut s = tokio::net::TcpStream::connect(r.addr).await?;
        s.write_all(&Hello::new(frames::VERSION, 1).encode())
            .await?;
        let mut answer = [0u8; frames::RESPONSE_HEADER_LEN];
        s.read_exact(&mut answer).await?;
        assert_eq!(answer[0], 0, "hello {i} refused");
        let header = Request {
            id: RequestId(i + 1),
            op: RequestOp::Write {
                offset: 0,
                data: Bytes::from(vec![0u8; len as usize]),
                sums: None,
                flush: None,
            },
        }
        .header()
        .encode();
        // Sent from a task: once the replica stops reading, the socket fills and the
        // sender waits, as a slow or hostile client's would.
        conns.push(tokio::spawn(async move {
            let _ = s.write_all(&header).await;
            let body = vec![0x5au8; (len - 4096) as usize];
            let _ = s.write_all(&body).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(s);
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during = vm_rss_kib(pid)?;
    let grown_mib = during.saturating_sub(before) / 1024;
    eprintln!("VmRSS {before} kB -> {during} kB (+{grown_mib} MiB) with 8 partial 16 MiB writes");
    assert!(
        grown_mib < 64,
        "8 partly sent 16 MiB writes grew the replica by {grown_mib} MiB"
    );
    for c in conns {
        c.abort();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut c = connect(r.addr).await?;
    let mut s = DataStream::open(&mut c, 2)
        .await
        .map_err(|s| anyhow::anyhow!("{s:?}"))?;
    s.write(0, fill(7, 4096)).await?;
    assert_eq!(&s.read(0, 4096).await?[..], &fill(7, 4096)[..]);
    Ok(())
}

/// The upgrade path of finding 1: replicas made before volume identity (their replica.json
/// has no `volume_uuid`) are current members at the next engine start, so they adopt the
/// uuid that engine makes, all the same one, and the volume serves its data. A former member
/// without identity that is not current then is refused for catch-up (store tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_made_before_identity_adopt_the_uuid_at_the_next_start() -> anyhow::Result<()> {
    let mut c = Cluster::start("vol-upgrade", 64 * MIB)?;
    write_through(&c, 0x19, MIB).await?;
    c.engine_mut().terminate(Duration::from_secs(30))?;
    for i in 0..3 {
        c.kill_replica(i);
        let path = c.dirs[i].join("replica.json");
        let mut meta: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        let had = meta
            .as_object_mut()
            .and_then(|m| m.remove("volume_uuid"))
            .is_some();
        assert!(had, "this build records the uuid");
        std::fs::write(&path, serde_json::to_vec_pretty(&meta)?)?;
        c.restart_replica(i)?;
        assert_eq!(
            info(c.replica(i).addr).await?.volume_uuid,
            "",
            "a pre-identity replica"
        );
    }
    c.start_engine()?;
    let mut uuids = std::collections::BTreeSet::new();
    for i in 0..3 {
        uuids.insert(info(c.replica(i).addr).await?.volume_uuid);
    }
    assert_eq!(uuids.len(), 1, "one uuid for all: {uuids:?}");
    assert!(!uuids.iter().any(String::is_empty), "{uuids:?}");
    expect_through(&c, 0x19, MIB, "after the upgrade").await?;
    Ok(())
}
