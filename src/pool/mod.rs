//! A pool: one virtual reservation, physical chunks mapped into it, and a
//! heap of the mapped free space in each of its two arenas. [`Pool`] is
//! the handle that ties the parts together:
//!
//! ```text
//!   Pool ─ Shared (outside the lock: id, size limit, recorder, exports, device)
//!            └ Mutex<Inner>
//!                arenas   Arenas   a heap per arena (heap/): where allocations go
//!                space    Space    reservation, units, spares, aliases (space.rs)
//!                streams  Streams  streams with frees pending here (ordering/)
//!                guards   Guards   free ranges a stream may still touch (ordering/)
//!   growth (growth/) borrows arenas, space and guards to map new ranges
//! ```
//!
//! An allocation takes a free block from the heap when one fits (no driver
//! call). When none fits, the pool grows a contiguous range and backs it
//! with spare chunks, then with whole free units unmapped from elsewhere,
//! and only then with new chunks. A unit moves only when no live byte is
//! on it, so a pointer never moves. Stream-ordered frees wait with their
//! stream, where the same stream reuses them without the pool's lock.
//! Notes \[Placement\], [Growth and remapping], [Stream-ordered frees]: docs/DESIGN.md.

mod audit;
mod batches;
mod inner;
mod marking;
mod pending;
mod recording;
mod settings;
mod sleep;
mod stepping;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use vmm::{Backend, DeviceId, DevicePtr, ErrorKind};

use crate::allocation::Allocation;
use crate::arena::{Arena, Arenas, ChunkPolicy};
use crate::capture::Captures;
use crate::exports::Exports;
use crate::heap::{Heap, QUANTUM};
use crate::ordering::{Counted, Pending, Stream, StreamPos, StreamShared, Streams};
use crate::props::{HandleType, PoolProps, DEFAULT_CHUNK_SIZE};
use crate::space::{Space, SpaceProps};
use crate::stats::{PoolSnapshot, PoolStats};
use crate::sync::lock;
use crate::trace::record::{record_path, Recorder};
use crate::va::Va;
use crate::{Error, Result};
use inner::{Inner, Purpose, StepMarks};
pub use sleep::{PrepareReport, Retention, SleepLevel, SleepReport, WakeReport};
use stepping::Stepping;

/// `repr(C)` and aligned to a cache line: what an allocation and a free
/// read outside the lock comes first and shares one line (Note [Cache-line
/// layout] in docs/DESIGN.md).
#[repr(C, align(64))]
struct Shared<B: Backend> {
    id: u64,
    /// The reservation's size: no allocation is larger.
    va_size: u64,
    /// The program's bytes as the lock counted them after its last locked
    /// allocation: a stream whose frees since reach them may have emptied
    /// the pool, and its next allocation takes the lock, which marks a
    /// step there. `u64::MAX` before the first, and once the program marks
    /// its own steps (Note [Steps at emptying]).
    held_at_count: AtomicU64,
    recorder: Option<Box<Recorder>>,
    /// Allocations exported to other processes and their leases.
    exports: Exports<B>,
    device: DeviceId,
    /// Asleep (see [`Pool::sleep`]): read by every free, some of which take
    /// no lock, so on the first line with the rest they read.
    asleep: AtomicBool,
    /// Steps have been marked: allocations and frees pass through `steps`
    /// (Note [Step layouts]). Never cleared, since planned allocations
    /// must come back to it.
    stepping: AtomicBool,
    /// Which mark is due at the next allocation, if any: the program's
    /// ([`Pool::mark_step_at_next_allocation`]) or one deferred past the
    /// frees its step carries (Note [Step layouts]).
    mark_due: marking::DueMark,
    /// The pool no longer marks a step where the program empties it: the
    /// program has marked one itself, or the pool's own marks laid nothing
    /// out (Note [Steps at emptying]).
    emptying_marks_off: AtomicBool,
    backend: Arc<B>,
    /// Chunks are created exportable ([`HandleType::PosixFileDescriptor`]).
    shareable: bool,
    inner: Mutex<Inner<B>>,
    /// The other pools of the device, asked to release unused memory before
    /// this one reports out-of-memory.
    siblings: Weak<Siblings<B>>,
    /// Left out when a pool of the device asks the others to release unused
    /// memory: a graph pool's unused memory is what its graphs replay into.
    keeps_unused: AtomicBool,
    steps: Mutex<Stepping<B>>,
    /// Held through a step mark, from the steps' mark to its region's
    /// install: marks made where the program empties the pool come from
    /// any of its threads, and each takes the layout the last one left.
    marking: Mutex<()>,
}

