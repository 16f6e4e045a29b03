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
//! on, the allocation of each ordinal takes its slot if it fits and no live
//! allocation lies there; anything else goes to the heap as before.

use std::collections::{BTreeMap, HashMap};

use crate::layout::{lay_out, Lifetime};

/// One event of a recorded step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Alloc(u32),
    Free(u32),
}

/// A step as it happens: its events, and each ordinal's size.
#[derive(Debug, Default)]
struct Recording {
    events: Vec<Event>,
    sizes: Vec<u64>,
    /// Heap allocations of this step by address, to find their frees.
    from_heap: HashMap<u64, u32>,
    /// Allocations that wanted their slot and did not get it.
    missed: u64,
    /// The step made more than [`MAX_ALLOCATIONS`]: the rest went
    /// unrecorded, and it is laid out never.
    overflowed: bool,
}

/// The most allocations a step records: a program that marks one step and
/// never another must not record forever. Some 40 MB of recording at most.
const MAX_ALLOCATIONS: usize = 1 << 21;

/// Where a slot lies in its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    offset: u64,
    size: u64,
}

/// A planned allocation that is live.
#[derive(Debug, Clone, Copy)]
struct Live {
    end: u64,
    ordinal: u32,
    /// The mark it was made after: a free in a later step is not that
    /// step's event.
    step: u64,
}

/// The memory a layout's slots lie in: one allocation of the pool's, held
/// by [`Steps`] as `R` (the pool's allocation type), and the planned
/// allocations live in it.
#[derive(Debug)]
pub(crate) struct Region<R> {
    base: u64,
    len: u64,
    live: BTreeMap<u64, Live>,
    pub(crate) memory: R,
}

impl<R> Region<R> {
    fn contains(&self, ptr: u64) -> bool {
        (self.base..self.base + self.len).contains(&ptr)
    }

    /// Whether `[at, at + size)` is clear of live planned allocations.
    fn is_clear(&self, at: u64, size: u64) -> bool {
        let before = self.live.range(..=at).next_back();
        let after = self.live.range(at..at + size).next();
        before.is_none_or(|(_, l)| l.end <= at) && after.is_none()
    }
}

/// The layout in use: a slot per ordinal (`None`: the ordinal lived past
/// its step, or was never seen), and the region they lie in.
#[derive(Debug)]
struct Active<R> {
    slots: Vec<Option<Slot>>,
    region: Region<R>,
}

/// Where an allocation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// At this address, in the layout's region.
    Planned(u64),
    /// To the heap; if it has an ordinal, tell [`Steps::went_to_heap`] where
    /// it went.
    Heap(Option<u32>),
}

/// What a mark asks of the pool.
#[derive(Debug)]
pub(crate) struct Marked<R> {
    /// Regions no planned allocation lives in any more: the pool frees
    /// them.
    pub(crate) retired: Vec<R>,
    /// A new layout needs a region of this many bytes: the pool allocates
    /// it and hands it to [`Steps::install`].
    pub(crate) wants: Option<u64>,
}

/// Counts for the statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCounters {
    /// Marks so far.
    pub steps: u64,
    /// Layouts made (the first, and each one made again when a step
    /// outgrew the last).
    pub layouts: u64,
    /// Allocations served from a layout's slot.
    pub planned: u64,
    /// Allocations whose slot was too small or taken.
    pub missed: u64,
    /// Bytes of the regions held.
    pub region_bytes: u64,
}

/// A pool's step layouts; `R` is the pool's allocation type (a region's
/// memory).
#[derive(Debug)]
pub(crate) struct Steps<R> {
    /// The stream the layout serves (`None`: synchronous calls), fixed by
    /// the first allocation after the first mark.
    stream: Option<Option<u64>>,
    current: Recording,
    /// The step before: its events and sizes.
    previous: Option<Recording>,
    active: Option<Active<R>>,
    /// Earlier regions with planned allocations still live.
    draining: Vec<Region<R>>,
    /// A layout waiting for its region: slots and length.
    pending: Option<(Vec<Option<Slot>>, u64)>,
    counters: StepCounters,
    align: u64,
}

impl<R> Steps<R> {
    pub(crate) fn new(align: u64) -> Self {
        Self {
            stream: None,
            current: Recording::default(),
            previous: None,
            active: None,
            draining: Vec::new(),
            pending: None,
            counters: StepCounters::default(),
            align,
        }
    }

    pub(crate) fn counters(&self) -> StepCounters {
        StepCounters {
            region_bytes: self.regions().map(|r| r.len).sum(),
            ..self.counters
        }
    }

    fn regions(&self) -> impl Iterator<Item = &Region<R>> {
        self.active.iter().map(|a| &a.region).chain(&self.draining)
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
        self.current.events.push(Event::Alloc(ordinal));
        let Some(active) = &mut self.active else {
            return Placement::Heap(Some(ordinal));
        };
        let slot = active.slots.get(ordinal as usize).copied().flatten();
        match slot {
            Some(slot) if !capturing && size <= slot.size => {
                let at = active.region.base + slot.offset;
                if active.region.is_clear(at, size) {
                    let live = Live {
                        end: at + size,
                        ordinal,
                        step: self.counters.steps,
                    };
                    active.region.live.insert(at, live);
                    self.counters.planned += 1;
                    return Placement::Planned(at);
                }
                self.missed();
            }
            Some(_) => self.missed(),
            None => {}
        }
        Placement::Heap(Some(ordinal))
    }

