//! A pool's stream-ordered frees on their way back to its heap: merged
//! at a stream's miss under its guards, released once an event or a
//! synchronization shows the stream has passed them, or waited for (Note
//! [Stream-ordered frees] and Note [Guards and aliases] in
//! docs/DESIGN.md).

use std::sync::Arc;

use vmm::Backend;

use crate::ordering::{Guard, StreamPos, StreamShared};
use crate::Result;

use super::inner::Inner;

/// How many of a stream's latest small frees (small-arena blocks) stay
/// pending when a miss merges the others into the heap, or when the pool
/// learns the stream has passed them: a program that allocates small
/// blocks of a few sizes over and over (generation, a layer at a time)
/// then finds them on the same-size fast path instead of taking the lock
/// again (docs/RESULTS.md). Which stay follows the calls alone, not how
/// far the GPU has run (Note [Stream-ordered frees], "Apart from the GPU's
/// timing").
pub(super) const KEEP_SMALL: usize = 64;

impl<B: Backend> Inner<B> {
    /// Moves the pending frees of `stream` into the heap, each under a
    /// guard of the stream, all but its latest `keep` small ones (see
    /// [`Streams::merge_own_frees`]). Returns whether any stayed.
    pub(super) fn merge_own_frees(
        &mut self,
        stream: &Arc<StreamShared<B>>,
        keep: usize,
    ) -> Result<bool> {
        let Self {
            arenas,
            guards,
            streams,
            ..
        } = self;
        streams.merge_own_frees(stream, keep, |p| {
            arenas[p.arena].heap.free(p.block);
            let by = StreamPos {
                stream: stream.id,
                seq: p.seq,
            };
            guards.insert(
                p.ptr,
                Guard {
                    end: p.ptr + p.size,
                    by,
                },
            );
        })
    }

    /// Moves the pending frees whose events have completed back to the heap
    /// (opportunistic reuse). An event that reports an error fails the call.
    #[cold]
    pub(super) fn collect_completed(&mut self) -> Result<()> {
        for pos in self.streams.completed()? {
            self.release_pending(pos, KEEP_SMALL);
        }
        Ok(())
    }

    /// Frees of a stream up to a position are free for every stream: back
    /// to the heap, but for its latest `keep_small` small ones, which stay
    /// pending; their guards and aliases go. A stream left with nothing
    /// pending and no guard leaves the table.
    pub(super) fn release_pending(&mut self, passed: StreamPos, keep_small: usize) {
        let StreamPos { stream, seq: upto } = passed;
        if !self.streams.is_registered(stream) {
            return;
        }
        self.guards.release(stream, upto);
        self.space.pass_aliases(stream, upto);
        let guarded = self.guards.any_of(stream) || self.space.alias_streams().any(|s| s == stream);
        let mut released = std::mem::take(&mut self.released);
        if let Some(gone) = self
            .streams
            .release(stream, upto, keep_small, guarded, &mut released)
        {
            self.usage.used -= gone.credit;
            self.calls.allocations += gone.reuses;
            self.calls.same_stream_reuses += gone.reuses;
            self.calls.frees += gone.frees;
        }
        for p in released.drain(..) {
            self.arenas[p.arena].heap.free(p.block);
        }
        self.released = released;
    }

    /// Blocks until every stream with pending frees has run past them, and
    /// releases them all (the last resort before out-of-memory, and drop).
    /// While a graph capture is under way nothing can be waited for: then
    /// it does nothing and returns false.
    pub(super) fn wait_for_pending_frees(&mut self) -> bool {
        self.wait_for_streams(|_| true)
    }

    /// [`Self::wait_for_pending_frees`] for the streams `wanted` picks
    /// among those with pending frees.
    pub(super) fn wait_for_streams(&mut self, wanted: impl FnMut(u64) -> bool) -> bool {
        let Some(passed) = self.streams.wait_for(wanted) else {
            return false;
        };
        for pos in passed {
            self.release_pending(pos, 0);
        }
        true
    }

    /// Releases the stream-ordered frees of a stream up to a position (its
    /// work has run that far), then trims to the release threshold.
    pub(super) fn stream_passed(&mut self, passed: StreamPos) -> Result<()> {
        self.release_pending(passed, 0);
        let keep = self.release_threshold;
        self.growth().trim_to(keep)
    }
}
