//! Turning "what changed since the parent" into whole chunks to read and chunks now zero.
//!
//! The glue knows changes at block granularity (the snapshot chain's extents, unmapped
//! ranges); the writer takes whole chunks. [`plan_chunks`] widens changed ranges to chunk
//! boundaries and merges them (so the glue reads each changed chunk once, in large
//! sequential reads), and keeps a zeroed range only for chunks it covers entirely: a chunk
//! that is partly unmapped and partly data must be read.

use std::ops::Range;

/// What an incremental backup must read and what it may record as holes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Chunk-aligned byte ranges to read and hand to the writer, ascending, merged.
    pub read: Vec<Range<u64>>,
    /// Chunk-aligned byte ranges that are now entirely zero, ascending, merged, disjoint from
    /// `read`.
    pub zero: Vec<Range<u64>>,
}

impl ChunkPlan {
    /// Bytes to read.
    pub fn read_bytes(&self) -> u64 {
        self.read.iter().map(|r| r.end - r.start).sum()
    }
}

fn merge(mut v: Vec<Range<u64>>) -> Vec<Range<u64>> {
    v.retain(|r| r.start < r.end);
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Plans an incremental backup of a `volume_size` volume with `chunk_size` chunks.
pub fn plan_chunks(
    volume_size: u64,
    chunk_size: u64,
    changed: &[Range<u64>],
    zeroed: &[Range<u64>],
) -> ChunkPlan {
    let clamp = |r: &Range<u64>| r.start.min(volume_size)..r.end.min(volume_size);
    let up = |x: u64| {
        x.div_ceil(chunk_size)
            .saturating_mul(chunk_size)
            .min(volume_size)
    };
    let down = |x: u64| x / chunk_size * chunk_size;
    let mut read: Vec<Range<u64>> = changed
        .iter()
        .map(clamp)
        .filter(|r| r.start < r.end)
        .map(|r| down(r.start)..up(r.end))
        .collect();
    let mut zero = Vec::new();
    // Merged first: two adjacent unmaps can cover a chunk that neither covers alone.
    for r in merge(zeroed.iter().map(clamp).collect()) {
        // The last chunk may be short: a range reaching the volume's end covers it.
        let (a, b) = (
            up(r.start),
            if r.end == volume_size {
                volume_size
            } else {
                down(r.end)
            },
        );
        if a < b {
            zero.push(a..b);
        }
        // Partly covered edge chunks hold data as well: read them.
        if r.start % chunk_size != 0 {
            read.push(down(r.start)..up(r.start));
        }
        if r.end != volume_size && r.end % chunk_size != 0 {
            read.push(down(r.end)..up(r.end));
        }
    }
    let read = merge(read);
    // Reading wins over zeroing: cut the read ranges out of the zero ranges.
    let mut cut = Vec::new();
    for z in merge(zero) {
        let mut start = z.start;
        for r in read.iter().filter(|r| r.start < z.end && r.end > z.start) {
            if r.start > start {
                cut.push(start..r.start);
            }
            start = start.max(r.end);
        }
        if start < z.end {
            cut.push(start..z.end);
        }
    }
    ChunkPlan {
        read,
        zero: merge(cut),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Per chunk: 2 = read, 1 = zero, 0 = untouched, computed the slow way.
    fn naive(volume: u64, cs: u64, changed: &[Range<u64>], zeroed: &[Range<u64>]) -> Vec<u8> {
        let n = volume.div_ceil(cs);
        (0..n)
            .map(|c| {
                let (s, e) = (c * cs, ((c + 1) * cs).min(volume));
                let touches = |r: &Range<u64>| r.start < e && r.end > s && r.start < r.end;
                if changed.iter().any(touches) {
                    return 2;
                }
                let zero_bytes: Vec<bool> = (s..e)
                    .map(|b| zeroed.iter().any(|r| r.start <= b && b < r.end))
                    .collect();
                if zero_bytes.iter().all(|&z| z) {
                    1
                } else if zero_bytes.iter().any(|&z| z) {
                    2
                } else {
                    0
                }
            })
            .collect()
    }

    fn classify(volume: u64, cs: u64, p: &ChunkPlan) -> Vec<u8> {
        let n = volume.div_ceil(cs);
        let mut v = vec![0u8; n as usize];
        for (set, val) in [(&p.zero, 1u8), (&p.read, 2u8)] {
            for r in set {
                assert_eq!(r.start % cs, 0, "{r:?} unaligned");
                assert!(r.end % cs == 0 || r.end == volume, "{r:?} unaligned");
                for c in r.start / cs..r.end.div_ceil(cs) {
                    assert_eq!(v[c as usize], 0, "chunk {c} planned twice");
                    v[c as usize] = val;
                }
            }
        }
        v
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one range of bytes, not a Vec of numbers
    fn a_partly_unmapped_chunk_is_read_and_a_whole_one_is_zeroed() {
        let p = plan_chunks(
            10 << 20,
            1 << 20,
            &[4096..8192],
            &[(1 << 20) + 4096..(4 << 20)],
        );
        assert_eq!(p.read, vec![0..(2 << 20)]);
        assert_eq!(p.zero, vec![(2 << 20)..(4 << 20)]);
    }

    proptest! {
        #[test]
        fn plan_matches_a_naive_model(
            volume in 1u64..40_000,
            cs in prop::sample::select(vec![512u64, 1000, 4096]),
            changed in prop::collection::vec((0u64..45_000, 0u64..5_000), 0..6),
            zeroed in prop::collection::vec((0u64..45_000, 0u64..20_000), 0..6),
        ) {
            let changed: Vec<_> = changed.into_iter().map(|(s, l)| s..s + l).collect();
            let zeroed: Vec<_> = zeroed.into_iter().map(|(s, l)| s..s + l).collect();
            let p = plan_chunks(volume, cs, &changed, &zeroed);
            let clamp: Vec<_> = zeroed.iter().map(|r| r.start.min(volume)..r.end.min(volume)).collect();
            prop_assert_eq!(classify(volume, cs, &p), naive(volume, cs, &changed, &clamp));
        }
    }
}
