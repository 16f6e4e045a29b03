//! Step layouts: what a pool learns from a step that repeats (Note [Step
//! layouts] in docs/DESIGN.md). Pure bookkeeping, no driver and no heap:
//! the pool asks it where an allocation goes and tells it what happened.
//!
//! ```text
//!   mark   step 1 (recorded)   mark   step 2 (recorded)   mark   step 3 ...
//!          every allocation           same events as 1?          planned
//!          from the heap              yes: lay them out  ──►     allocations
//!                                     in one region              at offsets
//! ```
//!
//! A step is what lies between two [`Steps::mark`]s. Each step's
//! allocations on the layout's stream are numbered in order (their
//! ordinal) and recorded with the frees that end them. When a step has the
//! same events as the one before (sizes may differ), its allocations that
//! were freed within it are laid out in one region ([`crate::layout`]),
//! each slot as large as the largest that ordinal has asked for. From then
//! on, while a step's events are the layout's, the allocation of each
//! ordinal takes its slot if it fits and no live allocation lies there;
//! anything else goes to the heap as before. A step that goes another way
//! ends the layout, and its region goes back to the pool at once, split
//! around the planned allocations still live in it.

use rustc_hash::FxHashMap;

use crate::layout::{peak, Orders};

mod deferral;
mod planning;
mod region;

use deferral::Deferral;
use planning::{lifetimes, plan, Plan, Planning, PLANNED_APART};
use region::{Active, Event, Live, Region, Slot};

/// A step as it happens: its events, and each ordinal's size.
#[derive(Debug, Default)]
struct Recording {
    events: Vec<Event>,
    sizes: Vec<u64>,
    /// Allocations that wanted their slot and did not get it.
    missed: u64,
    /// Its events went another way than the layout's, which then went:
    /// its allocations may live otherwise than their slots assume.
    diverged: bool,
    /// The step made more than [`MAX_ALLOCATIONS`]: the rest went
    /// unrecorded, and it is laid out never.
    overflowed: bool,
    /// The step freed an allocation the step before it made, carried
    /// across their mark: it may carry allocations of its own into the
    /// next ([`Steps::defer_mark`]). (Frees of older ones, a model's
    /// weights torn down, say, are not carried.)
    freed_carried: bool,
    /// The most bytes live at once at `sizes`, kept once the step is
    /// finished, so that a step that repeats it at the same sizes need not
    /// work it out again (0 while recording, and for a step not whole).
    peak: u64,
}

/// A layout more than this many tenths of the peak its steps need is made
/// again: it was made from a larger, odd step (an evaluation, the first
/// step of a replayed pass). Greedy layouts come within a few hundredths of
/// the peak (docs/RESULTS.md, "Step layouts").
const OVERSIZED_TENTHS: u64 = 11;

/// A layout is made only if its region is at most this many hundredths of
/// the largest peak any one step has needed. Each slot is as large as the
/// largest size its ordinal has asked for, and when shapes vary apart (a
/// sequence length in one step, a batch in another) those sizes never
/// meet in one step: their layout holds more than the program ever needs
/// at once, and the heap serves such steps better. Greedy layouts of the
/// recorded steps come within 1.007 of their peak (ViT's 1.0066, the
/// UNet's 1.0000; docs/RESULTS.md, "Step layouts").
const SLACK_HUNDREDTHS: u64 = 102;

/// After layouts that did not last their first step, each in a row, a
/// layout waits for one more step alike, up to this many: steps whose
/// shapes are drawn at random (ResNet-50 here) repeat the one before now
/// and then and go another way at the next, and each layout made of them
/// costs its placement and a region for nothing.
const MOST_REPEATS_AWAITED: u32 = 8;

/// A step that goes on past its layout's last event keeps the layout
/// while the heap grows beside the idle region by at most this many
/// hundredths of it, in all: more, and the region's memory serves the heap
/// instead (docs/RESULTS.md, "Steps that go on past their layout").
const GROWTH_PAST_HUNDREDTHS: u64 = 1;

/// The most allocations a step records: a program that marks one step and
/// never another must not record forever. Some 40 MB of recording at most.
const MAX_ALLOCATIONS: usize = 1 << 21;

