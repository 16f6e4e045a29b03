//! Placement by lowest floor (Moffitt, "MiniMalloc: A Lightweight Memory
//! Allocator for Hardware-Accelerated Machine Learning", ASPLOS 2023):
//! allocations are placed in order of their offsets, each on top of the
//! highest one already placed that it meets in time, always the one that
//! can sit lowest next. Every layout can be pushed down into that
//! *canonical* form without growing, so the order alone decides how
//! tight it is; MiniMalloc searches over it, and this takes the one
//! order that places the largest first among those at the lowest floor,
//! with no search.
//!
//! ```text
//!   offset ^        [  c  ]          floors: a at 0, b at 0 (meets no
//!          |  [ a ][  b   ]          one placed), c on top of b: a
//!          +-------------------> time  and c never meet
//! ```
//!
//! Where best fit in a fixed order leaves a gap under the step's busiest
//! moment, this fills the space from the bottom up: ViT's recorded step,
//! whose peak is 6,449.7 MiB, lays out in 6,454.2 where the best of the
//! greedy orders takes 6,492.4 (docs/RESULTS.md, "Layouts by lowest
//! floor").

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{Layout, Lifetime, Race};

/// What taking an allocation from the queue counts against an order's
/// budget of visits (`MOST_VISITS`): a take and the skyline's walks cost
/// about 270 ns on the CI machine, a greedy order's visit of a placed
/// allocation about 3 (GQA's whole trace, 95,451 allocations, takes 8.1
/// M from the queue in 2.2 s).
const TAKE_VISITS: u64 = 100;

/// Lays out `lifetimes` by lowest floor as order `k` of `race`; `None`
/// as soon as `race` says so, or once it has spent `visits`, at
/// [`TAKE_VISITS`] an allocation taken from its queue (`visits` is then 0;
/// else what is left of it).
///
/// Each allocation waits in a queue by the floor it had when last looked
/// at: floors only rise as allocations are placed, so one taken from the
/// queue whose floor has not risen since is the lowest of all, and one
/// whose floor has risen goes back at its new floor.
pub(super) fn lay_out_by_floor(
    lifetimes: &[Lifetime],
    race: &Race,
    k: usize,
    visits: &mut u64,
) -> Option<Layout> {
    let events = lifetimes.iter().map(|l| l.end).max().unwrap_or(0) as usize;
    let mut skyline = Skyline::new(events);
    let mut queue: BinaryHeap<Reverse<Waiting>> = lifetimes
        .iter()
        .enumerate()
        .map(|(index, l)| {
            Reverse(Waiting {
                floor: 0,
                size: Reverse(l.size),
                start: l.start,
                index,
            })
        })
        .collect();
    let mut offsets = vec![0; lifetimes.len()];
    let mut len = 0;
    while let Some(Reverse(waiting)) = queue.pop() {
        let Some(left) = visits.checked_sub(TAKE_VISITS) else {
            *visits = 0;
            return None;
        };
        *visits = left;
        let i = waiting.index;
        let l = lifetimes[i];
        let span = l.start as usize..l.end as usize;
        let floor = skyline.highest(span.clone());
        if floor > waiting.floor {
            queue.push(Reverse(Waiting { floor, ..waiting }));
            continue;
        }
        offsets[i] = floor;
        len = len.max(floor + l.size);
        if !race.open(k, len) {
            return None;
        }
        skyline.raise(span, floor + l.size);
    }
    Some(Layout { offsets, len })
}

/// An allocation not yet placed, in the queue: the lowest floor first;
/// among equal floors the largest, then the earliest, then the first
/// listed, so that the layout is the same on every run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Waiting {
    /// Its floor when last looked at: the highest top of those placed
    /// that it meets in time.
    floor: u64,
    size: Reverse<u64>,
    start: u32,
    index: usize,
}

/// The top of what has been placed, event by event: a segment tree of
/// maxima over the events, raised over a range at once, walked from the
/// leaves up.
struct Skyline {
    /// Per node, the highest top of any event below it.
    most: Vec<u64>,
    /// Per node, a top every event below it has reached, not passed down
    /// to its children: an event's top is the most of its leaf's and its
    /// ancestors' raised tops.
    raised: Vec<u64>,
    /// The leaves' first node: events rounded up to a power of two.
    leaves: usize,
}

impl Skyline {
    fn new(events: usize) -> Self {
        let leaves = events.max(1).next_power_of_two();
        Self {
            most: vec![0; 2 * leaves],
            raised: vec![0; 2 * leaves],
            leaves,
        }
    }

