//! What the C functions do, in safe Rust: per device, a pool created on
//! first use, the caller's streams as vmpool streams, and a table of the
//! pointers handed out, so that a free names its allocation by pointer and
//! a pointer vmpool never gave out is refused, not trusted.
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
//! ```
//!
//! **CUDA graphs.** A graph replays into the memory its capture allocated,
//! including what the capture freed again, so that memory must not go to
//! anything else while the graph lives. PyTorch gives each capture a
//! private pool id (`MempoolId_t`) and calls the begin / end / release
//! hooks around it; here each id gets a pool of its own. While one is open
//! (begin .. end), an allocation on a stream that is capturing goes to it,
//! and the capture is announced to every pool (`Context::graph_capture`:
//! they make no call the driver refuses during a capture); a free goes to
//! the pool its allocation came from; the pool goes when every graph that
//! captured into it is released and its last allocation is freed.
#![deny(unsafe_code)]

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::time::Instant;

use rustc_hash::FxHashMap;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::{
    Allocation, Context, Event, GraphCapture, Pool, PoolAttribute, PoolProps, PoolStats, Stream,
};

/// A whole number of at least 1 the environment asked for.
fn at_least_one<T: std::str::FromStr + PartialOrd + From<u8>>(
    name: &'static str,
    value: String,
    expected: &'static str,
) -> Result<T, ConfigError> {
    match value.trim().parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        _ => Err(ConfigError::Other {
            name,
            value,
            expected,
        }),
    }
}

/// Bytes the environment asked for: a number with an optional binary
/// suffix (`K`, `M`, `G`, `T`, with or without `iB`), or `max`.
fn parse_bytes(name: &str, value: &str) -> Result<u64, ConfigError> {
    let bad = || ConfigError::Bytes {
        name: name.to_owned(),
        value: value.to_owned(),
    };
    let v = value.trim();
    if v.eq_ignore_ascii_case("max") {
        return Ok(u64::MAX);
    }
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (number, suffix) = v.split_at(digits);
    let number = u64::from_str(number).map_err(|_| bad())?;
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KIB" => 10,
        "M" | "MIB" => 20,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(bad()),
    };
    number.checked_mul(1 << shift).ok_or_else(bad)
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}={value:?}: expected bytes, such as 1073741824, 512MiB, 2G or max")]
    Bytes { name: String, value: String },
    #[error("{name}={value:?}: expected {expected}")]
    Other {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
}

/// Which driver layer the library runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cuda,
    /// The host backend, for tests without a GPU; stream handles are then
    /// opaque keys.
    Host,
}

/// The C layer's growth-chunk divisor unless `VMPOOL_CHUNK_DIVISOR` says
/// otherwise: an eighth of the library's ([`vmpool::DEFAULT_CHUNK_DIVISOR`]),
/// so chunks up to eight times as large once the pool holds 2 GiB (below
/// that, growth is by granules either way:
/// [`vmpool::DEFAULT_GRANULE_GROWTH_BELOW`]). Under PyTorch each chunk's
/// driver calls cost step time when the pool grows (about 60 us a new
/// chunk behind queued work): GPT-2 training's first large step maps 631
/// chunks instead of 1,634 at 1024, and the footprint stays under 1.005
/// (1.0047 on ResNet-50, generation's as before); README.md, "PyTorch".
pub const DEFAULT_CHUNK_DIVISOR: u64 = 256;

