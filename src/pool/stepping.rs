//! A pool's step layouts (Note [Step layouts] in docs/DESIGN.md): once the
//! program marks its steps, allocations and frees pass through
//! [`Steps`], which serves the allocations of a repeating step from a
//! region laid out for them, so that the step takes no heap block, grows
//! nothing and remaps nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmm::Backend;

use crate::allocation::Allocation;
use crate::capture::Captures;
use crate::heap::{BlockId, QUANTUM};
use crate::ordering::{Pending, Stream, StreamShared};
use crate::steps::{Freed, Placement, StepCounters, Steps};
use crate::sync::lock;
use crate::Result;

use super::{Pool, Purpose};

/// The layouts and the stream they serve.
pub(super) struct Stepping<B: Backend> {
    pub(super) steps: Steps<Allocation>,
    /// The pool's own marks in a row that laid nothing out (Note [Steps at
    /// emptying]).
    pub(super) unlaid_marks: u32,
    /// The layout's stream, once an allocation has fixed it (`None` also
    /// for synchronous calls): regions are allocated and freed on it.
    pub(super) stream: Option<Stream<B>>,
    captures: Arc<Captures>,
    /// The pool's count of planned bytes freed, idle again, that its lock
    /// has not yet counted (`Usage::planned_frees`).
    planned_frees: Arc<AtomicU64>,
    /// Planned allocations freed on another stream than the layout's
    /// while a graph capture was under way, when that stream could not be
    /// waited for: freed at the pool's next free in a marked step, mark,
    /// request for one or trim, with no capture under way
    /// ([`take_deferred`]). Until then their bytes count as used.
    deferred: Vec<(Allocation, Stream<B>)>,
}

impl<B: Backend> Stepping<B> {
    pub(super) fn new(captures: Arc<Captures>, planned_frees: Arc<AtomicU64>) -> Self {
        Self {
            steps: Steps::new(QUANTUM),
            unlaid_marks: 0,
            stream: None,
            captures,
            planned_frees,
            deferred: Vec::new(),
        }
    }
}

/// Memory the layouts gave up, to free on the layout's stream once the
/// steps' lock is let go: the work queued there may still use it.
pub(super) type GivenUp<B> = Option<(Vec<Allocation>, Option<Stream<B>>)>;

impl<B: Backend> Pool<B> {
    /// Gives up a layout nothing planned lives in now, its region freed
    /// in stream order: asked for its unused memory, the pool counts an
    /// idle region as unused. Steps that repeat lay out again.
    pub(super) fn give_up_idle_layout(&self) {
        // Frees a capture deferred first: their slots may be all that
        // keeps the layout from being idle.
        self.carry_out_deferred();
        let given_up = {
            let mut st = lock(&self.0.steps);
            st.steps.give_up_if_idle();
            self.given_up(&mut st)
        };
        self.free_given_up(given_up);
    }

    /// What the layouts gave up since the last call, under the steps' lock:
    /// whole regions, and the parts of split ones that hold no planned
    /// allocation. A region given up with planned allocations live in it is
    /// split, under the pool's lock, into heap blocks at their edges; each
    /// of theirs goes to the steps, to be freed when its allocation is.
    pub(super) fn given_up(&self, st: &mut Stepping<B>) -> GivenUp<B> {
        let mut free = st.steps.take_retired();
        for split in st.steps.take_splits() {
            let region = split.memory;
            let part = |at: u64, size: u64, block| Allocation {
                ptr: vmm::DevicePtr(at),
                size,
                block_size: size,
                arena: region.arena,
                block,
                pool: self.0.id,
                trace_id: 0,
                step: None,
                device: self.0.device,
            };
            let mut inner = self.lock();
            let heap = &mut inner.arenas[region.arena].heap;
            let end = region.ptr.0 + region.block_size;
            // The part not yet split off, from `start`.
            let (mut rest, mut start) = (Some(region.block), region.ptr.0);
            for (at, size, live) in split.live {
                let block = rest.expect("live allocations lie inside the region");
                let block = if at > start {
                    free.push(part(start, at - start, block));
                    heap.split(block, at)
                } else {
                    block
                };
                rest = (at + size < end).then(|| heap.split(block, at + size));
                start = at + size;
                st.steps.adopt(at, part(at, size, block), live);
            }
            if let Some(block) = rest {
                free.push(part(start, end - start, block));
            }
        }
        (!free.is_empty()).then(|| (free, st.stream.clone()))
    }

