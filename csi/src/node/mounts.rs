//! Mounts, filesystems and sizes on the node: `/proc/self/mountinfo`, `mount`, `umount`,
//! `blkid`, `mkfs.*`, `resize2fs`/`xfs_growfs`, statvfs.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use crate::exec::{self, ExecError};

/// One line of mountinfo: what is mounted where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
    /// `major:minor` of the filesystem's device (for a bind mount, the original's).
    pub dev: String,
    /// The path inside the filesystem that is mounted (`/` unless a bind of a subtree).
    pub root: String,
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && let Ok(v) = std::str::from_utf8(&b[i + 1..i + 4])
                .map_err(|_| ())
                .and_then(|oct| u8::from_str_radix(oct, 8).map_err(|_| ()))
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse `/proc/self/mountinfo`'s text.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(MountEntry {
                dev: l.get(2)?.to_string(),
                root: unescape(l.get(3)?),
                mount_point: unescape(l.get(4)?),
                fs_type: r.first()?.to_string(),
                source: unescape(r.get(1)?),
            })
        })
        .collect()
}

pub fn mounts() -> std::io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// The last mount on `path` (what a lookup of the path sees), if any.
pub fn mounted_at(path: &Path) -> std::io::Result<Option<MountEntry>> {
    let p = path.to_string_lossy();
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == p))
}

pub async fn mount(
    source: &str,
    target: &Path,
    fs_type: Option<&str>,
    options: &[String],
) -> Result<(), ExecError> {
    let target = target.to_string_lossy().into_owned();
    let opts = options.join(",");
    let mut args: Vec<&str> = Vec::new();
    if let Some(t) = fs_type {
        args.extend(["-t", t]);
    }
    if !opts.is_empty() {
        args.extend(["-o", &opts]);
    }
    args.extend([source, &target]);
    exec::run("mount", &args).await.map(|_| ())
}

pub async fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), ExecError> {
    let s = source.to_string_lossy().into_owned();
    let t = target.to_string_lossy().into_owned();
    exec::run("mount", &["--bind", &s, &t]).await?;
    if read_only {
        // A bind mount takes ro only on a remount (the kernel ignores it on the bind).
        exec::run("mount", &["-o", "remount,bind,ro", &t]).await?;
    }
    Ok(())
}

/// Unmount every mount stacked on `path`; nothing mounted is fine.
pub async fn unmount_all(path: &Path) -> Result<(), ExecError> {
    let t = path.to_string_lossy().into_owned();
    for _ in 0..16 {
        match mounted_at(path) {
            Ok(Some(_)) => exec::run("umount", &[&t]).await.map(|_| ())?,
            Ok(None) => return Ok(()),
            Err(e) => {
                return Err(ExecError::Spawn {
                    command: "read /proc/self/mountinfo".into(),
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The filesystem on a device, `None` when it holds none (blank).
pub async fn probe_fs(device: &str) -> Result<Option<String>, ExecError> {
    match exec::run("blkid", &["-p", "-o", "value", "-s", "TYPE", device]).await {
        Ok(out) => {
            let t = out.trim();
            Ok((!t.is_empty()).then(|| t.to_string()))
        }
        // blkid: 2 = nothing found on the device.
        Err(e) if e.code() == Some(2) => Ok(None),
        Err(e) => Err(e),
    }
}

pub async fn mkfs(fs: &str, device: &str, params: &str) -> Result<(), ExecError> {
    let force = if fs == "xfs" { "-f" } else { "-F" };
    let program = format!("mkfs.{fs}");
    let mut args: Vec<&str> = vec![force];
    args.extend(params.split_whitespace());
    args.push(device);
    exec::run(&program, &args).await.map(|_| ())
}

/// Grow the filesystem mounted at `mount_point` from `device` to the device's size.
pub async fn grow_fs(fs: &str, device: &str, mount_point: &Path) -> Result<(), ExecError> {
    match fs {
        "xfs" => exec::run("xfs_growfs", &[&mount_point.to_string_lossy()])
            .await
            .map(|_| ()),
        _ => exec::run("resize2fs", &[device]).await.map(|_| ()),
    }
}

/// Bytes of a block device (or of the device a block-device file refers to).
pub fn block_size_bytes(path: &Path) -> std::io::Result<u64> {
    let meta = std::fs::metadata(path)?;
    if !meta.file_type().is_block_device() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a block device", path.display()),
        ));
    }
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let sectors = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/size"))?;
    sectors
        .trim()
        .parse::<u64>()
        .map(|s| s * 512)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
}

/// Bytes and inodes of the filesystem at `path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    pub total: u64,
    pub available: u64,
    pub used: u64,
    pub inodes: u64,
    pub inodes_free: u64,
    pub inodes_used: u64,
}

pub fn fs_stats(path: &Path) -> Result<FsStats, nix::Error> {
    let s = nix::sys::statvfs::statvfs(path)?;
    let frag = s.fragment_size();
    let total = s.blocks() * frag;
    let free = s.blocks_free() * frag;
    let available = s.blocks_available() * frag;
    Ok(FsStats {
        total,
        available,
        used: total.saturating_sub(free),
        inodes: s.files(),
        inodes_free: s.files_free(),
        inodes_used: s.files().saturating_sub(s.files_free()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_mount_points_with_spaces_unescaped() {
        let text = "36 35 98:0 /mnt1 /mnt/my\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    37 35 0:40 / /var/lib/x shared:2 - fuse.nbdfuse nbdfuse rw\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, "/mnt/my dir");
        assert_eq!(m[0].root, "/mnt1");
        assert_eq!(m[0].fs_type, "ext3");
        assert_eq!(m[0].source, "/dev/root");
        assert_eq!(m[0].dev, "98:0");
        assert_eq!(m[1].fs_type, "fuse.nbdfuse");
        assert!(parse_mountinfo("garbage\n").is_empty());
    }
}
