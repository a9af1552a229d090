//! Reading a device back and judging every block against the [`Model`].
//!
//! Reads go out in runs of consecutive blocks (up to 1 MiB per request) with a bounded
//! number in flight, so scanning a whole range over NBD costs a few hundred requests per
//! GiB rather than one per block.

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::BlockIndex;
use super::driver::{IoFailure, OpKind};
use super::model::{Candidate, Expect, Model, Wrong};
use zebu_engine::blockdev::{BlockDevice, BlockError};

/// Which blocks to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every block of the workload's range: also catches writes that landed on blocks the
    /// workload never touched.
    Range,
    /// Only blocks the workload wrote or unmapped.
    Touched,
}

#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub checked: u64,
    pub wrong: Vec<Wrong>,
    pub io_errors: Vec<IoFailure>,
    /// For every touched block that checked out, which acceptable content it held (used to
    /// settle the model after a crash check).
    pub found: Vec<(BlockIndex, Candidate)>,
}

impl VerifyReport {
    pub fn passed(&self) -> bool {
        self.wrong.is_empty() && self.io_errors.is_empty()
    }
}

const MAX_READ: u64 = 1 << 20;

/// Reads the blocks in `scope` with up to `queue_depth` reads in flight and checks each.
pub async fn verify<D: BlockDevice + ?Sized>(
    dev: &D,
    model: &Model,
    expect: Expect,
    scope: Scope,
    queue_depth: usize,
) -> VerifyReport {
    let blocks: Vec<BlockIndex> = match scope {
        Scope::Range => model.blocks().collect(),
        Scope::Touched => model.touched_blocks().collect(),
    };
    let per_read = (MAX_READ / model.block_size).max(1);
    // Group consecutive blocks into one read.
    let mut runs: Vec<(BlockIndex, u64)> = Vec::new();
    for b in blocks {
        match runs.last_mut() {
            Some((start, n)) if start.0 + *n == b.0 && *n < per_read => *n += 1,
            _ => runs.push((b, 1)),
        }
    }

    let mut report = VerifyReport::default();
    let mut pending = runs.into_iter();
    let mut inflight = FuturesUnordered::new();
    let bs = model.block_size;
    loop {
        while inflight.len() < queue_depth.max(1) {
            let Some((start, n)) = pending.next() else {
                break;
            };
            inflight.push(async move {
                let r: Result<Bytes, BlockError> = dev.read(model.offset(start), n * bs).await;
                (start, n, r)
            });
        }
        let Some((start, n, result)) = inflight.next().await else {
            break;
        };
        let data = match result {
            Ok(d) if d.len() as u64 == n * bs => d,
            Ok(d) => {
                report.io_errors.push(IoFailure {
                    op: OpKind::Read,
                    offset: model.offset(start),
                    len: n * bs,
                    error: format!("short read of {} bytes", d.len()),
                });
                continue;
            }
            Err(e) => {
                report.io_errors.push(IoFailure {
                    op: OpKind::Read,
                    offset: model.offset(start),
                    len: n * bs,
                    error: e.to_string(),
                });
                continue;
            }
        };
        for (i, chunk) in data.chunks(bs as usize).enumerate() {
            let block = BlockIndex(start.0 + i as u64);
            report.checked += 1;
            match model.check(block, chunk, expect) {
                Ok(c) => {
                    if model.state(block).is_some() {
                        report.found.push((block, c));
                    }
                }
                Err(w) => report.wrong.push(w),
            }
        }
    }
    report.wrong.sort_by_key(|w| w.block);
    report
}
