//! What tests, examples and the soak need from a backend beyond what the
//! allocator does (the `testing` feature).
//!
//! [`TestBackend`] queues work on a stream: writes to check data with,
//! copies back to the host, delays that hold a stream busy so that the
//! allocator's stream ordering shows, and graph captures. [`faulty`] wraps
//! any backend to make a chosen driver call fail; [`lag`] keeps a stream
//! behind the calls that allocate on it, as a GPU does.
//!
//! Each backend implements [`TestBackend`] in a `testing.rs` of its own
//! folder, beside its [`Backend`] implementation.

pub mod faulty;
pub mod lag;

use std::time::Duration;

use crate::{Backend, DevicePtr, Result};

/// A [`Backend`] that can queue work of its own on its streams.
pub trait TestBackend: Backend {
    /// Queues a write of `count` copies of `value` (4 bytes each) at `dst`.
    fn fill_u32(
        &self,
        stream: &Self::Stream,
        dst: DevicePtr,
        count: usize,
        value: u32,
    ) -> Result<()>;
    /// Copies `dst.len()` bytes from `src` after the work queued on `stream`,
    /// and returns once they are in `dst`.
    fn copy_to_host(&self, stream: &Self::Stream, src: DevicePtr, dst: &mut [u8]) -> Result<()>;
    /// Queues work that keeps `stream` busy for `duration`. (The CUDA
    /// backend compiles its spin kernel on the first call.)
    fn delay(&self, stream: &Self::Stream, duration: Duration) -> Result<()>;
    /// Starts capturing `stream`'s work into a graph, as PyTorch's
    /// `torch.cuda.graph` does (global mode): see
    /// [`Backend::stream_capturing`] for what the driver then refuses.
    /// The host backend captures nothing, but refuses the same calls, and
    /// work or a synchronisation on the capturing stream.
    fn begin_capture(&self, stream: &Self::Stream) -> Result<()>;
    /// Ends the capture `begin_capture` started on this thread and drops
    /// the graph. An error if the capture was invalidated (on CUDA, by a
    /// refused call on the capturing thread, or in global mode on any).
    fn end_capture(&self, stream: &Self::Stream) -> Result<()>;
}
