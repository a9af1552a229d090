//! A heap buffer aligned to [`IO_ALIGN`](super::IO_ALIGN), as `O_DIRECT` requires, and the
//! cache of freed buffers that makes allocating one cheap.
//!
//! Why a cache: the data path allocates one buffer per request (a write's aligned copy, a
//! read's destination, which then travels out as `Bytes`). A 1 MiB aligned allocation is
//! above glibc's mmap threshold or gets trimmed back to the kernel when freed, so every
//! request paid for fresh pages: measured through the store at 1 MiB, page faults and page
//! clearing were a third of the process's CPU and the store used ~950 µs of CPU per request
//! against fio's ~100 µs (benches/README.md, `replica_io`). Freed buffers of the sizes the
//! data path uses (powers of two from 4 KiB to [`MAX_CACHED`]) are therefore kept, up to
//! [`CACHE_LIMIT`] idle bytes in all, and handed out again.
//!
//! The cache is process-wide, like the allocator it sits in front of: a buffer is freed
//! wherever its last owner drops it (a gRPC task, a ring thread, a test), often far from the
//! `IoEngine` that used it. It holds only idle memory; what a caller gets does not depend on
//! it, except that a recycled buffer is not zeroed again unless the constructor says so:
//! [`AlignedBuf::zeroed`] and [`AlignedBuf::copy_from`] always clear what they do not fill;
//! only [`AlignedBuf::for_overwrite`] (read destinations, which a completed read overwrites
//! in full or zero-fills past end-of-file) may hold stale bytes of an earlier request.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use super::IO_ALIGN;

/// Largest allocation the cache keeps (the store's merge and rebuild chunk is 1 MiB; engines
/// write up to a few MiB at once).
pub const MAX_CACHED: usize = 4 << 20;
/// Idle bytes the cache may hold in all; enough for 32 requests of 1 MiB in flight.
pub const CACHE_LIMIT: usize = 32 << 20;
/// Size classes: `IO_ALIGN << k` for `k` in `0..CLASSES`.
const CLASSES: usize = (MAX_CACHED / IO_ALIGN).trailing_zeros() as usize + 1;

/// A zero-initialised (at allocation) byte buffer whose address and length are multiples of
/// [`IO_ALIGN`](super::IO_ALIGN).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    /// Bytes visible through `Deref`.
    len: usize,
    /// Bytes allocated (the size class for cached sizes); `len <= cap`.
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads of the owned bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, rounded up to a multiple of the alignment.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let (mut buf, recycled) = AlignedBuf::obtain(len);
        if recycled {
            buf.fill(0);
        }
        buf
    }

    /// A buffer holding a copy of `data`, zero-padded to the alignment.
    pub fn copy_from(data: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::for_overwrite(data.len());
        buf[..data.len()].copy_from_slice(data);
        buf[data.len()..].fill(0);
        buf
    }

    /// A buffer of `len` bytes (rounded up to the alignment) whose contents are unspecified:
    /// zeros, or the bytes of an earlier buffer of this process. Only for destinations that
    /// are overwritten in full before anyone reads them, such as the buffer of a read (which,
    /// when it succeeds, holds the file's bytes or zeros past end-of-file).
    pub fn for_overwrite(len: usize) -> AlignedBuf {
        AlignedBuf::obtain(len).0
    }

    /// A buffer of `len` bytes rounded up, and whether it came from the cache (and so may
    /// hold an earlier buffer's bytes) rather than from a fresh, zeroed allocation.
    fn obtain(len: usize) -> (AlignedBuf, bool) {
        let len = len.div_ceil(IO_ALIGN).max(1) * IO_ALIGN;
        let Some(class) = class_of(len) else {
            let ptr = allocate(len);
            return (AlignedBuf { ptr, len, cap: len }, false);
        };
        let cap = IO_ALIGN << class;
        match CACHE.take(class) {
            Some(ptr) => (AlignedBuf { ptr, len, cap }, true),
            None => (
                AlignedBuf {
                    ptr: allocate(cap),
                    len,
                    cap,
                },
                false,
            ),
        }
    }

    /// The buffer as `Bytes`, without a copy; the memory goes back to the cache when the last
    /// `Bytes` pointing into it drops. Whole, it can be written without a copy again
    /// ([`IoEngine::write_bytes_at`](super::IoEngine::write_bytes_at)): a transport that
    /// receives payloads into `AlignedBuf`s spares the replica a copy of every write.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// The cache class of an allocation of `len` bytes (a multiple of `IO_ALIGN`), or `None` when
/// it is too large to cache.
fn class_of(len: usize) -> Option<usize> {
    if len > MAX_CACHED {
        return None;
    }
    let pages = len.div_ceil(IO_ALIGN).next_power_of_two();
    Some(pages.trailing_zeros() as usize)
}

