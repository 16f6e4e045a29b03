//! What the C functions do, in safe Rust: per device, a pool created on
//! first use, the caller's streams as vmpool streams (the stream table,
//! `streams.rs`), and a table of the pointers handed out (`pointers.rs`),
//! so that a free names its allocation by pointer and a pointer vmpool
//! never gave out is refused, not trusted.
//!
//! ```text
//!   vmpool_alloc(size, device, stream)
//!     stream handle ──► Stream (borrowed from the caller, adopted once)
//!     pool of device ─► allocate_async ──► live[ptr] = Allocation
//!   vmpool_record_stream(ptr, other)
//!     live[ptr].used_on += other
//!   vmpool_free(ptr, size, device, stream)
//!     live.remove(ptr) ──► stream waits for each `used_on` stream's work so far
//!                      ──► free_async on the stream; not there: refused
//!   vmpool_begin_allocate_to_pool(device, id) .. vmpool_end_allocate_to_pool
//!     an allocation on a capturing stream ──► the graph's own pool, `id`
//!     `id` a memory pool's: the calling thread's allocations ──► pool `id`
//! ```
//!
//! **CUDA graphs.** Each device has a [`GraphPools`] for PyTorch's private
//! pools of graph captures, which PyTorch opens, closes and releases
//! through the begin / end / release hooks (Note [Graph pools] in
//! docs/DESIGN.md): while one is open, an allocation on a capturing stream
//! comes from it, and a free goes back to the pool its allocation came
//! from. The C layer's own part: a free of memory with recorded users
//! (`record_stream`) is put off while a graph pool is open, since the
//! freeing stream may then wait for no event recorded outside the capture
//! (`Device::deferred_frees`).
//!
//! **Memory pools.** Each device also has [`MemPools`] for
//! `torch.cuda.MemPool` (`shim/mem_pools.rs`, Note [Memory pools] in
//! docs/DESIGN.md): the same begin / end hooks, for an id vmpool made a
//! memory pool of, put the calling thread in it and take it out.
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

use vmpool::vmm::{Backend, DeviceId};
use vmpool::{
    Closed, Context, Event, GraphAllocation, GraphPoolId, GraphPools, MemPoolAllocation, MemPools,
    Pool, PoolAttribute, PoolProps, PoolSnapshot, PoolStats, Stream,
};

pub use crate::call_error::CallError;
use crate::config::Config;
use crate::pointers::{DeferredFree, Live, Owner, PointerTable};
use crate::refusals::{Refusals, Say};
pub use crate::streams::Borrow;
use crate::streams::StreamTable;

/// `repr(C)` and aligned to a cache line: what every call reads (the pool,
/// the live table, whether a graph pool is open, the stream table, whether
/// a thread is in a memory pool) comes first, on two lines; a call under
/// PyTorch finds them cold (docs/RESULTS.md, "Calls on cold caches").
#[repr(C, align(64))]
struct Device<B: Backend> {
    pool: OnceLock<Pool<B>>,
    /// What vmpool handed out and the caller has not freed, by pointer.
    live: PointerTable<B>,
    /// CUDA graphs' private pools, by PyTorch's id: only while one is open
    /// (its first word, on the first line) does an allocation ask whether
    /// its stream is capturing.
    graphs: GraphPools<B>,
    /// The caller's streams by handle, adopted on first use and forgotten
    /// at each wait for the whole device ([`Shim::wait_and_forget_streams`]).
    streams: StreamTable<B>,
    /// `torch.cuda.MemPool`s, by PyTorch's id: only while a thread is in
    /// one (its first word) does an allocation ask whether its thread is.
    mem_pools: MemPools<B>,
    id: DeviceId,
    /// Serialises the pool's creation, which can fail and is retried.
    creating: Mutex<()>,
    /// Frees of allocations with recorded users (`record_stream`) made
    /// while a graph pool is open (a capture under way), with the stream
    /// each was freed on: done when the last one closes. During a capture
    /// the freeing stream may wait for no event recorded outside it, and
    /// the memory must not be reused before the users' work, so such a
    /// free waits, as PyTorch's own allocator defers it.
    deferred_frees: Mutex<Vec<DeferredFree<B>>>,
    /// a wait takes what the event captured when it is made, so an event
    /// serves again at once, without a driver call to create it.
    idle_events: Mutex<Vec<Event<B>>>,
    /// Frees refused: pointers vmpool did not hand out (or not any more).
    refused_frees: Refusals,
    /// With `VMPOOL_TIMING=1`: allocations and frees timed, and their
    /// time; and of those, the frees.
    timed_calls: AtomicU64,
    call_nanos: AtomicU64,
    timed_frees: AtomicU64,
    free_nanos: AtomicU64,
}