/// The library's settings, from the environment (README.md, "PyTorch").
///
/// `repr(C)`: `timing`, which every call reads, first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[repr(C)]
pub struct Config {
    /// `VMPOOL_TIMING`: `1` to time every `vmpool_alloc` and `vmpool_free`
    /// (two clock reads a call) and report the total in the statistics;
    /// default `0`.
    pub timing: bool,
    /// `VMPOOL_BACKEND`: `cuda` (default) or `host`.
    pub backend: BackendChoice,
    /// `VMPOOL_RELEASE_THRESHOLD`: bytes each pool keeps across
    /// `vmpool_synchronize`; default `max` (keep everything, as PyTorch's
    /// own allocator does).
    pub release_threshold: u64,
    /// `VMPOOL_CHUNK_SIZE`: the largest growth chunk; default the pool's.
    pub chunk_size: Option<u64>,
    /// `VMPOOL_CHUNK_DIVISOR`: growth chunks of at most the pool's reserved
    /// bytes over this (`PoolProps::chunk_divisor`); default
    /// [`DEFAULT_CHUNK_DIVISOR`]; `off`: every growth by whole
    /// `VMPOOL_CHUNK_SIZE` chunks.
    pub chunk_divisor: Option<u64>,
    /// `VMPOOL_GRANULE_GROWTH_BELOW`: with a divisor, growth by granules
    /// while the pool holds fewer bytes than this
    /// (`PoolProps::granule_growth_below`); default
    /// [`vmpool::DEFAULT_GRANULE_GROWTH_BELOW`].
    pub granule_growth_below: u64,
    /// `VMPOOL_HOST_DEVICES` and `VMPOOL_HOST_MEMORY` (per device): the host
    /// backend's devices; default 1 of 4 GiB.
    pub host_devices: u32,
    pub host_memory: u64,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The settings from `lookup(name)`, for tests without touching the
    /// process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let bytes =
            |name: &str, default: u64| lookup(name).map_or(Ok(default), |v| parse_bytes(name, &v));
        let backend = match lookup("VMPOOL_BACKEND").as_deref() {
            None | Some("cuda") => BackendChoice::Cuda,
            Some("host") => BackendChoice::Host,
            Some(other) => {
                return Err(ConfigError::Other {
                    name: "VMPOOL_BACKEND",
                    value: other.to_owned(),
                    expected: "cuda or host",
                })
            }
        };
        let host_devices = lookup("VMPOOL_HOST_DEVICES")
            .map(|v| at_least_one("VMPOOL_HOST_DEVICES", v, "a number of devices, at least 1"))
            .transpose()?
            .unwrap_or(1);
        let timing = match lookup("VMPOOL_TIMING").as_deref().map(str::trim) {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(ConfigError::Other {
                    name: "VMPOOL_TIMING",
                    value: other.to_owned(),
                    expected: "0 or 1",
                })
            }
        };
        let chunk_size = match lookup("VMPOOL_CHUNK_SIZE") {
            None => None,
            Some(v) => Some(parse_bytes("VMPOOL_CHUNK_SIZE", &v)?),
        };
        let chunk_divisor = match lookup("VMPOOL_CHUNK_DIVISOR") {
            None => Some(DEFAULT_CHUNK_DIVISOR),
            Some(v) => vmpool::parse_chunk_divisor(&v).map_err(|_| ConfigError::Other {
                name: "VMPOOL_CHUNK_DIVISOR",
                value: v,
                expected: "a whole number, at least 1, or off",
            })?,
        };
        Ok(Self {
            backend,
            release_threshold: bytes("VMPOOL_RELEASE_THRESHOLD", u64::MAX)?,
            chunk_size,
            chunk_divisor,
            granule_growth_below: bytes(
                "VMPOOL_GRANULE_GROWTH_BELOW",
                vmpool::DEFAULT_GRANULE_GROWTH_BELOW,
            )?,
            host_devices,
            host_memory: bytes("VMPOOL_HOST_MEMORY", 4 << 30)?,
            timing,
        })
    }
}

/// Why a call did nothing. Logged by the C layer, which can only return
/// NULL or -1.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("device {0} does not exist")]
    NoDevice(i64),
    #[error("invalid size {0}")]
    Size(i64),
    #[error("free of {ptr:#x} on device {device}: {why}")]
    NotOurs { ptr: u64, device: u32, why: String },
    #[error("{ptr:#x} is not a live allocation of vmpool's on any device")]
    NotLive { ptr: u64 },
    #[error(transparent)]
    Vmpool(#[from] vmpool::Error),
    #[error("writing the allocation trace: {0}")]
    Trace(std::io::Error),
    #[error(
        "an allocation on a capturing stream while {open} graph pools are open on device {device}: \
         vmpool cannot tell which capture it belongs to (one capture at a time per device)"
    )]
    WhichCapture { device: u32, open: usize },
    #[error("memory fraction {0}: not in (0, 1]")]
    Fraction(f64),
    #[error("graph pool {id:?} on device {device}: {why}")]
    GraphPool {
        device: u32,
        id: GraphPoolId,
        why: &'static str,
    },
}

/// PyTorch's id of a CUDA graph's private memory pool (`MempoolId_t`).
pub type GraphPoolId = (u64, u64);

/// A CUDA graph's private pool (see the module's notes).
struct GraphPool<B: Backend> {
    pool: Pool<B>,
    /// Between begin and end: allocations on capturing streams come here,
    /// and the capture is announced to every pool.
    open: Option<GraphCapture>,
    /// Captures into it whose graphs live: one per begin, less one per
    /// release (graphs may share a pool). At none, the pool goes with its
    /// last allocation.
    uses: usize,
    /// Allocations handed out from it and not yet freed.
    live: usize,
}

/// How the C layer turns a caller's stream handle into a backend stream:
/// the one `unsafe` step, which it keeps to itself.
pub type Borrow<B> = fn(&B, DeviceId, usize) -> vmpool::vmm::Result<<B as Backend>::Stream>;

