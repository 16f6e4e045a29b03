//! A step's end (Note [Step layouts], Note [Steps at emptying] in
//! docs/DESIGN.md): the marks the program or the pool makes, and the
//! region each new layout takes.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use vmm::Backend;

use crate::allocation::Allocation;
use crate::arena::{LayoutAtMark, StepEnd};
use crate::heap::{BlockId, QUANTUM};
use crate::ordering::StreamShared;
use crate::sync::lock;
use crate::{Error, Result};

use super::{Pool, Purpose};

/// Where a step layout's region may come from (Note [Step layouts],
/// "Regions from free memory").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegionFrom {
    /// The heap, growing as for any allocation.
    AnyMemory,
    /// A free block alone: no growth, no driver call.
    FreeMemory,
}

/// Who marked a step's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarkedBy {
    Program,
    /// The program's first, while the pool's own marks were on: it ends
    /// a step one of them began, whose first allocation's free is no
    /// event of the step, so it is never deferred (it would wait for
    /// that free).
    ProgramFirst,
    /// The pool, where the program emptied it (Note [Steps at emptying]).
    Emptying,
    /// The pool, for a program's mark that waited for the frees its step
    /// carried into the next (Note [Step layouts]).
    Deferred,
}

/// Which mark is due at the pool's next allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Due {
    None,
    /// The program's ([`Pool::mark_step_at_next_allocation`]).
    Program,
    /// A program's mark deferred past the frees its step carried.
    Deferred,
}

/// The [`Due`] mark, in one byte that the allocation's hot path loads
/// (`Shared::mark_due`).
pub(super) struct DueMark(AtomicU8);

impl DueMark {
    pub(super) fn new() -> Self {
        Self(AtomicU8::new(Due::None as u8))
    }

    /// Whether no mark is due: one load.
    #[inline]
    fn is_none(&self) -> bool {
        self.0.load(Ordering::Relaxed) == Due::None as u8
    }

    /// The program's mark is due, over any other.
    fn set_program(&self) {
        self.0.store(Due::Program as u8, Ordering::Release);
    }

