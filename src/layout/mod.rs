//! Pure planning of a repeated step's layout: given the allocations of a
//! recorded step, each with its size and lifetime, choose an offset for
//! each so that no two that are live at once overlap, in as little space
//! as possible. No driver, no pool state: tested on its own. See Note
//! [Step layouts] in docs/DESIGN.md.
//!
//! Two heuristics, the smaller result kept. Placement by lowest floor
//! (`floors`, after MiniMalloc): allocations in order of their offsets,
//! each on top of the highest one placed that it meets in time. And
//! greedy best fit (Pisarchyk and Lee, "Efficient memory management for
//! deep neural net inference", 2020): in some order (by size, or by
//! breadth: those alive at the busiest moments first), each allocation at
//! the best-fitting gap among those already placed that it meets in time.
//!
//! ```text
//!   offset ^   [ big, events 0..9 ]
//!          |   [a: 1..4][  b: 5..8  ]      a and b never meet: they
//!          +-----------------------> time  share the space above big
//! ```

use std::cmp::Reverse;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use floors::lay_out_by_floor;

mod floors;

/// One allocation of a recorded step: `size` bytes, live from event
/// `start` until event `end` (exclusive). Events are the step's
/// allocations and frees, numbered in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lifetime {
    pub(crate) size: u64,
    pub(crate) start: u32,
    pub(crate) end: u32,
}

impl Lifetime {
    fn meets(&self, other: &Lifetime) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Offsets for a step's allocations, in the order given, and the space
/// they take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) offsets: Vec<u64>,
    /// The highest end of any allocation: the space the layout needs.
    pub(crate) len: u64,
}

/// How many events a time bucket spans: an allocation is listed in every
/// bucket its lifetime touches, so that finding those it meets scans a
/// few buckets, not every allocation placed.
const BUCKET: u32 = 128;

/// An allocation that lives longer than this share of a step's events
/// (and more than four buckets) is listed once, among the long-lived, in
/// order of offset: a training step's activations, kept from the forward
/// pass to the backward, meet most later allocations, and listed in every
/// bucket they touched they were visited once a bucket, which made
/// placement cubic in them. Shorter ones stay in buckets, where a step
/// of many that live apart (a generation loop's caches) finds them.
const LONG_SHARE: u32 = 16;

/// The most placed allocations one order of a [`lay_out`] may visit,
/// about six seconds' work on the CI machine: placement is quadratic in
/// the allocations that meet one another, and the step of a large model,
/// or many steps marked as one, would hold up the allocation that carries
/// the mark for minutes. An order past it gives up; past it in every
/// order, the layout is given up, and the steps run as unmarked ones do.
/// The recorded traces, each laid out whole as one step, visit 68 M
/// (ResNet-50) to 1,237 M (MoE) in all their orders; a step of one of
/// them, about a million. Placement by floor counts each allocation
/// taken from its queue as a visit, and never comes near it.
const MOST_VISITS: u64 = 1 << 31;

/// A layout within this fraction of its step's peak ends the search: the
/// orders after it could save at most as much. The MoE's whole trace
/// is laid out by breadth in 1.0000039 of its peak, and the three orders
/// after it took 2.5 s more on the CI machine for nothing.
const NEAR_PEAK: u64 = 10_000;

/// How [`lay_out`] runs its four orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Orders {
    /// One after another on the calling thread: a step small enough to
    /// plan where it is marked (Note [Steps at emptying]).
    InTurn,
    /// The first alone (best fit by breadth), which most often reaches
    /// the step's peak, then the other three at once, each on a thread: a
    /// large step, planned apart, whose layout the pool waits for. ViT's
    /// whole trace takes 0.2, 0.4 and 0.4 s in the three greedy orders on
    /// the CI machine, and is laid out tightest by floor; started at once
    /// with the first, the others slowed it where it alone was needed
    /// (docs/RESULTS.md, "Two orders at once", "Layouts by lowest floor").
    AtOnce,
}

