//! Pure planning of growth: where a new contiguous range goes, and which
//! physical chunks back it. No driver, no pool state: tested on its own.
//!
//! ```text
//!   before:  [used|free tail T]..........unmapped..........[unit]
//!   grow q:  [used|free tail T|<-- need = q - |T| -->]      [unit]
//!                              ^ backed by whole chunks: spare ones, then
//!                                free units moved from elsewhere, then new
//! ```
//!
//! Chunks map whole (the driver maps nothing smaller), so the chunks chosen
//! may cover more than the need; the excess is free space at the target.
//!
//! A bridge instead maps chunks into the unmapped holes between free
//! blocks, so that they join into one:
//!
//! ```text
//!   before:  [used|free A]  hole  [free B]  hole  [free C|used]
//!   bridge:  [used|free A][chunks][free B][chunks][free C|used]
//!                  \______ one free block of A + B + C + holes _/
//! ```

use rustc_hash::FxHashSet;

mod sizes;

pub use sizes::Sizes;

/// Where new chunks will be mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// First byte of the new range.
    pub start: u64,
    /// Size of the free block the range extends (0 for a fresh range), which
    /// starts at `start - extends`.
    pub extends: u64,
}

/// One chunk backing the new range, in mapping order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A spare chunk of `size` bytes (held by the pool, used by nothing).
    Spare { size: u64 },
    /// The free unit at `va`: unmap it and map it here.
    Unit { va: u64, size: u64 },
    /// A new chunk.
    New { size: u64 },
}

impl Source {
    pub fn size(&self) -> u64 {
        match *self {
            Source::Spare { size } | Source::Unit { size, .. } | Source::New { size } => size,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub target: Target,
    pub sources: Vec<Source>,
}

impl Plan {
    /// Bytes the new range spans.
    pub fn len(&self) -> u64 {
        self.sources.iter().map(Source::size).sum()
    }

    /// Bytes of new chunks it creates.
    pub fn created(&self) -> u64 {
        created(&self.sources)
    }
}

/// A free block that ends a mapped region, and the unmapped room after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tail {
    pub start: u64,
    pub len: u64,
    pub room_after: u64,
}

/// An unmapped range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub start: u64,
    pub len: u64,
}

/// A free unit (no live byte) that may move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitSize {
    pub va: u64,
    pub size: u64,
}

/// A mapped range in address order, with its free ends: the free block
/// it starts with and the one it ends with (0: none; `len` both when all
/// of it is free). A range growth may not join (a moved unit's old
/// mapping) has no free end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub start: u64,
    pub len: u64,
    pub head: u64,
    pub tail: u64,
}

/// Room for a request made by mapping chunks into the unmapped holes
/// between free blocks, each hole filled exactly, so that the free blocks
/// and the holes join into one free range of at least the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bridge {
    /// The holes, in address order, each with the chunks that fill it.
    pub holes: Vec<(Gap, Vec<Source>)>,
    /// Free units from outside the run to release first, as many bytes as
    /// the new chunks take where the pool holds them: what fills the
    /// holes is then memory the pool had, in the sizes the holes need.
    pub release: Vec<UnitSize>,
}

impl Bridge {
    /// Bytes mapped into the holes.
    pub fn len(&self) -> u64 {
        self.holes.iter().map(|(g, _)| g.len).sum()
    }

    /// Bytes of new chunks it creates beyond those it releases.
    pub fn created(&self) -> u64 {
        let released: u64 = self.release.iter().map(|u| u.size).sum();
        created(self.holes.iter().flat_map(|(_, sources)| sources)).saturating_sub(released)
    }
}

/// Bytes of the new chunks among `sources`.
fn created<'a>(sources: impl IntoIterator<Item = &'a Source>) -> u64 {
    sources
        .into_iter()
        .filter_map(|s| match *s {
            Source::New { size } => Some(size),
            _ => None,
        })
        .sum()
}

/// What the pool holds that growth may use.
pub struct Inputs<'a> {
    /// The mapped ranges, in address order, for bridges.
    pub mapped: &'a [Mapped],
    pub tails: &'a [Tail],
    /// In address order.
    pub gaps: &'a [Gap],
    /// The spare chunks' sizes.
    pub spares: Sizes,
    /// In the order to move them where sizes tie.
    pub units: &'a [UnitSize],
    pub granule: u64,
    /// Largest chunk a growth creates.
    pub chunk_size: u64,
}