/// What a heap allocation of a recorded step carries, so that its free
/// is recorded in the step it was made in: the step and its ordinal there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepTag {
    step: u64,
    ordinal: u32,
}

/// A region to split around its live planned allocations.
#[derive(Debug)]
pub(crate) struct Split<R> {
    pub(crate) memory: R,
    /// Address, bytes and what the steps know of each.
    pub(crate) live: Vec<(u64, u64, Live)>,
}

/// A planned allocation whose region was split: the part that holds it.
#[derive(Debug)]
struct Converted<R> {
    memory: R,
    live: Live,
}

/// What the pool does with a free.
#[derive(Debug)]
pub(crate) enum Freed<R> {
    /// Not planned: the heap's, as any allocation.
    Heap,
    /// A planned allocation, free now: its slot is idle again.
    Planned,
    /// A planned allocation whose slot stays taken: the pool could not
    /// order the slot's reuse after the free (its stream could not be
    /// waited for).
    Kept,
    /// A planned allocation whose region was split: free this part of it.
    Split(R),
}

/// Where an allocation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// At this address, in the layout's region.
    Planned(u64),
    /// To the heap; an allocation of the step recorded carries its tag,
    /// and gives it back to [`Steps::free`].
    Heap(Option<StepTag>),
}

/// A layout made at a mark, waiting for its region.
#[derive(Debug)]
struct PendingLayout {
    slots: Vec<Option<Slot>>,
    events: Vec<Event>,
    len: u64,
}

/// Counts for the statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCounters {
    /// Marks so far.
    pub steps: u64,
    /// Layouts made: when steps first repeat, and again when they repeat
    /// after outgrowing the last layout or leaving it.
    pub layouts: u64,
    /// Allocations served from a layout's slot.
    pub planned: u64,
    /// Allocations whose slot was too small or taken.
    pub missed: u64,
    /// Bytes of the layout's region.
    pub region_bytes: u64,
    /// Layouts given up because the pool could not allocate their region
    /// (out of memory, over its limit, or no room in its address space):
    /// their steps went on from the heap.
    pub refused: u64,
}

/// A pool's step layouts; `R` is the pool's allocation type (a region's
/// memory).
#[derive(Debug)]
pub(crate) struct Steps<R> {
    /// The stream the layout serves (`None`: synchronous calls), fixed by
    /// the first allocation after the first mark, and again after a step in
    /// which it allocated nothing (the program moved to another stream, or
    /// the C library forgot its streams and adopted them anew).
    stream: Option<Option<u64>>,
    current: Recording,
    /// The step before: its events and sizes.
    previous: Option<Recording>,
    active: Option<Active<R>>,
    /// Regions given up with planned allocations still live in them, for
    /// the pool to split ([`Steps::take_splits`]).
    splitting: Vec<Region<R>>,
    /// Planned allocations whose region was given up: now the part of it
    /// the pool split off for each, freed as heap allocations.
    converted: FxHashMap<u64, Converted<R>>,
    /// Regions nothing lives in any more, for the pool to free
    /// ([`Steps::take_retired`]).
    retired: Vec<R>,
    /// A layout waiting for its region.
    pending: Option<PendingLayout>,
    /// A large step's layout being planned apart.
    planning: Option<Planning>,
    counters: StepCounters,
    /// The largest peak any whole step has needed, at its own sizes.
    largest_peak: u64,
    /// Steps in a row, up to the last marked, that repeated the one before.
    repeated: u32,
    /// Layouts in a row that ended in their first step, or never began
    /// (their region refused).
    short_lived: u32,
    /// Whether the last layout to end did so in its first step, and none
    /// has served a whole step since.
    ended_early: bool,
    /// Whether the program's marks wait for the frees their steps carry.
    deferral: Deferral,
    /// A layout ended as its step went another way, and no allocation has
    /// looked since whether the program emptied the pool
    /// ([`Steps::take_divergence`]).
    unchecked_divergence: bool,
    align: u64,
}

