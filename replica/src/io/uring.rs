//! The io_uring back end: a few rings, each owned by one thread that does all its submission
//! and reaping; requests are spread over the rings round-robin.
//!
//! ```text
//!  async callers ──mpsc──▶ ┌──────────── zebu-uring-N thread ───────────┐
//!   (oneshot each)         │ accept: drain channel into the backlog     │
//!        ▲                 │ fill:   backlog → free slots → SQEs        │
//!        │  eventfd write  │ wait:   io_uring_enter(submit, wait ≥ 1)   │
//!        └─ wake ─────────▶│ reap:   CQEs → finish, or resubmit the rest│
//!                          └────────────────────────────────────────────┘
//! ```
//!
//! Why a dedicated thread per ring rather than a ring per tokio worker: one owner means the
//! ring needs no locking, every SQE and the memory it points at are owned by the same code,
//! and batching falls out naturally — everything that arrived since the last wait is
//! submitted with one `io_uring_enter`.
//!
//! Why several rings (`IoConfig::uring_rings`: one per CPU, at most 4) rather than one: every request
//! crosses the ring thread twice (wake to submit, then reap and reply), so with one ring that
//! thread is a single point every request waits on. On a loaded machine (measured: 2 cores,
//! load average ~9) the ring thread used only ~13% of a CPU yet spent its time waiting to be
//! scheduled, and all 32 requests in flight stalled with it; the 8-thread pool lost only one
//! request per descheduled thread. Through the store, one ring was 0.55–0.9× the pool; four
//! rings were 1.0–1.3× (random I/O) in the same runs (benches/README.md, `replica_io`).
//! Requests in flight together are unordered anyway, so any ring may serve any request.
//! But not more rings than CPUs: each ring thread is woken for every batch it carries, so
//! on 2 cores 4 rings cost 2–3× the CPU per 4 KiB request of 2 rings (context switches were
//! a third of the profile) with no more IOPS.
//!
//! Not used (yet): `SINGLE_ISSUER` + `DEFER_TASKRUN` (6.1), which fit this design (the ring
//! thread is the only task that submits and reaps; the ring is already set up on that thread,
//! as `SINGLE_ISSUER` needs). They were tried, but their effect was not measured apart from
//! the other changes, and the kill -9 tests showed a failure that then turned out to happen
//! without them too; left for a measured change of its own.
//!
//! Allocating writes (the store writes into sparse layer files): ext4 cannot do an
//! `O_DIRECT` write that allocates without blocking, so io_uring's non-blocking attempt
//! fails and the write is punted to the io-wq workers of the ring's thread (measured with the
//! `io_uring:io_uring_queue_async_work` tracepoint: ~70% of 4 KiB random writes into a sparse
//! file). On this kernel those punts are *not* hashed per inode (ext4 allows parallel direct
//! writes), so they run in parallel, up to io-wq's bound-worker limit of each ring's thread;
//! more rings means more workers. `IOSQE_ASYNC` would punt overwrites too, which today
//! complete inline, so it is not used. The thread pool is far worse here: a blocking
//! allocating `pwrite` holds the inode lock exclusively until the I/O completes, which
//! serialises the pool (measured at the io level on a sparse file: pool 11–12k IOPS,
//! one ring 32k, four rings 47k, fio 56k).
//!
//! Waking: the thread keeps a read of an eventfd in the ring at all times, so it sleeps in a
//! single `io_uring_enter` waiting for either an I/O completion or a new request. Senders write
//! the eventfd only when no wake is already pending (`Waker::pending`), so a burst of requests
//! costs one `write` rather than one per request.
//!
//! Memory safety (the part that must be airtight): an SQE carries raw pointers to a buffer and
//! a raw fd. Each request's buffer ([`AlignedBuf`](super::AlignedBuf), or the `Bytes` of a
//! shared write) and `Arc<DataFile>` are moved into a slot of
//! [`Slots`] *before* its SQE is built, and stay there, untouched, until the kernel posts the
//! CQE for it; only then is the slot emptied. The buffer's heap memory does not move when the
//! `AlignedBuf` (or `Bytes`) value moves, and no Rust mutable reference to it exists while the kernel may access
//! it. A cancelled caller future only drops its oneshot receiver; the slot is unaffected. If
//! the thread ever unwinds with operations in flight, [`Slots`] leaks them instead of freeing
//! memory the kernel may still write. Capacity: at most `sq_entries - 1` operations are in
//! slots (one SQE is kept for the eventfd read), so the SQ never overflows and, with the CQ
//! twice the SQ, the CQ never does either; anything beyond waits in the backlog.
//!
//! Shutdown: when the last [`IoEngine`](super::IoEngine) clone drops, the channel closes and
//! the eventfd is signalled. The thread serves everything already queued, waits for every
//! in-flight operation (including its own eventfd read) to complete, and exits; the drop joins
//! it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{IoUring, Probe, opcode, squeue, types};
use tokio::sync::oneshot;

