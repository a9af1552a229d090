//! End to end: careless and hostile input to the `zebu` CLI and the REST API gets a clear
//! error that names it and changes nothing (issue 18, item 7), and two `zebu up` clusters
//! run side by side on their own node addresses.
//!
//! Needs `zebu-replica` and `zebu-engine` built next to `zebu`, and `qemu-io`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// `zebu up --nodes 1` on its own API port and node address range.
fn up_at(dir: &Path, first_node: &str) -> Up {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("up.log"))
        .expect("log");
    let mut child: Child = Command::new(ZEBU)
        .args(["up", "--nodes", "1", "--listen", "127.0.0.1:0"])
        .args(["--first-node-address", first_node])
        .args(["--setting", "storage-minimal-available-percentage=0"])
        .arg("--data-dir")
        .arg(dir)
        .env(
            "ZEBU_LOG",
            "zebu_manager=info,zebu_ops=info,zebu_controllers=info,zebu_agent=info",
        )
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn zebu up");
    let api = first_line_api(&mut child);
    Up::adopt(child, api, dir)
}

/// The exit code and the one line of stderr of a `zebu` that must fail.
fn fails(api: &str, args: &[&str]) -> (i32, String) {
    let out = zebu(api, args);
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!out.status.success(), "zebu {args:?} should fail");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    (out.status.code().unwrap_or(-1), err)
}

/// A raw HTTP/1.1 request (as a careless client would send it); status and body.
fn raw_http(api: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let hostport = api.trim_start_matches("http://");
    let mut s = TcpStream::connect(hostport).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

#[test]
fn careless_names_sizes_and_addresses_get_clear_errors_and_change_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = up_at(tmp.path(), "127.0.0.31");
    let api = up.api.clone();
    wait_nodes(&api, 1);
    let nodes: serde_json::Value =
        serde_json::from_str(&ok(&api, &["node", "ls", "-o", "json"])).expect("json");
    assert_eq!(nodes["items"][0]["spec"]["address"], "127.0.0.31");
    ok(
        &api,
        &[
            "volume",
            "create",
            "vol",
            "--size",
            "16M",
            "--replicas",
            "1",
        ],
    );

    // A name with a fragment mark used to go out as `DELETE /v1/volumes/vol`.
    let (code, err) = fails(&api, &["volume", "delete", "vol#frag"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("volume name \"vol#frag\" is not valid"),
        "{err}"
    );
    assert!(volume(&api, "vol").is_some(), "vol must survive");
    // A name that climbs the path is one segment, refused as a name.
    let (code, err) = fails(&api, &["volume", "get", "x/../../v1/nodes"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("volume name \"x/../../v1/nodes\" is not valid"),
        "{err}"
    );
    let (_, err) = fails(&api, &["snapshot", "rm", "vol", "../../nodes"]);
    assert!(
        err.contains("snapshot name \"../../nodes\" is not valid"),
        "{err}"
    );

    // New names are DNS-1123 labels, as in Kubernetes.
    let (code, err) = fails(&api, &["volume", "create", "a.b", "--size", "16M"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("\"a.b\" is not a valid DNS-1123 label"),
        "{err}"
    );
    let long = "a".repeat(64);
    let (_, err) = fails(&api, &["volume", "create", &long, "--size", "16M"]);
    assert!(err.contains("longer than 63 characters"), "{err}");

    // Sizes too large for any disk, as text and as a JSON number.
    let (code, err) = fails(&api, &["volume", "create", "big", "--size", "99999999999T"]);
    assert_eq!(code, 2);
    assert!(err.contains("size \"99999999999T\" is too large"), "{err}");
    let (status, body) = raw_http(
        &api,
        "POST",
        "/v1/volumes",
        r#"{"name":"big","size":99999999999999999999}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("size 100000000000000000000 is too large"),
        "{body}"
    );
    let (status, body) = raw_http(
        &api,
        "POST",
        "/v1/volumes",
        r#"{"name":"big","size":"99999999999T"}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("size \\\"99999999999T\\\" is too large"),
        "{body}"
    );
    assert!(volume(&api, "big").is_none());

    // A wait longer than the clock can add is an argument error, not a panic.
    let (code, err) = fails(
        &api,
        &[
            "volume",
            "attach",
            "vol",
            "--timeout",
            "18446744073709551615",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--timeout"), "{err}");

    // An API address with another scheme is refused before any lookup.
    let (code, err) = fails("ftp://127.0.0.1:1", &["volume", "ls"]);
    assert_eq!(code, 1);
    assert!(err.contains("unsupported scheme \"ftp\""), "{err}");
    let (_, err) = fails("http://127.0.0.1", &["volume", "ls"]);
    assert!(err.contains("no port"), "{err}");
    drop(up);
}

/// Two clusters on one host, each with its own data directory, API port and node
/// addresses, both with a volume `vol` served over NBD: each keeps its own data, and
/// neither adopts or stops the other's processes.
#[test]
fn two_clusters_run_side_by_side_on_their_own_node_addresses() {
    let a_dir = tempfile::tempdir().expect("tempdir");
    let b_dir = tempfile::tempdir().expect("tempdir");
    let a = up_at(a_dir.path(), "127.0.0.41");
    let b = up_at(b_dir.path(), "127.0.0.51");
    let mut endpoints = Vec::new();
    for (up, pattern) in [(&a, "0x41"), (&b, "0x51")] {
        wait_nodes(&up.api, 1);
        ok(
            &up.api,
            &[
                "volume",
                "create",
                "vol",
                "--size",
                "16M",
                "--replicas",
                "1",
                "--frontend",
                "nbd",
            ],
        );
        let endpoint = ok(&up.api, &["volume", "attach", "vol"]).trim().to_string();
        qemu_io(&endpoint, &format!("write -P {pattern} 0 1M"));
        endpoints.push(endpoint);
    }
    assert!(
        endpoints[0].starts_with("nbd://127.0.0.41:"),
        "{endpoints:?}"
    );
    assert!(
        endpoints[1].starts_with("nbd://127.0.0.51:"),
        "{endpoints:?}"
    );
    qemu_io(&endpoints[0], "read -P 0x41 0 1M");
    qemu_io(&endpoints[1], "read -P 0x51 0 1M");
    for (up, dir) in [(&a, &a_dir), (&b, &b_dir)] {
        let needle = dir.path().display().to_string();
        assert_eq!(
            pids("zebu-engine", &needle).len(),
            1,
            "one engine per cluster"
        );
        assert_eq!(pids("zebu-replica", &needle).len(), 1);
        wait_for("healthy", 30, || {
            volume(&up.api, "vol").is_some_and(|v| v["status"]["robustness"] == "healthy")
        });
    }
    // Stopping one cluster leaves the other serving.
    drop(a);
    qemu_io(&endpoints[1], "read -P 0x51 0 1M");
    drop(b);
}