/// Which call [`Shim::timed`] times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Alloc,
    Free,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `repr(C)`: the devices and the settings (whose first field, `timing`,
/// every call reads) first.
#[repr(C)]
pub struct Shim<B: Backend> {
    devices: Vec<Device<B>>,
    config: Config,
    context: Context<B>,
    borrow: Borrow<B>,
}

/// A pool's figures as the C interface reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Figures {
    pub reserved_high: u64,
    pub used_high: u64,
    pub stats: PoolStats,
    pub refused_frees: u64,
    pub timed_calls: u64,
    pub call_nanos: u64,
    /// Of the timed calls, the frees, and their time.
    pub timed_frees: u64,
    pub free_nanos: u64,
    /// CUDA graphs' private pools, and the physical bytes they hold.
    pub graph_pools: u64,
    pub graph_reserved_bytes: u64,
    /// Memory pools (`torch.cuda.MemPool`), the physical bytes they hold
    /// and the bytes of their live allocations.
    pub mem_pools: u64,
    pub mem_pool_reserved_bytes: u64,
    pub mem_pool_used_bytes: u64,
    /// What the pool's step layouts have done.
    pub steps: vmpool::StepCounters,
}

/// The properties of `device`'s pools, the device's own and its graph and
/// memory pools, as configured; the device's own also reserves the
/// configured address space ([`Shim::new_pool`]).
fn pool_props(config: &Config, device: DeviceId) -> PoolProps {
    PoolProps {
        chunk_size: config.chunk_size,
        chunk_divisor: config.chunk_divisor,
        granule_growth_below: config.granule_growth_below,
        fresh_start: config.fresh_start,
        handle_type: config.handle_type,
        ..PoolProps::new(device)
    }
}

