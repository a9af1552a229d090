//! What the device must contain, according to everything the workload saw acknowledged.
//!
//! Every write and unmap gets a run-wide sequence number when it is issued. Per block the
//! model keeps the *durable* version (the newest one acknowledged before a flush that has
//! completed, or acknowledged as a FUA write) and the list of *later* versions, each in
//! flight, acknowledged or failed.
//!
//! Flushes are tracked with a global acknowledgement counter: a flush issued when `acks == n`
//! covers exactly the writes with ack number `<= n` (acknowledged before it was sent), so its
//! completion raises the model-wide `flushed_barrier` to `n`. Blocks are folded lazily — only
//! when touched or checked — so a flush costs O(1) however many blocks the run has written.
//!
//! What is acceptable when a block is read back:
//! - [`Expect::Exact`] (no crash happened): the newest acknowledged version, or a version
//!   issued after it whose outcome is unknown (in flight / failed — it may have landed).
//! - [`Expect::AfterCrash`]: the durable version or any later version, acknowledged or not.
//!   Anything else — a torn block, another block's data, a version older than the durable one,
//!   zeros where data was flushed — is wrong.
//!
//! The driver never has two operations on one block in flight at once, which is what makes
//! "the newest acknowledged version" well defined.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::stamp::{self, Found, Stamp};
use super::{BlockIndex, RunId, Seq, WorkloadError};

/// Version of the JSON state file.
const STATE_FORMAT: u32 = 1;

/// What a version put into the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Content {
    /// The stamped block for this sequence number.
    Data,
    /// Zeros (an unmap; seq 0 stands for "never written").
    Zeros,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteState {
    InFlight,
    /// Acknowledged; `ack` orders acknowledgements across the whole run.
    Acked {
        ack: u64,
    },
    /// The device returned an error: the block may or may not hold it.
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    pub seq: Seq,
    pub content: Content,
    pub state: WriteState,
}

/// One content a block may acceptably hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    pub seq: Seq,
    pub content: Content,
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.content, self.seq.0) {
            (Content::Zeros, 0) => write!(f, "zeros (never written)"),
            (Content::Zeros, s) => write!(f, "zeros (unmap seq {s})"),
            (Content::Data, s) => write!(f, "seq {s}"),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub durable: Option<Candidate>,
    pub later: Vec<Version>,
}

/// How strict a check is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// No crash: the newest acknowledged write (or an unresolved later one).
    Exact,
    /// After a crash or power loss: the durable write or anything issued after it.
    AfterCrash,
}

/// A block that holds something it must not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wrong {
    pub block: BlockIndex,
    pub offset: u64,
    pub expected: Vec<Candidate>,
    pub found: Found,
    pub why: String,
}

impl std::fmt::Display for Wrong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let expected: Vec<String> = self.expected.iter().map(|c| c.to_string()).collect();
        write!(
            f,
            "block {} (offset {}): {}; found {}; expected {}",
            self.block.0,
            self.offset,
            self.why,
            self.found,
            expected.join(" or ")
        )
    }
}

/// Returned by [`Model::begin_flush`]; hand it back to [`Model::flush_done`].
#[derive(Clone, Copy, Debug)]
pub struct FlushTicket {
    barrier: u64,
}

/// The per-run record of what every block must hold. Serializable to a JSON state file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    format: u32,
    pub run: RunId,
    pub block_size: u64,
    /// The workload covers blocks `first_block .. first_block + block_count` (in units of
    /// `block_size`).
    pub first_block: u64,
    pub block_count: u64,
    next_seq: u64,
    acks: u64,
    flushed_barrier: u64,
    blocks: BTreeMap<u64, BlockState>,
}

const NEVER_WRITTEN: Candidate = Candidate {
    seq: Seq(0),
    content: Content::Zeros,
};

impl Model {
    pub fn new(run: RunId, block_size: u64, first_block: u64, block_count: u64) -> Model {
        Model {
            format: STATE_FORMAT,
            run,
            block_size,
            first_block,
            block_count,
            next_seq: 1,
            acks: 0,
            flushed_barrier: 0,
            blocks: BTreeMap::new(),
        }
    }

    /// Every block index the workload covers.
    pub fn blocks(&self) -> impl Iterator<Item = BlockIndex> + use<> {
        (self.first_block..self.first_block + self.block_count).map(BlockIndex)
    }

