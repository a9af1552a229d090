//! Chunk-map pages: which chunk sits at which volume offset, in content-addressed pieces.
//!
//! A backup's chunk map is cut into pages of [`PAGE_CHUNKS`] consecutive chunk slots (1 GiB
//! of volume with 1 MiB chunks). Each page is a blob of kind [`crate::blob::BlobKind::Map`]
//! stored in a pack like data, named by its hash; the manifest lists only page hashes. So:
//!
//! - An incremental backup rewrites only the pages its changes touch and names the parent's
//!   pages for the rest: its metadata costs what changed, not the volume's whole block list.
//! - Every manifest is complete by itself. A restore of backup N reads N's manifest and its
//!   pages, never the chain of parents, and deleting any backup never touches another one.
//! - Diffing two backups skips every page whose hash is equal without reading it.
//!
//! # Page layout (before compression, little-endian)
//!
//! ```text
//! count u32, then count × (slot u32 | hash [32]), slots strictly ascending, < PAGE_CHUNKS
//! ```
//!
//! A slot is relative to the page's first chunk; holes and all-zero chunks have no entry.

use crate::error::{BackupError, Result};
use crate::ids::ChunkHash;

/// Chunk slots per page.
pub const PAGE_CHUNKS: u64 = 1024;
const ENTRY: usize = 36;

/// One page: `(slot in page, chunk hash)`, ascending.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page(pub Vec<(u32, ChunkHash)>);

impl Page {
    /// The page's raw bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.0.len() * ENTRY);
        out.extend_from_slice(&(self.0.len() as u32).to_le_bytes());
        for (slot, h) in &self.0 {
            out.extend_from_slice(&slot.to_le_bytes());
            out.extend_from_slice(&h.0);
        }
        out
    }

    /// Parses and checks a page's raw bytes.
    pub fn decode(object: &str, raw: &[u8]) -> Result<Self> {
        let corrupt = |reason: &str| BackupError::CorruptObject {
            object: object.to_string(),
            reason: reason.into(),
        };
        if raw.len() < 4 {
            return Err(corrupt("map page too short"));
        }
        let n = u32::from_le_bytes(raw[..4].try_into().expect("invariant: 4 bytes")) as usize;
        if raw.len() != 4 + n * ENTRY {
            return Err(corrupt("map page length does not match its count"));
        }
        let mut v = Vec::with_capacity(n);
        let mut prev: Option<u32> = None;
        for e in raw[4..].chunks_exact(ENTRY) {
            let slot = u32::from_le_bytes(e[..4].try_into().expect("invariant: 4 bytes"));
            if u64::from(slot) >= PAGE_CHUNKS || prev.is_some_and(|p| p >= slot) {
                return Err(corrupt("map page slots out of order or range"));
            }
            prev = Some(slot);
            v.push((
                slot,
                ChunkHash(e[4..].try_into().expect("invariant: 32 bytes")),
            ));
        }
        Ok(Self(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_bad_ones_are_refused() {
        let p = Page(vec![
            (0, ChunkHash([1; 32])),
            (7, ChunkHash([2; 32])),
            (1023, ChunkHash([3; 32])),
        ]);
        assert_eq!(Page::decode("x", &p.encode()).unwrap(), p);
        assert_eq!(
            Page::decode("x", &Page::default().encode()).unwrap(),
            Page::default()
        );
        let unordered = Page(vec![(7, ChunkHash([2; 32])), (0, ChunkHash([1; 32]))]);
        assert!(Page::decode("x", &unordered.encode()).is_err());
        let out_of_range = Page(vec![(1024, ChunkHash([2; 32]))]);
        assert!(Page::decode("x", &out_of_range.encode()).is_err());
        assert!(Page::decode("x", &p.encode()[..40]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn page_decoding_never_panics(raw in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = Page::decode("x", &raw);
        }
    }
}
