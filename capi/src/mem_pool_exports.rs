//! The C calls of memory pools (`torch.cuda.MemPool`; vmpool.h's "Memory
//! pools"): `vmpool.torch.MemPool` makes one per pool with
//! [`vmpool_mem_pool_create`], PyTorch's `use_mem_pool` enters and leaves
//! it through the graph-pool hooks, and [`vmpool_mem_pool_release`] gives
//! its memory back (Note [Memory pools] in docs/DESIGN.md).

use std::ffi::c_int;

use vmpool::{Release, Released};

use crate::shim::Figures;
use crate::{call, Global, VmpoolMempoolId, VmpoolStats};

/// [`vmpool_mem_pool_release`]'s `when`: now, refused (-1, logged) while
/// an allocation of the pool is live.
pub const VMPOOL_RELEASE_NOW: c_int = 0;
/// [`vmpool_mem_pool_release`]'s `when`: now if nothing of the pool is
/// allocated, else with its last free.
pub const VMPOOL_RELEASE_WITH_LAST_FREE: c_int = 1;

/// Makes `pool` a memory pool of `device`, empty: from now on
/// [`crate::vmpool_begin_allocate_to_pool`] with its id puts the calling
/// thread in it, so that the thread's allocations come from it until
/// [`crate::vmpool_end_allocate_to_pool`]. The id must be no graph pool's
/// (`torch.cuda.graph_pool_handle()` hands out fresh ones). 0, or -1 on
/// failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_mem_pool_create(device: c_int, pool: VmpoolMempoolId) -> c_int {
    call(
        "mem_pool_create",
        -1,
        |g| with_shim!(g, s => s.create_mem_pool(i64::from(device), pool.into()).map(|()| 0)),
    )
}

/// Lets memory pool `pool` go, with its physical memory and its address
/// space: `when` is [`VMPOOL_RELEASE_NOW`] or
/// [`VMPOOL_RELEASE_WITH_LAST_FREE`]. 0 when it is gone, 1 when it goes
/// with the last of its live allocations, -1 when refused (logged): an
/// unknown id, a thread still in it, or (now) allocations live.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_mem_pool_release(
    device: c_int,
    pool: VmpoolMempoolId,
    when: c_int,
) -> c_int {
    let when = match when {
        VMPOOL_RELEASE_NOW => Release::Now,
        VMPOOL_RELEASE_WITH_LAST_FREE => Release::WithLastFree,
        _ => {
            tracing::error!("vmpool: mem_pool_release: `when` {when} is neither 0 (now) nor 1 (with the last free)");
            return -1;
        }
    };
    call("mem_pool_release", -1, |g| {
        with_shim!(g, s => s.release_mem_pool(i64::from(device), pool.into(), when)).map(
            |released| match released {
                Released::Gone { .. } => 0,
                Released::WithLastFree { .. } => 1,
            },
        )
    })
}

/// Memory pool `pool`'s own figures: the pool's fields of
/// `vmpool_stats_t` (reserved and used bytes, counts), the rest 0. `valid`
/// is 0 when there is no such pool (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_mem_pool_stats(device: c_int, pool: VmpoolMempoolId) -> VmpoolStats {
    call("mem_pool_stats", VmpoolStats::default(), |g| {
        with_shim!(g, s => s.mem_pool_stats(i64::from(device), pool.into())).map(|stats| {
            VmpoolStats::from(Figures {
                stats,
                ..Figures::default()
            })
        })
    })
}
