//! Gathering a pool's whole free regions into one range at a step mark
//! (Note [Growth and remapping], "Gathering at marks", in docs/DESIGN.md).

use std::time::Instant;

use rustc_hash::FxHashSet;
use vmm::Backend;

use super::{Growing, Growth};
use crate::arena::ArenaId;
use crate::heap::BlockId;
use crate::props::Defragment;
use crate::Result;

impl<B: Backend> Growth<'_, B> {
    /// Gathers the units of the free blocks that are whole mapped regions
    /// (in both arenas) into one free block of the large arena, by growth's
    /// plan for their total (a range, or a bridge over the holes between
    /// them), where two or more such regions exist and the plan creates
    /// nothing: a step that ends with its free memory in one block places
    /// the next step's large allocations there, instead of moving units to
    /// make room for each (Note [Growth and remapping], "Gathering at
    /// marks"). Units under any stream's queued work stay where they are.
    /// Returns whether it gathered.
    #[cold]
    pub(crate) fn gather_free_regions(&mut self) -> Result<bool> {
        let free = self.free_units(None, Defragment::WholeRegions);
        let regions: FxHashSet<BlockId> = free.iter().map(|u| u.block).collect();
        if regions.len() < 2 {
            return Ok(false);
        }
        let total = free.iter().map(|u| u.len).sum();
        let arena = ArenaId::Large;
        let started = Instant::now();
        // Passed aliases go with this driver work, as in growth; before
        // the plan nothing is unmapped, for a gathering may not happen.
        match self.plan(arena, total, &free)? {
            Growing::Range(plan) if plan.created() == 0 => {
                self.space.unmap_passed_aliases();
                self.map_range(arena, &plan, &free)?;
            }
            // A large gathering may join the regions where they lie, by
            // filling the holes between them (Note [Growth and remapping],
            // "Bridges"), releasing as much as it creates. A bridge of no
            // hole is a run of free blocks that holds as much already.
            Growing::Bridge(bridge) if bridge.created() == 0 && !bridge.holes.is_empty() => {
                self.space.unmap_passed_aliases();
                self.bridge(arena, total, &bridge, &free, started)?;
            }
            _ => return Ok(false),
        }
        self.counters.gathers += 1;
        tracing::debug!(
            pool = self.pool,
            regions = regions.len(),
            bytes = total,
            took = ?started.elapsed(),
            "gathered free regions"
        );
        Ok(true)
    }
}
