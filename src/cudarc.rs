//! cudarc interop (feature `cudarc`): cudarc's copies and kernel launches
//! take a [`Buffer`] on the CUDA backend, and streams go both ways.
//!
//! - A cudarc stream becomes a vmpool stream with
//!   [`Context::adopt_cudarc_stream`]; buffers allocated on it implement
//!   cudarc's `DeviceSlice`, `DevicePtr`, `DevicePtrMut` and
//!   `PushKernelArg`, with that cudarc stream as theirs.
//! - A vmpool stream's driver handle is `stream.raw().handle()`, for
//!   `CudaContext::wrap_borrowed_stream` (unsafe on cudarc's side: the
//!   vmpool stream must outlive the wrapper).
//!
//! cudarc is a dependency without a CUDA version or linking feature: the
//! program picks those on its own cudarc dependency (cargo unifies them).
//!
//! Ordering: cudarc's `DevicePtr` contract asks the callee to make the
//! stream wait for earlier writes. A buffer's accesses are ordered by its
//! stream; for another stream, order it with an event first, as with any
//! vmpool memory.

use std::sync::Arc;

use cudarc::driver::{
    CudaStream as CudarcStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop,
};
use vmm::cuda::Cuda;

use crate::{Buffer, Context, Result, Stream};

impl Context<Cuda> {
    /// Wraps a cudarc stream as a vmpool stream of its device: vmpool
    /// orders its frees on it and keeps it alive while it uses it, and
    /// buffers allocated on it work with cudarc. Refused (an invalid
    /// argument) unless the stream lives in its device's primary context,
    /// which `cudarc::driver::CudaContext::new` uses.
    pub fn adopt_cudarc_stream(&self, stream: &Arc<CudarcStream>) -> Result<Stream<Cuda>> {
        let (device, raw) = self.backend().adopt_cudarc_stream(stream)?;
        self.adopt_stream(raw, device)
    }
}

impl<T> Buffer<T, Cuda> {
    /// The cudarc stream of the buffer's stream; `None` unless the stream
    /// was adopted from cudarc ([`Context::adopt_cudarc_stream`]).
    pub fn cudarc_stream(&self) -> Option<&Arc<CudarcStream>> {
        self.stream().raw().cudarc()
    }
}

impl<T> DeviceSlice<T> for Buffer<T, Cuda> {
    fn len(&self) -> usize {
        Buffer::len(self)
    }

    /// The cudarc stream the buffer was allocated on.
    ///
    /// # Panics
    /// When the buffer's stream was not adopted from cudarc: cudarc's trait
    /// must return one, and a stream vmpool made has none. Allocate buffers
    /// for cudarc on a stream from [`Context::adopt_cudarc_stream`].
    fn stream(&self) -> &Arc<CudarcStream> {
        match self.cudarc_stream() {
            Some(stream) => stream,
            None => panic!(
                "vmpool::Buffer used as a cudarc slice, but its stream was not adopted from \
                 cudarc (use Context::adopt_cudarc_stream)"
            ),
        }
    }
}

impl<T> DevicePtr<T> for Buffer<T, Cuda> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudarcStream) -> (u64, SyncOnDrop<'a>) {
        // Ordering is the streams' (see the module's notes): nothing to
        // record or wait for.
        (self.raw_ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Buffer<T, Cuda> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudarcStream) -> (u64, SyncOnDrop<'a>) {
        (self.raw_ptr, SyncOnDrop::Sync(None))
    }
}

// cudarc's `PushKernelArg` is an unsafe trait: an implementation must push
// a pointer to a value of the kernel parameter's type that outlives the
// launch. This one performs no unsafe operation itself: it pushes, through
// cudarc's safe `arg` for `&u64`, a reference to the buffer's address,
// borrowed for as long as the launch arguments.
#[allow(unsafe_code)]
// SAFETY: `raw_ptr` is a `u64` holding the device address, the kernel's
// pointer parameter (`CUdeviceptr`); it is borrowed for `'b`, which outlives
// the launch arguments `'a`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Buffer<T, Cuda>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b Buffer<T, Cuda>) -> &mut Self {
        self.arg(&arg.raw_ptr)
    }
}

#[allow(unsafe_code)]
// SAFETY: as for `&Buffer`; the exclusive borrow also keeps the host side
// from freeing the buffer while the arguments live.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buffer<T, Cuda>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b mut Buffer<T, Cuda>) -> &mut Self {
        self.arg(&arg.raw_ptr)
    }
}
