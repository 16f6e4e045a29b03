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
//! pending. The same-stream hot path (free, then allocate the same size)
//! touches only this state and the pool's `used` counters, not the pool's
//! lock, so streams on different threads do not serialise on one lock.
//! Lock order: a pool's lock, then a stream's; never the other way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustc_hash::FxHashMap;
use vmm::{Backend, DeviceId};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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

/// A block freed on a stream, not yet known to be free for every stream.
pub(crate) struct Pending {
    pub(crate) arena: usize,
    pub(crate) block: crate::heap::BlockId,
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    /// The stream's position at the free.
    pub(crate) seq: u64,
}

/// The pending frees one stream has made in one pool.
#[derive(Default)]
pub(crate) struct PoolFrees {
    /// By size, most recent last: the hot path pops from here.
    pub(crate) by_size: FxHashMap<u64, Vec<Pending>>,
    /// Position of the latest free.
    pub(crate) last_free: u64,
    pub(crate) bytes: u64,
    /// Hot-path counts, summed into the pool's statistics.
    pub(crate) frees: u64,
    pub(crate) reuses: u64,
}

impl PoolFrees {
    /// The most recent pending block of exactly `size` freed at or before
    /// position `upto`.
    pub(crate) fn take(&mut self, size: u64, upto: u64) -> Option<Pending> {
        let list = self.by_size.get_mut(&size)?;
        let i = list.iter().rposition(|p| p.seq <= upto)?;
        let p = list.swap_remove(i);
        self.bytes -= p.size;
        Some(p)
    }

    /// The smallest size present, between `size` and 1/8 more, with a block
    /// freed at or before `upto`.
    pub(crate) fn near_size(&self, size: u64, upto: u64) -> Option<u64> {
        self.by_size
            .iter()
            .filter(|(&s, list)| {
                s >= size && s <= size + size / 8 && list.iter().any(|p| p.seq <= upto)
            })
            .map(|(&s, _)| s)
            .min()
    }

    /// Removes every block freed at or before `upto`.
    pub(crate) fn drain_upto(&mut self, upto: u64) -> Vec<Pending> {
        let mut out = Vec::new();
        for list in self.by_size.values_mut() {
            let mut i = 0;
            while i < list.len() {
                if list[i].seq <= upto {
                    out.push(list.swap_remove(i));
                } else {
                    i += 1;
                }
            }
        }
        self.by_size.retain(|_, list| !list.is_empty());
        self.bytes -= out.iter().map(|p| p.size).sum::<u64>();
        out
    }
}

pub(crate) struct StreamState {
    /// Positions handed out to frees and records on this stream.
    pub(crate) seq: u64,
    pub(crate) clock: Clock,
    /// Pending frees by pool id. An entry exists exactly while the pool has
    /// this stream registered.
    pub(crate) pending: FxHashMap<u64, PoolFrees>,
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
    pub(crate) fn state(&self) -> spin::mutex::SpinMutexGuard<'_, StreamState, spin::relax::Yield> {
        self.state.lock()
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

impl<B: Backend> Stream<B> {
    pub(crate) fn new(raw: B::Stream, device: DeviceId) -> Self {
        Self(Arc::new(StreamShared {
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
            device,
            raw,
            state: StateLock::new(StreamState {
                seq: 0,
                clock: Clock::default(),
                pending: FxHashMap::default(),
            }),
        }))
    }

    pub fn device(&self) -> DeviceId {
        self.0.device
    }

    /// The backend's stream, to queue work on it.
    pub fn raw(&self) -> &B::Stream {
        &self.0.raw
    }
}

/// What an event captured when it was last recorded.
#[derive(Debug, Clone)]
pub(crate) struct Captured {
    pub(crate) stream: u64,
    pub(crate) seq: u64,
    pub(crate) clock: Clock,
}

pub struct Event<B: Backend> {
    pub(crate) raw: B::Event,
    pub(crate) device: DeviceId,
    pub(crate) captured: Mutex<Option<Captured>>,
}

impl<B: Backend> Event<B> {
    pub(crate) fn new(raw: B::Event, device: DeviceId) -> Self {
        Self {
            raw,
            device,
            captured: Mutex::new(None),
        }
    }

    /// (stream, position) of the last record.
    pub(crate) fn captured(&self) -> Option<(u64, u64)> {
        lock(&self.captured).as_ref().map(|c| (c.stream, c.seq))
    }

    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The backend's event.
    pub fn raw(&self) -> &B::Event {
        &self.raw
    }

    /// Notes that the event now captures `stream` up to now.
    pub(crate) fn capture(&self, stream: &StreamShared<B>) {
        let (seq, clock) = {
            let mut st = stream.state();
            st.seq += 1;
            (st.seq, st.clock.clone())
        };
        *lock(&self.captured) = Some(Captured {
            stream: stream.id,
            seq,
            clock,
        });
    }

    /// Makes `stream`'s clock include what this event captured.
    pub(crate) fn order_after(&self, stream: &StreamShared<B>) {
        if let Some(c) = &*lock(&self.captured) {
            let mut st = stream.state();
            st.clock.merge(&c.clock);
            st.clock.advance(c.stream, c.seq);
        }
    }
}