use super::DataFile;
use super::request::{Memory, Reply, Request, Step, Transfer, Work, cqe_result};

/// `user_data` of the eventfd read; slot indices are far below it.
const WAKE_TOKEN: u64 = u64::MAX;

/// Checks that this kernel lets us set up a ring, run a NOP, and use the opcodes we need.
pub(super) fn probe() -> io::Result<()> {
    let mut ring = IoUring::new(2)?;
    let mut supported = Probe::new();
    // IORING_REGISTER_PROBE arrived in 5.6 together with IORING_OP_READ/WRITE, so a kernel
    // that refuses it is too old for this back end anyway.
    ring.submitter().register_probe(&mut supported)?;
    for (name, code) in [
        ("READ", opcode::Read::CODE),
        ("WRITE", opcode::Write::CODE),
        ("FSYNC", opcode::Fsync::CODE),
    ] {
        if !supported.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring lacks IORING_OP_{name}"),
            ));
        }
    }
    let nop = opcode::Nop::new().build().user_data(1);
    // SAFETY: a NOP carries no pointers or descriptors.
    unsafe { ring.submission().push(&nop) }
        .map_err(|_| io::Error::other("a fresh ring has no free SQE"))?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("NOP did not complete"))?;
    cqe_result(cqe.result()).map(|_| ())
}

/// The io_uring back end: several rings, each with its own thread; requests are spread over
/// them round-robin. Dropping it shuts every thread down and joins it.
pub(super) struct UringBackend {
    rings: Vec<RingThread>,
    next: AtomicUsize,
}

impl UringBackend {
    /// Sets up `rings` rings of `entries` SQEs each and starts their threads. Errors from ring
    /// setup are returned here, not later (rings already started are shut down).
    pub(super) fn start(entries: u32, rings: usize, max_chunk: usize) -> io::Result<UringBackend> {
        let rings = (0..rings.max(1))
            .map(|i| RingThread::start(i, entries, max_chunk))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(UringBackend {
            rings,
            next: AtomicUsize::new(0),
        })
    }

    /// Queues `req` on the next ring. Requests in flight at the same time are unordered
    /// anyway, so which ring serves which request does not matter for correctness; a sync
    /// covers every write its caller has seen complete, whichever ring ran it.
    pub(super) fn submit(&self, req: Request) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len();
        self.rings[i].submit(req);
    }
}

