//! Reading a pool's state out: its statistics, a snapshot of its address
//! space, and the audit that recounts its tables.

use vmm::Backend;

use super::inner::Inner;
use crate::stats::{PoolSnapshot, PoolStats};
use crate::va::Va;
use crate::AuditError;

pub(super) fn stats<B: Backend>(inner: &Inner<B>) -> PoolStats {
    let pending = inner.streams.totals();
    let (calls, growth) = (&inner.calls, &inner.growth);
    let space = &inner.space.counters;
    let ordering = &inner.streams.counters;
    PoolStats {
        // Hot-path counts live with the streams until they unregister.
        allocations: calls.allocations + pending.reuses,
        frees: calls.frees + pending.frees,
        grows: growth.grows,
        grow_nanos: calls.grow_nanos,
        remaps: growth.remaps,
        bytes_remapped: growth.bytes_remapped,
        chunks_created: space.chunks_created,
        chunks_released: space.chunks_released,
        bytes_created: space.bytes_created,
        bytes_released: space.bytes_released,
        maps: space.maps,
        unmaps: space.unmaps,
        trims: growth.trims,
        gathers: growth.gathers,
        joins: growth.joins,
        same_stream_reuses: calls.same_stream_reuses + pending.reuses,
        dependency_reuses: ordering.dependency_reuses,
        frees_completed: ordering.frees_completed,
        waits_inserted: ordering.waits_inserted,
        frees_merged: ordering.frees_merged,
        events_recorded: ordering.events_recorded,
        reserved_bytes: inner.space.reserved(),
        used_bytes: inner.used_bytes(),
        mapped_bytes: inner.space.mapped_bytes(),
        spare_bytes: inner.space.spare_bytes(),
        units: inner.space.units().len() as u64,
        largest_free_range: inner
            .arenas
            .iter()
            .map(|a| a.heap.largest_free())
            .max()
            .unwrap_or(0),
        pending_bytes: inner.guards.bytes() + pending.bytes,
        aliased_bytes: inner.space.aliased_bytes(),
        asleep: inner.slumber.is_some(),
        kept_on_host_bytes: inner.slumber.as_ref().map_or(0, |s| s.kept_bytes()),
        host_bytes: inner.host_bytes(),
    }
}

pub(super) fn snapshot<B: Backend>(inner: &Inner<B>, va_size: u64) -> PoolSnapshot {
    let mut free = Vec::new();
    for arena in inner.arenas.iter() {
        arena
            .heap
            .for_each_free(|addr, len, _| free.push((addr, len)));
    }
    free.sort_unstable();
    PoolSnapshot {
        base: inner.space.base().0,
        va_size,
        arenas: inner.arenas.iter().map(|a| (a.start, a.end)).collect(),
        units: inner.space.unit_views(),
        free,
        spares: inner.space.spare_chunks().collect(),
        stats: stats(inner),
    }
}

/// Recounts the pool from its tables: the space's own checks, then guards
/// against the heaps' free ranges, mapped bytes against free and allocated
/// ones, the heaps' regions against the runs of units, and the chunk count
/// against those created and released.
pub(super) fn audit<B: Backend>(inner: &Inner<B>) -> std::result::Result<(), AuditError> {
    let mut problems = Vec::new();
    // Pending frees still in their streams' lists are allocated in the
    // heap; guarded ones are free there.
    let allocated = inner.live_bytes() + inner.streams.totals().bytes;
    let registered = |stream| inner.streams.is_registered(stream);
    let (mut mapped, chunks_held) = inner.space.audit(registered, &mut problems);
    // Asleep, the heaps still describe the units released, which wake maps
    // again where they were.
    if let Some(slumber) = &inner.slumber {
        mapped += slumber.unit_bytes();
    }
    let free: u64 = inner.arenas.iter().map(|a| a.heap.free_bytes()).sum();
    let mut free_ranges = Vec::new();
    for arena in inner.arenas.iter() {
        arena
            .heap
            .for_each_free(|addr, len, _| free_ranges.push((addr, addr + len)));
    }
    free_ranges.sort_unstable();
    let mut prev_end = 0;
    for (start, g) in inner.guards.iter() {
        let i = free_ranges.partition_point(|&(a, _)| a <= start);
        let inside = i > 0 && free_ranges[i - 1].1 >= g.end;
        if start < prev_end || g.end <= start || !inside {
            problems.push(format!(
                "guard [{start:#x}, {:#x}) of stream {} is not a free range of its own",
                g.end, g.by.stream
            ));
        }
        if !registered(g.by.stream) {
            problems.push(format!(
                "guard at {start:#x}: stream {} not registered",
                g.by.stream
            ));
        }
        prev_end = g.end;
    }
    if free + allocated != mapped {
        problems.push(format!(
            "free {free} + allocated {allocated} != {mapped} bytes mapped"
        ));
    }
    // Planning takes the ranges in use from the heaps' regions: each must
    // be a run of adjacent units, and every run one region.
    for arena in inner.arenas.iter() {
        let runs: Vec<(u64, u64)> = match &inner.slumber {
            Some(slumber) => {
                let mapped: Vec<(Va, u64)> = inner
                    .space
                    .units()
                    .iter()
                    .map(|(&va, m)| (va, m.size() as u64))
                    .collect();
                slumber.runs_in(arena.start, arena.end, &mapped)
            }
            None => inner
                .space
                .unit_runs(Va(arena.start)..Va(arena.end))
                .into_iter()
                .map(|run| (run.range.start.0, run.range.end.0 - run.range.start.0))
                .collect(),
        };
        if arena.heap.regions() != runs {
            problems.push(format!(
                "the heap's regions in [{:#x}, {:#x}) are not the runs of its units",
                arena.start, arena.end
            ));
        }
    }
    let counters = &inner.space.counters;
    if counters.chunks_created - counters.chunks_released != chunks_held {
        problems.push(format!(
            "{} chunks created, {} released, {} held",
            counters.chunks_created, counters.chunks_released, chunks_held
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(AuditError { problems })
    }
}
