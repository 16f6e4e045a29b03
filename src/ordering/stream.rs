//! vmpool's streams and events: the backend's, plus what vmpool needs to
//! know about stream order to decide when memory freed on one stream may be
//! handed to another.
//!
//! ```text
//!   stream A:  free(x)@3 ... record(e)@5
//!   stream B:                          wait(e)  -> B.clock[A] = 5 >= 3: x is B's to reuse
//! ```
//!
//! Each stream counts its frees and records (`seq`). An event remembers the
//! stream and count it captured, and that stream's own clock: what it had
//! itself waited for. A stream that waits on the event merges both into its
//! clock, so dependencies carry along chains of streams.
//!
//! A stream also holds, per pool, the blocks freed on it that are still
//! pending, and what those frees owe the pool's count of used bytes
//! (`credit`). The same-stream hot path (free, then allocate the same size)
//! touches only this state, nothing of the pool's, so streams on different
//! threads share no lock and no counter. A pool's lock is taken before a
//! stream's, never the other way (Note [Lock order] in docs/DESIGN.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;
use vmm::{Backend, DeviceId};

use super::frees::{ByPool, Counted, Pending};
use crate::sync::lock;

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// For each other stream, the last of its positions this stream is known to
/// be ordered after.
#[derive(Debug, Clone, Default)]
pub(crate) struct Clock(FxHashMap<u64, u64>);

impl Clock {
    pub(crate) fn get(&self, stream: u64) -> u64 {
        self.0.get(&stream).copied().unwrap_or(0)
    }

    pub(crate) fn advance(&mut self, stream: u64, seq: u64) {
        let at = self.0.entry(stream).or_insert(0);
        *at = (*at).max(seq);
    }

    fn merge(&mut self, other: &Clock) {
        for (&stream, &seq) in &other.0 {
            self.advance(stream, seq);
        }
    }
}

pub(crate) struct StreamState {
    /// Positions handed out to frees and records on this stream.
    pub(super) seq: u64,
    pub(super) clock: Clock,
    /// Pending frees by pool id. An entry exists exactly while the pool has
    /// this stream registered.
    pub(super) pending: ByPool,
}

/// Held for a few instructions at a time, never across a driver call.
type StateLock<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;

pub(crate) struct StreamShared<B: Backend> {
    pub(crate) id: u64,
    pub(crate) device: DeviceId,
    pub(crate) raw: B::Stream,
    state: StateLock<StreamState>,
}

impl<B: Backend> StreamShared<B> {
    pub(super) fn state(&self) -> spin::mutex::SpinMutexGuard<'_, StreamState, spin::relax::Yield> {
        self.state.lock()
    }

    /// The hot path's allocation: a block of exactly `size` this stream
    /// freed in `pool`, reused in its order without the pool's lock;
    /// none once the stream's frees reach `held` (see
    /// [`super::frees::PoolFrees::reuse`]).
    #[inline]
    pub(crate) fn reuse(&self, pool: u64, size: u64, held: u64) -> Option<Pending> {
        self.state().pending.get_mut(&pool)?.reuse(size, held)
    }

    /// A stream-ordered free: the block goes to this stream's pending
    /// frees in `pool`, at the stream's next position, its bytes counted
    /// as `counted` says. `false` when the stream is not registered with
    /// the pool yet: the position is spent, the block not taken.
    #[inline]
    pub(crate) fn push_free(
        &self,
        pool: u64,
        block: impl FnOnce(u64) -> Pending,
        counted: Counted,
    ) -> bool {
        let mut st = self.state();
        st.seq += 1;
        let seq = st.seq;
        match st.pending.get_mut(&pool) {
            Some(frees) => {
                frees.push(block(seq), counted);
                true
            }
            None => false,
        }
    }

    /// Takes the stream's next position, for an event about to be
    /// recorded on it: the frees made so far lie below it, those made
    /// from now on above. Taken before the backend records, never after:
    /// a free another thread makes on the stream in between lies above
    /// the position, though the work queued before that free may come
    /// after the recorded point; the other way round, the event would
    /// claim that free, and its completion release the memory under
    /// work still queued.
    pub(crate) fn capture(&self) -> Captured {
        let mut st = self.state();
        st.seq += 1;
        Captured {
            stream: self.id,
            seq: st.seq,
            clock: st.clock.clone(),
        }
    }

    /// Makes the stream's clock include what an event `captured`.
    pub(crate) fn order_after(&self, captured: &Captured) {
        let mut st = self.state();
        st.clock.merge(&captured.clock);
        st.clock.advance(captured.stream, captured.seq);
    }

    /// The last position handed out.
    pub(crate) fn current_seq(&self) -> u64 {
        self.state().seq
    }
}

/// A stream of device work. Cloning gives another handle to the same stream.
pub struct Stream<B: Backend>(pub(crate) Arc<StreamShared<B>>);

impl<B: Backend> Clone for Stream<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

/// Two handles are equal when they are the same stream (clones of one
/// another), whatever the backend stream inside.
impl<B: Backend> PartialEq for Stream<B> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<B: Backend> Eq for Stream<B> {}

impl<B: Backend> std::fmt::Debug for Stream<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.0.id)
            .field("device", &self.0.device)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Stream<B> {
    pub(crate) fn new(raw: B::Stream, device: DeviceId) -> Self {
        Self(Arc::new(StreamShared {
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
            device,
            raw,
            state: StateLock::new(StreamState {
                seq: 0,
                clock: Clock::default(),
                pending: ByPool::default(),
            }),
        }))
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> DeviceId {
        self.0.device
    }

    /// The backend's stream, to queue work on it.
    pub fn raw(&self) -> &B::Stream {
        &self.0.raw
    }
}

/// What an event captured when it was last recorded.
#[derive(Debug)]
pub(crate) struct Captured {
    pub(crate) stream: u64,
    pub(crate) seq: u64,
    pub(crate) clock: Clock,
}

/// A point in a stream's work, recorded with [`crate::Context::record_event`]
/// and waited for by streams or the host, as CUDA's events.
pub struct Event<B: Backend> {
    pub(crate) raw: B::Event,
    pub(crate) device: DeviceId,
    /// Shared, so that a wait takes it without copying the clock.
    pub(crate) captured: Mutex<Option<Arc<Captured>>>,
}

impl<B: Backend> std::fmt::Debug for Event<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device)
            .field("recorded", &self.captured().is_some())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Event<B> {
    pub(crate) fn new(raw: B::Event, device: DeviceId) -> Self {
        Self {
            raw,
            device,
            captured: Mutex::new(None),
        }
    }

    /// What the last record captured.
    pub(crate) fn captured(&self) -> Option<Arc<Captured>> {
        lock(&self.captured).clone()
    }

    /// The device the event belongs to.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The backend's event.
    pub fn raw(&self) -> &B::Event {
        &self.raw
    }

    /// Notes that the event now captures what [`StreamShared::capture`]
    /// took, once the backend has recorded it.
    pub(crate) fn set_captured(&self, captured: Captured) {
        *lock(&self.captured) = Some(Arc::new(captured));
    }
}
