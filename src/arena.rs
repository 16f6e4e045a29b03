//! The two parts of a pool's reservation, each with its own heap of mapped
//! free space: small allocations, then large ones (Note \[Placement\] in
//! docs/DESIGN.md).

use std::ops::{Index, IndexMut};

use crate::heap::Heap;
use crate::props::SMALL_LIMIT;

/// Which arena.
///
/// A word wide, as the index it replaced: the hot path copies the
/// [`crate::Allocation`]s and pending frees that carry it, and a byte-wide
/// field there made those copies slower (docs/RESULTS.md, "The pool split").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum ArenaId {
    /// Allocations under [`SMALL_LIMIT`], packed on granule-sized chunks.
    Small,
    Large,
}

impl ArenaId {
    /// The arena an allocation of `size` bytes goes to.
    pub(crate) fn for_size(size: u64) -> Self {
        if size >= SMALL_LIMIT {
            Self::Large
        } else {
            Self::Small
        }
    }

    pub(crate) fn other(self) -> Self {
        match self {
            Self::Small => Self::Large,
            Self::Large => Self::Small,
        }
    }
}

/// How an arena's growth sizes its new chunks (Note [Growth chunk size] in
/// docs/DESIGN.md).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkPolicy {
    /// Largest chunk a growth creates.
    pub(crate) chunk_size: u64,
    /// See [`crate::PoolProps::chunk_divisor`].
    pub(crate) chunk_divisor: Option<u64>,
    /// See [`crate::PoolProps::granule_growth_below`].
    pub(crate) granule_growth_below: u64,
}

/// Where the program stands in its run, for the chunks growth creates
/// (Note [Growth chunk size], "The first steps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunStage {
    /// Before the end of the program's [`FIRST_STEPS`]th marked step.
    FirstSteps,
    /// From then on, for the rest of the pool's life.
    Later,
}

/// Where a marked step ended, as far as growth cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepEnd {
    /// At a mark of the program's (deferred or not).
    Program,
    /// Where the program emptied the pool: it starts afresh instead (Note
    /// [Starting afresh]), so nothing is gathered.
    Emptied,
}

/// Whether a step layout is under way as a step is marked: one serves,
/// waits for its region or is being planned, or parts of one given up
/// are still to be freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayoutAtMark {
    UnderWay,
    None,
}

/// Where a small request goes that the small arena's free memory cannot
/// serve (Note [Placement], "Small requests in the large arena").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SmallOverflow {
    /// The small arena grows.
    Grow,
    /// The large arena's free memory first; growth only if it has none.
    LargeFirst,
}

impl SmallOverflow {
    /// The rule from a mark on: the large arena's free memory once the
    /// first steps are over (what they make, weights and optimizer state,
    /// lives on, where the steps' memory should be), at a mark of the
    /// program's (in an emptied pool nothing of the first steps lives on,
    /// and a small block there lies where the step's large ones go) and
    /// while no layout is under way (its region would find small
    /// allocations in its way).
    pub(crate) fn at_mark(stage: RunStage, end: StepEnd, layout: LayoutAtMark) -> Self {
        if stage == RunStage::Later && end == StepEnd::Program && layout == LayoutAtMark::None {
            Self::LargeFirst
        } else {
            Self::Grow
        }
    }
}

/// Steps marked before growth takes the divisor's chunks: the first sets
/// up what the run keeps (weights, optimizer state), the second is the
/// first that repeats.
pub(crate) const FIRST_STEPS: u32 = 2;

/// In its first steps a pool grows by granules while it holds under this,
/// so that a program that never marks a step pays at most this over the
/// granule in chunks.
pub(crate) const FIRST_STEPS_GRANULE_LIMIT: u64 = 16 << 30;

impl ChunkPolicy {
    /// Largest chunk a growth creates while the pool holds `reserved` bytes.
    pub(crate) fn growth_chunk(&self, reserved: u64, granule: u64, stage: RunStage) -> u64 {
        let granule_below = match stage {
            RunStage::FirstSteps if self.granule_growth_below > 0 => {
                FIRST_STEPS_GRANULE_LIMIT.max(self.granule_growth_below)
            }
            _ => self.granule_growth_below,
        };
        match self.chunk_divisor {
            Some(_) if reserved < granule_below => granule,
            Some(d) => (reserved / d)
                .next_multiple_of(granule)
                .clamp(granule, self.chunk_size),
            None => self.chunk_size,
        }
    }
}

/// One part of the reservation, `[start, end)`, with its own heap.
pub(crate) struct Arena {
    pub(crate) heap: Heap,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) policy: ChunkPolicy,
}

/// Both arenas, indexed by [`ArenaId`].
pub(crate) struct Arenas {
    small: Arena,
    large: Arena,
}

impl Arenas {
    pub(crate) fn new(small: Arena, large: Arena) -> Self {
        Self { small, large }
    }

    /// The arena `va` lies in.
    pub(crate) fn of(&self, va: u64) -> ArenaId {
        if va < self.small.end {
            ArenaId::Small
        } else {
            ArenaId::Large
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arena> {
        [&self.small, &self.large].into_iter()
    }
}

impl Index<ArenaId> for Arenas {
    type Output = Arena;

    fn index(&self, id: ArenaId) -> &Arena {
        match id {
            ArenaId::Small => &self.small,
            ArenaId::Large => &self.large,
        }
    }
}

impl IndexMut<ArenaId> for Arenas {
    fn index_mut(&mut self, id: ArenaId) -> &mut Arena {
        match id {
            ArenaId::Small => &mut self.small,
            ArenaId::Large => &mut self.large,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn policy(granule_growth_below: u64) -> ChunkPolicy {
        ChunkPolicy {
            chunk_size: 32 * MIB,
            chunk_divisor: Some(1024),
            granule_growth_below,
        }
    }

    #[test]
    fn first_steps_grow_by_granules_up_to_their_limit() {
        let (g, p) = (2 * MIB, policy(2 * GIB));
        let chunk = |reserved, stage| p.growth_chunk(reserved, g, stage);
        // Later: granules below the pool's limit, then the divisor's share.
        assert_eq!(chunk(GIB, RunStage::Later), g);
        assert_eq!(chunk(4 * GIB, RunStage::Later), 4 * MIB);
        // First steps: granules up to 16 GiB, the divisor's share from there.
        assert_eq!(chunk(4 * GIB, RunStage::FirstSteps), g);
        assert_eq!(
            chunk(FIRST_STEPS_GRANULE_LIMIT - g, RunStage::FirstSteps),
            g
        );
        assert_eq!(
            chunk(FIRST_STEPS_GRANULE_LIMIT, RunStage::FirstSteps),
            16 * MIB
        );
        assert_eq!(chunk(64 * GIB, RunStage::FirstSteps), 32 * MIB);
    }

    #[test]
    fn a_pool_without_a_granule_limit_takes_the_divisor_from_the_first_step() {
        let p = policy(0);
        assert_eq!(
            p.growth_chunk(4 * GIB, 2 * MIB, RunStage::FirstSteps),
            4 * MIB
        );
        // A limit above the first steps' keeps its own.
        let p = policy(32 * GIB);
        assert_eq!(
            p.growth_chunk(20 * GIB, 2 * MIB, RunStage::FirstSteps),
            2 * MIB
        );
    }

    #[test]
    fn whole_chunks_without_a_divisor() {
        let p = ChunkPolicy {
            chunk_divisor: None,
            ..policy(2 * GIB)
        };
        assert_eq!(p.growth_chunk(GIB, 2 * MIB, RunStage::FirstSteps), 32 * MIB);
    }
}
