//! Blobs: a chunk of volume data or a chunk-map page, hashed, compressed and verified.
//!
//! A blob's name is the blake3 hash of its uncompressed bytes; a reader decompresses and
//! re-hashes every blob it reads, so a flipped bit anywhere (in a pack, in transit, in a
//! cache) is an error naming the object and the chunk, never wrong data handed on.
//!
//! Compression: zstd at level 1 by default. Measured with `examples/backup_bench.rs` on a
//! 1 GiB mixed image (see `BENCH.md`): zstd-1 stored 551 MiB against lz4's 610 MiB (10 %
//! less) at about the same backup time (18.4 s against 17.3 s to moto in the same run).
//! A chunk that does not shrink by 1/32 is stored raw, and a probe of 64 KiB finds most
//! incompressible chunks before the whole chunk is tried, so random data costs 1/16 of a
//! compression attempt and nothing on restore. lz4 stays available
//! ([`Codec::Lz4`]) and is recorded per blob, so a store can mix them.

use bytes::Bytes;

use crate::ids::ChunkHash;

/// How a blob's bytes are stored in its pack (one byte in the pack index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Codec {
    Raw = 0,
    Zstd = 1,
    Lz4 = 2,
}

impl Codec {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Raw),
            1 => Some(Self::Zstd),
            2 => Some(Self::Lz4),
            _ => None,
        }
    }
}

/// What a blob holds (one byte in the pack index; GC and repack treat both alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BlobKind {
    /// Volume data: one chunk.
    Data = 0,
    /// A chunk-map page (see [`crate::map`]).
    Map = 1,
}

impl BlobKind {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Data),
            1 => Some(Self::Map),
            _ => None,
        }
    }
}

/// A blob ready to go into a pack.
#[derive(Clone, Debug)]
pub struct EncodedBlob {
    pub hash: ChunkHash,
    pub kind: BlobKind,
    pub codec: Codec,
    pub raw_len: u32,
    pub stored: Bytes,
}

