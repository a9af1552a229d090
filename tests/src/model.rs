//! A model of what a volume must contain, for crash tests.
//!
//! Every 4 KiB block the tests write carries a *stamp* (a write number): the block holds
//! its own index and the stamp, a pattern derived from both, and a CRC32C of the rest, so a
//! block read back names the write it came from and a torn or misplaced block is detected.
//! Stamp 0 means "never written" and reads as zeros.
//!
//! [`Model`] keeps per block the stamp made durable by the last completed flush and the
//! stamps written since (acknowledged or merely sent): after a crash a block may hold any
//! of those, and nothing else.

use std::collections::BTreeMap;

/// The block size of the model.
pub const BLOCK: u64 = 4096;

/// The bytes of `block` as written with `stamp` (zeros for stamp 0).
pub fn block_data(block: u64, stamp: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK as usize];
    if stamp == 0 {
        return b;
    }
    b[0..8].copy_from_slice(&block.to_le_bytes());
    b[8..16].copy_from_slice(&stamp.to_le_bytes());
    // xorshift64 seeded by both, so every (block, stamp) has its own body.
    let mut x =
        block.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stamp.wrapping_mul(0xD6E8_FEB8_6659_FD93) | 1;
    for chunk in b[16..BLOCK as usize - 4].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let crc = crc32c::crc32c(&b[..BLOCK as usize - 4]);
    b[BLOCK as usize - 4..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The bytes of `count` consecutive blocks from `first`, all with `stamp`.
pub fn blocks_data(first: u64, count: u64, stamp: u64) -> Vec<u8> {
    (first..first + count)
        .flat_map(|b| block_data(b, stamp))
        .collect()
}

/// Which write `data` (one block read at `block`) came from; an error names what is wrong.
pub fn decode(block: u64, data: &[u8]) -> Result<u64, String> {
    if data.len() != BLOCK as usize {
        return Err(format!("block {block}: read {} bytes", data.len()));
    }
    if data.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let word = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().expect("8 bytes"));
    let (at, stamp) = (word(0), word(8));
    if at != block {
        return Err(format!(
            "block {block} holds data written for block {at} (stamp {stamp})"
        ));
    }
    if data != block_data(block, stamp).as_slice() {
        return Err(format!(
            "block {block}: corrupt contents (header says stamp {stamp})"
        ));
    }
    Ok(stamp)
}

#[derive(Debug, Clone, Default)]
struct BlockState {
    /// What the last completed flush made durable.
    durable: u64,
    /// The newest acknowledged stamp (becomes durable at the next flush); 0 is an unmap.
    acked: Option<u64>,
    /// Every stamp sent since the last flush, acknowledged or not.
    since_flush: Vec<u64>,
}

/// Expected contents of a volume's blocks; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct Model {
    blocks: BTreeMap<u64, BlockState>,
}

impl Model {
    /// Records that a write of `stamp` to `block` was sent (it may land or not).
    pub fn sent(&mut self, block: u64, stamp: u64) {
        self.blocks
            .entry(block)
            .or_default()
            .since_flush
            .push(stamp);
    }

    /// Records that the write of `stamp` to `block` was acknowledged.
    pub fn acked(&mut self, block: u64, stamp: u64) {
        self.blocks.entry(block).or_default().acked = Some(stamp);
    }

    /// Records a completed flush that was sent after every write sent so far was
    /// acknowledged or abandoned.
    pub fn flushed(&mut self) {
        for s in self.blocks.values_mut() {
            if let Some(acked) = s.acked {
                s.durable = acked;
            }
            s.since_flush.clear();
        }
    }

    /// The stamps `block` may hold now.
    pub fn allowed(&self, block: u64) -> Vec<u64> {
        match self.blocks.get(&block) {
            None => vec![0],
            Some(s) => {
                let mut v = vec![s.durable];
                v.extend(&s.since_flush);
                v
            }
        }
    }

    /// The one stamp `block` must hold when nothing is unflushed.
    pub fn expected(&self, block: u64) -> u64 {
        self.blocks.get(&block).map_or(0, |s| s.durable)
    }

    /// Checks one block read back after a crash and takes what it holds as the truth.
    pub fn verify_and_settle(&mut self, block: u64, data: &[u8]) -> Result<(), String> {
        let stamp = decode(block, data)?;
        let allowed = self.allowed(block);
        if !allowed.contains(&stamp) {
            return Err(format!(
                "block {block} holds stamp {stamp}, allowed only {allowed:?}"
            ));
        }
        let s = self.blocks.entry(block).or_default();
        s.durable = stamp;
        s.acked = None;
        s.since_flush.clear();
        Ok(())
    }

    /// Every block the model knows about.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_names_the_write() {
        assert_eq!(decode(7, &block_data(7, 42)), Ok(42));
        assert_eq!(decode(7, &block_data(7, 0)), Ok(0));
        assert!(decode(8, &block_data(7, 42)).is_err());
        let mut torn = block_data(7, 42);
        torn[2048..].copy_from_slice(&block_data(7, 43)[2048..]);
        assert!(decode(7, &torn).is_err());
    }

    #[test]
    fn unflushed_blocks_may_hold_old_or_new() {
        let mut m = Model::default();
        m.sent(1, 10);
        m.acked(1, 10);
        m.flushed();
        m.sent(1, 11);
        assert_eq!(m.allowed(1), vec![10, 11]);
        assert!(m.clone().verify_and_settle(1, &block_data(1, 10)).is_ok());
        assert!(m.clone().verify_and_settle(1, &block_data(1, 11)).is_ok());
        assert!(m.verify_and_settle(1, &block_data(1, 0)).is_err());
    }

    #[test]
    fn a_flushed_unmap_makes_zeros_durable() {
        let mut m = Model::default();
        m.sent(1, 10);
        m.acked(1, 10);
        m.flushed();
        m.sent(1, 0);
        m.acked(1, 0);
        m.flushed();
        assert_eq!(m.allowed(1), vec![0]);
        assert_eq!(m.expected(1), 0);
    }
}
