//! End to end: `zebu up` as a real process with three node agents, driven by
//! the real `zebu` CLI over HTTP on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

const ZEBU: &str = env!("CARGO_BIN_EXE_zebu");

struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn zebu(api: &str, args: &[&str]) -> Output {
    Command::new(ZEBU)
        .args(args)
        .env("ZEBU_API", api)
        .output()
        .expect("run zebu")
}

fn ok_json(api: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = zebu(api, &all);
    assert!(
        out.status.success(),
        "zebu {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json output")
}

/// The exit code and the stderr, which must be exactly one line.
fn fails(api: &str, args: &[&str]) -> (i32, String) {
    let out = zebu(api, args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "zebu {args:?} should fail");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    (out.status.code().unwrap_or(-1), err)
}

#[test]
fn up_serves_the_api_and_the_cli_drives_volumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(ZEBU)
        .args([
            "up",
            "--nodes",
            "3",
            "--listen",
            "127.0.0.1:0",
            // Shared CI disks are often fuller than the default allows.
            "--setting",
            "storage-minimal-available-percentage=0",
            "--data-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn zebu up");
    let stdout = child.stdout.take().expect("stdout");
    let up = Up(child);
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first).expect("read");
    let api = first
        .trim()
        .strip_prefix("zebu API listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();

    // Three nodes with their own loopback addresses and real disk numbers.
    let deadline = Instant::now() + Duration::from_secs(10);
    let nodes = loop {
        let nodes = ok_json(&api, &["node", "ls"]);
        let items = nodes["items"].as_array().cloned().unwrap_or_default();
        let ready = items.iter().all(|n| {
            n["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        });
        if items.len() == 3 && ready {
            break items;
        }
        assert!(Instant::now() < deadline, "nodes not ready: {nodes}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let addrs: Vec<_> = nodes.iter().map(|n| n["spec"]["address"].clone()).collect();
    assert_eq!(addrs, ["127.0.0.11", "127.0.0.12", "127.0.0.13"]);
    assert!(nodes[0]["status"]["diskStatus"]["disk-0"]["storageMaximum"].as_u64() > Some(0));
    assert!(dir.path().join("node-2/disk-0").is_dir());

    let v = ok_json(
        &api,
        &[
            "volume",
            "create",
            "db",
            "--size",
            "10G",
            "--frontend",
            "nbd",
        ],
    );
    assert_eq!(v["spec"]["size"], 10u64 << 30);
    assert_eq!(v["spec"]["numberOfReplicas"], 3, "default replica count");
    assert_eq!(v["spec"]["frontend"], "nbd");

    let (code, err) = fails(&api, &["volume", "create", "db", "--size", "1G"]);
    assert_eq!(
        (code, err.trim()),
        (1, "zebu: Volume \"db\" already exists")
    );
    let (code, err) = fails(&api, &["volume", "create", "x", "--size", "10X"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown unit \"X\""), "{err}");
    let (_, err) = fails(
        &api,
        &["volume", "create", "x", "--size", "1G", "--replicas", "0"],
    );
    assert!(err.contains("--replicas"), "{err}");
    let (_, err) = fails(&api, &["volume", "create", "x", "--size", "1000"]);
    assert!(err.contains("not a multiple of 4 KiB"), "{err}");
    let (_, err) = fails(&api, &["volume", "attach", "db", "--node", "node-9"]);
    assert!(err.contains("node \"node-9\" does not exist"), "{err}");
    let (code, err) = fails(&api, &["volume", "get", "nope"]);
    assert_eq!((code, err.trim()), (1, "zebu: volume \"nope\" not found"));
    for args in [
        &["volume", "delete", "nope"][..],
        &["volume", "attach", "nope"],
        &["volume", "detach", "nope"],
    ] {
        let (code, err) = fails(&api, args);
        assert_eq!(
            (code, err.trim()),
            (1, "zebu: volume \"nope\" not found"),
            "{args:?}"
        );
    }
    // Larger than any disk: refused at create with the scheduler's reason.
    let (code, err) = fails(&api, &["volume", "create", "huge", "--size", "64Ti"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(
            "zebu: cannot schedule replica 1 of volume huge: no disk has 64 TiB available"
        ),
        "{err}"
    );
    // Four replicas on three nodes under hard node anti-affinity.
    let (code, err) = fails(
        &api,
        &[
            "volume",
            "create",
            "wide",
            "--size",
            "1G",
            "--replicas",
            "4",
        ],
    );
    assert_eq!(code, 1);
    assert_eq!(
        err.trim(),
        "zebu: cannot schedule replica 4 of volume wide: 3 nodes, hard node anti-affinity needs 4"
    );
    // Neither refused volume was stored.
    assert_eq!(fails(&api, &["volume", "get", "huge"]).0, 1);
    assert_eq!(fails(&api, &["volume", "get", "wide"]).0, 1);
    // Malformed sizes and flags: exit 2 before any request.
    let (code, err) = fails(&api, &["volume", "create", "x", "--size", "ten"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("zebu: invalid value 'ten' for '--size <SIZE>'"),
        "{err}"
    );
    let (code, err) = fails(
        &api,
        &["volume", "create", "x", "--size", "1G", "--colour", "red"],
    );
    assert_eq!(code, 2);
    assert_eq!(err.trim(), "zebu: unexpected argument '--colour' found");
    let (code, err) = fails(&api, &["volume", "create", "x"]);
    assert_eq!(
        (code, err.trim()),
        (
            2,
            "zebu: the following required arguments were not provided: --size <SIZE>"
        )
    );
    // A reader that goes away (`zebu node ls | head -c0`) ends the command
    // quietly instead of a panic.
    let mut child = Command::new(ZEBU)
        .args(["node", "ls", "-o", "json"])
        .env("ZEBU_API", &api)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let (code, err) = fails(
        &api,
        &["volume", "create", "x", "--size", "1G", "--frontend", "fc"],
    );
    assert_eq!(code, 2);
    assert!(
        err.starts_with("zebu: invalid value 'fc' for '--frontend"),
        "{err}"
    );
    let (code, err) = fails(&api, &["node", "stop", "node-9"]);
    assert_eq!(
        (code, err.trim()),
        (1, "zebu: node \"node-9\" is not run by this zebu up")
    );

    let v = ok_json(
        &api,
        &["volume", "attach", "db", "--node", "node-2", "--no-wait"],
    );
    assert_eq!(v["spec"]["nodeId"], "node-2");
    let (_, err) = fails(&api, &["volume", "attach", "db", "--node", "node-3"]);
    assert!(err.contains("already attached to node-2"), "{err}");
    let list = ok_json(&api, &["volume", "ls"]);
    assert_eq!(list["items"][0]["metadata"]["name"], "db");
    let yaml = zebu(&api, &["volume", "get", "db", "-o", "yaml"]);
    let text = String::from_utf8_lossy(&yaml.stdout);
    assert!(
        text.contains("kind: Volume") && text.contains("nodeId: node-2"),
        "{text}"
    );
    let table = zebu(&api, &["volume", "ls"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.starts_with("NAME"), "{text}");
    assert!(text.contains("10 GiB") && text.contains("node-2"), "{text}");

    // `get --watch` prints the current state, then the change made by detach.
    let mut watch = Command::new(ZEBU)
        .args(["volume", "get", "db", "--watch", "-o", "json"])
        .env("ZEBU_API", &api)
        .stdout(Stdio::piped())
        .spawn()
        .expect("watch");
    let mut lines = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let mut seen = String::new();
    while !seen.contains("\"nodeId\"") {
        seen.push_str(&lines.next().expect("line").expect("read"));
    }
    ok_json(&api, &["volume", "detach", "db"]);
    ok_json(&api, &["volume", "delete", "db"]);
    // The watch ends by itself when the volume is deleted.
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = watch.wait().expect("watch exits");
    assert!(status.success());
    assert!(
        rest.iter().filter(|l| l.trim() == "}").count() >= 2,
        "{rest:?}"
    );
    let (code, _) = fails(&api, &["volume", "get", "db"]);
    assert_eq!(code, 1);

    // SIGINT stops everything cleanly.
    let pid = nix::unistd::Pid::from_raw(up.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let mut up = up;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = up.0.try_wait().expect("wait") {
            assert!(status.success(), "{status:?}");
            break;
        }
        assert!(Instant::now() < deadline, "zebu up did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, err) = fails(&api, &["volume", "ls"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot reach the zebu API"), "{err}");
}

/// `zebu up --volume` as the README's main job runs it: the volume is
/// created and attached by itself and its endpoint printed; Ctrl-C stops
/// every process; the next `zebu up` brings the same volume back, with its
/// data, at the same endpoint.
#[test]
fn up_with_a_volume_serves_it_and_ctrl_c_stops_every_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let needle = dir.path().display().to_string();
    let _cleanup = common::KillUnder(needle.clone());
    let run = |expect_created: bool| {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("up.log"))
            .expect("log");
        let mut child = Command::new(ZEBU)
            .args(["up", "--listen", "127.0.0.1:0", "--volume", "vol"])
            .args(["--volume-size", "64M"])
            // Shared CI disks are often fuller than the default allows.
            .args(["--setting", "storage-minimal-available-percentage=0"])
            .arg("--data-dir")
            .arg(dir.path())
            .env(
                "ZEBU_LOG",
                "zebu_manager=debug,zebu_ops=debug,zebu_controllers=debug,zebu_agent=debug",
            )
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn zebu up");
        // Lines through a channel, so a line that never comes fails the
        // test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let up = Up(child);
        let log_path = dir.path().join("up.log");
        let next = || {
            rx.recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|e| {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    let tail: Vec<&str> = log
                        .lines()
                        .filter(|l| !l.contains("store::embedded"))
                        .rev()
                        .take(40)
                        .collect();
                    panic!("no line from zebu up: {e}; up.log ends {tail:#?}")
                })
        };
        let api = next()
            .strip_prefix("zebu API listening on ")
            .expect("API line")
            .to_string();
        assert!(next().contains("3 nodes; Ctrl-C stops everything"));
        let line = next();
        let endpoint = line
            .strip_prefix("volume vol attached: ")
            .unwrap_or_else(|| panic!("{line:?}"))
            .to_string();
        assert!(
            endpoint.starts_with("nbd://127.0.0.11:") && endpoint.ends_with("/vol"),
            "{endpoint}"
        );
        let v = ok_json(&api, &["volume", "get", "vol"]);
        assert_eq!(v["spec"]["numberOfReplicas"], 3);
        assert_eq!(v["spec"]["size"], 64u64 << 20);
        assert_eq!(v["status"]["replicas"].as_array().map(Vec::len), Some(3));
        let io = |cmd: &str| {
            let out = Command::new("qemu-io")
                .args(["-f", "raw", "-c", cmd, &endpoint])
                .output()
                .expect("qemu-io");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success() && !text.contains("fail"),
                "{cmd}: {text}"
            );
        };
        let snapshots = |v: Value| -> Vec<String> {
            v["items"]
                .as_array()
                .expect("items")
                .iter()
                .filter_map(|s| s["name"].as_str().map(str::to_string))
                .collect()
        };
        if expect_created {
            io("write -P 0x5a 1M 2M");
            // Snapshots go through the running engine.
            let after = snapshots(ok_json(&api, &["snapshot", "create", "vol", "s1"]));
            assert!(after.contains(&"s1".to_string()), "{after:?}");
            io("write -P 0x6b 1M 1M");
            let listed = snapshots(ok_json(&api, &["snapshot", "ls", "vol"]));
            assert!(listed.contains(&"s1".to_string()), "{listed:?}");
            let table = zebu(&api, &["snapshot", "ls", "vol"]);
            let text = String::from_utf8_lossy(&table.stdout);
            assert!(text.starts_with("NAME") && text.contains("s1"), "{text}");
            let (code, err) = fails(&api, &["snapshot", "rm", "vol", "nope"]);
            assert_eq!(code, 1);
            assert!(err.contains("nope"), "{err}");
            let (code, err) = fails(&api, &["snapshot", "ls", "nope"]);
            assert_eq!((code, err.trim()), (1, "zebu: volume \"nope\" not found"));
            let (code, err) = fails(&api, &["snapshot", "create", "vol", "Bad_Name"]);
            assert_eq!(code, 1);
            assert!(err.contains("snapshot name \"Bad_Name\""), "{err}");
            ok_json(
                &api,
                &[
                    "volume",
                    "create",
                    "cold",
                    "--size",
                    "16M",
                    "--replicas",
                    "1",
                ],
            );
            let (code, err) = fails(&api, &["snapshot", "create", "cold"]);
            assert_eq!(code, 1);
            assert!(err.contains("\"cold\" is not attached"), "{err}");
            let left = snapshots(ok_json(&api, &["snapshot", "rm", "vol", "s1"]));
            assert!(!left.contains(&"s1".to_string()), "{left:?}");
        }
        // Deleting the snapshot merged it: both writes read back.
        io("read -P 0x6b 1M 1M");
        io("read -P 0x5a 2M 1M");

        let mut up = up;
        let pid = nix::unistd::Pid::from_raw(up.0.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = up.0.try_wait().expect("wait") {
                assert!(status.success(), "{status:?}");
                break;
            }
            assert!(Instant::now() < deadline, "zebu up did not stop on SIGINT");
            std::thread::sleep(Duration::from_millis(50));
        }
        let left: Vec<i32> = ["zebu-engine", "zebu-replica"]
            .iter()
            .flat_map(|b| common::pids(b, &needle))
            .collect();
        assert!(left.is_empty(), "processes left after Ctrl-C: {left:?}");
        endpoint
    };
    let first = run(true);
    let second = run(false);
    assert_eq!(first, second, "the same endpoint after a restart");
}
