//! Memory pools that a thread allocates from while it is in them, as
//! PyTorch's `torch.cuda.MemPool` and `torch.cuda.use_mem_pool` route a
//! thread's allocations (vLLM keeps a model's weights in one this way).
//! Each is a [`Pool`] of its own, named by a [`MemPoolId`]:
//!
//! ```text
//!   create(id)         the pool, empty
//!   begin(id)          the calling thread is in it: its allocations come
//!                      from it, on any stream
//!     allocate_async   a thread in a pool: from it; any other: None, the
//!                      caller's pool serves it
//!     free_async       back to the pool the allocation came from, from any thread
//!   end(id)            the calling thread leaves it
//!   release(id)        the pool goes, with its memory and its reservation
//! ```
//!
//! A thread is in at most one pool of a device at a time. Unlike a graph
//! pool ([`crate::GraphPools`]) a memory pool is routed by thread, not by
//! capturing stream, and its free memory is its own to give back: it trims
//! and is trimmed as any pool. See Note [Memory pools] in docs/DESIGN.md.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::{self, ThreadId};

use rustc_hash::FxHashMap;
use vmm::{Backend, DeviceId};

use crate::sync::lock;
use crate::{Allocation, Context, Error, Pool, PoolAttribute, PoolProps, PoolStats, Stream};

/// The id of a memory pool: PyTorch's `MempoolId_t` of a user's pool
/// (`{0, n}`, as `torch.cuda.graph_pool_handle()` hands out). Shown as
/// `(first, second)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemPoolId {
    /// 0 for a user's pool.
    pub first: u64,
    /// The user's pool's number.
    pub second: u64,
}

impl MemPoolId {
    /// The id `(first, second)`.
    pub const fn new(first: u64, second: u64) -> Self {
        Self { first, second }
    }
}

impl fmt::Display for MemPoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.first, self.second)
    }
}

/// Why a memory pool call did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemPoolError {
    /// [`MemPools::create`] of an id that exists.
    #[error("memory pool {0} exists already")]
    Exists(MemPoolId),
    /// A call naming a pool that does not exist (never created, or
    /// released).
    #[error("memory pool {0} does not exist")]
    NoSuchPool(MemPoolId),
    /// [`MemPools::begin`] on a thread that is in a pool of this device
    /// already (the same or another): one at a time per thread.
    #[error("this thread is in memory pool {current} already: it cannot enter {id} too")]
    AlreadyIn {
        /// The pool asked for.
        id: MemPoolId,
        /// The pool the thread is in.
        current: MemPoolId,
    },
    /// [`MemPools::end`] on a thread that is not in the pool.
    #[error("this thread is not in memory pool {0}")]
    NotIn(MemPoolId),
    /// [`MemPools::release`] while threads are in the pool.
    #[error("memory pool {id} cannot be released while {threads} threads are in it")]
    InUse {
        /// The pool.
        id: MemPoolId,
        /// Threads in it.
        threads: usize,
    },
    /// [`MemPools::release`] with [`Release::Now`] while allocations of
    /// the pool are live.
    #[error("memory pool {id} cannot be released now: {live} of its allocations are live (free them first)")]
    Live {
        /// The pool.
        id: MemPoolId,
        /// Its live allocations.
        live: usize,
    },
    /// The pool refused (out of memory, a stream of another device, ...),
    /// or a driver call failed.
    #[error(transparent)]
    Pool(#[from] Error),
}

/// When [`MemPools::release`] lets a pool go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Now, or not at all: refused while any allocation of it is live
    /// ([`MemPoolError::Live`]).
    Now,
    /// Now if nothing of it is allocated, else with its last free (as
    /// PyTorch drops a `MemPool` whose tensors outlive it).
    WithLastFree,
}

/// What [`MemPools::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The pool is gone, with the physical bytes it held.
    Gone {
        /// Physical bytes it held.
        reserved_bytes: u64,
    },
    /// It goes with the last of its `live` allocations.
    WithLastFree {
        /// Its live allocations.
        live: usize,
    },
}

/// An allocation from a memory pool, with the pool's id, for
/// [`MemPools::free_async`].
#[derive(Debug)]
pub struct MemPoolAllocation {
    /// The allocation.
    pub allocation: Allocation,
    /// The memory pool it came from.
    pub pool: MemPoolId,
}

