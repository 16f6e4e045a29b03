//! The per-process view of the devices: each device's pools, its default
//! pool and its current pool (as CUDA keeps them per device), and the
//! stream-ordered front end: streams, events, synchronization, and
//! `alloc_async` / `free_async` on the current pool.

use std::sync::{Arc, Mutex, Weak};

use vmm::{Backend, DeviceId, EventStatus};

use crate::capture::{Captures, GraphCapture};
use crate::ordering::{Event, Stream, StreamShared};
use crate::pool::{Pool, Siblings, WeakPool};
use crate::sync::lock;
use crate::{Allocation, Buffer, PoolProps};
use crate::{Error, Result};

struct DeviceSlot<B: Backend> {
    /// Every pool of the device, so that one running out of memory can ask
    /// the others to release what they hold unused.
    pools: Arc<Siblings<B>>,
    default: Mutex<Option<Pool<B>>>,
    current: Mutex<Option<Pool<B>>>,
    /// The streams made on the device, for a device-wide synchronize.
    streams: Mutex<Vec<Weak<StreamShared<B>>>>,
}

/// The process's view of the devices (as the CUDA runtime's): each
/// device's default and current pool, the streams made on it, and the
/// stream-ordered front end (`alloc_async`, `free_async`, events). Built on
/// one backend: `Context<Cuda>` on a GPU, `Context<Host>` without one.
pub struct Context<B: Backend> {
    backend: Arc<B>,
    devices: Vec<DeviceSlot<B>>,
    /// Graph captures announced and not yet ended (see `capture.rs`).
    captures: Arc<Captures>,
}

