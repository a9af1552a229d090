//! Outgoing PDUs of one connection: stamping and writing without a hop to another task.
//!
//! [`Outbox::push`] stamps StatSN, ExpCmdSN and MaxCmdSN into a PDU and encodes it at the
//! tail of one queue under one lock, so StatSN increases in wire order. [`Outbox::flush`]
//! then writes the queue straight to the socket with non-blocking vectored writes from the
//! caller's task. Only when the socket is full does the connection's writer task
//! ([`Outbox::run`]) take over, waiting for the socket to become writable; while it owns the
//! queue (`flushing`), other callers only append.
//!
//! Before this, every PDU went through a channel to a writer task, which cost a task
//! wake-up (often a futex wake of another worker thread) per response.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice};
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;
use tracing::debug;

use super::pdu::{Bhs, encode};

/// How the StatSN field of an outgoing PDU is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sn {
    /// A response: carries the next StatSN, which then advances.
    Advance,
    /// Carries the current StatSN without advancing it (R2T).
    Current,
    /// StatSN is reserved (Data-In without status).
    Reserved,
}

struct State {
    stat_sn: u32,
    scratch: BytesMut,
    queue: VecDeque<Bytes>,
    /// The writer task owns the queue until it has drained it.
    flushing: bool,
    /// Close once the queue is drained.
    closing: bool,
    /// Writing failed: the connection is dead and further PDUs are dropped.
    failed: bool,
}

pub struct Outbox {
    sock: OwnedWriteHalf,
    state: Mutex<State>,
    kick: Notify,
    header_digest: bool,
    data_digest: bool,
}

impl Outbox {
    pub fn new(sock: OwnedWriteHalf, stat_sn: u32, header_digest: bool, data_digest: bool) -> Self {
        Outbox {
            sock,
            state: Mutex::new(State {
                stat_sn,
                scratch: BytesMut::with_capacity(16 * 1024),
                queue: VecDeque::with_capacity(64),
                flushing: false,
                closing: false,
                failed: false,
            }),
            kick: Notify::new(),
            header_digest,
            data_digest,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("invariant: outbox lock not poisoned")
    }

    /// Stamps and queues one PDU; `window` gives (ExpCmdSN, MaxCmdSN) at that moment.
    pub fn push(&self, mut bhs: Bhs, data: &Bytes, sn: Sn, window: impl FnOnce() -> (u32, u32)) {
        let mut st = self.lock();
        if st.failed || st.closing {
            return;
        }
        match sn {
            Sn::Advance => {
                bhs.set_u32(24, st.stat_sn);
                st.stat_sn = st.stat_sn.wrapping_add(1);
            }
            Sn::Current => bhs.set_u32(24, st.stat_sn),
            Sn::Reserved => {}
        }
        let (exp, max) = window();
        bhs.set_u32(28, exp);
        bhs.set_u32(32, max);
        let mut out = Vec::with_capacity(3);
        let State { scratch, queue, .. } = &mut *st;
        encode(
            &bhs,
            data,
            self.header_digest,
            self.data_digest,
            scratch,
            &mut out,
        );
        queue.extend(out);
    }

    /// Writes what is queued now, unless the writer task already owns the queue.
    pub fn flush(&self) {
        let mut st = self.lock();
        if st.flushing || st.failed || st.queue.is_empty() {
            return;
        }
        match self.try_drain(&mut st) {
            Ok(true) => {}
            Ok(false) => {
                st.flushing = true;
                self.kick.notify_one();
            }
            Err(e) => {
                debug!(error = %e, "writing to initiator failed");
                st.failed = true;
                st.queue.clear();
            }
        }
    }

    /// Flushes what is queued, then shuts the sending side of the connection down.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closing = true;
        st.flushing = true;
        self.kick.notify_one();
    }

    /// Writes as much of the queue as the socket takes without blocking. True when empty.
    fn try_drain(&self, st: &mut State) -> std::io::Result<bool> {
        while !st.queue.is_empty() {
            let mut slices = [IoSlice::new(&[]); 64];
            let mut n = 0;
            for b in st.queue.iter().take(64) {
                slices[n] = IoSlice::new(b);
                n += 1;
            }
            let mut written = match self.sock.try_write_vectored(&slices[..n]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(w) => w,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            };
            while written > 0 {
                let front = st
                    .queue
                    .front_mut()
                    .expect("invariant: the kernel took no more than was queued");
                if written >= front.len() {
                    written -= front.len();
                    st.queue.pop_front();
                } else {
                    front.advance(written);
                    written = 0;
                }
            }
        }
        Ok(true)
    }

    /// The writer task: drains the queue whenever [`Self::flush`] finds the socket full, and
    /// performs the close.
    pub async fn run(&self) {
        loop {
            self.kick.notified().await;
            loop {
                {
                    let mut st = self.lock();
                    if st.failed {
                        return;
                    }
                    match self.try_drain(&mut st) {
                        Ok(true) => {
                            st.flushing = false;
                            if st.closing {
                                drop(st);
                                self.shutdown();
                                return;
                            }
                            break;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            debug!(error = %e, "writing to initiator failed");
                            st.failed = true;
                            st.queue.clear();
                            return;
                        }
                    }
                }
                if self.sock.writable().await.is_err() {
                    self.lock().failed = true;
                    return;
                }
            }
        }
    }

    fn shutdown(&self) {
        let fd = self.sock.as_ref().as_raw_fd();
        // SAFETY: `fd` is the open socket owned by `self.sock`, alive for this call;
        // shutdown(2) only changes the connection state and touches no memory.
        let _ = unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    }
}
