//! The self-describing content the workload writes into every block.
//!
//! Layout of one block of `block_size` bytes (little-endian):
//!
//! ```text
//! 0..8    magic  b"ZEBUWKLD"
//! 8..16   run id       (which workload run wrote it)
//! 16..24  block index  (where it was meant to land)
//! 24..32  write sequence number (which write of that run)
//! 32..36  block size in bytes
//! 36..40  CRC-32C of the whole block, computed with these four bytes as zero
//! 40..    payload: a pseudo-random stream seeded by (run id, block, seq)
//! ```
//!
//! The header lets a verifier say *what* it found (another block's data, an older write, a
//! torn block) rather than only "mismatch"; the checksum over the whole block catches tears
//! and bit rot anywhere in it, and because the payload is deterministic a verifier can also
//! regenerate the exact block a header claims and compare byte for byte.

use serde::{Deserialize, Serialize};

use super::{BlockIndex, RunId, Seq};

pub const MAGIC: [u8; 8] = *b"ZEBUWKLD";
const HEADER_LEN: usize = 40;
const CRC_AT: std::ops::Range<usize> = 36..40;

/// What a stamped block claims about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    pub run: RunId,
    pub block: BlockIndex,
    pub seq: Seq,
}

/// What a block read back turned out to contain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Found {
    /// Every byte is zero (never written, or unmapped).
    Zeros,
    /// A complete, intact block written by the workload.
    Intact(Stamp),
    /// A workload header whose checksum or payload does not match: torn or corrupted.
    Corrupt { claimed: Stamp, reason: String },
    /// Neither zeros nor a workload block.
    Garbage,
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Zeros => write!(f, "zeros"),
            Found::Intact(s) => write!(
                f,
                "seq {} of block {} (run {:x})",
                s.seq.0, s.block.0, s.run.0
            ),
            Found::Corrupt { claimed, reason } => write!(
                f,
                "corrupt block claiming seq {} of block {} ({reason})",
                claimed.seq.0, claimed.block.0
            ),
            Found::Garbage => write!(f, "garbage (no workload header)"),
        }
    }
}

/// SplitMix64: tiny, fast and fully determined by its seed, which is all the payload needs.
pub(crate) struct SplitMix(pub u64);

impl SplitMix {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn payload_seed(s: Stamp) -> u64 {
    let mut m = SplitMix(s.run.0 ^ s.block.0.rotate_left(21) ^ s.seq.0.rotate_left(42));
    m.next_u64()
}

fn block_crc(buf: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&buf[..CRC_AT.start]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &buf[CRC_AT.end..])
}

/// Builds the full content of a block for `stamp`. `block_size` must be a multiple of 4096
/// (checked by the workload config), so it is a multiple of 8 too.
pub fn make_block(stamp: Stamp, block_size: usize) -> Vec<u8> {
    let mut buf = vec![0u8; block_size];
    buf[0..8].copy_from_slice(&MAGIC);
    buf[8..16].copy_from_slice(&stamp.run.0.to_le_bytes());
    buf[16..24].copy_from_slice(&stamp.block.0.to_le_bytes());
    buf[24..32].copy_from_slice(&stamp.seq.0.to_le_bytes());
    buf[32..36].copy_from_slice(&(block_size as u32).to_le_bytes());
    let mut rng = SplitMix(payload_seed(stamp));
    for chunk in buf[HEADER_LEN..].chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let crc = block_crc(&buf);
    buf[CRC_AT].copy_from_slice(&crc.to_le_bytes());
    buf
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("invariant: 8-byte slice"))
}

/// Classifies what a block read back contains.
pub fn inspect(buf: &[u8]) -> Found {
    if buf.iter().all(|&b| b == 0) {
        return Found::Zeros;
    }
    if buf.len() < HEADER_LEN || buf[0..8] != MAGIC {
        return Found::Garbage;
    }
    let claimed = Stamp {
        run: RunId(u64_at(buf, 8)),
        block: BlockIndex(u64_at(buf, 16)),
        seq: Seq(u64_at(buf, 24)),
    };
    let size = u32::from_le_bytes(buf[32..36].try_into().expect("invariant: 4-byte slice"));
    if size as usize != buf.len() {
        return Found::Corrupt {
            claimed,
            reason: format!("header says {size} bytes, block is {}", buf.len()),
        };
    }
    let stored = u32::from_le_bytes(buf[CRC_AT].try_into().expect("invariant: 4-byte slice"));
    let actual = block_crc(buf);
    if stored != actual {
        return Found::Corrupt {
            claimed,
            reason: format!("checksum {actual:08x} != stored {stored:08x}"),
        };
    }
    // A matching CRC could still hide a deliberately crafted block; regenerating is cheap.
    if make_block(claimed, buf.len()) != buf {
        return Found::Corrupt {
            claimed,
            reason: "payload differs from the regenerated block".into(),
        };
    }
    Found::Intact(claimed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(seq: u64) -> Stamp {
        Stamp {
            run: RunId(0xabc),
            block: BlockIndex(7),
            seq: Seq(seq),
        }
    }

    #[test]
    fn intact_block_round_trips() {
        let b = make_block(stamp(3), 8192);
        assert_eq!(inspect(&b), Found::Intact(stamp(3)));
        assert_ne!(make_block(stamp(3), 8192), make_block(stamp(4), 8192));
    }

    #[test]
    fn torn_and_garbage_blocks_are_told_apart() {
        let mut b = make_block(stamp(3), 8192);
        let other = make_block(stamp(4), 8192);
        b[4096..].copy_from_slice(&other[4096..]);
        assert!(matches!(inspect(&b), Found::Corrupt { claimed, .. } if claimed == stamp(3)));
        assert_eq!(inspect(&[0u8; 4096]), Found::Zeros);
        assert_eq!(inspect(&[1u8; 4096]), Found::Garbage);
    }
}