/// A place a new range could go: where, how many bytes it must map there,
/// how many it may, and the units that may back it.
struct Candidate {
    target: Target,
    need: u64,
    room: u64,
    units: Vec<UnitSize>,
}

/// Plans room for a `request`-byte allocation: extend the free tail that
/// needs the least new mapping, else use the first gap that fits; back it
/// with spare chunks, then free units, then new chunks. `None` when no
/// place in the address space can hold it.
pub fn plan_growth(request: u64, inputs: &Inputs<'_>) -> Option<Plan> {
    let mut tails: Vec<(Tail, u64)> = inputs
        .tails
        .iter()
        .filter(|t| t.len < request)
        .map(|&t| (t, (request - t.len).next_multiple_of(inputs.granule)))
        .filter(|&(t, need)| need <= t.room_after)
        .collect();
    tails.sort_by_key(|&(_, need)| need);
    let extend = tails.into_iter().map(|(t, need)| {
        let own = |u: &&UnitSize| !(t.start..t.start + t.len).contains(&u.va);
        Candidate {
            target: Target {
                start: t.start + t.len,
                extends: t.len,
            },
            need,
            room: t.room_after,
            units: inputs.units.iter().filter(own).copied().collect(),
        }
    });
    let fresh = inputs.gaps.iter().map(|g| Candidate {
        target: Target {
            start: g.start,
            extends: 0,
        },
        need: request.next_multiple_of(inputs.granule),
        room: g.len,
        units: inputs.units.to_vec(),
    });
    extend
        .chain(fresh)
        .filter(|c| c.need <= c.room)
        .find_map(|c| {
            let sources = plan_sources(c.need, &inputs.spares, &c.units, inputs.chunk_size);
            let plan = Plan {
                target: c.target,
                sources,
            };
            (plan.len() <= c.room).then_some(plan)
        })
}

/// Room for `request` bytes by bridging (see [`Bridge`]): among the runs
/// of free blocks separated only by holes, whose bytes and holes together
/// hold the request, the one with the fewest bytes of holes; `None` when
/// no run holds it. The request takes the run's start; each hole in that
/// window is filled with spare chunks, then free units from outside the
/// window, then new chunks, none larger than what is left of the hole (a
/// hole has mapped memory on both sides). Free units from outside the
/// window among `releasable` (those no stream may still use) are released
/// for as many bytes as the new chunks take.
pub fn plan_bridge(request: u64, inputs: &Inputs<'_>, releasable: &[UnitSize]) -> Option<Bridge> {
    let mapped = inputs.mapped;
    // (hole bytes, index of the run's first range, of its last).
    let mut best: Option<(u64, usize, usize)> = None;
    for (i, first) in mapped.iter().enumerate() {
        if first.tail == 0 {
            continue;
        }
        let (mut have, mut holes, mut end) = (first.tail, 0, first.start + first.len);
        for (j, next) in mapped.iter().enumerate().skip(i + 1) {
            if next.head == 0 {
                break;
            }
            holes += next.start - end;
            let whole = next.head == next.len;
            have += (next.start - end) + next.head;
            if have >= request {
                if best.is_none_or(|(b, _, _)| holes < b) {
                    best = Some((holes, i, j));
                }
                break;
            }
            if !whole {
                break;
            }
            end = next.start + next.len;
        }
    }
    let (_, i, j) = best?;
    // The request goes at the run's start; what of the run lies past it
    // is free memory like any other, its units free to move or go, its
    // holes left.
    let start = mapped[i].start + mapped[i].len - mapped[i].tail;
    let window = start..start + request;
    let mut spares = inputs.spares.clone();
    let mut units: Vec<(u64, u64)> = inputs
        .units
        .iter()
        .filter(|u| u.va + u.size <= window.start || u.va >= window.end)
        .map(|u| (u.va, u.size))
        .collect();
    let holes: Vec<(Gap, Vec<Source>)> = mapped[i..=j]
        .windows(2)
        .map(|w| Gap {
            start: w[0].start + w[0].len,
            len: w[1].start - (w[0].start + w[0].len),
        })
        .filter(|hole| hole.len > 0 && hole.start < window.end)
        .map(|hole| {
            let mut left = hole.len;
            let mut sources = Vec::new();
            while let Some(size) = spares.take_largest_within(left) {
                sources.push(Source::Spare { size });
                left -= size;
            }
            while let Some(pick) = largest_within(&units, left) {
                let (va, size) = units.remove(pick);
                sources.push(Source::Unit { va, size });
                left -= size;
            }
            sources.extend(new_chunks(left, inputs.chunk_size));
            (hole, sources)
        })
        .collect();
    let mut new = created(holes.iter().flat_map(|(_, sources)| sources));
    let mut release = Vec::new();
    // Only units no stream may still use can go; those left unmoved.
    let releasable: FxHashSet<u64> = releasable.iter().map(|u| u.va).collect();
    let mut units: Vec<(u64, u64)> = units
        .into_iter()
        .filter(|(va, _)| releasable.contains(va))
        .collect();
    while new > 0 {
        let Some(pick) = best_cover(&units, new) else {
            break;
        };
        let (va, size) = units.remove(pick);
        release.push(UnitSize { va, size });
        new = new.saturating_sub(size);
    }
    Some(Bridge { holes, release })
}

