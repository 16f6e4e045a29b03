//! The checked layer: one function per driver entry point used, turning its
//! `CUresult` into [`crate::Result`].
//!
//! A function is `unsafe` when the driver could misbehave (touch freed state,
//! write through a dangling pointer) on arguments that Rust cannot check: a
//! handle that is no longer alive, a host buffer that must outlive queued
//! work. Its `# Safety` section lists what the caller guarantees. Functions
//! that only create things, or only read state into out-parameters they own,
//! are safe.
//!
//! Every function here calls into the driver library loaded by
//! [`super::sys::load`], which [`super::Cuda::new`] calls before the first
//! of them; without it each call fails with `CUDA_ERROR_NOT_INITIALIZED`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use super::sys::{self, CUresult};

use crate::{Error, ErrorKind, EventStatus, Result};

/// `Ok(())` on `CUDA_SUCCESS`, otherwise the error of `call`.
pub(crate) fn check(call: &'static str, code: CUresult) -> Result<()> {
    match code {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(error(call, code)),
    }
}

/// The [`Error::Cuda`] for a failed `call`, with the driver's own words.
fn error(call: &'static str, code: CUresult) -> Error {
    Error::Cuda {
        call,
        kind: kind_of(code),
        code: code.0,
        name: error_text(code, sys::cuGetErrorName).unwrap_or_else(|| format!("{code:?}")),
        description: error_text(code, sys::cuGetErrorString)
            .unwrap_or_else(|| "no description from the driver".to_owned()),
    }
}