/// Handle to one ring thread; dropping it shuts the thread down and joins it.
struct RingThread {
    /// `None` only while dropping.
    tx: Option<mpsc::Sender<Request>>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl RingThread {
    fn start(index: usize, entries: u32, max_chunk: usize) -> io::Result<RingThread> {
        let waker = Arc::new(Waker::new()?);
        let (tx, rx) = mpsc::channel();
        // The ring is set up on the thread that will own it: flags that bind a ring to its
        // creating task (SINGLE_ISSUER) need that, and setup errors still reach the caller.
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_waker = waker.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zebu-uring-{index}"))
            .spawn(move || {
                let ring = match IoUring::builder().setup_clamp().build(entries.max(2)) {
                    Ok(ring) => ring,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let sq = ring.params().sq_entries() as usize;
                let cq = ring.params().cq_entries() as usize;
                let capacity = sq.min(cq) - 1;
                let reactor = Reactor {
                    ring,
                    rx,
                    waker: thread_waker,
                    slots: Slots::with_capacity(capacity),
                    backlog: VecDeque::new(),
                    completed: Vec::with_capacity(cq),
                    wake: WakeRead {
                        buf: Box::new(0),
                        armed: false,
                    },
                    closing: false,
                    shutdown_signalled: false,
                    max_chunk,
                };
                tracing::debug!(index, sq, cq, capacity, "io_uring ring started");
                let _ = ready_tx.send(Ok(()));
                reactor.run();
            })?;
        let handle = RingThread {
            tx: Some(tx),
            waker,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(handle),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::other("the io_uring thread exited during setup")),
        }
    }

    /// Queues `req` and wakes the thread. If the thread is gone, the request (and its reply
    /// sender) is dropped, which the caller sees as a closed reply channel.
    fn submit(&self, req: Request) {
        if let Some(tx) = &self.tx
            && tx.send(req).is_ok()
        {
            self.waker.wake();
        }
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        self.tx = None;
        // Unconditional: `pending` may be set by a wake the thread has already consumed.
        self.waker.signal();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the io_uring thread panicked");
        }
    }
}

/// The eventfd that wakes the ring thread, and whether a wake is already on its way.
struct Waker {
    fd: File,
    /// Set by the first sender after the thread last consumed a wake; cleared (with acquire,
    /// so the thread then sees every request sent before the set) when the thread consumes it.
    pending: AtomicBool,
}

impl Waker {
    fn new() -> io::Result<Waker> {
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Waker {
            fd,
            pending: AtomicBool::new(false),
        })
    }

    /// Called after sending a request.
    fn wake(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            self.signal();
        }
    }

    fn signal(&self) {
        // An eventfd write of 8 bytes is all-or-nothing; it can only fail with EAGAIN when the
        // counter is near u64::MAX, which one increment per wake never reaches.
        if let Err(e) = (&self.fd).write_all(&1u64.to_ne_bytes()) {
            tracing::error!(error = %e, "cannot wake the io_uring thread");
        }
    }
}

/// An operation between "accepted" and "replied".
enum Job {
    Transfer {
        t: Transfer,
        reply: Reply,
    },
    Sync {
        file: Arc<DataFile>,
        reply: oneshot::Sender<io::Result<()>>,
    },
}

impl Job {
    fn new(req: Request, max_chunk: usize) -> Job {
        match req.into_work(max_chunk) {
            Work::Transfer(t, reply) => Job::Transfer { t, reply },
            Work::Sync(file, reply) => Job::Sync { file, reply },
        }
    }

    /// The SQE for this job's next step. Must only be called on a job already in its slot,
    /// and the SQE must be pushed before the slot is touched again.
    fn sqe(&mut self, index: usize) -> squeue::Entry {
        let entry = match self {
            Job::Transfer { t, .. } => {
                let (offset, len) = t.next_chunk();
                let fd = types::Fd(t.file.raw_fd());
                let done = t.done;
                // `len` is at most `max_chunk`, which `IoConfig` caps below u32::MAX.
                let len = len as u32;
                match &mut t.mem {
                    Memory::ReadInto(buf) => {
                        let ptr = buf[done..].as_mut_ptr();
                        opcode::Read::new(fd, ptr, len).offset(offset).build()
                    }
                    Memory::WriteFrom(buf) => {
                        let ptr = buf[done..].as_ptr();
                        opcode::Write::new(fd, ptr, len).offset(offset).build()
                    }
                    Memory::WriteShared(data) => {
                        let ptr = data[done..].as_ptr();
                        opcode::Write::new(fd, ptr, len).offset(offset).build()
                    }
                }
            }
            Job::Sync { file, .. } => opcode::Fsync::new(types::Fd(file.raw_fd()))
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        entry.user_data(index as u64)
    }
}

/// Jobs the kernel may be working on, indexed by the `user_data` of their SQE.
struct Slots {
    entries: Vec<Option<Job>>,
    free: Vec<usize>,
}

impl Slots {
    fn with_capacity(capacity: usize) -> Slots {
        Slots {
            entries: (0..capacity).map(|_| None).collect(),
            free: (0..capacity).rev().collect(),
        }
    }

