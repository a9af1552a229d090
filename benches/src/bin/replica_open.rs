//! Memory and open time of a large, fragmented replica.
//!
//! Method: build (once, cached in `--dir`) a 1 TiB replica whose 1 GiB of data is scattered
//! as 262,144 separate 4 KiB writes at random block offsets, spread over 10 snapshots and the
//! head. Then, in a fresh child process per round (so the build's memory does not count),
//! open it and report the open time and the peak RSS (VmHWM) of that process, and the
//! number of extents in the in-memory index. The reference is the same child process
//! opening nothing (the baseline RSS of the runtime), measured in the same run.
//!
//! `cargo run --release -p zebu-benches --bin replica_open -- --dir /var/tmp/zebu-open-bench`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use zebu_replica::Replica;
use zebu_replica::io::{BackendKind, IoEngine};

#[derive(Parser)]
struct Args {
    /// Where the test replica is built (kept between runs; delete it to rebuild).
    #[arg(long, default_value = "/var/tmp/zebu-open-bench")]
    dir: PathBuf,
    /// Volume size in GiB.
    #[arg(long, default_value_t = 1024)]
    size_gib: u64,
    /// Data written, in MiB, as separate 4 KiB blocks.
    #[arg(long, default_value_t = 1024)]
    data_mib: u64,
    #[arg(long, default_value_t = 10)]
    snapshots: u64,
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Internal: open the replica (or nothing, with "-") and print one JSON line.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

async fn child(dir: String) -> anyhow::Result<()> {
    let io = IoEngine::new(BackendKind::Auto)?;
    if dir == "-" {
        println!(
            "{}",
            serde_json::json!({"open_ms": 0.0, "rss_kib": vm_hwm_kib(), "extents": 0})
        );
        return Ok(());
    }
    let t = Instant::now();
    let r = Replica::open(std::path::Path::new(&dir), io).await?;
    let open_ms = t.elapsed().as_secs_f64() * 1000.0;
    // Touch the index the way I/O does.
    r.read(0, 4096).await?;
    println!(
        "{}",
        serde_json::json!({"open_ms": open_ms, "rss_kib": vm_hwm_kib(), "extents": r.index_extents(),
                           "layers": r.info().layers.len()})
    );
    Ok(())
}

async fn build(args: &Args) -> anyhow::Result<()> {
    let done = args.dir.join("built");
    if done.exists() {
        return Ok(());
    }
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)?;
    }
    let size = args.size_gib << 30;
    let io = IoEngine::new(BackendKind::Auto)?;
    let r = Replica::create(&args.dir, size, io).await?;
    let blocks = args.data_mib << 8;
    let per_layer = blocks / (args.snapshots + 1);
    let t = Instant::now();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for layer in 0..=args.snapshots {
        let mut offsets = Vec::with_capacity(per_layer as usize);
        for _ in 0..per_layer {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            offsets.push(seed % (size / 4096) * 4096);
        }
        let block = Bytes::from(vec![0xA5u8; 4096]);
        futures::future::try_join_all(offsets.chunks(per_layer.div_ceil(32) as usize).map(
            |chunk| {
                let r = r.clone();
                let block = block.clone();
                async move {
                    for &o in chunk {
                        r.write(o, block.clone()).await?;
                    }
                    Ok::<_, zebu_replica::ReplicaError>(())
                }
            },
        ))
        .await?;
        if layer < args.snapshots {
            r.snapshot_create(&format!("snap-{layer}"), true, BTreeMap::new())
                .await?;
        }
        eprintln!(
            "layer {layer}: {per_layer} blocks written ({:.0} s)",
            t.elapsed().as_secs_f64()
        );
    }
    r.flush(0).await?;
    r.close().await?;
    std::fs::write(done, b"")?;
    Ok(())
}

fn run_child(arg: &str) -> anyhow::Result<serde_json::Value> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["--child", arg])
        .output()
        .context("start child")?;
    if !out.status.success() {
        bail!("child failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Runtime::new()?;
    if let Some(dir) = args.child.clone() {
        return rt.block_on(child(dir));
    }
    rt.block_on(build(&args))?;
    let base = run_child("-")?;
    println!(
        "baseline (runtime, no replica): RSS {} KiB",
        base["rss_kib"]
    );
    println!(
        "{:>6} {:>10} {:>10} {:>9} {:>8}",
        "round", "open ms", "RSS MiB", "extents", "layers"
    );
    for i in 0..args.rounds {
        let v = run_child(&args.dir.to_string_lossy())?;
        println!(
            "{:>6} {:>10.0} {:>10.1} {:>9} {:>8}",
            i,
            v["open_ms"].as_f64().unwrap_or(0.0),
            v["rss_kib"].as_f64().unwrap_or(0.0) / 1024.0,
            v["extents"],
            v["layers"]
        );
    }
    Ok(())
}
