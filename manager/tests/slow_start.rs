//! End to end: one engine whose start hangs does not hold up another
//! volume on the same node.
//!
//! `zebu up --nodes 1` runs two 1-replica volumes on one node. The replica
//! of `slow` is frozen (SIGSTOP: its socket still accepts connections but
//! nothing answers), `slow` is attached, and its engine, stuck asking the
//! replica for its Info, is frozen too, so it never says it is ready and the
//! node agent's start of it hangs until its 60 s ready timeout. `fast` is
//! attached meanwhile and must be served within seconds, while `slow`'s
//! engine process is still the same one and still starting. Then `slow` is
//! detached while its start hangs (the start is aborted and the frozen
//! engine stopped), its replica is let go, and it attaches normally.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, and
//! `qemu-io`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

fn signal(pid: i32, sig: Signal) {
    kill(Pid::from_raw(pid), sig).expect("signal");
}

fn alive(pid: i32) -> bool {
    // A zombie keeps its /proc entry but loses its command line.
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

#[test]
fn a_hung_engine_start_does_not_delay_attaching_another_volume_on_the_node() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 1, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 1);
    for name in ["slow", "fast"] {
        ok(
            &api,
            &[
                "volume",
                "create",
                name,
                "--size",
                "64M",
                "--replicas",
                "1",
                "--frontend",
                "nbd",
            ],
        );
    }
    let mut slow_replica = String::new();
    wait_for("both replicas running", 30, || {
        let (Some(s), Some(f)) = (volume(&api, "slow"), volume(&api, "fast")) else {
            return false;
        };
        slow_replica = s["status"]["replicas"][0]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        [s, f]
            .iter()
            .all(|v| v["status"]["state"] == "detached" && v["status"]["robustness"] == "healthy")
    });
    let replica = pids("zebu-replica", &slow_replica);
    assert_eq!(replica.len(), 1, "{slow_replica}: {replica:?}");
    signal(replica[0], Signal::SIGSTOP);

    ok(&api, &["volume", "attach", "slow", "--no-wait"]);
    let mut engine = Vec::new();
    wait_for("slow's engine process", 20, || {
        engine = pids("zebu-engine", "engine-slow-e");
        !engine.is_empty()
    });
    assert_eq!(engine.len(), 1, "{engine:?}");
    signal(engine[0], Signal::SIGSTOP);

    let start = Instant::now();
    let endpoint = ok(&api, &["volume", "attach", "fast", "--timeout", "40"])
        .trim()
        .to_string();
    let took = start.elapsed();
    eprintln!("fast attached after {took:?} at {endpoint} while slow's engine hangs");
    assert!(endpoint.starts_with("nbd://127.0.0.11:"), "{endpoint}");
    assert!(
        took < Duration::from_secs(20),
        "fast waited {took:?} for slow's start"
    );
    assert!(alive(engine[0]), "slow's engine start is still in flight");
    let slow = volume(&api, "slow").expect("slow");
    assert_eq!(slow["status"]["state"], "attaching", "{slow}");
    qemu_io(&endpoint, "write -P 0x7a 0 4M");
    qemu_io(&endpoint, "read -P 0x7a 0 4M");

    // Detach slow while its start still hangs: the start is aborted and the
    // frozen engine stopped (SIGTERM waits in vain, then SIGKILL).
    ok(&api, &["volume", "detach", "slow"]);
    let gone = wait_for("slow's engine stopped", 40, || !alive(engine[0]));
    eprintln!("slow's hung engine stopped {gone:?} after detach");
    wait_for("slow detached", 20, || {
        volume(&api, "slow").is_some_and(|v| v["status"]["state"] == "detached")
    });
    assert!(pids("zebu-engine", "engine-slow-e").is_empty());

    // Let its replica go: slow attaches normally now.
    signal(replica[0], Signal::SIGCONT);
    let slow_endpoint = ok(&api, &["volume", "attach", "slow", "--timeout", "60"])
        .trim()
        .to_string();
    assert!(slow_endpoint.ends_with("/slow"), "{slow_endpoint}");
    qemu_io(&slow_endpoint, "write -P 0x11 0 1M");
    qemu_io(&slow_endpoint, "read -P 0x11 0 1M");
    qemu_io(&endpoint, "read -P 0x7a 0 4M");
    drop(up);
}
