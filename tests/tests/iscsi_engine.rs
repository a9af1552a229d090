//! The engine's iSCSI target on the real replicated volume: three `zebu-replica` processes
//! on 127.0.0.11–13 and one `zebu-engine serve --frontend iscsi` over them.
//!
//! - libiscsi's conformance suite (the "core" subset that matters for a block volume) must
//!   pass through the replicated write path, and afterwards the three replicas must hold
//!   identical data: every write, unmap and write-same the suite issued reached all three.
//! - A Linux kernel initiator (inside a throw-away QEMU VM) logs in, makes ext4, writes and
//!   verifies a file; after the engine is stopped with SIGTERM and started again on the same
//!   replicas, a second VM finds the file intact.
//!
//! Both drive shared tools from `<repo>/../shared/scripts` (CI keeps a copy of `shared/`
//! beside the checkout; a git worktree checked out elsewhere looks beside its main checkout;
//! `ZEBU_SHARED_SCRIPTS=DIR` points elsewhere). Without them, or without root for the VM, a
//! test prints why and passes without checking anything.
//!
//! The scripts run as child processes under a deadline, so a target that hangs fails the
//! test instead of stalling CI; a target that crashes fails the liveness check after them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use zebu_tests::engine::{Cluster, Fingerprint, mode_in};

const MIB: u64 = 1 << 20;

/// The core conformance run takes about a minute; far more than that is a hang.
const CONFORMANCE_DEADLINE: Duration = Duration::from_secs(15 * 60);
/// One VM run is ~80 s under software emulation plus a first-time apt install.
const VM_DEADLINE: Duration = Duration::from_secs(20 * 60);

/// The shared test scripts, or `None` (with the reason printed) when they are not there.
fn shared_scripts() -> Option<PathBuf> {
    let dir = match std::env::var_os("ZEBU_SHARED_SCRIPTS") {
        Some(d) => PathBuf::from(d),
        None => {
            // tests/ -> repo root -> its sibling shared/
            let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let beside = repo.join("../shared/scripts");
            // A worktree's main checkout: the parent of the git directory it shares.
            let main = std::process::Command::new("git")
                .args(["rev-parse", "--path-format=absolute", "--git-common-dir"])
                .current_dir(&repo)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
            match main.as_deref().and_then(std::path::Path::parent) {
                Some(main) if !beside.is_dir() => main.join("../shared/scripts"),
                _ => beside,
            }
        }
    };
    if dir.join("conformance.sh").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "SKIPPED: no shared test scripts at {} (set ZEBU_SHARED_SCRIPTS)",
            dir.display()
        );
        None
    }
}

/// Three fresh replicas of `size` bytes and an engine serving them over iSCSI on
/// 127.0.0.1 (a free port).
fn iscsi_cluster(volume: &str, size: u64) -> anyhow::Result<Cluster> {
    let mut c = Cluster::replicas_only(volume, size)?;
    c.cfg.iscsi_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    // Generous: this machine is shared and the VM emulates its CPU in software; a replica
    // dropped for being slow would make the "three replicas" claim untrue, and the final
    // mode check would report it.
    c.cfg.io_timeout = Duration::from_secs(10);
    c.start_engine()?;
    Ok(c)
}

/// The engine's iSCSI URL split into (portal `host:port`, target IQN).
fn portal_and_iqn(c: &Cluster) -> anyhow::Result<(SocketAddr, String)> {
    let url = c
        .engine()
        .iscsi
        .as_deref()
        .context("engine has no iSCSI URL")?;
    // iscsi://HOST:PORT/IQN/LUN
    let rest = url.strip_prefix("iscsi://").context("iscsi URL scheme")?;
    let mut parts = rest.split('/');
    let portal: SocketAddr = parts
        .next()
        .context("portal in iscsi URL")?
        .parse()
        .context("parsing the portal")?;
    let iqn = parts.next().context("IQN in iscsi URL")?.to_string();
    Ok((portal, iqn))
}

/// Runs `cmd` to completion or kills it at `deadline`; returns (exit code, stdout).
async fn run_script(
    mut cmd: tokio::process::Command,
    what: &str,
    deadline: Duration,
) -> anyhow::Result<(Option<i32>, String)> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        // The scripts log progress on stderr: let it through to the test output.
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let started = Instant::now();
    let child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    let out = match tokio::time::timeout(deadline, child.wait_with_output()).await {
        Ok(out) => out.with_context(|| format!("waiting for {what}"))?,
        Err(_) => bail!("{what} did not finish within {deadline:?}: the target hangs?"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "{what}: {} after {:?}; stdout:\n{stdout}",
        out.status,
        started.elapsed()
    );
    Ok((out.status.code(), stdout))
}

/// `N passed, N failed, N skipped` from the last line of conformance.sh.
fn parse_counts(stdout: &str) -> anyhow::Result<(u32, u32, u32)> {
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .context("conformance.sh printed nothing")?;
    let nums: Vec<u32> = last
        .split(',')
        .map(|part| {
            part.split_whitespace()
                .next()
                .context("empty count")?
                .parse::<u32>()
                .with_context(|| format!("count in {last:?}"))
        })
        .collect::<anyhow::Result<_>>()?;
    let [passed, failed, skipped] = nums[..] else {
        bail!("unexpected closing line {last:?}");
    };
    Ok((passed, failed, skipped))
}

