//! Filesystem operations on layer files that the I/O back ends do not cover: finding data
//! extents (`SEEK_DATA`/`SEEK_HOLE`), punching holes, resizing.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

/// The data extents of `file` within `range` (bytes), rounded out to `block` boundaries.
/// Adjacent extents are merged.
pub fn data_extents(
    file: &File,
    range: Range<u64>,
    block: u64,
) -> std::io::Result<Vec<Range<u64>>> {
    let fd = file.as_raw_fd();
    let end = range.end.min(file.metadata()?.len());
    let mut out: Vec<Range<u64>> = Vec::new();
    let mut pos = range.start;
    while pos < end {
        let Some(data) = seek(fd, pos, libc::SEEK_DATA)? else {
            break;
        };
        if data >= end {
            break;
        }
        let hole = seek(fd, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        let s = data / block * block;
        let e = hole.div_ceil(block) * block;
        match out.last_mut() {
            Some(last) if last.end >= s => last.end = last.end.max(e),
            _ => out.push(s.max(range.start)..e.min(range.end)),
        }
        pos = hole.max(data + 1);
    }
    Ok(out)
}

/// `lseek`; `None` where there is no more data (ENXIO).
fn seek(fd: i32, pos: u64, whence: i32) -> std::io::Result<Option<u64>> {
    // SAFETY: lseek on a valid fd with plain integer arguments has no memory effects.
    let r = unsafe { libc::lseek(fd, pos as libc::off_t, whence) };
    if r >= 0 {
        return Ok(Some(r.cast_unsigned()));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(err)
    }
}

/// Deallocates `range` of `file`, keeping its size; the range reads as zeros afterwards.
pub fn punch_hole(file: &File, range: Range<u64>) -> std::io::Result<()> {
    if range.is_empty() {
        return Ok(());
    }
    // SAFETY: fallocate on a valid fd with plain integer arguments has no memory effects.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            range.start as libc::off_t,
            (range.end - range.start) as libc::off_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn finds_written_extents_and_punched_holes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .expect("open");
        f.set_len(64 << 20).expect("size");
        f.write_all_at(&[1u8; 8192], 1 << 20).expect("write");
        f.write_all_at(&[2u8; 4096], 8 << 20).expect("write");
        f.sync_all().expect("sync");
        let ext = data_extents(&f, 0..64 << 20, 4096).expect("extents");
        assert_eq!(
            ext,
            vec![(1 << 20)..(1 << 20) + 8192, (8 << 20)..(8 << 20) + 4096]
        );
        punch_hole(&f, (1 << 20)..(1 << 20) + 4096).expect("punch");
        let ext = data_extents(&f, 0..64 << 20, 4096).expect("extents");
        assert_eq!(
            ext,
            vec![
                (1 << 20) + 4096..(1 << 20) + 8192,
                (8 << 20)..(8 << 20) + 4096
            ]
        );
        let ext = data_extents(&f, (8 << 20) + 4096..64 << 20, 4096).expect("extents");
        assert!(ext.is_empty());
    }
}