    /// Frees what [`Pool::given_up`] returned, once the steps' lock is let
    /// go.
    pub(super) fn free_given_up(&self, given_up: GivenUp<B>) {
        let Some((parts, stream)) = given_up else {
            return;
        };
        let freed: u64 = parts.iter().map(|p| p.block_size).sum();
        tracing::trace!(pool = self.0.id, parts = parts.len(), freed, "region freed");
        // Their bytes taken from idle, and the parts freed, under one hold
        // of the pool's lock: a count another thread made in between would
        // find more idle bytes than used ones (Note [Step layouts]).
        let mut inner = self.lock();
        inner.release_idle(freed);
        for part in &parts {
            match &stream {
                Some(s) => inner.free_in_order(part, &s.0),
                None => inner.free(part.arena, part.block, part.block_size),
            }
        }
    }

    /// Frees `part` in stream order on `stream`, or at once (`None`).
    fn release_on(&self, part: &Allocation, stream: Option<&Stream<B>>) {
        match stream {
            Some(s) => self.release_async(part, s),
            None => self.release(part),
        }
    }

    /// What the step layouts have done.
    pub fn step_counters(&self) -> StepCounters {
        lock(&self.0.steps).steps.counters()
    }

    /// An allocation once steps are marked: its slot in the layout, or the
    /// heap.
    pub(super) fn allocate_stepping(
        &self,
        size: u64,
        rounded: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Allocation> {
        let id = stream.map(|s| s.id);
        let (placement, counted, overran, given_up) = {
            let mut st = lock(&self.0.steps);
            let capturing = st.captures.under_way();
            let placement = st.steps.place(id, rounded, capturing);
            if st.steps.take_deferred_mark() {
                self.0.mark_due.set_deferred();
            }
            if st.stream.is_none() && placement != Placement::Heap(None) {
                st.stream = stream.map(|s| Stream(Arc::clone(s)));
            }
            let counted = matches!(placement, Placement::Planned(_))
                && spend_planned_frees(&st.planned_frees, rounded);
            let overran = matches!(placement, Placement::Heap(Some(_)))
                && (st.steps.overran() || st.steps.take_divergence());
            (placement, counted, overran, self.given_up(&mut st))
        };
        self.free_given_up(given_up);
        match placement {
            Placement::Planned(ptr) => {
                let p = Pending {
                    arena: crate::arena::ArenaId::Large,
                    block: BlockId::PLANNED,
                    ptr,
                    size: rounded,
                    seq: 0,
                };
                if !counted {
                    self.lock().count_planned(rounded);
                }
                Ok(self.hand_out(size, p, id.unwrap_or(0), Purpose::Program))
            }
            Placement::Heap(tag) => {
                let allocation = if overran {
                    self.allocate_past_layout(size, rounded, stream)?
                } else {
                    self.allocate_from_heap(size, rounded, stream, Purpose::Program)?
                };
                // One that found the pool emptied was placed again, after
                // the step mark it made (`Pool::allocate_after_emptying_mark`),
                // and may be planned there: where another thread's
                // allocations took the new step's first ordinals, its own
                // has a slot. The tag taken before the mark would send its
                // free to the heap, its slot never freed. One from the heap
                // may take it: an earlier step's tag records no event of
                // this one, as that function wants.
                if allocation.block == BlockId::PLANNED {
                    return Ok(allocation);
                }
                Ok(Allocation {
                    step: tag,
                    ..allocation
                })
            }
        }
    }

    /// An allocation of a step gone on past its layout's last event, the
    /// region idle (a log, a checkpoint, or a new model built and trained
    /// after the last mark): from the heap's free memory if it can; where
    /// the heap must grow, the layout may be given up first
    /// ([`Steps::grow_past`]), so that the heap takes the region's memory
    /// instead of growing beside it. Where the program holds nothing of the
    /// pool, the layout is given up at once and the pool starts afresh.
    fn allocate_past_layout(
        &self,
        size: u64,
        rounded: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Allocation> {
        // Under the pool's lock, which also takes the stream's own frees:
        // rare enough not to need the lock-free path.
        let mut inner = self.lock();
        // A program that marks no step and has emptied the pool: a step
        // ends here, which the layout may serve (Note [Steps at emptying]).
        let freed = inner.freed_by(stream);
        if self.marks_at_emptying() && inner.take_emptied_mark(freed, self.step_marks()) {
            drop(inner);
            return self.allocate_after_emptying_mark(size, rounded, stream);
        }
        // A program that has emptied the pool starts afresh, its idle
        // layout given up first so that its region goes too (Note
        // [Starting afresh]).
        let emptied = inner.empty_now();
        if !emptied {
            if let Some(p) = inner.allocate_without_growth(rounded, stream)? {
                return Ok(self.hand_out_locked(inner, size, p, stream, Purpose::Program));
            }
        }
        drop(inner);
        let given_up = {
            let mut st = lock(&self.0.steps);
            if emptied {
                st.steps.give_up_if_idle();
            } else {
                st.steps.grow_past(rounded);
            }
            self.given_up(&mut st)
        };
        if given_up.is_some() {
            let why = if emptied {
                "the program emptied the pool"
            } else {
                "the heap would grow past it"
            };
            tracing::debug!(pool = self.0.id, size, why, "step layout given up");
        }
        self.free_given_up(given_up);
        if emptied {
            self.lock().start_afresh(stream)?;
        }
        self.allocate_locked(size, rounded, stream, Purpose::Program)
    }

    /// A free once steps are marked; `stream`: the freeing stream (`None`:
    /// a synchronous free). Returns whether the allocation was planned, and
    /// so is dealt with. A planned allocation freed on a stream other than
    /// the layout's waits for that stream first: the layout's stream takes
    /// the slot again without an event to order it after the free. One
    /// whose region was split frees its part of it, as any allocation.
    pub(super) fn free_stepping(
        &self,
        allocation: &Allocation,
        stream: Option<&Stream<B>>,
    ) -> bool {
        let (freed, given_up, deferred) = {
            let mut st = lock(&self.0.steps);
            let freed = self.free_in_steps(&mut st, allocation, stream);
            if st.steps.take_deferred_mark() {
                self.0.mark_due.set_deferred();
            }
            if let Freed::Planned = freed {
                // Idle again, counted before a region this free gave up
                // leaves the idle bytes; without the pool's lock.
                st.planned_frees
                    .fetch_add(allocation.block_size, Ordering::Release);
            }
            (freed, self.given_up(&mut st), take_deferred(&mut st))
        };
        self.free_given_up(given_up);
        self.free_deferred(deferred);
        match freed {
            Freed::Heap => false,
            Freed::Planned | Freed::Kept => true,
            Freed::Split(part) => {
                self.release_on(&part, stream);
                true
            }
        }
    }

    /// Frees what a graph capture deferred, if none is under way now
    /// ([`take_deferred`]).
    pub(super) fn carry_out_deferred(&self) {
        let deferred = take_deferred(&mut lock(&self.0.steps));
        self.free_deferred(deferred);
    }

    /// Frees the planned allocations that [`take_deferred`] took: each
    /// stream is waited for now, as it would have been at the free.
    fn free_deferred(&self, deferred: Vec<(Allocation, Stream<B>)>) {
        for (allocation, stream) in deferred {
            let planned = self.free_stepping(&allocation, Some(&stream));
            debug_assert!(planned, "a deferred free is a planned allocation's");
        }
    }

    /// [`Pool::free_stepping`] under the steps' lock.
    fn free_in_steps(
        &self,
        st: &mut Stepping<B>,
        allocation: &Allocation,
        stream: Option<&Stream<B>>,
    ) -> Freed<Allocation> {
        let ptr = allocation.ptr.0;
        let layout_stream = st.stream.as_ref().map(|s| s.0.id);
        if let Some(s) = stream.filter(|s| Some(s.0.id) != layout_stream) {
            if st.steps.is_planned(ptr) {
                // While a graph is captured nothing may be waited for: the
                // slot stays taken until a free or mark with no capture
                // under way waits and frees it. A stream that cannot be
                // waited for keeps it: safe, at the cost of the slot.
                if st.captures.under_way() {
                    st.deferred.push((allocation.duplicate(), s.clone()));
                    return Freed::Kept;
                }
                if let Err(err) = self.0.backend.synchronize_stream(&s.0.raw) {
                    tracing::warn!(%err, "a planned allocation freed on another stream stays taken");
                    return Freed::Kept;
                }
            }
        }
        st.steps.free(ptr, allocation.step)
    }
}

/// The planned allocations whose frees on another stream came while a
/// graph capture was under way ([`Pool::free_in_steps`]), once none is:
/// taken to be freed by the pool's next free in a marked step, mark,
/// request for one or trim.
fn take_deferred<B: Backend>(st: &mut Stepping<B>) -> Vec<(Allocation, Stream<B>)> {
    if st.deferred.is_empty() || st.captures.under_way() {
        return Vec::new();
    }
    std::mem::take(&mut st.deferred)
}

/// Takes `size` bytes from the planned frees the pool's lock has not yet
/// counted, if there are that many: the allocation then reuses bytes the
/// program held since the lock last counted, so it cannot raise the
/// high-water mark, and needs no lock to count it (as a stream's usage
/// credit, Note [Usage credit]). In a laid-out step that makes no heap
/// allocation, the last step's frees count every allocation of the next.
fn spend_planned_frees(planned_frees: &AtomicU64, size: u64) -> bool {
    planned_frees
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |freed| {
            freed.checked_sub(size)
        })
        .is_ok()
}
