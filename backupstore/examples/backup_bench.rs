//! Benchmark: Zebu's backup store against restic, backing up and restoring the same image to
//! the same target in the same run. See `backupstore/BENCH.md` for the method and figures.
//!
//! ```text
//! cargo build --release -p zebu-backupstore --examples
//! ./target/release/examples/backup_bench --size-mib 1024 --target moto --json bench.json
//! ```
//!
//! Rows: full backup, an unchanged re-backup, an incremental backup after rewriting 10 % of
//! the image, and a restore of the incremental backup; for Zebu with zstd and with lz4, and
//! for restic. Each row: wall time, peak RSS of the process (ru_maxrss), and for backups the
//! bytes and objects the target holds afterwards. Both tools read the whole image (restic
//! has no changed-block list; the tool compares chunks with the parent's hashes), so the
//! incremental rows compare like with like.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use futures::StreamExt;
use object_store::ObjectStore;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// `moto` (an S3 server on 127.0.0.1 started here) or `file`.
    #[arg(long, default_value = "moto")]
    target: String,
    /// mixed (1/2 random, 1/4 text, 1/4 zeros, in 4 MiB stripes) or random.
    #[arg(long, default_value = "mixed")]
    content: String,
    #[arg(long, default_value = "/var/tmp/zebu-backup-bench")]
    dir: PathBuf,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Zebu's largest restore read, MiB.
    #[arg(long, default_value_t = 16)]
    max_read_mib: u64,
    /// Zebu's restore reads in flight.
    #[arg(long, default_value_t = 4)]
    reads: usize,
    /// Skip restic (Zebu rows only).
    #[arg(long)]
    no_restic: bool,
}

/// Where each tool writes: a URL maker for Zebu, restic's repository, the environment,
/// and a store to count objects with.
type Targets = (
    Box<dyn Fn(&str) -> String>,
    String,
    Vec<(String, String)>,
    Box<dyn ObjectStore>,
);

/// Kills the moto server however the bench ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Run {
    secs: f64,
    max_rss_kib: i64,
    stdout: String,
}

/// Runs a command to completion and measures its wall time and peak RSS.
fn run(cmd: &mut Command) -> anyhow::Result<Run> {
    use std::io::Read;
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{cmd:?}"))?;
    let pid = child.id() as i32;
    let drain = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = p {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    // Peak RSS from /proc (VmHWM starts afresh at exec; ru_maxrss of a child also counts
    // what it shared with this process before exec).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hwm = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut best = 0i64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    && let Some(v) = s.lines().find_map(|l| l.strip_prefix("VmHWM:"))
                {
                    best = best.max(v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0));
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            best
        })
    };
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for the child spawned above, which nothing else waits for.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let secs = t.elapsed().as_secs_f64();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = hwm.join().unwrap_or(0);
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if r < 0 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("{cmd:?} failed ({status}): {stderr}");
    }
    Ok(Run {
        secs,
        max_rss_kib: peak.max(1),
        stdout,
    })
}

fn make_image(path: &Path, size: u64, content: &str) -> anyhow::Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == size) {
        return Ok(());
    }
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let stripe = 4usize << 20;
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let words: [&[u8]; 8] = [
        b"replica ",
        b"engine ",
        b"volume ",
        b"snapshot ",
        b"backup ",
        b"chunk ",
        b"zebu ",
        b"block ",
    ];
    let mut buf = vec![0u8; stripe];
    for i in 0..(size as usize).div_ceil(stripe) {
        let kind = if content == "random" {
            0
        } else {
            [0, 0, 1, 2][i % 4]
        };
        match kind {
            0 => {
                for w in buf.chunks_exact_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    w.copy_from_slice(&x.to_le_bytes());
                }
            }
            1 => {
                let mut at = 0;
                while at < stripe {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let w = words[(x % 8) as usize];
                    let n = w.len().min(stripe - at);
                    buf[at..at + n].copy_from_slice(&w[..n]);
                    at += n;
                }
            }
            _ => buf.fill(0),
        }
        let n = stripe.min(size as usize - i * stripe);
        f.write_all(&buf[..n])?;
    }
    f.flush()?;
    Ok(())
}

