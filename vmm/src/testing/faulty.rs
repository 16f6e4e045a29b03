//! A backend wrapper that makes a chosen driver call fail, for testing how
//! the layers above recover, or runs a chosen action right after one, for
//! testing what another thread's calls landing there do. Works over any
//! backend.
//!
//! ```text
//! let b = Faulty::new(Host::new(cfg)?);
//! b.fail_nth(Call::Map, 3);   // the 4th map from now fails, once
//! b.interleave(Call::RecordEvent, Box::new(|| { /* other calls */ }));
//! ```

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::TestBackend;
use crate::{
    Access, AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr, Error, ErrorKind, EventStatus,
    HostCopy, MemInfo, Result,
};

/// The calls a fault can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `reserve`.
    Reserve,
    /// `free_reservation`.
    FreeReservation,
    /// `create_chunk`.
    CreateChunk,
    /// `release_chunk`.
    ReleaseChunk,
    /// `map`.
    Map,
    /// `unmap`.
    Unmap,
    /// `set_access`.
    SetAccess,
    /// `export_chunk`.
    ExportChunk,
    /// `import_chunk`.
    ImportChunk,
    /// `create_event`.
    CreateEvent,
    /// `record_event`.
    RecordEvent,
    /// `stream_wait_event`.
    StreamWaitEvent,
    /// `alloc_host`.
    AllocHost,
    /// `copy_device_to_host`.
    CopyDeviceToHost,
    /// `copy_host_to_device`.
    CopyHostToDevice,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Reserve => "reserve",
            Call::FreeReservation => "free_reservation",
            Call::CreateChunk => "create_chunk",
            Call::ReleaseChunk => "release_chunk",
            Call::Map => "map",
            Call::Unmap => "unmap",
            Call::SetAccess => "set_access",
            Call::ExportChunk => "export_chunk",
            Call::ImportChunk => "import_chunk",
            Call::CreateEvent => "create_event",
            Call::RecordEvent => "record_event",
            Call::StreamWaitEvent => "stream_wait_event",
            Call::AllocHost => "alloc_host",
            Call::CopyDeviceToHost => "copy_device_to_host",
            Call::CopyHostToDevice => "copy_host_to_device",
        }
    }
}

/// A backend that passes every call to `inner`, except one armed call,
/// which fails (after letting a chosen number through): for testing that
/// callers recover from a driver failure at any call site.
pub struct Faulty<B: Backend> {
    inner: Arc<B>,
    /// The calls to fail, each with how many more of it to let through
    /// first.
    armed: Mutex<Vec<(Call, u64)>>,
    /// Actions to run once, each right after the next call of its kind.
    interleaved: Mutex<Vec<(Call, Interleaved)>>,
}

/// An action [`Faulty::interleave`] runs inside a call.
pub type Interleaved = Box<dyn FnOnce() + Send>;