/// True when every byte is zero (such chunks are stored as nothing: holes).
pub fn is_zero(data: &[u8]) -> bool {
    // Word-at-a-time over the aligned middle; the compiler vectorises the fold.
    let (head, mid, tail) = {
        // SAFETY: any bit pattern is a valid u64, and align_to keeps the bytes in bounds.
        unsafe { data.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0)
        && tail.iter().all(|&b| b == 0)
        && mid.iter().fold(0u64, |a, &w| a | w) == 0
}

/// Bytes of a chunk tried first to tell whether it compresses (see [`encode`]).
const PROBE_BYTES: usize = 64 << 10;
/// Chunks shorter than this are compressed without a probe.
const PROBE_ABOVE: usize = 4 * PROBE_BYTES;

/// Whether `raw` is worth compressing whole: zstd-1 over [`PROBE_BYTES`] taken from four
/// places of it saves at least 1/16. Random data (most of a volume full of compressed files,
/// media or encrypted blocks) is found out for 1/16 of the cost of compressing it whole, and
/// stored raw without a copy; data that compresses pays the probe (about 6 %) on top.
fn worth_compressing(raw: &[u8]) -> bool {
    if raw.len() < PROBE_ABOVE {
        return true;
    }
    let piece = PROBE_BYTES / 4;
    let step = (raw.len() - piece) / 3;
    let mut sample = Vec::with_capacity(PROBE_BYTES);
    for i in 0..4 {
        sample.extend_from_slice(&raw[i * step..i * step + piece]);
    }
    match zstd::bulk::compress(&sample, 1) {
        Ok(c) => c.len() < sample.len() - sample.len() / 16,
        Err(_) => true,
    }
}

/// Hashes and compresses `raw` (CPU work: call it off the async threads). A chunk that
/// does not shrink by 1/32 (or whose probe says it will not, see [`worth_compressing`]) is
/// stored raw: the returned blob then shares `raw`'s bytes.
pub fn encode(kind: BlobKind, raw: Bytes, codec: Codec, hash: Option<ChunkHash>) -> EncodedBlob {
    let hash = hash.unwrap_or_else(|| ChunkHash::of(&raw));
    let compressed = match codec {
        Codec::Raw => None,
        _ if !worth_compressing(&raw) => None,
        Codec::Zstd => zstd::bulk::compress(&raw, 1).ok(),
        Codec::Lz4 => Some(lz4_flex::block::compress(&raw)),
    };
    let raw_len = raw.len() as u32;
    // Keep the compressed form only when it saves at least 1/32.
    let (codec, stored) = match compressed {
        Some(c) if c.len() < raw.len() - raw.len() / 32 => (codec, Bytes::from(c)),
        _ => (Codec::Raw, raw),
    };
    EncodedBlob {
        hash,
        kind,
        codec,
        raw_len,
        stored,
    }
}

/// Decompresses a stored blob and checks it against its hash.
pub fn decode(
    stored: &[u8],
    codec: Codec,
    raw_len: u32,
    hash: &ChunkHash,
) -> Result<Bytes, String> {
    let raw: Vec<u8> = match codec {
        Codec::Raw => stored.to_vec(),
        Codec::Zstd => {
            zstd::bulk::decompress(stored, raw_len as usize).map_err(|e| format!("zstd: {e}"))?
        }
        Codec::Lz4 => lz4_flex::block::decompress(stored, raw_len as usize)
            .map_err(|e| format!("lz4: {e}"))?,
    };
    if raw.len() != raw_len as usize {
        return Err(format!("decoded {} bytes, index says {raw_len}", raw.len()));
    }
    let got = ChunkHash::of(&raw);
    if got != *hash {
        return Err(format!("content hashes to {got}"));
    }
    Ok(Bytes::from(raw))
}

/// [`decode`] of a blob already in a `Bytes`: a raw blob is checked and handed back without
/// a copy.
pub fn decode_bytes(
    stored: Bytes,
    codec: Codec,
    raw_len: u32,
    hash: &ChunkHash,
) -> Result<Bytes, String> {
    if codec != Codec::Raw {
        return decode(&stored, codec, raw_len, hash);
    }
    if stored.len() != raw_len as usize {
        return Err(format!(
            "stored {} bytes, index says {raw_len}",
            stored.len()
        ));
    }
    let got = ChunkHash::of(&stored);
    if got != *hash {
        return Err(format!("content hashes to {got}"));
    }
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_sees_one_set_bit_anywhere() {
        let mut v = vec![0u8; 4096 + 3];
        assert!(is_zero(&v));
        for i in [0, 1, 7, 8, 100, 4095, 4098] {
            v[i] = 1;
            assert!(!is_zero(&v[..]), "bit at {i} missed");
            assert!(!is_zero(&v[1..]) || i == 0);
            v[i] = 0;
        }
        assert!(is_zero(&[]));
    }

    #[test]
    fn the_probe_stores_random_chunks_raw_without_a_copy_and_compresses_text() {
        let random = Bytes::from(
            (0..1 << 20)
                .map(|_| rand::random::<u8>())
                .collect::<Vec<u8>>(),
        );
        assert!(!worth_compressing(&random));
        let b = encode(BlobKind::Data, random.clone(), Codec::Zstd, None);
        assert_eq!(b.codec, Codec::Raw);
        assert_eq!(
            b.stored.as_ptr(),
            random.as_ptr(),
            "raw blobs share the chunk's bytes"
        );
        // Text with a random quarter: the probe still sees text and the whole chunk shrinks.
        let mut mixed: Vec<u8> = (0..1 << 20)
            .map(|i: u32| b"zebu "[(i % 5) as usize])
            .collect();
        mixed[..1 << 18].copy_from_slice(&random[..1 << 18]);
        let b = encode(BlobKind::Data, Bytes::from(mixed), Codec::Zstd, None);
        assert_eq!(b.codec, Codec::Zstd);
        assert!(b.stored.len() < 300_000);
    }

    #[test]
    fn every_codec_round_trips_and_a_flipped_bit_is_caught() {
        let text: Vec<u8> = (0..1 << 20)
            .map(|i: u32| b"zebu backup "[(i % 12) as usize])
            .collect();
        let random: Vec<u8> = (0..1 << 20).map(|_| rand::random::<u8>()).collect();
        for codec in [Codec::Raw, Codec::Zstd, Codec::Lz4] {
            for raw in [&text, &random] {
                let b = encode(BlobKind::Data, Bytes::copy_from_slice(raw), codec, None);
                if raw == &random {
                    assert_eq!(b.codec, Codec::Raw, "incompressible data is stored raw");
                } else if codec != Codec::Raw {
                    assert!(b.stored.len() < raw.len() / 10);
                }
                assert_eq!(
                    &decode(&b.stored, b.codec, b.raw_len, &b.hash).unwrap()[..],
                    &raw[..]
                );
                let mut bad = b.stored.to_vec();
                let mid = bad.len() / 2;
                bad[mid] ^= 0x10;
                assert!(decode(&bad, b.codec, b.raw_len, &b.hash).is_err());
            }
        }
    }
}
