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
    /// Spare chunk number `index` (unmapped, held by the pool).
    Spare { index: usize, size: u64 },
    /// The free unit at `va`: unmap it and map it here.
    Unit { va: u64, size: u64 },
    /// A new chunk.
    New { size: u64 },
}

impl Source {
    pub fn size(&self) -> u64 {
        match *self {
            Source::Spare { size, .. } | Source::Unit { size, .. } | Source::New { size } => size,
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

/// What the pool holds that growth may use.
pub struct Inputs<'a> {
    pub tails: &'a [Tail],
    /// In address order.
    pub gaps: &'a [Gap],
    /// Sizes of the spare chunks.
    pub spares: &'a [u64],
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
            let sources = plan_sources(c.need, inputs.spares, &c.units, inputs.chunk_size);
            let plan = Plan {
                target: c.target,
                sources,
            };
            (plan.len() <= c.room).then_some(plan)
        })
}

/// Whole chunks covering `need` bytes: spare ones first (no driver call to
/// free them), then free units moved from elsewhere, then new ones of at
/// most `chunk_size` (a granule multiple) each. Within each kind, the
/// smallest that covers what is left, else the largest, so few chunks move
/// and little is over-covered; among equal sizes, the first in the order
/// given. Nothing is created while unused memory would do.
pub fn plan_sources(need: u64, spares: &[u64], units: &[UnitSize], chunk_size: u64) -> Vec<Source> {
    let mut left = need;
    let mut plan = Vec::new();
    let mut spare_left: Vec<(usize, u64)> = spares.iter().copied().enumerate().collect();
    while left > 0 {
        let Some(pick) = best_cover(&spare_left, left) else {
            break;
        };
        let (index, size) = spare_left.remove(pick);
        plan.push(Source::Spare { index, size });
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
    while left > 0 {
        let size = left.min(chunk_size);
        plan.push(Source::New { size });
        left -= size;
    }
    plan
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
            tails,
            gaps,
            spares,
            units,
            granule: G,
            chunk_size: 16 * G,
        }
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
            vec![
                Source::Spare {
                    index: 0,
                    size: 6 * G
                },
                Source::New { size: 4 * G }
            ]
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
    fn unused_memory_before_new() {
        let plan = plan_sources(
            10 * G,
            &[G, 3 * G],
            &[unit(100 * G, 2 * G), unit(50 * G, 8 * G)],
            G,
        );
        assert_eq!(
            plan,
            vec![
                Source::Spare {
                    index: 1,
                    size: 3 * G
                },
                Source::Spare { index: 0, size: G },
                Source::Unit {
                    va: 50 * G,
                    size: 8 * G
                },
            ]
        );
        let plan = plan_sources(40 * G, &[], &[], 16 * G);
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
            let plan = plan_sources(need * G, &spares, &units, chunk * G);
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