impl<R> Steps<R> {
    pub(crate) fn new(align: u64) -> Self {
        Self {
            stream: None,
            current: Recording::default(),
            previous: None,
            active: None,
            splitting: Vec::new(),
            converted: FxHashMap::default(),
            retired: Vec::new(),
            pending: None,
            planning: None,
            counters: StepCounters::default(),
            largest_peak: 0,
            repeated: 0,
            short_lived: 0,
            ended_early: false,
            deferral: Deferral::default(),
            unchecked_divergence: false,
            align,
        }
    }

    pub(crate) fn counters(&self) -> StepCounters {
        StepCounters {
            region_bytes: self.active.as_ref().map_or(0, |a| a.region.len),
            ..self.counters
        }
    }

    /// Where an allocation of `size` bytes (a multiple of the alignment)
    /// on `stream` goes. `capturing`: a graph capture is under way, and
    /// nothing is planned (the graph would keep using the slot).
    pub(crate) fn place(&mut self, stream: Option<u64>, size: u64, capturing: bool) -> Placement {
        if self.counters.steps == 0 || *self.stream.get_or_insert(stream) != stream {
            return Placement::Heap(None);
        }
        if self.current.sizes.len() == MAX_ALLOCATIONS {
            self.current.overflowed = true;
            return Placement::Heap(None);
        }
        let ordinal = self.current.sizes.len() as u32;
        self.current.sizes.push(size);
        self.record(Event::Alloc(ordinal));
        let tag = Some(StepTag {
            step: self.counters.steps,
            ordinal,
        });
        let Some(active) = &mut self.active else {
            return Placement::Heap(tag);
        };
        let slot = active.slots.get(ordinal as usize).copied().flatten();
        match slot {
            Some(slot) if size > slot.size => {
                // Larger than this ordinal has been: the steps outgrew the
                // layout. Held beside the heap's growth for this and the
                // other allocations that outgrow it, the region would cost
                // its whole size on top of the step's peak; it goes back
                // to the heap at once, and a repeat lays out again.
                self.missed();
                if let Some(active) = self.active.take() {
                    self.end(active);
                }
            }
            Some(slot) if !capturing => {
                let at = active.region.base + slot.offset;
                if active.region.is_clear(at, size) {
                    let live = Live {
                        end: at + size,
                        ordinal,
                        step: self.counters.steps,
                    };
                    active.region.insert(at, live);
                    self.counters.planned += 1;
                    return Placement::Planned(at);
                }
                self.missed();
            }
            Some(_) => self.missed(),
            None => {}
        }
        Placement::Heap(tag)
    }

    fn missed(&mut self) {
        self.current.missed += 1;
        self.counters.missed += 1;
    }

    /// Adds an event to the current step, noting where it leaves the
    /// layout's. Events past the layout's last are not leaving it: by then
    /// every planned allocation has been freed where the layout expects.
    fn record(&mut self, event: Event) {
        let at = self.current.events.len();
        self.current.events.push(event);
        if let Event::Free(o) = event {
            self.deferral.freed(o);
        }
        let leaves = |a: &mut Active<R>| a.events.get(at).is_some_and(|e| *e != event);
        if let Some(active) = self.active.take_if(leaves) {
            // The program went another way: its memory is the heap's now,
            // as soon as nothing planned lives in it.
            self.current.diverged = true;
            self.end(active);
            self.unchecked_divergence = true;
            self.deferral.diverged();
        }
    }

    /// Ends a layout the steps left or outgrew, noting one that did not
    /// last its first step.
    fn end(&mut self, active: Active<R>) {
        if active.since == self.counters.steps {
            self.short_lived += 1;
            self.ended_early = true;
        }
        self.retire(active.region);
    }

    /// Gives a region up to the pool: whole if nothing lives in it, else
    /// split around its live planned allocations, which become heap
    /// allocations, so that the rest goes back to the heap at once.
    fn retire(&mut self, region: Region<R>) {
        if region.is_idle() {
            self.retired.push(region.memory);
        } else {
            self.splitting.push(region);
        }
    }

