//! What a pool keeps under its lock, and the allocation path that takes it:
//! the heaps, other streams' frees as the reuse rules allow, then growth.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmm::{Backend, ErrorKind};

use crate::arena::{ArenaId, Arenas, LayoutAtMark, RunStage, SmallOverflow, StepEnd, FIRST_STEPS};
use crate::growth::{AtMarks, Counts, Growth, GrowthCounters};
use crate::heap::BlockId;
use crate::ordering::{Counted, Guard, Guards, Pending, StreamShared, Streams};
use crate::props::{Defragment, FreshStart};
use crate::space::Space;
use crate::{Allocation, Error, Result};

use super::pending::KEEP_SMALL;
use super::sleep::{Retention, Slumber};

/// One allocation on the slow path: what it asks for, and the heap blocks
/// it took but may not use (another stream's guards cover them), given
/// back to the heap when it is done.
struct Request<'s, B: Backend> {
    /// Bytes, rounded to the heap's quantum.
    size: u64,
    /// `None`: a synchronous allocation.
    stream: Option<&'s Arc<StreamShared<B>>>,
    held: Vec<Held>,
}

/// A heap block an allocation holds while it looks further.
struct Held {
    arena: ArenaId,
    block: BlockId,
}

/// A heap block found for an allocation.
#[derive(Clone, Copy)]
struct Found {
    addr: u64,
    block: BlockId,
}

impl Found {
    /// The allocation of `size` bytes this block in `arena` serves.
    fn pending(&self, arena: ArenaId, size: u64) -> Pending {
        Pending {
            arena,
            block: self.block,
            ptr: self.addr,
            size,
            seq: 0,
        }
    }
}

/// Calls counted under the lock; the hot path's own counts live with the
/// streams until they leave the pool's table.
#[derive(Debug, Clone, Default)]
pub(super) struct CallCounters {
    pub(super) allocations: u64,
    pub(super) frees: u64,
    pub(super) same_stream_reuses: u64,
    pub(super) grow_nanos: u64,
}

/// Whether the pool marks steps already, for [`Inner::take_emptied_mark`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StepMarks {
    /// No step marked yet.
    None,
    /// Steps marked (by the pool, where the program emptied it).
    Some,
}

/// Whose an allocation is. The program's go in the pool's recorded trace
/// and count as used bytes; a step layout's region does neither: the
/// planned allocations in it do (Note [Step layouts]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    Program,
    Region,
}

/// Bytes of live allocations as the lock counts them (Note [Usage credit]
/// in docs/DESIGN.md).
#[derive(Debug, Default)]
pub(super) struct Usage {
    /// Live heap bytes, less the frees the streams' hot paths have not yet
    /// settled here. A step layout's region is one heap allocation.
    pub(super) used: u64,
    /// Bytes of step layouts' regions that no planned allocation holds:
    /// allocated in the heap, not by the program (Note [Step layouts]).
    pub(super) idle: u64,
    /// Bytes of planned allocations freed since the lock last counted
    /// them, idle again: a planned free adds them without this lock
    /// (holding the steps' own), and [`Inner::settle`] moves them into
    /// `idle`. They only lower the used bytes, so counting them late never
    /// raises the high-water mark.
    pub(super) planned_frees: Arc<AtomicU64>,
    /// The most bytes the program has held: `used - idle` at its highest.
    pub(super) used_high: u64,
}

pub(super) struct Inner<B: Backend> {
    pub(super) arenas: Arenas,
    pub(super) space: Space<B>,
    pub(super) streams: Streams<B>,
    pub(super) guards: Guards,
    pub(super) usage: Usage,
    pub(super) release_threshold: u64,
    /// Growth's count of moved units when the pool last started afresh.
    remaps_at_fresh: u64,
    /// The most bytes the program has held since the pool last marked a
    /// step where the program emptied it (Note [Steps at emptying]).
    step_high: u64,
    /// Growth's count of moved units when the pool last marked so.
    remaps_at_mark: u64,
    /// Steps marked so far, up to [`FIRST_STEPS`].
    steps_marked: u32,
    /// Growth's counts at the last mark, for its work at the next.
    at_marks: AtMarks,
    /// Where a small request goes that the small arena's free memory
    /// cannot serve, set at each mark ([`SmallOverflow::at_mark`]).
    small_overflow: SmallOverflow,
    pub(super) defragment: Defragment,
    fresh_start: FreshStart,
    /// The pool's id, for the logs.
    pool: u64,
    pub(super) calls: CallCounters,
    pub(super) growth: GrowthCounters,
    /// What sleeping does with the pool's bytes.
    pub(super) retention: Retention,
    /// While the pool sleeps: where its kept bytes are and where its units
    /// were.
    pub(super) slumber: Option<Slumber>,
    /// Page-locked host memory for the kept bytes: holds them while the
    /// pool sleeps, and stays for the next sleep (Note [Sleep and wake]).
    pub(super) host: Option<B::HostBuffer>,
    /// A reused buffer: the guards an allocation finds in its range, empty
    /// between calls.
    found_guards: Vec<(u64, Guard)>,
    /// A reused buffer: frees a stream's table hands back.
    pub(super) released: Vec<Pending>,
}