/// The figures of a device's memory pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemPoolsStats {
    /// Memory pools that exist (released ones with live allocations too).
    pub pools: usize,
    /// Physical bytes they hold together.
    pub reserved_bytes: u64,
    /// Bytes of their live allocations, as the pools round them.
    pub used_bytes: u64,
}

/// One memory pool.
struct MemPool<B: Backend> {
    pool: Pool<B>,
    /// Threads in it now.
    threads: Vec<ThreadId>,
    /// Allocations handed out from it and not yet freed.
    live: usize,
    /// Released with live allocations: goes with the last of them.
    released: bool,
}

/// The memory pools of one device (see the module's notes).
///
/// `repr(C)`, with the count of threads in a pool first and everything
/// else behind one pointer: the count is what an allocation reads to learn
/// whether to ask anything more.
#[repr(C)]
pub struct MemPools<B: Backend> {
    /// Threads in a pool, over all pools.
    entered: AtomicUsize,
    state: Box<State<B>>,
}

struct State<B: Backend> {
    pools: Mutex<FxHashMap<MemPoolId, MemPool<B>>>,
    /// What a new memory pool is made with.
    props: PoolProps,
    /// Its release threshold.
    release_threshold: u64,
}

impl<B: Backend> fmt::Debug for MemPools<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPools")
            .field("device", &self.device())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend> MemPools<B> {
    /// Memory pools of `props.device`, each created with `props` and
    /// `release_threshold` ([`PoolAttribute::ReleaseThreshold`]).
    pub fn new(props: PoolProps, release_threshold: u64) -> Self {
        Self {
            entered: AtomicUsize::new(0),
            state: Box::new(State {
                pools: Mutex::default(),
                props,
                release_threshold,
            }),
        }
    }

    /// The device whose memory pools these are.
    pub fn device(&self) -> DeviceId {
        self.state.props.device
    }

    fn pools(&self) -> MutexGuard<'_, FxHashMap<MemPoolId, MemPool<B>>> {
        lock(&self.state.pools)
    }

    /// Creates memory pool `id` in `context`, empty, no thread in it.
    pub fn create(&self, context: &Context<B>, id: MemPoolId) -> Result<(), MemPoolError> {
        let mut pools = self.pools();
        if pools.contains_key(&id) {
            return Err(MemPoolError::Exists(id));
        }
        let pool = context.create_pool(&self.state.props)?;
        pool.set_attribute(
            PoolAttribute::ReleaseThreshold,
            self.state.release_threshold,
        )?;
        pools.insert(
            id,
            MemPool {
                pool,
                threads: Vec::new(),
                live: 0,
                released: false,
            },
        );
        tracing::debug!(device = self.device().0, %id, "memory pool created");
        Ok(())
    }

    /// The calling thread enters pool `id`: until [`MemPools::end`], its
    /// allocations come from it (PyTorch's `beginAllocateToPool` with a
    /// filter for the thread, from `use_mem_pool`).
    pub fn begin(&self, id: MemPoolId) -> Result<(), MemPoolError> {
        let me = thread::current().id();
        let mut pools = self.pools();
        if pools.get(&id).is_none_or(|p| p.released) {
            return Err(MemPoolError::NoSuchPool(id));
        }
        if let Some((&current, _)) = pools.iter().find(|(_, p)| p.threads.contains(&me)) {
            return Err(MemPoolError::AlreadyIn { id, current });
        }
        pools.get_mut(&id).expect("checked above").threads.push(me);
        self.entered.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// The calling thread leaves pool `id` (PyTorch's `endAllocateToPool`,
    /// at the end of `use_mem_pool`).
    pub fn end(&self, id: MemPoolId) -> Result<(), MemPoolError> {
        let me = thread::current().id();
        let mut pools = self.pools();
        let Some(p) = pools.get_mut(&id) else {
            return Err(MemPoolError::NoSuchPool(id));
        };
        let Some(at) = p.threads.iter().position(|&t| t == me) else {
            return Err(MemPoolError::NotIn(id));
        };
        p.threads.swap_remove(at);
        self.entered.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }

    /// Lets pool `id` go, with its physical memory and its reservation:
    /// now, or with its last free when `when` allows it. Refused while a
    /// thread is in it.
    pub fn release(&self, id: MemPoolId, when: Release) -> Result<Released, MemPoolError> {
        let mut pools = self.pools();
        let Some(p) = pools.get_mut(&id).filter(|p| !p.released) else {
            return Err(MemPoolError::NoSuchPool(id));
        };
        if !p.threads.is_empty() {
            let threads = p.threads.len();
            return Err(MemPoolError::InUse { id, threads });
        }
        if p.live > 0 {
            let live = p.live;
            if when == Release::Now {
                return Err(MemPoolError::Live { id, live });
            }
            p.released = true;
            tracing::debug!(device = self.device().0, %id, live, "memory pool goes with its last free");
            return Ok(Released::WithLastFree { live });
        }
        let gone = pools.remove(&id).expect("found above");
        drop(pools);
        Ok(Released::Gone {
            reserved_bytes: self.drop_pool(id, gone),
        })
    }

    /// Drops `gone`'s pool, outside the lock (a pool's drop waits for its
    /// streams' pending frees); the physical bytes it held.
    fn drop_pool(&self, id: MemPoolId, gone: MemPool<B>) -> u64 {
        let reserved_bytes = gone.pool.stats().reserved_bytes;
        drop(gone);
        tracing::debug!(device = self.device().0, %id, reserved_bytes, "memory pool dropped");
        reserved_bytes
    }

    /// Whether a thread is in a memory pool: only then can
    /// [`MemPools::allocate_async`] serve anything. One atomic load.
    #[inline]
    pub fn any_entered(&self) -> bool {
        self.entered.load(Ordering::Acquire) > 0
    }

    /// `size` bytes in stream order on `stream` from the pool the calling
    /// thread is in; `None` when it is in none (then the caller's own pool
    /// serves it).
    pub fn allocate_async(
        &self,
        size: u64,
        stream: &Stream<B>,
    ) -> Result<Option<MemPoolAllocation>, MemPoolError> {
        if !self.any_entered() {
            return Ok(None);
        }
        let me = thread::current().id();
        let mut pools = self.pools();
        let Some((&id, p)) = pools.iter_mut().find(|(_, p)| p.threads.contains(&me)) else {
            return Ok(None);
        };
        let allocation = p.pool.allocate_async(size, stream)?;
        p.live += 1;
        Ok(Some(MemPoolAllocation {
            allocation,
            pool: id,
        }))
    }

    /// Frees `allocation` in stream order on `stream` to its memory pool
    /// (as [`Pool::free_async`]), from any thread. The last free of a
    /// released pool drops it.
    pub fn free_async(
        &self,
        allocation: MemPoolAllocation,
        stream: &Stream<B>,
    ) -> Result<(), MemPoolError> {
        let id = allocation.pool;
        let pool = match self.pools().get(&id) {
            Some(p) => p.pool.clone(),
            None => return Err(MemPoolError::NoSuchPool(id)),
        };
        // Outside the lock: a free may wait for the pool's own lock.
        pool.free_async(allocation.allocation, stream)?;
        drop(pool);
        let mut pools = self.pools();
        let Some(p) = pools.get_mut(&id) else {
            return Ok(());
        };
        p.live -= 1;
        if p.released && p.live == 0 {
            let gone = pools.remove(&id).expect("found above");
            drop(pools);
            self.drop_pool(id, gone);
        }
        Ok(())
    }

    /// Releases the unused memory of every memory pool down to `keep`
    /// bytes each (as [`Pool::trim_to`]).
    pub fn trim_to(&self, keep: u64) -> Result<(), Error> {
        let pools: Vec<Pool<B>> = self.pools().values().map(|p| p.pool.clone()).collect();
        pools.iter().try_for_each(|p| p.trim_to(keep))
    }

    /// Whether memory pool `id` exists and is not released.
    pub fn contains(&self, id: MemPoolId) -> bool {
        self.pools().get(&id).is_some_and(|p| !p.released)
    }

    /// Pool `id`'s own figures, if it exists.
    pub fn pool_stats(&self, id: MemPoolId) -> Option<PoolStats> {
        self.pools().get(&id).map(|p| p.pool.stats())
    }

    /// How many memory pools exist, and what they hold.
    pub fn stats(&self) -> MemPoolsStats {
        let pools = self.pools();
        pools.values().fold(
            MemPoolsStats {
                pools: pools.len(),
                ..MemPoolsStats::default()
            },
            |mut sum, p| {
                let s = p.pool.stats();
                sum.reserved_bytes += s.reserved_bytes;
                sum.used_bytes += s.used_bytes;
                sum
            },
        )
    }
}
