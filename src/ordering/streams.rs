//! A pool's view of the streams that have frees pending in it: which they
//! are, the events recorded on them to learn when their frees complete, and
//! the reuse rules that say when one stream may take another's frees
//! (Note [Event-based reuse] in docs/DESIGN.md). The frees themselves live
//! with their streams ([`super::frees`]); this type is the pool's one way
//! to reach them.

use std::collections::VecDeque;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use vmm::{Backend, EventStatus};

use super::frees::Pending;
use super::guards::{Guard, StreamPos};
use super::stream::StreamShared;
use crate::capture::Captures;
use crate::Result;

/// How many stream-ordered allocations that take the pool's lock share one
/// look for completed frees on the way in (an event query per stream with
/// frees pending).
const COLLECT_EVERY: u32 = 4;

/// CUDA's three cross-stream reuse switches
/// (`cudaMemPoolReuse*`), all on by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReuseRules {
    /// A stream takes frees of streams it is ordered after by events.
    pub(crate) follow_event_dependencies: bool,
    /// Frees whose events have completed go back to every stream.
    pub(crate) allow_opportunistic: bool,
    /// A stream may be made to wait for another's frees, to take them.
    pub(crate) allow_internal_dependencies: bool,
}

impl Default for ReuseRules {
    fn default() -> Self {
        Self {
            follow_event_dependencies: true,
            allow_opportunistic: true,
            allow_internal_dependencies: true,
        }
    }
}

/// What the streams' ordering has done, for [`crate::PoolStats`].
#[derive(Debug, Clone, Default)]
pub(crate) struct OrderingCounters {
    pub(crate) dependency_reuses: u64,
    pub(crate) frees_completed: u64,
    pub(crate) waits_inserted: u64,
    pub(crate) frees_merged: u64,
    pub(crate) events_recorded: u64,
}

/// The hot path's counts and the bytes pending, summed over the streams.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PendingTotals {
    pub(crate) reuses: u64,
    pub(crate) frees: u64,
    pub(crate) bytes: u64,
}

/// What a stream that leaves the pool's table still owed it: its credit
/// (Note [Usage credit] in docs/DESIGN.md) and its hot-path counts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unregistered {
    pub(crate) credit: u64,
    pub(crate) reuses: u64,
    pub(crate) frees: u64,
}

/// A stream with pending frees in the pool, and the events recorded on it
/// (oldest first, with the position each captured).
struct Registered<B: Backend> {
    /// Keeps the stream alive while its frees are pending.
    stream: Arc<StreamShared<B>>,
    events: VecDeque<(u64, B::Event)>,
}

pub(crate) struct Streams<B: Backend> {
    /// The pool's id: its entry in each stream's pending frees.
    pool: u64,
    backend: Arc<B>,
    /// The context's graph captures under way (Note [Graph captures]).
    captures: Arc<Captures>,
    pub(crate) rules: ReuseRules,
    registered: FxHashMap<u64, Registered<B>>,
    /// Events not in use, kept because creating one is a driver call.
    idle_events: Vec<B::Event>,
    /// Stream-ordered allocations that took the lock since the pool last
    /// looked for completed frees on the way in.
    unchecked: u32,
    /// A reused buffer: a stream's frees being merged, empty between calls.
    merging: Vec<Pending>,
    pub(crate) counters: OrderingCounters,
}

impl<B: Backend> Streams<B> {
    pub(crate) fn new(pool: u64, backend: Arc<B>, captures: Arc<Captures>) -> Self {
        Self {
            pool,
            backend,
            captures,
            rules: ReuseRules::default(),
            registered: FxHashMap::default(),
            idle_events: Vec::new(),
            unchecked: 0,
            merging: Vec::new(),
            counters: OrderingCounters::default(),
        }
    }

    /// Notes that `stream` has (or will have) pending frees here.
    pub(crate) fn register(&mut self, stream: &Arc<StreamShared<B>>) {
        self.registered
            .entry(stream.id)
            .or_insert_with(|| Registered {
                stream: Arc::clone(stream),
                events: VecDeque::new(),
            });
        stream.state().pending.entry(self.pool);
    }