fn layout(cap: usize) -> Layout {
    Layout::from_size_align(cap, IO_ALIGN).expect("invariant: valid layout")
}

fn allocate(cap: usize) -> NonNull<u8> {
    let layout = layout(cap);
    // SAFETY: layout has a non-zero size (cap is at least IO_ALIGN).
    let ptr = unsafe { alloc_zeroed(layout) };
    NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
}

/// An idle allocation in the cache.
struct Idle(NonNull<u8>);

// SAFETY: an idle allocation is owned by the cache alone; nothing else points at it.
unsafe impl Send for Idle {}

/// Idle allocations per size class.
struct Cache {
    classes: [Mutex<Vec<Idle>>; CLASSES],
    idle_bytes: AtomicUsize,
}

static CACHE: Cache = Cache {
    classes: [const { Mutex::new(Vec::new()) }; CLASSES],
    idle_bytes: AtomicUsize::new(0),
};

impl Cache {
    fn lock(&self, class: usize) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // A panic while holding the lock cannot leave the Vec inconsistent (push/pop only).
        self.classes[class]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take(&self, class: usize) -> Option<NonNull<u8>> {
        let Idle(ptr) = self.lock(class).pop()?;
        self.idle_bytes
            .fetch_sub(IO_ALIGN << class, Ordering::Relaxed);
        Some(ptr)
    }

    /// Keeps the allocation if the cache has room; gives it back otherwise.
    fn put(&self, class: usize, ptr: NonNull<u8>) -> Result<(), NonNull<u8>> {
        let cap = IO_ALIGN << class;
        if self.idle_bytes.fetch_add(cap, Ordering::Relaxed) + cap > CACHE_LIMIT {
            self.idle_bytes.fetch_sub(cap, Ordering::Relaxed);
            return Err(ptr);
        }
        self.lock(class).push(Idle(ptr));
        Ok(())
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to cap >= len initialised bytes owned by self (zeroed when
        // allocated, and only ever written with initialised bytes since).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr points to cap >= len initialised bytes owned exclusively by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(class) = class_of(self.cap)
            && (IO_ALIGN << class) == self.cap
            && CACHE.put(class, self.ptr).is_ok()
        {
            return;
        }
        // SAFETY: allocated in `allocate` with exactly this layout, and not cached.
        unsafe { dealloc(self.ptr.as_ptr(), layout(self.cap)) };
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycled_buffers_are_cleared_by_zeroed_and_copy_from() {
        // Dirty a buffer of a cached class, free it, and ask for the same class again many
        // times: whatever the cache hands out, these constructors must not show old bytes.
        for round in 0..8 {
            let mut dirty = AlignedBuf::for_overwrite(3 * IO_ALIGN);
            dirty.fill(0xA5);
            drop(dirty);
            let z = AlignedBuf::zeroed(3 * IO_ALIGN);
            assert_eq!(z.len(), 3 * IO_ALIGN);
            assert!(
                z.iter().all(|&b| b == 0),
                "round {round}: zeroed shows old bytes"
            );
            drop(z);
            let mut dirty = AlignedBuf::for_overwrite(4 * IO_ALIGN);
            dirty.fill(0x5A);
            drop(dirty);
            let c = AlignedBuf::copy_from(&[7u8; 5000]);
            assert_eq!(c.len(), 2 * IO_ALIGN);
            assert!(c[..5000].iter().all(|&b| b == 7));
            assert!(
                c[5000..].iter().all(|&b| b == 0),
                "round {round}: padding not zero"
            );
        }
    }

    #[test]
    fn lengths_round_up_and_addresses_are_aligned() {
        for len in [
            0,
            1,
            4095,
            4096,
            4097,
            12288,
            1 << 20,
            MAX_CACHED + 1,
            9 << 20,
        ] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(
                b.len(),
                len.div_ceil(IO_ALIGN).max(1) * IO_ALIGN,
                "len {len}"
            );
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0, "len {len}");
            assert!(b.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn size_classes_cover_their_lengths() {
        assert_eq!(class_of(IO_ALIGN), Some(0));
        assert_eq!(class_of(2 * IO_ALIGN), Some(1));
        assert_eq!(class_of(3 * IO_ALIGN), Some(2));
        assert_eq!(class_of(1 << 20), Some(8));
        assert_eq!(class_of(MAX_CACHED), Some(CLASSES - 1));
        assert_eq!(class_of(MAX_CACHED + IO_ALIGN), None);
    }

    #[test]
    fn idle_bytes_stay_under_the_limit() {
        let many: Vec<_> = (0..(CACHE_LIMIT / MAX_CACHED) + 4)
            .map(|_| AlignedBuf::zeroed(MAX_CACHED))
            .collect();
        drop(many);
        assert!(CACHE.idle_bytes.load(Ordering::Relaxed) <= CACHE_LIMIT);
    }
}