    /// The regions to split, each with its live planned allocations
    /// (address and bytes, in address order): the pool splits each at
    /// their edges, frees the rest and hands each one's part to
    /// [`Steps::adopt`].
    pub(crate) fn take_splits(&mut self) -> Vec<Split<R>> {
        if self.splitting.is_empty() {
            // Every call asks: the common answer costs nothing.
            return Vec::new();
        }
        self.splitting
            .drain(..)
            .map(|r| {
                let (memory, live) = r.into_parts();
                Split { memory, live }
            })
            .collect()
    }

    /// The part of a split region that holds the planned allocation at
    /// `at`, now a heap allocation of the pool's.
    pub(crate) fn adopt(&mut self, at: u64, memory: R, live: Live) {
        self.converted.insert(at, Converted { memory, live });
    }

    /// Whether no layout is under way: none serves, waits for its region
    /// or is being planned, and nothing of one is left to free.
    pub(crate) fn lays_out_nothing(&self) -> bool {
        self.active.is_none()
            && self.pending.is_none()
            && self.planning.is_none()
            && self.splitting.is_empty()
            && self.converted.is_empty()
            && self.retired.is_empty()
    }

    /// Waits for a layout being planned apart, if any, to be ready.
    pub(crate) fn await_plan(&mut self) {
        if let Some(planning) = &mut self.planning {
            planning.wait();
        }
    }

    /// Forgets the steps recorded, as the pool stops marking them: steps
    /// marked later start a new run.
    pub(crate) fn forget_steps(&mut self) {
        debug_assert!(self.lays_out_nothing());
        self.stream = None;
        self.current = Recording::default();
        self.previous = None;
        self.repeated = 0;
    }

    /// Whether a stream is the layout's (none since a quiet step).
    pub(crate) fn has_stream(&self) -> bool {
        self.stream.is_some()
    }

    /// Gives the layout up if nothing planned lives in it now (the pool is
    /// asked for its unused memory): its region is retired.
    pub(crate) fn give_up_if_idle(&mut self) {
        if let Some(active) = self.active.take_if(|a| a.region.is_idle()) {
            self.retire(active.region);
        }
    }

    /// Whether the step has gone on past its layout's last event with
    /// nothing planned live: the layout has served the step, and the
    /// region is idle while what follows comes from the heap.
    pub(crate) fn overran(&self) -> bool {
        let events = self.current.events.len();
        self.active.as_ref().is_some_and(|a| a.overran_by(events))
    }

    /// An allocation of `size` bytes past the layout's last event
    /// ([`Steps::overran`]) that the heap serves only by growing. Past
    /// [`GROWTH_PAST_HUNDREDTHS`] of the region grown beside it in all,
    /// the layout is given up, and the region's memory serves what follows
    /// (a new model built and trained after the last mark) instead of a
    /// heap grown beside it; below, it stays (a log, a small checkpoint).
    /// Steps that repeat lay out again.
    pub(crate) fn grow_past(&mut self, size: u64) {
        let events = self.current.events.len();
        let Some(active) = self.active.as_mut().filter(|a| a.overran_by(events)) else {
            return;
        };
        active.grown_past += size;
        if active.grown_past * 100 > active.region.len * GROWTH_PAST_HUNDREDTHS {
            self.give_up_if_idle();
        }
    }

    /// The regions given up since the last call: the pool frees them.
    pub(crate) fn take_retired(&mut self) -> Vec<R> {
        std::mem::take(&mut self.retired)
    }

    /// Whether `ptr` is a live planned allocation.
    pub(crate) fn is_planned(&self, ptr: u64) -> bool {
        self.active.as_ref().is_some_and(|a| a.region.holds(ptr))
    }

    /// An allocation at `ptr` is freed, with the tag it was given if it
    /// went to the heap in a recorded step: what the pool does with it.
    pub(crate) fn free(&mut self, ptr: u64, tag: Option<StepTag>) -> Freed<R> {
        if let Some(tag) = tag {
            self.record_free(tag.step, tag.ordinal);
            return Freed::Heap;
        }
        // The map, mostly empty, is looked in only when it holds something.
        let converted = (!self.converted.is_empty())
            .then(|| self.converted.remove(&ptr))
            .flatten();
        if let Some(c) = converted {
            self.record_free(c.live.step, c.live.ordinal);
            return Freed::Split(c.memory);
        }
        let Some(region) = self
            .active
            .as_mut()
            .map(|a| &mut a.region)
            .filter(|r| r.contains(ptr))
        else {
            return Freed::Heap;
        };
        let Some(live) = region.remove(ptr) else {
            return Freed::Heap;
        };
        self.record_free(live.step, live.ordinal);
        Freed::Planned
    }