impl<B: Backend> Inner<B> {
    pub(super) fn new(
        arenas: Arenas,
        space: Space<B>,
        streams: Streams<B>,
        defragment: Defragment,
        fresh_start: FreshStart,
        pool: u64,
        planned_frees: Arc<AtomicU64>,
    ) -> Self {
        Self {
            arenas,
            space,
            streams,
            guards: Guards::default(),
            usage: Usage {
                planned_frees,
                ..Usage::default()
            },
            release_threshold: 0,
            remaps_at_fresh: 0,
            step_high: 0,
            remaps_at_mark: 0,
            steps_marked: 0,
            at_marks: AtMarks::default(),
            small_overflow: SmallOverflow::Grow,
            defragment,
            fresh_start,
            pool,
            calls: CallCounters::default(),
            growth: GrowthCounters::default(),
            retention: Retention::default(),
            slumber: None,
            host: None,
            found_guards: Vec::new(),
            released: Vec::new(),
        }
    }

    /// The parts growth and trimming change, borrowed together.
    pub(super) fn growth(&mut self) -> Growth<'_, B> {
        let stage = self.stage();
        Growth {
            space: &mut self.space,
            arenas: &mut self.arenas,
            guards: &mut self.guards,
            counters: &mut self.growth,
            defragment: self.defragment,
            pool: self.pool,
            stage,
        }
    }

    fn stage(&self) -> RunStage {
        if self.steps_marked < FIRST_STEPS {
            RunStage::FirstSteps
        } else {
            RunStage::Later
        }
    }

    /// Counts a step marked, for the chunks growth creates (Note [Growth
    /// chunk size], "The first steps"); at a program's step after the
    /// first steps, has growth gather the whole free regions into one
    /// range where the step just ended created chunks, and join free units
    /// where steps keep moving them (Note [Growth and remapping],
    /// "Gathering at marks", "Joining where steps keep moving units").
    /// Either failing leaves the tables consistent and every chunk
    /// accounted for, and the mark goes on: it is logged, not returned.
    /// `end` and `layout` set where small requests go until the next mark.
    pub(super) fn step_marked(&mut self, end: StepEnd, layout: LayoutAtMark) {
        self.steps_marked = (self.steps_marked + 1).min(FIRST_STEPS);
        self.small_overflow = SmallOverflow::at_mark(self.stage(), end, layout);
        let later = end == StepEnd::Program && self.steps_marked >= FIRST_STEPS;
        let work = self.at_marks.due(later, self.growth_counts());
        if work.gather {
            if let Err(error) = self.growth().gather_free_regions() {
                tracing::warn!(pool = self.pool, %error, "gathering free regions at a mark failed");
            }
        }
        if work.join {
            if let Err(error) = self.growth().join_free_units() {
                tracing::warn!(pool = self.pool, %error, "joining free units at a mark failed");
            }
        }
        self.at_marks.counted(self.growth_counts());
    }

    fn growth_counts(&self) -> Counts {
        Counts {
            created: self.space.counters.chunks_created,
            moved: self.growth.remaps,
        }
    }

    /// Bytes of live allocations: `used` less the streams' credits. It
    /// reads the credits and leaves them: settling them here would send the
    /// streams' next same-size allocations to the locked path, so that
    /// reading a statistic changed what it measures.
    pub(super) fn live_bytes(&self) -> u64 {
        self.usage.used - self.streams.credit()
    }

    /// Moves every stream's credit into `used` (Note [Usage credit]), and
    /// the planned frees into `idle`.
    pub(super) fn settle(&mut self) {
        self.usage.used -= self.streams.settle();
        self.usage.idle += self.usage.planned_frees.swap(0, Ordering::Acquire);
        debug_assert!(
            self.usage.idle <= self.usage.used,
            "more idle bytes ({}) than used ones ({})",
            self.usage.idle,
            self.usage.used
        );
    }

    /// Bytes the program holds: [`Inner::live_bytes`] less the idle bytes
    /// of step layouts' regions.
    pub(super) fn used_bytes(&self) -> u64 {
        let idle = self.usage.idle + self.usage.planned_frees.load(Ordering::Acquire);
        self.live_bytes().saturating_sub(idle)
    }

    /// Counts a heap allocation of `size` bytes made under this lock: the
    /// program's, or a step layout's region, idle until planned
    /// allocations take its bytes ([`Inner::count_planned`]).
    pub(super) fn count_used(&mut self, size: u64, purpose: Purpose) {
        self.settle();
        self.usage.used += size;
        match purpose {
            Purpose::Program => self.raise_high(),
            Purpose::Region => self.usage.idle += size,
        }
    }

    /// Counts a planned allocation of `size` bytes, in a region's bytes.
    pub(super) fn count_planned(&mut self, size: u64) {
        self.settle();
        self.usage.idle -= size;
        self.raise_high();
    }

    /// Counts `bytes` of step layouts' regions, idle until now, as freed:
    /// just before their frees, under the same hold of this lock, so that
    /// no other count finds the program's bytes misstated (Note [Step
    /// layouts]); the planned frees settled first, so that every idle
    /// byte is counted.
    pub(super) fn release_idle(&mut self, bytes: u64) {
        self.settle();
        self.usage.idle -= bytes;
    }

    fn raise_high(&mut self) {
        let held = self.usage.used.saturating_sub(self.usage.idle);
        self.usage.used_high = self.usage.used_high.max(held);
        self.step_high = self.step_high.max(held);
    }

    /// Whether the pool marks a step before this allocation of the
    /// program: since the pool last marked one so, the program has held at
    /// least half the most it ever held, and then, at some moment since the
    /// pool last counted, held none (as [`Inner::emptied`] reads it: by
    /// what the allocating stream freed alone). A program that frees a
    /// few small blocks as it starts a pass empties the pool too, but
    /// ends no pass. Before the first mark, growth must also have moved
    /// units (a loop that allocates and frees one buffer does not, and
    /// keeps its hot path as it was). If so, the next step starts (Note
    /// [Steps at emptying]). A synchronous allocation (`freed`: 0)
    /// marks where the program's counted bytes are none.
    pub(super) fn take_emptied_mark(&mut self, freed: u64, marks: StepMarks) -> bool {
        if !self.marks_at_emptying(marks) || self.step_high < self.usage.used_high.div_ceil(2) {
            return false;
        }
        let emptied = freed >= self.held_bytes();
        if emptied {
            self.step_high = 0;
            self.remaps_at_mark = self.growth.remaps;
        }
        emptied
    }

    /// What the allocating stream freed since the pool last settled the
    /// streams' credit (0 for a synchronous call, which leaves nothing
    /// pending): read once a locked allocation, for both
    /// [`Inner::take_emptied_mark`] and [`Inner::allocate`].
    pub(super) fn freed_by(&self, stream: Option<&Arc<StreamShared<B>>>) -> u64 {
        stream.map_or(0, |s| self.streams.credit_high(s))
    }

    /// Whether an emptying would mark a step: the program has held bytes
    /// and, before the first mark, growth has moved units.
    pub(super) fn marks_at_emptying(&self, marks: StepMarks) -> bool {
        self.usage.used_high > 0
            && (marks == StepMarks::Some || self.growth.remaps != self.remaps_at_mark)
    }

    /// The program's bytes, less what the streams freed since the pool
    /// last settled their credit: exact right after a count.
    pub(super) fn held_bytes(&self) -> u64 {
        let planned = self.usage.planned_frees.load(Ordering::Acquire);
        (self.usage.used - self.usage.idle).saturating_sub(planned)
    }

    /// Frees `allocation` in stream order on `stream`, as
    /// [`super::Pool::free_async`] does, its bytes counted out of the used
    /// ones here: no credit that the stream's hot path could spend as the
    /// program's freed bytes, raising what it holds past the high-water
    /// mark unseen.
    pub(super) fn free_in_order(&mut self, allocation: &Allocation, stream: &Arc<StreamShared<B>>) {
        let pending = super::pending_free(allocation);
        while !stream.push_free(self.pool, pending, Counted::Already) {
            self.streams.register(stream);
        }
        self.usage.used -= allocation.block_size;
    }

    pub(super) fn free(&mut self, arena: ArenaId, block: BlockId, size: u64) {
        self.arenas[arena].heap.free(block);
        self.calls.frees += 1;
        self.usage.used -= size;
    }

    /// The slow path of an allocation: the heap, then (stream-ordered) other
    /// pending frees as the reuse rules allow, then growth.
    pub(super) fn allocate(
        &mut self,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        freed: u64,
    ) -> Result<Pending> {
        if self.emptied(freed) {
            self.start_afresh(stream)?;
        }
        let found = self.with_request(size, stream, |inner, request| {
            match inner.serve_from_free(request)? {
                Some(found) => Ok(found),
                None => inner.grow_for(request),
            }
        });
        self.calls.allocations += u64::from(found.is_ok());
        found
    }

    /// Whether the program held no byte of the pool at some moment since
    /// the pool last counted, by what the allocating stream freed alone,
    /// with growth having moved units since the pool last started afresh
    /// (Note [Starting afresh]).
    fn emptied(&self, freed: u64) -> bool {
        if !self.may_start_afresh() {
            return false;
        }
        let held = self.usage.used - self.usage.idle;
        freed >= held
    }

    /// Whether the program holds no byte of the pool now, with growth
    /// having moved units since the pool last started afresh: read
    /// exactly, every stream's credit and the planned frees taken in (the
    /// look [`Inner::allocate`] makes reads the allocating stream's alone).
    pub(super) fn empty_now(&self) -> bool {
        self.may_start_afresh() && self.used_bytes() == 0
    }

    /// Whether an emptied pool would start afresh: the setting allows it,
    /// and growth has moved units since the pool last did.
    fn may_start_afresh(&self) -> bool {
        self.fresh_start == FreshStart::WhenEmptied && self.growth.remaps != self.remaps_at_fresh
    }

    /// Unmaps every unit with no live byte, keeping its chunk spare, so
    /// that growth lays the pool out again as it did from empty (Note
    /// [Starting afresh]). The frees still pending go back first, waited
    /// for; during a graph capture, where nothing can be waited for, and
    /// while the pool sleeps, it stays as it is.
    pub(super) fn start_afresh(&mut self, stream: Option<&Arc<StreamShared<B>>>) -> Result<()> {
        if self.slumber.is_some() {
            return Ok(());
        }
        if let Some(s) = stream {
            self.merge_own_frees(s, 0)?;
        }
        if !self.wait_for_pending_frees() {
            return Ok(());
        }
        self.remaps_at_fresh = self.growth.remaps;
        self.growth().park_free_units();
        Ok(())
    }

    /// [`Inner::allocate`] from the memory the pool holds free, without
    /// growth: `None` where it would grow.
    pub(super) fn allocate_without_growth(
        &mut self,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Option<Pending>> {
        let found = self.with_request(size, stream, Self::serve_from_free);
        self.calls.allocations += u64::from(matches!(found, Ok(Some(_))));
        found
    }

    /// Runs `serve` on a request for `size` bytes on `stream`, then gives
    /// the heap back the blocks it held.
    fn with_request<T>(
        &mut self,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        serve: impl FnOnce(&mut Self, &mut Request<'_, B>) -> Result<T>,
    ) -> Result<T> {
        if self.slumber.is_some() {
            return Err(Error::Asleep);
        }
        // Opportunistic reuse: frees whose events have completed go back to
        // the heap. One stream-ordered miss in a few looks, which keeps
        // guards and aliases from piling up; before it grows, the pool
        // always looks.
        if stream.is_some() && self.streams.due_for_collect() {
            self.collect_completed()?;
        }
        let mut request = Request {
            size,
            stream,
            held: Vec::new(),
        };
        let found = serve(self, &mut request);
        for held in request.held {
            self.arenas[held.arena].heap.free(held.block);
        }
        found
    }

    /// [`Inner::allocate`] without growth (`None`: nothing free fits),
    /// leaving in `request.held` the blocks it took from the heap but may
    /// not use.
    fn serve_from_free(&mut self, request: &mut Request<'_, B>) -> Result<Option<Pending>> {
        let (size, stream) = (request.size, request.stream);
        let arena = ArenaId::for_size(size);
        // The stream's own frees, at any size: in its order they are free,
        // and back in the heap they join their free neighbours, so the
        // heap's choice is as good as without stream order. The latest
        // small ones stay for the same-size fast path, unless the heap
        // cannot serve without them.
        let mut kept = false;
        if let Some(s) = stream {
            kept = self.merge_own_frees(s, KEEP_SMALL)?;
        }
        if let Some(found) = self.take_from_heap(arena, request)? {
            return Ok(Some(found.pending(arena, size)));
        }
        if let Some(s) = stream.filter(|_| kept) {
            self.merge_own_frees(s, 0)?;
            if let Some(found) = self.take_from_heap(arena, request)? {
                return Ok(Some(found.pending(arena, size)));
            }
        }
        if let Some(s) = stream {
            if let Some(p) = self.streams.reuse_pending(size, s)? {
                return Ok(Some(p));
            }
            if self.streams.rules.allow_opportunistic {
                // Events just recorded on idle streams complete at once:
                // better their frees than new memory.
                self.streams.record_pending(s.id)?;
                self.collect_completed()?;
                if let Some(found) = self.take_from_heap(arena, request)? {
                    return Ok(Some(found.pending(arena, size)));
                }
            }
        }
        if arena == ArenaId::Small && self.small_overflow == SmallOverflow::LargeFirst {
            if let Some(found) = self.take_from_heap(ArenaId::Large, request)? {
                return Ok(Some(found.pending(ArenaId::Large, size)));
            }
        }
        Ok(None)
    }

    /// Grows the pool for `request`, which nothing free serves. Moved
    /// units' old places that a stream may still use are waited for
    /// first (their streams only), and the request tried again on what
    /// that frees: growth then plans on the same pool however far behind
    /// the streams are (Note [Guards and aliases], "Growth waits for
    /// aliases"). Not while a graph capture is under way, when nothing can
    /// be waited for.
    fn grow_for(&mut self, request: &mut Request<'_, B>) -> Result<Pending> {
        let aliased: Vec<u64> = self.space.alias_streams().collect();
        if !aliased.is_empty() && self.wait_for_streams(|s| aliased.contains(&s)) {
            tracing::debug!(
                pool = self.pool,
                "growth waited for the streams of moved units' old places"
            );
            // Blocks held aside for other streams' guards may be free now.
            for held in request.held.drain(..) {
                self.arenas[held.arena].heap.free(held.block);
            }
            if let Some(found) = self.serve_from_free(request)? {
                return Ok(found);
            }
        }
        let (size, stream) = (request.size, request.stream);
        let arena = ArenaId::for_size(size);
        loop {
            let started = std::time::Instant::now();
            let grown = self.growth().grow(arena, size, stream.map(|s| s.id));
            self.calls.grow_nanos += started.elapsed().as_nanos() as u64;
            let (arena, found) = match grown {
                Ok(free) => {
                    let (addr, block) = self.arenas[arena].heap.alloc_from(free, size);
                    (arena, Found { addr, block })
                }
                // The device is full, or this arena's address space, but
                // the other arena may have room: better there than failing.
                Err(e)
                    if matches!(&e, Error::Driver(d) if d.kind() == ErrorKind::OutOfMemory)
                        || matches!(e, Error::OutOfAddressSpace { .. }) =>
                {
                    let other = arena.other();
                    match self.take_from_heap(other, request)? {
                        Some(found) => (other, found),
                        None => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            };
            // Growth may extend a guarded free range.
            let cleared = self.clear_guards(found.addr, size, stream);
            if let Ok(true) = cleared {
                return Ok(found.pending(arena, size));
            }
            request.held.push(Held {
                arena,
                block: found.block,
            });
            cleared?;
        }
    }

    /// A heap block for `request` in `arena` that its stream may take (see
    /// [`Guard`]); the blocks it may not take go to `request.held`.
    fn take_from_heap(
        &mut self,
        arena: ArenaId,
        request: &mut Request<'_, B>,
    ) -> Result<Option<Found>> {
        while let Some((addr, block)) = self.arenas[arena].heap.alloc(request.size) {
            // Given back to the heap by the caller, unless taken.
            let cleared = self.clear_guards(addr, request.size, request.stream);
            if let Ok(true) = cleared {
                return Ok(Some(Found { addr, block }));
            }
            request.held.push(Held { arena, block });
            cleared?;
        }
        Ok(None)
    }

    /// Whether `stream` (`None`: a synchronous allocation) may take
    /// `[addr, addr + size)`, as far as guards go (see
    /// [`Streams::may_take`]). If so, the guards of the range go (the
    /// allocation's own later free will guard it again).
    fn clear_guards(
        &mut self,
        addr: u64,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<bool> {
        let end = addr + size;
        let mut found = std::mem::take(&mut self.found_guards);
        found.extend(self.guards.in_range(addr, end));
        let cleared = if found.is_empty() {
            Ok(true)
        } else {
            let may = self.streams.may_take(&found, stream);
            if let Ok(true) = may {
                self.guards.remove_found(addr, end, &found);
            }
            may
        };
        found.clear();
        self.found_guards = found;
        cleared
    }
}