/// Lays out `lifetimes` in at most `limit` bytes (`None`: no layout
/// found fits); every size must be a multiple of `align`, and so is every
/// offset.
///
/// Four orders are tried and the smallest layout kept, since none wins
/// on every recorded workload (docs/RESULTS.md, "Step layouts", "Layouts
/// by lowest floor"): greedy best fit by breadth (Pisarchyk and Lee's
/// other greedy order), the allocations alive at the step's busiest
/// moments first, which fills the peak before anything can leave a gap in
/// it and reaches it on most recorded steps; then by lowest floor, which
/// reaches the peak of most of the others (ViT's step, 0.07 % over it,
/// where the best greedy order leaves 0.66 %); then best fit by size,
/// allocations of one size the earliest first or the longest-lived first.
/// Breadth goes first: it places a step fastest and most often reaches
/// the peak.
///
/// An order gives up as soon as its layout passes the limit or one that
/// another order has finished: placement is quadratic in the worst case,
/// and a layout refused for its size (steps whose shapes vary apart) then
/// costs a fraction of a whole one. Once an order's layout is within a
/// [`NEAR_PEAK`]th of the step's peak, which none is below, the orders
/// after it give up (most recorded steps reach it in the first, and
/// planning a whole trace as one step takes half the time). Of layouts
/// of one length, the earliest order's is kept, so that the layout is the
/// same whichever order finishes first.
pub(crate) fn lay_out(
    lifetimes: &[Lifetime],
    align: u64,
    limit: u64,
    orders: Orders,
) -> Option<Layout> {
    lay_out_within(lifetimes, align, limit, MOST_VISITS, orders)
}

/// What the orders of one [`lay_out`] tell one another.
struct Race {
    /// The limit, or the shortest layout an order has finished.
    bound: AtomicU64,
    /// The first order whose layout came within a [`NEAR_PEAK`]th of the
    /// step's peak (`usize::MAX`: none yet); the orders after it give up.
    near_peak: AtomicUsize,
}

impl Race {
    /// Whether order `k` may go on with a layout of `len` bytes so far.
    fn open(&self, k: usize, len: u64) -> bool {
        len <= self.bound.load(Relaxed) && self.near_peak.load(Relaxed) > k
    }
}

/// [`lay_out`], with at most `visits` placed allocations visited in each
/// order.
fn lay_out_within(
    lifetimes: &[Lifetime],
    align: u64,
    limit: u64,
    visits: u64,
    orders: Orders,
) -> Option<Layout> {
    let live = live_per_event(lifetimes);
    let peak = live.iter().copied().max().unwrap_or(0);
    let near = peak + peak / NEAR_PEAK;
    let race = Race {
        bound: AtomicU64::new(limit),
        near_peak: AtomicUsize::new(usize::MAX),
    };
    let l = |i: usize| &lifetimes[i];
    let breadth = breadths(lifetimes, &live);
    let by_breadth = |i: usize| (Reverse(breadth[i]), Reverse(l(i).size), l(i).start);
    let by_size = |i: usize| (Reverse(l(i).size), Reverse(0), l(i).start);
    let by_size_longest = |i: usize| {
        (
            Reverse(l(i).size),
            Reverse(u64::from(l(i).end - l(i).start)),
            0,
        )
    };
    // Order `k`: its layout, or why it has none.
    let run = |k: usize| {
        if !race.open(k, 0) {
            return (None, false);
        }
        let mut left = visits;
        let layout = match k {
            0 => lay_out_by(lifetimes, align, &race, k, &mut left, by_breadth),
            1 => lay_out_by_floor(lifetimes, &race, k, &mut left),
            2 => lay_out_by(lifetimes, align, &race, k, &mut left, by_size),
            _ => lay_out_by(lifetimes, align, &race, k, &mut left, by_size_longest),
        };
        if let Some(layout) = &layout {
            race.bound.fetch_min(layout.len, Relaxed);
            if layout.len <= near {
                race.near_peak.fetch_min(k, Relaxed);
            }
        }
        (layout, left == 0)
    };
    let results = match orders {
        Orders::InTurn => [run(0), run(1), run(2), run(3)],
        Orders::AtOnce => {
            let first = run(0);
            std::thread::scope(|s| {
                let spawn = |k: usize| {
                    std::thread::Builder::new()
                        .name("vmpool-plan".into())
                        .spawn_scoped(s, move || run(k))
                };
                let (second, third) = (spawn(1), spawn(2));
                let fourth = run(3);
                // No thread to be had: in turn, with the same result.
                let second = second.map_or_else(|_| run(1), join);
                let third = third.map_or_else(|_| run(2), join);
                [first, second, third, fourth]
            })
        }
    };
    let out_of_visits = results.iter().any(|(_, spent)| *spent);
    // The shortest; of equal lengths, the earliest order's.
    let best = results
        .into_iter()
        .filter_map(|(layout, _)| layout)
        .reduce(|best, next| if next.len < best.len { next } else { best });
    if best.is_none() && out_of_visits {
        tracing::info!(
            allocations = lifetimes.len(),
            "step layout given up: placing it would take too long"
        );
    }
    best
}