/// Index of the largest item of at most `left` bytes; the first such.
fn largest_within<K>(items: &[(K, u64)], left: u64) -> Option<usize> {
    items
        .iter()
        .enumerate()
        .filter(|(_, &(_, size))| size <= left)
        .max_by_key(|&(i, &(_, size))| (size, std::cmp::Reverse(i)))
        .map(|(i, _)| i)
}

/// Whole chunks covering `need` bytes: spare ones first (no driver call to
/// free them), then free units moved from elsewhere, then new ones of at
/// most `chunk_size` (a granule multiple) each. Spares go as new chunks
/// would: for each piece of at most `chunk_size`, the smallest spare that
/// covers it without passing `chunk_size`, else the largest within it; a
/// spare larger than `chunk_size` only where no other is left. So a pool
/// whose chunks are all spare after a fresh start lays out with them as it
/// did with new ones from empty (Note [Starting afresh]). Units go by the
/// smallest that covers what is left, else the largest, so few move and
/// little is over-covered; among equal sizes, the first in the order
/// given. Nothing is created while unused memory would do.
pub fn plan_sources(need: u64, spares: &Sizes, units: &[UnitSize], chunk_size: u64) -> Vec<Source> {
    let mut left = need;
    let mut plan = Vec::new();
    let mut spare_left = spares.clone();
    while left > 0 {
        let piece = left.min(chunk_size);
        let Some(size) = spare_left
            .take_smallest_in(piece, chunk_size)
            .or_else(|| spare_left.take_largest_within(piece))
            .or_else(|| spare_left.take_best_cover(left))
        else {
            break;
        };
        plan.push(Source::Spare { size });
        left = left.saturating_sub(size);
    }
    let mut unit_left: Vec<(u64, u64)> = units.iter().map(|u| (u.va, u.size)).collect();
    while left > 0 {
        let Some(pick) = best_cover(&unit_left, left) else {
            break;
        };
        let (va, size) = unit_left.remove(pick);
        plan.push(Source::Unit { va, size });
        left = left.saturating_sub(size);
    }
    plan.extend(new_chunks(left, chunk_size));
    plan
}

/// New chunks for `left` bytes, each of at most `chunk_size`.
fn new_chunks(mut left: u64, chunk_size: u64) -> impl Iterator<Item = Source> {
    std::iter::from_fn(move || {
        (left > 0).then(|| {
            let size = left.min(chunk_size);
            left -= size;
            Source::New { size }
        })
    })
}

