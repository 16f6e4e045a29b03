//! CUDA graphs' private pools, as PyTorch keeps them (`MempoolId_t`).
//!
//! A graph replays into the memory its capture allocated, including what
//! the capture freed again, so that memory must go to nothing else while
//! the graph lives. Each graph pool is a [`Pool`] of its own, named by a
//! [`GraphPoolId`]:
//!
//! ```text
//!   begin(id)          open the pool (made on first use); announce a capture
//!     allocate_async   on a capturing stream: from the open pool
//!                      on any other stream: None, the caller's pool serves it
//!     free_async       back to the pool the allocation came from
//!   end(id)            close it: the capture is over
//!   release(id)        a graph that captured into it is gone
//! ```
//!
//! A pool stays while any graph that captured into it lives (one `begin`
//! each, less one `release` each: graphs may share a pool) or any of its
//! allocations is live; then it goes, with its memory. While a pool is
//! open its capture is announced to the context
//! ([`Context::graph_capture`]), so no pool of the context makes a call
//! the driver refuses during a capture. Which capture an allocation
//! belongs to is known only by the stream capturing, so one graph pool at
//! a time may be open per device for capturing allocations to be served.
//! See Note [Graph pools] in docs/DESIGN.md.
//!
//! A graph pool's free memory is what its graphs replay into, so nothing
//! may unmap it while they live: a graph pool keeps all its memory (release
//! threshold `u64::MAX`), never moves its free units to back a growth
//! ([`PoolProps::defragment`] off: [`Defragment::Off`]), and is left alone when another pool of
//! the device runs out of memory and asks the others to release what they
//! hold unused.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use rustc_hash::FxHashMap;
use vmm::{Backend, DeviceId};

use crate::sync::lock;
use crate::{
    Allocation, Context, Defragment, Error, GraphCapture, Pool, PoolAttribute, PoolProps, Stream,
};

/// The id of a graph pool: PyTorch's `MempoolId_t`, a pair of ids (a
/// capture's own pool is `{capture id, 0}`, one from
/// `torch.cuda.graph_pool_handle()` is `{0, handle id}`). Shown as
/// `(first, second)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId {
    /// The capture's id, or 0 for a pool from a handle.
    pub first: u64,
    /// The handle's id, or 0 for a capture's own pool.
    pub second: u64,
}

impl GraphPoolId {
    /// The id `(first, second)`.
    pub const fn new(first: u64, second: u64) -> Self {
        Self { first, second }
    }
}

impl fmt::Display for GraphPoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.first, self.second)
    }
}

/// Why a graph pool call did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphPoolError {
    /// [`GraphPools::begin`] on a pool that is open: its capture has not
    /// ended.
    #[error("graph pool {0} is open already")]
    AlreadyOpen(GraphPoolId),
    /// [`GraphPools::end`] on a pool that is not open.
    #[error("graph pool {0} is not open")]
    NotOpen(GraphPoolId),
    /// [`GraphPools::release`] with no graph left that captured into the
    /// pool: released more often than begun, or the pool is gone.
    #[error("graph pool {0} has no graph left to release")]
    NotInUse(GraphPoolId),
    /// [`GraphPools::free_async`] of an allocation whose pool does not
    /// exist.
    #[error("graph pool {0} does not exist")]
    NoSuchPool(GraphPoolId),
    /// An allocation on a capturing stream while more than one graph pool
    /// is open: which capture it belongs to cannot be told.
    #[error(
        "an allocation on a capturing stream while {open} graph pools are open: \
         which capture it belongs to cannot be told (one capture at a time per device)"
    )]
    WhichCapture {
        /// How many graph pools were open.
        open: usize,
    },
    /// The pool refused (out of memory, a stream of another device, ...),
    /// or a driver call failed.
    #[error(transparent)]
    Pool(#[from] Error),
}

/// An allocation from a graph pool, with the pool's id, for
/// [`GraphPools::free_async`].
#[derive(Debug)]
pub struct GraphAllocation {
    /// The allocation.
    pub allocation: Allocation,
    /// The graph pool it came from.
    pub pool: GraphPoolId,
}

/// What closing a graph pool ([`GraphPools::end`], [`GraphPools::release`])
/// left open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// It was not open: nothing changed.
    WasNotOpen,
    /// Closed; other graph pools of the device are still open.
    OthersOpen,
    /// Closed, and it was the last open one: no capture these pools
    /// announced is under way any more.
    LastOpen,
}