    /// Blocks that have ever been written or unmapped.
    pub fn touched_blocks(&self) -> impl Iterator<Item = BlockIndex> + '_ {
        self.blocks.keys().map(|&b| BlockIndex(b))
    }

    pub fn offset(&self, block: BlockIndex) -> u64 {
        block.0 * self.block_size
    }

    pub fn state(&self, block: BlockIndex) -> Option<&BlockState> {
        self.blocks.get(&block.0)
    }

    /// Whether an operation on `block` is still outstanding.
    pub fn in_flight(&self, block: BlockIndex) -> bool {
        self.blocks.get(&block.0).is_some_and(|s| {
            s.later
                .last()
                .is_some_and(|v| v.state == WriteState::InFlight)
        })
    }

    /// Records a write being issued and returns its sequence number; the caller writes
    /// [`Model::block_content`] for it.
    pub fn begin_write(&mut self, block: BlockIndex) -> Seq {
        self.begin(block, Content::Data)
    }

    /// Records an unmap of the whole block being issued.
    pub fn begin_unmap(&mut self, block: BlockIndex) -> Seq {
        self.begin(block, Content::Zeros)
    }

    fn begin(&mut self, block: BlockIndex, content: Content) -> Seq {
        debug_assert!(!self.in_flight(block), "one operation per block at a time");
        let seq = Seq(self.next_seq);
        self.next_seq += 1;
        self.fold(block);
        self.blocks.entry(block.0).or_default().later.push(Version {
            seq,
            content,
            state: WriteState::InFlight,
        });
        seq
    }

    /// The bytes the write `seq` puts into `block`.
    pub fn block_content(&self, block: BlockIndex, seq: Seq) -> Vec<u8> {
        stamp::make_block(
            Stamp {
                run: self.run,
                block,
                seq,
            },
            self.block_size as usize,
        )
    }

    /// Records the outcome of the write or unmap `seq` on `block`.
    pub fn complete(&mut self, block: BlockIndex, seq: Seq, ok: bool) {
        let state = if ok {
            self.acks += 1;
            WriteState::Acked { ack: self.acks }
        } else {
            WriteState::Failed
        };
        if let Some(v) = self
            .blocks
            .get_mut(&block.0)
            .and_then(|s| s.later.iter_mut().find(|v| v.seq == seq))
        {
            v.state = state;
        } else {
            tracing::error!(
                block = block.0,
                seq = seq.0,
                "completion for an unknown write"
            );
        }
    }

    /// Records that the acknowledged write `seq` on `block` is durable by itself (a FUA
    /// write): after a crash the block holds it or something issued after it.
    pub fn made_durable(&mut self, block: BlockIndex, seq: Seq) {
        self.fold(block);
        if let Some(s) = self.blocks.get_mut(&block.0)
            && let Some(at) = s.later.iter().position(|v| v.seq == seq)
        {
            let v = s.later[at];
            s.durable = Some(Candidate {
                seq: v.seq,
                content: v.content,
            });
            s.later.drain(..=at);
        }
    }

    /// Records a flush being sent: it covers everything acknowledged so far.
    pub fn begin_flush(&self) -> FlushTicket {
        FlushTicket { barrier: self.acks }
    }

    /// Records a flush completing successfully.
    pub fn flush_done(&mut self, ticket: FlushTicket) {
        self.flushed_barrier = self.flushed_barrier.max(ticket.barrier);
    }

    /// Splits a block's history at the flush barrier: (durable, versions after it).
    fn split(&self, block: BlockIndex) -> (Candidate, &[Version]) {
        let Some(s) = self.blocks.get(&block.0) else {
            return (NEVER_WRITTEN, &[]);
        };
        let durable_at = s.later.iter().rposition(
            |v| matches!(v.state, WriteState::Acked { ack } if ack <= self.flushed_barrier),
        );
        match durable_at {
            Some(i) => (
                Candidate {
                    seq: s.later[i].seq,
                    content: s.later[i].content,
                },
                &s.later[i + 1..],
            ),
            None => (s.durable.unwrap_or(NEVER_WRITTEN), &s.later),
        }
    }

    /// Drops history the flush barrier made irrelevant, keeping per-block state small.
    fn fold(&mut self, block: BlockIndex) {
        let (durable, rest) = self.split(block);
        let rest = rest.to_vec();
        if let Some(s) = self.blocks.get_mut(&block.0) {
            s.durable = Some(durable);
            s.later = rest;
        }
    }

    /// Everything `block` may acceptably hold under `expect`.
    pub fn candidates(&self, block: BlockIndex, expect: Expect) -> Vec<Candidate> {
        let (durable, later) = self.split(block);
        let mut out = vec![durable];
        for v in later {
            let c = Candidate {
                seq: v.seq,
                content: v.content,
            };
            match (expect, v.state) {
                (Expect::Exact, WriteState::Acked { .. }) => out = vec![c],
                _ => out.push(c),
            }
        }
        out
    }

    /// Checks what was read from `block`; returns the matching candidate.
    pub fn check(
        &self,
        block: BlockIndex,
        data: &[u8],
        expect: Expect,
    ) -> Result<Candidate, Wrong> {
        let expected = self.candidates(block, expect);
        let found = stamp::inspect(data);
        let matched = expected
            .iter()
            .copied()
            .find(|c| match (&found, c.content) {
                (Found::Zeros, Content::Zeros) => true,
                (Found::Intact(s), Content::Data) => {
                    s.run == self.run && s.block == block && s.seq == c.seq
                }
                _ => false,
            });
        if let Some(c) = matched {
            return Ok(c);
        }
        let oldest = expected.iter().map(|c| c.seq).min().unwrap_or(Seq(0));
        let why = match &found {
            Found::Zeros => "lost write: block reads as zeros".to_string(),
            Found::Garbage => "garbage: not written by this workload".to_string(),
            Found::Corrupt { .. } => "torn or corrupted block".to_string(),
            Found::Intact(s) if s.run != self.run => {
                format!("data from another run ({:x})", s.run.0)
            }
            Found::Intact(s) if s.block != block => {
                format!("misdirected: holds data meant for block {}", s.block.0)
            }
            Found::Intact(s) if s.seq < oldest => "stale: older than every acceptable write".into(),
            Found::Intact(s) if s.seq.0 >= self.next_seq => {
                "a write this run never issued".to_string()
            }
            Found::Intact(_) => "an overwritten write came back".to_string(),
        };
        Err(Wrong {
            block,
            offset: self.offset(block),
            expected,
            found,
            why,
        })
    }

    /// After a crash check, records what the device was found to hold as the durable truth,
    /// so a later run can continue from this state.
    pub fn settle(&mut self, block: BlockIndex, found: Candidate) {
        if found == NEVER_WRITTEN {
            self.blocks.remove(&block.0);
            return;
        }
        self.blocks.insert(
            block.0,
            BlockState {
                durable: Some(found),
                later: Vec::new(),
            },
        );
    }

    /// Writes the state as JSON, atomically (temp file + rename) so a crash mid-save never
    /// leaves a half-written state behind.
    pub fn save(&self, path: &Path) -> Result<(), WorkloadError> {
        let err = |source: std::io::Error| WorkloadError::State {
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        let mut folded = self.clone();
        let touched: Vec<BlockIndex> = folded.touched_blocks().collect();
        for b in touched {
            folded.fold(b);
        }
        let json = serde_json::to_vec(&folded).map_err(|e| err(e.into()))?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }

    pub fn load(path: &Path) -> Result<Model, WorkloadError> {
        let err = |source: Box<dyn std::error::Error + Send + Sync>| WorkloadError::State {
            path: path.to_path_buf(),
            source,
        };
        let bytes = std::fs::read(path).map_err(|e| err(e.into()))?;
        let mut model: Model = serde_json::from_slice(&bytes).map_err(|e| err(e.into()))?;
        if model.format != STATE_FORMAT {
            return Err(err(format!(
                "state format {} (this build reads {STATE_FORMAT})",
                model.format
            )
            .into()));
        }
        // Whatever was in flight when the state was saved has an unknown outcome now.
        for s in model.blocks.values_mut() {
            for v in &mut s.later {
                if v.state == WriteState::InFlight {
                    v.state = WriteState::Failed;
                }
            }
        }
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Model {
        Model::new(RunId(9), 4096, 0, 16)
    }

    #[test]
    fn exact_expects_newest_ack_and_crash_accepts_old_or_new() {
        let mut m = model();
        let b = BlockIndex(3);
        let s1 = m.begin_write(b);
        m.complete(b, s1, true);
        let t = m.begin_flush();
        m.flush_done(t);
        let s2 = m.begin_write(b);
        m.complete(b, s2, true);
        let s3 = m.begin_write(b);

        let d1 = m.block_content(b, s1);
        let d2 = m.block_content(b, s2);
        let d3 = m.block_content(b, s3);
        assert!(m.check(b, &d1, Expect::Exact).is_err());
        assert_eq!(m.check(b, &d2, Expect::Exact).map(|c| c.seq), Ok(s2));
        assert_eq!(m.check(b, &d3, Expect::Exact).map(|c| c.seq), Ok(s3));
        for d in [&d1, &d2, &d3] {
            assert!(m.check(b, d, Expect::AfterCrash).is_ok());
        }
        assert!(m.check(b, &[0u8; 4096], Expect::AfterCrash).is_err());

        // A second flush after s2's ack makes s1 stale even after a crash.
        m.complete(b, s3, true);
        let t = m.begin_flush();
        let s4 = m.begin_write(b);
        m.complete(b, s4, true);
        m.flush_done(t);
        let wrong = m
            .check(b, &d1, Expect::AfterCrash)
            .expect_err("s1 is stale");
        assert!(wrong.why.contains("stale"), "{wrong}");
        assert!(m.check(b, &d3, Expect::AfterCrash).is_ok());
        assert!(m.check(b, &d2, Expect::AfterCrash).is_err());
    }
}
