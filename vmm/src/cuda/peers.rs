//! CUDA's own allocators, wrapped safely so that benchmarks can run them side
//! by side with vmpool on the same workload. They are *peers* to compare
//! against, not part of vmpool's allocator, and do not go through
//! [`Backend`](crate::Backend) or its address tables.
//!
//! * [`CudaAsyncPool`]: the stream-ordered allocator (`cuMemAllocAsync` /
//!   `cuMemFreeAsync`) on a device's default memory pool, configured as
//!   PyTorch's `cudaMallocAsync` backend does: cached memory is never given
//!   back on its own.
//! * [`CudaMalloc`]: plain `cuMemAlloc` / `cuMemFree`.
//!
//! Both hand out a [`PeerAllocation`], which is neither `Clone` nor `Copy`
//! and is consumed by `free`, so freeing twice does not compile. It remembers
//! which allocator made it: freeing it through another one is an
//! [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) error,
//! never a driver call. It has no `Drop`: an allocation dropped without
//! `free` leaks, and the driver reclaims it when the process exits. A `free`
//! that fails (wrong allocator, driver error) consumes the allocation too,
//! which then leaks the same way.
//!
//! The hot paths (`alloc`, `free`) take no lock and look nothing up: a
//! comparison or two, a check of the thread's current context (bound, and
//! put back after, only when it is another), and the driver call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::sys;
use super::sys::CUmemPool_attribute as Attr;

use super::context::DeviceContext;
use super::{result, Cuda, CudaStream};
use crate::error::report_drop_error;
use crate::{DeviceId, DevicePtr, Error, Result};

/// Source of allocator ids, shared by both kinds so that no two allocators
/// of the process ever have the same; 0 is never handed out.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Device memory from [`CudaAsyncPool::alloc`] or [`CudaMalloc::alloc`].
///
/// Give it back with the same allocator's `free`, which consumes it. There
/// is no `Drop`: dropping it without `free` leaks the memory until the
/// process exits.
///
/// ```compile_fail
/// # use vmpool_driver::cuda::peers::{CudaMalloc, PeerAllocation};
/// fn double_free(malloc: &CudaMalloc, a: PeerAllocation) -> vmpool_driver::Result<()> {
///     malloc.free(a)?;
///     malloc.free(a) // use of moved value
/// }
/// ```
#[derive(Debug, PartialEq, Eq, Hash)]
#[must_use = "a PeerAllocation dropped without `free` leaks its memory"]
pub struct PeerAllocation {
    ptr: DevicePtr,
    size: usize,
    /// The id of the allocator that made it.
    owner: u64,
}

impl PeerAllocation {
    /// The device address of the first byte.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The size asked for, in bytes (the driver may have rounded it up).
    pub fn size(&self) -> usize {
        self.size
    }
}

/// The error for an allocation that `call`'s allocator did not make.
fn not_ours(call: &'static str, a: &PeerAllocation) -> Error {
    Error::invalid(
        call,
        format!(
            "{} bytes at {} were not allocated by this allocator",
            a.size, a.ptr
        ),
    )
}

fn check_size(call: &'static str, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid(call, "size is zero"));
    }
    Ok(())
}

// ---- the stream-ordered pool -------------------------------------------------

/// CUDA's stream-ordered allocator on one device's default memory pool
/// (`cuDeviceGetDefaultMemPool`).
///
/// [`new`](Self::new) sets the pool's release threshold to `u64::MAX`, so
/// memory freed into the pool stays cached there instead of going back to the
/// device at the next synchronisation (what PyTorch's `cudaMallocAsync`
/// backend does), and resets its high-water marks. Dropping it sets the
/// threshold back to 0 (the driver's default) and trims the pool to 0, so
/// the cached memory goes back to the device; allocations still live stay
/// allocated (leaked until the process exits).
///
/// The default pool is the device's, not this value's: its attributes and
/// counters are shared with every other user of it in the process (the
/// runtime's `cudaMallocAsync`, libraries), and with any other
/// `CudaAsyncPool` of the same device. Keep one per device at a time, and
/// read the counters as the whole pool's. `cuMemAllocAsync` allocates from
/// the device's *current* pool, which is the default one unless something
/// calls `cuDeviceSetMemPool`; nothing in vmm does.
#[derive(Debug)]
pub struct CudaAsyncPool {
    /// The device's default pool: owned by the driver, never destroyed.
    pool: sys::CUmemoryPool,
    context: Arc<DeviceContext>,
    id: u64,
    /// Keeps the backend (and with it the device's primary context) alive.
    _cuda: Arc<Cuda>,
}

