//! Growing a pool's mapped space, and shrinking it: where a new range goes
//! and which chunks back it (spares, free units moved from elsewhere, new
//! chunks), and which chunks a trim gives back. The choice itself is the
//! pure planner's ([`crate::plan`]); this module gathers its inputs from
//! the pool's tables and carries its plan out (Note [Growth and
//! remapping] in docs/DESIGN.md).

mod at_marks;
mod gathering;
mod joining;
mod trimming;

pub(crate) use at_marks::{AtMarks, Counts};

use std::sync::Arc;
use std::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};
use vmm::memory::Chunk;
use vmm::Backend;

use crate::arena::{ArenaId, Arenas, RunStage};
use crate::heap::BlockId;
use crate::ordering::{Guard, Guards, StreamPos};
use crate::plan::{self, Bridge, Gap, Mapped, Plan, Sizes, Source, Tail, UnitSize};
use crate::props::Defragment;
use crate::space::{Piece, Space};
use crate::va::Va;
use crate::{Error, Result};

/// What growth has done, for [`crate::PoolStats`].
#[derive(Debug, Clone, Default)]
pub(crate) struct GrowthCounters {
    pub(crate) grows: u64,
    pub(crate) remaps: u64,
    pub(crate) bytes_remapped: u64,
    pub(crate) trims: u64,
    /// Marks at which whole free regions were gathered into one range.
    pub(crate) gathers: u64,
    /// Marks at which free units were joined into larger chunks.
    pub(crate) joins: u64,
}

/// A unit with no live byte: all of it inside the free heap block `block`.
#[derive(Debug, Clone, Copy)]
struct FreeUnit {
    va: Va,
    len: u64,
    block: BlockId,
    /// Its chunk is mapped elsewhere too, as an alias its stream may
    /// still use: it may move, never be released.
    aliased: bool,
}

/// A unit taken out of its place, with the guard position it was under
/// there if its old mapping stays as an alias.
struct MovedUnit<B: Backend> {
    from: Va,
    chunk: Arc<Chunk<B>>,
    under: Option<StreamPos>,
}

/// Growth bridges holes only for a request of at least this share of the
/// pool's reserved bytes (a 1/8th): there a range moves most of the pool,
/// a bridge a few chunks. For smaller requests the range moves few units
/// anyway, and bridging only places them elsewhere: replays of every trace
/// in traces/ then ended up to 0.007 above or below their footprints
/// (docs/RESULTS.md, "Bridging holes").
const BRIDGE_SHARE: u64 = 8;

/// Where a growth maps its chunks.
enum Growing {
    /// One new range.
    Range(Plan),
    /// The holes between free blocks.
    Bridge(Bridge),
}

/// The chunks gathered for a growth, in mapping order, each with the guard
/// position it was under at its old place.
struct Gathered<B: Backend> {
    pieces: Vec<Piece<B>>,
    under: Vec<Option<StreamPos>>,
}

/// The parts of a pool that growing and trimming change, borrowed together
/// under the pool's lock.
pub(crate) struct Growth<'a, B: Backend> {
    /// The pool's id, for the logs.
    pub(crate) pool: u64,
    pub(crate) space: &'a mut Space<B>,
    pub(crate) arenas: &'a mut Arenas,
    pub(crate) guards: &'a mut Guards,
    pub(crate) counters: &'a mut GrowthCounters,
    /// Which unused chunks may move ([`crate::PoolProps::defragment`]).
    pub(crate) defragment: Defragment,
    /// Sizes the chunks growth creates ([`crate::arena::ChunkPolicy`]).
    pub(crate) stage: RunStage,
}