impl<B: Backend> Shim<B> {
    pub fn new(backend: Arc<B>, config: Config, borrow: Borrow<B>) -> vmpool::Result<Self> {
        let context = Context::new(backend)?;
        let count = context.backend().device_count()?;
        let devices = (0..count)
            .map(|d| Device {
                pool: OnceLock::new(),
                live: PointerTable::default(),
                graphs: GraphPools::new(pool_props(&config, DeviceId(d))),
                mem_pools: MemPools::new(
                    pool_props(&config, DeviceId(d)),
                    config.release_threshold,
                ),
                streams: StreamTable::default(),
                id: DeviceId(d),
                creating: Mutex::new(()),
                idle_events: Mutex::default(),
                deferred_frees: Mutex::default(),
                refused_frees: Refusals::default(),
                timed_calls: AtomicU64::new(0),
                call_nanos: AtomicU64::new(0),
                timed_frees: AtomicU64::new(0),
                free_nanos: AtomicU64::new(0),
            })
            .collect();
        Ok(Self {
            devices,
            config,
            context,
            borrow,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn device(&self, device: i64) -> Result<&Device<B>, CallError> {
        // Not `ok_or`: it would build (and drop) the error on every call.
        match usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
        {
            Some(dev) => Ok(dev),
            None => Err(CallError::NoDevice(device)),
        }
    }

    /// The device's pool, made (and made current) on first use.
    fn pool<'d>(&self, device: &'d Device<B>) -> vmpool::Result<&'d Pool<B>> {
        if let Some(pool) = device.pool.get() {
            return Ok(pool);
        }
        let _creating = lock(&device.creating);
        if let Some(pool) = device.pool.get() {
            return Ok(pool);
        }
        let pool = self.new_pool(device.id)?;
        self.context.set_current_pool(&pool)?;
        tracing::info!(device = device.id.0, "vmpool: pool created");
        Ok(device.pool.get_or_init(|| pool))
    }

    /// The pool of `device`: the configured chunk sizes, threshold and
    /// address space.
    fn new_pool(&self, device: DeviceId) -> vmpool::Result<Pool<B>> {
        let props = PoolProps {
            va_size: self.config.va_size,
            ..pool_props(&self.config, device)
        };
        let pool = self.context.create_pool(&props)?;
        pool.set_attribute(
            PoolAttribute::ReleaseThreshold,
            self.config.release_threshold,
        )?;
        tracing::debug!(
            device = device.0,
            ?props,
            release_threshold = self.config.release_threshold,
            "vmpool: new pool"
        );
        Ok(pool)
    }

    /// Calls `f` with the vmpool stream for the caller's `handle`, adopted
    /// on first use ([`StreamTable::with`]). `f` is not called when the
    /// adoption fails.
    #[inline]
    fn with_stream<T>(
        &self,
        device: &Device<B>,
        handle: usize,
        f: impl FnOnce(&Stream<B>) -> T,
    ) -> vmpool::Result<T> {
        device
            .streams
            .with(handle, || self.adopt(device, handle), f)
    }

    /// The caller's stream `handle` as a vmpool stream.
    #[cold]
    fn adopt(&self, device: &Device<B>, handle: usize) -> vmpool::Result<Stream<B>> {
        let raw = (self.borrow)(self.context.backend(), device.id, handle)?;
        self.context.adopt_stream(raw, device.id)
    }

    /// Waits for every stream vmpool has seen on `device`, then forgets
    /// them ([`StreamTable::forget_all`] says why).
    fn wait_and_forget_streams(&self, device: &Device<B>) -> vmpool::Result<()> {
        self.context.synchronize_device(device.id)?;
        device.streams.forget_all();
        Ok(())
    }

    /// `size` bytes on `device` in stream order on `stream`; `Ok(0)` for
    /// zero bytes, as `cudaMallocAsync` gives NULL.
    pub fn alloc(&self, size: i64, device: i64, stream: usize) -> Result<u64, CallError> {
        let dev = self.device(device)?;
        self.timed(dev, Call::Alloc, || self.alloc_on(dev, size, stream))
    }

    /// `f()`, counted in `dev`'s call time when timing is on.
    fn timed<T>(&self, dev: &Device<B>, call: Call, f: impl FnOnce() -> T) -> T {
        if !self.config.timing {
            return f();
        }
        let start = Instant::now();
        let out = f();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        dev.call_nanos.fetch_add(nanos, Ordering::Relaxed);
        dev.timed_calls.fetch_add(1, Ordering::Relaxed);
        if call == Call::Free {
            dev.free_nanos.fetch_add(nanos, Ordering::Relaxed);
            dev.timed_frees.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    fn alloc_on(&self, dev: &Device<B>, size: i64, stream: usize) -> Result<u64, CallError> {
        let size = u64::try_from(size).map_err(|_| CallError::Size(size))?;
        if size == 0 {
            return Ok(0);
        }
        let pool = self.pool(dev)?;
        // A capture first (Note [Memory pools]: precedence), then the
        // memory pool the thread is in.
        if dev.graphs.any_open() {
            if let Some(ptr) = self.alloc_for_capture(dev, size, stream)? {
                return Ok(ptr);
            }
        }
        if dev.mem_pools.any_entered() {
            if let Some(ptr) = self.alloc_for_mem_pool(dev, size, stream)? {
                return Ok(ptr);
            }
        }
        let allocation = self.with_stream(dev, stream, |s| pool.allocate_async(size, s))??;
        let ptr = allocation.ptr().0;
        dev.live.insert(ptr, Live::new(allocation, Owner::Device));
        Ok(ptr)
    }

    /// While a graph pool is open: `size` bytes from it when `stream` is
    /// capturing, else `None` (the device's pool serves it).
    #[cold]
    fn alloc_for_capture(
        &self,
        dev: &Device<B>,
        size: u64,
        stream: usize,
    ) -> Result<Option<u64>, CallError> {
        let taken = self.with_stream(dev, stream, |s| dev.graphs.allocate_async(size, s))?;
        let Some(GraphAllocation { allocation, pool }) =
            taken.map_err(|err| CallError::graph(dev.id, err))?
        else {
            return Ok(None);
        };
        let ptr = allocation.ptr().0;
        dev.live
            .insert(ptr, Live::new(allocation, Owner::Graph(pool)));
        Ok(Some(ptr))
    }

    /// Opens graph pool `id` (made on first use): until it is closed,
    /// allocations on capturing streams of `device` come from it
    /// (PyTorch's `beginAllocateToPool`, at the start of a capture).
    pub fn begin_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        dev.graphs
            .begin(&self.context, id)
            .map_err(|err| CallError::graph(dev.id, err))
    }

    /// Closes graph pool `id`: allocations go to the device's pool again;
    /// what the pool handed out is freed to it (PyTorch's
    /// `endAllocateToPool`, at the end of a capture).
    pub fn end_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        let closed = dev
            .graphs
            .end(id)
            .map_err(|err| CallError::graph(dev.id, err))?;
        if closed == Closed::LastOpen {
            self.free_deferred(dev);
        }
        Ok(())
    }

    /// A graph that captured into pool `id` is gone (PyTorch's
    /// `releasePool`): once every graph that did is, the pool goes, with
    /// its memory, when its last allocation is freed.
    pub fn release_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        let closed = dev
            .graphs
            .release(id)
            .map_err(|err| CallError::graph(dev.id, err))?;
        if closed == Closed::LastOpen {
            self.free_deferred(dev);
        }
        Ok(())
    }