// SAFETY: a CUmemoryPool is a driver handle that the driver API lets any
// thread use, and the driver synchronises concurrent calls on it; nothing is
// mutated through `&CudaAsyncPool` on the Rust side. The other fields are
// Send and Sync.
unsafe impl Send for CudaAsyncPool {}
// SAFETY: as for `Send`.
unsafe impl Sync for CudaAsyncPool {}

impl CudaAsyncPool {
    /// The default pool of `device`, set to cache freed memory forever
    /// (release threshold `u64::MAX`), with its high-water marks reset.
    pub fn new(cuda: &Arc<Cuda>, device: DeviceId) -> Result<Self> {
        let context = Arc::clone(cuda.device("CudaAsyncPool::new", device)?);
        let _bound = context.bind()?;
        let pool = result::device_get_default_mem_pool(context.device())?;
        // From here on, an early return drops `this`, which puts the release
        // threshold back.
        let this = Self {
            pool,
            context,
            id: next_id(),
            _cuda: Arc::clone(cuda),
        };
        this.set(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)?;
        this.reset_high()?;
        tracing::debug!(%device, "CUDA default memory pool ready");
        Ok(this)
    }

    /// The device whose default pool this is.
    pub fn device(&self) -> DeviceId {
        DeviceId(self.context.ordinal() as u32)
    }

    /// Queues an allocation of `size` bytes on `stream`, which must be of
    /// this pool's device. The memory may be used by work queued on `stream`
    /// after this call, or ordered after it through events.
    pub fn alloc(&self, size: usize, stream: &CudaStream) -> Result<PeerAllocation> {
        check_size("CudaAsyncPool::alloc", size)?;
        let context = stream.context();
        if context.ordinal() != self.context.ordinal() {
            return Err(Error::invalid(
                "CudaAsyncPool::alloc",
                format!(
                    "the stream is of device {}, the pool of {}",
                    context.ordinal(),
                    self.device()
                ),
            ));
        }
        let _bound = context.bind()?;
        // SAFETY: a `CudaStream` holds a live stream until it is dropped.
        let ptr = unsafe { result::mem_alloc_async(size, stream.raw()) }?;
        Ok(PeerAllocation {
            ptr: DevicePtr(ptr),
            size,
            owner: self.id,
        })
    }

