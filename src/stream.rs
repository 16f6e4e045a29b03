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

pub(crate) struct StreamShared<B: Backend> {
    pub(crate) id: u64,
    pub(crate) device: DeviceId,
    pub(crate) raw: B::Stream,
    /// Positions handed out to frees and records on this stream.
    seq: AtomicU64,
    pub(crate) clock: Mutex<Clock>,
}

impl<B: Backend> StreamShared<B> {
    /// The next position on this stream.
    pub(crate) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The last position handed out.
    pub(crate) fn current_seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
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
            seq: AtomicU64::new(0),
            clock: Mutex::new(Clock::default()),
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
        let seq = stream.next_seq();
        let clock = lock(&stream.clock).clone();
        *lock(&self.captured) = Some(Captured {
            stream: stream.id,
            seq,
            clock,
        });
    }

    /// Makes `stream`'s clock include what this event captured.
    pub(crate) fn order_after(&self, stream: &StreamShared<B>) {
        if let Some(c) = &*lock(&self.captured) {
            let mut clock = lock(&stream.clock);
            clock.merge(&c.clock);
            clock.advance(c.stream, c.seq);
        }
    }
}