    /// Notes that the work queued on `stream` from now until `ptr` is
    /// freed may use it: the free makes its own stream wait for that work
    /// first, so the memory is not reused under it (PyTorch's
    /// `record_stream`, which names no device: the pointer's is found).
    pub fn record_stream(&self, ptr: u64, stream: usize) -> Result<(), CallError> {
        let dev = self
            .devices
            .iter()
            .find(|d| d.live.contains(ptr))
            .ok_or(CallError::NotLive { ptr })?;
        // Adopted here, so that a stream vmpool cannot use is reported now
        // and the free has nothing to fail on.
        let adopted = self.with_stream(dev, stream, Stream::clone)?;
        // Freed by another thread meanwhile: nothing left to order.
        if !dev.live.add_user(ptr, adopted) {
            return Err(CallError::NotLive { ptr });
        }
        Ok(())
    }

    /// Frees what `alloc` returned, in stream order on `stream`. A pointer
    /// vmpool did not hand out, or handed out and saw freed, changes nothing
    /// and is an error.
    pub fn free(&self, ptr: u64, size: i64, device: i64, stream: usize) -> Result<(), CallError> {
        if ptr == 0 {
            return Ok(());
        }
        let dev = self.device(device)?;
        self.timed(dev, Call::Free, || self.free_on(dev, ptr, size, stream))
    }

    fn free_on(
        &self,
        dev: &Device<B>,
        ptr: u64,
        size: i64,
        stream: usize,
    ) -> Result<(), CallError> {
        let Some(live) = dev.live.remove(ptr) else {
            return Err(self.refuse(dev, ptr));
        };
        if size >= 0 && size as u64 != live.allocation.size() {
            tracing::warn!(
                ptr = format_args!("{ptr:#x}"),
                given = size,
                allocated = live.allocation.size(),
                "vmpool: free names another size than was allocated; freeing the allocation"
            );
        }
        if !live.used_on().is_empty() && dev.graphs.any_open() {
            lock(&dev.deferred_frees).push(DeferredFree { ptr, live, stream });
            return Ok(());
        }
        self.hand_back(dev, ptr, live, stream)
    }