/// Rewrites 10 % of the image (every tenth 4 MiB stripe) with new random bytes.
fn modify_image(src: &Path, dst: &Path) -> anyhow::Result<()> {
    let mut img = std::fs::read(src)?;
    let stripe = 4usize << 20;
    let mut x: u64 = 0xdead_beef_1234_5677;
    for (i, s) in img.chunks_mut(stripe).enumerate() {
        if i % 10 == 5 {
            for w in s.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
        }
    }
    std::fs::write(dst, img)?;
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> anyhow::Result<bool> {
    Ok(Command::new("cmp")
        .arg("-s")
        .arg(a)
        .arg(b)
        .status()?
        .success())
}

async fn count_objects(store: &dyn ObjectStore, prefix: &str) -> anyhow::Result<(u64, u64)> {
    let p = object_store::path::Path::from(prefix);
    let mut s = store.list(Some(&p));
    let (mut n, mut bytes) = (0, 0);
    while let Some(m) = s.next().await {
        let m = m?;
        if m.location.as_ref().contains(".probe") {
            continue;
        }
        n += 1;
        bytes += m.size;
    }
    Ok((n, bytes))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.dir)?;
    let size = a.size_mib << 20;
    let image = a
        .dir
        .join(format!("image-{}-{}.img", a.content, a.size_mib));
    let image2 = a
        .dir
        .join(format!("image-{}-{}-v2.img", a.content, a.size_mib));
    make_image(&image, size, &a.content)?;
    modify_image(&image, &image2)?;
    let tool = std::env::current_exe()?
        .parent()
        .context("exe dir")?
        .join("backup_tool");
    let run_dir = a.dir.join("run");
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;

    // Targets.
    let mut moto_child = None;
    let (zebu_url, restic_repo, env, lister): Targets = if a.target == "moto" {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/moto-venv.sh");
        let prog = String::from_utf8(Command::new("bash").arg(script).output()?.stdout)?
            .trim()
            .to_string();
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(prog)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        moto_child = Some(KillOnDrop(child));
        let ep = format!("http://127.0.0.1:{port}");
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t.elapsed().as_secs() > 60 {
                bail!("moto did not start");
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("bench")
            .with_region("us-east-1")
            .with_access_key_id("testing")
            .with_secret_access_key("testing")
            .with_endpoint(&ep)
            .with_allow_http(true)
            .build()?;
        // Create the bucket with an unsigned PUT (moto accepts it).
        std::process::Command::new("curl")
            .args(["-s", "-X", "PUT", &format!("{ep}/bench")])
            .status()?;
        let env = vec![
            ("AWS_ACCESS_KEY_ID".into(), "testing".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "testing".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_DEFAULT_REGION".into(), "us-east-1".into()),
            ("AWS_ENDPOINT_URL".into(), ep.clone()),
        ];
        (
            Box::new(|p: &str| format!("s3://bench@us-east-1/{p}")),
            format!("s3:{ep}/bench/restic"),
            env,
            Box::new(s3),
        )
    } else {
        let root = run_dir.join("target");
        std::fs::create_dir_all(&root)?;
        let r2 = root.clone();
        (
            Box::new(move |p: &str| format!("file://{}/{p}", r2.display())),
            format!("{}/restic", root.display()),
            Vec::new(),
            Box::new(object_store::local::LocalFileSystem::new_with_prefix(
                &root,
            )?),
        )
    };

    let mut rows = Vec::new();
    let mut row = |tool: &str, op: &str, r: &Run, objects: Option<(u64, u64)>| {
        let (o, b) = objects.unwrap_or((0, 0));
        println!(
            "{tool:<12} {op:<12} {:>8.2} s {:>8.1} MiB/s  rss {:>6} MiB  objects {:>5}  stored {:>8.1} MiB",
            r.secs,
            size as f64 / (1 << 20) as f64 / r.secs,
            r.max_rss_kib / 1024,
            o,
            b as f64 / (1 << 20) as f64
        );
        rows.push(
            serde_json::json!({"tool": tool, "op": op, "secs": r.secs, "max_rss_kib": r.max_rss_kib,
            "objects": o, "stored_bytes": b, "out": r.stdout.trim()}),
        );
    };

    for codec in ["zstd", "lz4"] {
        let name = format!("zebu-{codec}");
        let url = zebu_url(&name);
        let cache = run_dir.join(format!("cache-{codec}"));
        let base = |c: &mut Command| {
            c.args(["--target", &url, "--codec", codec, "--cache-dir"])
                .arg(&cache);
            for (k, v) in &env {
                c.env(k, v);
            }
        };
        let mut c = Command::new(&tool);
        base(&mut c);
        let r = run(c
            .args(["backup", "--family", "bench", "--name", "full"])
            .arg(&image))?;
        row(
            &name,
            "full",
            &r,
            Some(count_objects(lister.as_ref(), &name).await?),
        );
        let mut c = Command::new(&tool);
        base(&mut c);
        let r = run(c
            .args([
                "backup", "--family", "bench", "--name", "again", "--parent", "full",
            ])
            .arg(&image))?;
        row(
            &name,
            "unchanged",
            &r,
            Some(count_objects(lister.as_ref(), &name).await?),
        );
        let mut c = Command::new(&tool);
        base(&mut c);
        let r = run(c
            .args([
                "backup", "--family", "bench", "--name", "incr", "--parent", "again",
            ])
            .arg(&image2))?;
        row(
            &name,
            "incremental",
            &r,
            Some(count_objects(lister.as_ref(), &name).await?),
        );
        let out = run_dir.join(format!("restore-{codec}.img"));
        let mut c = Command::new(&tool);
        base(&mut c);
        let r = run(c
            .args(["restore", "--family", "bench", "--name", "incr"])
            .arg(&out))?;
        if !same_file(&out, &image2)? {
            bail!("zebu {codec} restore differs from the image");
        }
        row(&name, "restore", &r, None);
        let _ = std::fs::remove_file(&out);
        // Delete the older backups and GC twice (condemn, then delete): time and memory of GC.
        for old in ["full", "again"] {
            let mut c = Command::new(&tool);
            base(&mut c);
            run(c.args(["rm", "--family", "bench", "--name", old]))?;
        }
        for pass in ["gc-pass-1", "gc-pass-2"] {
            let mut c = Command::new(&tool);
            base(&mut c);
            let r = run(c.args(["gc", "--family", "bench", "--margin-secs", "0"]))?;
            row(
                &name,
                pass,
                &r,
                Some(count_objects(lister.as_ref(), &name).await?),
            );
        }
    }

    if a.no_restic {
        drop(moto_child);
        return Ok(());
    }
    // restic.
    let restic = |args: &[&str]| {
        let mut c = Command::new("restic");
        c.args(["-r", &restic_repo, "--no-cache"])
            .args(args)
            .env("RESTIC_PASSWORD", "bench");
        for (k, v) in &env {
            c.env(k, v);
        }
        c
    };
    run(&mut restic(&["init"]))?;
    let restic_prefix = "restic";
    let img_dir = image.parent().context("image dir")?;
    let img_name = image
        .file_name()
        .context("image name")?
        .to_string_lossy()
        .into_owned();
    let r = run(restic(&["backup", "--host", "bench", &img_name]).current_dir(img_dir))?;
    row(
        "restic",
        "full",
        &r,
        Some(count_objects(lister.as_ref(), restic_prefix).await?),
    );
    let r = run(restic(&["backup", "--host", "bench", &img_name]).current_dir(img_dir))?;
    row(
        "restic",
        "unchanged",
        &r,
        Some(count_objects(lister.as_ref(), restic_prefix).await?),
    );
    // The modified image under the same name, so restic sees one file changing.
    let v2_dir = run_dir.join("v2");
    std::fs::create_dir_all(&v2_dir)?;
    std::fs::rename(&image2, v2_dir.join(&img_name))?;
    let r = run(restic(&["backup", "--host", "bench", &img_name]).current_dir(&v2_dir))?;
    row(
        "restic",
        "incremental",
        &r,
        Some(count_objects(lister.as_ref(), restic_prefix).await?),
    );
    let out_dir = run_dir.join("restic-restore");
    let r = run(&mut restic(&[
        "restore",
        "latest",
        "--target",
        out_dir.to_str().context("utf8")?,
    ]))?;
    if !same_file(&out_dir.join(&img_name), &v2_dir.join(&img_name))? {
        bail!("restic restore differs from the image");
    }
    row("restic", "restore", &r, None);

    if let Some(p) = &a.json {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(
                &serde_json::json!({"size_mib": a.size_mib, "content": a.content,
            "target": a.target, "rows": rows}),
            )?,
        )?;
    }
    drop(moto_child);
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(())
}
