//! The raw driver API: the few types and constants of `cuda.h` that vmm
//! uses, and its entry points, resolved from `libcuda.so.1` at run time.
//!
//! vmm loads the driver itself rather than through a binding crate so that
//! it imposes no CUDA version and no linking mode on the program it is built
//! into: the entry points below have kept their names and signatures since
//! CUDA 11.2, and a crate beside vmm may bind any CUDA version, loaded or
//! linked, without a feature conflict. Nothing links against libcuda.
//!
//! Handles and enumerations are plain integers and pointers (a newtype per
//! enumeration, with the constants vmm uses): a value the driver returns
//! that vmm does not know is still a valid value, never undefined behaviour.
//!
//! [`load`] opens the library and resolves every entry point, once per
//! process; until it has succeeded, each entry point returns
//! `CUDA_ERROR_NOT_INITIALIZED` without calling anything.

// The names are those of `cuda.h`, so that each call reads as the driver's
// documentation spells it.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use libloading::Library;

/// Declares a `#[repr(transparent)]` newtype over a C enumeration, with the
/// constants vmm uses.
macro_rules! c_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $value:expr,)* }) => {
        $(#[$meta])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub(crate) struct $name(pub(crate) c_uint);

        #[allow(dead_code)]
        impl $name {
            $(pub(crate) const $variant: Self = Self($value);)*
        }
    };
}

c_enum! {
    /// `CUresult`: what a driver call returns.
    CUresult {
        CUDA_SUCCESS = 0,
        CUDA_ERROR_INVALID_VALUE = 1,
        CUDA_ERROR_OUT_OF_MEMORY = 2,
        CUDA_ERROR_NOT_INITIALIZED = 3,
        CUDA_ERROR_DEINITIALIZED = 4,
        CUDA_ERROR_STUB_LIBRARY = 34,
        CUDA_ERROR_NO_DEVICE = 100,
        CUDA_ERROR_INVALID_DEVICE = 101,
        CUDA_ERROR_INVALID_CONTEXT = 201,
        CUDA_ERROR_ALREADY_MAPPED = 208,
        CUDA_ERROR_NOT_MAPPED = 211,
        CUDA_ERROR_NOT_MAPPED_AS_ARRAY = 212,
        CUDA_ERROR_NOT_MAPPED_AS_POINTER = 213,
        CUDA_ERROR_ECC_UNCORRECTABLE = 214,
        CUDA_ERROR_NVLINK_UNCORRECTABLE = 220,
        CUDA_ERROR_CONTAINED = 226,
        CUDA_ERROR_INVALID_HANDLE = 400,
        CUDA_ERROR_NOT_FOUND = 500,
        CUDA_ERROR_NOT_READY = 600,
        CUDA_ERROR_ILLEGAL_ADDRESS = 700,
        CUDA_ERROR_LAUNCH_TIMEOUT = 702,
        CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
        CUDA_ERROR_ASSERT = 710,
        CUDA_ERROR_HARDWARE_STACK_ERROR = 714,
        CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
        CUDA_ERROR_MISALIGNED_ADDRESS = 716,
        CUDA_ERROR_INVALID_ADDRESS_SPACE = 717,
        CUDA_ERROR_INVALID_PC = 718,
        CUDA_ERROR_LAUNCH_FAILED = 719,
        CUDA_ERROR_TENSOR_MEMORY_LEAK = 721,
        CUDA_ERROR_NOT_SUPPORTED = 801,
        CUDA_ERROR_SYSTEM_NOT_READY = 802,
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
        CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
        CUDA_ERROR_EXTERNAL_DEVICE = 911,
    }
}

c_enum! {
    /// `CUmemAllocationType`.
    CUmemAllocationType { CU_MEM_ALLOCATION_TYPE_PINNED = 1, }
}

c_enum! {
    /// `CUmemAllocationHandleType`.
    CUmemAllocationHandleType {
        CU_MEM_HANDLE_TYPE_NONE = 0,
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    }
}

c_enum! {
    /// `CUmemLocationType`.
    CUmemLocationType { CU_MEM_LOCATION_TYPE_DEVICE = 1, }
}

c_enum! {
    /// `CUmemAllocationGranularity_flags`.
    CUmemAllocationGranularity_flags { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0, }
}

c_enum! {
    /// `CUmemAccess_flags`.
    CUmemAccess_flags {
        CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
        CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    }
}

c_enum! {
    /// `CUstream_flags`.
    CUstream_flags { CU_STREAM_NON_BLOCKING = 1, }
}

