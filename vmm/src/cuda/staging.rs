//! Copies between device memory and page-locked host memory on CUDA: what
//! a pool that sleeps uses to keep its bytes (see
//! [`Backend::copy_device_to_host`]).

use std::ffi::c_void;
use std::ptr::NonNull;

use std::sync::Arc;

use super::{result, sys, Cuda, CudaEvent, CudaStream};
use crate::error::report_drop_error;
use crate::{HostBuffer, HostCopy, Result};

/// Page-locked host memory (`cuMemHostAlloc`), freed when dropped.
#[derive(Debug)]
pub struct CudaHostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone; the
// driver touches it only during a copy, which the methods below complete
// before they return.
unsafe impl Send for CudaHostBuffer {}
// SAFETY: as above; shared references only read it.
unsafe impl Sync for CudaHostBuffer {}

impl HostBuffer for CudaHostBuffer {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised bytes (zeroed at
        // allocation) for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only
        // reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for CudaHostBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: `ptr` came from `mem_host_alloc` and is freed only here;
        // every copy that used it completed before its call returned.
        if let Err(err) = unsafe { mem_free_host(self.ptr.as_ptr().cast::<c_void>()) } {
            report_drop_error("freeing page-locked host memory", &err);
        }
    }
}

impl Cuda {
    pub(super) fn host_buffer(&self, size: usize) -> Result<CudaHostBuffer> {
        if size == 0 {
            return Ok(CudaHostBuffer {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let context = self.device("alloc_host", crate::DeviceId(0))?;
        let _bound = context.bind()?;
        let started = std::time::Instant::now();
        let raw = mem_host_alloc(size)?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            crate::Error::invalid("cuMemHostAlloc", "the driver returned a null pointer")
        })?;
        let pinned = started.elapsed();
        // SAFETY: the driver gave `size` writable bytes at `ptr`; zeroing
        // them makes every byte initialised before a slice is made of them.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        tracing::debug!(size, ?pinned, zeroed = ?(started.elapsed() - pinned), "page-locked host memory");
        Ok(CudaHostBuffer { ptr, len: size })
    }

    pub(super) fn copy_out(
        &self,
        stream: &CudaStream,
        ranges: &[HostCopy],
        dst: &mut CudaHostBuffer,
    ) -> Result<()> {
        let _bound = stream.context.bind()?;
        let queued = self.queue_out(stream, ranges, dst);
        finish(stream, queued)
    }

    pub(super) fn copy_in(
        &self,
        stream: &CudaStream,
        src: &CudaHostBuffer,
        ranges: &[HostCopy],
    ) -> Result<()> {
        let _bound = stream.context.bind()?;
        let queued = self.queue_in(stream, src, ranges);
        finish(stream, queued)
    }

    /// See [`crate::Backend::copy_device_to_host_pipelined`]: every batch
    /// is queued at once, each followed by an event; then each event is
    /// awaited in turn and `done` called for its batch, so that the copy
    /// engine never waits for `done`. On the H200, releasing a 2 MiB chunk
    /// takes 30-60 us while a copy runs, often longer than copying its
    /// bytes (38 us), and a window of four batches left the copy waiting
    /// for the releases (Note [Sleep and wake] in docs/DESIGN.md).
    pub(super) fn copy_out_pipelined(
        &self,
        stream: &CudaStream,
        batches: &[Vec<HostCopy>],
        dst: &mut CudaHostBuffer,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let _bound = stream.context.bind()?;
        let mut events = Vec::with_capacity(batches.len());
        for _ in batches {
            let event = result::event_create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
            events.push(CudaEvent {
                event,
                context: Arc::clone(&stream.context),
            });
        }
        let mut run = || -> Result<()> {
            for (batch, event) in batches.iter().zip(&events) {
                self.queue_out(stream, batch, dst)?;
                // SAFETY: the event and the stream are live, of one context.
                unsafe { result::event_record(event.event, stream.stream) }?;
            }
            for (i, event) in events.iter().enumerate() {
                // SAFETY: a `CudaEvent` holds a live event until dropped.
                unsafe { result::event_synchronize(event.event) }?;
                done(i)?;
            }
            Ok(())
        };
        let ran = run();
        finish(stream, ran)
    }

    /// See [`crate::Backend::copy_host_to_device_pipelined`].
    pub(super) fn copy_in_pipelined(
        &self,
        stream: &CudaStream,
        src: &CudaHostBuffer,
        batches: &[Vec<HostCopy>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let _bound = stream.context.bind()?;
        let mut run = || -> Result<()> {
            for (i, batch) in batches.iter().enumerate() {
                ready(i)?;
                self.queue_in(stream, src, batch)?;
            }
            Ok(())
        };
        let ran = run();
        finish(stream, ran)
    }

    /// Queues one copy per range out of device memory into `dst`, without
    /// waiting: the caller synchronises the stream before it returns (and
    /// before `dst` is touched again), whatever happens.
    fn queue_out(
        &self,
        stream: &CudaStream,
        ranges: &[HostCopy],
        dst: &mut CudaHostBuffer,
    ) -> Result<()> {
        let base = dst.as_mut_slice();
        for r in ranges.iter().filter(|r| r.len > 0) {
            let _mapped = self.mapped("copy_device_to_host", r.device, r.len)?;
            let out = &mut base[r.host_offset..r.host_offset + r.len];
            // SAFETY: the stream is live until dropped; the source lies in
            // vmm's mappings and the caller keeps it mapped until the copy
            // has run; `dst` is borrowed mutably by the caller until it has
            // synchronised the stream, which completes the copy.
            unsafe { result::memcpy_dtoh_async(out, r.device.0, stream.stream) }?;
        }
        Ok(())
    }

    /// Queues one copy per range from `src` into device memory, without
    /// waiting, as [`Cuda::queue_out`].
    fn queue_in(
        &self,
        stream: &CudaStream,
        src: &CudaHostBuffer,
        ranges: &[HostCopy],
    ) -> Result<()> {
        let base = src.as_slice();
        for r in ranges.iter().filter(|r| r.len > 0) {
            let _mapped = self.mapped("copy_host_to_device", r.device, r.len)?;
            let from = &base[r.host_offset..r.host_offset + r.len];
            // SAFETY: as in `queue_out`, with `src` borrowed by the caller
            // until it has synchronised the stream, and the destination in
            // vmm's mappings.
            unsafe { memcpy_htod_async(r.device.0, from, stream.stream) }?;
        }
        Ok(())
    }
}

/// Waits for everything queued on `stream`, also after a failure (so that
/// no copy still reads or writes a host buffer the caller gets back), and
/// returns the first error.
fn finish(stream: &CudaStream, queued: Result<()>) -> Result<()> {
    // SAFETY: a `CudaStream` holds a live stream until it is dropped.
    let synced = unsafe { result::stream_synchronize(stream.stream) };
    queued.and(synced)
}

// ---- the driver calls only copies through host memory make ----------------

/// `CU_MEMHOSTALLOC_PORTABLE`: page-locked for every context, not only the
/// current one.
const CU_MEMHOSTALLOC_PORTABLE: std::ffi::c_uint = 0x01;

/// `cuMemcpyHtoDAsync_v2`: queues a copy of `src.len()` bytes to `dst`.
///
/// # Safety
/// 1. `stream` is a live stream from [`result::stream_create`].
/// 2. `[dst, dst + src.len())` lies in mappings the caller made with
///    [`result::mem_map`], which stay mapped until the copy has run.
/// 3. `src` is neither written nor freed until the stream has finished the
///    copy (the caller synchronises before it returns).
unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: &[u8],
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: `src` is valid for reads of `src.len()` bytes; the caller
    // upholds 1 to 3, so it stays so until the copy is done.
    result::check("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream)
    })
}

/// `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`: `size` bytes of
/// page-locked host memory that every context may copy to and from.
fn mem_host_alloc(size: usize) -> Result<*mut c_void> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: `ptr` is a valid place for the result; the driver checks the
    // size and flags.
    result::check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut ptr, size, CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(ptr)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from [`mem_host_alloc`], is freed once, and no copy that
/// uses it is still queued.
unsafe fn mem_free_host(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller upholds the contract above.
    result::check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr) })
}
