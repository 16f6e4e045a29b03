//! A device's figures as they cross the C interface (`vmpool_stats_t` in
//! include/vmpool.h): one flat `repr(C)` struct, its layout part of the
//! ABI ([`crate::ABI`]).

use crate::shim::Figures;

/// A device's figures (`vmpool_stats_t` in vmpool.h). `valid` is 0 when the
/// call failed (logged).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmpoolStats {
    pub valid: u64,
    /// Physical bytes held, and the most held.
    pub reserved_bytes: u64,
    pub reserved_high: u64,
    /// Bytes of live allocations (as the pool rounds them), and the most.
    pub used_bytes: u64,
    pub used_high: u64,
    pub allocations: u64,
    pub frees: u64,
    pub grows: u64,
    pub remaps: u64,
    pub bytes_remapped: u64,
    pub chunks_created: u64,
    pub chunks_released: u64,
    pub largest_free_range: u64,
    /// Freed in stream order, not yet known to be free for every stream.
    pub pending_bytes: u64,
    /// Frees refused: pointers vmpool did not hand out, or not any more.
    pub refused_frees: u64,
    /// With `VMPOOL_TIMING=1`: `vmpool_alloc` and `vmpool_free` calls
    /// timed, and the nanoseconds spent in them.
    pub timed_calls: u64,
    pub call_nanos: u64,
    /// CUDA graphs' private pools, and the physical bytes they hold (not
    /// in `reserved_bytes`, which is the device's pool).
    pub graph_pools: u64,
    pub graph_reserved_bytes: u64,
    /// Of the timed calls, the frees, and their nanoseconds.
    pub timed_frees: u64,
    pub free_nanos: u64,
    /// Nanoseconds spent growing (planning and driver calls), inside the
    /// timed calls when timing is on.
    pub grow_nanos: u64,
    /// Driver map and unmap calls.
    pub maps: u64,
    pub unmaps: u64,
    /// Allocations served, without the pool's lock, by memory freed on
    /// the same stream: the rest of `allocations` took the lock.
    pub same_stream_reuses: u64,
    /// Stream-ordered frees merged back into the free space when their
    /// stream missed, and those moved back once their stream passed them.
    pub frees_merged: u64,
    pub frees_completed: u64,
    /// Events recorded to learn when frees complete, and waits inserted to
    /// reuse another stream's frees.
    pub events_recorded: u64,
    pub waits_inserted: u64,
    /// Memory pools (`torch.cuda.MemPool`), the physical bytes they hold
    /// and the bytes of their live allocations (in neither
    /// `reserved_bytes` nor `used_bytes`).
    pub mem_pools: u64,
    pub mem_pool_reserved_bytes: u64,
    pub mem_pool_used_bytes: u64,
    /// Page-locked host memory the pool holds for sleeping: the kept bytes
    /// while asleep, the buffer the next sleep reuses while awake.
    pub host_bytes: u64,
    /// Steps marked ([`crate::vmpool_mark_step`]), layouts made, allocations
    /// served from a layout's slot and those that wanted one and missed,
    /// and the bytes of the layouts' regions (in `reserved_bytes`).
    pub steps: u64,
    pub step_layouts: u64,
    pub planned: u64,
    pub missed: u64,
    pub step_region_bytes: u64,
}

impl From<Figures> for VmpoolStats {
    fn from(f: Figures) -> Self {
        let s = f.stats;
        Self {
            valid: 1,
            reserved_bytes: s.reserved_bytes,
            reserved_high: f.reserved_high,
            used_bytes: s.used_bytes,
            used_high: f.used_high,
            allocations: s.allocations,
            frees: s.frees,
            grows: s.grows,
            remaps: s.remaps,
            bytes_remapped: s.bytes_remapped,
            chunks_created: s.chunks_created,
            chunks_released: s.chunks_released,
            largest_free_range: s.largest_free_range,
            pending_bytes: s.pending_bytes,
            refused_frees: f.refused_frees,
            timed_calls: f.timed_calls,
            call_nanos: f.call_nanos,
            graph_pools: f.graph_pools,
            graph_reserved_bytes: f.graph_reserved_bytes,
            timed_frees: f.timed_frees,
            free_nanos: f.free_nanos,
            grow_nanos: s.grow_nanos,
            maps: s.maps,
            unmaps: s.unmaps,
            same_stream_reuses: s.same_stream_reuses,
            frees_merged: s.frees_merged,
            frees_completed: s.frees_completed,
            events_recorded: s.events_recorded,
            waits_inserted: s.waits_inserted,
            mem_pools: f.mem_pools,
            mem_pool_reserved_bytes: f.mem_pool_reserved_bytes,
            mem_pool_used_bytes: f.mem_pool_used_bytes,
            host_bytes: s.host_bytes,
            steps: f.steps.steps,
            step_layouts: f.steps.layouts,
            planned: f.steps.planned,
            missed: f.steps.missed,
            step_region_bytes: f.steps.region_bytes,
        }
    }
}
