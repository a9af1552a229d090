//! The loop that keeps N operations in flight against a device.
//!
//! One task owns the [`Model`] and a set of in-flight operation futures; it issues until the
//! queue is full, then waits for any completion and records it. Owning the model in the one
//! loop (instead of sharing it behind a lock between N workers) makes every model update
//! happen in completion order, which is exactly the order the acknowledgement counter needs.
//!
//! The loop never puts two operations on one block in flight, so "newest acknowledged write"
//! is well defined and reads can be checked exactly.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::{Deserialize, Serialize};

use super::model::{Expect, FlushTicket, Model, Wrong};
use super::stamp::SplitMix;
use super::{BlockIndex, RunId, Seq, WorkloadError};
use zebu_engine::blockdev::{BlockDevice, BlockError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    Random,
    Sequential,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopAfter {
    /// This many reads, writes and unmaps (flushes not counted).
    Ops(u64),
    Duration(Duration),
}

#[derive(Clone, Debug)]
pub struct WorkloadConfig {
    /// Bytes per block; a multiple of 4096.
    pub block_size: u64,
    /// First byte of the range the workload covers; a multiple of `block_size`.
    pub range_start: u64,
    /// Bytes covered; `None` = to the end of the device (rounded down to whole blocks).
    pub range_len: Option<u64>,
    pub queue_depth: usize,
    pub pattern: Pattern,
    pub stop: StopAfter,
    /// Percentage of operations that are reads (checked against the model).
    pub read_percent: u8,
    /// Percentage of operations that are unmaps of one block.
    pub unmap_percent: u8,
    /// Percentage of writes sent with FUA (`BlockDevice::write_fua`): each is durable when
    /// acknowledged, flush or no flush.
    pub fua_percent: u8,
    /// Flush after this many writes and unmaps.
    pub flush_every: Option<u64>,
    /// Flush when this long has passed since the last one.
    pub flush_interval: Option<Duration>,
    /// Flush once more after the last operation.
    pub final_flush: bool,
    /// Stop issuing new operations after the first I/O error (the device is likely gone).
    pub stop_on_error: bool,
    /// Seed for block and operation choice.
    pub seed: u64,
    /// Set to true from elsewhere to end the run early (in-flight operations still finish).
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            block_size: 4096,
            range_start: 0,
            range_len: None,
            queue_depth: 32,
            pattern: Pattern::Random,
            stop: StopAfter::Ops(10_000),
            read_percent: 10,
            unmap_percent: 0,
            fua_percent: 0,
            flush_every: Some(100),
            flush_interval: None,
            final_flush: true,
            stop_on_error: true,
            seed: 1,
            cancel: None,
        }
    }
}

impl WorkloadConfig {
    /// Checks the configuration against a device of `device_size` bytes and builds an empty model for it.
    pub fn new_model(&self, device_size: u64, run: RunId) -> Result<Model, WorkloadError> {
        let bs = self.block_size;
        if bs == 0 || !bs.is_multiple_of(4096) {
            return Err(WorkloadError::Config(format!(
                "block size {bs} is not a positive multiple of 4096"
            )));
        }
        if !self.range_start.is_multiple_of(bs) {
            return Err(WorkloadError::Config(format!(
                "range start {} is not a multiple of the block size {bs}",
                self.range_start
            )));
        }
        let size = device_size;
        let len = self
            .range_len
            .unwrap_or(size.saturating_sub(self.range_start));
        if self
            .range_start
            .checked_add(len)
            .is_none_or(|end| end > size)
        {
            return Err(WorkloadError::Config(format!(
                "range {}+{len} exceeds the device of {size} bytes",
                self.range_start
            )));
        }
        let count = len / bs;
        if count == 0 {
            return Err(WorkloadError::Config(format!(
                "range of {len} bytes holds no {bs}-byte block"
            )));
        }
        if self.queue_depth == 0 {
            return Err(WorkloadError::Config("queue depth 0".into()));
        }
        if u16::from(self.read_percent) + u16::from(self.unmap_percent) > 100 {
            return Err(WorkloadError::Config(
                "read and unmap percentages add up to more than 100".into(),
            ));
        }
        Ok(Model::new(run, bs, self.range_start / bs, count))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OpKind {
    Read,
    Write,
    /// A write with FUA.
    FuaWrite,
    Unmap,
    Flush,
}

/// One I/O error the workload saw.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoFailure {
    pub op: OpKind,
    pub offset: u64,
    pub len: u64,
    pub error: String,
}

impl std::fmt::Display for IoFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {}+{}: {}",
            self.op, self.offset, self.len, self.error
        )
    }
}