    fn in_flight(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// Places `job` in a free slot, or gives it back when there is none.
    fn insert(&mut self, job: Job) -> Result<usize, Job> {
        let Some(index) = self.free.pop() else {
            return Err(job);
        };
        self.entries[index] = Some(job);
        Ok(index)
    }

    fn get_mut(&mut self, index: usize) -> Option<&mut Job> {
        self.entries.get_mut(index).and_then(Option::as_mut)
    }

    fn take(&mut self, index: usize) -> Option<Job> {
        let job = self.entries.get_mut(index)?.take()?;
        self.free.push(index);
        Some(job)
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Empty on every normal exit. Non-empty only if the thread is unwinding from a panic
        // with operations in flight: the kernel may still write into those buffers, so they
        // are leaked rather than freed.
        let mut leaked = 0;
        for job in self.entries.drain(..).flatten() {
            std::mem::forget(job);
            leaked += 1;
        }
        if leaked > 0 {
            tracing::error!(leaked, "io_uring thread stopped with operations in flight");
        }
    }
}

/// The 8-byte buffer of the always-pending eventfd read.
struct WakeRead {
    buf: Box<u64>,
    armed: bool,
}

impl Drop for WakeRead {
    fn drop(&mut self) {
        if self.armed {
            // Same reasoning as `Slots::drop`: the kernel may still write these 8 bytes.
            let buf = std::mem::replace(&mut self.buf, Box::new(0));
            std::mem::forget(buf);
        }
    }
}

struct Reactor {
    ring: IoUring,
    rx: mpsc::Receiver<Request>,
    waker: Arc<Waker>,
    slots: Slots,
    /// Accepted jobs waiting for a slot, in arrival order.
    backlog: VecDeque<Job>,
    /// Completions copied out of the CQ, reused between rounds.
    completed: Vec<(u64, i32)>,
    wake: WakeRead,
    /// The channel is closed: serve what is left, then exit.
    closing: bool,
    shutdown_signalled: bool,
    max_chunk: usize,
}

impl Reactor {
    fn run(mut self) {
        loop {
            self.accept();
            self.fill();
            if self.closing && self.slots.in_flight() == 0 && self.backlog.is_empty() {
                if !self.wake.armed {
                    return;
                }
                // Our own eventfd read is the last thing in flight: complete it so that its
                // buffer is free before the ring goes away.
                if !self.shutdown_signalled {
                    self.waker.signal();
                    self.shutdown_signalled = true;
                }
            } else if !self.closing && !self.wake.armed {
                self.arm_wake();
            }
            self.enter();
            self.reap();
        }
    }