impl<B: Backend> Faulty<B> {
    /// Wraps `inner`, with nothing armed.
    pub fn new(inner: Arc<B>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            armed: Mutex::new(Vec::new()),
            interleaved: Mutex::new(Vec::new()),
        })
    }

    /// The `n`-th call of `call` from now (0: the next one) fails, once;
    /// replaces whatever was armed.
    pub fn fail_nth(&self, call: Call, n: u64) {
        *self.armed.lock().unwrap_or_else(|p| p.into_inner()) = vec![(call, n)];
    }

    /// As [`Faulty::fail_nth`], beside what is armed already: for a
    /// failure during the recovery from another.
    pub fn also_fail_nth(&self, call: Call, n: u64) {
        self.armed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((call, n));
    }

    /// Cancels the armed faults; returns whether they had all fired.
    pub fn disarm(&self) -> bool {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        let all_fired = armed.is_empty();
        armed.clear();
        all_fired
    }

    /// Runs `action` once, right after the next call of `call` (but the
    /// pipelined copies) has reached the inner backend, before it returns
    /// to its caller: as if another thread's calls landed between that
    /// driver call and what its caller does next.
    pub fn interleave(&self, call: Call, action: Interleaved) {
        self.interleaved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((call, action));
    }

    /// A call that fails if armed to, else reaches the inner backend (`f`)
    /// and then runs what is interleaved after it.
    fn pass<T>(&self, call: Call, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.enter(call)?;
        let result = f();
        let action = {
            let mut interleaved = self.interleaved.lock().unwrap_or_else(|p| p.into_inner());
            let i = interleaved.iter().position(|(c, _)| *c == call);
            i.map(|i| interleaved.remove(i).1)
        };
        if let Some(action) = action {
            action();
        }
        result
    }

    fn enter(&self, call: Call) -> Result<()> {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        let mut fire = false;
        armed.retain_mut(|(c, n)| {
            if *c != call {
                return true;
            }
            if *n == 0 {
                fire = true;
                return false;
            }
            *n -= 1;
            true
        });
        if fire {
            Err(Error::rejected(
                call.name(),
                ErrorKind::Other,
                "injected fault",
            ))
        } else {
            Ok(())
        }
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Stream = B::Stream;
    type Event = B::Event;
    type HostBuffer = B::HostBuffer;

    fn alloc_host(&self, size: usize) -> Result<B::HostBuffer> {
        self.pass(Call::AllocHost, || self.inner.alloc_host(size))
    }
    fn copy_device_to_host(
        &self,
        stream: &B::Stream,
        ranges: &[HostCopy],
        dst: &mut B::HostBuffer,
    ) -> Result<()> {
        self.pass(Call::CopyDeviceToHost, || {
            self.inner.copy_device_to_host(stream, ranges, dst)
        })
    }
    fn copy_host_to_device(
        &self,
        stream: &B::Stream,
        src: &B::HostBuffer,
        ranges: &[HostCopy],
    ) -> Result<()> {
        self.pass(Call::CopyHostToDevice, || {
            self.inner.copy_host_to_device(stream, src, ranges)
        })
    }
    /// Each batch counts as a call of [`Call::CopyDeviceToHost`]: a fault
    /// at batch `i > 0` comes after `done(i - 1)`, as if batch `i`'s copy
    /// failed.
    fn copy_device_to_host_pipelined(
        &self,
        stream: &B::Stream,
        batches: &[Vec<HostCopy>],
        dst: &mut B::HostBuffer,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        if batches.is_empty() {
            return Ok(());
        }
        self.enter(Call::CopyDeviceToHost)?;
        let n = batches.len();
        self.inner
            .copy_device_to_host_pipelined(stream, batches, dst, &mut |i| {
                done(i)?;
                if i + 1 < n {
                    self.enter(Call::CopyDeviceToHost)?;
                }
                Ok(())
            })
    }
    /// Each batch counts as a call of [`Call::CopyHostToDevice`], failing
    /// after its `ready`, before its copies are queued.
    fn copy_host_to_device_pipelined(
        &self,
        stream: &B::Stream,
        src: &B::HostBuffer,
        batches: &[Vec<HostCopy>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        self.inner
            .copy_host_to_device_pipelined(stream, src, batches, &mut |i| {
                ready(i)?;
                self.enter(Call::CopyHostToDevice)
            })
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn device_count(&self) -> Result<u32> {
        self.inner.device_count()
    }
    fn granularity(&self, device: DeviceId) -> Result<usize> {
        self.inner.granularity(device)
    }
    fn device_uuid(&self, device: DeviceId) -> Result<[u8; 16]> {
        self.inner.device_uuid(device)
    }
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }
    fn reserve(&self, size: usize, alignment: usize) -> Result<DevicePtr> {
        self.pass(Call::Reserve, || self.inner.reserve(size, alignment))
    }
    fn free_reservation(&self, base: DevicePtr, size: usize) -> Result<()> {
        self.pass(Call::FreeReservation, || {
            self.inner.free_reservation(base, size)
        })
    }
    fn create_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.pass(Call::CreateChunk, || self.inner.create_chunk(device, size))
    }
    fn release_chunk(&self, chunk: ChunkHandle) -> Result<()> {
        self.pass(Call::ReleaseChunk, || self.inner.release_chunk(chunk))
    }
    fn map(&self, va: DevicePtr, chunk: ChunkHandle) -> Result<()> {
        self.pass(Call::Map, || self.inner.map(va, chunk))
    }
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.pass(Call::Unmap, || self.inner.unmap(va, size))
    }
    fn set_access(&self, va: DevicePtr, size: usize, access: &[AccessDesc]) -> Result<()> {
        self.pass(Call::SetAccess, || self.inner.set_access(va, size, access))
    }
    fn get_access(&self, va: DevicePtr, device: DeviceId) -> Result<Access> {
        self.inner.get_access(va, device)
    }
    /// Fails as [`Call::CreateChunk`]: it is the same driver call.
    fn create_shareable_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.pass(Call::CreateChunk, || {
            self.inner.create_shareable_chunk(device, size)
        })
    }
    fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd> {
        self.pass(Call::ExportChunk, || self.inner.export_chunk(chunk))
    }
    fn import_chunk(
        &self,
        fd: BorrowedFd<'_>,
        device: DeviceId,
        size: usize,
    ) -> Result<ChunkHandle> {
        self.pass(Call::ImportChunk, || {
            self.inner.import_chunk(fd, device, size)
        })
    }
    fn create_stream(&self, device: DeviceId) -> Result<B::Stream> {
        self.inner.create_stream(device)
    }
    unsafe fn borrow_stream(&self, device: DeviceId, handle: usize) -> Result<B::Stream> {
        // SAFETY: the caller upholds the trait's contract, which is the
        // inner backend's.
        unsafe { self.inner.borrow_stream(device, handle) }
    }
    fn synchronize_stream(&self, stream: &B::Stream) -> Result<()> {
        self.inner.synchronize_stream(stream)
    }
    fn stream_capturing(&self, stream: &B::Stream) -> Result<bool> {
        self.inner.stream_capturing(stream)
    }
    fn create_event(&self, device: DeviceId) -> Result<B::Event> {
        self.pass(Call::CreateEvent, || self.inner.create_event(device))
    }
    fn record_event(&self, event: &B::Event, stream: &B::Stream) -> Result<()> {
        self.pass(Call::RecordEvent, || self.inner.record_event(event, stream))
    }
    fn query_event(&self, event: &B::Event) -> Result<EventStatus> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: &B::Event) -> Result<()> {
        self.inner.synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: &B::Stream, event: &B::Event) -> Result<()> {
        self.pass(Call::StreamWaitEvent, || {
            self.inner.stream_wait_event(stream, event)
        })
    }
}

/// Test work passes through: no fault is injected into it.
impl<B: TestBackend> TestBackend for Faulty<B> {
    fn fill_u32(&self, stream: &B::Stream, dst: DevicePtr, count: usize, value: u32) -> Result<()> {
        self.inner.fill_u32(stream, dst, count, value)
    }
    fn copy_to_host(&self, stream: &B::Stream, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        self.inner.copy_to_host(stream, src, dst)
    }
    fn begin_capture(&self, stream: &B::Stream) -> Result<()> {
        self.inner.begin_capture(stream)
    }
    fn end_capture(&self, stream: &B::Stream) -> Result<()> {
        self.inner.end_capture(stream)
    }
    fn delay(&self, stream: &B::Stream, duration: Duration) -> Result<()> {
        self.inner.delay(stream, duration)
    }
}
