//! Getting a block device for a volume on this node, and giving it back.
//!
//! Two ways, chosen per node with `--attach` and named in the publish context by the
//! controller (`frontend`), never guessed:
//!
//! - **iSCSI** (`iscsi`): the engine serves an iSCSI target; `iscsiadm` discovers it at the
//!   portal, logs in, and the kernel initiator makes a SCSI disk. The disk is found through
//!   sysfs (the session whose target name is the volume's IQN, its LUN's block device), so
//!   it works with or without udev's `/dev/disk/by-path` links. A disk that multipathd has
//!   claimed (a `dm` holder whose uuid starts with `mpath-`) is refused: mounting the raw
//!   path under a multipath map corrupts data, and this is the failure users hit most.
//! - **nbdfuse** (`nbd`): for hosts whose kernel has no iSCSI initiator but has FUSE (CI
//!   machines). The engine serves NBD; `nbdfuse` exposes the export as a file on a FUSE
//!   mount under the plugin's state directory, and `losetup --direct-io=on` turns the file
//!   into a loop device. Direct I/O is checked: a loop device that caches would acknowledge
//!   writes the engine never saw.
//!
//! Both are idempotent: attaching what is attached finds the same device; detaching what is
//! gone succeeds.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::exec::{self, ExecError};
use crate::node::mounts;

/// How this node attaches volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// The kernel's iSCSI initiator, through `iscsiadm`.
    Iscsi,
    /// `nbdfuse` and a direct-I/O loop device.
    Nbdfuse,
}

impl AttachMode {
    /// The publish context's `frontend` value for this mode.
    pub fn frontend(self) -> &'static str {
        match self {
            AttachMode::Iscsi => "iscsi",
            AttachMode::Nbdfuse => "nbd",
        }
    }
}

/// Publish context keys (what ControllerPublish answers and NodeStage reads).
pub const CTX_FRONTEND: &str = "frontend";
pub const CTX_PORTAL: &str = "portal";
pub const CTX_IQN: &str = "iqn";
pub const CTX_LUN: &str = "lun";
pub const CTX_NBD_URI: &str = "nbdUri";

/// How long a device may take to appear after the login / the FUSE mount.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(20);

/// Where a volume's device came from, kept in the node's state so that unstage (even after
/// a restart of the plugin) gives back exactly that.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "frontend")]
pub enum Attachment {
    #[serde(rename = "iscsi")]
    Iscsi {
        portal: String,
        iqn: String,
        lun: u32,
        device: String,
    },
    #[serde(rename = "nbd")]
    Nbd {
        uri: String,
        fuse_dir: PathBuf,
        file: PathBuf,
        device: String,
    },
}

impl Attachment {
    pub fn device(&self) -> &str {
        match self {
            Attachment::Iscsi { device, .. } | Attachment::Nbd { device, .. } => device,
        }
    }
}

/// Why a device could not be had or given back.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("volume {volume}: {source}")]
    Tool {
        volume: String,
        #[source]
        source: ExecError,
    },
    /// The publish context does not say how to attach, or says what this node cannot do.
    #[error("volume {volume}: {message}")]
    Context { volume: String, message: String },
    #[error(
        "volume {volume}: device {device} is claimed by multipathd ({holder}, {uuid}); Zebu volumes must not be multipathed: blacklist them in /etc/multipath.conf (blacklist {{ device {{ vendor \"ZEBU\" }} }}) and flush the map (multipath -f {holder})"
    )]
    Multipath {
        volume: String,
        device: String,
        holder: String,
        uuid: String,
    },
    #[error("volume {volume}: {message}")]
    Device { volume: String, message: String },
}

fn tool(volume: &str) -> impl FnOnce(ExecError) -> AttachError {
    let volume = volume.to_string();
    move |source| AttachError::Tool { volume, source }
}

/// Attach `volume` as the publish context says; this node's `mode` must match it.
pub async fn attach(
    volume: &str,
    mode: AttachMode,
    ctx: &std::collections::HashMap<String, String>,
    state_dir: &Path,
) -> Result<Attachment, AttachError> {
    let bad = |message: String| AttachError::Context {
        volume: volume.to_string(),
        message,
    };
    let frontend = ctx.get(CTX_FRONTEND).map(String::as_str).ok_or_else(|| {
        bad(format!(
            "the publish context has no {CTX_FRONTEND:?} (was the volume published by zebu-csi's controller?)"
        ))
    })?;
    if frontend != mode.frontend() {
        return Err(bad(format!(
            "published with the {frontend} frontend, but this node attaches with --attach {} (frontend {}); run the controller and the nodes with the same --attach",
            match mode {
                AttachMode::Iscsi => "iscsi",
                AttachMode::Nbdfuse => "nbdfuse",
            },
            mode.frontend()
        )));
    }
    let get = |k: &str| {
        ctx.get(k)
            .cloned()
            .ok_or_else(|| bad(format!("the publish context has no {k:?}")))
    };
    match mode {
        AttachMode::Iscsi => {
            let portal = get(CTX_PORTAL)?;
            let iqn = get(CTX_IQN)?;
            let lun: u32 = get(CTX_LUN)?
                .parse()
                .map_err(|_| bad(format!("the publish context's {CTX_LUN:?} is not a number")))?;
            let device = iscsi_login(volume, &portal, &iqn, lun).await?;
            Ok(Attachment::Iscsi {
                portal,
                iqn,
                lun,
                device,
            })
        }
        AttachMode::Nbdfuse => {
            let uri = get(CTX_NBD_URI)?;
            let fuse_dir = state_dir.join("fuse").join(volume);
            let file = fuse_dir.join("disk");
            let device = nbdfuse_attach(volume, &uri, &fuse_dir, &file, state_dir).await?;
            Ok(Attachment::Nbd {
                uri,
                fuse_dir,
                file,
                device,
            })
        }
    }
}

