//! Giving memory back: parking a pool's free units as it starts afresh
//! (Note [Starting afresh] in docs/DESIGN.md), and trimming it to a number
//! of bytes by releasing spare chunks and free units.

use std::time::Instant;

use vmm::Backend;

use super::{FreeUnit, Growth};
use crate::props::Defragment;
use crate::Result;

impl<B: Backend> Growth<'_, B> {
    /// Parks every unit with no live byte (none under guards): out of the
    /// heap, its chunk spare but still mapped, so that growth, laying out
    /// new space as from empty, maps it again at no cost where it lays a
    /// chunk of its size at its place (Note [Starting afresh] in
    /// docs/DESIGN.md).
    pub(crate) fn park_free_units(&mut self) {
        let mut units = self.free_units(None, Defragment::Units);
        let count = units.len();
        // Right to left, as in `unmap_units`.
        units.sort_by_key(|u| std::cmp::Reverse(u.va));
        for FreeUnit { va, len, block, .. } in units {
            let arena = self.arenas.of(va.0);
            self.arenas[arena].heap.take(block, va.0, len);
            self.space.park(va);
        }
        tracing::debug!(pool = self.pool, units = count, "started afresh");
    }

    /// Releases unused chunks (spares and free units, largest first) until
    /// the pool holds at most `keep` bytes, or nothing more can go.
    pub(crate) fn trim_to(&mut self, keep: u64) -> Result<()> {
        self.space.retry_unreleased();
        let reserved = self.space.reserved();
        if reserved <= keep {
            return Ok(());
        }
        let started = Instant::now();
        self.counters.trims += 1;
        // Passed aliases go first: a chunk only an alias held is spare
        // then, and a free unit's chunk is mapped nowhere else.
        self.space.unmap_passed_aliases();
        // Spare chunks and free units can go, largest first.
        let mut candidates: Vec<(u64, Option<FreeUnit>)> = self
            .space
            .spare_counts()
            .flat_map(|(size, n)| std::iter::repeat_n((size, None), n))
            .chain(
                self.free_units(None, Defragment::Units)
                    .into_iter()
                    .map(|u| (u.len, Some(u))),
            )
            .collect();
        candidates.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        let mut after = reserved;
        let mut spare_count = 0;
        let mut units = Vec::new();
        for (size, unit) in candidates {
            if after <= keep {
                break;
            }
            after -= size;
            match unit {
                Some(unit) => units.push(unit),
                None => spare_count += 1,
            }
        }
        // The largest spares are the ones counted above.
        self.space.release_largest_spares(spare_count);
        let unit_count = units.len();
        for m in self.unmap_units(units)? {
            self.space.release(m.chunk);
        }
        // One event per trim; each chunk released is logged at trace.
        tracing::debug!(
            pool = self.pool,
            keep,
            chunks = spare_count + unit_count,
            bytes = reserved - self.space.reserved(),
            reserved = self.space.reserved(),
            took = ?started.elapsed(),
            "trimmed"
        );
        Ok(())
    }
}
