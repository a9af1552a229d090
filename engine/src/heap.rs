//! How the engine asks the C allocator to treat its large I/O buffers.
//!
//! A 1 MiB write reaches the engine as PDUs or NBD payloads and is gathered into a buffer of
//! its own, which lives until every replica has answered and is then freed. With glibc's
//! defaults such a buffer is a fresh `mmap` until the first one is freed, and afterwards it
//! comes from an arena whose top is given back to the kernel (`madvise`/`brk`) as soon as
//! 2 MiB of it are free: either way the next buffer is faulted in and zeroed again, page by
//! page. A profile of the engine under `qemu-img bench` 1 MiB sequential writes at queue
//! depth 8 (one replica) put a fifth of the engine's CPU in page faults, page clearing and
//! unmapping (`exc_page_fault`, `clear_page_erms`, `unmap_page_range`).
//!
//! [`keep_large_buffers`] fixes both thresholds instead: allocations up to 32 MiB (every
//! replica request: the replicator splits I/O into pieces of at most 8 MiB) come from the arenas, and an
//! arena keeps up to 64 MiB of freed memory at its top before trimming. The memory kept is
//! bounded by what the engine had in use at its peak, which its frontends already bound
//! (`iscsi::session::WRITE_BUDGET` and `OUT_BUDGET` per connection). Measured (benches/README.md,
//! "Ceilings, and large buffers that stay mapped"): 1 MiB writes at queue depth 8 +25–28 %,
//! the engine's peak RSS over those runs 35–39 MiB instead of 33–34.

/// Largest allocation served from an arena rather than its own `mmap` (glibc's maximum).
const MMAP_THRESHOLD: libc::c_int = 32 << 20;
/// Free memory an arena keeps at its top before giving it back to the kernel.
const TRIM_THRESHOLD: libc::c_int = 64 << 20;

/// Sets the allocator thresholds described in the module docs (process-wide: every thread's
/// arena follows them). Call once at start-up. Returns whether the allocator took both settings (a non-glibc libc
/// has no such knobs, and the engine works the same without them, only slower).
pub fn keep_large_buffers() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters, under glibc's own arena lock
        // (it is thread-safe), and both values are in the ranges glibc accepts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_both_thresholds() {
        assert!(super::keep_large_buffers());
    }
}