    /// Records the free of the allocation of `ordinal` made in `step`, if
    /// it is this step's; one the step before made was carried across
    /// their mark.
    fn record_free(&mut self, step: u64, ordinal: u32) {
        if step == self.counters.steps {
            self.record(Event::Free(ordinal));
        } else if step + 1 == self.counters.steps {
            self.current.freed_carried = true;
        }
    }

    /// Whether the program's mark waits for the allocations its step
    /// carries into the next (`Deferral::defer`), so that a layout's
    /// region is not placed beside them; once they are freed, the mark is
    /// due at the next allocation ([`Steps::take_deferred_mark`]).
    pub(crate) fn defer_mark(&mut self) -> bool {
        self.deferral
            .defer(&self.current.events, self.current.freed_carried)
    }

    /// Whether a layout ended by a step that went another way since the
    /// last allocation that asked, once: the next looks whether the
    /// program emptied the pool, as one past a layout's last event does
    /// (a model torn down in the middle of a step, where a deferred mark
    /// put the step's end).
    pub(crate) fn take_divergence(&mut self) -> bool {
        std::mem::take(&mut self.unchecked_divergence)
    }

    /// Whether a deferred mark is due, once: the pool marks at its next
    /// allocation.
    pub(crate) fn take_deferred_mark(&mut self) -> bool {
        self.deferral.take_due()
    }

    /// Ends a step. A step gets a new layout when it had the events of the
    /// step before, and the layout in use did not fit it or is far larger
    /// than it needs (made from an odd step). Never from one step alone:
    /// a layout made from an odd step would hold its region while the heap
    /// grows for the steps that miss it. After layouts that did not last
    /// their first step, it waits for longer runs of steps alike
    /// ([`MOST_REPEATS_AWAITED`]); and it is refused if it would hold more
    /// than [`SLACK_HUNDREDTHS`] of what one step has needed. (A step
    /// whose events leave the layout's, or that outgrows it, gives it up
    /// there and then: see [`Steps::record`] and [`Steps::place`].) The
    /// pool is asked for a new layout's region.
    pub(crate) fn mark(&mut self) -> Option<u64> {
        if self
            .active
            .as_ref()
            .is_some_and(|a| a.since == self.counters.steps)
        {
            // It served the whole step.
            self.short_lived = 0;
            self.ended_early = false;
        }
        self.counters.steps += 1;
        self.deferral.marked();
        if let Some(active) = &mut self.active {
            active.region.step_ended();
        }
        let finished = std::mem::take(&mut self.current);
        if finished.sizes.is_empty() {
            // The stream went quiet: the next step's first allocation
            // picks the stream, and what was learnt of this one goes.
            self.stream = None;
            self.previous = None;
            if let Some(active) = self.active.take() {
                self.retire(active.region);
            }
            return None;
        }
        let whole = !finished.overflowed && !finished.events.is_empty();
        let repeats = whole
            && self
                .previous
                .as_ref()
                .is_some_and(|p| !p.overflowed && p.events == finished.events);
        self.repeated = if repeats { self.repeated + 1 } else { 0 };
        // A step that repeats the one before at its sizes has its peak:
        // the steady state of a layout, where working it out again (some
        // 1.5 ms for 35,000 allocations) would cost every step.
        let unchanged = repeats
            && self
                .previous
                .as_ref()
                .is_some_and(|p| p.sizes == finished.sizes);
        let step_peak = |sizes: &[u64]| peak(&lifetimes(&finished.events, sizes, self.align).0);
        let own_peak = match &self.previous {
            Some(previous) if unchanged => previous.peak,
            _ if whole => step_peak(&finished.sizes),
            _ => 0,
        };
        self.largest_peak = self.largest_peak.max(own_peak);
        // Over a run of repeating steps, each ordinal's largest size, and
        // the peak at those sizes.
        let (sizes, merged_peak) = match &self.previous {
            Some(previous) if repeats && !unchanged => {
                let sizes: Vec<u64> = finished
                    .sizes
                    .iter()
                    .zip(&previous.sizes)
                    .map(|(a, b)| *a.max(b))
                    .collect();
                let merged_peak = step_peak(&sizes);
                (sizes, merged_peak)
            }
            _ => (finished.sizes, own_peak),
        };
        let fitted = self.active.as_ref().is_some_and(|a| {
            finished.missed == 0 && a.region.len * 10 <= merged_peak * OVERSIZED_TENTHS
        });
        let mut wants = None;
        let awaited = 1 + self.short_lived.min(MOST_REPEATS_AWAITED);
        let laid_out = if repeats && !fitted && self.repeated >= awaited {
            self.plan_for(&finished.events, &sizes)
        } else {
            None
        };
        if let Some(Plan { slots, len }) = laid_out {
            wants = Some(len);
            self.pending = Some(PendingLayout {
                slots,
                events: finished.events.clone(),
                len,
            });
            if let Some(old) = self.active.take() {
                self.retire(old.region);
            }
        }
        tracing::debug!(
            step = self.counters.steps,
            allocations = sizes.len(),
            missed = finished.missed,
            diverged = finished.diverged,
            repeats,
            fitted,
            short_lived = self.short_lived,
            largest_peak = self.largest_peak,
            lays_out = ?wants,
            "step marked"
        );
        self.previous = Some(Recording {
            events: finished.events,
            sizes,
            overflowed: finished.overflowed,
            peak: merged_peak,
            ..Recording::default()
        });
        wants
    }

