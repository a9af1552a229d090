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
//! [`keep_large_buffers`] sets three parameters instead:
//! - allocations up to 32 MiB come from the arena (every replica request does: the replicator
//!   splits I/O into pieces of at most 8 MiB);
//! - the arena keeps up to 64 MiB of freed memory at its top before trimming, so a steady
//!   stream of large writes reuses the same pages;
//! - one arena for the whole process. glibc gives threads arenas of their own, and
//!   `malloc_trim` cannot shrink the top of those, only of the main one: with one arena per
//!   worker thread an idle engine kept 29 MiB it could not give back (measured). Small
//!   allocations still come from each thread's cache without the arena lock.
//!
//! The memory kept is bounded by what the engine had in use at its peak, which its frontends
//! bound (`iscsi::session::WRITE_BUDGET` and `OUT_BUDGET` per connection), and
//! [`trim_when_idle`] gives it back: once the volume has started no request for a whole
//! [`IDLE_TRIM_AFTER`], `malloc_trim` returns the free memory to the kernel, once per idle
//! spell. A node runs one engine per volume, so an idle engine must be small.
//!
//! Measured (benches/README.md, "Ceilings, and large buffers that stay mapped"): 1 MiB writes
//! at queue depth 8 over iSCSI +24–47 %, 4 KiB rows unchanged within noise; over a burst of
//! 1 MiB writes the engine's peak RSS was 24 MiB (32 MiB before), and five seconds after it
//! 9.1 MiB (9.5 MiB before, when glibc's defaults trimmed as it went).

use std::time::Duration;

/// How long the volume must have started no request before free memory is given back.
pub const IDLE_TRIM_AFTER: Duration = Duration::from_secs(2);

/// Largest allocation served from an arena rather than its own `mmap` (glibc's maximum).
const MMAP_THRESHOLD: libc::c_int = 32 << 20;
/// Free memory an arena keeps at its top before giving it back to the kernel.
const TRIM_THRESHOLD: libc::c_int = 64 << 20;
/// Arenas for the whole process (see the module docs).
const ARENA_MAX: libc::c_int = 1;

/// Sets the allocator parameters described in the module docs. Call once at start-up, before
/// other threads exist: a thread that already has an arena of its own keeps it (the two
/// thresholds bind every arena at once).
/// Returns whether the allocator took all three (a non-glibc libc has no such knobs, and the
/// engine works the same without them, only slower).
pub fn keep_large_buffers() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters, under glibc's own arena lock
        // (it is thread-safe), and every value is in the range glibc accepts.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Decides when to trim, from a count of requests started that only grows: once per idle
/// spell, after a tick that saw no new request.
#[derive(Debug, Default)]
pub struct IdleTrim {
    last: u64,
    trimmed: bool,
}

impl IdleTrim {
    /// Called every [`IDLE_TRIM_AFTER`] with the current count; true when it is time to trim.
    pub fn tick(&mut self, count: u64) -> bool {
        if count != self.last {
            self.last = count;
            self.trimmed = false;
            return false;
        }
        !std::mem::replace(&mut self.trimmed, true)
    }
}

/// Runs forever: every [`IDLE_TRIM_AFTER`], reads `requests` (a count of requests started)
/// and, when none started since the last look, trims the heap (module docs). The trim walks
/// the arena under its lock, so it runs on the blocking pool, not on a runtime worker.
pub async fn trim_when_idle(requests: impl Fn() -> u64) {
    let mut state = IdleTrim::default();
    let mut every = tokio::time::interval(IDLE_TRIM_AFTER);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if state.tick(requests()) {
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

/// Gives the arena's free memory back to the kernel.
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory, under glibc's own arena locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::IdleTrim;

    #[test]
    fn trims_once_per_idle_spell_and_again_after_new_requests() {
        let mut t = IdleTrim::default();
        // Requests keep starting: no trim.
        assert!(!t.tick(5));
        assert!(!t.tick(9));
        // A tick with no new request trims, once.
        assert!(t.tick(9));
        assert!(!t.tick(9));
        assert!(!t.tick(9));
        // Busy again, then idle again: one more trim.
        assert!(!t.tick(10));
        assert!(t.tick(10));
        assert!(!t.tick(10));
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_every_setting() {
        assert!(super::keep_large_buffers());
    }
}