/// The text `lookup` (`cuGetErrorName` or `cuGetErrorString`) gives `code`.
fn error_text(
    code: CUresult,
    lookup: unsafe fn(CUresult, *mut *const c_char) -> CUresult,
) -> Option<String> {
    let mut text: *const c_char = ptr::null();
    // SAFETY: `lookup` is one of the two error-text entry points (the only
    // callers are in `error`); both take any `CUresult` (unknown ones give
    // CUDA_ERROR_INVALID_VALUE) and only write a pointer to `text`. The
    // library is loaded: `code` came from it.
    if unsafe { lookup(code, &mut text) } != CUresult::CUDA_SUCCESS || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `text` at a static NUL-terminated
    // string.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Classifies a `CUresult` for callers that match on what went wrong.
fn kind_of(code: CUresult) -> ErrorKind {
    use CUresult as R;
    match code {
        R::CUDA_ERROR_INVALID_VALUE
        | R::CUDA_ERROR_INVALID_HANDLE
        | R::CUDA_ERROR_NOT_MAPPED
        | R::CUDA_ERROR_NOT_MAPPED_AS_ARRAY
        | R::CUDA_ERROR_NOT_MAPPED_AS_POINTER
        | R::CUDA_ERROR_ALREADY_MAPPED
        | R::CUDA_ERROR_NOT_FOUND
        | R::CUDA_ERROR_INVALID_CONTEXT
        | R::CUDA_ERROR_CONTEXT_IS_DESTROYED => ErrorKind::InvalidArgument,
        R::CUDA_ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        R::CUDA_ERROR_NO_DEVICE | R::CUDA_ERROR_INVALID_DEVICE => ErrorKind::InvalidDevice,
        // Failures of queued work: sticky, reported by whichever call
        // synchronises next.
        R::CUDA_ERROR_ILLEGAL_ADDRESS
        | R::CUDA_ERROR_LAUNCH_FAILED
        | R::CUDA_ERROR_LAUNCH_TIMEOUT
        | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | R::CUDA_ERROR_MISALIGNED_ADDRESS
        | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
        | R::CUDA_ERROR_INVALID_PC
        | R::CUDA_ERROR_HARDWARE_STACK_ERROR
        | R::CUDA_ERROR_ASSERT
        | R::CUDA_ERROR_TENSOR_MEMORY_LEAK
        | R::CUDA_ERROR_ECC_UNCORRECTABLE
        | R::CUDA_ERROR_NVLINK_UNCORRECTABLE
        | R::CUDA_ERROR_CONTAINED
        | R::CUDA_ERROR_EXTERNAL_DEVICE => ErrorKind::StreamFault,
        R::CUDA_ERROR_DEINITIALIZED => ErrorKind::Deinitialized,
        // No usable driver behind the library: never initialised, a stub, or
        // a kernel module that does not match it.
        R::CUDA_ERROR_NOT_INITIALIZED
        | R::CUDA_ERROR_STUB_LIBRARY
        | R::CUDA_ERROR_SYSTEM_NOT_READY
        | R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => ErrorKind::DriverUnavailable,
        // Everything else, including a kernel image the device cannot run
        // (CUDA_ERROR_NO_BINARY_FOR_GPU, CUDA_ERROR_INVALID_PTX): that is
        // vmm's own PTX, not an argument of the caller.
        _ => ErrorKind::Other,
    }
}

// ---- initialisation and devices --------------------------------------------

/// `cuInit(0)`.
pub(crate) fn init() -> Result<()> {
    // SAFETY: cuInit takes no pointers and may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDeviceGetCount`.
pub(crate) fn device_get_count() -> Result<c_int> {
    let mut count = 0;
    // SAFETY: `count` is a valid place for the driver to write the count.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`: the device of ordinal `ordinal`.
pub(crate) fn device_get(ordinal: c_int) -> Result<sys::CUdevice> {
    let mut device = 0;
    // SAFETY: `device` is a valid place for the driver to write the handle;
    // an out-of-range ordinal is an error.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

/// `cuDeviceGetUuid_v2`: the device's UUID.
pub(crate) fn device_get_uuid(device: sys::CUdevice) -> Result<[u8; 16]> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid place for the driver to write 16 bytes; a
    // handle that is not a device is an error.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&mut uuid, device)
    })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDevicePrimaryCtxRetain`: retains (and creates, the first time) the
/// primary context of `device`.
pub(crate) fn device_primary_ctx_retain(device: sys::CUdevice) -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: `ctx` is a valid place for the driver to write the handle; an
    // invalid `device` is an error.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease_v2`.
///
/// # Safety
/// 1. Balances one successful [`device_primary_ctx_retain`] of `device`
///    made by the caller.
/// 2. The caller uses the context, and anything it created in it, no more:
///    this may be the last retain, which destroys the context.
pub(crate) unsafe fn device_primary_ctx_release(device: sys::CUdevice) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuDevicePrimaryCtxRelease_v2", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

/// `cuCtxSetCurrent`: binds `ctx` to the calling thread.
///
/// # Safety
/// 1. `ctx` is a context the caller keeps alive (retained) while it is used
///    through this thread.
pub(crate) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// `cuCtxGetCurrent`: the context bound to the calling thread (null for
/// none).
pub(crate) fn ctx_get_current() -> Result<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid place for the driver to write the handle.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx)
}

/// `cuCtxSynchronize`: waits for all work in the current context.
#[cfg(feature = "testing")]
pub(crate) fn ctx_synchronize() -> Result<()> {
    // SAFETY: cuCtxSynchronize takes no arguments; without a current context
    // it returns an error.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// `cuMemGetInfo_v2`: `(free, total)` bytes of the current context's device.
pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: both are valid places for the driver to write a size; without
    // a current context the driver returns an error.
    check("cuMemGetInfo_v2", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free, total))
}

// ---- virtual memory -----------------------------------------------------------