/// Give the device back; gone already is fine.
pub async fn detach(volume: &str, a: &Attachment) -> Result<(), AttachError> {
    match a {
        Attachment::Iscsi { portal, iqn, .. } => {
            match exec::run(
                "iscsiadm",
                &["-m", "node", "-T", iqn, "-p", portal, "--logout"],
            )
            .await
            {
                Ok(_) => {}
                // 21: no session (logged out already); 2: no such node record.
                Err(e) if matches!(e.code(), Some(21) | Some(2)) => {}
                Err(e) => return Err(tool(volume)(e)),
            }
            // The record would make iscsid log in again at its next start.
            let _ = exec::run(
                "iscsiadm",
                &["-m", "node", "-T", iqn, "-p", portal, "-o", "delete"],
            )
            .await;
            Ok(())
        }
        Attachment::Nbd { fuse_dir, file, .. } => {
            for dev in loops_of(file).await.map_err(tool(volume))? {
                exec::run("losetup", &["-d", &dev])
                    .await
                    .map_err(tool(volume))?;
            }
            // Unmounting the FUSE mount ends nbdfuse's session; nbdfuse then exits.
            mounts::unmount_all(fuse_dir).await.map_err(tool(volume))?;
            let _ = std::fs::remove_dir(fuse_dir);
            Ok(())
        }
    }
}

// ---------------------------------------------------------------- iSCSI