    /// The layout for a step of `events` at `sizes` that repeats the one
    /// before: planned here for a small step; for a large one, planned on
    /// a thread of its own ([`Planning`]) and taken at a later mark whose
    /// step is the one planned, so that no allocation waits for it.
    fn plan_for(&mut self, events: &[Event], sizes: &[u64]) -> Option<Plan> {
        let (align, largest_peak) = (self.align, self.largest_peak);
        if sizes.len() <= PLANNED_APART {
            return plan(events, sizes, align, largest_peak, Orders::InTurn);
        }
        match self.planning.take_if(|p| p.is_ready()) {
            Some(ready) if ready.serves(events, sizes) => {
                let plan = ready.take();
                if plan.is_none() {
                    // Not to be laid out: wait for a longer run, as
                    // after a refused region, before planning again.
                    self.short_lived += 1;
                    self.repeated = 0;
                }
                plan
            }
            // Another step's, or still under way.
            Some(_) | None if self.planning.is_some() => None,
            _ => {
                self.planning =
                    Planning::start(events.to_vec(), sizes.to_vec(), align, largest_peak);
                None
            }
        }
    }

    /// Whether the last layout to end lasted its first step (or none has
    /// ended): while layouts do not, a region is taken from free memory
    /// alone (Note [Step layouts], "Regions from free memory"). A region
    /// refused is no layout ended: the next may grow.
    pub(crate) fn layouts_last(&self) -> bool {
        !self.ended_early
    }

    /// The region the last mark asked for, allocated at `base`.
    pub(crate) fn install(&mut self, base: u64, memory: R) {
        let PendingLayout { slots, events, len } =
            self.pending.take().expect("a layout waits for its region");
        let replaced = self.active.replace(Active {
            slots,
            events,
            region: Region::new(base, len, memory),
            since: self.counters.steps,
            grown_past: 0,
        });
        debug_assert!(replaced.is_none(), "a mark installs over a layout");
        if let Some(old) = replaced {
            self.retire(old.region);
        }
        self.counters.layouts += 1;
    }

    /// Gives up the layout that waits for its region (the pool could not
    /// allocate it): the next waits for a run of steps alike from here,
    /// longer after each refusal in a row, as after a layout that did not
    /// last its step, so that a pool that cannot afford one does not try
    /// at every mark.
    pub(crate) fn abandon(&mut self) {
        self.pending = None;
        self.counters.refused += 1;
        self.short_lived += 1;
        self.repeated = 0;
    }
}