impl<B: Backend> std::fmt::Debug for Context<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("backend", &std::any::type_name::<B>())
            .field("devices", &self.devices.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Context<B> {
    /// A context over `backend`, with a slot for each of its devices; pools
    /// are made when first asked for.
    pub fn new(backend: Arc<B>) -> Result<Self> {
        let devices = (0..backend.device_count()?)
            .map(|_| DeviceSlot {
                pools: Arc::default(),
                default: Mutex::new(None),
                current: Mutex::new(None),
                streams: Mutex::new(Vec::new()),
            })
            .collect();
        Ok(Self {
            backend,
            devices,
            captures: Arc::default(),
        })
    }

    /// The backend the context was made with.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    fn slot(&self, device: DeviceId) -> Result<&DeviceSlot<B>> {
        self.devices
            .get(device.0 as usize)
            .ok_or(Error::InvalidDevice(device))
    }

    /// Announces a CUDA graph capture (in the driver's global mode) about
    /// to begin: until the value is dropped, after the capture has ended,
    /// this context's pools make none of the calls the driver refuses
    /// during one (`capture.rs` says which, and what changes).
    pub fn graph_capture(&self) -> GraphCapture {
        GraphCapture::begin(&self.captures)
    }

    /// Creates an explicit pool with its own properties.
    pub fn create_pool(&self, props: &PoolProps) -> Result<Pool<B>> {
        Pool::create(
            &self.backend,
            props,
            &self.slot(props.device)?.pools,
            &self.captures,
        )
    }

    /// The device's default pool, created on first use.
    pub fn default_pool(&self, device: DeviceId) -> Result<Pool<B>> {
        let slot = self.slot(device)?;
        let mut default = lock(&slot.default);
        if let Some(pool) = &*default {
            return Ok(pool.clone());
        }
        let pool = Pool::create(
            &self.backend,
            &PoolProps::new(device),
            &slot.pools,
            &self.captures,
        )?;
        *default = Some(pool.clone());
        Ok(pool)
    }

    /// The pool that allocations without an explicit pool use on `device`:
    /// the one last made current, else the default pool.
    pub fn current_pool(&self, device: DeviceId) -> Result<Pool<B>> {
        match &*lock(&self.slot(device)?.current) {
            Some(pool) => Ok(pool.clone()),
            None => self.default_pool(device),
        }
    }

    /// Makes `pool` the current pool of its device.
    pub fn set_current_pool(&self, pool: &Pool<B>) -> Result<()> {
        *lock(&self.slot(pool.device())?.current) = Some(pool.clone());
        Ok(())
    }

    // ---- the stream-ordered front end ------------------------------------

    /// A new stream on `device` (non-blocking on CUDA), owned by vmpool.
    pub fn create_stream(&self, device: DeviceId) -> Result<Stream<B>> {
        self.slot(device)?;
        self.adopt_stream(self.backend.create_stream(device)?, device)
    }

    /// Makes a backend stream of `device` a vmpool stream: one made outside
    /// vmpool, such as one from [`Backend::borrow_stream`] (the C interface
    /// wraps its callers' streams this way).
    pub fn adopt_stream(&self, raw: B::Stream, device: DeviceId) -> Result<Stream<B>> {
        let slot = self.slot(device)?;
        let stream = Stream::new(raw, device);
        let mut streams = lock(&slot.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&stream.0));
        Ok(stream)
    }

    /// A new event on `device`.
    pub fn create_event(&self, device: DeviceId) -> Result<Event<B>> {
        self.slot(device)?;
        Ok(Event::new(self.backend.create_event(device)?, device))
    }

    /// Records `event` on `stream`: it captures the work queued so far.
    pub fn record_event(&self, event: &Event<B>, stream: &Stream<B>) -> Result<()> {
        if event.device() != stream.device() {
            return Err(Error::WrongDevice {
                expected: stream.device(),
                found: event.device(),
            });
        }
        let captured = stream.0.capture();
        self.backend.record_event(&event.raw, &stream.0.raw)?;
        event.set_captured(captured);
        Ok(())
    }

    /// Makes `stream` wait for what `event` captured. vmpool notes the
    /// dependency: memory freed on the event's stream before the record may
    /// now be reused on `stream` (follow event dependencies).
    pub fn stream_wait_event(&self, stream: &Stream<B>, event: &Event<B>) -> Result<()> {
        // What the event captured, read before the driver makes the stream
        // wait: were it recorded again in between, the stream would wait
        // for the earlier point, and must not count as after the later.
        let captured = event.captured();
        self.backend.stream_wait_event(&stream.0.raw, &event.raw)?;
        if let Some(c) = &captured {
            stream.0.order_after(c);
        }
        Ok(())
    }

    /// Complete, pending, or the error of the work the event captured.
    pub fn query_event(&self, event: &Event<B>) -> Result<EventStatus> {
        Ok(self.backend.query_event(&event.raw)?)
    }

    /// Waits for `stream`; then its stream-ordered frees are free for every
    /// stream, and every pool trims itself to its release threshold.
    pub fn synchronize_stream(&self, stream: &Stream<B>) -> Result<()> {
        let upto = stream.0.current_seq();
        self.backend.synchronize_stream(&stream.0.raw)?;
        self.passed(stream.0.id, upto)
    }

    /// Waits for what `event` captured; frees before it are then free for
    /// every stream, and every pool trims itself to its release threshold.
    pub fn synchronize_event(&self, event: &Event<B>) -> Result<()> {
        let captured = event.captured();
        self.backend.synchronize_event(&event.raw)?;
        match captured {
            Some(c) => self.passed(c.stream, c.seq),
            None => self.passed(0, 0),
        }
    }

    /// Waits for every stream vmpool made on `device` (streams made
    /// elsewhere are not known to it), with the effects of
    /// [`Context::synchronize_stream`] for each.
    pub fn synchronize_device(&self, device: DeviceId) -> Result<()> {
        let streams: Vec<Arc<StreamShared<B>>> = lock(&self.slot(device)?.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for stream in streams {
            self.synchronize_stream(&Stream(stream))?;
        }
        Ok(())
    }

    /// Allocates on the current pool of `stream`'s device, in stream order
    /// (`cudaMallocAsync`).
    pub fn alloc_async(&self, size: u64, stream: &Stream<B>) -> Result<Allocation> {
        self.current_pool(stream.device())?
            .allocate_async(size, stream)
    }

    /// Allocates from `pool` in stream order (`cudaMallocFromPoolAsync`).
    pub fn alloc_from_pool_async(
        &self,
        size: u64,
        pool: &Pool<B>,
        stream: &Stream<B>,
    ) -> Result<Allocation> {
        pool.allocate_async(size, stream)
    }

    /// Frees in stream order to the allocation's own pool (`cudaFreeAsync`).
    /// A [`Buffer`] of `len` values of `T` from the current pool of
    /// `stream`'s device, on `stream`; freed on it when dropped.
    pub fn alloc_buffer<T>(&self, len: usize, stream: &Stream<B>) -> Result<Buffer<T, B>> {
        Buffer::alloc(&self.current_pool(stream.device())?, len, stream)
    }

    /// Frees `allocation` in stream order on `stream` (`cudaFreeAsync`): the
    /// memory goes back to its pool once work queued before the free on
    /// `stream` has run; `stream` may reuse it at once.
    pub fn free_async(&self, allocation: Allocation, stream: &Stream<B>) -> Result<()> {
        // Usually the device's current pool: found without a search (and
        // without creating a default pool just to look at it).
        let slot = self.slot(allocation.device())?;
        let current = lock(&slot.current)
            .clone()
            .or_else(|| lock(&slot.default).clone());
        if let Some(pool) = current.filter(|p| p.owns(&allocation)) {
            return pool.free_async(allocation, stream);
        }
        match self.pools().into_iter().find(|p| p.owns(&allocation)) {
            Some(pool) => pool.free_async(allocation, stream),
            None => Err(Error::WrongPool {
                ptr: allocation.ptr().0,
            }),
        }
    }

    fn pools(&self) -> Vec<Pool<B>> {
        self.devices
            .iter()
            .flat_map(|slot| {
                lock(&slot.pools)
                    .iter()
                    .filter_map(WeakPool::upgrade)
                    .collect::<Vec<Pool<B>>>()
            })
            .collect()
    }

    /// The work of stream `stream` has run up to position `upto`.
    fn passed(&self, stream: u64, upto: u64) -> Result<()> {
        for pool in self.pools() {
            pool.stream_passed(stream, upto)?;
        }
        Ok(())
    }
}
