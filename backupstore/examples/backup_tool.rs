//! A small command-line front end to the backup store, for tests (kill -9 mid-upload), the
//! benchmark and by-hand inspection. S3 settings come from the AWS variables.
//!
//! ```text
//! backup_tool --target URL backup  --family F --name N [--parent P] IMAGE
//! backup_tool --target URL restore --family F --name N OUT
//! backup_tool --target URL verify  --family F --name N
//! backup_tool --target URL ls [--family F]
//! backup_tool --target URL rm      --family F --name N
//! backup_tool --target URL gc      --family F [--margin-secs S]
//! backup_tool --target URL usage
//! ```
//!
//! `backup` of an image reads it chunk by chunk; with `--parent` it hands over only chunks
//! whose content differs from the parent's (a stand-in for the snapshot chain's changed
//! extents). Prints one JSON line with what it did.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use zebu_backupstore::*;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    target: String,
    /// Index cache folder.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Pack size in MiB.
    #[arg(long, default_value_t = 64)]
    pack_mib: u64,
    /// Upload part size in MiB.
    #[arg(long, default_value_t = 8)]
    part_mib: usize,
    /// Uploads in flight.
    #[arg(long, default_value_t = 6)]
    uploads: usize,
    /// Restore reads in flight.
    #[arg(long, default_value_t = 4)]
    reads: usize,
    /// Largest restore read in MiB.
    #[arg(long, default_value_t = 80)]
    max_read_mib: u64,
    /// Unneeded bytes a restore read may span, in KiB.
    #[arg(long, default_value_t = 1024)]
    max_gap_kib: u64,
    /// Restore reorder buffer in MiB.
    #[arg(long, default_value_t = 64)]
    buffer_mib: u64,
    /// zstd or lz4.
    #[arg(long, default_value = "zstd")]
    codec: String,
    /// Session ttl in seconds (heartbeat a tenth of it).
    #[arg(long, default_value_t = 600)]
    session_ttl_secs: u64,
    /// Sleep this long after each chunk (to make a backup slow enough to kill mid-upload).
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Backup {
        #[arg(long)]
        family: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        parent: Option<String>,
        image: PathBuf,
    },
    Restore {
        #[arg(long)]
        family: String,
        #[arg(long)]
        name: String,
        out: PathBuf,
    },
    Verify {
        #[arg(long)]
        family: String,
        #[arg(long)]
        name: String,
    },
    Ls {
        #[arg(long)]
        family: Option<String>,
    },
    Rm {
        #[arg(long)]
        family: String,
        #[arg(long)]
        name: String,
    },
    Gc {
        #[arg(long)]
        family: String,
        #[arg(long, default_value_t = 3600)]
        margin_secs: u64,
    },
    Usage,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let codec = match a.codec.as_str() {
        "zstd" => Codec::Zstd,
        "lz4" => Codec::Lz4,
        "raw" => Codec::Raw,
        c => bail!("unknown codec {c}"),
    };
    let opts = StoreOptions {
        cache_dir: a.cache_dir.clone(),
        codec,
        packs: PackLimits {
            pack_size: a.pack_mib << 20,
            part_size: a.part_mib << 20,
            uploads: a.uploads,
        },
        sessions: SessionTimes {
            ttl: Duration::from_secs(a.session_ttl_secs),
            heartbeat: Duration::from_millis(a.session_ttl_secs * 100),
        },
        ..Default::default()
    };
    let store = BackupStore::open(&TargetConfig::from_env(&a.target), opts).await?;
    let t0 = Instant::now();
    let ropts = RestoreOptions {
        concurrency: a.reads,
        max_read: a.max_read_mib << 20,
        max_gap: a.max_gap_kib << 10,
        buffer: a.buffer_mib << 20,
    };
    match a.cmd {
        Cmd::Backup {
            family,
            name,
            parent,
            image,
        } => {
            let mut f = std::fs::File::open(&image).with_context(|| image.display().to_string())?;
            let size = f.metadata()?.len();
            let fam = FamilyId::new(&family)?;
            let parent_m = match &parent {
                Some(p) => Some(store.get_backup(&fam, &BackupName::new(p)?).await?),
                None => None,
            };
            let parent_map = match &parent_m {
                Some(m) => Some(chunk_hashes(&store, m).await?),
                None => None,
            };
            let mut w = store
                .begin_backup(BackupSpec {
                    family: fam,
                    name: BackupName::new(&name)?,
                    volume: family.clone(),
                    snapshot: format!("image {}", image.display()),
                    volume_size: size,
                    parent: parent.map(BackupName::new).transpose()?,
                    labels: Default::default(),
                })
                .await?;
            let cs = w.chunk_size();
            let mut read = 0u64;
            let mut off = 0u64;
            while off < size {
                let len = cs.min(size - off) as usize;
                let mut buf = vec![0u8; len];
                f.seek(SeekFrom::Start(off))?;
                f.read_exact(&mut buf)?;
                read += len as u64;
                let changed = match &parent_map {
                    None => true,
                    Some(map) => {
                        let h = if buf.iter().all(|&b| b == 0) {
                            None
                        } else {
                            Some(ChunkHash::of(&buf))
                        };
                        map.get(&(off / cs)).copied().flatten() != h
                    }
                };
                if changed {
                    w.put_chunk(off, Bytes::from(buf)).await?;
                }
                if a.chunk_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(a.chunk_delay_ms)).await;
                }
                off += len as u64;
            }
            let m = w.commit().await?;
            println!(
                "{}",
                serde_json::json!({"op": "backup", "secs": t0.elapsed().as_secs_f64(), "bytes_read": read,
                    "chunks": m.stats.chunks, "given": m.stats.chunks_given, "dedup": m.stats.dedup_chunks,
                    "zero": m.stats.zero_chunks, "new_blobs": m.stats.new_blobs, "stored": m.stats.new_stored_bytes,
                    "packs": m.stats.packs, "peak_rss": peak_rss()})
            );
        }
        Cmd::Restore { family, name, out } => {
            let m = store
                .get_backup(&FamilyId::new(&family)?, &BackupName::new(&name)?)
                .await?;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&out)?;
            f.set_len(m.volume_size)?;
            let mut s = store.restore(&m, ropts).await?;
            while let Some(item) = s.next().await {
                if let RestoreItem::Data { offsets, data } = item? {
                    for o in offsets {
                        f.seek(SeekFrom::Start(o))?;
                        f.write_all(&data)?;
                    }
                }
            }
            f.sync_all()?;
            let st = s.stats();
            println!(
                "{}",
                serde_json::json!({"op": "restore", "secs": t0.elapsed().as_secs_f64(), "chunks": st.chunks,
                    "bytes": st.bytes, "reads": st.reads, "downloaded": st.downloaded, "skipped": st.skipped,
                    "peak_held": st.peak_held, "peak_rss": peak_rss()})
            );
        }
        Cmd::Verify { family, name } => {
            let m = store
                .get_backup(&FamilyId::new(&family)?, &BackupName::new(&name)?)
                .await?;
            let st = store.verify(&m, ropts).await?;
            println!(
                "{}",
                serde_json::json!({"op": "verify", "ok": true, "chunks": st.chunks, "downloaded": st.downloaded})
            );
        }
        Cmd::Ls { family } => {
            let fam = family.map(FamilyId::new).transpose()?;
            for m in store.list_backups(fam.as_ref()).await? {
                println!(
                    "{}/{} parent={:?} size={} chunks={}",
                    m.family, m.name, m.parent, m.volume_size, m.stats.chunks
                );
            }
        }
        Cmd::Rm { family, name } => {
            store
                .delete_backup(&FamilyId::new(&family)?, &BackupName::new(&name)?)
                .await?
        }
        Cmd::Gc {
            family,
            margin_secs,
        } => {
            let out = store
                .gc(
                    &FamilyId::new(&family)?,
                    GcOptions {
                        margin: Duration::from_secs(margin_secs),
                        ..Default::default()
                    },
                )
                .await?;
            println!("{out:?}");
        }
        Cmd::Usage => {
            let u = store.usage().await?;
            println!(
                "{}",
                serde_json::json!({"objects": u.objects, "bytes": u.bytes, "packs": u.packs, "manifests": u.manifests})
            );
        }
    }
    Ok(())
}

/// Slot -> hash of a backup (the tool has no snapshot chain: it compares contents).
async fn chunk_hashes(
    store: &BackupStore,
    m: &Manifest,
) -> anyhow::Result<std::collections::HashMap<u64, Option<ChunkHash>>> {
    Ok(store
        .chunk_map(m)
        .await?
        .into_iter()
        .map(|(s, h)| (s, Some(h)))
        .collect())
}

/// This process's peak resident memory in bytes (`VmHWM`), 0 if unknown.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}