    /// Frees `live` (just taken out of the live table) on `stream`, after
    /// making the stream wait for its recorded users; on failure it goes
    /// back in the table, unchanged.
    fn hand_back(
        &self,
        dev: &Device<B>,
        ptr: u64,
        live: Live<B>,
        stream: usize,
    ) -> Result<(), CallError> {
        let owner = live.owner();
        // There: it was made before the first allocation.
        let pool = self.pool(dev)?;
        let mut live = Some(live);
        let freed = self.with_stream(dev, stream, |s| -> Result<(), CallError> {
            let users = live.as_ref().expect("called once").used_on();
            self.wait_for_users(dev, s, users)?;
            let allocation = live.take().expect("called once").allocation;
            match owner {
                Owner::Device => pool.free_async(allocation, s)?,
                Owner::Graph(id) => dev
                    .graphs
                    .free_async(
                        GraphAllocation {
                            allocation,
                            pool: id,
                        },
                        s,
                    )
                    .map_err(|err| CallError::graph(dev.id, err))?,
                Owner::Mem(id) => dev
                    .mem_pools
                    .free_async(
                        MemPoolAllocation {
                            allocation,
                            pool: id,
                        },
                        s,
                    )
                    .map_err(|err| CallError::mem_pool(dev.id, err))?,
            }
            Ok(())
        });
        let err = match freed {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(err)) => err,
            Err(err) => err.into(),
        };
        // Not handed over (the stream could not be adopted, or it could not
        // be made to wait for the allocation's other users): nothing
        // changed, it stays live.
        if let Some(live) = live {
            dev.live.insert(ptr, live);
        }
        Err(err)
    }

    /// Does the frees deferred while a capture was under way (see
    /// `Device::deferred_frees`), once none is; a failed one is logged and
    /// its allocation stays live.
    fn free_deferred(&self, dev: &Device<B>) {
        let deferred = std::mem::take(&mut *lock(&dev.deferred_frees));
        for DeferredFree { ptr, live, stream } in deferred {
            if let Err(err) = self.hand_back(dev, ptr, live, stream) {
                tracing::error!("vmpool: a free deferred past a graph capture: {err}");
            }
        }
    }

    /// Makes `stream` wait for the work queued so far on each of `users`
    /// (other than itself; all of `dev`): an event recorded on each,
    /// waited for.
    fn wait_for_users(
        &self,
        dev: &Device<B>,
        stream: &Stream<B>,
        users: &[Stream<B>],
    ) -> vmpool::Result<()> {
        for user in users.iter().filter(|&u| u != stream) {
            let idle = lock(&dev.idle_events).pop();
            let event = match idle {
                Some(event) => event,
                None => self.context.create_event(dev.id)?,
            };
            let waited = self
                .context
                .record_event(&event, user)
                .and_then(|()| self.context.stream_wait_event(stream, &event));
            lock(&dev.idle_events).push(event);
            waited?;
        }
        Ok(())
    }

    /// Counts a refused free of `ptr` and says what to log: the first
    /// ones in full, then a count now and then (`refusals.rs`).
    #[cold]
    fn refuse(&self, dev: &Device<B>, ptr: u64) -> CallError {
        let device = dev.id.0;
        match dev.refused_frees.count() {
            Say::InFull { last } => {
                let mut why = self.why_not_ours(ptr, dev);
                if last {
                    why += "; later refused frees are counted, and logged as counts";
                }
                CallError::NotOurs { ptr, device, why }
            }
            Say::Count { more, total } => CallError::RefusedFrees {
                device,
                more,
                total,
                next: total.saturating_mul(10),
            },
            Say::Nothing => CallError::Unlogged,
        }
    }

    /// Why `ptr` is not a live allocation of `dev`, as precisely as the
    /// tables tell (the cold path of a refused free).
    fn why_not_ours(&self, ptr: u64, dev: &Device<B>) -> String {
        if let Some(inside) = dev.live.containing(ptr) {
            return format!(
                "it points inside the allocation at {:#x} ({} bytes); free that pointer",
                inside.start,
                inside.end - inside.start
            );
        }
        for other in self.devices.iter().filter(|d| d.id != dev.id) {
            if other.live.contains(ptr) {
                return format!("it was allocated on device {}", other.id.0);
            }
        }
        "vmpool did not allocate it, or it was freed already".to_owned()
    }

    /// Waits for every stream vmpool has seen on `device`; then their
    /// frees are free for every stream, and the pool keeps at most its
    /// release threshold.
    pub fn synchronize(&self, device: i64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        Ok(self.wait_and_forget_streams(dev)?)
    }

    /// Releases unused memory of `device`'s pool down to `keep` bytes.
    pub fn trim(&self, device: i64, keep: u64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        match dev.pool.get() {
            Some(pool) => Ok(pool.trim_to(keep)?),
            None => Ok(()),
        }
    }

    /// Returns every device's unused memory (PyTorch's `empty_cache`): waits
    /// for the streams vmpool has seen, then trims each device's pool and
    /// memory pools to nothing unused. Graph pools keep their memory for
    /// their graphs' replays; while one is open (a capture under way, which
    /// a wait would spoil) the pools are trimmed without waiting.
    pub fn empty_cache(&self) -> Result<(), CallError> {
        for dev in &self.devices {
            let Some(pool) = dev.pool.get() else {
                continue;
            };
            // Gives up an idle step layout, freed in stream order: see below.
            pool.trim_to(0)?;
            if !dev.graphs.any_open() {
                self.wait_and_forget_streams(dev)?;
            }
            pool.trim_to(0)?;
            dev.mem_pools.trim_to(0)?;
        }
        Ok(())
    }

    /// Limits `device`'s pool to `fraction` of the device's memory
    /// (PyTorch's `set_per_process_memory_fraction`): growth past it fails,
    /// as out of memory; what the pool holds above it stays until freed
    /// and trimmed. Graph pools are not limited.
    pub fn set_memory_fraction(&self, fraction: f64, device: i64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(CallError::Fraction(fraction));
        }
        let total = self
            .context
            .backend()
            .mem_info(dev.id)
            .map_err(vmpool::Error::from)?
            .total as f64;
        self.pool(dev)?
            .set_max_size(Some((fraction * total) as u64));
        Ok(())
    }

    /// Resets the high-water marks to the current figures.
    pub fn reset_peaks(&self, device: i64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        if let Some(pool) = dev.pool.get() {
            pool.set_attribute(PoolAttribute::ReservedMemHigh, 0)?;
            pool.set_attribute(PoolAttribute::UsedMemHigh, 0)?;
        }
        Ok(())
    }

    /// The device's figures; all zero before its first allocation.
    pub fn figures(&self, device: i64) -> Result<Figures, CallError> {
        let dev = self.device(device)?;
        let graphs = dev.graphs.stats();
        let mems = dev.mem_pools.stats();
        let calls = Figures {
            refused_frees: dev.refused_frees.total(),
            timed_calls: dev.timed_calls.load(Ordering::Relaxed),
            call_nanos: dev.call_nanos.load(Ordering::Relaxed),
            timed_frees: dev.timed_frees.load(Ordering::Relaxed),
            free_nanos: dev.free_nanos.load(Ordering::Relaxed),
            graph_pools: graphs.pools as u64,
            graph_reserved_bytes: graphs.reserved_bytes,
            mem_pools: mems.pools as u64,
            mem_pool_reserved_bytes: mems.reserved_bytes,
            mem_pool_used_bytes: mems.used_bytes,
            ..Figures::default()
        };
        Ok(match dev.pool.get() {
            Some(pool) => Figures {
                reserved_high: pool.attribute(PoolAttribute::ReservedMemHigh),
                used_high: pool.attribute(PoolAttribute::UsedMemHigh),
                stats: pool.stats(),
                steps: pool.step_counters(),
                ..calls
            },
            None => calls,
        })
    }

    /// Writes out the allocation traces being recorded (`VMPOOL_RECORD`).
    pub fn flush_traces(&self) -> Result<(), CallError> {
        for dev in &self.devices {
            if let Some(pool) = dev.pool.get() {
                pool.flush_trace().map_err(CallError::Trace)?;
            }
        }
        Ok(())
    }

    /// The pool's address-space dump (`Pool::snapshot`), if it exists.
    pub fn snapshot(&self, device: i64) -> Result<Option<String>, CallError> {
        Ok(self.pool_snapshot(device)?.map(|s| s.to_string()))
    }

    /// The pool's address-space picture, if it exists (memory history).
    pub fn pool_snapshot(&self, device: i64) -> Result<Option<PoolSnapshot>, CallError> {
        let dev = self.device(device)?;
        Ok(dev.pool.get().map(|p| p.snapshot()))
    }
}

mod mem_pools;
mod sleep;
mod steps;
#[cfg(test)]
mod tests;
