//! The layout in use (Note [Step layouts] in docs/DESIGN.md): the events
//! it was made from, a slot per ordinal, and the region the slots lie in
//! with the planned allocations live there.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

/// One event of a recorded step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    Alloc(u32),
    Free(u32),
}

/// Where a slot lies in its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) offset: u64,
    pub(super) size: u64,
}

/// A planned allocation that is live.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Live {
    pub(super) end: u64,
    pub(super) ordinal: u32,
    /// The mark it was made after: a free in a later step is not that
    /// step's event.
    pub(super) step: u64,
}

/// The memory a layout's slots lie in: one allocation of the pool's, held
/// by [`super::Steps`] as `R` (the pool's allocation type), and the
/// planned allocations live in it.
#[derive(Debug)]
pub(super) struct Region<R> {
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) memory: R,
    /// The planned allocations live in it, by address.
    live: FxHashMap<u64, Live>,
    /// Those of them made before the last mark, by address, with their
    /// ends: the only ones a slot can meet. While a step's events are the
    /// layout's, the allocations it has made and not freed are those the
    /// layout has live at that event, which it laid out apart; an
    /// allocation still live from an earlier step (a step that ended
    /// before its free, or a slot kept) is not one of them.
    earlier: BTreeMap<u64, u64>,
}

impl<R> Region<R> {
    pub(super) fn new(base: u64, len: u64, memory: R) -> Self {
        Self {
            base,
            len,
            memory,
            live: FxHashMap::default(),
            earlier: BTreeMap::new(),
        }
    }

    pub(super) fn contains(&self, ptr: u64) -> bool {
        (self.base..self.base + self.len).contains(&ptr)
    }

    /// Whether `[at, at + size)`, the slot of this step's next allocation,
    /// is clear of live planned allocations: of those from earlier steps,
    /// the only ones it can meet. They never overlap one another, so the
    /// last that starts before the range ends is the one that ends last:
    /// if it ends by `at`, all do.
    pub(super) fn is_clear(&self, at: u64, size: u64) -> bool {
        let last = self.earlier.range(..at + size).next_back();
        let clear = last.is_none_or(|(_, end)| *end <= at);
        debug_assert!(
            !clear
                || self
                    .live
                    .iter()
                    .all(|(&a, l)| l.end <= at || at + size <= a),
            "a slot meets a live planned allocation of this step"
        );
        clear
    }

    pub(super) fn insert(&mut self, at: u64, live: Live) {
        self.live.insert(at, live);
    }

    /// The live planned allocation at `ptr`, no longer live.
    pub(super) fn remove(&mut self, ptr: u64) -> Option<Live> {
        let live = self.live.remove(&ptr)?;
        if !self.earlier.is_empty() {
            self.earlier.remove(&ptr);
        }
        Some(live)
    }

    pub(super) fn holds(&self, ptr: u64) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Whether no planned allocation lives in it.
    pub(super) fn is_idle(&self) -> bool {
        self.live.is_empty()
    }

    /// A step ended: what is live now was made before the next one.
    pub(super) fn step_ended(&mut self) {
        self.earlier = self.live.iter().map(|(&at, l)| (at, l.end)).collect();
    }

    /// The live planned allocations in address order (address, bytes,
    /// and what the steps know of each), and the memory.
    pub(super) fn into_parts(self) -> (R, Vec<(u64, u64, Live)>) {
        let mut live: Vec<(u64, u64, Live)> = self
            .live
            .into_iter()
            .map(|(at, l)| (at, l.end - at, l))
            .collect();
        live.sort_unstable_by_key(|&(at, _, _)| at);
        (self.memory, live)
    }
}

/// The layout in use: a slot per ordinal (`None`: the ordinal lived past
/// its step, or was never seen), and the region they lie in.
#[derive(Debug)]
pub(super) struct Active<R> {
    pub(super) slots: Vec<Option<Slot>>,
    /// The events of the steps it was made from: a step is served from the
    /// layout only while its own events are these.
    pub(super) events: Vec<Event>,
    pub(super) region: Region<R>,
    /// The marks made when it was installed: the step it serves first is
    /// the one that ends at the next.
    pub(super) since: u64,
    /// Bytes the heap grew for, past the layout's last event
    /// ([`super::Steps::grow_past`]).
    pub(super) grown_past: u64,
}

impl<R> Active<R> {
    /// Whether a step of `events` events so far has gone past this
    /// layout's last with nothing planned live ([`super::Steps::overran`]).
    pub(super) fn overran_by(&self, events: usize) -> bool {
        events > self.events.len() && self.region.is_idle()
    }
}
