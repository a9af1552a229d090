//! Happy path with a real initiator: libiscsi's command-line tools (package libiscsi-bin)
//! against an in-process target on loopback.

use std::sync::Arc;

use tokio::process::Command;
use tokio::sync::oneshot;
use zebu_engine::blockdev::MemDevice;
use zebu_engine::iscsi::{Chap, IscsiConfig, IscsiServer};

async fn start(ip: &str, chap: Option<Chap>) -> (String, oneshot::Sender<()>) {
    let mut cfg = IscsiConfig::new(format!("{ip}:0").parse().expect("addr"), "clivol");
    cfg.chap = chap;
    let server = IscsiServer::bind(cfg, Arc::new(MemDevice::new(32 << 20)))
        .await
        .expect("bind");
    let portal = server.local_addr().to_string();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server.serve(async {
        let _ = rx.await;
    }));
    (portal, tx)
}

async fn run(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{tool} must be installed (apt-get install libiscsi-bin): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test]
async fn libiscsi_tools_see_the_volume() {
    let (portal, _stop) = start("127.0.0.31", None).await;
    let url = format!("iscsi://{portal}/iqn.2025-01.io.zebu:clivol/1");
    let inq = run("iscsi-inq", &[&url]).await;
    assert!(inq.contains("Vendor:ZEBU"), "{inq}");
    assert!(
        inq.contains("Peripheral Device Type:DIRECT_ACCESS"),
        "{inq}"
    );
    let rc = run("iscsi-readcapacity16", &[&url]).await;
    assert!(rc.contains("LOGICAL BLOCK LENGTH IN BYTES:512"), "{rc}");
    assert!(
        rc.contains("LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT:3"),
        "{rc}"
    );
    assert!(rc.contains("LBPME:1 LBPRZ:1"), "{rc}");
    assert!(rc.contains(&format!("Total size:{}", 32u64 << 20)), "{rc}");
    let ls = run("iscsi-ls", &["-s", &format!("iscsi://{portal}")]).await;
    assert!(
        ls.contains(&format!(
            "Target:iqn.2025-01.io.zebu:clivol Portal:{portal},1"
        )),
        "{ls}"
    );
}

#[tokio::test]
async fn libiscsi_logs_in_with_chap() {
    let chap = Chap {
        user: "bob".into(),
        secret: "s3cret-s3cret".into(),
        mutual: None,
    };
    let (portal, _stop) = start("127.0.0.32", Some(chap)).await;
    let url = format!("iscsi://bob%s3cret-s3cret@{portal}/iqn.2025-01.io.zebu:clivol/1");
    let inq = run("iscsi-inq", &[&url]).await;
    assert!(inq.contains("Vendor:ZEBU"), "{inq}");
    let bad = Command::new("iscsi-inq")
        .arg(format!(
            "iscsi://bob%nope-nope-nope@{portal}/iqn.2025-01.io.zebu:clivol/1"
        ))
        .output()
        .await
        .expect("iscsi-inq runs");
    assert!(!bad.status.success(), "a wrong secret must not log in");
}