async fn iscsi_login(
    volume: &str,
    portal: &str,
    iqn: &str,
    lun: u32,
) -> Result<String, AttachError> {
    if let Some(dev) = iscsi_device(iqn, lun) {
        check_multipath(volume, &dev)?;
        return Ok(dev);
    }
    exec::run_for(
        "iscsiadm",
        &["-m", "discovery", "-t", "sendtargets", "-p", portal],
        Duration::from_secs(30),
    )
    .await
    .map_err(tool(volume))?;
    match exec::run_for(
        "iscsiadm",
        &["-m", "node", "-T", iqn, "-p", portal, "--login"],
        Duration::from_secs(30),
    )
    .await
    {
        Ok(_) => {}
        // 15: a session exists already.
        Err(e) if e.code() == Some(15) => {}
        Err(e) => return Err(tool(volume)(e)),
    }
    let deadline = tokio::time::Instant::now() + DEVICE_TIMEOUT;
    loop {
        if let Some(dev) = iscsi_device(iqn, lun) {
            check_multipath(volume, &dev)?;
            return Ok(dev);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(AttachError::Device {
                volume: volume.to_string(),
                message: format!(
                    "logged in to {iqn} at {portal}, but no disk for LUN {lun} appeared within {} s",
                    DEVICE_TIMEOUT.as_secs()
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/dev/sdX` of LUN `lun` of the session logged in to `iqn`, from sysfs.
fn iscsi_device(iqn: &str, lun: u32) -> Option<String> {
    let sessions = std::fs::read_dir("/sys/class/iscsi_session").ok()?;
    for s in sessions.flatten() {
        let name = std::fs::read_to_string(s.path().join("targetname")).ok()?;
        if name.trim() != iqn {
            continue;
        }
        let dev_dir = s.path().join("device");
        for t in std::fs::read_dir(&dev_dir).ok()?.flatten() {
            if !t.file_name().to_string_lossy().starts_with("target") {
                continue;
            }
            for l in std::fs::read_dir(t.path()).ok()?.flatten() {
                let hctl = l.file_name().to_string_lossy().into_owned();
                if hctl.rsplit(':').next() != Some(&lun.to_string()) {
                    continue;
                }
                if let Some(b) = std::fs::read_dir(l.path().join("block"))
                    .ok()
                    .and_then(|mut d| d.next())
                    .and_then(Result::ok)
                {
                    let dev = format!("/dev/{}", b.file_name().to_string_lossy());
                    if Path::new(&dev).exists() {
                        return Some(dev);
                    }
                }
            }
        }
    }
    None
}

/// Refuse a disk that a multipath map holds.
fn check_multipath(volume: &str, device: &str) -> Result<(), AttachError> {
    let name = device.trim_start_matches("/dev/");
    let Ok(holders) = std::fs::read_dir(format!("/sys/block/{name}/holders")) else {
        return Ok(());
    };
    for h in holders.flatten() {
        let holder = h.file_name().to_string_lossy().into_owned();
        let uuid =
            std::fs::read_to_string(format!("/sys/block/{holder}/dm/uuid")).unwrap_or_default();
        let uuid = uuid.trim().to_string();
        if uuid.starts_with("mpath-") {
            return Err(AttachError::Multipath {
                volume: volume.to_string(),
                device: device.to_string(),
                holder,
                uuid,
            });
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- nbdfuse

/// Loop devices backed by `file`.
async fn loops_of(file: &Path) -> Result<Vec<String>, ExecError> {
    if !file.exists() {
        return Ok(vec![]);
    }
    let out = exec::run(
        "losetup",
        &["-j", &file.to_string_lossy(), "-O", "NAME", "-n"],
    )
    .await?;
    Ok(out
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("/dev/"))
        .map(str::to_string)
        .collect())
}

async fn nbdfuse_attach(
    volume: &str,
    uri: &str,
    fuse_dir: &Path,
    file: &Path,
    state_dir: &Path,
) -> Result<String, AttachError> {
    let device_err = |message: String| AttachError::Device {
        volume: volume.to_string(),
        message,
    };
    let fuse_up = mounts::mounted_at(fuse_dir)
        .map_err(|e| device_err(format!("reading mountinfo: {e}")))?
        .is_some_and(|m| m.fs_type.starts_with("fuse"))
        && file.exists();
    if !fuse_up {
        // A FUSE mount whose nbdfuse died leaves an unusable mount point behind.
        mounts::unmount_all(fuse_dir).await.map_err(tool(volume))?;
        std::fs::create_dir_all(fuse_dir)
            .map_err(|e| device_err(format!("creating {}: {e}", fuse_dir.display())))?;
        let log_path = state_dir.join("fuse").join(format!("{volume}.log"));
        let log = std::fs::File::create(&log_path)
            .map_err(|e| device_err(format!("creating {}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| device_err(format!("{}: {e}", log_path.display())))?;
        // Its own process group: a signal to the plugin's group (Ctrl-C, a restart) must not
        // take the mount away from a filesystem that uses it. The runtime reaps it when it
        // exits after the unmount.
        let mut child = tokio::process::Command::new("nbdfuse")
            .arg(file)
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(|e| device_err(format!("cannot run nbdfuse: {e}")))?;
        let deadline = tokio::time::Instant::now() + DEVICE_TIMEOUT;
        loop {
            let up = mounts::mounted_at(fuse_dir)
                .map_err(|e| device_err(format!("reading mountinfo: {e}")))?
                .is_some()
                && file.exists();
            if up {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                let said = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(device_err(format!(
                    "nbdfuse {uri} exited ({status}) before exposing the export: {}",
                    said.trim()
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.start_kill();
                return Err(device_err(format!(
                    "nbdfuse did not expose {uri} within {} s",
                    DEVICE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Reaped by the runtime when it exits; it must outlive this call.
        drop(child);
    }
    let device = match loops_of(file)
        .await
        .map_err(tool(volume))?
        .into_iter()
        .next()
    {
        Some(d) => d,
        None => exec::run(
            "losetup",
            &[
                "--find",
                "--show",
                "--direct-io=on",
                &file.to_string_lossy(),
            ],
        )
        .await
        .map_err(tool(volume))?
        .trim()
        .to_string(),
    };
    let name = device.trim_start_matches("/dev/");
    let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
    if dio.trim() != "1" {
        let _ = exec::run("losetup", &["-d", &device]).await;
        return Err(device_err(format!(
            "{device} over {} has direct I/O off: it would cache writes the engine never saw",
            file.display()
        )));
    }
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attachments_round_trip_through_the_state_file_format() {
        let a = Attachment::Nbd {
            uri: "nbd://127.0.0.11:1234/v".into(),
            fuse_dir: "/s/fuse/v".into(),
            file: "/s/fuse/v/disk".into(),
            device: "/dev/loop3".into(),
        };
        let json = serde_json::to_string(&a).expect("json");
        assert!(json.contains("\"frontend\":\"nbd\""), "{json}");
        assert_eq!(serde_json::from_str::<Attachment>(&json).expect("back"), a);
    }

    #[tokio::test]
    async fn a_publish_context_for_another_frontend_is_refused_with_what_to_do() {
        let ctx = [
            (CTX_FRONTEND.to_string(), "iscsi".to_string()),
            (CTX_PORTAL.to_string(), "127.0.0.1:3260".to_string()),
        ]
        .into_iter()
        .collect();
        let e = attach("v", AttachMode::Nbdfuse, &ctx, Path::new("/nonexistent"))
            .await
            .expect_err("mismatch");
        assert!(e.to_string().contains("--attach nbdfuse"), "{e}");
        let e = attach("v", AttachMode::Iscsi, &Default::default(), Path::new("/x"))
            .await
            .expect_err("empty");
        assert!(e.to_string().contains("no \"frontend\""), "{e}");
    }
}