/// An order's result, from its thread; a panic there is passed on.
fn join<T>(thread: std::thread::ScopedJoinHandle<'_, T>) -> T {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The bytes live at each event of `lifetimes`.
fn live_per_event(lifetimes: &[Lifetime]) -> Vec<u64> {
    let end = lifetimes.iter().map(|l| l.end).max().unwrap_or(0) as usize;
    let mut change = vec![0i128; end + 1];
    for l in lifetimes {
        change[l.start as usize] += i128::from(l.size);
        change[l.end as usize] -= i128::from(l.size);
    }
    change[..end]
        .iter()
        .scan(0i128, |sum, c| {
            *sum += c;
            Some(*sum as u64)
        })
        .collect()
}

/// The most bytes of `lifetimes` live at once: no layout is smaller.
pub(crate) fn peak(lifetimes: &[Lifetime]) -> u64 {
    live_per_event(lifetimes).into_iter().max().unwrap_or(0)
}

/// For each allocation, the most bytes live at any event of its
/// lifetime: the live bytes per event, their maxima kept per [`BUCKET`]
/// events, so that each lifetime reads its two end buckets event by
/// event and those between whole.
fn breadths(lifetimes: &[Lifetime], live: &[u64]) -> Vec<u64> {
    let bucket = BUCKET as usize;
    let most: Vec<u64> = live
        .chunks(bucket)
        .map(|c| c.iter().copied().max().unwrap_or(0))
        .collect();
    lifetimes
        .iter()
        .map(|l| {
            let (start, end) = (l.start as usize, l.end as usize);
            let (first, last) = (start / bucket, (end - 1) / bucket);
            if first == last {
                return live[start..end].iter().copied().max().unwrap_or(0);
            }
            let head = live[start..(first + 1) * bucket].iter();
            let tail = live[last * bucket..end].iter();
            let whole = most[first + 1..last].iter();
            head.chain(whole).chain(tail).copied().max().unwrap_or(0)
        })
        .collect()
}

/// Lays out greedily in the order of `key` (of an allocation's index),
/// as order `k` of `race`; `None` as soon as `race` says so (see
/// [`Race::open`]), or once it has visited `visits` placed allocations
/// (`visits` is then 0; else what is left of it).
fn lay_out_by<K: Ord>(
    lifetimes: &[Lifetime],
    align: u64,
    race: &Race,
    k: usize,
    visits: &mut u64,
    key: impl Fn(usize) -> K,
) -> Option<Layout> {
    debug_assert!(lifetimes
        .iter()
        .all(|l| l.size % align == 0 && l.start < l.end));
    let mut order: Vec<usize> = (0..lifetimes.len()).collect();
    order.sort_by_key(|&i| key(i));
    let end = lifetimes.iter().map(|l| l.end).max().unwrap_or(0);
    let long_after = (end / LONG_SHARE).max(4 * BUCKET);
    // Each bucket's allocations, and the long-lived ones, in order of
    // offset, so that an allocation finds those it meets in order, with
    // little sorting.
    let mut placed: Vec<Vec<usize>> = vec![Vec::new(); (end / BUCKET + 1) as usize];
    let mut long: Vec<usize> = Vec::new();
    let mut offsets = vec![0; lifetimes.len()];
    // Which allocation last listed another as met: a stamp per allocation
    // instead of a set cleared each time.
    let mut seen = vec![usize::MAX; lifetimes.len()];
    let (mut met, mut met_long, mut merged) = (Vec::new(), Vec::new(), Vec::new());
    let mut len = 0;
    for &i in &order {
        let l = lifetimes[i];
        let spanned = (l.start / BUCKET) as usize..=((l.end - 1) / BUCKET) as usize;
        let range = |j: usize| (offsets[j], offsets[j] + lifetimes[j].size);
        let mut visited = long.len() as u64;
        met.clear();
        for bucket in &placed[spanned.clone()] {
            visited += bucket.len() as u64;
            for &j in bucket {
                if seen[j] != i && l.meets(&lifetimes[j]) {
                    seen[j] = i;
                    met.push(range(j));
                }
            }
        }
        let Some(left) = visits.checked_sub(visited) else {
            *visits = 0;
            return None;
        };
        *visits = left;
        if spanned.start() != spanned.end() {
            met.sort_unstable();
        }
        met_long.clear();
        met_long.extend(
            long.iter()
                .filter(|&&j| l.meets(&lifetimes[j]))
                .map(|&j| range(j)),
        );
        let taken = if met_long.is_empty() {
            &met
        } else {
            merge(&met, &met_long, &mut merged);
            &merged
        };
        offsets[i] = best_gap(taken, l.size);
        len = len.max(offsets[i] + l.size);
        if !race.open(k, len) {
            return None;
        }
        let by_offset = |list: &[usize]| list.partition_point(|&j| offsets[j] <= offsets[i]);
        if l.end - l.start > long_after {
            long.insert(by_offset(&long), i);
        } else {
            for bucket in &mut placed[spanned] {
                bucket.insert(by_offset(bucket), i);
            }
        }
    }
    debug_assert!(offsets.iter().all(|o| o % align == 0));
    Some(Layout { offsets, len })
}

/// `a` and `b`, each in order, merged in order into `out`.
fn merge(a: &[(u64, u64)], b: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
    out.clear();
    let (mut a, mut b) = (a.iter().peekable(), b.iter().peekable());
    while let (Some(&&x), Some(&&y)) = (a.peek(), b.peek()) {
        if x <= y {
            out.push(x);
            a.next();
        } else {
            out.push(y);
            b.next();
        }
    }
    out.extend(a.chain(b));
}

/// The start of the smallest gap of at least `size` between the ranges
/// in `taken` (in order of their starts), or the end of the highest if
/// none fits.
fn best_gap(taken: &[(u64, u64)], size: u64) -> u64 {
    let mut best: Option<(u64, u64)> = None;
    let mut end = 0;
    for &(lo, hi) in taken.iter() {
        if lo >= end + size && best.is_none_or(|(gap, _)| lo - end < gap) {
            best = Some((lo - end, end));
        }
        end = end.max(hi);
    }
    best.map_or(end, |(_, at)| at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    pub(super) fn life(size: u64, start: u32, end: u32) -> Lifetime {
        Lifetime { size, start, end }
    }

    /// Lifetimes from drawn `(size, start, span)`, each size in `unit`s.
    pub(super) fn lives(spans: &[(u64, u32, u32)], unit: u64) -> Vec<Lifetime> {
        spans
            .iter()
            .map(|&(size, start, span)| life(size * unit, start, start + span))
            .collect()
    }

    /// Bytes of `lifetimes` live at event `t`, counted one by one.
    fn live_at(lifetimes: &[Lifetime], t: u32) -> u64 {
        lifetimes
            .iter()
            .filter(|l| l.start <= t && t < l.end)
            .map(|l| l.size)
            .sum()
    }

    /// That `layout` holds `lifetimes`: each at an offset that is a
    /// multiple of `align`, within its length, apart from every one it
    /// meets; and that it is no smaller than their peak, counted event by
    /// event.
    pub(super) fn check(
        lifetimes: &[Lifetime],
        layout: &Layout,
        align: u64,
    ) -> Result<(), TestCaseError> {
        let end = lifetimes.iter().map(|l| l.end).max().unwrap_or(0);
        let peak_live = (0..end).map(|t| live_at(lifetimes, t)).max().unwrap_or(0);
        prop_assert!(layout.len >= peak_live);
        for (i, a) in lifetimes.iter().enumerate() {
            prop_assert_eq!(layout.offsets[i] % align, 0);
            prop_assert!(layout.offsets[i] + a.size <= layout.len);
            for (j, b) in lifetimes.iter().enumerate().skip(i + 1) {
                let apart = layout.offsets[i] + a.size <= layout.offsets[j]
                    || layout.offsets[j] + b.size <= layout.offsets[i];
                prop_assert!(!a.meets(b) || apart, "{i} and {j} overlap");
            }
        }
        Ok(())
    }

    #[test]
    fn allocations_that_never_meet_share_space() {
        let layout = lay_out(
            &[life(8, 0, 9), life(4, 1, 4), life(4, 5, 8)],
            4,
            u64::MAX,
            Orders::InTurn,
        )
        .unwrap();
        assert_eq!(layout.offsets, vec![0, 8, 8]);
        assert_eq!(layout.len, 12);
    }

    #[test]
    fn a_limit_refuses_only_what_passes_it() {
        let lifetimes = [life(8, 0, 9), life(4, 1, 4), life(4, 5, 8)];
        assert_eq!(lay_out(&lifetimes, 4, 11, Orders::InTurn), None);
        assert_eq!(lay_out(&lifetimes, 4, 12, Orders::InTurn).unwrap().len, 12);
    }

    /// A step whose allocations all meet one another (a training step's
    /// activations, kept until the backward pass) costs placement a visit
    /// per pair: past the budget, no layout, whatever the limit.
    #[test]
    fn a_layout_past_its_budget_is_given_up() {
        let n = 3_000u32;
        let nested: Vec<Lifetime> = (0..n)
            .map(|i| life(256 * u64::from(1 + i % 7), 2 * i, 4 * n - 2 * i))
            .collect();
        let pairs = u64::from(n) * u64::from(n) / 2;
        for orders in [Orders::InTurn, Orders::AtOnce] {
            let laid_out = lay_out_within(&nested, 256, u64::MAX, 3 * pairs, orders).unwrap();
            assert_eq!(laid_out.len, nested.iter().map(|l| l.size).sum::<u64>());
            assert_eq!(
                lay_out_within(&nested, 256, u64::MAX, pairs / 2, orders),
                None
            );
            assert_eq!(lay_out(&nested, 256, u64::MAX, orders), Some(laid_out));
        }
    }

    #[test]
    fn the_smallest_gap_that_fits_is_taken() {
        // Gaps: 4..6 (2 bytes) and 8..14 (6 bytes), then the end at 16.
        let taken = [(0, 4), (6, 8), (14, 16)];
        assert_eq!(best_gap(&taken, 2), 4);
        assert_eq!(best_gap(&taken, 4), 8);
        assert_eq!(best_gap(&taken, 7), 16);
        assert_eq!(best_gap(&[], 7), 0);
    }

    proptest! {
        /// Against a count at every event, across bucket edges.
        #[test]
        fn breadths_are_the_most_live_in_each_lifetime(
            spans in prop::collection::vec((1u64..64, 0u32..600, 1u32..400), 1..80)
        ) {
            let lifetimes = lives(&spans, 1);
            for (l, got) in lifetimes.iter().zip(breadths(&lifetimes, &live_per_event(&lifetimes))) {
                let want = (l.start..l.end).map(|t| live_at(&lifetimes, t)).max().unwrap();
                prop_assert_eq!(got, want);
            }
        }

        /// Spans up to 1,200 events: some live longer than a
        /// [`LONG_SHARE`]th of the step and four buckets.
        #[test]
        fn live_allocations_never_overlap(
            spans in prop::collection::vec((1u64..64, 0u32..400, 1u32..1200), 1..120)
        ) {
            let lifetimes = lives(&spans, 8);
            let layout = lay_out(&lifetimes, 8, u64::MAX, Orders::InTurn).unwrap();
            // A limit changes nothing but whether it is found; the orders
            // at once give the layout they give in turn.
            for orders in [Orders::InTurn, Orders::AtOnce] {
                prop_assert_eq!(lay_out(&lifetimes, 8, layout.len, orders), Some(layout.clone()));
                prop_assert_eq!(lay_out(&lifetimes, 8, layout.len - 1, orders), None);
                prop_assert_eq!(lay_out(&lifetimes, 8, u64::MAX, orders), Some(layout.clone()));
            }
            check(&lifetimes, &layout, 8)?;
        }
    }
}