/// The figures of a device's graph pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphPoolsStats {
    /// Graph pools that exist: in use by a graph, or with live allocations.
    pub pools: usize,
    /// Of those, the open ones (between `begin` and `end`).
    pub open: usize,
    /// Physical bytes they hold together.
    pub reserved_bytes: u64,
}

/// One graph pool.
struct GraphPool<B: Backend> {
    pool: Pool<B>,
    /// Between begin and end: capturing allocations come here, and the
    /// capture is announced to the context.
    open: Option<GraphCapture>,
    /// Graphs that captured into it and live: one per begin, less one per
    /// release. At none, the pool goes with its last allocation.
    graphs: usize,
    /// Allocations handed out from it and not yet freed.
    live: usize,
}

/// The graph pools of one device (see the module's notes).
///
/// `repr(C)`, with the count of open pools first and everything else
/// behind one pointer: the count is what an allocation reads to learn
/// whether to ask anything more, so a caller that keeps graph pools beside
/// its own hot fields pays two words for them.
#[repr(C)]
pub struct GraphPools<B: Backend> {
    open: AtomicUsize,
    state: Box<State<B>>,
}

struct State<B: Backend> {
    pools: Mutex<FxHashMap<GraphPoolId, GraphPool<B>>>,
    /// What a new graph pool is made with.
    props: PoolProps,
}

