//! A snapshot's layer chain and which layer a block of the snapshot is read from.
//!
//! A replica keeps a volume as a chain of layers, oldest first; the head is the newest and
//! the only one that changes. The volume as of snapshot `S` is the chain from the oldest
//! layer up to `S`: a block reads from the newest of those layers that holds data for it
//! (zeros a layer holds are data: they hide what older layers hold), and as zeros where none
//! does. Each layer's own data extents come from `ListExtents`, so the backup reads exactly
//! the bytes the snapshot consists of, layer by layer, without ever reading a hole.
//!
//! [`Chain`] is that list for one snapshot on one replica: names (equal on every replica of
//! the volume) and ids (each replica's own), and [`Chain::extents`] once loaded.
//! [`resolve`] splits a window of the volume into the pieces each layer supplies;
//! [`union`] is what an incremental backup reads: every extent written since an older
//! snapshot of the same chain.

use std::collections::HashMap;
use std::ops::Range;

use zebu_proto::replica as pb;

/// The layers a snapshot consists of on one replica, oldest first; the last is the snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub names: Vec<String>,
    /// Each layer's id on this replica, to tell whether the chain changed under a read
    /// (a snapshot delete merges a layer into its child: an id disappears).
    pub ids: Vec<u64>,
    /// The snapshot's size (the volume's size when it was taken).
    pub size: u64,
}

/// Why a chain cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("snapshot {0:?} does not exist on the replica")]
    NoSnapshot(String),
    #[error("snapshot {snapshot:?}: layer {layer:?} is incomplete (a rebuild is writing it)")]
    Incomplete { snapshot: String, layer: String },
    #[error("snapshot {0:?}: its parent chain is broken")]
    Broken(String),
}

impl Chain {
    /// The chain of `snapshot` in a replica's Info.
    pub fn of(info: &pb::InfoResponse, snapshot: &str) -> Result<Chain, ChainError> {
        let by_id: HashMap<u64, &pb::LayerInfo> = info.layers.iter().map(|l| (l.id, l)).collect();
        let top = info
            .layers
            .iter()
            .find(|l| !l.head && l.name == snapshot)
            .ok_or_else(|| ChainError::NoSnapshot(snapshot.to_string()))?;
        let mut rev = vec![top];
        let mut at = top;
        while at.parent != 0 {
            at = by_id
                .get(&at.parent)
                .copied()
                .ok_or_else(|| ChainError::Broken(snapshot.to_string()))?;
            if rev.len() > info.layers.len() {
                return Err(ChainError::Broken(snapshot.to_string()));
            }
            rev.push(at);
        }
        rev.reverse();
        if let Some(l) = rev.iter().find(|l| l.incomplete) {
            return Err(ChainError::Incomplete {
                snapshot: snapshot.to_string(),
                layer: l.name.clone(),
            });
        }
        Ok(Chain {
            names: rev.iter().map(|l| l.name.clone()).collect(),
            ids: rev.iter().map(|l| l.id).collect(),
            size: top.size,
        })
    }

    /// The position of an older snapshot in this chain, if it is one of its layers.
    pub fn position(&self, snapshot: &str) -> Option<usize> {
        self.names.iter().position(|n| n == snapshot)
    }
}