/// Index of the smallest item of at least `left` bytes, else of the
/// largest; the first such.
fn best_cover<K>(items: &[(K, u64)], left: u64) -> Option<usize> {
    let covering = items
        .iter()
        .enumerate()
        .filter(|(_, &(_, size))| size >= left)
        .min_by_key(|&(i, &(_, size))| (size, i));
    covering
        .or_else(|| {
            items
                .iter()
                .enumerate()
                .max_by_key(|&(i, &(_, size))| (size, std::cmp::Reverse(i)))
        })
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const G: u64 = 2 << 20;

    fn tail(start: u64, len: u64, room_after: u64) -> Tail {
        Tail {
            start,
            len,
            room_after,
        }
    }

    fn gap(start: u64, len: u64) -> Gap {
        Gap { start, len }
    }

    fn unit(va: u64, size: u64) -> UnitSize {
        UnitSize { va, size }
    }

    fn inputs<'a>(
        tails: &'a [Tail],
        gaps: &'a [Gap],
        spares: &'a [u64],
        units: &'a [UnitSize],
    ) -> Inputs<'a> {
        Inputs {
            mapped: &[],
            tails,
            gaps,
            spares: sizes(spares),
            units,
            granule: G,
            chunk_size: 16 * G,
        }
    }

    fn sizes(of: &[u64]) -> Sizes {
        Sizes::of(of.iter().map(|&size| (size, 1)))
    }

    fn mapped(start: u64, len: u64, head: u64, tail: u64) -> Mapped {
        Mapped {
            start,
            len,
            head,
            tail,
        }
    }

    #[test]
    fn a_bridge_fills_the_holes_between_free_blocks() {
        // [used|2G free] 2G hole [2G free] 1G hole [3G free|used]
        let ranges = [
            mapped(0, 10 * G, 0, 2 * G),
            mapped(12 * G, 2 * G, 2 * G, 2 * G),
            mapped(15 * G, 5 * G, 3 * G, 0),
        ];
        let inputs = Inputs {
            mapped: &ranges,
            ..inputs(&[], &[], &[], &[])
        };
        let bridge = plan_bridge(8 * G, &inputs, &[]).unwrap();
        assert_eq!(
            bridge.holes,
            vec![
                (gap(10 * G, 2 * G), vec![Source::New { size: 2 * G }]),
                (gap(14 * G, G), vec![Source::New { size: G }]),
            ]
        );
        assert_eq!((bridge.len(), bridge.created()), (3 * G, 3 * G));
        // A request the run cannot hold: no bridge.
        assert_eq!(plan_bridge(11 * G, &inputs, &[]), None);
    }

    #[test]
    fn used_memory_ends_a_run() {
        // The middle range is free at its start only: the run stops there.
        let ranges = [
            mapped(0, 4 * G, 0, 2 * G),
            mapped(5 * G, 4 * G, G, 0),
            mapped(10 * G, 4 * G, 4 * G, 4 * G),
        ];
        let inputs = Inputs {
            mapped: &ranges,
            ..inputs(&[], &[], &[], &[])
        };
        assert_eq!(plan_bridge(5 * G, &inputs, &[]), None);
        assert!(plan_bridge(4 * G, &inputs, &[]).is_some());
    }

    #[test]
    fn the_run_with_the_fewest_hole_bytes_is_bridged() {
        let ranges = [
            mapped(0, 2 * G, 0, 2 * G),
            mapped(6 * G, 2 * G, 2 * G, 0),
            mapped(20 * G, 2 * G, 0, 2 * G),
            mapped(23 * G, 2 * G, 2 * G, 0),
        ];
        let inputs = Inputs {
            mapped: &ranges,
            ..inputs(&[], &[], &[], &[])
        };
        let bridge = plan_bridge(4 * G, &inputs, &[]).unwrap();
        assert_eq!(bridge.holes.len(), 1);
        assert_eq!(bridge.holes[0].0, gap(22 * G, G));
    }

    #[test]
    fn a_bridge_moves_units_from_outside_it_and_releases_for_new_chunks() {
        // [used|2G free] 3G hole [2G free|used]; a free unit inside the
        // window (it must stay), one of 1G and one of 4G outside it.
        let ranges = [mapped(0, 4 * G, 0, 2 * G), mapped(7 * G, 4 * G, 2 * G, 0)];
        let units = [unit(2 * G, G), unit(40 * G, G), unit(50 * G, 4 * G)];
        let inputs = Inputs {
            mapped: &ranges,
            ..inputs(&[], &[], &[], &units)
        };
        // Only the 1G unit fits the hole; the 4G one goes to make room for
        // the 2G of new chunks, unless streams may still use it.
        let bridge = plan_bridge(6 * G, &inputs, &units).unwrap();
        assert_eq!(
            bridge.holes,
            vec![(
                gap(4 * G, 3 * G),
                vec![
                    Source::Unit {
                        va: 40 * G,
                        size: G
                    },
                    Source::New { size: 2 * G }
                ]
            )]
        );
        assert_eq!(bridge.release, vec![unit(50 * G, 4 * G)]);
        assert_eq!(bridge.created(), 0);
        let guarded = plan_bridge(6 * G, &inputs, &[]).unwrap();
        assert!(guarded.release.is_empty());
        assert_eq!(guarded.created(), 2 * G);
    }

    #[test]
    fn extends_the_tail_needing_least() {
        let tails = [tail(0, 2 * G, 100 * G), tail(200 * G, 7 * G, 100 * G)];
        let plan = plan_growth(10 * G, &inputs(&tails, &[], &[], &[])).unwrap();
        assert_eq!(
            plan.target,
            Target {
                start: 207 * G,
                extends: 7 * G
            }
        );
        assert_eq!(plan.sources, vec![Source::New { size: 3 * G }]);
    }

    #[test]
    fn a_tail_without_room_is_skipped() {
        let tails = [tail(0, 8 * G, G)];
        let gaps = [gap(50 * G, 9 * G), gap(70 * G, 10 * G)];
        let plan = plan_growth(10 * G, &inputs(&tails, &gaps, &[], &[])).unwrap();
        assert_eq!(
            plan.target,
            Target {
                start: 70 * G,
                extends: 0
            }
        );
        assert!(plan_growth(10 * G, &inputs(&[], &[gap(0, 9 * G)], &[], &[])).is_none());
    }

    #[test]
    fn whole_chunks_must_fit_the_room() {
        // A 6-granule spare would over-cover the 2-granule need past the room
        // of the tail, so the fresh gap is used instead.
        let tails = [tail(0, 8 * G, 3 * G)];
        let gaps = [gap(100 * G, 50 * G)];
        let plan = plan_growth(10 * G, &inputs(&tails, &gaps, &[6 * G], &[])).unwrap();
        assert_eq!(plan.target.start, 100 * G);
        assert_eq!(
            plan.sources,
            vec![Source::Spare { size: 6 * G }, Source::New { size: 4 * G }]
        );
    }

    #[test]
    fn units_of_the_extended_tail_do_not_move() {
        let tails = [tail(0, 4 * G, 100 * G)];
        let units = [unit(0, 4 * G), unit(50 * G, 8 * G)];
        let plan = plan_growth(10 * G, &inputs(&tails, &[], &[], &units)).unwrap();
        assert_eq!(
            plan.sources,
            vec![Source::Unit {
                va: 50 * G,
                size: 8 * G
            }]
        );
    }

    #[test]
    fn spares_go_as_new_chunks_would() {
        let spares = sizes(&[G, G, G, G, 8 * G]);
        // Growth would create one-granule chunks: the granules go, not
        // the large spare that covers it all.
        assert_eq!(
            plan_sources(4 * G, &spares, &[], G),
            vec![Source::Spare { size: G }; 4]
        );
        // It would create one 4-granule chunk: the smallest spare that
        // covers it within the chunk size.
        assert_eq!(
            plan_sources(4 * G, &spares, &[], 16 * G),
            vec![Source::Spare { size: 8 * G }]
        );
    }

    #[test]
    fn unused_memory_before_new() {
        let plan = plan_sources(
            10 * G,
            &sizes(&[G, 3 * G]),
            &[unit(100 * G, 2 * G), unit(50 * G, 8 * G)],
            G,
        );
        assert_eq!(
            plan,
            vec![
                Source::Spare { size: G },
                Source::Spare { size: 3 * G },
                Source::Unit {
                    va: 50 * G,
                    size: 8 * G
                },
            ]
        );
        let plan = plan_sources(40 * G, &sizes(&[]), &[], 16 * G);
        assert_eq!(
            plan,
            vec![
                Source::New { size: 16 * G },
                Source::New { size: 16 * G },
                Source::New { size: 8 * G }
            ]
        );
    }

    proptest! {
        #[test]
        fn plans_cover_the_need_and_create_only_the_shortfall(
            need in 1..64u64,
            spares in proptest::collection::vec(1..8u64, 0..6),
            units in proptest::collection::vec(1..8u64, 0..6),
            chunk in 1..20u64,
        ) {
            let spares: Vec<u64> = spares.iter().map(|s| s * G).collect();
            let units: Vec<UnitSize> = units.iter().enumerate().map(|(i, l)| unit(i as u64 * 100 * G, l * G)).collect();
            let plan = plan_sources(need * G, &sizes(&spares), &units, chunk * G);
            let total: u64 = plan.iter().map(Source::size).sum();
            prop_assert!(total >= need * G);
            let available: u64 = spares.iter().sum::<u64>() + units.iter().map(|u| u.size).sum::<u64>();
            let created: u64 = plan.iter().map(|s| match s { Source::New { size } => *size, _ => 0 }).sum();
            prop_assert_eq!(created, (need * G).saturating_sub(available));
            for s in &plan {
                prop_assert!(s.size() > 0);
                if let Source::New { size } = s { prop_assert!(*size <= chunk * G); }
            }
        }
    }
}
