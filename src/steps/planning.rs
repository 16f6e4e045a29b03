//! Planning a step's layout: the slots of the allocations freed within
//! it, and the region's length. A large step is planned on a thread of its
//! own, so that the allocation that carries the mark does not wait for it
//! (Note [Steps at emptying] in docs/DESIGN.md).

use std::thread::JoinHandle;

use crate::layout::{lay_out, peak, Lifetime, Orders};

use super::region::{Event, Slot};
use super::SLACK_HUNDREDTHS;

/// Steps of more allocations than this are planned apart. Planning is
/// quadratic in the allocations that meet one another: a training step
/// of a few thousand plans in milliseconds, a whole trace replayed as one
/// step (28,000-69,000 allocations) in most of a second on the host, held
/// up in one allocation (docs/RESULTS.md, "Steps at emptying").
pub(super) const PLANNED_APART: usize = 4096;

/// A step's layout: each ordinal's slot (`None`: not freed within the
/// step), and the region's length.
pub(super) struct Plan {
    pub(super) slots: Vec<Option<Slot>>,
    pub(super) len: u64,
}

/// The layout for `events` at `sizes`; `None` if nothing is freed within
/// the step, or if the region would be more than [`SLACK_HUNDREDTHS`] of
/// `largest_peak`, the largest peak a step has needed (checked on the
/// sizes' own peak first, which no layout is below, so that steps of
/// shapes that vary apart cost no layout).
pub(super) fn plan(
    events: &[Event],
    sizes: &[u64],
    align: u64,
    largest_peak: u64,
    orders: Orders,
) -> Option<Plan> {
    let (lifetimes, ordinals) = lifetimes(events, sizes, align);
    if lifetimes.is_empty() {
        // Nothing freed within the step: no slot, and a region of no
        // bytes, which the heap cannot hold.
        return None;
    }
    let limit = largest_peak * SLACK_HUNDREDTHS / 100;
    if peak(&lifetimes) > limit {
        return None;
    }
    let layout = lay_out(&lifetimes, align, limit, orders)?;
    let mut slots = vec![None; sizes.len()];
    for ((o, offset), l) in ordinals.iter().zip(layout.offsets).zip(&lifetimes) {
        slots[*o as usize] = Some(Slot {
            offset,
            size: l.size,
        });
    }
    Some(Plan {
        slots,
        len: layout.len,
    })
}

/// A large step's layout, planned on a thread of its own.
pub(super) struct Planning {
    /// The step planned, and its sizes: the plan serves a later step only
    /// if that step makes the same events at sizes no larger.
    events: Vec<Event>,
    sizes: Vec<u64>,
    progress: Progress,
}

/// How far a [`Planning`] has come.
enum Progress {
    Running(JoinHandle<Option<Plan>>),
    /// Waited for ([`Planning::wait`]): the plan, if one was found.
    Done(Option<Plan>),
}

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planning")
            .field("allocations", &self.sizes.len())
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl Planning {
    /// Starts planning `events` at `sizes`; `None` if no thread could be
    /// started (the steps then go on unplanned, as unmarked ones do).
    pub(super) fn start(
        events: Vec<Event>,
        sizes: Vec<u64>,
        align: u64,
        largest_peak: u64,
    ) -> Option<Self> {
        let (planned_events, planned_sizes) = (events.clone(), sizes.clone());
        let thread = std::thread::Builder::new()
            .name("vmpool-plan".into())
            .spawn(move || {
                plan(
                    &planned_events,
                    &planned_sizes,
                    align,
                    largest_peak,
                    Orders::AtOnce,
                )
            });
        match thread {
            Ok(thread) => Some(Self {
                events,
                sizes,
                progress: Progress::Running(thread),
            }),
            Err(err) => {
                tracing::warn!(%err, "step layout not planned: no thread");
                None
            }
        }
    }

    pub(super) fn is_ready(&self) -> bool {
        match &self.progress {
            Progress::Running(thread) => thread.is_finished(),
            Progress::Done(_) => true,
        }
    }

    /// Waits until the plan is ready.
    pub(super) fn wait(&mut self) {
        if let Progress::Running(thread) =
            std::mem::replace(&mut self.progress, Progress::Done(None))
        {
            self.progress = Progress::Done(thread.join().ok().flatten());
        }
    }

    /// Whether the plan serves a step of `events` at `sizes`.
    pub(super) fn serves(&self, events: &[Event], sizes: &[u64]) -> bool {
        self.events == events
            && self.sizes.len() == sizes.len()
            && self
                .sizes
                .iter()
                .zip(sizes)
                .all(|(planned, s)| planned >= s)
    }

    /// The plan, once ready (see [`Planning::is_ready`]).
    pub(super) fn take(self) -> Option<Plan> {
        match self.progress {
            Progress::Running(thread) => thread.join().ok().flatten(),
            Progress::Done(plan) => plan,
        }
    }
}

/// The lifetimes of the allocations of `events` freed within the step,
/// sized `sizes` rounded up to `align`, with their ordinals.
pub(super) fn lifetimes(events: &[Event], sizes: &[u64], align: u64) -> (Vec<Lifetime>, Vec<u32>) {
    let mut starts: Vec<Option<u32>> = vec![None; sizes.len()];
    let mut lifetimes = Vec::new();
    let mut ordinals = Vec::new();
    for (i, event) in events.iter().enumerate() {
        match *event {
            Event::Alloc(o) => starts[o as usize] = Some(i as u32),
            Event::Free(o) => {
                if let Some(start) = starts[o as usize].take() {
                    lifetimes.push(Lifetime {
                        size: sizes[o as usize].next_multiple_of(align),
                        start,
                        end: i as u32 + 1,
                    });
                    ordinals.push(o);
                }
            }
        }
    }
    (lifetimes, ordinals)
}
