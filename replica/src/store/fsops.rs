//! Filesystem operations on layer files that the I/O back ends do not cover: finding data
//! extents (`SEEK_DATA`/`SEEK_HOLE`), punching holes, resizing.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

/// The data extents of `file` within `range` (bytes), rounded out to `block` boundaries.
/// Adjacent extents are merged. Uses FIEMAP (hundreds of extents per system call) where the
/// filesystem has it, else `SEEK_DATA`/`SEEK_HOLE` (two calls per extent).
///
/// Unwritten (preallocated) extents count as holes: they read as zeros, and in a layer file
/// they are what an interrupted `O_DIRECT` write into a hole leaves, a write that was never
/// acknowledged, so the layers below it must show through.
pub fn data_extents(
    file: &File,
    range: Range<u64>,
    block: u64,
) -> std::io::Result<Vec<Range<u64>>> {
    match fiemap_extents(file, range.clone(), block) {
        Ok(v) => Ok(v),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => seek_extents(file, range, block),
        Err(e) => Err(e),
    }
}

/// Size and link count of an open file, from the descriptor.
#[derive(Debug, Clone, Copy)]
pub struct SizeLinks {
    pub len: u64,
    pub nlink: u64,
}

/// [`SizeLinks`] of `file`, by a `statx` that asks for nothing but those two.
///
/// Not `File::metadata`: that asks for the timestamps too, and since Linux 6.13 a query of a
/// file's ctime makes the next write stamp it with a fine-grained time, so every write after
/// a query dirties the inode. On ext4 without a journal an `fdatasync` then writes the inode
/// block as well, in series with the data: measured here, a 4 KiB write + `fdatasync` with an
/// `fstat` in between ran at 0.65 of the same loop without it. The replica stats its open
/// files before every flush (`health.rs`), so this is on the durable path.
pub fn size_links(file: &File) -> std::io::Result<SizeLinks> {
    // SAFETY: `struct statx` is plain integers, for which all zero bytes are a valid value.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx writes at most one `struct statx` into `st`, which is owned here and lives
    // past the call; the path is an empty C string, and AT_EMPTY_PATH makes the call use the
    // descriptor, which `file` keeps open.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_SYNC_AS_STAT,
            libc::STATX_SIZE | libc::STATX_NLINK,
            &mut st,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let want = libc::STATX_SIZE | libc::STATX_NLINK;
    if st.stx_mask & want != want {
        return Err(std::io::Error::other(
            "statx did not report the size and link count",
        ));
    }
    Ok(SizeLinks {
        len: st.stx_size,
        nlink: u64::from(st.stx_nlink),
    })
}

// The FIEMAP ioctl (linux/fiemap.h); the libc crate does not carry it.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// Extents asked for per call.
const FIEMAP_BATCH: usize = 512;
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the FIEMAP word layout assumes little-endian"
);
/// `struct fiemap` header and `struct fiemap_extent`, in u64 words.
const HEADER_WORDS: usize = 4;
const EXTENT_WORDS: usize = 7;

fn fiemap_extents(file: &File, range: Range<u64>, block: u64) -> std::io::Result<Vec<Range<u64>>> {
    let end = range.end.min(size_links(file)?.len);
    let mut out: Vec<Range<u64>> = Vec::new();
    let mut pos = range.start;
    // u64 words keep the buffer 8-byte aligned, as the kernel structures need.
    let mut buf = vec![0u64; HEADER_WORDS + FIEMAP_BATCH * EXTENT_WORDS];
    'outer: while pos < end {
        buf.fill(0);
        buf[0] = pos; // fm_start
        buf[1] = end - pos; // fm_length
        // word 2: fm_flags = 0, fm_mapped_extents (out); word 3: fm_extent_count
        buf[3] = FIEMAP_BATCH as u64;
        // SAFETY: `buf` is a writable, 8-byte aligned buffer of exactly the size a
        // `struct fiemap` with FIEMAP_BATCH extents needs; the kernel writes within it.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, buf.as_mut_ptr()) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mapped = (buf[2] >> 32) as usize;
        if mapped == 0 {
            break;
        }
        for i in 0..mapped.min(FIEMAP_BATCH) {
            let e = &buf[HEADER_WORDS + i * EXTENT_WORDS..HEADER_WORDS + (i + 1) * EXTENT_WORDS];
            let (logical, length) = (e[0], e[2]);
            let flags = e[5] as u32; // fe_flags: the low half of word 5 (little-endian)
            let (s, t) = (logical.max(range.start), (logical + length).min(end));
            if s < t && flags & FIEMAP_EXTENT_UNWRITTEN == 0 {
                push_merged(
                    &mut out,
                    s / block * block..t.div_ceil(block) * block,
                    &range,
                );
            }
            pos = logical + length;
            if flags & FIEMAP_EXTENT_LAST != 0 {
                break 'outer;
            }
        }
    }
    Ok(out)
}

fn push_merged(out: &mut Vec<Range<u64>>, r: Range<u64>, clip: &Range<u64>) {
    let r = r.start.max(clip.start)..r.end.min(clip.end);
    match out.last_mut() {
        Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
        _ => out.push(r),
    }
}

fn seek_extents(file: &File, range: Range<u64>, block: u64) -> std::io::Result<Vec<Range<u64>>> {
    let fd = file.as_raw_fd();
    let end = range.end.min(size_links(file)?.len);
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
        // Both implementations agree, also on a clipped range.
        for r in [
            0..64 << 20,
            (1 << 20) + 8192..(8 << 20) + 2048,
            4096..(1 << 20) + 6000,
        ] {
            assert_eq!(
                fiemap_extents(&f, r.clone(), 4096).expect("fiemap"),
                seek_extents(&f, r, 4096).expect("seek")
            );
        }
    }

    #[test]
    fn many_scattered_extents_are_all_found() {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .expect("open");
        f.set_len(1 << 30).expect("size");
        for i in 0..2000u64 {
            f.write_all_at(&[7u8; 4096], i * 65536 * 7 % (1 << 30) / 4096 * 4096)
                .expect("write");
        }
        f.sync_all().expect("sync");
        let a = fiemap_extents(&f, 0..1 << 30, 4096).expect("fiemap");
        assert_eq!(a, seek_extents(&f, 0..1 << 30, 4096).expect("seek"));
        assert_eq!(a.iter().map(|r| r.end - r.start).sum::<u64>(), 2000 * 4096);
    }

    #[test]
    fn size_links_follows_the_file_through_growth_truncation_and_unlink() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("layer");
        let f = File::create(&path).expect("create");
        f.set_len(1 << 20).expect("grow");
        let s = size_links(&f).expect("statx");
        assert_eq!((s.len, s.nlink), (1 << 20, 1));
        std::fs::hard_link(&path, dir.path().join("second name")).expect("link");
        assert_eq!(size_links(&f).expect("statx").nlink, 2);
        f.set_len(4096).expect("truncate");
        assert_eq!(size_links(&f).expect("statx").len, 4096);
        std::fs::remove_file(&path).expect("unlink");
        std::fs::remove_file(dir.path().join("second name")).expect("unlink");
        let s = size_links(&f).expect("statx of an unlinked file");
        assert_eq!((s.len, s.nlink), (4096, 0));
    }
}
