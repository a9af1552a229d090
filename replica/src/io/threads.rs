//! The thread-pool back end: a fixed number of threads doing `pread`/`pwrite`/`fdatasync`.
//!
//! Used where io_uring is refused. The pool is fixed rather than tokio's `spawn_blocking`
//! because that pool grows to hundreds of threads under a deep queue, and each blocked
//! thread is one more request the disk sees at once with no bound; a fixed pool caps the
//! device queue depth at the number of threads and keeps the memory bounded.
//!
//! Requests come over one channel whose receiver the workers share behind a mutex: an idle
//! worker holds the mutex while it waits, the others wait for the mutex. Shutdown is the
//! channel closing when the last [`IoEngine`](super::IoEngine) drops: each worker finishes
//! the request it holds and exits, and the drop joins them.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::request::{Memory, Request, Step, Transfer, Work};

pub(super) struct ThreadPool {
    /// `None` only while dropping.
    tx: Option<mpsc::Sender<Request>>,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    pub(super) fn start(threads: usize, max_chunk: usize) -> io::Result<ThreadPool> {
        let (tx, rx) = mpsc::channel::<Request>();
        let rx = Arc::new(Mutex::new(rx));
        let mut pool = ThreadPool {
            tx: Some(tx),
            workers: Vec::with_capacity(threads),
        };
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let worker = std::thread::Builder::new()
                .name(format!("zebu-io-{i}"))
                .spawn(move || worker(&rx, max_chunk))?;
            // On a spawn error `pool` drops here, which stops the workers already started.
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// Queues `req`. If the workers are gone, the request (and its reply sender) is dropped,
    /// which the caller sees as a closed reply channel.
    pub(super) fn submit(&self, req: Request) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(req);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        // Closing the channel is the stop signal; queued requests are still served first
        // because `recv` only fails once the queue is empty.
        self.tx = None;
        for worker in self.workers.drain(..) {
            if worker.join().is_err() {
                tracing::error!("an I/O worker thread panicked");
            }
        }
    }
}

fn worker(rx: &Mutex<mpsc::Receiver<Request>>, max_chunk: usize) {
    loop {
        // Nothing panics while the lock is held, but a poisoned lock still guards a valid
        // receiver, so keep serving.
        let next = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        match next {
            Ok(req) => run(req, max_chunk),
            Err(mpsc::RecvError) => return,
        }
    }
}

fn run(req: Request, max_chunk: usize) {
    match req.into_work(max_chunk) {
        Work::Transfer(t, reply) => {
            let (t, step) = transfer(t);
            t.finish(reply, step);
        }
        Work::Sync(file, reply) => {
            let result = loop {
                match file.file().sync_data() {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => break other,
                }
            };
            let _ = reply.send(result);
        }
    }
}

/// Runs `t` to completion with blocking system calls.
fn transfer(mut t: Transfer) -> (Transfer, Step) {
    loop {
        let (offset, len) = t.next_chunk();
        let range = t.done..t.done + len;
        let file = t.file.file();
        let result = match &mut t.mem {
            Memory::ReadInto(buf) => file.read_at(&mut buf[range], offset),
            Memory::WriteFrom(buf) => file.write_at(&buf[range], offset),
            Memory::WriteShared(data) => file.write_at(&data[range], offset),
        };
        match t.advance(result) {
            Step::Continue => {}
            step => return (t, step),
        }
    }
}