/// Sorted, disjoint ranges merged into one sorted, disjoint list.
pub fn union(lists: &[&[Range<u64>]]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = lists
        .iter()
        .flat_map(|l| l.iter().cloned())
        .filter(|r| r.start < r.end)
        .collect();
    all.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(all.len());
    for r in all {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// The pieces of `window` each layer supplies: `(layer index, range)`, ascending by offset,
/// newest layer winning; parts of the window no layer holds are left out (they read as
/// zeros). `extents[i]` are layer `i`'s data extents, sorted and disjoint; the last layer is
/// the newest.
pub fn resolve(extents: &[Vec<Range<u64>>], window: Range<u64>) -> Vec<(usize, Range<u64>)> {
    let mut uncovered = vec![window.clone()];
    let mut out = Vec::new();
    for (layer, ext) in extents.iter().enumerate().rev() {
        if uncovered.is_empty() {
            break;
        }
        // The first extent that ends after the window starts.
        let first = ext.partition_point(|e| e.end <= window.start);
        for e in ext[first..].iter().take_while(|e| e.start < window.end) {
            let mut next = Vec::with_capacity(uncovered.len() + 1);
            for u in uncovered {
                let (a, b) = (u.start.max(e.start), u.end.min(e.end));
                if a >= b {
                    next.push(u);
                    continue;
                }
                out.push((layer, a..b));
                if u.start < a {
                    next.push(u.start..a);
                }
                if b < u.end {
                    next.push(b..u.end);
                }
            }
            uncovered = next;
        }
    }
    out.sort_by_key(|(_, r)| r.start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layer(id: u64, name: &str, parent: u64, head: bool) -> pb::LayerInfo {
        pb::LayerInfo {
            id,
            name: name.into(),
            parent,
            head,
            size: 1 << 20,
            ..Default::default()
        }
    }

    #[test]
    fn the_chain_of_a_snapshot_stops_at_it_and_skips_branches() {
        let info = pb::InfoResponse {
            layers: vec![
                layer(1, "a", 0, false),
                layer(2, "b", 1, false),
                layer(5, "c", 2, false),
                layer(6, "", 5, true),
                // A branch left by a revert to "a".
                layer(3, "x", 1, false),
            ],
            ..Default::default()
        };
        let c = Chain::of(&info, "b").expect("chain");
        assert_eq!(c.names, ["a", "b"]);
        assert_eq!(c.ids, [1, 2]);
        assert_eq!(Chain::of(&info, "x").expect("chain").names, ["a", "x"]);
        assert_eq!(c.position("a"), Some(0));
        assert_eq!(c.position("c"), None);
        assert_eq!(
            Chain::of(&info, "nope"),
            Err(ChainError::NoSnapshot("nope".into()))
        );
        let mut broken = info.clone();
        broken.layers[0].incomplete = true;
        assert!(matches!(
            Chain::of(&broken, "c"),
            Err(ChainError::Incomplete { .. })
        ));
    }

    /// Per byte: the newest layer holding it, computed the slow way.
    fn naive(extents: &[Vec<Range<u64>>], window: &Range<u64>) -> Vec<Option<usize>> {
        window
            .clone()
            .map(|b| {
                (0..extents.len())
                    .rev()
                    .find(|&l| extents[l].iter().any(|e| e.start <= b && b < e.end))
            })
            .collect()
    }

    fn sorted_disjoint(v: Vec<(u64, u64)>) -> Vec<Range<u64>> {
        union(&[&v.into_iter().map(|(s, l)| s..s + l).collect::<Vec<_>>()])
    }

    proptest! {
        #[test]
        fn resolve_matches_a_naive_model(
            layers in prop::collection::vec(prop::collection::vec((0u64..300, 1u64..40), 0..6), 1..5),
            start in 0u64..300,
            len in 0u64..200,
        ) {
            let extents: Vec<Vec<Range<u64>>> = layers.into_iter().map(sorted_disjoint).collect();
            let window = start..start + len;
            let pieces = resolve(&extents, window.clone());
            let mut got = vec![None; len as usize];
            let mut last_end = window.start;
            for (l, r) in &pieces {
                prop_assert!(r.start >= last_end, "pieces overlap or are unsorted: {:?}", pieces);
                last_end = r.end;
                for b in r.clone() {
                    got[(b - window.start) as usize] = Some(*l);
                }
            }
            prop_assert_eq!(got, naive(&extents, &window));
        }

        #[test]
        fn union_covers_exactly_its_inputs(
            a in prop::collection::vec((0u64..300, 0u64..40), 0..6),
            b in prop::collection::vec((0u64..300, 0u64..40), 0..6),
        ) {
            let (a, b) = (sorted_disjoint(a), sorted_disjoint(b));
            let u = union(&[&a, &b]);
            for w in u.windows(2) {
                prop_assert!(w[0].end < w[1].start);
            }
            for x in 0..400u64 {
                let inside = |v: &[Range<u64>]| v.iter().any(|r| r.contains(&x));
                prop_assert_eq!(inside(&u), inside(&a) || inside(&b));
            }
        }
    }
}
