//! The CUDA backend: the driver API's virtual-memory calls, streams and
//! events.
//!
//! ```text
//!   Cuda (this file)        the Backend: checks every call against its own
//!      │                    tables, binds contexts, owns streams and events
//!   context.rs              a device's primary context
//!   peers.rs                CUDA's own allocators, to benchmark against
//!   testing.rs              test work (feature `testing`): fills, copies,
//!      │                    a delay kernel, graph captures
//!   result.rs               one checked function per driver call:
//!      │                    CUresult -> crate::Result, `# Safety` on each
//!   sys.rs                  the types of `cuda.h` used, and the entry
//!                           points, resolved from libcuda.so.1 by dlopen
//! ```
//!
//! **Dynamic loading.** Nothing links against libcuda: [`Cuda::new`] opens
//! it and resolves every entry point vmm uses, once per process. vmm
//! therefore builds, and its host backend runs, on machines with no driver
//! at all (CI, laptops), and [`Cuda::new`] says
//! [`ErrorKind::DriverUnavailable`] there instead of the process failing to
//! start. Loading the driver itself, rather than through a binding crate,
//! leaves the CUDA version and the linking mode of any binding crate beside
//! vmm (cudarc's features) to the program.
//!
//! **Contexts.** [`Cuda::new`] retains every device's primary context (the
//! one the runtime API and most libraries share) and keeps it until the
//! backend and all of its streams and events are gone. Driver calls that need
//! a current context first bind the device's primary context to the calling
//! thread, unless `cuCtxGetCurrent` says it is current already, and put back
//! the thread's previous context afterwards: vmm runs inside programs that
//! bind contexts of their own (PyTorch binds the current device's), and
//! leaves every thread as it found it. Calls that name no device (address
//! ranges, unmap, set-access) bind device 0's; stream and event calls bind
//! the context their stream or event was made in.
//!
//! **Borrowed streams.** [`Backend::borrow_stream`] wraps a stream someone
//! else made (the legacy default stream, PyTorch's streams) without owning
//! it: vmm orders its work on it and never destroys it.
//!
//! **Validation.** As in the host backend, every address range, chunk handle
//! and mapping is checked against the backend's own tables before the driver
//! sees it: a wrong call is [`ErrorKind::InvalidArgument`], and the driver is
//! never asked to unmap, free or write memory that is not vmm's (under
//! unified addressing a stray device address can name host memory).
//! Validation and the driver call happen under one lock, so two threads
//! cannot race a check against a release.
//!
//! **Sharing.** Shareable chunks are created with the POSIX-descriptor
//! handle type and exported with `cuMemExportToShareableHandle`; an import
//! (`cuMemImportFromShareableHandle`) enters the tables like a created
//! chunk. If the driver answers an import with a handle vmm already holds
//! (memory of this very process), the import is refused rather than have
//! two owners release one handle. The driver does not say an imported
//! allocation's size; a wrong one fails at `cuMemMap`.

mod context;
#[cfg(feature = "cudarc")]
mod interop;
pub mod peers;
mod result;
mod staging;
mod sys;
#[cfg(feature = "testing")]
mod testing;

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use self::context::DeviceContext;
pub use self::staging::CudaHostBuffer;
use crate::backend::check_host_ranges;
use crate::error::report_drop_error;
use crate::ranges::Ranges;
use crate::{
    Access, AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr, Error, ErrorKind, EventStatus,
    HostBuffer, HostCopy, MemInfo, Result,
};

/// The CUDA driver as a [`Backend`].
#[derive(Debug)]
pub struct Cuda {
    /// Indexed by device ordinal; never empty.
    devices: Vec<Arc<DeviceContext>>,
    tables: Mutex<Tables>,
}

#[derive(Debug, Clone, Copy)]
struct ChunkEntry {
    device: DeviceId,
    size: usize,
    /// Created with a POSIX-descriptor handle type, or imported: exportable.
    shareable: bool,
}

