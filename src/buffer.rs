//! `Buffer<T>`: a typed, owning allocation, freed on its stream when
//! dropped.

use std::fmt;
use std::marker::PhantomData;

use vmm::{Backend, DeviceId, DevicePtr};

use crate::{Allocation, Error, Pool, Result, Stream};

/// `len` values of `T` in device memory from a pool, allocated in stream
/// order on a stream and freed on the same stream when dropped (like
/// `cudaMallocAsync` / `cudaFreeAsync` on one stream): work queued on the
/// stream before the drop still sees the memory, and the stream may reuse
/// it at once after. Work on other streams must be ordered before the drop
/// (an event), as with any stream-ordered free.
///
/// Dropping never panics: a failed free is logged (`tracing`, at error
/// level) and the memory stays with the pool until it goes. [`Buffer::free`]
/// frees and returns the error instead.
///
/// `T` only types the memory: vmpool never reads or writes it on the host.
pub struct Buffer<T, B: Backend> {
    /// The allocation's address, kept as a plain integer so that a kernel
    /// argument can point at it (see the `cudarc` feature).
    pub(crate) raw_ptr: u64,
    len: usize,
    /// `None` only once freed, inside `free` or `drop`.
    allocation: Option<Allocation>,
    pool: Pool<B>,
    stream: Stream<B>,
    _values: PhantomData<T>,
}

impl<T, B: Backend> Buffer<T, B> {
    /// Allocates room for `len` values of `T` from `pool` on `stream`;
    /// returns at once. The memory is uninitialised. `len` must be at least
    /// 1 and `T` not zero-sized ([`Error::InvalidSize`]).
    pub fn alloc(pool: &Pool<B>, len: usize, stream: &Stream<B>) -> Result<Self> {
        let size = std::mem::size_of::<T>()
            .checked_mul(len)
            .and_then(|bytes| u64::try_from(bytes).ok())
            .ok_or(Error::InvalidSize {
                requested: u64::MAX,
                reason: "the buffer's size in bytes overflows",
            })?;
        if size == 0 {
            return Err(Error::InvalidSize {
                requested: 0,
                reason: "a buffer holds at least one value of a type with a size",
            });
        }
        let allocation = pool.allocate_async(size, stream)?;
        Ok(Self {
            raw_ptr: allocation.ptr().0,
            len,
            allocation: Some(allocation),
            pool: pool.clone(),
            stream: stream.clone(),
            _values: PhantomData,
        })
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no value (never, for a buffer [`Buffer::alloc`]
    /// made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its size in bytes: `len() * size_of::<T>()`.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address of its first value (256-byte aligned).
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.raw_ptr)
    }

    /// The device its memory is on.
    pub fn device(&self) -> DeviceId {
        self.pool.device()
    }

    /// The stream it was allocated on, and is freed on.
    pub fn stream(&self) -> &Stream<B> {
        &self.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> &Pool<B> {
        &self.pool
    }

    /// Frees it on its stream now, returning what a drop would only log.
    pub fn free(mut self) -> Result<()> {
        match self.allocation.take() {
            Some(allocation) => self.pool.free_async(allocation, &self.stream),
            None => Ok(()),
        }
    }

    /// Gives up ownership: the allocation, for [`Pool::free_async`] (or
    /// another stream's free) by the caller.
    pub fn into_allocation(mut self) -> Allocation {
        match self.allocation.take() {
            Some(allocation) => allocation,
            // Only `free`, `drop` and this method take it, each consuming
            // the buffer.
            None => unreachable!("a live buffer holds its allocation"),
        }
    }
}

impl<T, B: Backend> Drop for Buffer<T, B> {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            let ptr = allocation.ptr();
            if let Err(err) = self.pool.free_async(allocation, &self.stream) {
                tracing::error!(%ptr, bytes = self.num_bytes(), error = %err,
                    "dropping a buffer: the free failed; the memory stays with the pool");
            }
        }
    }
}

impl<T, B: Backend> fmt::Debug for Buffer<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("type", &std::any::type_name::<T>())
            .field("ptr", &self.ptr())
            .field("len", &self.len)
            .field("device", &self.device())
            .finish()
    }
}