/// `repr(C)` and aligned to a cache line: what every call reads (whether a
/// graph pool is open, the pool, the live table, the stream table) comes
/// first, on two lines; a call under PyTorch finds them cold
/// (docs/RESULTS.md, "Calls on cold caches").
#[repr(C, align(64))]
struct Device<B: Backend> {
    /// How many graph pools are open (see `graphs`).
    open_graphs: AtomicUsize,
    pool: OnceLock<Pool<B>>,
    /// What vmpool handed out and the caller has not freed, by pointer.
    live: Mutex<FxHashMap<u64, Live<B>>>,
    /// The caller's streams by handle, adopted on first use and forgotten
    /// at each wait for the whole device ([`Shim::wait_and_forget_streams`]).
    streams: RwLock<FxHashMap<usize, Stream<B>>>,
    id: DeviceId,
    /// Serialises the pool's creation, which can fail and is retried.
    creating: Mutex<()>,
    /// CUDA graphs' private pools, by PyTorch's id: only while one is open
    /// does an allocation ask whether its stream is capturing.
    graphs: Mutex<FxHashMap<GraphPoolId, GraphPool<B>>>,
    /// Frees of allocations with recorded users (`record_stream`) made
    /// while a capture is under way, with the stream each was freed on:
    /// done when the capture ends. During a capture the freeing stream may
    /// wait for no event recorded outside it, and the memory must not be
    /// reused before the users' work, so such a free waits, as PyTorch's
    /// own allocator defers it.
    deferred_frees: Mutex<Vec<(u64, Live<B>, usize)>>,
    /// Events for a free to wait for the streams recorded as users, kept:
    /// a wait takes what the event captured when it is made, so an event
    /// serves again at once, without a driver call to create it.
    idle_events: Mutex<Vec<Event<B>>>,
    /// Frees refused: pointers vmpool did not hand out (or not any more).
    refused_frees: AtomicU64,
    /// With `VMPOOL_TIMING=1`: allocations and frees timed, and their
    /// time; and of those, the frees.
    timed_calls: AtomicU64,
    call_nanos: AtomicU64,
    timed_frees: AtomicU64,
    free_nanos: AtomicU64,
}