    /// A deferred mark is due; not over a program's mark due there, which
    /// ends the wait itself.
    pub(super) fn set_deferred(&self) {
        let _ = self.0.compare_exchange(
            Due::None as u8,
            Due::Deferred as u8,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// The mark due, none left due.
    fn take(&self) -> Due {
        match self.0.swap(Due::None as u8, Ordering::AcqRel) {
            d if d == Due::Program as u8 => Due::Program,
            d if d == Due::Deferred as u8 => Due::Deferred,
            _ => Due::None,
        }
    }
}

/// The pool's own marks in a row that may lay nothing out before it marks
/// no more (Note [Steps at emptying]): more than a layout awaits when its
/// steps repeat ([`crate::steps`]'s longest wait is nine marks).
const EMPTYING_MARKS_UNLAID: u32 = 16;

impl<B: Backend> Pool<B> {
    /// Marks the end of a step of a program that repeats its work (a
    /// training step, a serving iteration). Once two steps in a row make
    /// the same allocations and frees in the same order on one stream
    /// (sizes may differ), the pool lays them out in one region, and from
    /// then on serves them there: no driver call and no heap search for
    /// them, however long the program runs. A step that goes another way
    /// or outgrows the layout ends it, and the heap serves it as before;
    /// when steps repeat, the layout is made again, each allocation's slot
    /// as large as the largest it has asked for, unless that holds more
    /// than 1.02 times what one step has needed (shapes that vary apart:
    /// such steps stay on the heap). Without marks, nothing changes. See
    /// Note [Step layouts] in docs/DESIGN.md.
    ///
    /// Fails if the pool sleeps, or if the driver fails. A layout whose
    /// region the pool cannot allocate (out of memory, over its limit, or
    /// no room in its address space) is given up, not failed: the steps go
    /// on from the heap, [`StepCounters::refused`] counts it, and the next
    /// layout waits for a longer run of steps alike. So is one that would
    /// map chunks after a layout that did not last its first step: while
    /// layouts do not last (shapes that vary), a region comes from free
    /// memory alone.
    ///
    /// A program that marks no step has one marked where it empties the
    /// pool (Note [Steps at emptying] in docs/DESIGN.md); its first mark
    /// ends that.
    pub fn mark_step(&self) -> Result<()> {
        self.awake()?;
        let by = if self.marks_at_emptying() {
            MarkedBy::ProgramFirst
        } else {
            MarkedBy::Program
        };
        self.stop_emptying_marks();
        if let Some(r) = &self.0.recorder {
            r.step();
        }
        self.mark(by)
    }

    /// Whether the pool marks a step where the program empties it: until
    /// the program marks one itself, or the pool's own marks lay nothing
    /// out (Note [Steps at emptying]).
    pub(super) fn marks_at_emptying(&self) -> bool {
        !self.0.emptying_marks_off.load(Ordering::Acquire)
    }

    /// The pool marks no more steps where the program empties it, and its
    /// hot path no longer declines for them.
    fn stop_emptying_marks(&self) {
        self.0.emptying_marks_off.store(true, Ordering::Release);
        self.0.held_at_count.store(u64::MAX, Ordering::Relaxed);
    }

    /// The allocation that finds the pool emptied by the program, after
    /// the step mark that emptying makes (Note [Steps at emptying]).
    pub(super) fn allocate_after_emptying_mark(
        &self,
        size: u64,
        rounded: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Allocation> {
        tracing::trace!(
            pool = self.0.id,
            "step marked: the program emptied the pool"
        );
        self.mark(MarkedBy::Emptying)?;
        if !self.0.stepping.load(Ordering::Acquire) {
            // The pool's marks gave up (see [`Pool::mark`]).
            return self.allocate_locked(size, rounded, stream, Purpose::Program);
        }
        let allocation = self.allocate_stepping(size, rounded, stream)?;
        if allocation.block == BlockId::PLANNED {
            return Ok(allocation);
        }
        // The step's first allocation, from the heap: its free is no event
        // of the step, as where a step under way made the mark (see
        // `Pool::allocate_stepping`), so that the first step the pool
        // marks records what the later ones do and the second can repeat
        // it, and no step is wholly planned.
        Ok(Allocation {
            step: None,
            ..allocation
        })
    }

    /// A step's end, marked by the program or where it emptied the pool.
    /// [`EMPTYING_MARKS_UNLAID`] of the pool's own marks in a row that
    /// lay nothing out (steps that never repeat, or whose layout is not
    /// to be had) end its marks and its steps: the program's calls go as
    /// they did before the first.
    fn mark(&self, by: MarkedBy) -> Result<()> {
        self.carry_out_deferred();
        let _marking = lock(&self.0.marking);
        if by == MarkedBy::Emptying && !self.marks_at_emptying() {
            // The program marked a step meanwhile, on another thread: its
            // marks are the only ones now.
            return Ok(());
        }
        self.0.stepping.store(true, Ordering::Release);
        let (wants, layout, given_up, stream, from) = {
            let mut st = lock(&self.0.steps);
            if by == MarkedBy::Program && st.steps.defer_mark() {
                return Ok(());
            }
            let wants = st.steps.mark();
            let layout = if wants.is_none() && st.steps.lays_out_nothing() {
                LayoutAtMark::None
            } else {
                LayoutAtMark::UnderWay
            };
            if by == MarkedBy::Emptying {
                st.unlaid_marks = if layout == LayoutAtMark::None {
                    st.unlaid_marks + 1
                } else {
                    0
                };
                if st.unlaid_marks >= EMPTYING_MARKS_UNLAID {
                    tracing::debug!(
                        pool = self.0.id,
                        marks = st.unlaid_marks,
                        "no more steps marked at emptying: none laid out"
                    );
                    self.stop_emptying_marks();
                    self.0.stepping.store(false, Ordering::Release);
                    st.steps.forget_steps();
                    st.stream = None;
                    return Ok(());
                }
            }
            let given_up = self.given_up(&mut st);
            let stream = st.stream.clone();
            if !st.steps.has_stream() {
                // The next step's first allocation picks the stream.
                st.stream = None;
            }
            let from = if st.steps.layouts_last() {
                RegionFrom::AnyMemory
            } else {
                RegionFrom::FreeMemory
            };
            (wants, layout, given_up, stream, from)
        };
        let end = if by == MarkedBy::Emptying {
            StepEnd::Emptied
        } else {
            StepEnd::Program
        };
        self.lock().step_marked(end, layout);
        // Regions given up go first, so that a new one can take their place.
        self.free_given_up(given_up);
        let Some(len) = wants else {
            return Ok(());
        };
        match self.allocate_region(len, stream.as_ref().map(|s| &s.0), from) {
            Ok(None) => {
                lock(&self.0.steps).steps.abandon();
                tracing::debug!(
                    pool = self.0.id,
                    len,
                    "step layout given up: its region would map"
                );
                Ok(())
            }
            Ok(Some(region)) => {
                let base = region.ptr.0;
                lock(&self.0.steps).steps.install(base, region);
                tracing::debug!(
                    pool = self.0.id,
                    base = format_args!("{base:#x}"),
                    len,
                    "step layout installed"
                );
                Ok(())
            }
            Err(e) => {
                lock(&self.0.steps).steps.abandon();
                match e {
                    // An optimisation the pool cannot afford now: the
                    // program goes on as it would unmarked.
                    Error::OutOfMemory { .. }
                    | Error::PoolLimit { .. }
                    | Error::OutOfAddressSpace { .. } => {
                        tracing::info!(pool = self.0.id, len, error = %e, "step layout given up: no region");
                        Ok(())
                    }
                    e => Err(e),
                }
            }
        }
    }

    /// A step layout's region of `len` bytes, counted idle; `None` where
    /// it must come `from` free memory and no free block holds it.
    fn allocate_region(
        &self,
        len: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        from: RegionFrom,
    ) -> Result<Option<Allocation>> {
        let rounded = len.next_multiple_of(QUANTUM);
        // Under the lock, not from the stream's own frees, so that its
        // bytes are counted idle as it is made.
        match from {
            RegionFrom::AnyMemory => self
                .allocate_locked(len, rounded, stream, Purpose::Region)
                .map(Some),
            RegionFrom::FreeMemory => {
                let mut inner = self.lock();
                let found = inner.allocate_without_growth(rounded, stream)?;
                Ok(found.map(|p| self.hand_out_locked(inner, len, p, stream, Purpose::Region)))
            }
        }
    }

    /// Waits until a step layout being planned on a thread of its own (a
    /// step of many allocations, Note [Steps at emptying] in
    /// docs/DESIGN.md) is ready, so that the next mark whose step it
    /// serves takes it; returns at once if none is. For replays and tests
    /// whose steps should lay out at the same mark on any machine. Calls
    /// that record steps wait with it.
    pub fn await_step_plan(&self) {
        lock(&self.0.steps).steps.await_plan();
    }

    /// Marks the end of a step at the pool's next allocation, before that
    /// allocation is served, as [`Pool::mark_step`] would there: for a
    /// hook that runs once a step's work is queued but before its last
    /// frees, such as after an optimizer's step, whose gradients are freed
    /// after it. The frees until then end the step, so the step holds what
    /// it allocates and frees, and lays out. Called again before that
    /// allocation, it changes nothing; a failed mark fails the allocation.
    pub fn mark_step_at_next_allocation(&self) {
        self.carry_out_deferred();
        self.0.mark_due.set_program();
    }

    /// The mark due before an allocation, the program's
    /// ([`Pool::mark_step_at_next_allocation`]) or one deferred past the
    /// frees its step carried: a load of the pool's first line when none
    /// is due.
    #[inline]
    pub(super) fn mark_if_due(&self) -> Result<()> {
        if self.0.mark_due.is_none() {
            return Ok(());
        }
        match self.0.mark_due.take() {
            Due::Program => self.mark_step(),
            Due::Deferred => self.mark(MarkedBy::Deferred),
            Due::None => Ok(()),
        }
    }
}