    fn missed(&mut self) {
        self.current.missed += 1;
        self.counters.missed += 1;
    }

    /// An allocation of an ordinal went to the heap, at `ptr`.
    pub(crate) fn went_to_heap(&mut self, ordinal: u32, ptr: u64) {
        self.current.from_heap.insert(ptr, ordinal);
    }

    /// Whether `ptr` is a live planned allocation.
    pub(crate) fn is_planned(&self, ptr: u64) -> bool {
        self.regions().any(|r| r.live.contains_key(&ptr))
    }

    /// An allocation at `ptr` is freed. Returns whether it was planned, in
    /// which case the pool has nothing more to do.
    pub(crate) fn free(&mut self, ptr: u64) -> bool {
        if let Some(ordinal) = self.current.from_heap.remove(&ptr) {
            self.current.events.push(Event::Free(ordinal));
            return false;
        }
        let Some(region) = self
            .active
            .as_mut()
            .map(|a| &mut a.region)
            .filter(|r| r.contains(ptr))
            .or_else(|| self.draining.iter_mut().find(|r| r.contains(ptr)))
        else {
            return false;
        };
        let Some(live) = region.live.remove(&ptr) else {
            return false;
        };
        if live.step == self.counters.steps {
            self.current.events.push(Event::Free(live.ordinal));
        }
        true
    }

    /// Ends a step. A step that did not fit the layout in use gets a new
    /// one when it had the events of the step before, or when it is the
    /// first step recorded (a program's steps are mostly alike; if the
    /// next one is not, that layout goes). The pool is asked for the new
    /// layout's region, and the old region drains.
    pub(crate) fn mark(&mut self) -> Marked<R> {
        self.counters.steps += 1;
        let finished = std::mem::take(&mut self.current);
        let fitted = self.active.is_some() && finished.missed == 0;
        let whole = !finished.overflowed && !finished.events.is_empty();
        let repeats = whole
            && self
                .previous
                .as_ref()
                .is_some_and(|p| !p.overflowed && p.events == finished.events);
        // Over a run of repeating steps, each ordinal's largest size.
        let sizes: Vec<u64> = match &self.previous {
            Some(previous) if repeats => finished
                .sizes
                .iter()
                .zip(&previous.sizes)
                .map(|(a, b)| *a.max(b))
                .collect(),
            _ => finished.sizes,
        };
        let first = self.counters.layouts == 0 && whole;
        let mut wants = None;
        if (repeats || first) && !fitted {
            let (slots, len) = self.lay_out(&finished.events, &sizes);
            wants = Some(len);
            self.pending = Some((slots, len));
            if let Some(old) = self.active.take() {
                self.draining.push(old.region);
            }
        }
        // What did not repeat cannot be planned: the layout goes when its
        // step no longer comes.
        else if !repeats && self.active.as_ref().is_some_and(|_| finished.missed > 0) {
            let old = self.active.take().expect("checked");
            self.draining.push(old.region);
        }
        let (empty, live): (Vec<_>, Vec<_>) =
            self.draining.drain(..).partition(|r| r.live.is_empty());
        self.draining = live;
        let retired = empty.into_iter().map(|r| r.memory).collect();
        self.previous = Some(Recording {
            events: finished.events,
            sizes,
            overflowed: finished.overflowed,
            ..Recording::default()
        });
        Marked { retired, wants }
    }

    /// Slots for the allocations of `events` freed within the step, sized
    /// `sizes`, and the region's length.
    fn lay_out(&mut self, events: &[Event], sizes: &[u64]) -> (Vec<Option<Slot>>, u64) {
        let mut starts: Vec<Option<u32>> = vec![None; sizes.len()];
        let mut lifetimes = Vec::new();
        let mut ordinals = Vec::new();
        for (i, event) in events.iter().enumerate() {
            match *event {
                Event::Alloc(o) => starts[o as usize] = Some(i as u32),
                Event::Free(o) => {
                    if let Some(start) = starts[o as usize].take() {
                        let size = sizes[o as usize].next_multiple_of(self.align);
                        lifetimes.push(Lifetime {
                            size,
                            start,
                            end: i as u32 + 1,
                        });
                        ordinals.push(o);
                    }
                }
            }
        }
        let layout = lay_out(&lifetimes, self.align);
        let mut slots = vec![None; sizes.len()];
        for ((o, offset), l) in ordinals.iter().zip(layout.offsets).zip(&lifetimes) {
            slots[*o as usize] = Some(Slot {
                offset,
                size: l.size,
            });
        }
        self.counters.layouts += 1;
        (slots, layout.len)
    }

    /// The region the last mark asked for, allocated at `base`.
    pub(crate) fn install(&mut self, base: u64, memory: R) {
        let (slots, len) = self.pending.take().expect("a layout waits for its region");
        self.active = Some(Active {
            slots,
            region: Region {
                base,
                len,
                live: BTreeMap::new(),
                memory,
            },
        });
    }

    /// Gives up the layout that waits for its region (the pool could not
    /// allocate it).
    pub(crate) fn abandon(&mut self) {
        self.pending = None;
    }
}
