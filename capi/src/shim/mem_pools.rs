//! `torch.cuda.MemPool` for the C layer: a memory pool per id the caller
//! made one of ([`Shim::create_mem_pool`], from `vmpool.torch.MemPool`),
//! which the graph-pool hooks then serve for that id: begin puts the
//! calling thread in it (PyTorch's `use_mem_pool`), end takes it out
//! (Note [Memory pools] in docs/DESIGN.md). Any other id is a graph's.

use vmpool::vmm::Backend;
use vmpool::{MemPoolAllocation, MemPoolId, PoolStats, Release, Released};

use super::{CallError, Device, Shim};
use crate::pointers::{Live, Owner};

impl<B: Backend> Shim<B> {
    /// Makes memory pool `id` on `device`, empty, no thread in it. An id
    /// a graph pool has is refused: the hooks could not tell them apart.
    pub fn create_mem_pool(&self, device: i64, id: MemPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        // The device's pool first: a free is handed back through it.
        self.pool(dev)?;
        let graph = vmpool::GraphPoolId::new(id.first, id.second);
        if dev.graphs.contains(graph) {
            return Err(CallError::IdOfAGraph { device, id });
        }
        dev.mem_pools
            .create(&self.context, id)
            .map_err(|err| CallError::mem_pool(dev.id, err))
    }

    /// Whether `id` is a memory pool of `device` (not released): then the
    /// graph-pool hooks serve it as one.
    pub fn is_mem_pool(&self, device: i64, id: MemPoolId) -> Result<bool, CallError> {
        Ok(self.device(device)?.mem_pools.contains(id))
    }

    /// Puts the calling thread in memory pool `id` (PyTorch's
    /// `beginAllocateToPool` from `use_mem_pool`): its allocations on
    /// `device`, on any stream, come from it until [`Shim::leave_mem_pool`]
    /// (one on a capturing stream while a graph pool is open goes to the
    /// graph's pool first).
    pub fn enter_mem_pool(&self, device: i64, id: MemPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        dev.mem_pools
            .begin(id)
            .map_err(|err| CallError::mem_pool(dev.id, err))
    }

    /// Takes the calling thread out of memory pool `id` (PyTorch's
    /// `endAllocateToPool`, at the end of `use_mem_pool`).
    pub fn leave_mem_pool(&self, device: i64, id: MemPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        dev.mem_pools
            .end(id)
            .map_err(|err| CallError::mem_pool(dev.id, err))
    }

    /// Lets memory pool `id` go with its physical memory and reservation:
    /// now, refused while an allocation of it is live ([`Release::Now`]),
    /// or with its last free ([`Release::WithLastFree`]).
    pub fn release_mem_pool(
        &self,
        device: i64,
        id: MemPoolId,
        when: Release,
    ) -> Result<Released, CallError> {
        let dev = self.device(device)?;
        let released = dev
            .mem_pools
            .release(id, when)
            .map_err(|err| CallError::mem_pool(dev.id, err))?;
        tracing::debug!(device, %id, ?released, "vmpool: memory pool released");
        Ok(released)
    }

    /// Memory pool `id`'s own figures.
    pub fn mem_pool_stats(&self, device: i64, id: MemPoolId) -> Result<PoolStats, CallError> {
        let dev = self.device(device)?;
        dev.mem_pools
            .pool_stats(id)
            .ok_or(CallError::NoMemPool { device, id })
    }

    /// While a thread is in a memory pool: `size` bytes from the one the
    /// calling thread is in, else `None` (the device's pool serves it).
    #[cold]
    pub(super) fn alloc_for_mem_pool(
        &self,
        dev: &Device<B>,
        size: u64,
        stream: usize,
    ) -> Result<Option<u64>, CallError> {
        let taken = self.with_stream(dev, stream, |s| dev.mem_pools.allocate_async(size, s))?;
        let Some(MemPoolAllocation { allocation, pool }) =
            taken.map_err(|err| CallError::mem_pool(dev.id, err))?
        else {
            return Ok(None);
        };
        let ptr = allocation.ptr().0;
        dev.live
            .insert(ptr, Live::new(allocation, Owner::Mem(pool)));
        Ok(Some(ptr))
    }
}