impl<B: Backend> fmt::Debug for GraphPools<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPools")
            .field("device", &self.device())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend> GraphPools<B> {
    /// Graph pools of `props.device`, each created with `props` but with
    /// [`PoolProps::defragment`] off. A graph pool keeps all its memory
    /// until it goes: its graphs replay into what their captures freed (see
    /// the module's notes).
    pub fn new(props: PoolProps) -> Self {
        Self {
            open: AtomicUsize::new(0),
            state: Box::new(State {
                pools: Mutex::default(),
                props: PoolProps {
                    defragment: Defragment::Off,
                    ..props
                },
            }),
        }
    }

    /// The device whose graph pools these are.
    pub fn device(&self) -> DeviceId {
        self.state.props.device
    }

    fn pools(&self) -> MutexGuard<'_, FxHashMap<GraphPoolId, GraphPool<B>>> {
        lock(&self.state.pools)
    }

    /// Opens graph pool `id`, creating it in `context` on first use: until
    /// [`GraphPools::end`], allocations on a capturing stream come from it,
    /// and a capture is announced to `context` (PyTorch's
    /// `beginAllocateToPool`, at the start of a capture). Each begin counts
    /// a graph that uses the pool, until its [`GraphPools::release`].
    /// `context` is the one whose pools and streams these graphs use.
    pub fn begin(&self, context: &Context<B>, id: GraphPoolId) -> Result<(), GraphPoolError> {
        let mut pools = self.pools();
        let graph = match pools.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(GraphPool {
                pool: self.create(context)?,
                open: None,
                graphs: 0,
                live: 0,
            }),
        };
        if graph.open.is_some() {
            return Err(GraphPoolError::AlreadyOpen(id));
        }
        graph.open = Some(context.graph_capture());
        graph.graphs += 1;
        self.open.fetch_add(1, Ordering::AcqRel);
        tracing::debug!(device = self.device().0, %id, "graph pool open");
        Ok(())
    }

    fn create(&self, context: &Context<B>) -> Result<Pool<B>, Error> {
        let props = &self.state.props;
        let pool = context.create_pool(props)?;
        pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
        pool.keep_unused_memory();
        tracing::debug!(device = self.device().0, ?props, "graph pool created");
        Ok(pool)
    }

    /// Closes graph pool `id`: capturing allocations no longer come to it,
    /// and its capture is no longer announced (PyTorch's
    /// `endAllocateToPool`, at the end of a capture). Its memory stays for
    /// its graph.
    pub fn end(&self, id: GraphPoolId) -> Result<Closed, GraphPoolError> {
        match self.pools().get_mut(&id) {
            Some(graph) if graph.open.is_some() => Ok(self.close(graph)),
            _ => Err(GraphPoolError::NotOpen(id)),
        }
    }

    /// A graph that captured into pool `id` is gone (PyTorch's
    /// `releasePool`); the pool is closed if it was open. Once every graph
    /// that captured into it is, the pool goes, with its memory, when its
    /// last allocation is freed. Until then its free memory stays: a graph
    /// replays into what its capture freed.
    pub fn release(&self, id: GraphPoolId) -> Result<Closed, GraphPoolError> {
        let mut pools = self.pools();
        let Some(graph) = pools.get_mut(&id).filter(|g| g.graphs > 0) else {
            return Err(GraphPoolError::NotInUse(id));
        };
        let closed = self.close(graph);
        graph.graphs -= 1;
        self.drop_if_unused(&mut pools, id);
        Ok(closed)
    }

    /// Closes `graph` if it is open, keeping `open` its count.
    fn close(&self, graph: &mut GraphPool<B>) -> Closed {
        if graph.open.take().is_none() {
            return Closed::WasNotOpen;
        }
        match self.open.fetch_sub(1, Ordering::AcqRel) {
            1 => Closed::LastOpen,
            _ => Closed::OthersOpen,
        }
    }

    /// Drops graph pool `id` once no graph uses it and nothing of it is
    /// allocated.
    fn drop_if_unused(&self, pools: &mut FxHashMap<GraphPoolId, GraphPool<B>>, id: GraphPoolId) {
        if pools.get(&id).is_some_and(|g| g.graphs == 0 && g.live == 0) {
            pools.remove(&id);
            tracing::debug!(device = self.device().0, %id, "graph pool dropped");
        }
    }

    /// Whether a graph pool is open: only then can
    /// [`GraphPools::allocate_async`] serve anything. One atomic load.
    #[inline]
    pub fn any_open(&self) -> bool {
        self.open.load(Ordering::Acquire) > 0
    }

    /// `size` bytes in stream order on `stream` from the open graph pool,
    /// if `stream` is capturing; `None` when it is not, or no graph pool is
    /// open (then the caller's own pool serves it). An error when more than
    /// one is open and the stream is capturing
    /// ([`GraphPoolError::WhichCapture`]).
    pub fn allocate_async(
        &self,
        size: u64,
        stream: &Stream<B>,
    ) -> Result<Option<GraphAllocation>, GraphPoolError> {
        if !self.any_open() {
            return Ok(None);
        }
        let mut pools = self.pools();
        let mut open = pools.iter_mut().filter(|(_, g)| g.open.is_some());
        let Some((&id, graph)) = open.next() else {
            // Closed meanwhile: not a capture these pools were told of.
            return Ok(None);
        };
        let others = open.count();
        if !graph
            .pool
            .backend()
            .stream_capturing(stream.raw())
            .map_err(Error::from)?
        {
            return Ok(None);
        }
        if others > 0 {
            return Err(GraphPoolError::WhichCapture { open: others + 1 });
        }
        let allocation = graph.pool.allocate_async(size, stream)?;
        graph.live += 1;
        Ok(Some(GraphAllocation {
            allocation,
            pool: id,
        }))
    }

    /// Frees `allocation` in stream order on `stream` to its graph pool
    /// (as [`Pool::free_async`]). The last free of a pool no graph uses
    /// drops the pool.
    pub fn free_async(
        &self,
        allocation: GraphAllocation,
        stream: &Stream<B>,
    ) -> Result<(), GraphPoolError> {
        let id = allocation.pool;
        let pool = match self.pools().get(&id) {
            Some(graph) => graph.pool.clone(),
            None => return Err(GraphPoolError::NoSuchPool(id)),
        };
        // Outside the lock: a free may wait for the pool's own lock.
        pool.free_async(allocation.allocation, stream)?;
        let mut pools = self.pools();
        if let Some(graph) = pools.get_mut(&id) {
            graph.live -= 1;
        }
        self.drop_if_unused(&mut pools, id);
        Ok(())
    }

    /// Whether graph pool `id` exists.
    pub fn contains(&self, id: GraphPoolId) -> bool {
        self.pools().contains_key(&id)
    }

    /// How many graph pools exist and are open, and what they hold.
    pub fn stats(&self) -> GraphPoolsStats {
        let pools = self.pools();
        GraphPoolsStats {
            pools: pools.len(),
            open: pools.values().filter(|g| g.open.is_some()).count(),
            reserved_bytes: pools.values().map(|g| g.pool.stats().reserved_bytes).sum(),
        }
    }
}