/// What vmm created and has not freed yet.
#[derive(Debug, Default)]
struct Tables {
    reservations: Ranges<()>,
    mappings: Ranges<()>,
    /// Live (not yet released) chunk handles.
    chunks: HashMap<u64, ChunkEntry>,
}

impl Tables {
    /// The starts of the mappings that make up exactly `[start, start +
    /// size)`, inside one reservation; `None` unless it is such a run.
    fn whole_mappings(&self, start: u64, size: usize) -> Option<Vec<u64>> {
        self.reservations.containing(start, size)?;
        self.mappings.whole_run(start, size)
    }
}

/// `va` as a number, after checking that `[va, va + size)` is not empty and
/// does not wrap around the address space.
fn start_of(call: &'static str, va: DevicePtr, size: usize) -> Result<u64> {
    if size == 0 {
        return Err(Error::invalid(call, "size is zero"));
    }
    match va.0.checked_add(size as u64) {
        Some(_) => Ok(va.0),
        None => Err(Error::invalid(
            call,
            format!("{size} bytes at {va} wrap around"),
        )),
    }
}

/// Checks that the value called `name` is a multiple of `granularity`.
fn check_granular(call: &'static str, granularity: usize, name: &str, value: u64) -> Result<()> {
    if value % granularity as u64 == 0 {
        return Ok(());
    }
    Err(Error::invalid(
        call,
        format!("{name} {value:#x} is not a multiple of the granularity {granularity:#x}"),
    ))
}

/// Checks that `size` is a non-zero multiple of `granularity`.
fn check_size(call: &'static str, granularity: usize, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid(call, "size is zero"));
    }
    check_granular(call, granularity, "size", size as u64)
}

impl Cuda {
    /// Loads and initialises the driver and retains every device's primary
    /// context. Fails with [`ErrorKind::DriverUnavailable`] when there is no
    /// driver library, it cannot be initialised, or it sees no device.
    pub fn new() -> Result<Arc<Self>> {
        if let Err(why) = sys::load() {
            return Err(Error::rejected(
                "Cuda::new",
                ErrorKind::DriverUnavailable,
                why,
            ));
        }
        result::init().map_err(driver_unavailable)?;
        let count = result::device_get_count().map_err(driver_unavailable)?;
        if count <= 0 {
            return Err(Error::rejected(
                "Cuda::new",
                ErrorKind::DriverUnavailable,
                "the driver sees no CUDA device",
            ));
        }
        let devices = (0..count)
            .map(|ordinal| DeviceContext::open(ordinal).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            devices = devices.len(),
            granularity = devices[0].granularity(),
            "CUDA backend ready"
        );
        Ok(Arc::new(Self {
            devices,
            tables: Mutex::default(),
        }))
    }

    fn device(&self, call: &'static str, device: DeviceId) -> Result<&Arc<DeviceContext>> {
        self.devices.get(device.0 as usize).ok_or_else(|| {
            Error::rejected(
                call,
                ErrorKind::InvalidDevice,
                format!("{device} does not exist ({} present)", self.devices.len()),
            )
        })
    }

    /// Device 0: its granularity is the one of address ranges, and its
    /// context is bound for calls that name no device.
    fn first(&self) -> &DeviceContext {
        &self.devices[0]
    }

    /// A chunk of `size` bytes on `device`, exportable when `shareable`,
    /// entered in the tables.
    fn create(
        &self,
        call: &'static str,
        device: DeviceId,
        size: usize,
        shareable: bool,
    ) -> Result<ChunkHandle> {
        let context = self.device(call, device)?;
        check_size(call, context.granularity(), size)?;
        let _bound = context.bind()?;
        let handle = result::mem_create(context.ordinal(), size, shareable)?;
        self.tables().chunks.insert(
            handle,
            ChunkEntry {
                device,
                size,
                shareable,
            },
        );
        Ok(ChunkHandle(handle))
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the tables after checking that `[va, va + size)` is all mapped,
    /// so that it stays so while the guard is held.
    fn mapped(
        &self,
        call: &'static str,
        va: DevicePtr,
        size: usize,
    ) -> Result<MutexGuard<'_, Tables>> {
        let start = start_of(call, va, size)?;
        let tables = self.tables();
        if tables.mappings.covering(start, size).is_none() {
            return Err(Error::invalid(
                call,
                format!("{size} bytes at {va} are not all mapped"),
            ));
        }
        Ok(tables)
    }
}