    fn accept(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(req) => self.backlog.push_back(Job::new(req, self.max_chunk)),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.closing = true;
                    return;
                }
            }
        }
    }

    /// Moves backlog jobs into free slots and queues their SQEs.
    fn fill(&mut self) {
        while self.slots.has_room() {
            let Some(job) = self.backlog.pop_front() else {
                return;
            };
            match self.slots.insert(job) {
                Ok(index) => self.push_slot(index),
                Err(job) => {
                    self.backlog.push_front(job);
                    return;
                }
            }
        }
    }

    /// Queues the SQE for the next step of the job in slot `index`.
    fn push_slot(&mut self, index: usize) {
        let Some(job) = self.slots.get_mut(index) else {
            tracing::error!(index, "invariant: push of an empty io_uring slot");
            return;
        };
        let entry = job.sqe(index);
        // SAFETY: the entry points at the buffer (if any) and fd of the job in slot `index`.
        // That job owns the buffer and an `Arc` of the file, and stays in the slot, not read
        // or written by us, until the CQE with `user_data == index` is reaped (`reap`), so
        // the memory and the descriptor stay valid for as long as the kernel may use them.
        unsafe { self.push(&entry) };
    }

    fn arm_wake(&mut self) {
        let ptr: *mut u64 = &mut *self.wake.buf;
        let entry = opcode::Read::new(types::Fd(self.waker.fd.as_raw_fd()), ptr.cast(), 8)
            .build()
            .user_data(WAKE_TOKEN);
        // SAFETY: the 8-byte buffer is a heap allocation owned by `self.wake`, which is not
        // read or freed while `armed` (see `WakeRead::drop` for the unwinding case); the
        // eventfd is owned by `self.waker`, which this thread keeps alive.
        unsafe { self.push(&entry) };
        self.wake.armed = true;
    }

    /// Pushes an SQE, making room by submitting if the SQ is full.
    ///
    /// # Safety
    /// Whatever `entry` points at must stay valid until its completion is reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: forwarded from this function's contract.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            // Cannot happen with the slot limit, but if it does, handing the queued entries
            // to the kernel makes room.
            if let Err(e) = self.ring.submit() {
                tracing::warn!(error = %e, "io_uring submit failed while the SQ was full");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Submits everything queued and waits for at least one completion.
    fn enter(&mut self) {
        match self.ring.submit_and_wait(1) {
            Ok(_) => {}
            // A signal, or a full CQ (reaping makes room): either way reap and go round.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
            Err(e) => {
                // EAGAIN/ENOMEM: the kernel is short of memory. The SQEs stay queued and go
                // in on the next call; back off so this does not spin.
                tracing::warn!(error = %e, "io_uring_enter failed; retrying");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn reap(&mut self) {
        let mut completed = std::mem::take(&mut self.completed);
        completed.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result())),
        );
        for (token, res) in completed.drain(..) {
            if token == WAKE_TOKEN {
                self.on_wake(res);
            } else {
                self.on_completion(token as usize, res);
            }
        }
        self.completed = completed;
    }

    fn on_wake(&mut self, res: i32) {
        self.wake.armed = false;
        // Acquire pairs with the senders' release: requests sent before their `wake` are
        // visible to the `accept` that follows.
        self.waker.pending.swap(false, Ordering::AcqRel);
        if let Err(e) = cqe_result(res) {
            tracing::warn!(error = %e, "eventfd read failed");
        }
    }

    fn on_completion(&mut self, index: usize, res: i32) {
        let Some(job) = self.slots.get_mut(index) else {
            tracing::error!(index, "invariant: completion for an empty io_uring slot");
            return;
        };
        let step = match job {
            Job::Transfer { t, .. } => t.advance(cqe_result(res)),
            Job::Sync { .. } => match cqe_result(res) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Step::Continue,
                Err(e) => Step::Failed(e),
                Ok(_) => Step::Finished,
            },
        };
        if let Step::Continue = step {
            // The kernel is done with this slot's previous SQE; reuse the slot for the rest.
            self.push_slot(index);
            return;
        }
        match self.slots.take(index) {
            Some(Job::Transfer { t, reply }) => t.finish(reply, step),
            Some(Job::Sync { reply, .. }) => {
                let result = match step {
                    Step::Failed(e) => Err(e),
                    _ => Ok(()),
                };
                let _ = reply.send(result);
            }
            None => {}
        }
    }
}