/// The engine still runs and every replica is RW (none was dropped along the way).
async fn assert_engine_healthy(c: &Cluster, when: &str) -> anyhow::Result<()> {
    let pid = c.engine().pid();
    // Signal 0 only checks that the process exists (and is not a zombie we reaped).
    let alive = nix::sys::signal::kill(pid, None).is_ok();
    let info = c.engine().info().await;
    assert!(
        alive && info.is_ok(),
        "{when}: the engine is gone or does not answer ({info:?})\n{}",
        c.logs()
    );
    let info = info?;
    for i in 0..3 {
        let addr = c.addr(i);
        assert_eq!(
            mode_in(&info, &addr),
            "RW",
            "{when}: replica {addr} is not RW: {info:?}\n{}",
            c.logs()
        );
    }
    Ok(())
}

/// All three replicas hold the same data, layers and flush state (the engine must be idle).
async fn assert_replicas_identical(c: &Cluster, when: &str) -> anyhow::Result<()> {
    let first = Fingerprint::of(c.addrs[0]).await?;
    for i in 1..3 {
        let other = Fingerprint::of(c.addrs[i]).await?;
        let diff = first.diff(&other);
        assert!(
            diff.is_empty(),
            "{when}: replica {} differs from {}: {diff:?}",
            c.addr(i),
            c.addr(0)
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_core_against_three_replicas() -> anyhow::Result<()> {
    let Some(scripts) = shared_scripts() else {
        return Ok(());
    };
    let c = iscsi_cluster("conformance", 256 * MIB)?;
    let url = c.engine().iscsi.clone().context("iSCSI URL")?;
    let mut cmd = tokio::process::Command::new(scripts.join("conformance.sh"));
    cmd.arg(&url).arg(scripts.join("core-tests.txt"));
    let (code, stdout) = run_script(cmd, "conformance.sh (core)", CONFORMANCE_DEADLINE).await?;
    let (passed, failed, skipped) = parse_counts(&stdout)?;
    eprintln!(
        "core conformance on 3 replicas: {passed} passed, {failed} failed, {skipped} skipped"
    );
    // Exit 2 means an incomplete run (a test process died, e.g. the target dropped it).
    assert!(
        code == Some(0) && failed == 0 && passed >= 90,
        "core conformance: exit {code:?}, {passed} passed, {failed} failed, {skipped} skipped \
         (want exit 0, >= 90 passed, 0 failed)\n{}",
        c.logs()
    );
    assert_engine_healthy(&c, "after the conformance run").await?;
    assert_replicas_identical(&c, "after the conformance run").await?;
    Ok(())
}

/// One VM run of vm-iscsi-smoke.sh; fails unless it prints PASS.
async fn vm_smoke(
    scripts: &std::path::Path,
    c: &Cluster,
    keep_fs: bool,
    workdir: &std::path::Path,
) -> anyhow::Result<()> {
    let (portal, iqn) = portal_and_iqn(c)?;
    let mut cmd = tokio::process::Command::new(scripts.join("vm-iscsi-smoke.sh"));
    cmd.arg("--portal")
        .arg(portal.to_string())
        .arg("--iqn")
        .arg(&iqn)
        .arg("--workdir")
        .arg(workdir);
    if keep_fs {
        cmd.arg("--keep-fs");
    }
    let what = if keep_fs {
        "vm-iscsi-smoke.sh --keep-fs"
    } else {
        "vm-iscsi-smoke.sh"
    };
    let (code, stdout) = run_script(cmd, what, VM_DEADLINE).await?;
    let passed = stdout.lines().any(|l| l.starts_with("PASS"));
    assert!(
        code == Some(0) && passed,
        "{what} did not pass (see its console log in {})\n{}",
        workdir.display(),
        c.logs()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kernel_initiator_vm_smoke_three_replicas() -> anyhow::Result<()> {
    let Some(scripts) = shared_scripts() else {
        return Ok(());
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        eprintln!("SKIPPED: vm-iscsi-smoke.sh must run as root (it installs QEMU with apt)");
        return Ok(());
    }
    // A fixed directory, so the guest kernel it downloads is cached between runs.
    let workdir = std::env::temp_dir().join("zebu-iscsi-engine-vm");
    let mut c = iscsi_cluster("vmsmoke", 256 * MIB)?;
    vm_smoke(&scripts, &c, false, &workdir).await?;
    assert_engine_healthy(&c, "after the first VM run").await?;

    // Stop the engine cleanly and start it again on the same replicas and the same portal.
    let (portal, _) = portal_and_iqn(&c)?;
    let status = c
        .engine_mut()
        .terminate(Duration::from_secs(30))
        .with_context(|| c.logs())?;
    assert!(
        status.success(),
        "engine exit after SIGTERM: {status}\n{}",
        c.logs()
    );
    c.cfg.iscsi_listen = Some(portal);
    let mut last = None;
    for _ in 0..50 {
        match c.start_engine() {
            Ok(_) => {
                last = None;
                break;
            }
            Err(e) => {
                // The old listener's port may linger for a moment.
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    if let Some(e) = last {
        return Err(e.context("restarting the engine on the same portal"));
    }
    vm_smoke(&scripts, &c, true, &workdir).await?;
    assert_engine_healthy(&c, "after the second VM run").await?;
    assert_replicas_identical(&c, "after both VM runs").await?;
    Ok(())
}

#[test]
fn parses_the_closing_line() -> anyhow::Result<()> {
    let out = "FAILED  ALL.Foo.Bar\ncunit: 93 ran\n90 passed, 1 failed, 2 skipped\n";
    assert_eq!(parse_counts(out)?, (90, 1, 2));
    assert!(parse_counts("WARNING: incomplete run\n").is_err());
    assert!(parse_counts("").is_err());
    Ok(())
}