    pub(crate) fn is_registered(&self, stream: u64) -> bool {
        self.registered.contains_key(&stream)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.registered.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.registered.len()
    }

    /// The streams' credits, summed, left where they are.
    pub(crate) fn credit(&self) -> u64 {
        self.registered
            .values()
            .filter_map(|reg| reg.stream.state().pending.get(&self.pool).map(|f| f.credit))
            .sum()
    }

    /// Takes every stream's credit; returns their sum.
    pub(crate) fn settle(&mut self) -> u64 {
        let pool = self.pool;
        self.registered
            .values()
            .filter_map(|reg| {
                let mut st = reg.stream.state();
                st.pending.get_mut(&pool).map(|f| {
                    f.credit_high = 0;
                    std::mem::take(&mut f.credit)
                })
            })
            .sum()
    }

    /// The most bytes `stream` has freed in this pool, net of its hot-path
    /// reuses, at any moment since the pool last settled.
    pub(crate) fn credit_high(&self, stream: &StreamShared<B>) -> u64 {
        stream
            .state()
            .pending
            .get(&self.pool)
            .map_or(0, |f| f.credit_high)
    }

    pub(crate) fn totals(&self) -> PendingTotals {
        let mut totals = PendingTotals::default();
        for reg in self.registered.values() {
            if let Some(f) = reg.stream.state().pending.get(&self.pool) {
                totals.reuses += f.reuses;
                totals.frees += f.frees;
                totals.bytes += f.bytes;
            }
        }
        totals
    }

    /// Whether this stream-ordered miss is the one in [`COLLECT_EVERY`]
    /// that looks for completed frees (opportunistic reuse only).
    pub(crate) fn due_for_collect(&mut self) -> bool {
        if !self.rules.allow_opportunistic {
            return false;
        }
        self.unchecked += 1;
        if self.unchecked < COLLECT_EVERY {
            return false;
        }
        self.unchecked = 0;
        true
    }

    /// How far each stream's recorded events show it has run: the
    /// positions whose frees are free for every stream. Nothing while a
    /// capture is under way. An event that reports an error fails the call.
    pub(crate) fn completed(&self) -> Result<Vec<StreamPos>> {
        if self.captures.under_way() {
            return Ok(Vec::new());
        }
        let mut passed = Vec::new();
        for (&id, reg) in &self.registered {
            let mut upto = 0;
            for (seq, event) in &reg.events {
                match self.backend.query_event(event)? {
                    EventStatus::Complete => upto = *seq,
                    EventStatus::Pending => break,
                }
            }
            if upto > 0 {
                passed.push(StreamPos {
                    stream: id,
                    seq: upto,
                });
            }
        }
        Ok(passed)
    }

    /// Takes the pending frees of `stream`, in the order they were freed,
    /// and hands each to `merge` (which puts it in the heap under a guard);
    /// all but the latest `keep` small ones, which stay pending for the
    /// same-size fast path. Returns whether any stayed.
    ///
    /// The guards go when an event shows the stream has passed the frees;
    /// one is recorded here unless one is outstanding already, so that a
    /// stream missing often records at most one event per round trip of its
    /// work, and its free chunks become movable again once it catches up.
    pub(crate) fn merge_own_frees(
        &mut self,
        stream: &Arc<StreamShared<B>>,
        keep: usize,
        mut merge: impl FnMut(&Pending),
    ) -> Result<bool> {
        let mut merged = std::mem::take(&mut self.merging);
        let mut kept = false;
        if let Some(f) = stream.state().pending.get_mut(&self.pool) {
            kept = f.drain_all_but(keep, Pending::is_small, &mut merged);
        }
        for p in &merged {
            merge(p);
            self.counters.frees_merged += 1;
        }
        let any = !merged.is_empty();
        merged.clear();
        self.merging = merged;
        if any && self.registered[&stream.id].events.is_empty() {
            // None during a graph capture: the frees stay guarded (the
            // stream's own to reuse) until a later miss records one.
            self.event_after_frees(stream.id)?;
        }
        Ok(kept)
    }

