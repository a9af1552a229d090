//! The engine's NBD frontend driven by real NBD clients over a 3-replica volume.
//!
//! - `nbdinfo` must list the export with the volume's size, and `nbdcopy` must write random
//!   data into the volume and read it back byte for byte.
//! - A real filesystem (the CI filesystem test): `nbdfuse` exposes the export as a
//!   file, a loop device with direct I/O attaches it (so every block goes over NBD rather
//!   than stopping in the loop device's page cache), then mkfs.ext4 and mount. Files of
//!   seeded random data are written and fsynced; one replica is killed with SIGKILL while
//!   files are being written, and writing goes on. Every file must read back exactly (after
//!   an unmount, so the reads come from the device) and `e2fsck -fn` must find the
//!   filesystem clean. Then the engine is stopped with SIGTERM and started again over the
//!   same replicas (the killed one restarted on its directory: the engine must not read from
//!   it before it is caught up), and everything is checked once more.
//!
//! The filesystem test needs root, `/dev/fuse`, loop devices, `nbdfuse`, `losetup`,
//! `mkfs.ext4` and `e2fsck`; without them it prints why and passes without checking
//! anything. Mounts, loop devices and FUSE mounts are undone by drop guards whatever the
//! outcome, with `umount -l` when a plain unmount fails or hangs.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use rand::{RngCore, SeedableRng};
use zebu_proto::engine::VolumeInfo;
use zebu_tests::engine::{Cluster, Fingerprint, mode_in};
use zebu_tests::test_seed;

const MIB: u64 = 1 << 20;

/// How long an external command (mkfs, e2fsck, umount, ...) may run before it counts as hung.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `program args` to completion (killed after `timeout`) and returns its stdout; a
/// non-zero exit is an error carrying stdout and stderr.
fn run_with_timeout(program: &str, args: &[&str], timeout: Duration) -> anyhow::Result<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {program}"))?;
    // Drain the pipes in threads so a chatty command cannot block on a full pipe.
    let mut out = child.stdout.take().context("stdout pipe")?;
    let mut err = child.stderr.take().context("stderr pipe")?;
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status: ExitStatus = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{program} {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    if !status.success() {
        bail!("{program} {args:?} failed ({status}):\n{stdout}\n{stderr}");
    }
    Ok(stdout)
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    run_with_timeout(program, args, COMMAND_TIMEOUT)
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

/// True when something is mounted at `path` (per /proc/self/mountinfo).
fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    // Field 5 is the mount point (spaces are escaped as \040, which temp paths do not have).
    info.lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m == want))
}

/// Unmounts `path` if mounted: `umount`, and `umount -l` when that fails or hangs, so a
/// dead NBD server cannot leave a mount behind.
fn unmount(path: &Path) {
    if !is_mounted(path) {
        return;
    }
    let p = path.to_string_lossy().into_owned();
    if let Err(e) = run_with_timeout("umount", &[&p], Duration::from_secs(30)) {
        eprintln!("umount {p} failed ({e}); lazy unmount");
        if let Err(e) = run_with_timeout("umount", &["-l", &p], Duration::from_secs(30)) {
            eprintln!("umount -l {p} failed too: {e}");
        }
    }
}

/// An NBD export exposed as a regular file by `nbdfuse`; unmounted and reaped on drop.
struct FuseExport {
    child: Child,
    dir: PathBuf,
    file: PathBuf,
}