/// A live allocation, and the other streams the caller said use it
/// (`vmpool_record_stream`, PyTorch's `Tensor.record_stream`): its free
/// waits for the work queued on them until then.
struct Live<B: Backend> {
    allocation: Allocation,
    used_on: Vec<Stream<B>>,
    /// The graph pool it came from; `None`: the device's pool.
    graph: Option<GraphPoolId>,
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

impl<B: Backend> Device<B> {
    /// Closes `graph` if it is open, keeping `open_graphs` its count;
    /// whether that closed the last open one (then the deferred frees can
    /// go, see [`Shim::free_deferred`]).
    fn close_graph(&self, graph: &mut GraphPool<B>) -> bool {
        graph.open.take().is_some() && self.open_graphs.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Drops graph pool `id` once no graph uses it and nothing of it is
    /// allocated.
    fn drop_graph_if_unused(
        &self,
        graphs: &mut FxHashMap<GraphPoolId, GraphPool<B>>,
        id: GraphPoolId,
    ) {
        if graphs.get(&id).is_some_and(|g| g.uses == 0 && g.live == 0) {
            graphs.remove(&id);
            tracing::debug!(device = self.id.0, ?id, "vmpool: graph pool dropped");
        }
    }
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
}

impl<B: Backend> Shim<B> {
    pub fn new(backend: Arc<B>, config: Config, borrow: Borrow<B>) -> vmpool::Result<Self> {
        let context = Context::new(backend)?;
        let count = context.backend().device_count()?;
        let devices = (0..count)
            .map(|d| Device {
                open_graphs: AtomicUsize::new(0),
                pool: OnceLock::new(),
                live: Mutex::default(),
                streams: RwLock::default(),
                id: DeviceId(d),
                creating: Mutex::new(()),
                graphs: Mutex::default(),
                idle_events: Mutex::default(),
                deferred_frees: Mutex::default(),
                refused_frees: AtomicU64::new(0),
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
        usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or(CallError::NoDevice(device))
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

    /// A pool of `device` with the configured chunk size and threshold.
    fn new_pool(&self, device: DeviceId) -> vmpool::Result<Pool<B>> {
        let props = PoolProps {
            chunk_size: self.config.chunk_size,
            chunk_divisor: self.config.chunk_divisor,
            granule_growth_below: self.config.granule_growth_below,
            ..PoolProps::new(device)
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
    /// on first use. `f` runs under the table's read lock, so a call neither
    /// clones the stream nor writes to the table. `f` is not called when the
    /// adoption fails.
    fn with_stream<T>(
        &self,
        device: &Device<B>,
        handle: usize,
        f: impl FnOnce(&Stream<B>) -> T,
    ) -> vmpool::Result<T> {
        loop {
            {
                let streams = device
                    .streams
                    .read()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some(s) = streams.get(&handle) {
                    return Ok(f(s));
                }
            }
            // Found next time round, unless a synchronize forgot it in
            // between (then it is adopted again).
            self.adopt(device, handle)?;
        }
    }

    /// Waits for every stream vmpool has seen on `device`, then empties its
    /// stream table: the wait has left no free pending on any of them. A
    /// handle the caller destroyed may come back as another stream's; its
    /// old entry would carry what vmpool knew of the old stream's order
    /// (the other streams it had waited for) to the new one, which never
    /// waited. Adopted afresh, a stream starts knowing nothing, and the
    /// table does not grow with every stream the caller ever made.
    fn wait_and_forget_streams(&self, device: &Device<B>) -> vmpool::Result<()> {
        self.context.synchronize_device(device.id)?;
        device
            .streams
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        Ok(())
    }

    /// Adds the caller's stream `handle` to the table, unless another
    /// thread just did.
    #[cold]
    fn adopt(&self, device: &Device<B>, handle: usize) -> vmpool::Result<()> {
        let mut streams = device
            .streams
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let std::collections::hash_map::Entry::Vacant(slot) = streams.entry(handle) {
            let raw = (self.borrow)(self.context.backend(), device.id, handle)?;
            slot.insert(self.context.adopt_stream(raw, device.id)?);
        }
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
        if dev.open_graphs.load(Ordering::Acquire) > 0 {
            if let Some(ptr) = self.alloc_for_capture(dev, size, stream)? {
                return Ok(ptr);
            }
        }
        let allocation = self.with_stream(dev, stream, |s| pool.allocate_async(size, s))??;
        let ptr = allocation.ptr().0;
        let live = Live {
            allocation,
            used_on: Vec::new(),
            graph: None,
        };
        lock(&dev.live).insert(ptr, live);
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
        let backend = self.context.backend();
        let taken = self.with_stream(dev, stream, |s| -> Result<Option<u64>, CallError> {
            if !backend
                .stream_capturing(s.raw())
                .map_err(vmpool::Error::from)?
            {
                return Ok(None);
            }
            let mut graphs = lock(&dev.graphs);
            let mut open = graphs.iter_mut().filter(|(_, g)| g.open.is_some());
            let (Some((&id, graph)), None) = (open.next(), open.next()) else {
                let open = graphs.values().filter(|g| g.open.is_some()).count();
                if open == 0 {
                    // Closed meanwhile: not a capture vmpool was told of.
                    return Ok(None);
                }
                return Err(CallError::WhichCapture {
                    device: dev.id.0,
                    open,
                });
            };
            let allocation = graph.pool.allocate_async(size, s)?;
            graph.live += 1;
            let ptr = allocation.ptr().0;
            let live = Live {
                allocation,
                used_on: Vec::new(),
                graph: Some(id),
            };
            lock(&dev.live).insert(ptr, live);
            Ok(Some(ptr))
        })?;
        taken
    }

    /// Opens graph pool `id` (made on first use): until it is closed,
    /// allocations on capturing streams of `device` come from it
    /// (PyTorch's `beginAllocateToPool`, at the start of a capture).
    pub fn begin_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        let mut graphs = lock(&dev.graphs);
        let graph = match graphs.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(GraphPool {
                pool: self.new_pool(dev.id)?,
                open: None,
                uses: 0,
                live: 0,
            }),
        };
        if graph.open.is_some() {
            return Err(CallError::GraphPool {
                device: dev.id.0,
                id,
                why: "opened twice",
            });
        }
        graph.open = Some(self.context.graph_capture());
        graph.uses += 1;
        dev.open_graphs.fetch_add(1, Ordering::AcqRel);
        tracing::debug!(device = dev.id.0, ?id, "vmpool: graph pool open");
        Ok(())
    }

    /// Closes graph pool `id`: allocations go to the device's pool again;
    /// what the pool handed out is freed to it (PyTorch's
    /// `endAllocateToPool`, at the end of a capture).
    pub fn end_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        let closed = match lock(&dev.graphs).get_mut(&id) {
            Some(graph) if graph.open.is_some() => dev.close_graph(graph),
            _ => {
                return Err(CallError::GraphPool {
                    device: dev.id.0,
                    id,
                    why: "closed but not open",
                })
            }
        };
        if closed {
            self.free_deferred(dev);
        }
        Ok(())
    }

    /// A graph that captured into pool `id` is gone (PyTorch's
    /// `releasePool`): once every graph that did is, the pool goes, with
    /// its memory, when its last allocation is freed. Until then its free
    /// memory stays: a graph replays into what its capture freed.
    pub fn release_graph_pool(&self, device: i64, id: GraphPoolId) -> Result<(), CallError> {
        let dev = self.device(device)?;
        let mut graphs = lock(&dev.graphs);
        let Some(graph) = graphs.get_mut(&id).filter(|g| g.uses > 0) else {
            return Err(CallError::GraphPool {
                device: dev.id.0,
                id,
                why: "released more often than opened",
            });
        };
        let closed = dev.close_graph(graph);
        graph.uses -= 1;
        dev.drop_graph_if_unused(&mut graphs, id);
        drop(graphs);
        if closed {
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
            .find(|d| lock(&d.live).contains_key(&ptr))
            .ok_or(CallError::NotLive { ptr })?;
        // Adopted here, so that a stream vmpool cannot use is reported now
        // and the free has nothing to fail on.
        let adopted = self.with_stream(dev, stream, Stream::clone)?;
        let mut live = lock(&dev.live);
        // Freed by another thread meanwhile: nothing left to order.
        let entry = live.get_mut(&ptr).ok_or(CallError::NotLive { ptr })?;
        if !entry.used_on.contains(&adopted) {
            entry.used_on.push(adopted);
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
        let Some(live) = lock(&dev.live).remove(&ptr) else {
            dev.refused_frees.fetch_add(1, Ordering::Relaxed);
            return Err(CallError::NotOurs {
                ptr,
                device: dev.id.0,
                why: self.why_not_ours(ptr, dev),
            });
        };
        if size >= 0 && size as u64 != live.allocation.size() {
            tracing::warn!(
                ptr = format_args!("{ptr:#x}"),
                given = size,
                allocated = live.allocation.size(),
                "vmpool: free names another size than was allocated; freeing the allocation"
            );
        }
        if !live.used_on.is_empty() && dev.open_graphs.load(Ordering::Acquire) > 0 {
            lock(&dev.deferred_frees).push((ptr, live, stream));
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
        let Live {
            allocation,
            used_on,
            graph,
        } = live;
        let graph_pool;
        let pool = match graph {
            None => self.pool(dev)?,
            Some(id) => {
                graph_pool = lock(&dev.graphs)
                    .get(&id)
                    .expect("a graph pool stays while it has allocations")
                    .pool
                    .clone();
                &graph_pool
            }
        };
        let mut allocation = Some(allocation);
        let freed = self.with_stream(dev, stream, |s| {
            self.wait_for_users(dev, s, &used_on)?;
            pool.free_async(allocation.take().expect("called once"), s)
        });
        let err = match freed {
            Ok(Ok(())) => {
                if let Some(id) = graph {
                    self.graph_allocation_freed(dev, id);
                }
                return Ok(());
            }
            Ok(Err(err)) | Err(err) => err,
        };
        // Not handed over (the stream could not be adopted, or it could not
        // be made to wait for the allocation's other users): nothing
        // changed, it stays live.
        if let Some(allocation) = allocation {
            let live = Live {
                allocation,
                used_on,
                graph,
            };
            lock(&dev.live).insert(ptr, live);
        }
        Err(err.into())
    }

    /// Does the frees deferred while a capture was under way (see
    /// `Device::deferred_frees`), once none is; a failed one is logged and
    /// its allocation stays live.
    fn free_deferred(&self, dev: &Device<B>) {
        let deferred = std::mem::take(&mut *lock(&dev.deferred_frees));
        for (ptr, live, stream) in deferred {
            if let Err(err) = self.hand_back(dev, ptr, live, stream) {
                tracing::error!("vmpool: a free deferred past a graph capture: {err}");
            }
        }
    }

    /// Counts a free of graph pool `id`'s; the last of a pool no graph
    /// uses drops it.
    fn graph_allocation_freed(&self, dev: &Device<B>, id: GraphPoolId) {
        let mut graphs = lock(&dev.graphs);
        graphs
            .get_mut(&id)
            .expect("a graph pool stays while it has allocations")
            .live -= 1;
        dev.drop_graph_if_unused(&mut graphs, id);
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

    /// Why `ptr` is not a live allocation of `dev`, as precisely as the
    /// tables tell (the cold path of a refused free).
    fn why_not_ours(&self, ptr: u64, dev: &Device<B>) -> String {
        let inside = |live: &FxHashMap<u64, Live<B>>| {
            live.values()
                .map(|l| &l.allocation)
                .find(|a| a.ptr().0 < ptr && ptr < a.ptr().0 + a.size())
                .map(|a| (a.ptr().0, a.size()))
        };
        if let Some((base, size)) = inside(&lock(&dev.live)) {
            return format!(
                "it points inside the allocation at {base:#x} ({size} bytes); free that pointer"
            );
        }
        for other in self.devices.iter().filter(|d| d.id != dev.id) {
            if lock(&other.live).contains_key(&ptr) {
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
    /// for the streams vmpool has seen, then trims each device's pool to
    /// nothing unused. Graph pools keep their memory for their graphs'
    /// replays; while one is open (a capture under way, which a wait would
    /// spoil) the device's pool is trimmed without waiting.
    pub fn empty_cache(&self) -> Result<(), CallError> {
        for dev in &self.devices {
            let Some(pool) = dev.pool.get() else {
                continue;
            };
            if dev.open_graphs.load(Ordering::Acquire) == 0 {
                self.wait_and_forget_streams(dev)?;
            }
            pool.trim_to(0)?;
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
        let (graph_pools, graph_reserved_bytes) = {
            let graphs = lock(&dev.graphs);
            (
                graphs.len() as u64,
                graphs.values().map(|g| g.pool.stats().reserved_bytes).sum(),
            )
        };
        let calls = Figures {
            refused_frees: dev.refused_frees.load(Ordering::Relaxed),
            timed_calls: dev.timed_calls.load(Ordering::Relaxed),
            call_nanos: dev.call_nanos.load(Ordering::Relaxed),
            timed_frees: dev.timed_frees.load(Ordering::Relaxed),
            free_nanos: dev.free_nanos.load(Ordering::Relaxed),
            graph_pools,
            graph_reserved_bytes,
            ..Figures::default()
        };
        Ok(match dev.pool.get() {
            Some(pool) => Figures {
                reserved_high: pool.attribute(PoolAttribute::ReservedMemHigh),
                used_high: pool.attribute(PoolAttribute::UsedMemHigh),
                stats: pool.stats(),
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
        let dev = self.device(device)?;
        Ok(dev.pool.get().map(|p| p.snapshot().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmpool::vmm::testing::TestBackend;

    fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_lookup(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn defaults() {
        let c = config(&[]).unwrap();
        assert_eq!(c.backend, BackendChoice::Cuda);
        assert_eq!(c.release_threshold, u64::MAX);
        assert_eq!(c.chunk_size, None);
        assert_eq!(c.chunk_divisor, Some(DEFAULT_CHUNK_DIVISOR));
        assert_eq!(c.granule_growth_below, vmpool::DEFAULT_GRANULE_GROWTH_BELOW);
    }

    #[test]
    fn granule_growth_below() {
        let c = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "512MiB")]).unwrap();
        assert_eq!(c.granule_growth_below, 512 << 20);
        let c = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "0")]).unwrap();
        assert_eq!(c.granule_growth_below, 0);
        let err = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "2 GB")]).unwrap_err();
        assert!(
            err.to_string().contains("VMPOOL_GRANULE_GROWTH_BELOW"),
            "{err}"
        );
    }

    #[test]
    fn chunk_divisor() {
        let c = config(&[("VMPOOL_CHUNK_DIVISOR", " 4096 ")]).unwrap();
        assert_eq!(c.chunk_divisor, Some(4096));
        let c = config(&[("VMPOOL_CHUNK_DIVISOR", "off")]).unwrap();
        assert_eq!(c.chunk_divisor, None);
        for bad in ["", "0", "-1", "1/4096", "x", "none"] {
            let err = config(&[("VMPOOL_CHUNK_DIVISOR", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_CHUNK_DIVISOR"), "{err}");
        }
    }

    #[test]
    fn byte_sizes() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("2M", 2 << 20),
            ("2MiB", 2 << 20),
            ("1 GiB", 1 << 30),
            ("3g", 3 << 30),
            ("max", u64::MAX),
            ("MAX", u64::MAX),
        ] {
            let c = config(&[("VMPOOL_RELEASE_THRESHOLD", text)]).unwrap();
            assert_eq!(c.release_threshold, bytes, "{text}");
        }
        for bad in ["", "-1", "1.5G", "12Q", "99999999999999999999", "20000000T"] {
            let err = config(&[("VMPOOL_CHUNK_SIZE", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_CHUNK_SIZE"), "{err}");
        }
    }

    /// Adopts odd stream handles; an even one fails, as a handle of
    /// another device would.
    fn odd_handles_only(
        b: &vmpool::vmm::host::Host,
        device: DeviceId,
        handle: usize,
    ) -> vmpool::vmm::Result<vmpool::vmm::host::HostStream> {
        let device = if handle % 2 == 0 {
            DeviceId(u32::MAX)
        } else {
            device
        };
        b.create_stream(device)
    }

    #[test]
    fn a_free_on_a_stream_that_cannot_be_adopted_changes_nothing() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
        let ptr = shim.alloc(4096, 0, 1).unwrap();
        assert!(
            shim.alloc(4096, 0, 2).is_err(),
            "stream 2 cannot be adopted"
        );
        assert!(shim.free(ptr, 4096, 0, 2).is_err());
        // Still live, and freed normally on its own stream.
        assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 4096);
        shim.free(ptr, 4096, 0, 1).unwrap();
        let figures = shim.figures(0).unwrap();
        assert_eq!(figures.refused_frees, 0);
        shim.synchronize(0).unwrap();
        assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 0);
    }

    fn table_len(shim: &Shim<vmpool::vmm::host::Host>) -> usize {
        shim.devices[0].streams.read().unwrap().len()
    }

    #[test]
    fn a_synchronize_forgets_the_streams_and_they_are_adopted_again() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
        for handle in [1, 3, 5] {
            let ptr = shim.alloc(1 << 20, 0, handle).unwrap();
            shim.free(ptr, 1 << 20, 0, handle).unwrap();
        }
        assert_eq!(table_len(&shim), 3);
        shim.synchronize(0).unwrap();
        assert_eq!(table_len(&shim), 0);
        // Adopted afresh: a stream reuses its own frees at once again.
        let a = shim.alloc(1 << 20, 0, 3).unwrap();
        shim.free(a, 1 << 20, 0, 3).unwrap();
        let b = shim.alloc(1 << 20, 0, 3).unwrap();
        assert_eq!(a, b);
        assert_eq!(table_len(&shim), 1);
        shim.free(b, 1 << 20, 0, 3).unwrap();
        // empty_cache waits for the device too, and forgets as well.
        shim.empty_cache().unwrap();
        assert_eq!(table_len(&shim), 0);
        let figures = shim.figures(0).unwrap();
        assert_eq!((figures.stats.used_bytes, figures.refused_frees), (0, 0));
    }

    /// The host stream `handle` stands for on device 0.
    fn host_stream(
        shim: &Shim<vmpool::vmm::host::Host>,
        handle: usize,
    ) -> Stream<vmpool::vmm::host::Host> {
        shim.with_stream(&shim.devices[0], handle, Stream::clone)
            .unwrap()
    }

    #[test]
    fn a_free_waits_for_the_streams_recorded_as_users() {
        use std::time::{Duration, Instant};
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
        let ptr = shim.alloc(4096, 0, 1).unwrap();
        let (own, other) = (host_stream(&shim, 1), host_stream(&shim, 3));
        // Stream 3 still uses the memory when stream 1 frees it.
        host.delay(other.raw(), Duration::from_millis(300)).unwrap();
        shim.record_stream(ptr, 3).unwrap();
        shim.record_stream(ptr, 3).unwrap();
        shim.record_stream(ptr, 1).unwrap();
        let events = host.census().events;
        shim.free(ptr, 4096, 0, 1).unwrap();
        // One event made for the wait, and kept.
        assert_eq!(host.census().events, events + 1);
        // Stream 1's next allocation gets the same memory at once (its own
        // free), so its work from here must wait for stream 3's.
        assert_eq!(shim.alloc(4096, 0, 1).unwrap(), ptr);
        let started = Instant::now();
        host.synchronize_stream(own.raw()).unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "stream 1 ran ahead of the work stream 3 queued on the memory"
        );
        // Again: the kept event serves, none is made.
        host.delay(other.raw(), Duration::from_millis(300)).unwrap();
        shim.record_stream(ptr, 3).unwrap();
        shim.free(ptr, 4096, 0, 1).unwrap();
        assert_eq!(shim.alloc(4096, 0, 1).unwrap(), ptr);
        let started = Instant::now();
        host.synchronize_stream(own.raw()).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert_eq!(host.census().events, events + 1);
    }

    #[test]
    fn record_stream_refuses_what_is_not_live() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
        let ptr = shim.alloc(4096, 0, 1).unwrap();
        assert!(matches!(
            shim.record_stream(ptr + 256, 3),
            Err(CallError::NotLive { .. })
        ));
        // A stream that cannot be adopted is refused at the record, and the
        // free goes on as if it had not been named.
        assert!(shim.record_stream(ptr, 2).is_err());
        shim.free(ptr, 4096, 0, 1).unwrap();
        assert!(matches!(
            shim.record_stream(ptr, 3),
            Err(CallError::NotLive { .. })
        ));
        shim.synchronize(0).unwrap();
        assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 0);
    }

    /// While a graph pool is open, allocations on a capturing stream come
    /// from it and nothing else: after the capture, what it freed is not
    /// handed to other allocations (a replay would write there), and the
    /// pool goes with its last allocation once released.
    #[test]
    fn a_capture_allocates_from_its_graph_pool_only() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
        let id = (0, 7);
        let eager = shim.alloc(4 << 20, 0, 1).unwrap();
        shim.begin_graph_pool(0, id).unwrap();
        // Not capturing: the device's pool.
        let outside = shim.alloc(4 << 20, 0, 3).unwrap();
        let capturing = host_stream(&shim, 1);
        host.begin_capture(capturing.raw()).unwrap();
        let mut graph: Vec<u64> = Vec::new();
        for size in [3000, 1 << 20, 40 << 20, 1 << 20] {
            graph.push(shim.alloc(size, 0, 1).unwrap());
        }
        // Intermediates freed in the capture, and reused within it.
        shim.free(graph[1], -1, 0, 1).unwrap();
        graph.push(shim.alloc(1 << 20, 0, 1).unwrap());
        shim.free(graph[2], -1, 0, 1).unwrap();
        host.end_capture(capturing.raw()).unwrap();
        shim.end_graph_pool(0, id).unwrap();
        let figures = shim.figures(0).unwrap();
        assert_eq!(figures.graph_pools, 1);
        assert!(figures.graph_reserved_bytes >= 40 << 20);
        assert_eq!(figures.stats.used_bytes, 8 << 20, "eager and outside only");
        // After the capture, on the same stream and others: never the
        // graph's memory, freed or not.
        for handle in [1, 3] {
            for size in [3000, 1 << 20, 40 << 20] {
                let p = shim.alloc(size, 0, handle).unwrap();
                assert!(!graph.contains(&p), "{p:#x} belongs to the graph");
            }
        }
        shim.release_graph_pool(0, id).unwrap();
        assert_eq!(shim.figures(0).unwrap().graph_pools, 1, "allocations live");
        for p in [graph[0], graph[3], graph[4]] {
            shim.free(p, -1, 0, 3).unwrap();
        }
        assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
        shim.free(eager, -1, 0, 1).unwrap();
        shim.free(outside, -1, 0, 3).unwrap();
        assert!(shim.end_graph_pool(0, id).is_err(), "no longer open");
        assert!(shim.release_graph_pool(0, id).is_err(), "gone");
    }

    /// Graphs may share a pool (`torch.cuda.graph(pool=...)`): it stays
    /// while any of them lives, even with nothing allocated, since their
    /// replays use what the captures freed.
    #[test]
    fn a_shared_graph_pool_stays_until_every_graph_is_released() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
        let id = (0, 9);
        let s = host_stream(&shim, 1);
        for _ in 0..2 {
            shim.begin_graph_pool(0, id).unwrap();
            host.begin_capture(s.raw()).unwrap();
            let p = shim.alloc(8 << 20, 0, 1).unwrap();
            shim.free(p, -1, 0, 1).unwrap();
            host.end_capture(s.raw()).unwrap();
            shim.end_graph_pool(0, id).unwrap();
        }
        shim.release_graph_pool(0, id).unwrap();
        let figures = shim.figures(0).unwrap();
        assert_eq!(
            figures.graph_pools, 1,
            "the other graph still replays into it"
        );
        assert!(figures.graph_reserved_bytes >= 8 << 20);
        shim.release_graph_pool(0, id).unwrap();
        assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
        assert!(
            shim.release_graph_pool(0, id).is_err(),
            "released more often than opened"
        );
    }

    /// During a capture, a free of memory another stream was recorded on
    /// waits for the capture's end: the freeing stream may wait for no
    /// event recorded outside the capture, and the memory must not be
    /// reused before the other stream's work. Then it is freed, behind
    /// that work.
    #[test]
    fn a_free_with_recorded_users_waits_for_the_end_of_the_capture() {
        use std::time::{Duration, Instant};
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
        let id = (0, 11);
        let (s, other) = (host_stream(&shim, 1), host_stream(&shim, 3));
        shim.begin_graph_pool(0, id).unwrap();
        host.begin_capture(s.raw()).unwrap();
        let p = shim.alloc(1 << 20, 0, 1).unwrap();
        shim.record_stream(p, 3).unwrap();
        shim.free(p, -1, 0, 1).unwrap();
        // Not free yet: the same size on the same stream gets other memory.
        let q = shim.alloc(1 << 20, 0, 1).unwrap();
        assert_ne!(q, p);
        shim.free(q, -1, 0, 1).unwrap();
        host.end_capture(s.raw()).expect("the capture survived");
        host.delay(other.raw(), Duration::from_millis(300)).unwrap();
        shim.end_graph_pool(0, id).unwrap();
        // Freed now, behind stream 3's work.
        assert!(shim.free(p, -1, 0, 1).is_err(), "freed once already");
        let started = Instant::now();
        host.synchronize_stream(s.raw()).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));
        shim.release_graph_pool(0, id).unwrap();
        assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
    }

    #[test]
    fn two_open_graph_pools_refuse_a_capturing_allocation() {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
        shim.begin_graph_pool(0, (0, 1)).unwrap();
        assert!(shim.begin_graph_pool(0, (0, 1)).is_err(), "open already");
        shim.begin_graph_pool(0, (0, 2)).unwrap();
        let s = host_stream(&shim, 1);
        host.begin_capture(s.raw()).unwrap();
        assert!(matches!(
            shim.alloc(4096, 0, 1),
            Err(CallError::WhichCapture { open: 2, .. })
        ));
        // Not capturing: served as usual.
        let p = shim.alloc(4096, 0, 3).unwrap();
        host.end_capture(s.raw()).unwrap();
        shim.free(p, 4096, 0, 3).unwrap();
        for id in [(0, 1), (0, 2)] {
            shim.end_graph_pool(0, id).unwrap();
            shim.release_graph_pool(0, id).unwrap();
        }
        assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
    }

    #[test]
    fn timing_switch() {
        assert!(!config(&[]).unwrap().timing);
        assert!(config(&[("VMPOOL_TIMING", "1")]).unwrap().timing);
        assert!(!config(&[("VMPOOL_TIMING", "0")]).unwrap().timing);
        let err = config(&[("VMPOOL_TIMING", "yes")]).unwrap_err();
        assert!(err.to_string().contains("VMPOOL_TIMING"), "{err}");
    }

    #[test]
    fn bad_backend_and_devices() {
        assert!(config(&[("VMPOOL_BACKEND", "gpu")]).is_err());
        assert!(config(&[("VMPOOL_HOST_DEVICES", "0")]).is_err());
        let c = config(&[("VMPOOL_BACKEND", "host"), ("VMPOOL_HOST_DEVICES", "2")]).unwrap();
        assert_eq!((c.backend, c.host_devices), (BackendChoice::Host, 2));
    }
}