impl<B: Backend> Growth<'_, B> {
    /// Maps new space in `arena` so that a free block of at least `size`
    /// bytes exists, and returns it. `mover`: the stream growing, whose own
    /// guarded units may move. On failure the tables are consistent and
    /// every chunk is still accounted for (mapped, spare or released).
    #[cold]
    pub(crate) fn grow(
        &mut self,
        arena: ArenaId,
        size: u64,
        mover: Option<u64>,
    ) -> Result<BlockId> {
        // Aliases their streams have passed go first: their unmaps join
        // this driver work (Note [Guards and aliases], "Unmapped with
        // other work"), and a chunk only an alias held is spare for the
        // plan.
        self.space.unmap_passed_aliases();
        // Without defragmentation, nothing unused is moved: new memory only.
        let free = match self.defragment {
            Defragment::Off => Vec::new(),
            scope => self.free_units(mover, scope),
        };
        let started = Instant::now();
        let block = match self.plan(arena, size, &free)? {
            Growing::Range(plan) => self.range(arena, size, &plan, &free, started)?,
            Growing::Bridge(bridge) => self.bridge(arena, size, &bridge, &free, started)?,
        };
        self.counters.grows += 1;
        Ok(block)
    }

    /// Carries out a growth's `plan` for a `size`-byte request (see
    /// [`Growth::map_range`]), and logs it.
    fn range(
        &mut self,
        arena: ArenaId,
        size: u64,
        plan: &Plan,
        free: &[FreeUnit],
        started: Instant,
    ) -> Result<BlockId> {
        let block = self.map_range(arena, plan, free)?;
        // One event per growth; the chunks it created or moved are logged
        // one by one at trace.
        let count = |f: fn(&Source) -> bool| plan.sources.iter().filter(|s| f(s)).count();
        tracing::debug!(
            pool = self.pool,
            ?arena,
            request = size,
            bytes = plan.len(),
            at = format_args!("{:#x}", plan.target.start),
            chunks = plan.sources.len(),
            created = count(|s| matches!(s, Source::New { .. })),
            moved = count(|s| matches!(s, Source::Unit { .. })),
            spare = count(|s| matches!(s, Source::Spare { .. })),
            took = ?started.elapsed(),
            "grew"
        );
        Ok(block)
    }

    /// Gathers the chunks of `plan` and maps them side by side as its new
    /// range in `arena`, one free block there, and returns it. `free`: the
    /// free units the plan was made from.
    fn map_range(&mut self, arena: ArenaId, plan: &Plan, free: &[FreeUnit]) -> Result<BlockId> {
        let targets = side_by_side(plan.target.start, &plan.sources);
        let gathered = self.gather(&plan.sources, &targets, free, &FxHashSet::default())?;
        let sizes: Vec<u64> = gathered.pieces.iter().map(Piece::size).collect();
        self.space.map_at(Va(plan.target.start), gathered.pieces)?;
        let block = self.arenas[arena]
            .heap
            .insert_free(plan.target.start, plan.len());
        self.carry_guards(plan.target.start, &sizes, gathered.under);
        Ok(block)
    }

    /// Guards the chunks just mapped side by side from `start`, of
    /// `sizes`: a unit moved from under its stream's queued work (`under`)
    /// carries that stream's guard to its new place, the same memory.
    fn carry_guards(
        &mut self,
        start: u64,
        sizes: &[u64],
        under: impl IntoIterator<Item = Option<StreamPos>>,
    ) {
        let mut at = start;
        for (&size, under) in sizes.iter().zip(under) {
            if let Some(by) = under {
                self.guards.insert(at, Guard { end: at + size, by });
            }
            at += size;
        }
    }

    /// Maps the chunks of `bridge` into its holes, so that a free block of
    /// at least `size` bytes joins up, and returns it. On failure, the
    /// holes mapped so far stay mapped, free, and the other chunks are
    /// spare.
    fn bridge(
        &mut self,
        arena: ArenaId,
        size: u64,
        bridge: &Bridge,
        free: &[FreeUnit],
        started: Instant,
    ) -> Result<BlockId> {
        let sources: Vec<Source> = bridge
            .holes
            .iter()
            .flat_map(|(_, sources)| sources.iter().copied())
            .collect();
        let targets: Vec<u64> = bridge
            .holes
            .iter()
            .flat_map(|(hole, sources)| side_by_side(hole.start, sources))
            .collect();
        let release: FxHashSet<u64> = bridge.release.iter().map(|u| u.va).collect();
        let gathered = self.gather(&sources, &targets, free, &release)?;
        let mut pieces = gathered.pieces.into_iter();
        let mut under = gathered.under.into_iter();
        let mut joined = None;
        for (hole, sources) in &bridge.holes {
            let these: Vec<Piece<B>> = pieces.by_ref().take(sources.len()).collect();
            let sizes: Vec<u64> = these.iter().map(Piece::size).collect();
            if let Err(err) = self.space.map_at(Va(hole.start), these) {
                for piece in pieces {
                    self.space.put_back(piece);
                }
                return Err(err);
            }
            joined = Some(self.arenas[arena].heap.insert_free(hole.start, hole.len));
            self.carry_guards(hole.start, &sizes, under.by_ref().take(sizes.len()));
        }
        tracing::debug!(
            pool = self.pool,
            ?arena,
            request = size,
            holes = bridge.holes.len(),
            released = bridge.release.len(),
            bytes = bridge.len(),
            chunks = sources.len(),
            took = ?started.elapsed(),
            "bridged"
        );
        Ok(joined.expect("a bridge has a hole"))
    }

    /// Where growth maps: a new range, or for a large request the holes of
    /// a bridge, whichever creates fewer new bytes, then maps fewer (Note
    /// [Growth and remapping], "Bridges"). `free`: the free units growth
    /// may move (see [`Growth::free_units`]).
    fn plan(&self, arena: ArenaId, size: u64, free: &[FreeUnit]) -> Result<Growing> {
        let granule = self.space.granule();
        let arena = &self.arenas[arena];
        // Chunks sized by what the pool holds apart from its spares: after
        // a fresh start, where every chunk is spare, growth takes them in
        // the sizes it created them in from empty (Note [Starting afresh]).
        let in_use = self.space.reserved() - self.space.spare_bytes();
        let growth_chunk = arena.policy.growth_chunk(in_use, granule, self.stage);
        let (start, end) = (arena.start, arena.end);
        // Address ranges in use: the units, which the heap's regions cover
        // exactly (a unit's range goes in when it is mapped and out when it
        // is unmapped), a region for each run of them; and the old places of
        // moved units and the mappings that would not unmap, out of the heap
        // but still mapped.
        let regions = arena.heap.regions();
        let mapped_apart = self.space.mapped_apart_in(Va(start)..Va(end));
        let mut occupied = regions.clone();
        occupied.extend(mapped_apart.iter().copied());
        // Two runs already in order: a stable sort merges them in one pass.
        occupied.sort();
        let next_in_use_after = |at: u64| {
            let i = occupied.partition_point(|&(va, _)| va < at);
            occupied.get(i).map_or(end, |&(va, _)| va)
        };
        let mut tails: Vec<Tail> = arena
            .heap
            .free_region_tails()
            .map(|(start, len, _)| Tail {
                start,
                len,
                room_after: next_in_use_after(start + len) - (start + len),
            })
            .collect();
        // Deterministic order for ties (the heap keeps tails in a hash map).
        tails.sort_unstable();
        let mut prev_end = start;
        let mut gaps: Vec<Gap> = Vec::new();
        for &(va, size) in &occupied {
            if va > prev_end {
                gaps.push(Gap {
                    start: prev_end,
                    len: va - prev_end,
                });
            }
            prev_end = va + size;
        }
        gaps.push(Gap {
            start: prev_end,
            len: end - prev_end,
        });
        let spares = if self.defragment != Defragment::Off {
            Sizes::of(self.space.spare_counts())
        } else {
            Sizes::of([])
        };
        let units: Vec<UnitSize> = free
            .iter()
            .map(|u| UnitSize {
                va: u.va.0,
                size: u.len,
            })
            .collect();
        // Only a large request weighs a bridge, and needs its inputs.
        let bridging = size * BRIDGE_SHARE >= self.space.reserved();
        let mut mapped: Vec<Mapped> = Vec::new();
        if bridging {
            let heads: FxHashMap<u64, u64> = arena.heap.free_region_heads().collect();
            let tail_at: FxHashMap<u64, u64> =
                tails.iter().map(|t| (t.start + t.len, t.len)).collect();
            mapped = regions
                .iter()
                .map(|&(start, len)| Mapped {
                    start,
                    len,
                    head: heads.get(&start).copied().unwrap_or(0),
                    tail: tail_at.get(&(start + len)).copied().unwrap_or(0),
                })
                .chain(mapped_apart.iter().map(|&(start, len)| Mapped {
                    start,
                    len,
                    head: 0,
                    tail: 0,
                }))
                .collect();
            mapped.sort_unstable_by_key(|m| m.start);
        }
        let inputs = plan::Inputs {
            mapped: &mapped,
            tails: &tails,
            gaps: &gaps,
            spares,
            units: &units,
            granule,
            chunk_size: growth_chunk,
        };
        let bridge = bridging
            .then(|| {
                // A bridge may release units: only those no stream may
                // still use, here or through an alias.
                let unguarded: Vec<UnitSize> = free
                    .iter()
                    .zip(&units)
                    .filter(|(f, u)| {
                        !f.aliased && self.guards.in_range(u.va, u.va + u.size).next().is_none()
                    })
                    .map(|(_, &u)| u)
                    .collect();
                plan::plan_bridge(size, &inputs, &unguarded)
            })
            .flatten();
        match (plan::plan_growth(size, &inputs), bridge) {
            // New memory is what the footprint pays; then the driver calls.
            (Some(range), Some(bridge))
                if (bridge.created(), bridge.len()) < (range.created(), range.len()) =>
            {
                Ok(Growing::Bridge(bridge))
            }
            (Some(range), _) => Ok(Growing::Range(range)),
            (None, Some(bridge)) => Ok(Growing::Bridge(bridge)),
            (None, None) => Err(Error::OutOfAddressSpace {
                requested: size,
                arena_size: end - start,
                reserved: self.space.reserved(),
            }),
        }
    }

    /// Units with no live byte, in both arenas, that can move or go: no
    /// stream may still touch them (no guard on them), except `mover`, for
    /// which a unit under its own guards moves and leaves an alias behind;
    /// and their chunk has no other mapping.
    ///
    /// In the order growth should move them: by address, except that a
    /// pool whose chunks scale with it ([`crate::PoolProps::chunk_divisor`])
    /// moves first the units of free blocks that start and end on unit
    /// boundaries. Moving a unit out of a block that ends part way into a
    /// unit holding live bytes shrinks the free space beside that partial
    /// unit, until nothing fits there and it is stranded; a block with
    /// whole units at both ends leaves none.
    /// With [`Defragment::WholeRegions`], only the units of free blocks
    /// that are whole mapped regions count.
    fn free_units(&self, mover: Option<u64>, scope: Defragment) -> Vec<FreeUnit> {
        let whole_first = self.arenas[ArenaId::Large].policy.chunk_divisor.is_some();
        // Units are whole granules: the small arena's chunk size.
        let smallest_unit = self.arenas[ArenaId::Small].policy.chunk_size;
        let units = self.space.units();
        let alias_counts = if mover.is_some() {
            self.space.alias_counts()
        } else {
            FxHashMap::default()
        };
        // The free blocks that can hold a unit, ranked; their units then
        // come in address order within each block, and blocks do not
        // overlap, so the units come out ranked too.
        struct Candidate {
            partial: bool,
            addr: u64,
            len: u64,
            block: BlockId,
        }
        let mut blocks: Vec<Candidate> = Vec::new();
        for arena in self.arenas.iter() {
            arena.heap.for_each_free(|addr, len, block| {
                if len < smallest_unit {
                    return;
                }
                // A block lies in one mapped region, which its units tile:
                // it starts on a unit boundary when a unit starts there, and
                // ends on one when the last unit starting in it ends there.
                let (start, end) = (Va(addr), Va(addr) + len);
                let partial = whole_first && {
                    let mut ends = units.range(start..end);
                    let first = ends.next();
                    let last = ends.next_back().or(first);
                    !(first.is_some_and(|(&va, _)| va == start)
                        && last.is_some_and(|(&va, m)| va + m.size() as u64 == end))
                };
                blocks.push(Candidate {
                    partial,
                    addr,
                    len,
                    block,
                });
            });
        }
        if scope == Defragment::WholeRegions {
            let regions: FxHashSet<(u64, u64)> =
                self.arenas.iter().flat_map(|a| a.heap.regions()).collect();
            blocks.retain(|c| regions.contains(&(c.addr, c.len)));
        }
        blocks.sort_unstable_by_key(|c| (c.partial, c.addr));
        let mut found = Vec::new();
        for c in blocks {
            let block_end = Va(c.addr) + c.len;
            for (&va, m) in units.range(Va(c.addr)..block_end) {
                let end = va + m.size() as u64;
                // Held by its unit alone, or (for a stream's growth) by its
                // aliases besides: a chunk mapped at several places moves
                // as one mapped at one (Note [Guards and aliases], "Units
                // moved again"). One held elsewhere (exported) stays.
                let others = Arc::strong_count(m.chunk()) - 1;
                let aliases = alias_counts.get(&m.chunk().handle()).copied().unwrap_or(0);
                let held_apart = others > 0 && (mover.is_none() || others != aliases);
                let movable = || {
                    !held_apart
                        && self
                            .guards
                            .in_range(va.0, end.0)
                            .all(|(_, g)| Some(g.by.stream) == mover)
                };
                if end <= block_end && movable() {
                    found.push(FreeUnit {
                        va,
                        len: m.size() as u64,
                        block: c.block,
                        aliased: others > 0,
                    });
                }
            }
        }
        found
    }

    /// Takes free units (as [`Growth::free_units`] lists them) out of the
    /// heap and unmaps them, right to left so that each free block's id
    /// stays valid for the units left of it. A unit under guards (of the
    /// stream that moves it) is not unmapped but kept as an alias. A unit
    /// that fails to unmap goes back in the heap; the chunks unmapped before
    /// it are spare.
    fn unmap_units(&mut self, mut units: Vec<FreeUnit>) -> Result<Vec<MovedUnit<B>>> {
        units.sort_by_key(|u| std::cmp::Reverse(u.va));
        let mut moved: Vec<MovedUnit<B>> = Vec::new();
        for FreeUnit { va, len, block, .. } in units {
            let arena = self.arenas.of(va.0);
            self.arenas[arena].heap.take(block, va.0, len);
            let mapping = self.space.remove_unit(va);
            let guards = self.guards.take(va.0, va.0 + len);
            if let Some(&first) = guards.first() {
                let seq = guards.iter().map(|g| g.by.seq).max().expect("not empty");
                let until = StreamPos {
                    stream: first.by.stream,
                    seq,
                };
                let chunk = Arc::clone(mapping.chunk());
                tracing::trace!(
                    va = format_args!("{va:#x}"),
                    len,
                    stream = until.stream,
                    "moving a unit its stream may still use: the old mapping stays until it passes"
                );
                self.space.add_alias(va, mapping, until);
                moved.push(MovedUnit {
                    from: va,
                    chunk,
                    under: Some(until),
                });
                continue;
            }
            match self.space.unmap(mapping) {
                Ok(chunk) => moved.push(MovedUnit {
                    from: va,
                    chunk,
                    under: None,
                }),
                Err((err, mapping)) => {
                    self.space.restore_unit(va, mapping);
                    self.arenas[arena].heap.insert_free(va.0, len);
                    for m in moved {
                        self.space.keep_spare(m.chunk);
                    }
                    return Err(err);
                }
            }
        }
        Ok(moved)
    }

    /// Collects the chunks a plan names, in its order, first releasing the
    /// free units at the addresses in `release` (a bridge's), so that the
    /// pool never holds both them and the new chunks. A spare the plan
    /// names goes by its size: a chunk parked of that size where it goes
    /// (`targets`: each source's address) stays mapped there; the parked
    /// chunks in the way are unmapped. On failure the chunks this call
    /// created are released again and the others are spare or parked.
    /// `free`: the free units the plan was made from.
    fn gather(
        &mut self,
        sources: &[Source],
        targets: &[u64],
        free: &[FreeUnit],
        release: &FxHashSet<u64>,
    ) -> Result<Gathered<B>> {
        let moving: FxHashSet<Va> = sources
            .iter()
            .filter_map(|s| match *s {
                Source::Unit { va, .. } => Some(Va(va)),
                _ => None,
            })
            .collect();
        // One call for both, right to left, so that the heap's block ids
        // stay valid throughout.
        let units = free
            .iter()
            .filter(|u| moving.contains(&u.va) || release.contains(&u.va.0))
            .copied()
            .collect();
        let mut moved: FxHashMap<Va, MovedUnit<B>> = FxHashMap::default();
        for m in self.unmap_units(units)? {
            if !release.contains(&m.from.0) {
                moved.insert(m.from, m);
            } else if m.under.is_none() {
                self.space.release(m.chunk);
            } else {
                // Under its stream's work (a bridge releases none such):
                // its alias keeps the chunk, spare once the stream passes.
                drop(m);
            }
        }
        // A chunk parked where the plan lays a spare of its size stays
        // there; the other parked chunks in the way go.
        let mut in_place: Vec<Option<Piece<B>>> = sources
            .iter()
            .zip(targets)
            .map(|(source, &at)| match *source {
                Source::Spare { size } => {
                    self.space.take_parked_at(Va(at), size).map(Piece::InPlace)
                }
                _ => None,
            })
            .collect();
        let mut failure = None;
        for (source, &at) in sources.iter().zip(targets) {
            if let Err(err) = self.space.clear_parked(Va(at)..Va(at + source.size())) {
                failure = Some(err);
                break;
            }
        }
        let mut gathered = Gathered {
            pieces: Vec::new(),
            under: Vec::new(),
        };
        let mut created = Vec::new();
        for (i, source) in sources.iter().enumerate() {
            if failure.is_some() {
                break;
            }
            let mut was_under = None;
            let chunk = match *source {
                Source::Spare { size } => {
                    if let Some(piece) = in_place[i].take() {
                        gathered.pieces.push(piece);
                        gathered.under.push(None);
                        continue;
                    }
                    match self.space.take_spare(size) {
                        Ok(chunk) => chunk,
                        Err(err) => {
                            failure = Some(err);
                            break;
                        }
                    }
                }
                Source::Unit { va, size } => {
                    self.counters.remaps += 1;
                    self.counters.bytes_remapped += size;
                    tracing::trace!(
                        from = format_args!("{va:#x}"),
                        size,
                        "remapping a free unit"
                    );
                    moved.remove(&Va(va)).map(|m| {
                        was_under = m.under;
                        m.chunk
                    })
                }
                Source::New { size } => match self.space.create_chunk(size) {
                    Ok(chunk) => {
                        created.push(chunk.handle());
                        Some(chunk)
                    }
                    Err(err) => {
                        failure = Some(err);
                        break;
                    }
                },
            };
            gathered.pieces.push(Piece::Chunk(
                chunk.expect("every planned chunk was gathered"),
            ));
            gathered.under.push(was_under);
        }
        match failure {
            Some(err) => {
                // Moved units not gathered yet are spare (or stay with their
                // aliases, which hand them over when they go).
                for m in moved.into_values() {
                    self.space.keep_spare(m.chunk);
                }
                for piece in gathered
                    .pieces
                    .into_iter()
                    .chain(in_place.into_iter().flatten())
                {
                    match piece {
                        Piece::Chunk(chunk) if created.contains(&chunk.handle()) => {
                            self.space.release(chunk)
                        }
                        piece => self.space.put_back(piece),
                    }
                }
                Err(err)
            }
            None => Ok(gathered),
        }
    }
}

/// The address of each of `sources`, mapped side by side from `start`.
fn side_by_side(start: u64, sources: &[Source]) -> Vec<u64> {
    sources
        .iter()
        .scan(start, |at, source| {
            let here = *at;
            *at += source.size();
            Some(here)
        })
        .collect()
}