/// Pinned device memory on the device of ordinal `ordinal`: the only kind of
/// physical memory vmm creates. Requests no shareable handle, so the driver
/// reads none of the Windows-only fields.
fn pinned_on(ordinal: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_allocFlags {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (minimum) of pinned memory on the device
/// of ordinal `ordinal`.
pub(crate) fn mem_get_allocation_granularity(ordinal: c_int) -> Result<usize> {
    let prop = pinned_on(ordinal);
    let mut granularity = 0;
    // SAFETY: `prop` is a fully initialised property that outlives the call;
    // `granularity` is a valid place for the result.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity)
}

/// `cuMemAddressReserve`: a fresh range of `size` bytes aligned to
/// `alignment`, anywhere (no address hint, no flags).
pub(crate) fn mem_address_reserve(size: usize, alignment: usize) -> Result<sys::CUdeviceptr> {
    let mut base = 0;
    // SAFETY: `base` is a valid place for the address; a fresh reservation
    // does not touch any existing memory.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut base, size, alignment, 0, 0)
    })?;
    Ok(base)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// 1. `base` and `size` are exactly a live reservation of the caller's, from
///    [`mem_address_reserve`].
/// 2. Nothing is mapped in it any more.
pub(crate) unsafe fn mem_address_free(base: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(base, size)
    })
}

/// `cuMemCreate`: `size` bytes of pinned memory on the device of ordinal
/// `ordinal`; `shareable`: exportable as a POSIX file descriptor as well
/// ([`mem_export_to_shareable_handle`]), for sharing with another process.
pub(crate) fn mem_create(
    ordinal: c_int,
    size: usize,
    shareable: bool,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let prop = if shareable {
        sys::CUmemAllocationProp {
            requestedHandleTypes:
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ..pinned_on(ordinal)
        }
    } else {
        pinned_on(ordinal)
    };
    let mut handle = 0;
    // SAFETY: `prop` is a fully initialised property that outlives the call
    // (a POSIX descriptor type reads no Windows-only field); `handle` is a
    // valid place for the new handle.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, size, &prop, 0)
    })?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// 1. `handle` is a live handle of the caller's, from [`mem_create`], not
///    used again after this call (mappings of it stay valid until unmapped).
pub(crate) unsafe fn mem_release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap`: maps `size` bytes of `handle` from `offset` at `va`. The
/// driver supports whole allocations only (`offset` 0, `size` the handle's
/// size) and answers anything else with `CUDA_ERROR_NOT_SUPPORTED`.
///
/// # Safety
/// 1. `handle` is a live handle from [`mem_create`].
/// 2. `[va, va + size)` lies inside one live reservation of the caller's and
///    nothing is mapped there, so no other owner's memory is affected.
pub(crate) unsafe fn mem_map(
    va: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuMemMap", unsafe {
        sys::cuMemMap(va, size, offset, handle, 0)
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// 1. `[va, va + size)` is made of whole mappings the caller made with
///    [`mem_map`].
/// 2. No queued or running work still accesses it.
pub(crate) unsafe fn mem_unmap(va: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size) })
}

/// `cuMemSetAccess`: applies every descriptor of `desc` to the range.
///
/// # Safety
/// 1. `[va, va + size)` is mapped, by the caller, through [`mem_map`].
/// 2. No queued or running work relies on access that `desc` takes away.
pub(crate) unsafe fn mem_set_access(
    va: sys::CUdeviceptr,
    size: usize,
    desc: &[sys::CUmemAccessDesc],
) -> Result<()> {
    // SAFETY: `desc` points at `desc.len()` initialised descriptors for the
    // duration of the call; the caller upholds 1 and 2.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, size, desc.as_ptr(), desc.len())
    })
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the
/// caller.
///
/// # Safety
/// 1. `handle` is a live handle from [`mem_create`] with `shareable` (or
///    imported).
pub(crate) unsafe fn mem_export_to_shareable_handle(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for the POSIX descriptor type the driver writes one `int` to
    // the first argument, which `fd` is; the caller upholds 1.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            ptr::from_mut(&mut fd).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::rejected(
            "cuMemExportToShareableHandle",
            ErrorKind::Other,
            format!("the driver returned descriptor {fd}"),
        ));
    }
    // SAFETY: on success the driver has opened `fd` for the caller, who is
    // its only owner from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor. The driver
/// does not take the descriptor over: the caller still owns (and closes) it.
pub(crate) fn mem_import_from_shareable_handle(
    fd: BorrowedFd<'_>,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: for the POSIX descriptor type the driver reads the descriptor
    // from the pointer's value (`(void *)(uintptr_t)fd`), which `fd` keeps
    // open for the call; `handle` is a valid place for the new handle. A
    // descriptor that is no exported allocation is an error from the driver.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(handle)
}

/// `cuMemGetAccess`: what the device of ordinal `ordinal` may do at `va`.
pub(crate) fn mem_get_access(ordinal: c_int, va: sys::CUdeviceptr) -> Result<u64> {
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    };
    let mut flags = 0;
    // SAFETY: `location` is initialised and outlives the call, `flags` is a
    // valid place for the answer; the driver only reads its tables (an
    // unmapped address is an error).
    check("cuMemGetAccess", unsafe {
        sys::cuMemGetAccess(&mut flags, &location, va)
    })?;
    Ok(flags)
}

// ---- streams and events --------------------------------------------------------

/// `cuStreamCreate` in the current context.
pub(crate) fn stream_create(flags: sys::CUstream_flags) -> Result<sys::CUstream> {
    let mut stream = ptr::null_mut();
    // SAFETY: `stream` is a valid place for the new handle.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut stream, flags.0)
    })?;
    Ok(stream)
}

/// `cuStreamDestroy_v2`: queued work still runs; the handle is freed after.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`], not used again.
pub(crate) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuStreamDestroy_v2", unsafe {
        sys::cuStreamDestroy_v2(stream)
    })
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
pub(crate) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream)
    })
}

