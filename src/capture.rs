//! CUDA graph captures under way.
//!
//! While work is captured into a graph in the driver's global mode (as
//! PyTorch's `torch.cuda.graph` does), the driver refuses, from any thread,
//! the calls that synchronise with the device (an event query, an event or
//! stream synchronisation), and a refused call spoils the capture; an event
//! recorded on the capturing stream belongs to the graph and can never be
//! queried. A pool makes such calls on its stream-ordered slow path: it
//! looks for completed frees with event queries, and records events to make
//! one stream wait for another's frees.
//!
//! So a capture is announced ([`crate::Context::graph_capture`]), and while
//! one is, no pool of that context records, queries or waits for an event
//! or synchronises a stream. Stream-ordered allocations go on: a stream
//! reuses its own frees, and grows where it would have waited for another
//! stream's. Growing (creating, mapping, giving access, unmapping chunks)
//! is allowed during a capture. [`crate::GraphPools`] announces a capture
//! while its graph pool is open, as PyTorch brackets each capture with its
//! graph-pool hooks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A context's announced captures not yet ended, shared with its pools.
#[derive(Debug, Default)]
pub(crate) struct Captures(AtomicUsize);

impl Captures {
    pub(crate) fn under_way(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// A CUDA graph capture under way, from [`crate::Context::graph_capture`]
/// until dropped (see the module's notes).
#[must_use = "the capture counts as under way only while this lives"]
#[derive(Debug)]
pub struct GraphCapture(Arc<Captures>);

impl GraphCapture {
    pub(crate) fn begin(captures: &Arc<Captures>) -> Self {
        captures.0.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(captures))
    }
}

impl Drop for GraphCapture {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}
