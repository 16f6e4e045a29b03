//! The layout in use (Note [Step layouts] in docs/DESIGN.md): the events
//! it was made from, a slot per ordinal, and the region the slots lie in
//! with the planned allocations live there.

use std::collections::BTreeMap;

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
/// by [`super::Steps`] as `R` (the pool's allocation type), and the planned
/// allocations live in it.
#[derive(Debug)]
pub(super) struct Region<R> {
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) live: BTreeMap<u64, Live>,
    pub(super) memory: R,
}

impl<R> Region<R> {
    pub(super) fn contains(&self, ptr: u64) -> bool {
        (self.base..self.base + self.len).contains(&ptr)
    }

    /// Whether `[at, at + size)` is clear of live planned allocations.
    /// They never overlap one another, so the last that starts before the
    /// range ends is the one that ends last: if it ends by `at`, all do.
    pub(super) fn is_clear(&self, at: u64, size: u64) -> bool {
        let last = self.live.range(..at + size).next_back();
        last.is_none_or(|(_, l)| l.end <= at)
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
        events > self.events.len() && self.region.live.is_empty()
    }
}