/// `cuStreamIsCapturing`: whether work queued on `stream` is being
/// captured into a graph (an invalidated capture counts: it lasts until
/// its end call).
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`], or the legacy
///    default stream.
pub(crate) unsafe fn stream_is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller upholds 1; `status` is a valid place for the answer.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `cuStreamBeginCapture_v2` in global mode (PyTorch's default for
/// `torch.cuda.graph`).
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
#[cfg(feature = "testing")]
pub(crate) unsafe fn stream_begin_capture(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    })
}

/// `cuStreamEndCapture`, then `cuGraphDestroy` of the graph it made. An
/// invalidated capture is an error (and makes no graph).
///
/// # Safety
/// 1. `stream` is a live stream capturing since [`stream_begin_capture`] on
///    this thread.
#[cfg(feature = "testing")]
pub(crate) unsafe fn stream_end_capture(stream: sys::CUstream) -> Result<()> {
    let mut graph = ptr::null_mut();
    // SAFETY: the caller upholds 1; `graph` is a valid place for the graph.
    check("cuStreamEndCapture", unsafe {
        sys::cuStreamEndCapture(stream, &mut graph)
    })?;
    // SAFETY: `graph` was just made by the capture and is used nowhere else.
    check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) })
}

/// `cuStreamWaitEvent` with no flags.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
/// 2. `event` is a live event from [`event_create`].
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}

/// `cuEventCreate` in the current context.
pub(crate) fn event_create(flags: sys::CUevent_flags) -> Result<sys::CUevent> {
    let mut event = ptr::null_mut();
    // SAFETY: `event` is a valid place for the new handle.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, flags.0)
    })?;
    Ok(event)
}

/// `cuEventDestroy_v2`.
///
/// # Safety
/// 1. `event` is a live event from [`event_create`], not used again.
pub(crate) unsafe fn event_destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuEventDestroy_v2", unsafe {
        sys::cuEventDestroy_v2(event)
    })
}

/// `cuEventRecord`.
///
/// # Safety
/// 1. `event` is a live event from [`event_create`].
/// 2. `stream` is a live stream from [`stream_create`].
pub(crate) unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    })
}

/// `cuEventQuery`: `CUDA_ERROR_NOT_READY` is [`EventStatus::Pending`], not an
/// error; every other failure is one.
///
/// # Safety
/// 1. `event` is a live event from [`event_create`].
pub(crate) unsafe fn event_query(event: sys::CUevent) -> Result<EventStatus> {
    // SAFETY: the caller upholds 1.
    match unsafe { sys::cuEventQuery(event) } {
        CUresult::CUDA_SUCCESS => Ok(EventStatus::Complete),
        CUresult::CUDA_ERROR_NOT_READY => Ok(EventStatus::Pending),
        code => Err(error("cuEventQuery", code)),
    }
}

/// `cuEventSynchronize`.
///
/// # Safety
/// 1. `event` is a live event from [`event_create`].
pub(crate) unsafe fn event_synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(event)
    })
}

// ---- asynchronous work -----------------------------------------------------------

/// `cuMemsetD32Async`: queues `count` writes of `value` from `dst` on.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
/// 2. `[dst, dst + 4 * count)` lies in mappings the caller made with
///    [`mem_map`] (device memory, so the write never reaches host memory),
///    which stay mapped until the work has run. Missing access faults the
///    context rather than the process.
#[cfg(feature = "testing")]
pub(crate) unsafe fn memset_d32_async(
    dst: sys::CUdeviceptr,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuMemsetD32Async", unsafe {
        sys::cuMemsetD32Async(dst, value, count, stream)
    })
}

/// `cuMemcpyDtoHAsync_v2`: queues a copy of `dst.len()` bytes from `src`.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
/// 2. `[src, src + dst.len())` lies in mappings the caller made with
///    [`mem_map`], which stay mapped until the copy has run.
/// 3. `dst` is neither read, written nor freed until the stream has
///    finished the copy (the caller synchronises before it returns).
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: `dst` is valid for writes of `dst.len()` bytes; the caller
    // upholds 1 to 3, so it stays so until the copy is done.
    check("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream)
    })
}

/// `cuModuleLoadData`: JIT-compiles the PTX `image` into the current context.
#[cfg(feature = "testing")]
pub(crate) fn module_load_data(image: &CStr) -> Result<sys::CUmodule> {
    let mut module = ptr::null_mut();
    // SAFETY: `image` is NUL-terminated text, as the driver requires of PTX,
    // alive for the call; `module` is a valid place for the new handle.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
    })?;
    Ok(module)
}

/// `cuModuleGetFunction`.
///
/// # Safety
/// 1. `module` is a live module from [`module_load_data`].
#[cfg(feature = "testing")]
pub(crate) unsafe fn module_get_function(
    module: sys::CUmodule,
    name: &CStr,
) -> Result<sys::CUfunction> {
    let mut function = ptr::null_mut();
    // SAFETY: `name` is NUL-terminated and alive for the call; `function` is
    // a valid place for the handle; the caller upholds 1.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
    })?;
    Ok(function)
}

/// `cuModuleUnload`.
///
/// # Safety
/// 1. `module` is a live module from [`module_load_data`], whose context is
///    current; neither it nor its functions are used again, and no queued
///    work still runs them.
#[cfg(feature = "testing")]
pub(crate) unsafe fn module_unload(module: sys::CUmodule) -> Result<()> {
    // SAFETY: the caller upholds 1.
    check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) })
}

/// `cuLaunchKernel` of a single thread (grid and block 1×1×1, no shared
/// memory). `params` holds one pointer per kernel parameter, to a value of
/// that parameter's type; the driver copies the values before returning.
///
/// # Safety
/// 1. `function` is from a live module of the context of `stream`, a live
///    stream from [`stream_create`].
/// 2. `params` matches the kernel's parameter list in number, order and
///    size.
/// 3. Whatever memory the kernel touches stays valid until it has run.
#[cfg(feature = "testing")]
pub(crate) unsafe fn launch_single_thread(
    function: sys::CUfunction,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller upholds 1 to 3; `extra` is null, so the driver reads
    // the parameters from `params` only.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            function,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

// ---- CUDA's own allocators, for side-by-side benchmarks (see `super::peers`) ----

/// `cuDeviceGetDefaultMemPool`: the pool that stream-ordered allocations on
/// `device` come from unless `cuDeviceSetMemPool` chose another. The driver
/// owns it; it is never destroyed.
pub(crate) fn device_get_default_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: `pool` is a valid place for the handle; an invalid `device`, or
    // one without memory pools, is an error.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, device)
    })?;
    Ok(pool)
}

/// `cuMemPoolSetAttribute` of an attribute whose value is a `cuuint64_t`
/// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, or one of the `*_MEM_HIGH` marks,
/// which only accept 0).
///
/// # Safety
/// 1. `pool` is a pool from [`device_get_default_mem_pool`].
/// 2. `attr` takes a `cuuint64_t`, so the driver reads exactly the 8 bytes
///    passed.
pub(crate) unsafe fn mem_pool_set_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    let mut value = value;
    // SAFETY: `value` is a live u64 for the call, which the driver only
    // reads; the caller upholds 1 and 2.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, ptr::from_mut(&mut value).cast())
    })
}

/// `cuMemPoolGetAttribute` of an attribute whose value is a `cuuint64_t`
/// (the release threshold and the `*_MEM_CURRENT` / `*_MEM_HIGH` counters).
///
/// # Safety
/// 1. `pool` is a pool from [`device_get_default_mem_pool`].
/// 2. `attr` takes a `cuuint64_t`, so the driver writes exactly the 8 bytes
///    of the value.
pub(crate) unsafe fn mem_pool_get_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut value = 0u64;
    // SAFETY: `value` is a valid place for a u64 for the call; the caller
    // upholds 1 and 2.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, ptr::from_mut(&mut value).cast())
    })?;
    Ok(value)
}

/// `cuMemPoolTrimTo`: gives memory the pool holds but nobody uses back to
/// the device until at most `keep` bytes stay reserved (or nothing more can
/// be released: memory backing live allocations, or frees still queued on a
/// stream, stays).
///
/// # Safety
/// 1. `pool` is a pool from [`device_get_default_mem_pool`].
pub(crate) unsafe fn mem_pool_trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller upholds 1; the driver never releases memory that
    // backs a live allocation.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool, keep)
    })
}

/// `cuMemAllocAsync`: queues an allocation of `size` bytes on `stream`, from
/// the current pool of the stream's device. The address is returned at once;
/// the memory may be used by work queued on `stream` after this call (or
/// ordered after it).
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
pub(crate) unsafe fn mem_alloc_async(
    size: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid place for the address; the caller upholds 1.
    check("cuMemAllocAsync", unsafe {
        sys::cuMemAllocAsync(&mut ptr, size, stream)
    })?;
    Ok(ptr)
}

/// `cuMemFreeAsync`: queues the free of `ptr` on `stream`; the memory goes
/// back to its pool once the work queued before it on `stream` has run.
///
/// # Safety
/// 1. `stream` is a live stream from [`stream_create`].
/// 2. `ptr` is an address from [`mem_alloc_async`], not freed yet and not
///    freed or used again after this call.
/// 3. Work on other streams that uses the memory is ordered before the free
///    (through events); otherwise it may touch memory the pool has handed
///    out again (device memory: this corrupts or faults device work, never
///    host memory).
pub(crate) unsafe fn mem_free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller upholds 1 to 3.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

/// `cuMemAlloc_v2`: `size` bytes of device memory in the current context.
pub(crate) fn mem_alloc(size: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid place for the address; a fresh allocation
    // touches no existing memory, and without a current context the driver
    // returns an error.
    check("cuMemAlloc_v2", unsafe {
        sys::cuMemAlloc_v2(&mut ptr, size)
    })?;
    Ok(ptr)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// 1. `ptr` is an address from [`mem_alloc`], not freed yet and not freed or
///    used again after this call.
/// 2. No queued or running work still accesses it.
pub(crate) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller upholds 1 and 2.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}
