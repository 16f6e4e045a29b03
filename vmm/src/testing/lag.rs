//! A stream kept behind the calls that allocate on it, as a GPU keeps a
//! program's stream behind the allocations that queue its kernels, and
//! waited for now and then, as a program waits to read a result.
//!
//! Where a stream-ordered allocator's frees come back, and what it may
//! reuse, follow that timing; work that queues nothing shows only one
//! point of it. `vmpool-replay --stream-lag` and vmpool's timing tests
//! drive a stream this way.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use super::TestBackend;
use crate::Result;

/// How far behind the stream is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLag {
    /// Work queued on the stream after an allocation.
    pub delay: Duration,
    /// After every this many allocations.
    pub every: NonZeroU64,
    /// The calls wait for the stream every this many operations.
    pub wait_every: NonZeroU64,
}

/// A stream kept behind by a [`StreamLag`]: told of each allocation and
/// free on it, it queues the delays and waits for the stream on their
/// turns.
pub struct Lagging<B: TestBackend> {
    backend: Arc<B>,
    lag: StreamLag,
    allocations: u64,
    ops: u64,
}

impl<B: TestBackend> Lagging<B> {
    /// Queues its delays on `backend`'s streams.
    pub fn new(backend: Arc<B>, lag: StreamLag) -> Self {
        Self {
            backend,
            lag,
            allocations: 0,
            ops: 0,
        }
    }

    /// After an allocation on `stream`: queues the delay on its turn.
    pub fn allocated(&mut self, stream: &B::Stream) -> Result<()> {
        self.allocations += 1;
        if self.allocations % self.lag.every.get() == 0 {
            self.backend.delay(stream, self.lag.delay)?;
        }
        self.done(stream)
    }

    /// After a free on `stream`.
    pub fn freed(&mut self, stream: &B::Stream) -> Result<()> {
        self.done(stream)
    }

    /// After any operation: waits for the stream on its turn, as the
    /// program would (the driver's wait: the allocator is not told).
    fn done(&mut self, stream: &B::Stream) -> Result<()> {
        self.ops += 1;
        if self.ops % self.lag.wait_every.get() == 0 {
            self.backend.synchronize_stream(stream)?;
        }
        Ok(())
    }
}