#[derive(Clone, Debug, Default)]
pub struct RunReport {
    /// Writes acknowledged, FUA writes among them.
    pub writes: u64,
    pub fua_writes: u64,
    pub reads: u64,
    pub unmaps: u64,
    pub flushes: u64,
    pub elapsed: Duration,
    pub io_errors: Vec<IoFailure>,
    /// Reads during the run that returned something other than the model's expectation.
    pub bad_reads: Vec<Wrong>,
}

impl RunReport {
    pub fn ops(&self) -> u64 {
        self.writes + self.reads + self.unmaps
    }

    pub fn iops(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.ops() as f64 / secs
        } else {
            0.0
        }
    }
}

struct Completion {
    op: OpKind,
    block: BlockIndex,
    seq: Seq,
    ticket: Option<FlushTicket>,
    result: Result<Option<Bytes>, BlockError>,
}

type OpFuture<'a> = Pin<Box<dyn Future<Output = Completion> + Send + 'a>>;

/// Runs the workload described by `cfg` against `dev`, recording everything in `model`
/// (which may come from an earlier run: sequence numbers continue).
pub async fn run_workload<D: BlockDevice + ?Sized>(
    dev: &D,
    model: &mut Model,
    cfg: &WorkloadConfig,
) -> RunReport {
    let started = Instant::now();
    let mut report = RunReport::default();
    let mut inflight: FuturesUnordered<OpFuture<'_>> = FuturesUnordered::new();
    let mut reading: HashSet<BlockIndex> = HashSet::new();
    let mut rng = SplitMix(cfg.seed ^ model.run.0);
    let mut cursor = 0u64;
    let mut issued = 0u64;
    let mut writes_since_flush = 0u64;
    let mut last_flush = Instant::now();
    let mut stopping = false;
    let mut final_flush_sent = false;
    let bs = model.block_size;

    loop {
        while !stopping && inflight.len() < cfg.queue_depth {
            let done = match cfg.stop {
                StopAfter::Ops(n) => issued >= n,
                StopAfter::Duration(d) => started.elapsed() >= d,
            };
            if done
                || cfg
                    .cancel
                    .as_ref()
                    .is_some_and(|c| c.load(Ordering::Relaxed))
            {
                stopping = true;
                break;
            }
            let flush_due = cfg.flush_every.is_some_and(|k| writes_since_flush >= k)
                || cfg
                    .flush_interval
                    .is_some_and(|t| writes_since_flush > 0 && last_flush.elapsed() >= t);
            if flush_due {
                inflight.push(flush_op(dev, model.begin_flush()));
                writes_since_flush = 0;
                last_flush = Instant::now();
                continue;
            }
            let Some(block) = pick_block(model, &reading, cfg.pattern, &mut rng, &mut cursor)
            else {
                break; // every candidate block is busy: wait for a completion
            };
            issued += 1;
            let dice = (rng.next_u64() % 100) as u8;
            let offset = model.offset(block);
            if dice < cfg.read_percent {
                reading.insert(block);
                inflight.push(Box::pin(async move {
                    let result = dev.read(offset, bs).await.map(Some);
                    Completion {
                        op: OpKind::Read,
                        block,
                        seq: Seq(0),
                        ticket: None,
                        result,
                    }
                }));
            } else if dice < cfg.read_percent + cfg.unmap_percent {
                let seq = model.begin_unmap(block);
                writes_since_flush += 1;
                inflight.push(Box::pin(async move {
                    let result = dev.unmap(offset, bs).await.map(|()| None);
                    Completion {
                        op: OpKind::Unmap,
                        block,
                        seq,
                        ticket: None,
                        result,
                    }
                }));
            } else {
                let seq = model.begin_write(block);
                let data = Bytes::from(model.block_content(block, seq));
                let fua = (rng.next_u64() % 100) < u64::from(cfg.fua_percent);
                if !fua {
                    writes_since_flush += 1;
                }
                inflight.push(Box::pin(async move {
                    let (op, done) = if fua {
                        (OpKind::FuaWrite, dev.write_fua(offset, data).await)
                    } else {
                        (OpKind::Write, dev.write(offset, data).await)
                    };
                    Completion {
                        op,
                        block,
                        seq,
                        ticket: None,
                        result: done.map(|()| None),
                    }
                }));
            }
        }

        if inflight.is_empty() {
            if !stopping {
                // Nothing in flight yet no block was free: only possible with an empty range,
                // which the config check rules out. Stop rather than spin.
                tracing::error!("workload found no block to operate on");
                break;
            }
            if cfg.final_flush && !final_flush_sent {
                final_flush_sent = true;
                inflight.push(flush_op(dev, model.begin_flush()));
            } else {
                break;
            }
        }

        let Some(c) = inflight.next().await else {
            continue;
        };
        let ok = c.result.is_ok();
        match (&c.op, c.result) {
            (OpKind::Flush, Ok(_)) => {
                report.flushes += 1;
                if let Some(t) = c.ticket {
                    model.flush_done(t);
                }
            }
            (OpKind::Read, Ok(data)) => {
                reading.remove(&c.block);
                report.reads += 1;
                let data = data.unwrap_or_default();
                if let Err(w) = model.check(c.block, &data, Expect::Exact) {
                    // Bounded so a wholesale failure does not flood the log.
                    if report.bad_reads.len() < 20 {
                        tracing::error!(%w, "read during the workload returned wrong data");
                    }
                    report.bad_reads.push(w);
                }
            }
            (OpKind::Write | OpKind::FuaWrite | OpKind::Unmap, Ok(_)) => {
                match c.op {
                    OpKind::Unmap => report.unmaps += 1,
                    OpKind::FuaWrite => {
                        report.writes += 1;
                        report.fua_writes += 1;
                    }
                    _ => report.writes += 1,
                }
                model.complete(c.block, c.seq, true);
                if c.op == OpKind::FuaWrite {
                    model.made_durable(c.block, c.seq);
                }
            }
            (op, Err(e)) => {
                if *op == OpKind::Read {
                    reading.remove(&c.block);
                } else if *op != OpKind::Flush {
                    model.complete(c.block, c.seq, false);
                }
                let (offset, len) = if *op == OpKind::Flush {
                    (0, 0)
                } else {
                    (model.offset(c.block), bs)
                };
                tracing::warn!(?op, offset, error = %e, "workload I/O error");
                report.io_errors.push(IoFailure {
                    op: *op,
                    offset,
                    len,
                    error: e.to_string(),
                });
            }
        }
        if !ok && cfg.stop_on_error {
            stopping = true;
        }
    }
    report.elapsed = started.elapsed();
    report
}

fn flush_op<D: BlockDevice + ?Sized>(dev: &D, ticket: FlushTicket) -> OpFuture<'_> {
    Box::pin(async move {
        let result = dev.flush().await.map(|()| None);
        Completion {
            op: OpKind::Flush,
            block: BlockIndex(0),
            seq: Seq(0),
            ticket: Some(ticket),
            result,
        }
    })
}

/// Picks a block with nothing in flight, or `None` after a bounded search.
fn pick_block(
    model: &Model,
    reading: &HashSet<BlockIndex>,
    pattern: Pattern,
    rng: &mut SplitMix,
    cursor: &mut u64,
) -> Option<BlockIndex> {
    let count = model.block_count;
    for _ in 0..count.min(64) {
        let i = match pattern {
            Pattern::Random => rng.next_u64() % count,
            Pattern::Sequential => {
                let i = *cursor;
                *cursor = (*cursor + 1) % count;
                i
            }
        };
        let b = BlockIndex(model.first_block + i);
        if !reading.contains(&b) && !model.in_flight(b) {
            return Some(b);
        }
    }
    None
}