impl FuseExport {
    fn start(dir: &Path, url: &str) -> anyhow::Result<FuseExport> {
        std::fs::create_dir_all(dir)?;
        let file = dir.join("disk");
        let child = Command::new("nbdfuse")
            .arg(&file)
            .arg(url)
            .stdin(Stdio::null())
            .spawn()
            .context("spawning nbdfuse")?;
        let mut export = FuseExport {
            child,
            dir: dir.to_path_buf(),
            file,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if is_mounted(&export.dir) && export.file.exists() {
                return Ok(export);
            }
            if let Some(status) = export.child.try_wait()? {
                bail!("nbdfuse exited ({status}) before exposing {url}");
            }
            if Instant::now() > deadline {
                bail!("nbdfuse did not expose {url} within 20 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        // There is no fusermount here; umount of the FUSE mount ends nbdfuse's session.
        unmount(&self.dir);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loop device over a file, with direct I/O; detached on drop.
struct LoopDevice {
    dev: String,
}

impl LoopDevice {
    fn attach(file: &Path) -> anyhow::Result<LoopDevice> {
        let out = run(
            "losetup",
            &["--find", "--show", "--direct-io=on", path_str(file)?],
        )?;
        let dev = LoopDevice {
            dev: out.trim().to_string(),
        };
        ensure!(dev.dev.starts_with("/dev/loop"), "losetup printed {out:?}");
        // Without direct I/O the loop device caches blocks and the test would read memory.
        let name = dev.dev.trim_start_matches("/dev/");
        let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .with_context(|| format!("reading the dio flag of {}", dev.dev))?;
        ensure!(
            dio.trim() == "1",
            "{} has direct I/O off ({dio:?})",
            dev.dev
        );
        Ok(dev)
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Err(e) = run_with_timeout("losetup", &["-d", &self.dev], Duration::from_secs(30)) {
            eprintln!("losetup -d {} failed: {e}", self.dev);
        }
    }
}

/// A mounted filesystem; unmounted on drop.
struct Mounted {
    dir: PathBuf,
}

impl Mounted {
    fn mount(dev: &LoopDevice, dir: &Path) -> anyhow::Result<Mounted> {
        std::fs::create_dir_all(dir)?;
        run("mount", &[&dev.dev, path_str(dir)?])?;
        Ok(Mounted {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        unmount(&self.dir);
    }
}

/// The whole stack: FUSE file, loop device and (optionally) the mounted filesystem. Fields
/// drop in declaration order, so the mount goes first and the FUSE export last.
struct FsStack {
    mount: Option<Mounted>,
    dev: LoopDevice,
    _fuse: FuseExport,
}

impl FsStack {
    fn attach(work: &Path, url: &str) -> anyhow::Result<FsStack> {
        let fuse = FuseExport::start(&work.join("fuse"), url)?;
        let dev = LoopDevice::attach(&fuse.file)?;
        Ok(FsStack {
            mount: None,
            dev,
            _fuse: fuse,
        })
    }

    fn mount(&mut self, dir: &Path) -> anyhow::Result<&Path> {
        let m = Mounted::mount(&self.dev, dir)?;
        Ok(&self.mount.insert(m).dir)
    }

    /// Unmounts with a plain `umount` (an error if it fails: a clean unmount is part of the
    /// test), then `e2fsck -fn` must report no problem.
    fn unmount_and_fsck(&mut self) -> anyhow::Result<()> {
        if let Some(m) = self.mount.take() {
            run("umount", &[path_str(&m.dir)?])?;
        }
        let out = run("e2fsck", &["-fn", &self.dev.dev]).context("e2fsck -fn found problems")?;
        eprintln!("e2fsck -fn {}: clean\n{}", self.dev.dev, out.trim());
        Ok(())
    }
}

/// One file the test wrote: its content is `len` bytes from a generator seeded by `seed`.
#[derive(Clone, Debug)]
struct FileSpec {
    name: String,
    seed: u64,
    len: usize,
}

impl FileSpec {
    fn new(run_seed: u64, i: u64) -> FileSpec {
        let seed = run_seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // 4 KiB .. 2 MiB, mostly not block multiples, so partial blocks and tails get tested.
        let len = 4096 + (seed % (2 * MIB - 4096)) as usize;
        FileSpec {
            name: format!("f{i:04}"),
            seed,
            len,
        }
    }

    fn content(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        rand::rngs::StdRng::seed_from_u64(self.seed).fill_bytes(&mut v);
        v
    }

    /// Writes the file and fsyncs it (ext4 then flushes the loop device, which flushes the
    /// FUSE file, which sends an NBD flush).
    fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(&self.name);
        let mut f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        f.write_all(&self.content())
            .with_context(|| format!("writing {}", path.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync of {}", path.display()))?;
        Ok(())
    }

    fn verify(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(&self.name);
        let got = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let want = self.content();
        ensure!(
            got.len() == want.len(),
            "{}: {} bytes, expected {}",
            self.name,
            got.len(),
            want.len()
        );
        // Slice equality is a memcmp; the byte loop only runs to name the place.
        if let Some(at) = (got != want)
            .then(|| got.iter().zip(&want).position(|(a, b)| a != b))
            .flatten()
        {
            bail!(
                "{}: content differs at byte {at} (block {}); crc32c {:08x}, expected {:08x}",
                self.name,
                at / 4096,
                crc32c::crc32c(&got),
                crc32c::crc32c(&want)
            );
        }
        Ok(())
    }
}

fn verify_all(what: &str, dir: &Path, files: &[FileSpec]) -> anyhow::Result<()> {
    let t = Instant::now();
    for f in files {
        f.verify(dir).with_context(|| what.to_string())?;
    }
    let bytes: usize = files.iter().map(|f| f.len).sum();
    eprintln!(
        "{what}: {} files ({:.1} MiB) read back exactly in {:?}",
        files.len(),
        bytes as f64 / MIB as f64,
        t.elapsed()
    );
    Ok(())
}

/// Why the filesystem test cannot run here, if it cannot.
fn fs_test_unsupported() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount, losetup)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("no loop devices (/dev/loop-control)".into());
    }
    for tool in [
        "nbdfuse",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("{tool} is not installed"));
        }
    }
    None
}

fn nbd_url(c: &Cluster) -> String {
    format!("nbd://{}/{}", c.engine().nbd, c.engine().volume)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nbdinfo_and_nbdcopy_round_trip_on_three_replicas() -> anyhow::Result<()> {
    // ZEBU_NBDCOPY_MIB=1024 for the larger run done by hand.
    let mib: u64 = std::env::var("ZEBU_NBDCOPY_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    let size = mib * MIB;
    let seed = test_seed();
    let c = Cluster::start("nbdcopy", size)?;
    let url = nbd_url(&c);

    let info: serde_json::Value = serde_json::from_str(&run("nbdinfo", &["--json", &url])?)
        .context("nbdinfo --json printed no JSON")?;
    let export = &info["exports"][0];
    assert_eq!(export["export-name"], "nbdcopy", "{info}");
    assert_eq!(export["export-size"].as_u64(), Some(size), "{info}");
    assert_eq!(export["is_read_only"], false, "{info}");
    // Without flush, fsync in a filesystem on the volume would promise nothing.
    assert_eq!(export["can_flush"], true, "{info}");
    let list = run("nbdinfo", &["--list", &format!("nbd://{}", c.engine().nbd)])?;
    assert!(list.contains("nbdcopy"), "nbdinfo --list: {list}");

    let src = c.tmp.path().join("src.img");
    let back = c.tmp.path().join("back.img");
    {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut f = std::fs::File::create(&src)?;
        let mut buf = vec![0u8; MIB as usize];
        for _ in 0..mib {
            rng.fill_bytes(&mut buf);
            f.write_all(&buf)?;
        }
    }
    let t = Instant::now();
    run("nbdcopy", &["--flush", path_str(&src)?, &url])?;
    let write_took = t.elapsed();
    let t = Instant::now();
    run("nbdcopy", &[&url, path_str(&back)?])?;
    let read_took = t.elapsed();
    eprintln!(
        "nbdcopy {mib} MiB: write {write_took:?} ({:.0} MiB/s), read {read_took:?} ({:.0} MiB/s)",
        mib as f64 / write_took.as_secs_f64(),
        mib as f64 / read_took.as_secs_f64()
    );

    // Byte for byte, in 1 MiB pieces so a mismatch names its place.
    let (mut a, mut b) = (std::fs::File::open(&src)?, std::fs::File::open(&back)?);
    assert_eq!(a.metadata()?.len(), b.metadata()?.len(), "sizes differ");
    let (mut x, mut y) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
    for i in 0..mib {
        a.read_exact(&mut x)?;
        b.read_exact(&mut y)?;
        if let Some(at) = (x != y)
            .then(|| x.iter().zip(&y).position(|(p, q)| p != q))
            .flatten()
        {
            panic!(
                "nbdcopy read back different data at byte {} of the volume\n{}",
                i * MIB + at as u64,
                c.logs()
            );
        }
    }
    let info = c.engine().info().await?;
    assert_eq!(info.state, "healthy", "{info:?}");
    Ok(())
}

/// The engine's anonymous memory (`RssAnon` in /proc/PID/status), in bytes.
fn rss_anon(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("RssAnon in /proc/PID/status")?;
    Ok(kib * 1024)
}

/// The engine keeps large I/O buffers mapped while it is busy (`engine/src/heap.rs`) and must
/// give that memory back once its volume idles: a node runs one engine per volume. Two passes
/// of 1 MiB writes at queue depth 8 over 128 MiB, read back and compared; then, within 10 s,
/// the engine's anonymous memory must come back to within 4 MiB of what it was before the
/// writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_engine_gives_back_the_memory_of_a_burst_of_large_writes() -> anyhow::Result<()> {
    use futures::StreamExt;
    use zebu_engine::blockdev::BlockDevice;
    let c = Cluster::start("idle-rss", 128 * MIB)?;
    let dev = c.engine().nbd_client().await?;
    let pid = c.engine().pid().as_raw().cast_unsigned();
    let before = rss_anon(pid)?;
    let bound = before + 4 * MIB;
    let mut rng = rand::rngs::StdRng::seed_from_u64(test_seed());
    let blocks: Vec<bytes::Bytes> = (0..128)
        .map(|_| {
            let mut b = vec![0u8; MIB as usize];
            rng.fill_bytes(&mut b);
            bytes::Bytes::from(b)
        })
        .collect();
    for pass in 0..2 {
        let results: Vec<_> = futures::stream::iter(blocks.iter().enumerate())
            .map(|(i, b)| dev.write(i as u64 * MIB, b.clone()))
            .buffer_unordered(8)
            .collect()
            .await;
        for r in results {
            r.with_context(|| format!("1 MiB write, pass {pass}"))?;
        }
    }
    for (i, b) in blocks.iter().enumerate().step_by(17) {
        let got = dev.read(i as u64 * MIB, MIB).await?;
        ensure!(got == *b, "block {i} read back different data");
    }
    let busy = rss_anon(pid)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut idle = busy;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        idle = rss_anon(pid)?;
        if idle < bound {
            break;
        }
    }
    eprintln!(
        "engine anonymous memory: {} KiB before, {} KiB right after the burst, {} KiB once idle",
        before / 1024,
        busy / 1024,
        idle / 1024
    );
    ensure!(
        idle < bound,
        "the idle engine still holds {} KiB of anonymous memory ({} KiB before the writes)",
        idle / 1024,
        before / 1024
    );
    Ok(())
}

/// Writes `files` into `dir` one after another, counting progress in `done`.
fn write_files(dir: &Path, files: &[FileSpec], done: &AtomicUsize) -> anyhow::Result<()> {
    for f in files {
        f.write(dir)?;
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filesystem_survives_replica_kill_and_engine_restart() -> anyhow::Result<()> {
    if let Some(why) = fs_test_unsupported() {
        eprintln!("SKIPPED filesystem_survives_replica_kill_and_engine_restart: {why}");
        return Ok(());
    }
    let seed = test_seed();
    let mut c = Cluster::start("fsvol", 512 * MIB)?;
    let work = c.tmp.path().join("fs");
    let mnt = work.join("mnt");
    let victim = 2;

    let mut all: Vec<FileSpec> = (0..120).map(|i| FileSpec::new(seed, i)).collect();
    let (before, rest) = all.split_at(24);
    let (during, after) = rest.split_at(64);
    let (before, during, after) = (before.to_vec(), during.to_vec(), after.to_vec());

    {
        let mut fs = FsStack::attach(&work, &nbd_url(&c))?;
        run("mkfs.ext4", &["-q", "-F", &fs.dev.dev])?;
        let dir = fs.mount(&mnt)?.to_path_buf();
        let t = Instant::now();
        write_files(&dir, &before, &AtomicUsize::new(0))?;
        run("sync", &[])?;
        eprintln!("wrote {} files in {:?}", before.len(), t.elapsed());

        // Kill a replica in the middle of a stream of fsynced file writes.
        let done = Arc::new(AtomicUsize::new(0));
        let writer = {
            let (dir, files, done) = (dir.clone(), during.clone(), done.clone());
            std::thread::spawn(move || write_files(&dir, &files, &done))
        };
        let t = Instant::now();
        while done.load(Ordering::Relaxed) < 16 && !writer.is_finished() {
            ensure!(
                t.elapsed() < Duration::from_secs(300),
                "writing is too slow"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let at = done.load(Ordering::Relaxed);
        ensure!(
            !writer.is_finished(),
            "the writer ended before the kill: {:?}",
            writer.join()
        );
        c.kill_replica(victim);
        eprintln!("killed replica {} after {at} files", c.addr(victim));
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?
            .context("writing files while a replica died")?;
        write_files(&dir, &after, &AtomicUsize::new(0))?;
        run("sync", &[])?;

        let info = others_rw("after the kill", &c, victim).await?;
        assert_ne!(mode_in(&info, &c.addr(victim)), "RW", "{info:?}");

        // Unmount first so every read below comes from the device, not the page cache.
        fs.unmount_and_fsck()?;
        let dir = fs.mount(&mnt)?.to_path_buf();
        verify_all("after the replica kill", &dir, &all)?;
        fs.unmount_and_fsck()?;
    }

    // SIGTERM: the engine flushes every replica it has and exits.
    let status = c.engine_mut().terminate(Duration::from_secs(30))?;
    assert!(status.success(), "engine exit on SIGTERM: {status}");
    // The killed replica comes back on its directory, stale: the engine must not serve
    // reads from it before it has caught up.
    c.restart_replica(victim)?;
    c.start_engine()?;
    others_rw("after the restart", &c, victim).await?;

    let mut fs = FsStack::attach(&work, &nbd_url(&c))?;
    let dir = fs.mount(&mnt)?.to_path_buf();
    verify_all("after the engine restart", &dir, &all)?;
    // The restarted volume takes writes too.
    let extra: Vec<FileSpec> = (120..136).map(|i| FileSpec::new(seed, i)).collect();
    write_files(&dir, &extra, &AtomicUsize::new(0))?;
    all.extend(extra);
    fs.unmount_and_fsck()?;
    let dir = fs.mount(&mnt)?.to_path_buf();
    verify_all("after writing on the restarted engine", &dir, &all)?;
    fs.unmount_and_fsck()?;
    drop(fs);

    // The restarted replica is caught up in the background; once it is RW it must hold
    // the same volume as the two that never went away, block for block.
    let victim_addr = c.addr(victim);
    let (info, took) = c
        .engine()
        .wait_until(Duration::from_secs(120), |i| {
            mode_in(i, &victim_addr) == "RW" && i.state == "healthy"
        })
        .await
        .with_context(|| c.logs())?;
    eprintln!("replica {victim_addr} RW again after {took:?}: {info:?}");
    let status = c.engine_mut().terminate(Duration::from_secs(30))?;
    assert!(status.success(), "engine exit on SIGTERM: {status}");
    let prints = [
        Fingerprint::of(c.addrs[0]).await?,
        Fingerprint::of(c.addrs[1]).await?,
        Fingerprint::of(c.addrs[2]).await?,
    ];
    for (i, p) in prints.iter().enumerate().skip(1) {
        let differing = p
            .volume_crcs
            .iter()
            .zip(&prints[0].volume_crcs)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            differing == 0 && p.volume_crcs.len() == prints[0].volume_crcs.len(),
            "replica {} differs from replica {} in {differing} blocks",
            c.addr(i),
            c.addr(0)
        );
    }
    eprintln!(
        "the three replicas hold the same {} blocks",
        prints[0].volume_crcs.len()
    );
    Ok(())
}

/// The engine's view of its replicas, printed under `what`, after asserting that every
/// replica but `victim` is RW.
async fn others_rw(what: &str, c: &Cluster, victim: usize) -> anyhow::Result<VolumeInfo> {
    let info = c.engine().info().await?;
    let modes: Vec<_> = info
        .replicas
        .iter()
        .map(|r| (&r.address, &r.mode))
        .collect();
    eprintln!("{what}: {} {modes:?}", info.state);
    for i in (0..3).filter(|&i| i != victim) {
        assert_eq!(mode_in(&info, &c.addr(i)), "RW", "{what}: {info:?}");
    }
    Ok(info)
}