    /// The highest top over `span` (not empty). The nodes that cover the
    /// span are children of the paths from its two end leaves to the
    /// root; those paths' raised tops hold over an end leaf, in the span.
    fn highest(&self, span: std::ops::Range<usize>) -> u64 {
        let (first, last) = (span.start + self.leaves, span.end - 1 + self.leaves);
        let mut top = self.above(first).max(self.above(last));
        let (mut lo, mut hi) = (first, last + 1);
        while lo < hi {
            if lo & 1 == 1 {
                top = top.max(self.most[lo]);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                top = top.max(self.most[hi]);
            }
            lo >>= 1;
            hi >>= 1;
        }
        top
    }

    /// The most raised top among `node`'s ancestors.
    fn above(&self, mut node: usize) -> u64 {
        let mut top = 0;
        while node > 1 {
            node >>= 1;
            top = top.max(self.raised[node]);
        }
        top
    }

    /// Raises every event of `span` (not empty) to at least `top`.
    fn raise(&mut self, span: std::ops::Range<usize>, top: u64) {
        let (first, last) = (span.start + self.leaves, span.end - 1 + self.leaves);
        let (mut lo, mut hi) = (first, last + 1);
        while lo < hi {
            if lo & 1 == 1 {
                self.lift(lo, top);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                self.lift(hi, top);
            }
            lo >>= 1;
            hi >>= 1;
        }
        // Every ancestor of an end leaf holds an event of the span.
        for mut node in [first, last] {
            while node > 1 {
                node >>= 1;
                self.most[node] = self.most[node].max(top);
            }
        }
    }

    fn lift(&mut self, node: usize, top: u64) {
        self.most[node] = self.most[node].max(top);
        self.raised[node] = self.raised[node].max(top);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    use super::super::tests::{check, life, lives};
    use super::super::{lay_out, lay_out_by, Orders};
    use super::*;
    use proptest::prelude::*;

    /// A budget of visits no test spends.
    fn plenty() -> u64 {
        u64::MAX
    }

    fn unbounded() -> Race {
        Race {
            bound: AtomicU64::new(u64::MAX),
            near_peak: AtomicUsize::new(usize::MAX),
        }
    }

    /// Five allocations whose peak is 7: best fit leaves a gap under the
    /// peak in every greedy order (8), placement by floor does not.
    #[test]
    fn the_lowest_floor_fills_what_best_fit_leaves() {
        let lifetimes = [
            life(2, 5, 8),
            life(2, 1, 7),
            life(1, 1, 3),
            life(4, 3, 4),
            life(3, 4, 7),
        ];
        let layout = lay_out_by_floor(&lifetimes, &unbounded(), 0, &mut plenty()).unwrap();
        assert_eq!(layout.len, 7);
        assert_eq!(layout.offsets, vec![3, 5, 0, 0, 0]);
        let by_size = |i: usize| (std::cmp::Reverse(lifetimes[i].size), lifetimes[i].start);
        let best_fit = lay_out_by(&lifetimes, 1, &unbounded(), 1, &mut plenty(), by_size);
        assert_eq!(best_fit.unwrap().len, 8);
        assert_eq!(
            lay_out(&lifetimes, 1, u64::MAX, Orders::InTurn),
            Some(layout)
        );
    }

    #[test]
    fn a_floor_past_the_race_bound_gives_up() {
        let lifetimes = [life(4, 0, 2), life(4, 1, 3)];
        let race = unbounded();
        race.bound.store(7, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(lay_out_by_floor(&lifetimes, &race, 0, &mut plenty()), None);
        let mut visits = TAKE_VISITS;
        assert_eq!(
            lay_out_by_floor(&lifetimes, &unbounded(), 0, &mut visits),
            None
        );
        assert_eq!(visits, 0);
    }

    proptest! {
        /// Against a plain array of tops.
        #[test]
        fn the_skyline_keeps_the_highest_top(
            ops in prop::collection::vec((0usize..300, 1usize..300, 0u64..1000, any::<bool>()), 1..200)
        ) {
            let events = 300;
            let mut skyline = Skyline::new(events);
            let mut tops = vec![0u64; events];
            for (start, len, top, raise) in ops {
                let span = start..(start + len).min(events);
                if span.is_empty() {
                    continue;
                }
                if raise {
                    skyline.raise(span.clone(), top);
                    for t in &mut tops[span] {
                        *t = (*t).max(top);
                    }
                } else {
                    prop_assert_eq!(skyline.highest(span.clone()), tops[span].iter().copied().max().unwrap());
                }
            }
        }

        /// Whatever the lifetimes, no two that meet overlap, and the
        /// layout is at least the peak.
        #[test]
        fn floors_never_overlap(
            spans in prop::collection::vec((1u64..64, 0u32..400, 1u32..1200), 1..120)
        ) {
            let lifetimes = lives(&spans, 1);
            let layout = lay_out_by_floor(&lifetimes, &unbounded(), 0, &mut plenty()).unwrap();
            check(&lifetimes, &layout, 1)?;
        }
    }
}