c_enum! {
    /// `CUevent_flags`.
    CUevent_flags { CU_EVENT_DISABLE_TIMING = 2, }
}

c_enum! {
    /// `CUstreamCaptureStatus`.
    CUstreamCaptureStatus { CU_STREAM_CAPTURE_STATUS_NONE = 0, }
}

c_enum! {
    /// `CUstreamCaptureMode`.
    CUstreamCaptureMode { CU_STREAM_CAPTURE_MODE_GLOBAL = 0, }
}

c_enum! {
    /// `CUmemPool_attribute`: the attributes of CUDA's own pools that the
    /// side-by-side benchmarks read and set.
    CUmemPool_attribute {
        CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
        CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
        CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
        CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
    }
}

/// `CUdevice`: a device ordinal's handle.
pub(crate) type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub(crate) type CUdeviceptr = c_ulonglong;
/// `CUmemGenericAllocationHandle`: a chunk of physical memory.
pub(crate) type CUmemGenericAllocationHandle = c_ulonglong;
/// `CUcontext`, an opaque driver pointer.
pub(crate) type CUcontext = *mut c_void;
/// `CUstream`, an opaque driver pointer (null: the legacy default stream).
pub(crate) type CUstream = *mut c_void;
/// `CUevent`, an opaque driver pointer.
pub(crate) type CUevent = *mut c_void;
/// `CUmodule`, an opaque driver pointer.
pub(crate) type CUmodule = *mut c_void;
/// `CUfunction`, an opaque driver pointer.
pub(crate) type CUfunction = *mut c_void;
/// `CUgraph`, an opaque driver pointer.
pub(crate) type CUgraph = *mut c_void;
/// `CUmemoryPool`, an opaque driver pointer.
pub(crate) type CUmemoryPool = *mut c_void;

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUuuid {
    pub(crate) bytes: [c_char; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemLocation {
    pub(crate) type_: CUmemLocationType,
    pub(crate) id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemAllocationProp_allocFlags {
    pub(crate) compressionType: u8,
    pub(crate) gpuDirectRDMACapable: u8,
    pub(crate) usage: u16,
    pub(crate) reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemAllocationProp {
    pub(crate) type_: CUmemAllocationType,
    pub(crate) requestedHandleTypes: CUmemAllocationHandleType,
    pub(crate) location: CUmemLocation,
    pub(crate) win32HandleMetaData: *mut c_void,
    pub(crate) allocFlags: CUmemAllocationProp_allocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemAccessDesc {
    pub(crate) location: CUmemLocation,
    pub(crate) flags: CUmemAccess_flags,
}

/// The names the driver library is opened under, in order.
const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Declares the entry points: a table of function pointers resolved by
/// [`load`], and one `unsafe fn` per entry point that calls through it.
macro_rules! entry_points {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The loaded library and every entry point vmm calls.
        struct Api {
            /// Kept open for the process's lifetime: the pointers below
            /// point into it.
            _library: Library,
            $($name: unsafe extern "C" fn($($ty),*) -> CUresult,)*
        }

        /// Resolves every entry point in `library`; the names of those it
        /// lacks otherwise.
        fn resolve(library: Library) -> std::result::Result<Api, String> {
            let mut missing = Vec::new();
            $(
                // SAFETY: the type is the entry point's prototype in
                // `cuda.h`, which the driver has kept under this name; the
                // pointer is copied out and used only while `library` stays
                // open, which `Api` ensures by owning it.
                let $name = unsafe {
                    library.get::<unsafe extern "C" fn($($ty),*) -> CUresult>(
                        concat!(stringify!($name), "\0").as_bytes(),
                    )
                }
                .map(|symbol| *symbol)
                .ok();
                if $name.is_none() {
                    missing.push(stringify!($name));
                }
            )*
            match ($($name,)*) {
                ($(Some($name),)*) => Ok(Api { _library: library, $($name,)* }),
                _ => Err(format!(
                    "the driver library lacks {} (a driver older than CUDA 11.2?)",
                    missing.join(", ")
                )),
            }
        }

        $(
            /// The driver entry point of this name; `CUDA_ERROR_NOT_INITIALIZED`
            /// until [`load`] has succeeded.
            ///
            /// # Safety
            /// As the driver API requires of this call (the checked
            /// wrappers in `result.rs` say what for each).
            // Some are called only by the `testing` feature's helpers;
            // `cuLaunchKernel` takes the driver's eleven arguments.
            #[allow(dead_code, clippy::too_many_arguments)]
            pub(crate) unsafe fn $name($($arg: $ty),*) -> CUresult {
                match API.get() {
                    // SAFETY: the caller upholds the driver's contract for
                    // this call; the pointer came from the open library.
                    Some(Ok(api)) => unsafe { (api.$name)($($arg),*) },
                    _ => CUresult::CUDA_ERROR_NOT_INITIALIZED,
                }
            }
        )*
    };
}

entry_points! {
    cuGetErrorName(error: CUresult, text: *mut *const c_char);
    cuGetErrorString(error: CUresult, text: *mut *const c_char);
    cuInit(flags: c_uint);
    cuDeviceGetCount(count: *mut c_int);
    cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, device: CUdevice);
    cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice);
    cuDevicePrimaryCtxRelease_v2(device: CUdevice);
    cuCtxSetCurrent(ctx: CUcontext);
    cuCtxGetCurrent(ctx: *mut CUcontext);
    cuCtxSynchronize();
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    );
    cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: c_ulonglong,
    );
    cuMemAddressFree(ptr: CUdeviceptr, size: usize);
    cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: c_ulonglong,
    );
    cuMemRelease(handle: CUmemGenericAllocationHandle);
    cuMemMap(
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    );
    cuMemUnmap(ptr: CUdeviceptr, size: usize);
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    cuMemExportToShareableHandle(
        shareable: *mut c_void,
        handle: CUmemGenericAllocationHandle,
        handle_type: CUmemAllocationHandleType,
        flags: c_ulonglong,
    );
    cuMemImportFromShareableHandle(
        handle: *mut CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        handle_type: CUmemAllocationHandleType,
    );
    cuMemGetAccess(flags: *mut c_ulonglong, location: *const CUmemLocation, ptr: CUdeviceptr);
    cuStreamCreate(stream: *mut CUstream, flags: c_uint);
    cuStreamDestroy_v2(stream: CUstream);
    cuStreamSynchronize(stream: CUstream);
    cuStreamIsCapturing(stream: CUstream, status: *mut CUstreamCaptureStatus);
    cuStreamBeginCapture_v2(stream: CUstream, mode: CUstreamCaptureMode);
    cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph);
    cuGraphDestroy(graph: CUgraph);
    cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint);
    cuEventCreate(event: *mut CUevent, flags: c_uint);
    cuEventDestroy_v2(event: CUevent);
    cuEventRecord(event: CUevent, stream: CUstream);
    cuEventQuery(event: CUevent);
    cuEventSynchronize(event: CUevent);
    cuMemsetD32Async(dst: CUdeviceptr, value: c_uint, count: usize, stream: CUstream);
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, size: usize, stream: CUstream);
    cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, size: usize, stream: CUstream);
    cuMemHostAlloc(ptr: *mut *mut c_void, size: usize, flags: c_uint);
    cuMemFreeHost(ptr: *mut c_void);
    cuModuleLoadData(module: *mut CUmodule, image: *const c_void);
    cuModuleGetFunction(function: *mut CUfunction, module: CUmodule, name: *const c_char);
    cuModuleUnload(module: CUmodule);
    cuLaunchKernel(
        function: CUfunction,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    );
    cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, device: CUdevice);
    cuMemPoolSetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    cuMemPoolGetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize);
    cuMemAllocAsync(ptr: *mut CUdeviceptr, size: usize, stream: CUstream);
    cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream);
    cuMemAlloc_v2(ptr: *mut CUdeviceptr, size: usize);
    cuMemFree_v2(ptr: CUdeviceptr);
}

/// The loaded driver, or why it could not be loaded; set once.
static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

/// Opens the driver library and resolves every entry point, the first time
/// it is called; later calls give the first call's answer. The error says
/// which library names were tried, or which entry points are missing.
pub(crate) fn load() -> std::result::Result<(), String> {
    let api = API.get_or_init(|| {
        let mut failures = Vec::new();
        for name in LIBRARY_NAMES {
            // SAFETY: the driver library's initialisers expect to be run by
            // dlopen, as every CUDA program does; opening it twice (the
            // program may have loaded it already) returns the same handle.
            match unsafe { Library::new(name) } {
                Ok(library) => return resolve(library),
                // libloading's message is generic; dlerror's text is its source.
                Err(err) => match std::error::Error::source(&err) {
                    Some(why) => failures.push(why.to_string()),
                    None => failures.push(format!("{name}: {err}")),
                },
            }
        }
        Err(format!(
            "the CUDA driver library could not be opened ({})",
            failures.join("; ")
        ))
    });
    api.as_ref().map(|_| ()).map_err(Clone::clone)
}