    /// Whether `stream` (`None`: a synchronous allocation) may take a range
    /// under the guards `found`: each guard of another stream must be one
    /// `stream` is ordered after, or, where the rules allow, `stream` is
    /// made to wait for it.
    pub(crate) fn may_take(
        &mut self,
        found: &[(u64, Guard)],
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<bool> {
        // Other streams whose frees are in the range, each with its latest
        // free there: few, so a list.
        let mut after: Vec<StreamPos> = Vec::new();
        for (_, g) in found {
            if stream.is_none_or(|s| s.id != g.by.stream) {
                match after.iter_mut().find(|p| p.stream == g.by.stream) {
                    Some(p) => p.seq = p.seq.max(g.by.seq),
                    None => after.push(g.by),
                }
            }
        }
        if after.is_empty() {
            return Ok(true);
        }
        let Some(s) = stream else {
            return Ok(false);
        };
        for pos in after {
            if self.rules.follow_event_dependencies && s.state().clock.get(pos.stream) >= pos.seq {
                continue;
            }
            if !self.rules.allow_internal_dependencies
                || self.wait_for_frees_of(s, pos.stream)?.is_none()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Memory freed in stream order on other streams that `stream` may take
    /// without growing the pool (its own are in the heap by now): frees of
    /// streams it is ordered after (follow event dependencies); then any,
    /// after making it wait for them (internal dependencies). Sizes up to
    /// 1/8 larger count.
    #[cold]
    pub(crate) fn reuse_pending(
        &mut self,
        size: u64,
        stream: &Arc<StreamShared<B>>,
    ) -> Result<Option<Pending>> {
        let pool = self.pool;
        let clock = stream.state().clock.clone();
        if self.rules.follow_event_dependencies {
            for (&id, reg) in self.registered.iter().filter(|(&id, _)| id != stream.id) {
                let upto = clock.get(id);
                let mut st = reg.stream.state();
                let Some(f) = st.pending.get_mut(&pool) else {
                    continue;
                };
                if let Some(near) = f.near_size(size, upto) {
                    self.counters.dependency_reuses += 1;
                    return Ok(f.take(near, upto));
                }
            }
        }
        if self.rules.allow_internal_dependencies {
            let candidate = self
                .registered
                .iter()
                .filter(|(&id, _)| id != stream.id)
                .find_map(|(&id, reg)| {
                    let st = reg.stream.state();
                    let near = st.pending.get(&pool)?.near_size(size, u64::MAX)?;
                    Some((id, near))
                });
            if let Some((id, near)) = candidate {
                let Some(event_seq) = self.wait_for_frees_of(stream, id)? else {
                    return Ok(None);
                };
                // The other stream's own hot path may have taken the block
                // meanwhile; then this is a wait for nothing, and we grow.
                let taken = self.registered[&id]
                    .stream
                    .state()
                    .pending
                    .get_mut(&pool)
                    .and_then(|f| f.take(near, event_seq));
                return Ok(taken);
            }
        }
        Ok(None)
    }

    /// Makes `stream` wait (on the device) for every free stream `id` has
    /// made so far (an internal dependency); returns the position of `id`
    /// it is now ordered after. `None`, with nothing done, while a graph
    /// capture is under way.
    fn wait_for_frees_of(&mut self, stream: &Arc<StreamShared<B>>, id: u64) -> Result<Option<u64>> {
        if self.captures.under_way() {
            return Ok(None);
        }
        let Some(event_seq) = self.event_after_frees(id)? else {
            return Ok(None);
        };
        let (_, event) = self.registered[&id]
            .events
            .iter()
            .find(|(seq, _)| *seq == event_seq)
            .expect("recorded above");
        self.backend.stream_wait_event(&stream.raw, event)?;
        stream.state().clock.advance(id, event_seq);
        self.counters.waits_inserted += 1;
        Ok(Some(event_seq))
    }

    /// An event on stream `id` that captures all its frees so far; records
    /// one if the latest does not. Returns the position it captured; `None`
    /// when one is needed while a graph capture is under way.
    fn event_after_frees(&mut self, id: u64) -> Result<Option<u64>> {
        let reg = self.registered.get_mut(&id).expect("caller checked");
        let last_free = reg
            .stream
            .state()
            .pending
            .get(&self.pool)
            .map_or(0, |f| f.last_free);
        if let Some((seq, _)) = reg.events.back() {
            if *seq >= last_free {
                return Ok(Some(*seq));
            }
        }
        if self.captures.under_way() {
            return Ok(None);
        }
        let event = match self.idle_events.pop() {
            Some(event) => event,
            None => self.backend.create_event(reg.stream.device)?,
        };
        let seq = {
            let mut st = reg.stream.state();
            st.seq += 1;
            st.seq
        };
        if let Err(err) = self.backend.record_event(&event, &reg.stream.raw) {
            self.idle_events.push(event);
            return Err(err.into());
        }
        reg.events.push_back((seq, event));
        self.counters.events_recorded += 1;
        Ok(Some(seq))
    }

    /// Records an event after the latest free of every stream but `except`
    /// that has none, so that a later miss can tell when those frees
    /// complete. Done on misses only: the same-stream path records nothing.
    #[cold]
    pub(crate) fn record_pending(&mut self, except: u64) -> Result<()> {
        let ids: Vec<u64> = self
            .registered
            .keys()
            .copied()
            .filter(|&id| id != except)
            .collect();
        for id in ids {
            self.event_after_frees(id)?;
        }
        Ok(())
    }

    /// Frees of stream `id` up to position `upto` are free for every
    /// stream: they go to `released`, in the order they were freed, all
    /// but the stream's latest `keep_small` small ones, which stay pending
    /// for its fast path; and events that captured no later position go
    /// idle. A stream left with nothing pending and, as the caller says,
    /// nothing `guarded`, leaves the table: what it owed comes back.
    pub(crate) fn release(
        &mut self,
        id: u64,
        upto: u64,
        keep_small: usize,
        guarded: bool,
        released: &mut Vec<Pending>,
    ) -> Option<Unregistered> {
        let reg = self.registered.get_mut(&id)?;
        let unregistered = {
            let mut st = reg.stream.state();
            let f = st.pending.get_mut(&self.pool).expect("registered");
            let start = released.len();
            f.drain_upto(upto, keep_small, Pending::is_small, released);
            self.counters.frees_completed += (released.len() - start) as u64;
            if f.is_empty() && !guarded {
                let f = st.pending.remove(&self.pool).expect("present");
                Some(Unregistered {
                    credit: f.credit,
                    reuses: f.reuses,
                    frees: f.frees,
                })
            } else {
                None
            }
        };
        while reg.events.front().is_some_and(|(seq, _)| *seq <= upto) {
            let (_, event) = reg.events.pop_front().expect("checked");
            self.idle_events.push(event);
        }
        if unregistered.is_some() {
            let reg = self.registered.remove(&id).expect("present");
            self.idle_events
                .extend(reg.events.into_iter().map(|(_, e)| e));
        }
        unregistered
    }

    /// Blocks until the streams with pending frees that `wanted` picks have
    /// run past them; returns how far each has (a stream that fails is
    /// left out, and logged). `None`, with nothing done, while a graph
    /// capture is under way: nothing can be waited for then.
    pub(crate) fn wait_for(&self, mut wanted: impl FnMut(u64) -> bool) -> Option<Vec<StreamPos>> {
        if self.captures.under_way() {
            return None;
        }
        let mut passed = Vec::new();
        for (&id, reg) in self.registered.iter().filter(|(&id, _)| wanted(id)) {
            let upto = reg.stream.current_seq();
            match self.backend.synchronize_stream(&reg.stream.raw) {
                Ok(()) => passed.push(StreamPos {
                    stream: id,
                    seq: upto,
                }),
                Err(err) => tracing::warn!(%err, "a stream with pending frees failed"),
            }
        }
        Some(passed)
    }
}