// What every call reads outside the lock lies on the first cache line.
const _: () = assert!(std::mem::offset_of!(Shared<vmm::host::Host>, asleep) < 64);
const _: () = assert!(std::mem::offset_of!(Shared<vmm::host::Host>, stepping) < 64);
const _: () = assert!(std::mem::offset_of!(Shared<vmm::host::Host>, mark_due) < 64);
const _: () = assert!(std::mem::offset_of!(Shared<vmm::host::Host>, held_at_count) < 64);

/// The pools of one device.
pub(crate) type Siblings<B> = Mutex<Vec<WeakPool<B>>>;

/// A memory pool. Cloning gives another handle to the same pool.
pub struct Pool<B: Backend>(Arc<Shared<B>>);

/// A handle that does not keep the pool alive.
pub(crate) struct WeakPool<B: Backend>(Weak<Shared<B>>);

impl<B: Backend> WeakPool<B> {
    pub(crate) fn upgrade(&self) -> Option<Pool<B>> {
        self.0.upgrade().map(Pool)
    }

    fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl<B: Backend> Clone for Pool<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<B: Backend> std::fmt::Debug for Pool<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("id", &self.0.id)
            .field("device", &self.0.device)
            .finish_non_exhaustive()
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl<B: Backend> Pool<B> {
    pub(crate) fn create(
        backend: &Arc<B>,
        props: &PoolProps,
        siblings: &Arc<Siblings<B>>,
        captures: &Arc<Captures>,
    ) -> Result<Self> {
        let device = props.device;
        if device.0 >= backend.device_count()? {
            return Err(Error::InvalidDevice(device));
        }
        let granule = backend.granularity(device)? as u64;
        let total = backend.mem_info(device)?.total as u64;
        let chunk_size = props
            .chunk_size
            .unwrap_or(DEFAULT_CHUNK_SIZE)
            .next_multiple_of(granule);
        let va_size = props.va_size.unwrap_or(4 * total).next_multiple_of(granule);
        if chunk_size == 0 || va_size == 0 || props.chunk_divisor == Some(0) {
            return Err(Error::InvalidProps(
                "chunk size, chunk divisor and address-space size must be non-zero".into(),
            ));
        }
        let shareable = props.handle_type == HandleType::PosixFileDescriptor;
        let space = Space::new(
            backend,
            SpaceProps {
                device,
                va_size,
                granule,
                shareable,
                max_size: props.max_size.unwrap_or(u64::MAX),
            },
        )?;
        let base = space.base().0;
        // An eighth of the address space for small allocations is far more
        // than they ever need; the rest is for large ones.
        let split = base + (va_size / 8).next_multiple_of(granule);
        let arena = |start, end, chunk_size, chunk_divisor| Arena {
            heap: Heap::new(),
            start,
            end,
            policy: ChunkPolicy {
                chunk_size,
                chunk_divisor,
                granule_growth_below: props.granule_growth_below,
            },
        };
        let arenas = Arenas::new(
            arena(base, split, granule, None),
            arena(split, base + va_size, chunk_size, props.chunk_divisor),
        );
        let id = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        let recorder = match record_path(props.record.as_deref(), id) {
            Some(path) => Some(Box::new(Self::recorder(&path, id, device)?)),
            None => None,
        };
        let streams = Streams::new(id, Arc::clone(backend), Arc::clone(captures));
        let planned_frees = Arc::new(AtomicU64::new(0));
        let shared = Arc::new(Shared {
            id,
            va_size,
            recorder,
            exports: Exports::default(),
            device,
            backend: Arc::clone(backend),
            shareable,
            inner: Mutex::new(Inner::new(
                arenas,
                space,
                streams,
                props.defragment,
                props.fresh_start,
                id,
                Arc::clone(&planned_frees),
            )),
            siblings: Arc::downgrade(siblings),
            keeps_unused: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            stepping: AtomicBool::new(false),
            mark_due: marking::DueMark::new(),
            emptying_marks_off: AtomicBool::new(false),
            held_at_count: AtomicU64::new(u64::MAX),
            steps: Mutex::new(Stepping::new(Arc::clone(captures), planned_frees)),
            marking: Mutex::new(()),
        });
        let mut list = lock(siblings);
        list.retain(WeakPool::is_alive);
        list.push(WeakPool(Arc::downgrade(&shared)));
        tracing::debug!(pool = shared.id, %device, va_size, chunk_size, chunk_divisor = ?props.chunk_divisor, "pool created");
        Ok(Self(shared))
    }

    pub(crate) fn downgrade(&self) -> WeakPool<B> {
        WeakPool(Arc::downgrade(&self.0))
    }

    pub(crate) fn id(&self) -> u64 {
        self.0.id
    }

    pub(crate) fn is_shareable(&self) -> bool {
        self.0.shareable
    }

    pub(crate) fn exports(&self) -> &Exports<B> {
        &self.0.exports
    }

    /// The address of the first unit under `[ptr, ptr + size)` and the
    /// chunks of all of them, in address order. The range must be a live
    /// allocation, so that its units are mapped and stay put.
    pub(crate) fn units_under(
        &self,
        ptr: u64,
        size: u64,
    ) -> (u64, Vec<Arc<vmm::memory::Chunk<B>>>) {
        let (first, chunks) = self.lock().space.units_under(Va(ptr), size);
        (first.0, chunks)
    }

    /// Leaves the pool out when another pool of the device, out of memory,
    /// asks every pool to release what it holds unused.
    pub(crate) fn keep_unused_memory(&self) {
        self.0.keeps_unused.store(true, Ordering::Relaxed);
    }

    pub(crate) fn owns(&self, allocation: &Allocation) -> bool {
        allocation.pool == self.0.id
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        lock(&self.0.inner)
    }

    /// The device whose memory the pool holds.
    pub fn device(&self) -> DeviceId {
        self.0.device
    }

    /// The backend the pool's memory comes from.
    pub fn backend(&self) -> &Arc<B> {
        &self.0.backend
    }

    /// Allocates `size` bytes, aligned to 256, for use right away (no stream
    /// order). Grows, defragments and, when the device is full, asks every
    /// pool on it to release unused memory before it gives up.
    pub fn allocate(&self, size: u64) -> Result<Allocation> {
        self.allocate_with(size, None)
    }

    /// Allocates `size` bytes for use in stream order on `stream`
    /// (`cudaMallocFromPoolAsync`). The call returns at once; errors are
    /// returned here, never later. Memory freed on `stream` is reused at
    /// once; memory freed on other streams as the pool's reuse switches
    /// allow, possibly by making `stream` wait for the free.
    #[inline]
    pub fn allocate_async(&self, size: u64, stream: &Stream<B>) -> Result<Allocation> {
        self.same_device(stream)?;
        self.allocate_with(size, Some(&stream.0))
    }

    /// Frees `allocation` in stream order on `stream`: the memory goes back
    /// to the pool once the work queued on `stream` so far has run. The
    /// stream must be ordered after every use of the allocation. Taken
    /// while the pool sleeps too, as [`Pool::free`]; another pool's
    /// allocation, or a stream of another device, is an error, and the
    /// allocation is dropped.
    #[inline]
    pub fn free_async(&self, allocation: Allocation, stream: &Stream<B>) -> Result<()> {
        if !self.owns(&allocation) {
            return Err(Error::WrongPool {
                ptr: allocation.ptr.0,
            });
        }
        self.same_device(stream)?;
        self.forget_kept(&allocation);
        // The allocation is not moved through an Option on the common way:
        // those copies cost the free path time (docs/RESULTS.md, "The pool
        // split").
        if self.0.exports.any() {
            if let Some(allocation) = self.0.exports.on_free(allocation, Some(&stream.0)) {
                self.release_async(&allocation, stream);
            }
        } else {
            self.release_async(&allocation, stream);
        }
        Ok(())
    }

    /// The stream-ordered free itself: the block goes to the stream's
    /// pending frees.
    #[inline(always)]
    fn release_async(&self, allocation: &Allocation, stream: &Stream<B>) {
        tracing::trace!(pool = self.0.id, ptr = %allocation.ptr, size = allocation.size, stream = stream.0.id, "free_async");
        self.record_free(allocation, stream.0.id);
        if self.0.stepping.load(Ordering::Acquire) && self.free_stepping(allocation, Some(stream)) {
            return;
        }
        let pending = pending_free(allocation);
        // The first pending free of this stream here registers it with the
        // pool (whose lock comes first), then goes again.
        while !stream.0.push_free(self.0.id, pending, Counted::Later) {
            self.register(&stream.0);
        }
    }

    /// Whether steps are marked (Note [Step layouts]).
    fn step_marks(&self) -> StepMarks {
        if self.0.stepping.load(Ordering::Acquire) {
            StepMarks::Some
        } else {
            StepMarks::None
        }
    }

    /// Refuses a call while the pool sleeps (its memory is not mapped).
    fn awake(&self) -> Result<()> {
        if self.0.asleep.load(Ordering::Acquire) {
            return Err(Error::Asleep);
        }
        Ok(())
    }

    /// A free while the pool sleeps: its bytes are no longer copied back
    /// at wake. The free itself then goes on as when awake: the heap and
    /// the streams' pending frees are books, no memory is touched (Note
    /// [Sleep and wake] in docs/DESIGN.md).
    #[inline(always)]
    fn forget_kept(&self, allocation: &Allocation) {
        if self.0.asleep.load(Ordering::Acquire) {
            self.forget_kept_asleep(allocation);
        }
    }

    #[cold]
    fn forget_kept_asleep(&self, allocation: &Allocation) {
        if let Some(slumber) = self.lock().slumber.as_mut() {
            slumber.forget(allocation.ptr.0, allocation.block_size);
        }
    }

    /// Out of line: a stream registers once, then frees on the hot path.
    #[cold]
    fn register(&self, stream: &Arc<StreamShared<B>>) {
        self.lock().streams.register(stream);
    }

    /// Unlike `cudaMallocFromPoolAsync`, which takes a stream of any
    /// device, a pool serves only streams of its own device: it gives no
    /// other device access to its memory, and the events it records to order
    /// frees are its device's.
    fn same_device(&self, stream: &Stream<B>) -> Result<()> {
        if stream.device() == self.device() {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                expected: self.device(),
                found: stream.device(),
            })
        }
    }

    #[inline]
    fn allocate_with(
        &self,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::InvalidSize {
                requested: size,
                reason: "zero bytes",
            });
        }
        if size > self.0.va_size {
            return Err(Error::InvalidSize {
                requested: size,
                reason: "larger than the pool's address space",
            });
        }
        let rounded = size.next_multiple_of(QUANTUM);
        self.mark_if_due()?;
        if self.0.stepping.load(Ordering::Acquire) {
            return self.allocate_stepping(size, rounded, stream);
        }
        self.allocate_from_heap(size, rounded, stream, Purpose::Program)
    }

    /// An allocation from the heap: the stream's own frees, then the
    /// locked path.
    #[inline]
    fn allocate_from_heap(
        &self,
        size: u64,
        rounded: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        purpose: Purpose,
    ) -> Result<Allocation> {
        if let Some(s) = stream {
            // The hot path: memory this stream freed, reused in its order,
            // without the pool's lock; not once its frees may have emptied
            // the pool (Note [Steps at emptying]).
            let held = self.0.held_at_count.load(Ordering::Relaxed);
            if let Some(p) = s.reuse(self.0.id, rounded, held) {
                return Ok(self.hand_out(size, p, s.id, purpose));
            }
        }
        self.allocate_locked(size, rounded, stream, purpose)
    }

    /// [`Pool::allocate_with`] under the pool's lock: the heap, other
    /// streams' frees, growth, and out-of-memory handling. Out of line, so
    /// that the hot path stays small.
    #[inline(never)]
    fn allocate_locked(
        &self,
        size: u64,
        rounded: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        purpose: Purpose,
    ) -> Result<Allocation> {
        let mut released_others = false;
        loop {
            let mut inner = self.lock();
            let freed = inner.freed_by(stream);
            if purpose == Purpose::Program
                && self.marks_at_emptying()
                && inner.take_emptied_mark(freed, self.step_marks())
            {
                drop(inner);
                return self.allocate_after_emptying_mark(size, rounded, stream);
            }
            match inner.allocate(rounded, stream, freed) {
                Ok(p) => return Ok(self.hand_out_locked(inner, size, p, stream, purpose)),
                Err(Error::Driver(e)) if e.kind() == ErrorKind::OutOfMemory && !released_others => {
                    // Pending frees become free once their streams finish.
                    inner.wait_for_pending_frees();
                    drop(inner);
                    tracing::debug!(
                        pool = self.0.id,
                        size,
                        "device full: releasing unused memory of every pool"
                    );
                    self.release_unused_on_device();
                    released_others = true;
                }
                Err(Error::Driver(e)) if e.kind() == ErrorKind::OutOfMemory => {
                    let device_free = self
                        .0
                        .backend
                        .mem_info(self.0.device)
                        .map_or(0, |m| m.free as u64);
                    return Err(Error::OutOfMemory {
                        device: self.0.device,
                        requested: size,
                        reserved: inner.space.reserved(),
                        used: inner.used_bytes(),
                        device_free,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Returns an allocation to the pool; also while it sleeps (the bytes
    /// are then not copied back at wake). [`Error::WrongPool`] for another
    /// pool's allocation, which is then dropped and stays in use in its
    /// own pool: [`Context::free_async`](crate::Context::free_async) finds
    /// the owner.
    pub fn free(&self, allocation: Allocation) -> Result<()> {
        if !self.owns(&allocation) {
            return Err(Error::WrongPool {
                ptr: allocation.ptr.0,
            });
        }
        self.forget_kept(&allocation);
        if self.0.exports.any() {
            if let Some(allocation) = self.0.exports.on_free(allocation, None) {
                self.release(&allocation);
            }
        } else {
            self.release(&allocation);
        }
        Ok(())
    }

    fn release(&self, allocation: &Allocation) {
        tracing::trace!(pool = self.0.id, ptr = %allocation.ptr, size = allocation.size, "free");
        self.record_free(allocation, 0);
        if self.0.stepping.load(Ordering::Acquire) && self.free_stepping(allocation, None) {
            return;
        }
        self.lock()
            .free(allocation.arena, allocation.block, allocation.block_size);
    }

    /// Hands out `p`, taken under `inner`, the pool's lock: its bytes are
    /// counted used there, and the lock let go before the rest.
    fn hand_out_locked(
        &self,
        mut inner: MutexGuard<'_, Inner<B>>,
        size: u64,
        p: Pending,
        stream: Option<&Arc<StreamShared<B>>>,
        purpose: Purpose,
    ) -> Allocation {
        inner.count_used(p.size, purpose);
        if purpose == Purpose::Program && self.marks_at_emptying() {
            // Only where an emptying would mark: otherwise the hot path
            // serves as ever.
            let held = if inner.marks_at_emptying(self.step_marks()) {
                inner.held_bytes()
            } else {
                u64::MAX
            };
            self.0.held_at_count.store(held, Ordering::Relaxed);
        }
        drop(inner);
        self.hand_out(size, p, stream.map_or(0, |s| s.id), purpose)
    }

    #[inline(always)]
    fn hand_out(&self, size: u64, p: Pending, stream: u64, purpose: Purpose) -> Allocation {
        tracing::trace!(
            pool = self.0.id,
            ptr = format_args!("{:#x}", p.ptr),
            size,
            "allocate"
        );
        let trace_id = match &self.0.recorder {
            Some(r) if purpose == Purpose::Program => r.allocation(size, stream),
            _ => 0,
        };
        Allocation {
            ptr: DevicePtr(p.ptr),
            size,
            block_size: p.size,
            arena: p.arena,
            block: p.block,
            pool: self.0.id,
            trace_id,
            step: None,
            device: self.0.device,
        }
    }

    /// Releases the stream-ordered frees of `stream` up to position `upto`
    /// (its work has run that far), then trims to the release threshold.
    pub(crate) fn stream_passed(&self, stream: u64, upto: u64) -> Result<()> {
        self.lock().stream_passed(StreamPos { stream, seq: upto })
    }

    /// Releases unused physical memory until the pool holds at most
    /// `bytes_to_keep` bytes, or nothing more can be released (a chunk is
    /// released only once no live byte is on any part of it). A step
    /// layout nothing lives in is given up first (Note [Step layouts]); its
    /// region is freed in stream order, so it is released by a trim after
    /// its stream has passed the free.
    pub fn trim_to(&self, bytes_to_keep: u64) -> Result<()> {
        if self.0.stepping.load(Ordering::Acquire) {
            self.give_up_idle_layout();
        }
        self.lock().growth().trim_to(bytes_to_keep)
    }

    fn release_unused_on_device(&self) {
        let Some(siblings) = self.0.siblings.upgrade() else {
            return;
        };
        let pools: Vec<Pool<B>> = lock(&siblings)
            .iter()
            .filter_map(WeakPool::upgrade)
            .filter(|p| !p.0.keeps_unused.load(Ordering::Relaxed))
            .collect();
        for pool in pools {
            // An idle step layout's region first, freed in stream order.
            if pool.0.stepping.load(Ordering::Acquire) {
                pool.give_up_idle_layout();
            }
            // Memory a pool's streams freed but have not passed is unused
            // too, once they have: wait for them, as for this pool's own.
            pool.lock().wait_for_pending_frees();
            if let Err(err) = pool.trim_to(0) {
                tracing::warn!(%err, "releasing unused memory failed");
            }
        }
    }

    /// The pool's statistics now.
    pub fn stats(&self) -> PoolStats {
        audit::stats(&self.lock())
    }

    /// The pool's ranges and chunks as they are now.
    pub fn snapshot(&self) -> PoolSnapshot {
        audit::snapshot(&self.lock(), self.0.va_size)
    }

    /// Recounts the pool from its own tables and checks them against the
    /// running totals; returns what disagrees. For tests and debugging.
    pub fn audit(&self) -> std::result::Result<(), crate::AuditError> {
        audit::audit(&self.lock())
    }
}

impl<B: Backend> Drop for Shared<B> {
    /// Memory freed in stream order may still be in use on its stream:
    /// wait for those streams before the mappings go. Memory still
    /// allocated when the last handle to the pool goes stays mapped, as
    /// with CUDA's pools, so that no live pointer dangles; with no pool left
    /// to free it to, it stays until the process ends. So does all of it
    /// when pending frees cannot be waited for (a graph capture under way).
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        let waited = inner.wait_for_pending_frees();
        let used = inner.used_bytes();
        if used > 0 || (!waited && !inner.streams.is_empty()) {
            tracing::warn!(
                pool = self.id,
                used,
                pending_streams = inner.streams.len(),
                "pool dropped with live allocations, or during a graph capture with frees \
                 pending: its memory stays mapped"
            );
            inner.space.forget_mappings();
        }
        if let Some(recorder) = &self.recorder {
            if let Err(err) = recorder.flush() {
                tracing::warn!(%err, "writing the allocation trace failed");
            }
        }
    }
}

/// The pending free of `allocation`, at the stream position it is given.
fn pending_free(allocation: &Allocation) -> impl Fn(u64) -> Pending + Copy + '_ {
    |seq| Pending {
        arena: allocation.arena,
        block: allocation.block,
        ptr: allocation.ptr.0,
        size: allocation.block_size,
        seq,
    }
}
