//! The REST API's OpenAPI document (issue 18, item 8) on a running `zebu up`: the served
//! document is the checked-in `manager/api/openapi.json`, every path it names is one the
//! router serves, and schemathesis (PyPI, `tests/scripts/schemathesis.sh`, its venv cached
//! outside the checkout) finds no 5xx, no hang and no answer that does not match the schema.
//!
//! Needs `curl`, `python3 -m venv` and, the first time, PyPI (the venv is then cached).

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod common;
use common::{FULL_DISK_OK, ok, start_up, wait_nodes};

const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/api/openapi.json");
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/scripts/schemathesis.sh"
);

fn curl(method: &str, url: &str) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sS", "-m", "20", "-X", method, "-w", "\n%{http_code}", url])
        .args(["-H", "content-type: application/json"])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or((&text, ""));
    (body.to_string(), code.to_string())
}

#[test]
fn the_served_document_is_the_checked_in_one_and_schemathesis_finds_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = start_up(tmp.path(), 1, FULL_DISK_OK);
    let api = up.api.clone();
    wait_nodes(&api, 1);

    let (served, code) = curl("GET", &format!("{api}/v1/openapi.json"));
    assert_eq!(code, "200");
    let file = std::fs::read_to_string(CHECKED_IN).expect("manager/api/openapi.json");
    assert!(
        served == file,
        "the served OpenAPI document is not manager/api/openapi.json; run \
         ZEBU_WRITE_OPENAPI=1 cargo test -p zebu-api openapi"
    );
    let doc: Value = serde_json::from_str(&served).expect("JSON");

    // Every documented operation reaches a handler (none falls through to "no such path").
    let paths = doc["paths"].as_object().expect("paths");
    let mut count = 0;
    for (path, ops) in paths {
        let concrete = path
            .replace("{name}", "absent-volume")
            .replace("{snapshot}", "absent-snapshot");
        for method in ops.as_object().expect("methods").keys() {
            let (body, code) = curl(&method.to_uppercase(), &format!("{api}{concrete}"));
            assert!(
                !body.contains("no such API path") && code != "405",
                "{method} {path}: {code} {body}"
            );
            let _: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {body}"));
            count += 1;
        }
    }
    assert!(count >= 34, "{count} operations");

    // Something for schemathesis to find, beside what it makes itself.
    ok(
        &api,
        &[
            "volume",
            "create",
            "seed",
            "--size",
            "16M",
            "--replicas",
            "1",
        ],
    );
    let out = Command::new("bash")
        .arg(SCRIPT)
        .args(["run", &api])
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .output()
        .expect("run schemathesis");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "schemathesis found problems:\n{text}");
    drop(up);
}
