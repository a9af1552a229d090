//! Crash safety of the embedded store: a child process writes in a loop and
//! is killed with SIGKILL at random moments, many times. After each kill the
//! database must open, and every write the child acknowledged (printed after
//! `create`/`update` returned) must be there.
//!
//! The child is this same test binary, re-run with an environment variable
//! that turns `crash_child` into the writer loop.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::json;
use zebu_store::EmbeddedStore;
use zebu_types::Kind;
use zebu_types::store::ListParams;

const CHILD_ENV: &str = "ZEBU_STORE_CRASH_CHILD";

/// The writer loop when run as the child; a no-op in a normal test run.
#[test]
fn crash_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = EmbeddedStore::open(&path).expect("child: open");
    let items = store
        .list_sync(Kind::Setting, &ListParams::all())
        .expect("child: list")
        .items;
    let mut n = items
        .iter()
        .filter_map(|i| {
            i["metadata"]["name"]
                .as_str()?
                .strip_prefix("k-")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .map_or(0, |m| m + 1);
    loop {
        let obj = json!({"kind": "Setting", "metadata": {"name": format!("k-{n}")},
                         "spec": {"value": n.to_string()}});
        store.create_sync(obj).expect("child: create");
        // Move a shared counter forward too, to crash inside updates.
        match store
            .get_sync(Kind::Setting, "counter")
            .expect("child: get")
        {
            Some(mut c) => {
                c["spec"]["value"] = json!(n.to_string());
                store.update_sync(c).expect("child: update");
            }
            None => {
                store
                    .create_sync(json!({"kind": "Setting", "metadata": {"name": "counter"},
                                        "spec": {"value": n.to_string()}}))
                    .expect("child: create counter");
            }
        }
        println!("ack {n}");
        n += 1;
    }
}

#[test]
fn acknowledged_writes_survive_kill_9() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("zebu.redb");
    let exe = std::env::current_exe().expect("current exe");
    let mut acked_max: Option<u64> = None;
    let mut kills = 0;
    for round in 0..25u64 {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line
                    .strip_prefix("ack ")
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    let _ = tx.send(n);
                }
            }
        });
        // Wait for the first ack of this round so every round kills mid-loop,
        // then let it run a varying time.
        let first = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("child acknowledges a write");
        std::thread::sleep(Duration::from_millis(5 + (round * 37) % 120));
        // Child::kill is SIGKILL on Unix: no chance to flush or clean up.
        child.kill().expect("kill -9");
        child.wait().expect("reap");
        kills += 1;
        reader.join().expect("reader thread");
        let round_max = rx.try_iter().fold(first, u64::max);
        acked_max = Some(acked_max.map_or(round_max, |m| m.max(round_max)));

        let store = EmbeddedStore::open(&path).expect("db opens after kill -9");
        let list = store
            .list_sync(Kind::Setting, &ListParams::all())
            .expect("list");
        let items = list.items;
        let mut present: Vec<u64> = items
            .iter()
            .filter_map(|i| {
                i["metadata"]["name"]
                    .as_str()?
                    .strip_prefix("k-")?
                    .parse()
                    .ok()
            })
            .collect();
        present.sort_unstable();
        let max = acked_max.expect("set above");
        for n in 0..=max {
            assert!(
                present.binary_search(&n).is_ok(),
                "round {round}: acknowledged write k-{n} lost (acked up to {max})"
            );
        }
        // Nothing beyond one unacknowledged create may appear.
        assert!(
            present.last().is_some_and(|&l| l <= max + 1),
            "round {round}: {:?} beyond acked {max}",
            present.last()
        );
        let counter = store
            .get_sync(Kind::Setting, "counter")
            .expect("get")
            .expect("counter exists");
        let c: u64 = counter["spec"]["value"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect("counter value");
        assert!(c >= max, "round {round}: counter {c} behind acked {max}");
        assert!(!list.resource_version.is_empty());
        drop(store);
    }
    assert_eq!(kills, 25);
    eprintln!(
        "{kills} kills, {} acknowledged writes all present",
        acked_max.unwrap_or(0) + 1
    );
}