/// The same error, as "no usable driver": what any failure of `cuInit` or
/// device enumeration means to a caller of [`Cuda::new`].
fn driver_unavailable(mut err: Error) -> Error {
    let (Error::Cuda { kind, .. } | Error::Rejected { kind, .. }) = &mut err;
    *kind = ErrorKind::DriverUnavailable;
    err
}

/// Everything still in the tables was leaked by an owner: the driver keeps
/// it until the process exits. Say so.
impl Drop for Cuda {
    fn drop(&mut self) {
        let tables = self
            .tables
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let (reservations, mappings, chunks) = (
            tables.reservations.len(),
            tables.mappings.len(),
            tables.chunks.len(),
        );
        if reservations + mappings + chunks != 0 {
            tracing::warn!(
                reservations,
                mappings,
                chunks,
                "CUDA backend dropped with memory still allocated"
            );
        }
    }
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` of cuda.h: handles that
/// name the legacy default stream and the calling thread's default stream.
const STREAM_LEGACY: usize = 0x1;
const STREAM_PER_THREAD: usize = 0x2;

/// A CUDA stream (created non-blocking, so it never waits for the legacy
/// default stream, or borrowed from its owner) and the context it lives in.
#[derive(Debug)]
pub struct CudaStream {
    stream: sys::CUstream,
    context: Arc<DeviceContext>,
    /// Made by vmm, and destroyed when dropped; else borrowed.
    owned: bool,
    /// The cudarc stream it was adopted from, kept alive with it.
    #[cfg(feature = "cudarc")]
    cudarc: Option<Arc<cudarc::driver::CudaStream>>,
}

impl CudaStream {
    /// The driver's handle, live until `self` is dropped.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.stream
    }

    /// The driver's `CUstream`, as an integer (0 for the legacy default
    /// stream), for handing to another CUDA library: it stays valid while
    /// `self` (or the vmpool stream holding it) lives.
    pub fn handle(&self) -> usize {
        self.stream as usize
    }

    /// The context the stream was created in.
    fn context(&self) -> &DeviceContext {
        &self.context
    }
}

// SAFETY: a CUstream is a driver handle that the driver API lets any thread
// use; `context` is Send.
unsafe impl Send for CudaStream {}
// SAFETY: as for `Send`; nothing is mutated through `&CudaStream` on the Rust
// side, and the driver synchronises concurrent calls on one stream.
unsafe impl Sync for CudaStream {}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let destroyed = self.context.bind().and_then(|_bound| {
            // SAFETY: the stream was created in `create_stream`, is destroyed
            // only here, and `self` is going away, so it is never used again.
            unsafe { result::stream_destroy(self.stream) }
        });
        if let Err(err) = destroyed {
            report_drop_error("destroying a stream", &err);
        }
    }
}

/// A CUDA event (timing disabled: vmm only orders and waits) and the context
/// it lives in.
#[derive(Debug)]
pub struct CudaEvent {
    event: sys::CUevent,
    context: Arc<DeviceContext>,
}

// SAFETY: a CUevent is a driver handle that the driver API lets any thread
// use; `context` is Send.
unsafe impl Send for CudaEvent {}
// SAFETY: as for `Send`; nothing is mutated through `&CudaEvent` on the Rust
// side, and the driver synchronises concurrent calls on one event.
unsafe impl Sync for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let destroyed = self.context.bind().and_then(|_bound| {
            // SAFETY: the event was created in `create_event`, is destroyed
            // only here, and `self` is going away, so it is never used again.
            unsafe { result::event_destroy(self.event) }
        });
        if let Err(err) = destroyed {
            report_drop_error("destroying an event", &err);
        }
    }
}

impl Backend for Cuda {
    type Stream = CudaStream;
    type Event = CudaEvent;
    type HostBuffer = CudaHostBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.devices.len() as u32)
    }

    fn granularity(&self, device: DeviceId) -> Result<usize> {
        Ok(self.device("granularity", device)?.granularity())
    }

    fn device_uuid(&self, device: DeviceId) -> Result<[u8; 16]> {
        result::device_get_uuid(self.device("device_uuid", device)?.device())
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let context = self.device("mem_info", device)?;
        let _bound = context.bind()?;
        let (free, total) = result::mem_get_info()?;
        Ok(MemInfo { free, total })
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<DevicePtr> {
        let first = self.first();
        check_size("reserve", first.granularity(), size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(Error::invalid(
                "reserve",
                format!("alignment {alignment:#x} is not a power of two"),
            ));
        }
        let _bound = first.bind()?;
        let base = result::mem_address_reserve(size, alignment.max(first.granularity()))?;
        self.tables().reservations.insert(base, size, ());
        Ok(DevicePtr(base))
    }

    fn free_reservation(&self, base: DevicePtr, size: usize) -> Result<()> {
        let start = start_of("free_reservation", base, size)?;
        let mut tables = self.tables();
        if tables.reservations.get(start).map(|r| r.size) != Some(size) {
            return Err(Error::invalid(
                "free_reservation",
                format!("no reservation of {size} bytes at {base}"),
            ));
        }
        if tables.mappings.overlaps(start, size) {
            return Err(Error::invalid(
                "free_reservation",
                format!("the reservation at {base} still has mappings"),
            ));
        }
        let _bound = self.first().bind()?;
        // SAFETY: the tables hold exactly this reservation, made by
        // `reserve`, with nothing mapped in it; the lock keeps it so until
        // it is removed below.
        unsafe { result::mem_address_free(start, size) }?;
        tables.reservations.remove(start);
        Ok(())
    }

    fn create_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.create("create_chunk", device, size, false)
    }

    fn release_chunk(&self, chunk: ChunkHandle) -> Result<()> {
        let mut tables = self.tables();
        let Some(entry) = tables.chunks.get(&chunk.0) else {
            return Err(Error::invalid(
                "release_chunk",
                format!("{chunk:?} is not a live chunk"),
            ));
        };
        let _bound = self.device("release_chunk", entry.device)?.bind()?;
        // SAFETY: the tables hold the handle, so `create_chunk` made it and
        // it is not released yet; it is removed below under the same lock,
        // so it is released once and never used again.
        unsafe { result::mem_release(chunk.0) }?;
        tables.chunks.remove(&chunk.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, chunk: ChunkHandle) -> Result<()> {
        let mut tables = self.tables();
        let Some(entry) = tables.chunks.get(&chunk.0).copied() else {
            return Err(Error::invalid(
                "map",
                format!("{chunk:?} is not a live chunk"),
            ));
        };
        let size = entry.size;
        let start = start_of("map", va, size)?;
        let context = self.device("map", entry.device)?;
        check_granular("map", context.granularity(), "address", start)?;
        if tables.reservations.containing(start, size).is_none() {
            return Err(Error::invalid(
                "map",
                format!("{size} bytes at {va} are not inside one reservation"),
            ));
        }
        if tables.mappings.overlaps(start, size) {
            return Err(Error::invalid(
                "map",
                format!("{size} bytes at {va} overlap an existing mapping"),
            ));
        }
        let _bound = context.bind()?;
        // SAFETY: the tables say the handle is live and the range lies in
        // one of vmm's reservations with nothing mapped; the lock keeps all
        // of that true until the mapping is recorded below.
        unsafe { result::mem_map(start, size, 0, chunk.0) }?;
        tables.mappings.insert(start, size, ());
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        let start = start_of("unmap", va, size)?;
        let mut tables = self.tables();
        let Some(gone) = tables.whole_mappings(start, size) else {
            return Err(Error::invalid(
                "unmap",
                format!("{size} bytes at {va} are not a run of whole mappings"),
            ));
        };
        let _bound = self.first().bind()?;
        // SAFETY: the tables say the range is exactly whole mappings made by
        // `map`; the caller guarantees (trait contract) that no queued work
        // still touches it.
        unsafe { result::mem_unmap(start, size) }?;
        for va in gone {
            tables.mappings.remove(va);
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: usize, access: &[AccessDesc]) -> Result<()> {
        let desc = access
            .iter()
            .map(|desc| {
                Ok(sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: self.device("set_access", desc.device)?.ordinal(),
                    },
                    flags: match desc.access {
                        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
                        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
                        Access::ReadWrite => {
                            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                        }
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let start = start_of("set_access", va, size)?;
        let tables = self.tables();
        if tables.whole_mappings(start, size).is_none() {
            return Err(Error::invalid(
                "set_access",
                format!("{size} bytes at {va} are not a run of whole mappings"),
            ));
        }
        if desc.is_empty() {
            return Ok(());
        }
        let _bound = self.first().bind()?;
        // SAFETY: the tables say the range is whole mappings made by `map`,
        // and the lock keeps them mapped during the call; taking access away
        // from queued work is the caller's to avoid (trait contract), and
        // at worst faults the context, not the process.
        unsafe { result::mem_set_access(start, size, &desc) }
    }

    fn get_access(&self, va: DevicePtr, device: DeviceId) -> Result<Access> {
        let ordinal = self.device("get_access", device)?.ordinal();
        let _mapped = self.mapped("get_access", va, 1)?;
        let _bound = self.first().bind()?;
        let flags = result::mem_get_access(ordinal, va.0)?;
        let read = u64::from(sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ.0);
        let read_write = u64::from(sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE.0);
        Ok(match flags {
            f if f == read_write => Access::ReadWrite,
            f if f == read => Access::Read,
            _ => Access::None,
        })
    }

    fn create_shareable_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.create("create_shareable_chunk", device, size, true)
    }

    fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd> {
        let tables = self.tables();
        let entry = match tables.chunks.get(&chunk.0) {
            Some(entry) if entry.shareable => entry,
            Some(_) => {
                return Err(Error::invalid(
                    "export_chunk",
                    format!("{chunk:?} was not created shareable"),
                ))
            }
            None => {
                return Err(Error::invalid(
                    "export_chunk",
                    format!("{chunk:?} is not a live chunk"),
                ))
            }
        };
        let _bound = self.device("export_chunk", entry.device)?.bind()?;
        // SAFETY: the tables hold the handle, shareable, and the lock keeps
        // it from being released during the call.
        unsafe { result::mem_export_to_shareable_handle(chunk.0) }
    }

    fn import_chunk(
        &self,
        fd: BorrowedFd<'_>,
        device: DeviceId,
        size: usize,
    ) -> Result<ChunkHandle> {
        let context = self.device("import_chunk", device)?;
        check_size("import_chunk", context.granularity(), size)?;
        let _bound = context.bind()?;
        let handle = result::mem_import_from_shareable_handle(fd)?;
        let mut tables = self.tables();
        if tables.chunks.contains_key(&handle) {
            // The driver gave back a handle vmm already holds (an allocation
            // of this process imported again): two owners of one handle
            // would release it twice, so refuse; the driver's reference
            // stays with the first owner.
            return Err(Error::invalid(
                "import_chunk",
                format!("the descriptor names chunk {handle:#x}, which this process already holds"),
            ));
        }
        tables.chunks.insert(
            handle,
            ChunkEntry {
                device,
                size,
                shareable: true,
            },
        );
        Ok(ChunkHandle(handle))
    }

    fn create_stream(&self, device: DeviceId) -> Result<CudaStream> {
        let context = self.device("create_stream", device)?;
        let _bound = context.bind()?;
        let stream = result::stream_create(sys::CUstream_flags::CU_STREAM_NON_BLOCKING)?;
        Ok(CudaStream {
            stream,
            context: Arc::clone(context),
            owned: true,
            #[cfg(feature = "cudarc")]
            cudarc: None,
        })
    }

    unsafe fn borrow_stream(&self, device: DeviceId, handle: usize) -> Result<CudaStream> {
        let context = self.device("borrow_stream", device)?;
        if handle == STREAM_PER_THREAD {
            return Err(Error::rejected(
                "borrow_stream",
                ErrorKind::InvalidArgument,
                "the per-thread default stream names another stream on each thread; \
                 pass a stream of its own",
            ));
        }
        // The two names of the legacy default stream are one stream.
        let handle = if handle == STREAM_LEGACY { 0 } else { handle };
        Ok(CudaStream {
            stream: handle as sys::CUstream,
            context: Arc::clone(context),
            owned: false,
            #[cfg(feature = "cudarc")]
            cudarc: None,
        })
    }

    fn synchronize_stream(&self, stream: &CudaStream) -> Result<()> {
        let _bound = stream.context.bind()?;
        // SAFETY: a `CudaStream` holds a live stream until it is dropped.
        unsafe { result::stream_synchronize(stream.stream) }
    }

    fn stream_capturing(&self, stream: &CudaStream) -> Result<bool> {
        let _bound = stream.context.bind()?;
        // SAFETY: a `CudaStream` holds a live stream (or the legacy default
        // stream) until it is dropped.
        unsafe { result::stream_is_capturing(stream.stream) }
    }

    fn create_event(&self, device: DeviceId) -> Result<CudaEvent> {
        let context = self.device("create_event", device)?;
        let _bound = context.bind()?;
        let event = result::event_create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        Ok(CudaEvent {
            event,
            context: Arc::clone(context),
        })
    }

    fn record_event(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        let _bound = stream.context.bind()?;
        // SAFETY: both hold live handles until they are dropped. An event
        // and stream of different devices is an error from the driver.
        unsafe { result::event_record(event.event, stream.stream) }
    }

    fn query_event(&self, event: &CudaEvent) -> Result<EventStatus> {
        let _bound = event.context.bind()?;
        // SAFETY: a `CudaEvent` holds a live event until it is dropped.
        unsafe { result::event_query(event.event) }
    }

    fn synchronize_event(&self, event: &CudaEvent) -> Result<()> {
        let _bound = event.context.bind()?;
        // SAFETY: a `CudaEvent` holds a live event until it is dropped.
        unsafe { result::event_synchronize(event.event) }
    }

    fn stream_wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        let _bound = stream.context.bind()?;
        // SAFETY: both hold live handles until they are dropped; waiting on
        // an event of another device is allowed.
        unsafe { result::stream_wait_event(stream.stream, event.event) }
    }

    fn alloc_host(&self, size: usize) -> Result<CudaHostBuffer> {
        self.host_buffer(size)
    }

    fn copy_device_to_host(
        &self,
        stream: &CudaStream,
        ranges: &[HostCopy],
        dst: &mut CudaHostBuffer,
    ) -> Result<()> {
        check_host_ranges("copy_device_to_host", ranges, dst.len())?;
        self.copy_out(stream, ranges, dst)
    }

    fn copy_host_to_device(
        &self,
        stream: &CudaStream,
        src: &CudaHostBuffer,
        ranges: &[HostCopy],
    ) -> Result<()> {
        check_host_ranges("copy_host_to_device", ranges, src.len())?;
        self.copy_in(stream, src, ranges)
    }

    fn copy_device_to_host_pipelined(
        &self,
        stream: &CudaStream,
        batches: &[Vec<HostCopy>],
        dst: &mut CudaHostBuffer,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        check_host_ranges("copy_device_to_host", batches.iter().flatten(), dst.len())?;
        self.copy_out_pipelined(stream, batches, dst, done)
    }

    fn copy_host_to_device_pipelined(
        &self,
        stream: &CudaStream,
        src: &CudaHostBuffer,
        batches: &[Vec<HostCopy>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        check_host_ranges("copy_host_to_device", batches.iter().flatten(), src.len())?;
        self.copy_in_pipelined(stream, src, batches, ready)
    }
}