    /// Queues the free of `a` on `stream`: the memory goes back to the pool
    /// once the work queued on `stream` before it has run.
    ///
    /// The caller orders work of *other* streams that uses `a` before this
    /// call (with events), as with `cuMemFreeAsync`; otherwise that work may
    /// touch memory the pool has handed out again, which corrupts or faults
    /// device work (never host memory).
    ///
    /// An allocation of another allocator is
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument); on
    /// any error `a` is not freed and leaks.
    pub fn free(&self, a: PeerAllocation, stream: &CudaStream) -> Result<()> {
        if a.owner != self.id {
            return Err(not_ours("CudaAsyncPool::free", &a));
        }
        let _bound = stream.context().bind()?;
        // SAFETY: the stream is live until dropped. `a` came from `alloc` of
        // this pool (only `alloc` makes one with this id, and ids are never
        // reused), which used `cuMemAllocAsync`; it is consumed here and is
        // neither `Clone` nor `Copy`, so it has not been freed and cannot be
        // again. Ordering other streams' use before the free is the caller's
        // (documented above), and at worst corrupts or faults device work.
        unsafe { result::mem_free_async(a.ptr.0, stream.raw()) }
    }

    /// Bytes of device memory the pool holds now, in use or cached
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_current(&self) -> Result<u64> {
        self.get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// The most [`reserved_current`](Self::reserved_current) has been since
    /// the last reset (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub fn reserved_high(&self) -> Result<u64> {
        self.get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }

    /// Bytes of the pool allocated and not yet freed
    /// (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub fn used_current(&self) -> Result<u64> {
        self.get(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// The most [`used_current`](Self::used_current) has been since the last
    /// reset (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`).
    pub fn used_high(&self) -> Result<u64> {
        self.get(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Resets both high-water marks ([`reserved_high`](Self::reserved_high),
    /// [`used_high`](Self::used_high)), e.g. between benchmark phases.
    /// [`new`](Self::new) does it once.
    pub fn reset_high(&self) -> Result<()> {
        self.set(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        self.set(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// Gives cached memory back to the device until at most `keep` bytes
    /// stay reserved (`cuMemPoolTrimTo`). Memory backing live allocations,
    /// or frees still queued on a stream, stays: synchronise first for a
    /// full trim.
    pub fn trim_to(&self, keep: usize) -> Result<()> {
        let _bound = self.context.bind()?;
        // SAFETY: `pool` is the device's default pool, from
        // `cuDeviceGetDefaultMemPool`.
        unsafe { result::mem_pool_trim_to(self.pool, keep) }
    }

    /// Reads a `cuuint64_t` attribute of the pool.
    fn get(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let _bound = self.context.bind()?;
        // SAFETY: `pool` is the device's default pool, from
        // `cuDeviceGetDefaultMemPool`; every caller passes an attribute
        // whose value is a cuuint64_t.
        unsafe { result::mem_pool_get_attribute_u64(self.pool, attr) }
    }

    /// Sets a `cuuint64_t` attribute of the pool.
    fn set(&self, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
        let _bound = self.context.bind()?;
        // SAFETY: `pool` is the device's default pool, from
        // `cuDeviceGetDefaultMemPool`; every caller passes an attribute
        // whose value is a cuuint64_t.
        unsafe { result::mem_pool_set_attribute_u64(self.pool, attr, value) }
    }
}

/// Puts the driver's default release threshold (0) back and gives the cached
/// memory back to the device.
impl Drop for CudaAsyncPool {
    fn drop(&mut self) {
        if let Err(err) = self.set(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0) {
            report_drop_error("resetting the default pool's release threshold", &err);
        }
        if let Err(err) = self.trim_to(0) {
            report_drop_error("trimming the default pool", &err);
        }
    }
}

// ---- plain cuMemAlloc -----------------------------------------------------------

/// `cuMemAlloc` / `cuMemFree` on one device.
///
/// Free every allocation before dropping the allocator: an allocation still
/// live then can no longer be freed (no other allocator accepts it) and
/// leaks until the process exits, when the driver reclaims it.
#[derive(Debug)]
pub struct CudaMalloc {
    context: Arc<DeviceContext>,
    id: u64,
    /// Keeps the backend (and with it the device's primary context) alive.
    _cuda: Arc<Cuda>,
}

impl CudaMalloc {
    /// An allocator of `device`'s memory.
    pub fn new(cuda: &Arc<Cuda>, device: DeviceId) -> Result<Self> {
        let context = Arc::clone(cuda.device("CudaMalloc::new", device)?);
        Ok(Self {
            context,
            id: next_id(),
            _cuda: Arc::clone(cuda),
        })
    }

    /// The device the memory is on.
    pub fn device(&self) -> DeviceId {
        DeviceId(self.context.ordinal() as u32)
    }

    /// `size` bytes of device memory (`cuMemAlloc_v2`).
    pub fn alloc(&self, size: usize) -> Result<PeerAllocation> {
        check_size("CudaMalloc::alloc", size)?;
        let _bound = self.context.bind()?;
        let ptr = result::mem_alloc(size)?;
        Ok(PeerAllocation {
            ptr: DevicePtr(ptr),
            size,
            owner: self.id,
        })
    }

    /// Frees `a` (`cuMemFree_v2`). Not stream-ordered: the caller
    /// guarantees that no queued or running work still uses it (as with
    /// `cudaFree`; a violation corrupts or faults device work, never host
    /// memory).
    ///
    /// An allocation of another allocator is
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument); on
    /// any error `a` is not freed and leaks.
    pub fn free(&self, a: PeerAllocation) -> Result<()> {
        if a.owner != self.id {
            return Err(not_ours("CudaMalloc::free", &a));
        }
        let _bound = self.context.bind()?;
        // SAFETY: `a` came from `alloc` of this allocator (only `alloc` makes
        // one with this id, and ids are never reused), which used
        // `cuMemAlloc_v2`; it is consumed here and is neither `Clone` nor
        // `Copy`, so it has not been freed and cannot be again. That no work
        // still uses it is the caller's (documented above).
        unsafe { result::mem_free(a.ptr.0) }
    }
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaAsyncPool>();
    send_sync::<CudaMalloc>();
    send_sync::<PeerAllocation>();
};

#[cfg(all(test, feature = "gpu-tests"))]
mod tests {
    use std::sync::{Arc, OnceLock};

    use super::{CudaAsyncPool, CudaMalloc};
    use crate::cuda::Cuda;
    use crate::{Backend, DeviceId, ErrorKind};

    const DEV: DeviceId = DeviceId(0);
    const SIZE: usize = 1 << 20;

    fn cuda() -> Arc<Cuda> {
        static CUDA: OnceLock<Arc<Cuda>> = OnceLock::new();
        Arc::clone(CUDA.get_or_init(|| {
            Cuda::new().unwrap_or_else(|e| {
                panic!("the gpu-tests feature is on, but no CUDA device could be opened: {e}")
            })
        }))
    }

    /// One test for everything that touches the default pool, whose
    /// counters are process-wide.
    #[test]
    fn async_pool() {
        let cuda = cuda();
        let pool = CudaAsyncPool::new(&cuda, DEV).unwrap();
        assert_eq!(pool.device(), DEV);
        let stream = cuda.create_stream(DEV).unwrap();
        assert_eq!(
            pool.alloc(0, &stream).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );

        let a = pool.alloc(SIZE, &stream).unwrap();
        assert_eq!(a.size(), SIZE);
        assert_ne!(a.ptr().0, 0);
        cuda.synchronize_stream(&stream).unwrap();
        assert!(pool.used_current().unwrap() >= SIZE as u64);
        assert!(pool.used_high().unwrap() >= SIZE as u64);
        assert!(pool.reserved_high().unwrap() >= SIZE as u64);
        pool.free(a, &stream).unwrap();
        cuda.synchronize_stream(&stream).unwrap();
        // The release threshold keeps freed memory cached.
        assert!(pool.reserved_current().unwrap() >= SIZE as u64);
        pool.trim_to(0).unwrap();

        // Another allocator's allocation is refused (and leaks).
        let malloc = CudaMalloc::new(&cuda, DEV).unwrap();
        let m = malloc.alloc(SIZE).unwrap();
        assert_eq!(
            pool.free(m, &stream).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let b = pool.alloc(SIZE, &stream).unwrap();
        assert_eq!(
            malloc.free(b).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let other = CudaAsyncPool::new(&cuda, DEV).unwrap();
        let c = pool.alloc(SIZE, &stream).unwrap();
        assert_eq!(
            other.free(c, &stream).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        cuda.synchronize_stream(&stream).unwrap();
    }

    #[test]
    fn malloc() {
        let cuda = cuda();
        let malloc = CudaMalloc::new(&cuda, DEV).unwrap();
        assert_eq!(malloc.device(), DEV);
        assert_eq!(
            malloc.alloc(0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let a = malloc.alloc(SIZE).unwrap();
        let b = malloc.alloc(SIZE).unwrap();
        assert_eq!(a.size(), SIZE);
        assert_ne!(a.ptr(), b.ptr());
        malloc.free(a).unwrap();
        malloc.free(b).unwrap();
        let other = CudaMalloc::new(&cuda, DEV).unwrap();
        let c = malloc.alloc(SIZE).unwrap();
        assert_eq!(
            other.free(c).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn missing_device_is_refused() {
        let cuda = cuda();
        let missing = DeviceId(cuda.device_count().unwrap());
        assert_eq!(
            CudaAsyncPool::new(&cuda, missing).unwrap_err().kind(),
            ErrorKind::InvalidDevice
        );
        assert_eq!(
            CudaMalloc::new(&cuda, missing).unwrap_err().kind(),
            ErrorKind::InvalidDevice
        );
    }
}
