//! The one trait the allocator programs against.
//!
//! A backend is a driver for one or more devices. Memory is named by plain
//! values (addresses and chunk handles) that the backend validates on every
//! call, so a wrong call is an error and never undefined behaviour on the
//! host. The RAII owners in [`crate::memory`] are how the allocator uses
//! this trait; the raw methods are public so that the conformance suite can
//! exercise every error path.
//!
//! Streams and events are owned values: dropping a stream lets its queued
//! work finish and then frees it (as `cuStreamDestroy` does), dropping an
//! event frees it.
//!
//! Adding a backend means one new folder beside `cuda/` and `host/` that
//! implements this trait (and `testing::TestBackend`, for the test suites);
//! nothing else changes.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::{
    Access, AccessDesc, ChunkHandle, DeviceId, DevicePtr, EventStatus, HostBuffer, HostCopy,
    MemInfo, Result,
};

/// The driver layer's model, implemented by the CUDA driver and by the
/// host backend: devices, virtual address ranges, physical chunks and
/// their mappings, access, chunk sharing, streams and events. Every
/// method checks its arguments against the backend's own tables first.
pub trait Backend: Send + Sync + 'static {
    /// An ordered queue of device work.
    type Stream: Send + Sync;
    /// A point in a stream that other streams and the host can wait for.
    type Event: Send + Sync;
    /// Host memory for copies to and from the device ([`Backend::alloc_host`]).
    type HostBuffer: HostBuffer;

    /// `"cuda"` or `"host"`: shown to users, so they know what they measured.
    fn name(&self) -> &'static str;

    // ---- devices ---------------------------------------------------------

    /// The number of devices this backend sees.
    fn device_count(&self) -> Result<u32>;
    /// The size and alignment unit of chunks and mappings (2 MiB on H200).
    fn granularity(&self, device: DeviceId) -> Result<usize>;
    /// The device's UUID (`cuDeviceGetUuid_v2`): the same physical device
    /// has the same UUID in every process, whatever ordinal
    /// `CUDA_VISIBLE_DEVICES` gives it there.
    fn device_uuid(&self, device: DeviceId) -> Result<[u8; 16]>;
    /// The device's free and total memory (`cuMemGetInfo`).
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo>;

    // ---- virtual address space -------------------------------------------

    /// Reserves `size` bytes of address space (a multiple of the
    /// granularity) aligned to `alignment` (0: the granularity).
    fn reserve(&self, size: usize, alignment: usize) -> Result<DevicePtr>;
    /// Frees a whole reservation, which must no longer have anything mapped.
    fn free_reservation(&self, base: DevicePtr, size: usize) -> Result<()>;

    // ---- physical memory -------------------------------------------------

    /// Creates a physical chunk of `size` bytes (a multiple of the
    /// granularity) on `device`.
    fn create_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle>;
    /// Releases the handle. Memory still mapped stays valid until unmapped,
    /// as with `cuMemRelease`.
    fn release_chunk(&self, chunk: ChunkHandle) -> Result<()>;

    // ---- mappings --------------------------------------------------------

    /// Maps the whole of `chunk` at `va`, a multiple of the granularity. The
    /// range must lie inside one reservation and not be mapped already. The
    /// new mapping has no access until [`Backend::set_access`].
    ///
    /// Whole chunks only: `cuMemMap` takes an offset and a size, but the
    /// driver (CUDA 13.0 on H200 included) answers `CUDA_ERROR_NOT_SUPPORTED`
    /// to anything but offset 0 and the chunk's full size, so a chunk is the
    /// unit in which physical memory moves.
    fn map(&self, va: DevicePtr, chunk: ChunkHandle) -> Result<()>;
    /// Unmaps a range made of whole mappings. Not stream-ordered: the caller
    /// guarantees no queued work still touches it.
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()>;
    /// Sets what each listed device may do with a mapped range.
    fn set_access(&self, va: DevicePtr, size: usize, access: &[AccessDesc]) -> Result<()>;
    /// What `device` may do with the mapped byte at `va` (`cuMemGetAccess`):
    /// the driver's own record, for checking what the allocator set.
    fn get_access(&self, va: DevicePtr, device: DeviceId) -> Result<Access>;

    // ---- sharing physical memory with other processes --------------------

    /// As [`Backend::create_chunk`], for a chunk that can also be exported
    /// as a POSIX file descriptor (`cuMemCreate` with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested).
    fn create_shareable_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle>;
    /// A new descriptor for a shareable chunk, to hand to another process
    /// (`cuMemExportToShareableHandle`). A chunk not created shareable is an
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument).
    fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd>;
    /// Imports a chunk that another process exported
    /// (`cuMemImportFromShareableHandle`): a handle of this backend, mapped
    /// and released like any other. `device` and `size` are what the exporter
    /// says the chunk is. The caller keeps `fd`. A descriptor that is not an
    /// exported chunk is an error, never memory of the wrong size.
    fn import_chunk(
        &self,
        fd: BorrowedFd<'_>,
        device: DeviceId,
        size: usize,
    ) -> Result<ChunkHandle>;

    // ---- streams and events ----------------------------------------------

    /// A new stream on `device`, owned by the returned value (destroyed when
    /// it is dropped, after its queued work).
    fn create_stream(&self, device: DeviceId) -> Result<Self::Stream>;
    /// A stream made by someone else, for vmpool to order its work on:
    /// the runtime API's default stream, a library's stream. Dropping the
    /// returned value leaves the stream alone. The host backend has no
    /// foreign streams: it returns a new stream of its own standing in for
    /// `handle`, so a caller keeps one per handle.
    ///
    /// # Safety
    /// On the CUDA backend `handle` is a `CUstream` of `device`'s primary
    /// context (0 or `CU_STREAM_LEGACY` for the legacy default stream; the
    /// per-thread default stream is refused, as it names a different stream
    /// on each thread) that stays alive while the returned value is used.
    unsafe fn borrow_stream(&self, device: DeviceId, handle: usize) -> Result<Self::Stream>;
    /// Blocks until all work queued on `stream` so far has finished; reports
    /// a failure of that work.
    fn synchronize_stream(&self, stream: &Self::Stream) -> Result<()>;
    /// Whether work queued on `stream` is being captured into a CUDA graph
    /// (`cuStreamBeginCapture` .. `cuStreamEndCapture`). While it is, the
    /// driver refuses a wait on an event recorded outside the capture, and
    /// an event recorded on it cannot be queried or waited for from outside
    /// the capture, even after it ends (until it is recorded again).
    fn stream_capturing(&self, stream: &Self::Stream) -> Result<bool>;
    /// A new event on `device` (no timing), owned by the returned value.
    fn create_event(&self, device: DeviceId) -> Result<Self::Event>;
    /// Captures the work queued on `stream` so far into `event`, replacing
    /// what it captured before.
    fn record_event(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// `Complete` once the last recorded work has finished (also for an
    /// event never recorded), `Pending` before, `Err` if that work failed.
    fn query_event(&self, event: &Self::Event) -> Result<EventStatus>;
    /// Blocks until the last recorded work has finished.
    fn synchronize_event(&self, event: &Self::Event) -> Result<()>;
    /// Work queued on `stream` after this call waits for the work `event`
    /// captured at the time of this call.
    fn stream_wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    // ---- copies through host memory ----------------------------------------

    /// `size` bytes of host memory that device copies read and write at
    /// full speed (`cuMemHostAlloc`: page-locked), zeroed on the host
    /// backend.
    fn alloc_host(&self, size: usize) -> Result<Self::HostBuffer>;
    /// Copies each range of device memory into `dst` at its host offset,
    /// after the work queued on `stream` so far, and returns once every copy
    /// has completed (one `cuMemcpyDtoHAsync` a range, then one stream
    /// synchronisation). The device ranges must be mapped with read access
    /// for the stream's device; a range outside `dst` is an error before
    /// anything is copied.
    fn copy_device_to_host(
        &self,
        stream: &Self::Stream,
        ranges: &[HostCopy],
        dst: &mut Self::HostBuffer,
    ) -> Result<()>;
    /// Copies each range from `src` at its host offset into device memory,
    /// after the work queued on `stream` so far, and returns once every copy
    /// has completed. The device ranges must be mapped read-write for the
    /// stream's device.
    fn copy_host_to_device(
        &self,
        stream: &Self::Stream,
        src: &Self::HostBuffer,
        ranges: &[HostCopy],
    ) -> Result<()>;

    /// [`Backend::copy_device_to_host`] in batches, for a caller that frees
    /// the device memory of each batch as soon as it is copied: queues the
    /// batches in order after the work queued on `stream` so far (a few
    /// ahead of the one awaited), and once batch `i`'s copies have all
    /// completed calls `done(i)`, while the later batches' copies run.
    /// `done` may unmap batch `i`'s device ranges, never a later batch's.
    /// Every range is checked against `dst` before anything is queued. On
    /// any failure (a copy, a wait, or `done` returning an error) no later
    /// `done` is called; the error is returned once nothing queued is still
    /// running. The CUDA backend overlaps `done` with the copies (an event
    /// after each batch); the default runs batch after batch.
    fn copy_device_to_host_pipelined(
        &self,
        stream: &Self::Stream,
        batches: &[Vec<HostCopy>],
        dst: &mut Self::HostBuffer,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        check_host_ranges("copy_device_to_host", batches.iter().flatten(), dst.len())?;
        for (i, batch) in batches.iter().enumerate() {
            self.copy_device_to_host(stream, batch, dst)?;
            done(i)?;
        }
        Ok(())
    }

    /// [`Backend::copy_host_to_device`] in batches, for a caller that maps
    /// the device memory of each batch just before it is copied: for each
    /// batch in order, calls `ready(i)` (which maps batch `i`'s device
    /// ranges), then queues its copies on `stream` without waiting, so that
    /// `ready(i + 1)` runs while batch `i` is copied. Returns once every
    /// copy has completed. Every range is checked against `src` first. On
    /// any failure (`ready` returning an error, a copy) nothing more is
    /// queued, and the error is returned once what was queued has run.
    fn copy_host_to_device_pipelined(
        &self,
        stream: &Self::Stream,
        src: &Self::HostBuffer,
        batches: &[Vec<HostCopy>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        check_host_ranges("copy_host_to_device", batches.iter().flatten(), src.len())?;
        for (i, batch) in batches.iter().enumerate() {
            ready(i)?;
            self.copy_host_to_device(stream, src, batch)?;
        }
        Ok(())
    }
}

/// Checks that every range lies inside a host buffer of `len` bytes.
pub(crate) fn check_host_ranges<'a>(
    call: &'static str,
    ranges: impl IntoIterator<Item = &'a HostCopy>,
    len: usize,
) -> Result<()> {
    for r in ranges {
        if r.host_offset.checked_add(r.len).is_none_or(|end| end > len) {
            return Err(crate::Error::invalid(
                call,
                format!(
                    "{} bytes at offset {} do not fit a host buffer of {len} bytes",
                    r.len, r.host_offset
                ),
            ));
        }
    }
    Ok(())
}
