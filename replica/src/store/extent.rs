//! A map from block ranges to values, stored as extents.
//!
//! The replica's "which layer holds this block" index is an [`ExtentMap`]: its size grows
//! with the number of separately written ranges, not with the volume size, so a 1 TiB volume
//! with little data costs little memory. Adjacent ranges with the same value are merged, so a
//! sequentially written file is one entry.
//!
//! Invariants (checked by [`ExtentMap::check`] in tests): extents are non-empty, do not
//! overlap, and no two touching extents carry the same value.

use std::collections::BTreeMap;
use std::ops::Range;

/// Non-overlapping `start..end` ranges of `u64` (block numbers) each carrying a `V`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtentMap<V> {
    /// start -> (end, value)
    map: BTreeMap<u64, (u64, V)>,
    /// Sum of the lengths of all extents.
    covered: u64,
}

impl<V: Copy + Eq> ExtentMap<V> {
    pub fn new() -> Self {
        ExtentMap {
            map: BTreeMap::new(),
            covered: 0,
        }
    }

    /// Number of extents (a measure of memory use).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Total length covered by extents.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// Every extent in order.
    pub fn iter(&self) -> impl Iterator<Item = (Range<u64>, V)> + '_ {
        self.map.iter().map(|(&s, &(e, v))| (s..e, v))
    }

    /// The value at one point.
    pub fn get(&self, at: u64) -> Option<V> {
        let (_, &(end, v)) = self.map.range(..=at).next_back()?;
        (at < end).then_some(v)
    }

    /// Whether all of `range` (non-empty) already carries `v`. Touching extents of the same
    /// value are merged, so that is one extent: one lookup. Lets a write that overwrites data
    /// already in the head skip the index update (and its exclusive lock) altogether.
    pub fn holds(&self, range: Range<u64>, v: V) -> bool {
        if range.is_empty() {
            return true;
        }
        self.map
            .range(..=range.start)
            .next_back()
            .is_some_and(|(_, &(end, value))| end >= range.end && value == v)
    }

    /// Splits the extent containing `at` (if any, and if `at` is inside it) so that an extent
    /// boundary falls on `at`.
    fn split_at(&mut self, at: u64) {
        let Some((&start, &(end, v))) = self.map.range(..at).next_back() else {
            return;
        };
        if start < at && at < end {
            self.map.insert(start, (at, v));
            self.map.insert(at, (end, v));
        }
    }

    /// Removes every value in `range`.
    pub fn remove(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        let inside: Vec<u64> = self
            .map
            .range(range.start..range.end)
            .map(|(&s, _)| s)
            .collect();
        for s in inside {
            if let Some((e, _)) = self.map.remove(&s) {
                self.covered -= e - s;
            }
        }
    }

    /// Sets `range` to `v`, replacing whatever was there.
    pub fn insert(&mut self, range: Range<u64>, v: V) {
        if range.is_empty() {
            return;
        }
        self.remove(range.clone());
        let (mut start, mut end) = (range.start, range.end);
        // Merge with a touching predecessor or successor of the same value.
        if let Some((&ps, &(pe, pv))) = self.map.range(..start).next_back()
            && pe == start
            && pv == v
        {
            self.map.remove(&ps);
            self.covered -= pe - ps;
            start = ps;
        }
        if let Some(&(ne, nv)) = self.map.get(&end)
            && nv == v
        {
            self.map.remove(&end);
            self.covered -= ne - end;
            end = ne;
        }
        self.map.insert(start, (end, v));
        self.covered += end - start;
    }

    /// The pieces of `range` in order: extents clipped to it, and the gaps between them as
    /// `None`. The pieces exactly tile `range`.
    pub fn segments(&self, range: Range<u64>) -> Vec<(Range<u64>, Option<V>)> {
        let mut out = Vec::new();
        let mut pos = range.start;
        if range.is_empty() {
            return out;
        }
        let first = match self.map.range(..=range.start).next_back() {
            Some((&s, &(e, _))) if e > range.start => s,
            _ => range.start,
        };
        for (&s, &(e, v)) in self.map.range(first..range.end) {
            let s = s.max(range.start);
            let e = e.min(range.end);
            if s > pos {
                out.push((pos..s, None));
            }
            out.push((s..e, Some(v)));
            pos = e;
        }
        if pos < range.end {
            out.push((pos..range.end, None));
        }
        out
    }

    /// Sets `v` on the parts of `range` that are empty or whose value `replace` accepts.
    pub fn fill_under(&mut self, range: Range<u64>, v: V, replace: impl Fn(V) -> bool) {
        for (piece, old) in self.segments(range) {
            if old.is_none_or(&replace) {
                self.insert(piece, v);
            }
        }
    }

    /// Panics if an invariant is broken. For tests.
    pub fn check(&self) {
        let mut prev: Option<(u64, V)> = None;
        let mut covered = 0;
        for (&s, &(e, v)) in &self.map {
            assert!(s < e, "empty extent {s}..{e}");
            if let Some((pe, pv)) = prev {
                assert!(pe <= s, "overlap at {s}");
                assert!(!(pe == s && pv == v), "unmerged neighbours at {s}");
            }
            covered += e - s;
            prev = Some((e, v));
        }
        assert_eq!(covered, self.covered, "covered count drifted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64, u8),
        Remove(u64, u64),
        FillUnder(u64, u64, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..200u64, 0..40u64, 0..4u8).prop_map(|(s, l, v)| Op::Insert(s, l, v)),
            (0..200u64, 0..40u64).prop_map(|(s, l)| Op::Remove(s, l)),
            (0..200u64, 0..40u64, 0..4u8).prop_map(|(s, l, v)| Op::FillUnder(s, l, v)),
        ]
    }

    proptest! {
        /// The map agrees with a byte-per-block model after any sequence of operations.
        #[test]
        fn matches_naive_model(ops in proptest::collection::vec(op(), 1..60)) {
            let mut map = ExtentMap::new();
            let mut model: Vec<Option<u8>> = vec![None; 256];
            for op in ops {
                match op {
                    Op::Insert(s, l, v) => {
                        map.insert(s..s + l, v);
                        for b in s..s + l { model[b as usize] = Some(v); }
                    }
                    Op::Remove(s, l) => {
                        map.remove(s..s + l);
                        for b in s..s + l { model[b as usize] = None; }
                    }
                    Op::FillUnder(s, l, v) => {
                        // Replace values lower than v, as the layer index does by rank.
                        map.fill_under(s..s + l, v, |old| old < v);
                        for b in s..s + l {
                            let m = &mut model[b as usize];
                            if m.is_none_or(|old| old < v) { *m = Some(v); }
                        }
                    }
                }
                map.check();
            }
            for (b, want) in model.iter().enumerate() {
                prop_assert_eq!(map.get(b as u64), *want, "block {}", b);
            }
            let segs = map.segments(10..250);
            let mut pos = 10;
            for (r, v) in segs {
                prop_assert_eq!(r.start, pos);
                for b in r.clone() { prop_assert_eq!(model[b as usize], v); }
                pos = r.end;
            }
            prop_assert_eq!(pos, 250);
            for (s, l) in [(0u64, 1u64), (10, 5), (20, 40), (100, 3), (199, 20)] {
                for v in 0..4u8 {
                    let want = (s..s + l).all(|b| model[b as usize] == Some(v));
                    prop_assert_eq!(map.holds(s..s + l, v), want, "holds {}+{} {}", s, l, v);
                }
            }
            prop_assert_eq!(map.covered(), model.iter().filter(|m| m.is_some()).count() as u64);
        }
    }

    #[test]
    fn sequential_writes_merge_into_one_extent() {
        let mut map = ExtentMap::new();
        for b in 0..1000 {
            map.insert(b..b + 1, 7u32);
        }
        assert_eq!(map.len(), 1);
        assert_eq!(map.covered(), 1000);
    }
}
