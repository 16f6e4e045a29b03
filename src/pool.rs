//! A pool: one virtual reservation, physical chunks mapped into it, and a
//! heap of the mapped free space.
//!
//! ```text
//!  reservation  [base ................................................. base+va_size)
//!  units        [unit A ][unit B      ]      [unit C]           (each one whole chunk,
//!                                                                mapped: the driver maps
//!                                                                nothing smaller)
//!  heap         [a1|free|a2  |  free   ]      [ a3  ]           (allocations packed at
//!                                                                256-byte granularity)
//!  spares       chunks not mapped anywhere, kept for reuse
//! ```
//!
//! The reservation has two arenas, each with its own heap: small allocations
//! (under [`SMALL_LIMIT`]) are packed in the first, on granule-sized chunks;
//! larger ones go to the second. Kept apart, small long-lived allocations do
//! not pin the chunks that large ones free, so those can move.
//!
//! An allocation takes a free block from the heap when one fits (no driver
//! call). When none fits, the pool grows a contiguous range: it extends the
//! free block that ends a mapped region (or picks an unmapped gap) and backs
//! the new part with spare chunks, then with whole free units unmapped from
//! elsewhere (the defragmenting remap), and only then with new chunks. A
//! unit moves only when no live byte is on it, so a pointer never moves.
//!
//! Stream-ordered frees do not go back to the heap at once: they wait with
//! their stream (see `stream.rs`), where the same stream reuses them by
//! size without the pool's lock, until a synchronization or a completed
//! event shows every stream may use them. When that stream misses (no
//! block fits), its own frees are merged into the heap at once, under a
//! [`Guard`]: free space that stream may take, other streams only once
//! ordered after it (or made to wait, as the reuse switches allow), and
//! synchronous allocations only once the free is known complete. Free
//! space under guards still moves, for the stream that owns the guards:
//! the chunk is mapped at its new place while the old mapping stays, an
//! [`Alias`] of the same memory, until the stream passes it (the driver's
//! unmap is not stream-ordered). Nothing is unmapped or released while
//! queued work may touch it.
//!
//! Physical accounting: a chunk counts as reserved from its creation until
//! the pool releases it. Used bytes are counted under the pool's lock; the
//! same-stream hot path, which does not take it, leaves what it frees and
//! reuses as a credit on its stream, settled before the pool counts an
//! allocation of its own (see [`Inner::settle`] for why the high-water
//! mark stays exact).
//!
//! Access: the pool keeps one access list (its device read-write, then
//! whatever peers were given with [`Pool::set_access`]); every mapping it
//! makes, by growth or by a remap, gets that list, and a change is applied
//! to every mapped unit at once. Sharing with other processes (`ipc.rs`)
//! hooks into the frees: an allocation another process has imported stays
//! allocated, so its units stay put, until that process lets go.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::RangeBounds;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rustc_hash::{FxHashMap, FxHashSet};
use vmm::memory::{Chunk, Mapping, Reservation};
use vmm::{Access, AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr, ErrorKind, EventStatus};

use crate::capture::Captures;
use crate::heap::{BlockId, Heap, QUANTUM};
use crate::ipc::Exports;
use crate::plan::{self, Plan, Source};
use crate::stream::{lock, Pending, Stream, StreamShared};
use crate::{Error, Result};

/// Properties fixed when a pool is created (as `cudaMemPoolProps`).
#[derive(Debug, Clone)]
pub struct PoolProps {
    pub device: DeviceId,
    /// Most physical bytes the pool may hold; `None`: no limit but the
    /// device's memory. [`Pool::set_max_size`] changes it later.
    pub max_size: Option<u64>,
    /// Largest chunk a growth of the large-allocation arena creates, in bytes
    /// (rounded up to the granularity); `None`: [`DEFAULT_CHUNK_SIZE`]. The
    /// small-allocation arena always grows by one granule.
    pub chunk_size: Option<u64>,
    /// Scales growth chunks with the pool: a growth of the large-allocation
    /// arena creates chunks of at most the pool's reserved bytes over this
    /// divisor (at least one granule, at most `chunk_size`), so that the
    /// free memory a partly used chunk can strand stays a small share of
    /// the pool, at the price of more chunks while the pool is small, each
    /// paid for in driver time (about 30 us to create and 40 us to move on
    /// the H200, whatever its size). With it, growth also moves first the
    /// free units whose free block ends on unit boundaries at both ends, so
    /// that moving them leaves no part of a unit beside live bytes cut off
    /// from the rest of its free block. Default
    /// [`DEFAULT_CHUNK_DIVISOR`]; `None`: every growth uses `chunk_size`,
    /// fewer driver calls for a larger footprint (docs/RESULTS.md has both
    /// sides measured).
    pub chunk_divisor: Option<u64>,
    /// With a `chunk_divisor`: while the pool holds fewer bytes than this,
    /// growth creates chunks of one granule, whatever the divisor gives. A
    /// small pool's footprint is the most sensitive to its chunk size, and
    /// growing to this size takes at most this over the granule in chunks
    /// (1,024 at the default), so a coarse divisor saves driver calls where
    /// they add up, in large pools. Default [`DEFAULT_GRANULE_GROWTH_BELOW`];
    /// 0: the divisor alone.
    pub granule_growth_below: u64,
    /// Virtual address space to reserve; `None`: four times the device's
    /// memory, so that address space never runs short before memory does.
    pub va_size: Option<u64>,
    /// Whether growth may remap unused chunks (free units and spares) into
    /// the new range. Off, the pool behaves like a conventional one: new
    /// memory for every range that does not fit. On by default.
    pub defragment: bool,
    /// Record every allocation and free of the pool to this file, in the
    /// shared trace format (`vmpool-replay` replays it). `None`: the
    /// environment variable `VMPOOL_RECORD`, if set, names a path prefix,
    /// and each pool records to `PREFIX.<pool id>.trace`.
    pub record: Option<PathBuf>,
    /// How the pool's memory can be shared with other processes
    /// (`cudaMemPoolProps::handleTypes`); see [`crate::ipc`].
    pub handle_type: HandleType,
}

/// The kinds of handle a pool's memory can be exported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandleType {
    /// Not shareable (the default).
    #[default]
    None,
    /// POSIX file descriptors (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`):
    /// chunks are created exportable, and the pool can be exported to
    /// another process.
    PosixFileDescriptor,
}

impl PoolProps {
    pub fn new(device: DeviceId) -> Self {
        Self {
            device,
            max_size: None,
            chunk_size: None,
            chunk_divisor: Some(DEFAULT_CHUNK_DIVISOR),
            granule_growth_below: DEFAULT_GRANULE_GROWTH_BELOW,
            va_size: None,
            defragment: true,
            record: None,
            handle_type: HandleType::None,
        }
    }
}

/// Writes a pool's operations as a trace (see [`PoolProps::record`]).
struct Recorder {
    out: BufWriter<File>,
    next_id: u64,
    /// The line being written: formatted whole before it goes to `out`, so
    /// that the buffer never reaches the file with half a line in it. A
    /// program that ends without flushing (pools are often never dropped)
    /// then leaves a shorter trace, not a broken one.
    line: String,
}

impl Recorder {
    fn line(&mut self, args: std::fmt::Arguments<'_>) {
        self.line.clear();
        // Formatting into a String does not fail.
        let _ = std::fmt::Write::write_fmt(&mut self.line, args);
        if let Err(err) = self.out.write_all(self.line.as_bytes()) {
            tracing::warn!(%err, "writing the allocation trace failed");
        }
    }

    /// Records an allocation; returns its id in the trace. Out of line:
    /// the allocation hot path only tests whether there is a recorder.
    #[cold]
    fn allocation(recorder: &Mutex<Self>, size: u64, stream: u64) -> u64 {
        let mut r = lock(recorder);
        let id = r.next_id;
        r.next_id += 1;
        r.line(format_args!("a {id} {size} {stream}\n"));
        id
    }

    #[cold]
    fn free(recorder: &Mutex<Self>, id: u64, stream: u64) {
        lock(recorder).line(format_args!("f {id} {stream}\n"));
    }
}

/// The largest growth chunk by default: 32 MiB, a measured choice. Each
/// chunk costs the H200 a fixed ~30 us to create, map and give access to,
/// and ~40 us to move, whatever its size, so small chunks make growth slow;
/// physical memory moves only in whole chunks, so large ones strand free
/// memory. Pools of 64 GiB and more grow by it; smaller ones by smaller
/// chunks ([`DEFAULT_CHUNK_DIVISOR`]). Growing by it alone keeps the
/// footprint of 2 MiB chunks on the shared traces (1.0092 / 1.0036) and
/// replays 4 to 5 times faster on the GPU, but not on traces recorded
/// under PyTorch (docs/RESULTS.md).
pub const DEFAULT_CHUNK_SIZE: u64 = 32 << 20;

/// The default [`PoolProps::chunk_divisor`]: growth chunks of at most a
/// 2048th of the pool, so 2 MiB granules until the pool holds 4 GiB. It
/// puts every real training trace under 1.01 (with 32 MiB chunks the
/// ResNet-50 ones recorded under PyTorch reach 1.0103-1.0158) and keeps the
/// footprint far lower over many passes, but makes a single replay of a
/// training trace 2.4-7 times slower on the H200, all of it growth
/// (docs/RESULTS.md, "The default since 2026-11-30").
pub const DEFAULT_CHUNK_DIVISOR: u64 = 2048;

/// A [`PoolProps::chunk_divisor`] as text, as `VMPOOL_CHUNK_DIVISOR` and
/// `vmpool-replay --chunk-divisor` take it: a whole number, at least 1, or
/// `off` for whole chunks (`None`); spaces around it are ignored. The error
/// says what was expected.
pub fn parse_chunk_divisor(text: &str) -> std::result::Result<Option<u64>, String> {
    match text.trim() {
        "off" => Ok(None),
        t => match t.parse::<u64>() {
            Ok(d) if d > 0 => Ok(Some(d)),
            _ => Err(format!(
                "{text:?}: expected a whole number, at least 1, or off"
            )),
        },
    }
}

/// The default [`PoolProps::granule_growth_below`], 2 GiB: 1,024 chunks of
/// 2 MiB. At the default divisor it changes nothing (a 2048th of the pool
/// is under a granule until 4 GiB); at a coarser one, such as the C
/// layer's 256, it keeps small pools such as GPT-2 generation's (1.2 GB)
/// at the footprint of fine chunks (1.0179 against 1.0288 with the divisor
/// alone; docs/RESULTS.md, "Coarser chunks for large pools").
pub const DEFAULT_GRANULE_GROWTH_BELOW: u64 = 2 << 30;

/// Attributes readable and settable as with `cudaMemPoolGetAttribute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolAttribute {
    /// Bytes the pool may keep cached across a synchronization.
    ReleaseThreshold,
    ReuseFollowEventDependencies,
    ReuseAllowOpportunistic,
    ReuseAllowInternalDependencies,
    /// Physical bytes held (read-only).
    ReservedMemCurrent,
    /// High-water mark of the above; setting it to 0 resets it to current.
    ReservedMemHigh,
    /// Bytes of live allocations (read-only).
    UsedMemCurrent,
    /// High-water mark of the above; setting it to 0 resets it to current.
    UsedMemHigh,
}

impl PoolAttribute {
    /// The three cross-stream reuse switches (SPEC.md section 3), in this
    /// order: follow event dependencies, opportunistic, internal
    /// dependencies.
    pub const REUSE_SWITCHES: [PoolAttribute; 3] = [
        PoolAttribute::ReuseFollowEventDependencies,
        PoolAttribute::ReuseAllowOpportunistic,
        PoolAttribute::ReuseAllowInternalDependencies,
    ];
}

/// What the pool has done, beyond CUDA's attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub allocations: u64,
    pub frees: u64,
    /// Allocations that needed new mapped space.
    pub grows: u64,
    /// Time spent growing (planning and driver calls), in nanoseconds.
    pub grow_nanos: u64,
    /// Units unmapped from one place and mapped at another.
    pub remaps: u64,
    pub bytes_remapped: u64,
    pub chunks_created: u64,
    pub chunks_released: u64,
    pub bytes_created: u64,
    pub bytes_released: u64,
    /// Driver map and unmap calls.
    pub maps: u64,
    pub unmaps: u64,
    pub trims: u64,
    /// Stream-ordered allocations served by memory freed on the same stream.
    pub same_stream_reuses: u64,
    /// ... by memory freed on a stream they were ordered after by an event.
    pub dependency_reuses: u64,
    /// Stream-ordered frees moved back to the heap because their stream
    /// had passed them (their event completed, or a synchronization).
    pub frees_completed: u64,
    /// ... by memory freed on another stream, after making them wait for it.
    pub waits_inserted: u64,
    /// Stream-ordered frees merged back into the heap early, when their
    /// own stream missed: that stream reuses them at any size; others only
    /// as the reuse switches allow (see `Guard`).
    pub frees_merged: u64,
    /// Events recorded on streams to learn when their frees complete.
    pub events_recorded: u64,
    /// Current state.
    pub reserved_bytes: u64,
    pub used_bytes: u64,
    pub mapped_bytes: u64,
    pub spare_bytes: u64,
    pub units: u64,
    pub largest_free_range: u64,
    /// Freed in stream order, waiting for their stream to pass the free.
    pub pending_bytes: u64,
    /// Old places of units moved while their stream could still use them:
    /// mapped (to the same memory as the new place) until it passes.
    pub aliased_bytes: u64,
}

/// A picture of a pool's address space: for a debug dump (its `Display`
/// is a readable listing) and for drawing.
#[derive(Debug, Clone)]
pub struct PoolSnapshot {
    pub base: u64,
    pub va_size: u64,
    /// The arenas' ranges: small allocations, then large ones.
    pub arenas: Vec<(u64, u64)>,
    /// Mapped units in address order.
    pub units: Vec<UnitView>,
    /// Free mapped ranges (start, length), in address order.
    pub free: Vec<(u64, u64)>,
    /// Chunks held unmapped: (chunk handle, size).
    pub spares: Vec<(u64, u64)>,
    pub stats: PoolStats,
}

/// One mapped chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitView {
    pub va: u64,
    pub size: u64,
    /// The backend's chunk handle: the same chunk keeps it when remapped.
    pub chunk: u64,
}

impl PoolSnapshot {
    /// Free bytes inside [start, start + len).
    pub fn free_in(&self, start: u64, len: u64) -> u64 {
        let end = start + len;
        self.free
            .iter()
            .map(|&(s, l)| (s.max(start), (s + l).min(end)))
            .filter(|(s, e)| e > s)
            .map(|(s, e)| e - s)
            .sum()
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

impl std::fmt::Display for PoolSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = &self.stats;
        writeln!(
            f,
            "pool at {:#x} (+{}): reserved {} in {} chunks, used {}, pending {}, spare {}, largest free range {}",
            self.base,
            mib(self.va_size),
            mib(st.reserved_bytes),
            self.units.len() + self.spares.len(),
            mib(st.used_bytes),
            mib(st.pending_bytes),
            mib(st.spare_bytes),
            mib(st.largest_free_range),
        )?;
        writeln!(
            f,
            "  history: {} grows, {} remaps ({}), {} chunks created, {} released, {} trims",
            st.grows,
            st.remaps,
            mib(st.bytes_remapped),
            st.chunks_created,
            st.chunks_released,
            st.trims
        )?;
        for (i, &(start, end)) in self.arenas.iter().enumerate() {
            writeln!(
                f,
                "  arena {} [{start:#x}, {end:#x}):",
                ["small", "large"][i]
            )?;
            for u in self.units.iter().filter(|u| u.va >= start && u.va < end) {
                let free = self.free_in(u.va, u.size);
                writeln!(
                    f,
                    "    {:#x} {:>10}  chunk {:<6} live {:>10}  free {:>10}",
                    u.va,
                    mib(u.size),
                    u.chunk,
                    mib(u.size - free),
                    mib(free)
                )?;
            }
        }
        for &(chunk, size) in &self.spares {
            writeln!(f, "  spare chunk {chunk} ({})", mib(size))?;
        }
        Ok(())
    }
}

/// A live allocation. Not `Clone`: it is consumed by [`Pool::free`], so a
/// double free does not compile.
#[derive(Debug)]
pub struct Allocation {
    ptr: DevicePtr,
    size: u64,
    /// The heap block's size: the request rounded up, or a little more when
    /// a pending block of a near size was reused.
    block_size: u64,
    arena: usize,
    block: BlockId,
    pool: u64,
    /// Its id in the pool's recorded trace (0 when not recording).
    trace_id: u64,
    device: DeviceId,
}

impl Allocation {
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The size asked for.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device of the pool it came from.
    pub fn device(&self) -> DeviceId {
        self.device
    }
}

/// What does not change after creation; outside the lock.
///
/// `repr(C)`: `device`, which every call reads, first, on [`Shared`]'s
/// first cache line.
#[repr(C)]
struct Space<B: Backend> {
    device: DeviceId,
    backend: Arc<B>,
    reservation: Arc<Reservation<B>>,
    granule: u64,
    defragment: bool,
    /// Chunks are created exportable ([`HandleType::PosixFileDescriptor`]).
    shareable: bool,
    /// The context's graph captures under way (see `capture.rs`).
    captures: Arc<Captures>,
}

impl<B: Backend> Space<B> {
    fn base(&self) -> u64 {
        self.reservation.base().0
    }
}

/// Allocations below this size share the small arena.
pub const SMALL_LIMIT: u64 = 1 << 20;

/// How many of a stream's latest small frees (small-arena blocks) stay
/// pending when a miss merges the others into the heap: a program that
/// allocates small blocks of a few sizes over and over (generation, a layer
/// at a time) then finds them on the same-size fast path instead of taking
/// the lock again. On the generation trace 270,000 of 324,000 small
/// allocations take the fast path, against 122,000 when every miss merged
/// every free (docs/RESULTS.md).
const KEEP_SMALL: usize = 64;

/// How many stream-ordered allocations that take the pool's lock share one
/// look for completed frees on the way in (an event query per stream with
/// frees pending).
const COLLECT_EVERY: u32 = 4;

/// A unit with no live byte: (address, size, the free heap block holding it).
type FreeUnit = (u64, u64, BlockId);

/// Chunks gathered for a growth, in order, each with the guard it was
/// under at its old place (see [`MovedUnit`]).
type Gathered<B> = (Vec<Arc<Chunk<B>>>, Vec<Under>);

/// The guard (stream, position) a moved unit was under at its old place,
/// if its old mapping stays as an [`Alias`].
type Under = Option<(u64, u64)>;

/// A unit taken out of its place: (old address, chunk, guard it was under).
type MovedUnit<B> = (u64, Arc<Chunk<B>>, Under);

/// One part of the reservation, with its own heap of mapped free space.
struct Arena {
    heap: Heap,
    start: u64,
    end: u64,
    /// Largest chunk a growth of this arena creates.
    chunk_size: u64,
    /// See [`PoolProps::chunk_divisor`].
    chunk_divisor: Option<u64>,
    /// See [`PoolProps::granule_growth_below`].
    granule_growth_below: u64,
}

impl Arena {
    /// Largest chunk a growth creates while the pool holds `reserved` bytes.
    fn growth_chunk(&self, reserved: u64, granule: u64) -> u64 {
        match self.chunk_divisor {
            Some(_) if reserved < self.granule_growth_below => granule,
            Some(d) => (reserved / d)
                .next_multiple_of(granule)
                .clamp(granule, self.chunk_size),
            None => self.chunk_size,
        }
    }
}

/// A stream with pending frees in this pool, and the events recorded on it
/// to learn when they complete (oldest first, with the position each
/// captured).
struct Registered<B: Backend> {
    /// Keeps the stream alive while its frees are pending.
    stream: Arc<StreamShared<B>>,
    events: VecDeque<(u64, B::Event)>,
}

/// A free heap range that a stream-ordered free returned before its
/// stream had passed it. The freeing stream may reuse it at once (stream
/// order); another stream only once ordered after the free, or made to wait
/// for it; a synchronous allocation only once the free is known complete;
/// and its chunk is not unmapped or moved until then. Guards cover free
/// heap space only and never overlap: an allocation removes the guards in
/// its range, once it may take it.
#[derive(Debug, Clone, Copy)]
struct Guard {
    end: u64,
    stream: u64,
    /// The stream's position at the free.
    seq: u64,
}

/// A unit moved away while its stream may still use it at its old address:
/// its chunk is mapped at the new place as well (a chunk may have several
/// mappings), and this old mapping goes once the stream passes `seq`. Its
/// address range is out of the heap until then. This is how the pool
/// defragments under a stream that runs behind: the memory moves at once,
/// without waiting, and the stream's later work, which is ordered after its
/// earlier work, uses the new address.
struct Alias<B: Backend> {
    mapping: Mapping<B>,
    stream: u64,
    seq: u64,
}

struct Inner<B: Backend> {
    /// Small, then large.
    arenas: [Arena; 2],
    /// Mapped units by address, in both arenas; every mapped byte is in the
    /// heap of its arena.
    units: BTreeMap<u64, Mapping<B>>,
    /// Chunks held but not mapped.
    spares: Vec<Arc<Chunk<B>>>,
    /// Mappings that could be neither given access nor unmapped: out of
    /// service, kept so their chunks stay accounted for.
    quarantine: Vec<Mapping<B>>,
    /// Chunks the driver would not release: still held and counted as
    /// reserved, released again at the next trim (or when the pool goes).
    unreleased: Vec<Arc<Chunk<B>>>,
    /// This pool's id, to find its entry in a stream's pending frees.
    id: u64,
    reserved: u64,
    reserved_high: u64,
    /// Bytes of live allocations, less the frees the streams' hot paths
    /// have not yet settled here (`PoolFrees::credit`; see
    /// [`Inner::settle`]), and the high-water mark of live bytes.
    used: u64,
    used_high: u64,
    release_threshold: u64,
    /// Most physical bytes the pool may hold (`PoolProps::max_size`).
    max_size: u64,
    /// The reuse switches, in order: follow event dependencies,
    /// opportunistic, internal dependencies.
    reuse: [bool; 3],
    /// Stream-ordered allocations that took the lock since the pool last
    /// looked for completed frees on the way in (see [`Inner::allocate`]).
    unchecked: u32,
    /// Reused buffers of the locked path, empty between calls: the guards
    /// an allocation finds in its range, and a stream's frees being merged.
    found_guards: Vec<(u64, Guard)>,
    merging: Vec<Pending>,
    stats: PoolStats,
    /// Streams with pending frees in this pool, by stream id. The frees
    /// themselves live in the stream (see `stream.rs`).
    streams: FxHashMap<u64, Registered<B>>,
    /// Events not in use, kept because creating them costs a driver call.
    idle_events: Vec<B::Event>,
    /// Guarded free ranges, by start.
    guards: BTreeMap<u64, Guard>,
    /// Old mappings of moved units, by address.
    aliases: BTreeMap<u64, Alias<B>>,
    /// What each device may do with the pool's memory
    /// (`cudaMemPoolSetAccess`): the owner's read-write first, then peers.
    /// Every mapping made gets it; [`Pool::set_access`] applies a change to
    /// every mapping there is.
    access: Vec<AccessDesc>,
}

/// `repr(C)` and aligned to a cache line: what an allocation and a free
/// read outside the lock (the id, the size limit, whether to record,
/// whether anything is exported, the device) comes first and shares one
/// line. Under PyTorch a call finds the pool cold, and every line it reads
/// is a load from far away (docs/RESULTS.md, "Calls on cold caches").
#[repr(C, align(64))]
pub(crate) struct Shared<B: Backend> {
    id: u64,
    /// The reservation's size: no allocation is larger.
    va_size: u64,
    recorder: Option<Box<Mutex<Recorder>>>,
    /// Allocations exported to other processes and their leases (`ipc.rs`).
    pub(crate) exports: Exports<B>,
    space: Space<B>,
    inner: Mutex<Inner<B>>,
    /// The other pools of the device, asked to release unused memory before
    /// this one reports out-of-memory.
    siblings: Weak<Siblings<B>>,
}

/// The pools of one device.
pub(crate) type Siblings<B> = Mutex<Vec<Weak<Shared<B>>>>;

/// A memory pool. Cloning gives another handle to the same pool.
pub struct Pool<B: Backend>(Arc<Shared<B>>);

impl<B: Backend> Clone for Pool<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
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
        let reservation = Reservation::new(backend, va_size as usize, 0)?;
        let base = reservation.base().0;
        // An eighth of the address space for small allocations is far more
        // than they ever need; the rest is for large ones.
        let split = base + (va_size / 8).next_multiple_of(granule);
        let arena = |start, end, chunk_size, chunk_divisor| Arena {
            heap: Heap::new(),
            start,
            end,
            chunk_size,
            chunk_divisor,
            granule_growth_below: props.granule_growth_below,
        };
        let id = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        let record = props.record.clone().or_else(|| {
            std::env::var_os("VMPOOL_RECORD").map(|prefix| {
                let mut path = prefix;
                path.push(format!(".{id}.trace"));
                PathBuf::from(path)
            })
        });
        let recorder = match record {
            Some(path) => {
                let file = File::create(&path).map_err(|e| {
                    Error::InvalidProps(format!("cannot record to {}: {e}", path.display()))
                })?;
                let mut recorder = Recorder {
                    out: BufWriter::new(file),
                    next_id: 1,
                    line: String::new(),
                };
                recorder.line(format_args!(
                    "# vmpool pool {id} on {device}: a <id> <bytes> <stream> | f <id> <stream>\n"
                ));
                Some(Box::new(Mutex::new(recorder)))
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            id,
            va_size,
            recorder,
            exports: Exports::default(),
            space: Space {
                device,
                backend: Arc::clone(backend),
                reservation,
                granule,
                defragment: props.defragment,
                shareable: props.handle_type == HandleType::PosixFileDescriptor,
                captures: Arc::clone(captures),
            },
            inner: Mutex::new(Inner {
                arenas: [
                    arena(base, split, granule, None),
                    arena(split, base + va_size, chunk_size, props.chunk_divisor),
                ],
                units: BTreeMap::new(),
                spares: Vec::new(),
                quarantine: Vec::new(),
                unreleased: Vec::new(),
                id,
                reserved: 0,
                reserved_high: 0,
                used: 0,
                used_high: 0,
                release_threshold: 0,
                max_size: props.max_size.unwrap_or(u64::MAX),
                reuse: [true; 3],
                unchecked: 0,
                found_guards: Vec::new(),
                merging: Vec::new(),
                stats: PoolStats::default(),
                streams: FxHashMap::default(),
                idle_events: Vec::new(),
                guards: BTreeMap::new(),
                aliases: BTreeMap::new(),
                access: vec![AccessDesc::read_write(device)],
            }),
            siblings: Arc::downgrade(siblings),
        });
        let mut list = siblings.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&shared));
        tracing::debug!(pool = shared.id, %device, va_size, chunk_size, chunk_divisor = ?props.chunk_divisor, "pool created");
        Ok(Self(shared))
    }

    pub(crate) fn from_shared(shared: Arc<Shared<B>>) -> Self {
        Self(shared)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared<B>> {
        &self.0
    }

    pub(crate) fn id(&self) -> u64 {
        self.0.id
    }

    pub(crate) fn is_shareable(&self) -> bool {
        self.0.space.shareable
    }

    /// The address of the first unit under `[ptr, ptr + size)` and the
    /// chunks of all of them, in address order. The range must be a live
    /// allocation, so that its units are mapped and stay put.
    pub(crate) fn units_under(&self, ptr: u64, size: u64) -> (u64, Vec<Arc<Chunk<B>>>) {
        let inner = self.lock();
        let first = inner
            .units
            .range(..=ptr)
            .next_back()
            .map_or(ptr, |(&va, _)| va);
        let chunks = inner
            .units
            .range(first..ptr + size.max(1))
            .map(|(_, m)| Arc::clone(m.chunk()))
            .collect();
        (first, chunks)
    }

    pub(crate) fn owns(&self, allocation: &Allocation) -> bool {
        allocation.pool == self.0.id
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        // Every update of the tables completes before the lock is released
        // (driver failures are handled, not unwound), so a poisoned lock
        // still guards consistent state.
        self.0.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn device(&self) -> DeviceId {
        self.0.space.device
    }

    pub fn backend(&self) -> &Arc<B> {
        &self.0.space.backend
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
    /// allow (SPEC.md section 3), possibly by making `stream` wait for the
    /// free.
    #[inline]
    pub fn allocate_async(&self, size: u64, stream: &Stream<B>) -> Result<Allocation> {
        self.same_device(stream)?;
        self.allocate_with(size, Some(&stream.0))
    }

    /// Frees `allocation` in stream order on `stream`: the memory goes back
    /// to the pool once the work queued on `stream` so far has run. The
    /// stream must be ordered after every use of the allocation.
    #[inline]
    pub fn free_async(&self, allocation: Allocation, stream: &Stream<B>) -> Result<()> {
        if allocation.pool != self.0.id {
            return Err(Error::WrongPool {
                ptr: allocation.ptr.0,
            });
        }
        self.same_device(stream)?;
        let Some(allocation) = self.0.exports.on_free(allocation, Some(&stream.0)) else {
            return Ok(());
        };
        tracing::trace!(pool = self.0.id, ptr = %allocation.ptr, size = allocation.size, stream = stream.0.id, "free_async");
        self.record_free(&allocation, stream.0.id);
        let size = allocation.block_size;
        loop {
            let mut st = stream.0.state();
            st.seq += 1;
            let seq = st.seq;
            if let Some(frees) = st.pending.get_mut(&self.0.id) {
                frees.push(Pending {
                    arena: allocation.arena,
                    block: allocation.block,
                    ptr: allocation.ptr.0,
                    size,
                    seq,
                });
                return Ok(());
            }
            // First pending free of this stream here: register it with the
            // pool (its lock comes first), then retry.
            drop(st);
            self.register(&stream.0);
        }
    }

    /// Out of line: a stream registers once, then frees on the hot path.
    #[cold]
    fn register(&self, stream: &Arc<StreamShared<B>>) {
        self.lock().register(stream);
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
        let va_size = self.0.va_size;
        if size == 0 {
            return Err(Error::InvalidSize {
                requested: size,
                reason: "zero bytes",
            });
        }
        if size > va_size {
            return Err(Error::InvalidSize {
                requested: size,
                reason: "larger than the pool's address space",
            });
        }
        let rounded = size.next_multiple_of(QUANTUM);
        if let Some(s) = stream {
            // The hot path: memory this stream freed, reused in its order,
            // without the pool's lock.
            let reused = s
                .state()
                .pending
                .get_mut(&self.0.id)
                .and_then(|f| f.reuse(rounded));
            if let Some(p) = reused {
                return Ok(self.hand_out(size, p, s.id));
            }
        }
        self.allocate_locked(size, rounded, stream)
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
    ) -> Result<Allocation> {
        let mut released_others = false;
        loop {
            let mut inner = self.lock();
            match inner.allocate(&self.0.space, rounded, stream) {
                Ok(p) => {
                    inner.count_used(p.size);
                    drop(inner);
                    return Ok(self.hand_out(size, p, stream.map_or(0, |s| s.id)));
                }
                Err(Error::Driver(e)) if e.kind() == ErrorKind::OutOfMemory && !released_others => {
                    // Pending frees become free once their streams finish.
                    inner.wait_for_pending_frees(&self.0.space);
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
                        .space
                        .backend
                        .mem_info(self.0.space.device)
                        .map_or(0, |m| m.free as u64);
                    return Err(Error::OutOfMemory {
                        device: self.0.space.device,
                        requested: size,
                        reserved: inner.reserved,
                        used: inner.live_bytes(),
                        device_free,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Returns an allocation to the pool.
    pub fn free(&self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.0.id {
            return Err(Error::WrongPool {
                ptr: allocation.ptr.0,
            });
        }
        let Some(allocation) = self.0.exports.on_free(allocation, None) else {
            return Ok(());
        };
        tracing::trace!(pool = self.0.id, ptr = %allocation.ptr, size = allocation.size, "free");
        self.record_free(&allocation, 0);
        let mut inner = self.lock();
        inner.free(allocation.arena, allocation.block);
        inner.used -= allocation.block_size;
        Ok(())
    }

    #[inline(always)]
    fn hand_out(&self, size: u64, p: Pending, stream: u64) -> Allocation {
        tracing::trace!(
            pool = self.0.id,
            ptr = format_args!("{:#x}", p.ptr),
            size,
            "allocate"
        );
        let trace_id = match &self.0.recorder {
            Some(r) => Recorder::allocation(r, size, stream),
            None => 0,
        };
        Allocation {
            ptr: DevicePtr(p.ptr),
            size,
            block_size: p.size,
            arena: p.arena,
            block: p.block,
            pool: self.0.id,
            trace_id,
            device: self.0.space.device,
        }
    }

    /// Writes out what the pool has recorded so far (see
    /// [`PoolProps::record`]); a pool that is never dropped, such as one of
    /// the C library's, must be flushed before the process exits.
    pub fn flush_trace(&self) -> std::io::Result<()> {
        match &self.0.recorder {
            Some(r) => lock(r).out.flush(),
            None => Ok(()),
        }
    }

    fn record_free(&self, allocation: &Allocation, stream: u64) {
        if let Some(r) = &self.0.recorder {
            Recorder::free(r, allocation.trace_id, stream);
        }
    }

    /// Releases the stream-ordered frees of `stream` up to position `upto`
    /// (its work has run that far), then trims to the release threshold.
    pub(crate) fn stream_passed(&self, stream: u64, upto: u64) -> Result<()> {
        let mut inner = self.lock();
        inner.release_pending(stream, upto);
        let keep = inner.release_threshold;
        inner.trim_to(keep)
    }

    /// Changes the most physical bytes the pool may hold
    /// ([`PoolProps::max_size`]; `None`: no limit but the device's memory).
    /// Growth past it fails with [`Error::PoolLimit`]; memory held above it
    /// now stays until it is freed and trimmed.
    pub fn set_max_size(&self, max_size: Option<u64>) {
        self.lock().max_size = max_size.unwrap_or(u64::MAX);
    }

    /// Releases unused physical memory until the pool holds at most
    /// `bytes_to_keep` bytes, or nothing more can be released (a chunk is
    /// released only once no live byte is on any part of it).
    pub fn trim_to(&self, bytes_to_keep: u64) -> Result<()> {
        self.lock().trim_to(bytes_to_keep)
    }

    fn release_unused_on_device(&self) {
        let Some(siblings) = self.0.siblings.upgrade() else {
            return;
        };
        let pools: Vec<Arc<Shared<B>>> = siblings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for shared in pools {
            let pool = Pool(shared);
            // Memory a pool's streams freed but have not passed is unused
            // too, once they have: wait for them, as for this pool's own.
            pool.lock().wait_for_pending_frees(&pool.0.space);
            if let Err(err) = pool.trim_to(0) {
                tracing::warn!(%err, "releasing unused memory failed");
            }
        }
    }

    /// Lets `device` access the pool's memory as `access`
    /// (`cudaMemPoolSetAccess`): everything mapped now, and everything
    /// mapped later, growth and remapped chunks included. The pool's own
    /// device always has read-write access; asking for less is an error.
    /// On failure the pool's memory and access list are as before.
    ///
    /// Taking access away is not stream-ordered: work queued on `device`
    /// that still touches the pool must have finished.
    pub fn set_access(&self, device: DeviceId, access: Access) -> Result<()> {
        if device.0 >= self.backend().device_count()? {
            return Err(Error::InvalidDevice(device));
        }
        if device == self.device() {
            return match access {
                Access::ReadWrite => Ok(()),
                _ => Err(Error::InvalidAccess {
                    device,
                    reason: "the pool's own device always has read-write access",
                }),
            };
        }
        self.lock().set_access(AccessDesc { device, access })
    }

    /// What `device` may do with the pool's memory
    /// (`cudaMemPoolGetAccess`).
    pub fn access(&self, device: DeviceId) -> Result<Access> {
        if device.0 >= self.backend().device_count()? {
            return Err(Error::InvalidDevice(device));
        }
        Ok(self
            .lock()
            .access
            .iter()
            .find(|d| d.device == device)
            .map_or(Access::None, |d| d.access))
    }

    pub fn attribute(&self, attribute: PoolAttribute) -> u64 {
        let inner = self.lock();
        match attribute {
            PoolAttribute::ReleaseThreshold => inner.release_threshold,
            PoolAttribute::ReuseFollowEventDependencies => inner.reuse[0] as u64,
            PoolAttribute::ReuseAllowOpportunistic => inner.reuse[1] as u64,
            PoolAttribute::ReuseAllowInternalDependencies => inner.reuse[2] as u64,
            PoolAttribute::ReservedMemCurrent => inner.reserved,
            PoolAttribute::ReservedMemHigh => inner.reserved_high,
            PoolAttribute::UsedMemCurrent => inner.live_bytes(),
            PoolAttribute::UsedMemHigh => inner.used_high,
        }
    }

    pub fn set_attribute(&self, attribute: PoolAttribute, value: u64) -> Result<()> {
        let invalid = |reason| Error::InvalidAttribute {
            attribute,
            value,
            reason,
        };
        let flag = |value| match value {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(invalid("a switch takes 0 or 1")),
        };
        let mut inner = self.lock();
        match attribute {
            PoolAttribute::ReleaseThreshold => inner.release_threshold = value,
            PoolAttribute::ReuseFollowEventDependencies => inner.reuse[0] = flag(value)?,
            PoolAttribute::ReuseAllowOpportunistic => inner.reuse[1] = flag(value)?,
            PoolAttribute::ReuseAllowInternalDependencies => inner.reuse[2] = flag(value)?,
            PoolAttribute::ReservedMemHigh | PoolAttribute::UsedMemHigh if value != 0 => {
                return Err(invalid("a high-water mark can only be reset, with 0"))
            }
            PoolAttribute::ReservedMemHigh => inner.reserved_high = inner.reserved,
            PoolAttribute::UsedMemHigh => {
                inner.settle();
                inner.used_high = inner.used;
            }
            PoolAttribute::ReservedMemCurrent | PoolAttribute::UsedMemCurrent => {
                return Err(invalid("read-only"))
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let used_bytes = inner.live_bytes();
        let mut stats = inner.stats.clone();
        let mut pending_bytes: u64 = inner.guards.iter().map(|(&a, g)| g.end - a).sum();
        for reg in inner.streams.values() {
            if let Some(f) = reg.stream.state().pending.get(&self.0.id) {
                // Hot-path counts live with the stream until it unregisters.
                stats.allocations += f.reuses;
                stats.same_stream_reuses += f.reuses;
                stats.frees += f.frees;
                pending_bytes += f.bytes;
            }
        }
        PoolStats {
            reserved_bytes: inner.reserved,
            used_bytes,
            mapped_bytes: inner.units.values().map(|m| m.size() as u64).sum(),
            spare_bytes: inner.spares.iter().map(|c| c.size() as u64).sum(),
            units: inner.units.len() as u64,
            largest_free_range: inner
                .arenas
                .iter()
                .map(|a| a.heap.largest_free())
                .max()
                .unwrap_or(0),
            pending_bytes,
            aliased_bytes: inner
                .aliases
                .values()
                .map(|a| a.mapping.size() as u64)
                .sum(),
            ..stats
        }
    }

    /// The pool's ranges and chunks as they are now.
    pub fn snapshot(&self) -> PoolSnapshot {
        let stats = self.stats();
        let inner = self.lock();
        let mut free = Vec::new();
        for arena in &inner.arenas {
            arena
                .heap
                .for_each_free(|addr, len, _| free.push((addr, len)));
        }
        free.sort_unstable();
        PoolSnapshot {
            base: self.0.space.base(),
            va_size: self.0.va_size,
            arenas: inner.arenas.iter().map(|a| (a.start, a.end)).collect(),
            units: inner
                .units
                .iter()
                .map(|(&va, m)| UnitView {
                    va,
                    size: m.size() as u64,
                    chunk: m.chunk().handle().0,
                })
                .collect(),
            free,
            spares: inner
                .spares
                .iter()
                .map(|c| (c.handle().0, c.size() as u64))
                .collect(),
            stats,
        }
    }

    /// Recounts the pool from its own tables and checks them against the
    /// running totals; returns what disagrees. For tests and debugging.
    pub fn audit(&self) -> std::result::Result<(), String> {
        let inner = self.lock();
        let used = inner.live_bytes();
        // Pending frees still in their streams' lists are allocated in the
        // heap; guarded ones are free there.
        let pending: u64 = inner
            .streams
            .values()
            .filter_map(|reg| reg.stream.state().pending.get(&self.0.id).map(|f| f.bytes))
            .sum();
        inner.audit(used + pending)
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
        let waited = inner.wait_for_pending_frees(&self.space);
        let used = inner.live_bytes();
        if used > 0 || (!waited && !inner.streams.is_empty()) {
            tracing::warn!(
                pool = self.id,
                used,
                pending_streams = inner.streams.len(),
                "pool dropped with live allocations, or during a graph capture with frees \
                 pending: its memory stays mapped"
            );
            std::mem::forget(std::mem::take(&mut inner.units));
            std::mem::forget(std::mem::take(&mut inner.quarantine));
        }
        if let Some(recorder) = &self.recorder {
            if let Err(err) = lock(recorder).out.flush() {
                tracing::warn!(%err, "writing the allocation trace failed");
            }
        }
    }
}

impl<B: Backend> Inner<B> {
    /// Bytes of live allocations: `used` less the streams' credits
    /// (`PoolFrees::credit`: bytes their hot paths freed without this lock).
    /// It reads the credits and leaves them: settling them here would send
    /// the streams' next same-size allocations to the locked path, so that
    /// reading a statistic changed what it measures.
    fn live_bytes(&self) -> u64 {
        let credit: u64 = self
            .streams
            .values()
            .filter_map(|reg| reg.stream.state().pending.get(&self.id).map(|f| f.credit))
            .sum();
        self.used - credit
    }

    /// Moves every stream's credit into `used`.
    ///
    /// Why the high-water mark stays exact though the hot path never
    /// touches it: `used` grows only in [`Inner::count_used`], under this
    /// lock, right after a settle, and the high is taken then. A stream's
    /// hot path allocates only against its credit, that is, never more than
    /// it freed since the last settle; so between two settles no stream
    /// holds more than it did at the first, and live bytes stay at or under
    /// what `used` was then. Resetting the high settles too, for the same
    /// reason.
    fn settle(&mut self) {
        let id = self.id;
        let credit: u64 = self
            .streams
            .values()
            .filter_map(|reg| {
                let mut st = reg.stream.state();
                st.pending
                    .get_mut(&id)
                    .map(|f| std::mem::take(&mut f.credit))
            })
            .sum();
        self.used -= credit;
    }

    /// Counts an allocation of `size` bytes made under this lock.
    fn count_used(&mut self, size: u64) {
        self.settle();
        self.used += size;
        self.used_high = self.used_high.max(self.used);
    }

    /// The slow path of an allocation: the heap, then (stream-ordered) other
    /// pending frees as the reuse switches allow, then growth.
    fn allocate(
        &mut self,
        space: &Space<B>,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<Pending> {
        let arena = usize::from(size >= SMALL_LIMIT);
        // Opportunistic reuse: frees whose events have completed go back to
        // the heap. One stream-ordered miss in COLLECT_EVERY looks (an
        // event query per stream with frees pending), which keeps guards
        // and aliases from piling up; before it grows, the pool always
        // looks.
        if stream.is_some() && self.reuse[1] {
            self.unchecked += 1;
            if self.unchecked >= COLLECT_EVERY {
                self.unchecked = 0;
                self.collect_completed(space)?;
            }
        }
        // Blocks the guards keep from this allocation, held while it looks
        // further and given back at the end.
        let mut held = Vec::new();
        let found = self.allocate_unheld(space, arena, size, stream, &mut held);
        for (arena, block) in held {
            self.arenas[arena].heap.free(block);
        }
        self.stats.allocations += u64::from(found.is_ok());
        found
    }

    /// [`Inner::allocate`], leaving in `held` the blocks it took from the
    /// heap but may not use.
    fn allocate_unheld(
        &mut self,
        space: &Space<B>,
        arena: usize,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        held: &mut Vec<(usize, BlockId)>,
    ) -> Result<Pending> {
        let block = |arena, (ptr, block)| Pending {
            arena,
            block,
            ptr,
            size,
            seq: 0,
        };
        // The stream's own frees, at any size: in its order they are free,
        // and back in the heap they join their free neighbours, so the
        // heap's choice is as good as without stream order. The latest
        // small ones stay for the same-size fast path, unless the heap
        // cannot serve without them.
        let mut kept = false;
        if let Some(s) = stream {
            kept = self.merge_own_frees(space, s, KEEP_SMALL)?;
        }
        if let Some(found) = self.take_from_heap(space, arena, size, stream, held)? {
            return Ok(block(arena, found));
        }
        if let Some(s) = stream.filter(|_| kept) {
            self.merge_own_frees(space, s, 0)?;
            if let Some(found) = self.take_from_heap(space, arena, size, stream, held)? {
                return Ok(block(arena, found));
            }
        }
        if let Some(s) = stream {
            if let Some(p) = self.reuse_pending(space, size, s)? {
                return Ok(p);
            }
            if self.reuse[1] {
                // Events just recorded on idle streams complete at once:
                // better their frees than new memory.
                self.record_pending(space, s.id)?;
                self.collect_completed(space)?;
                if let Some(found) = self.take_from_heap(space, arena, size, stream, held)? {
                    return Ok(block(arena, found));
                }
            }
        }
        loop {
            let started = std::time::Instant::now();
            let grown = self.grow(space, arena, size, stream.map(|s| s.id));
            self.stats.grow_nanos += started.elapsed().as_nanos() as u64;
            let (arena, (addr, id)) = match grown {
                Ok(free) => (arena, self.arenas[arena].heap.alloc_from(free, size)),
                // The device is full, but the other arena may have room:
                // better there than out of memory.
                Err(Error::Driver(e)) if e.kind() == ErrorKind::OutOfMemory => {
                    let other = 1 - arena;
                    match self.take_from_heap(space, other, size, stream, held)? {
                        Some(found) => (other, found),
                        None => return Err(Error::Driver(e)),
                    }
                }
                Err(e) => return Err(e),
            };
            // Growth may extend a guarded free range.
            let cleared = self.clear_guards(space, addr, size, stream);
            if let Ok(true) = cleared {
                return Ok(block(arena, (addr, id)));
            }
            held.push((arena, id));
            cleared?;
        }
    }

    /// A heap block of `size` bytes in `arena` that `stream` may take (see
    /// [`Guard`]); the blocks it may not take go to `held`.
    fn take_from_heap(
        &mut self,
        space: &Space<B>,
        arena: usize,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        held: &mut Vec<(usize, BlockId)>,
    ) -> Result<Option<(u64, BlockId)>> {
        while let Some((addr, block)) = self.arenas[arena].heap.alloc(size) {
            match self.clear_guards(space, addr, size, stream) {
                Ok(true) => return Ok(Some((addr, block))),
                // Given back to the heap by the caller, either way.
                Ok(false) => held.push((arena, block)),
                Err(err) => {
                    held.push((arena, block));
                    return Err(err);
                }
            }
        }
        Ok(None)
    }

    /// Whether `stream` (`None`: a synchronous allocation) may take
    /// `[addr, addr + size)`, as far as guards go: each guard of another
    /// stream must be one `stream` is ordered after, or, where the switches
    /// allow, `stream` is made to wait for it. If so, the guards of the range
    /// go (the allocation's own later free will guard it again).
    fn clear_guards(
        &mut self,
        space: &Space<B>,
        addr: u64,
        size: u64,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Result<bool> {
        let end = addr + size;
        let mut found = std::mem::take(&mut self.found_guards);
        found.extend(self.guards_in(addr, end));
        let cleared = if found.is_empty() {
            Ok(true)
        } else {
            self.clear_found_guards(space, addr, end, stream, &found)
        };
        found.clear();
        self.found_guards = found;
        cleared
    }

    /// [`Inner::clear_guards`], given the guards `found` in the range.
    fn clear_found_guards(
        &mut self,
        space: &Space<B>,
        addr: u64,
        end: u64,
        stream: Option<&Arc<StreamShared<B>>>,
        found: &[(u64, Guard)],
    ) -> Result<bool> {
        // Other streams whose frees are in the range, each with its latest
        // free there: few, so a list.
        let mut after: Vec<(u64, u64)> = Vec::new();
        for (_, g) in found {
            if stream.is_none_or(|s| s.id != g.stream) {
                match after.iter_mut().find(|(id, _)| *id == g.stream) {
                    Some((_, seq)) => *seq = (*seq).max(g.seq),
                    None => after.push((g.stream, g.seq)),
                }
            }
        }
        if !after.is_empty() {
            let Some(s) = stream else {
                return Ok(false);
            };
            for (id, seq) in after {
                if self.reuse[0] && s.state().clock.get(id) >= seq {
                    continue;
                }
                if !self.reuse[2] || self.wait_for_frees_of(space, s, id)?.is_none() {
                    return Ok(false);
                }
            }
        }
        self.remove_guards(addr, end, found);
        Ok(true)
    }

    /// Removes the guards' coverage of `[start, end)`, keeping what lies
    /// outside; returns the guards that covered part of it.
    fn take_guards(&mut self, start: u64, end: u64) -> Vec<Guard> {
        let found: Vec<(u64, Guard)> = self.guards_in(start, end).collect();
        self.remove_guards(start, end, &found);
        found.into_iter().rev().map(|(_, g)| g).collect()
    }

    /// [`Inner::take_guards`], given the guards `guards_in` found there.
    fn remove_guards(&mut self, start: u64, end: u64, found: &[(u64, Guard)]) {
        for &(at, g) in found {
            self.guards.remove(&at);
            if at < start {
                self.guards.insert(at, Guard { end: start, ..g });
            }
            if g.end > end {
                self.guards.insert(end, g);
            }
        }
    }

    /// The guards overlapping `[start, end)`, from the highest address down.
    fn guards_in(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, Guard)> + '_ {
        self.guards
            .range(..end)
            .rev()
            .take_while(move |(_, g)| g.end > start)
            .map(|(&a, &g)| (a, g))
    }

    /// Moves the pending frees of `stream` into the heap, guarded, in the
    /// order they were freed, so that the stream can reuse them at any size;
    /// all but the latest `keep` small ones, which stay pending for the
    /// same-size fast path. Returns whether any stayed.
    ///
    /// The guards go when an event shows the stream has passed the frees;
    /// one is recorded here unless one is outstanding already, so that a
    /// stream missing often records at most one event per round trip of its
    /// work, and its free chunks become movable again once it catches up.
    fn merge_own_frees(
        &mut self,
        space: &Space<B>,
        stream: &Arc<StreamShared<B>>,
        keep: usize,
    ) -> Result<bool> {
        let mut merged = std::mem::take(&mut self.merging);
        let mut kept = false;
        if let Some(f) = stream.state().pending.get_mut(&self.id) {
            kept = f.drain_all_but(keep, |p| p.arena == 0, &mut merged);
        }
        for p in &merged {
            self.arenas[p.arena].heap.free(p.block);
            let guard = Guard {
                end: p.ptr + p.size,
                stream: stream.id,
                seq: p.seq,
            };
            self.guards.insert(p.ptr, guard);
            self.stats.frees_merged += 1;
        }
        let any = !merged.is_empty();
        merged.clear();
        self.merging = merged;
        if any && self.streams[&stream.id].events.is_empty() {
            // None during a graph capture: the frees stay guarded (the
            // stream's own to reuse) until a later miss records one.
            self.event_after_frees(space, stream.id)?;
        }
        Ok(kept)
    }

    /// Notes that `stream` has (or will have) pending frees here.
    fn register(&mut self, stream: &Arc<StreamShared<B>>) {
        self.streams.entry(stream.id).or_insert_with(|| Registered {
            stream: Arc::clone(stream),
            events: VecDeque::new(),
        });
        stream.state().pending.entry(self.id);
    }

    /// Moves the pending frees whose events have completed back to the heap
    /// (opportunistic reuse). An event that reports an error fails the call.
    #[cold]
    fn collect_completed(&mut self, space: &Space<B>) -> Result<()> {
        if space.captures.under_way() {
            return Ok(());
        }
        let mut passed = Vec::new();
        for (&id, reg) in &self.streams {
            let mut upto = 0;
            for (seq, event) in &reg.events {
                match space.backend.query_event(event)? {
                    EventStatus::Complete => upto = *seq,
                    EventStatus::Pending => break,
                }
            }
            if upto > 0 {
                passed.push((id, upto));
            }
        }
        for (id, upto) in passed {
            self.release_pending(id, upto);
        }
        Ok(())
    }

    /// Memory freed in stream order on other streams that `stream` may take
    /// without growing the pool (its own are in the heap by now): frees of
    /// streams it is ordered after (follow event dependencies); then any,
    /// after making it wait for them (internal dependencies). Sizes up to
    /// 1/8 larger count.
    #[cold]
    fn reuse_pending(
        &mut self,
        space: &Space<B>,
        size: u64,
        stream: &Arc<StreamShared<B>>,
    ) -> Result<Option<Pending>> {
        let pool = self.id;
        let clock = stream.state().clock.clone();
        let others = || self.streams.iter().filter(|(&id, _)| id != stream.id);
        if self.reuse[0] {
            for (&id, reg) in others() {
                let upto = clock.get(id);
                let mut st = reg.stream.state();
                let Some(f) = st.pending.get_mut(&pool) else {
                    continue;
                };
                if let Some(near) = f.near_size(size, upto) {
                    self.stats.dependency_reuses += 1;
                    return Ok(f.take(near, upto));
                }
            }
        }
        if self.reuse[2] {
            let candidate = others().find_map(|(&id, reg)| {
                let st = reg.stream.state();
                let near = st.pending.get(&pool)?.near_size(size, u64::MAX)?;
                Some((id, near))
            });
            if let Some((id, near)) = candidate {
                let Some(event_seq) = self.wait_for_frees_of(space, stream, id)? else {
                    return Ok(None);
                };
                let reg = &self.streams[&id];
                // The other stream's own hot path may have taken the block
                // meanwhile; then this is a wait for nothing, and we grow.
                let taken = reg
                    .stream
                    .state()
                    .pending
                    .get_mut(&pool)
                    .and_then(|f| f.take(near, event_seq));
                return Ok(taken);
            }
        }
        Ok(None)
    }

    /// Makes `stream` wait (on the device) for every free stream `id` has
    /// made so far (an internal dependency); returns the position of `id`
    /// it is now ordered after. `None`, with nothing done, while a graph
    /// capture is under way (see `capture.rs`).
    fn wait_for_frees_of(
        &mut self,
        space: &Space<B>,
        stream: &Arc<StreamShared<B>>,
        id: u64,
    ) -> Result<Option<u64>> {
        if space.captures.under_way() {
            return Ok(None);
        }
        let Some(event_seq) = self.event_after_frees(space, id)? else {
            return Ok(None);
        };
        let (_, event) = self.streams[&id]
            .events
            .iter()
            .find(|(seq, _)| *seq == event_seq)
            .expect("recorded above");
        space.backend.stream_wait_event(&stream.raw, event)?;
        stream.state().clock.advance(id, event_seq);
        self.stats.waits_inserted += 1;
        Ok(Some(event_seq))
    }

    /// An event on stream `id` that captures all its frees so far; records
    /// one if the latest does not. Returns the position it captured; `None`
    /// when one is needed while a graph capture is under way (see
    /// `capture.rs`).
    fn event_after_frees(&mut self, space: &Space<B>, id: u64) -> Result<Option<u64>> {
        let reg = self.streams.get_mut(&id).expect("caller checked");
        let last_free = reg
            .stream
            .state()
            .pending
            .get(&self.id)
            .map_or(0, |f| f.last_free);
        if let Some((seq, _)) = reg.events.back() {
            if *seq >= last_free {
                return Ok(Some(*seq));
            }
        }
        if space.captures.under_way() {
            return Ok(None);
        }
        let event = match self.idle_events.pop() {
            Some(event) => event,
            None => space.backend.create_event(reg.stream.device)?,
        };
        let seq = {
            let mut st = reg.stream.state();
            st.seq += 1;
            st.seq
        };
        if let Err(err) = space.backend.record_event(&event, &reg.stream.raw) {
            self.idle_events.push(event);
            return Err(err.into());
        }
        reg.events.push_back((seq, event));
        self.stats.events_recorded += 1;
        Ok(Some(seq))
    }

    /// Records an event after the latest free of every stream that has
    /// none, so that a later miss can tell when those frees complete. Done
    /// on misses only: the same-stream path records nothing.
    #[cold]
    fn record_pending(&mut self, space: &Space<B>, except: u64) -> Result<()> {
        let ids: Vec<u64> = self
            .streams
            .keys()
            .copied()
            .filter(|&id| id != except)
            .collect();
        for id in ids {
            self.event_after_frees(space, id)?;
        }
        Ok(())
    }

    /// Frees of stream `id` up to position `upto` are free for every
    /// stream: back to the heap, and their guards go. Events that captured
    /// no later position go idle; a stream left with nothing pending and no
    /// guard is unregistered.
    fn release_pending(&mut self, id: u64, upto: u64) {
        if !self.streams.contains_key(&id) {
            return;
        }
        self.guards.retain(|_, g| g.stream != id || g.seq > upto);
        let passed: Vec<u64> = self
            .aliases
            .iter()
            .filter(|(_, a)| a.stream == id && a.seq <= upto)
            .map(|(&va, _)| va)
            .collect();
        for va in passed {
            let alias = self.aliases.remove(&va).expect("listed above");
            tracing::debug!(
                va = format_args!("{va:#x}"),
                "unmapping the old place of a moved unit"
            );
            self.retire(alias.mapping);
        }
        let guarded = self.guards.values().any(|g| g.stream == id)
            || self.aliases.values().any(|a| a.stream == id);
        let reg = self.streams.get_mut(&id).expect("checked");
        let (released, now_empty) = {
            let mut st = reg.stream.state();
            let f = st.pending.get_mut(&self.id).expect("registered");
            let mut released = Vec::new();
            f.drain_upto(upto, &mut released);
            let now_empty = f.is_empty() && !guarded;
            if now_empty {
                let f = st.pending.remove(&self.id).expect("present");
                self.used -= f.credit;
                self.stats.allocations += f.reuses;
                self.stats.same_stream_reuses += f.reuses;
                self.stats.frees += f.frees;
            }
            (released, now_empty)
        };
        while reg.events.front().is_some_and(|(seq, _)| *seq <= upto) {
            let (_, event) = reg.events.pop_front().expect("checked");
            self.idle_events.push(event);
        }
        if now_empty {
            let reg = self.streams.remove(&id).expect("present");
            self.idle_events
                .extend(reg.events.into_iter().map(|(_, e)| e));
        }
        for p in released {
            self.arenas[p.arena].heap.free(p.block);
            self.stats.frees_completed += 1;
        }
    }

    /// Blocks until every stream with pending frees has run past them, and
    /// releases them all (the last resort before out-of-memory, and drop).
    /// While a graph capture is under way nothing can be waited for: then
    /// it does nothing and returns false.
    fn wait_for_pending_frees(&mut self, space: &Space<B>) -> bool {
        if space.captures.under_way() {
            return false;
        }
        let streams: Vec<(u64, Arc<StreamShared<B>>)> = self
            .streams
            .iter()
            .map(|(&id, reg)| (id, Arc::clone(&reg.stream)))
            .collect();
        for (id, stream) in streams {
            let upto = stream.current_seq();
            match space.backend.synchronize_stream(&stream.raw) {
                Ok(()) => self.release_pending(id, upto),
                Err(err) => tracing::warn!(%err, "a stream with pending frees failed"),
            }
        }
        true
    }

    /// The access a new mapping gets: the list without its "none" entries
    /// (a mapping starts with no access for anyone).
    fn mapping_access(&self) -> Vec<AccessDesc> {
        self.access
            .iter()
            .copied()
            .filter(|d| d.access != Access::None)
            .collect()
    }

    /// Applies `desc` to every mapped unit, one driver call per run of
    /// adjacent units, then records it for later mappings. On failure the
    /// runs already changed get the device's previous access back.
    fn set_access(&mut self, desc: AccessDesc) -> Result<()> {
        let previous = AccessDesc {
            device: desc.device,
            access: self
                .access
                .iter()
                .find(|d| d.device == desc.device)
                .map_or(Access::None, |d| d.access),
        };
        let runs = self.unit_runs(..);
        for (i, (_, _, run)) in runs.iter().enumerate() {
            if let Err(err) = set_run_access(run, desc) {
                for (_, _, done) in &runs[..i] {
                    if let Err(err) = set_run_access(done, previous) {
                        tracing::warn!(%err, "could not restore a mapping's access");
                    }
                }
                return Err(err.into());
            }
        }
        match self.access.iter_mut().find(|d| d.device == desc.device) {
            Some(d) => d.access = desc.access,
            None => self.access.push(desc),
        }
        Ok(())
    }

    /// The units in `range` in runs of adjacent ones: each run's start, end
    /// and mappings, in address order.
    fn unit_runs(&self, range: impl RangeBounds<u64>) -> Vec<(u64, u64, Vec<&Mapping<B>>)> {
        let mut runs: Vec<(u64, u64, Vec<&Mapping<B>>)> = Vec::new();
        for (&va, m) in self.units.range(range) {
            match runs.last_mut() {
                Some((_, end, run)) if *end == va => {
                    *end += m.size() as u64;
                    run.push(m);
                }
                _ => runs.push((va, va + m.size() as u64, vec![m])),
            }
        }
        runs
    }

    fn free(&mut self, arena: usize, block: BlockId) {
        self.arenas[arena].heap.free(block);
        self.stats.frees += 1;
    }

    /// Maps new space so that a free block of at least `size` bytes exists,
    /// and returns it. On failure the tables are consistent and every chunk
    /// is still accounted for (mapped, spare or released).
    #[cold]
    fn grow(
        &mut self,
        space: &Space<B>,
        arena: usize,
        size: u64,
        stream: Option<u64>,
    ) -> Result<BlockId> {
        // Without defragmentation, nothing unused is moved: new memory only.
        let free = if space.defragment {
            self.free_units(stream)
        } else {
            Vec::new()
        };
        let plan = self.plan(space, arena, size, &free)?;
        let span = tracing::debug_span!(
            "grow",
            size,
            at = format_args!("{:#x}", plan.target.start),
            new = plan.len(),
            extends = plan.target.extends
        );
        let _enter = span.enter();
        let (chunks, moved_under) = self.gather(space, &plan.sources, &free)?;
        let sizes: Vec<u64> = chunks.iter().map(|c| c.size() as u64).collect();
        self.map_at(space, plan.target.start, chunks)?;
        self.stats.grows += 1;
        let block = self.arenas[arena]
            .heap
            .insert_free(plan.target.start, plan.len());
        // A unit moved from under its stream's queued work carries that
        // stream's guard to its new place: the same memory.
        let mut at = plan.target.start;
        for (size, under) in sizes.into_iter().zip(moved_under) {
            if let Some((stream, seq)) = under {
                let end = at + size;
                self.guards.insert(at, Guard { end, stream, seq });
            }
            at += size;
        }
        Ok(block)
    }

    /// `free`: the free units growth may move (see [`Inner::free_units`]).
    fn plan(&self, space: &Space<B>, arena: usize, size: u64, free: &[FreeUnit]) -> Result<Plan> {
        let growth_chunk = self.arenas[arena].growth_chunk(self.reserved, space.granule);
        let Arena {
            heap, start, end, ..
        } = &self.arenas[arena];
        // Address ranges in use: the units, which the heap's regions cover
        // exactly (a unit's range goes in when it is mapped and out when it
        // is unmapped), a region for each run of them; and the old places of
        // moved units, out of the heap but still mapped.
        let mut occupied = heap.regions();
        occupied.extend(
            self.aliases
                .range(start..end)
                .map(|(&va, a)| (va, a.mapping.size() as u64)),
        );
        // Two runs already in order: a stable sort merges them in one pass.
        occupied.sort();
        let next_in_use_after = |at: u64| {
            let i = occupied.partition_point(|&(va, _)| va < at);
            occupied.get(i).map_or(*end, |&(va, _)| va)
        };
        let mut tails: Vec<(u64, u64, u64)> = heap
            .free_region_tails()
            .map(|(start, len, _)| (start, len, next_in_use_after(start + len) - (start + len)))
            .collect();
        // Deterministic order for ties (the heap keeps tails in a hash map).
        tails.sort_unstable();
        let mut prev_end = *start;
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        for &(va, size) in &occupied {
            if va > prev_end {
                gaps.push((prev_end, va - prev_end));
            }
            prev_end = va + size;
        }
        gaps.push((prev_end, end - prev_end));
        let spares: Vec<u64> = if space.defragment {
            self.spares.iter().map(|c| c.size() as u64).collect()
        } else {
            Vec::new()
        };
        let units: Vec<(u64, u64)> = free.iter().map(|&(va, len, _)| (va, len)).collect();
        let inputs = plan::Inputs {
            tails: &tails,
            gaps: &gaps,
            spares: &spares,
            units: &units,
            granule: space.granule,
            chunk_size: growth_chunk,
        };
        plan::plan_growth(size, &inputs).ok_or(Error::InvalidSize {
            requested: size,
            reason: "no room left in the pool's address space",
        })
    }

    /// Units with no live byte, in both arenas, that can move or go: no
    /// stream may still touch them (no guard on them), except `mover`, for
    /// which a unit under its own guards moves and leaves an [`Alias`]
    /// behind; and their chunk has no other mapping.
    ///
    /// In the order growth should move them: by address, except that a
    /// pool whose chunks scale with it ([`PoolProps::chunk_divisor`])
    /// moves first the units of free blocks that start and end on unit
    /// boundaries. Moving a unit out of a block that ends part way into a
    /// unit holding live bytes shrinks the free space beside that partial
    /// unit, until nothing fits there and it is stranded; a block with
    /// whole units at both ends leaves none. (With fixed 32 MiB chunks the
    /// same order was measured neutral over the traces, and it takes
    /// gpt2_train's first pass from 1.0092 to 1.0193: docs/RESULTS.md.)
    fn free_units(&self, mover: Option<u64>) -> Vec<FreeUnit> {
        let whole_first = self.arenas[1].chunk_divisor.is_some();
        // The free blocks that can hold a unit, ranked; their units then
        // come in address order within each block, and blocks do not
        // overlap, so the units come out ranked too.
        let mut blocks: Vec<(bool, u64, u64, BlockId)> = Vec::new();
        for arena in &self.arenas {
            arena.heap.for_each_free(|addr, len, block| {
                // Units are whole granules: the small arena's chunk size.
                if len < self.arenas[0].chunk_size {
                    return;
                }
                // A block lies in one mapped region, which its units tile:
                // it starts on a unit boundary when a unit starts there, and
                // ends on one when the last unit starting in it ends there.
                let partial = whole_first && {
                    let mut ends = self.units.range(addr..addr + len);
                    let first = ends.next();
                    let last = ends.next_back().or(first);
                    !(first.is_some_and(|(&va, _)| va == addr)
                        && last.is_some_and(|(&va, m)| va + m.size() as u64 == addr + len))
                };
                blocks.push((partial, addr, len, block));
            });
        }
        blocks.sort_unstable_by_key(|&(partial, addr, _, _)| (partial, addr));
        let mut found = Vec::new();
        for (_, addr, len, block) in blocks {
            for (&va, m) in self.units.range(addr..addr + len) {
                let end = va + m.size() as u64;
                let movable = || {
                    Arc::strong_count(m.chunk()) == 1
                        && self
                            .guards_in(va, end)
                            .all(|(_, g)| Some(g.stream) == mover)
                };
                if end <= addr + len && movable() {
                    found.push((va, m.size() as u64, block));
                }
            }
        }
        found
    }

    /// The heap of the arena `va` lies in.
    fn heap_of(&mut self, va: u64) -> &mut Heap {
        let small = va < self.arenas[0].end;
        &mut self.arenas[usize::from(!small)].heap
    }

    /// Takes free units (as [`Inner::free_units`] lists them) out of the
    /// heap and unmaps them, right to left so that each free block's id
    /// stays valid for the units left of it. A unit under guards (of the
    /// stream that moves it) is not unmapped but kept as an [`Alias`].
    /// Returns their chunks by the address they had, each with the guard
    /// (stream, position) it was under. A unit that fails to unmap goes
    /// back in the heap; the chunks unmapped before it are spare.
    fn unmap_units(&mut self, mut units: Vec<FreeUnit>) -> Result<Vec<MovedUnit<B>>> {
        units.sort_by_key(|&(va, _, _)| std::cmp::Reverse(va));
        let mut chunks: Vec<MovedUnit<B>> = Vec::new();
        for (va, len, block) in units {
            self.heap_of(va).take(block, va, len);
            let mapping = self.units.remove(&va).expect("a free unit is mapped");
            let guards = self.take_guards(va, va + len);
            if let Some(&first) = guards.first() {
                let seq = guards.iter().map(|g| g.seq).max().expect("not empty");
                let chunk = Arc::clone(mapping.chunk());
                tracing::debug!(
                    va = format_args!("{va:#x}"),
                    len,
                    stream = first.stream,
                    "moving a unit its stream may still use: the old mapping stays until it passes"
                );
                self.aliases.insert(
                    va,
                    Alias {
                        mapping,
                        stream: first.stream,
                        seq,
                    },
                );
                chunks.push((va, chunk, Some((first.stream, seq))));
                continue;
            }
            match mapping.unmap() {
                Ok(chunk) => {
                    self.stats.unmaps += 1;
                    tracing::debug!(va = format_args!("{va:#x}"), len, "unmapped unit");
                    chunks.push((va, chunk, None));
                }
                Err((err, mapping)) => {
                    self.units.insert(va, mapping);
                    self.heap_of(va).insert_free(va, len);
                    for (_, chunk, _) in chunks {
                        self.keep_spare(chunk);
                    }
                    return Err(err.into());
                }
            }
        }
        Ok(chunks)
    }

    /// Keeps an unused chunk for later, unless an [`Alias`] still maps it:
    /// then the alias hands it over when it goes.
    fn keep_spare(&mut self, chunk: Arc<Chunk<B>>) {
        if Arc::strong_count(&chunk) == 1 {
            self.spares.push(chunk);
        }
    }

    /// Collects the chunks a plan names, in its order. On failure the chunks
    /// this call created are released again and the others are spare.
    /// `free`: the free units the plan was made from.
    fn gather(
        &mut self,
        space: &Space<B>,
        sources: &[Source],
        free: &[FreeUnit],
    ) -> Result<Gathered<B>> {
        let moving: FxHashSet<u64> = sources
            .iter()
            .filter_map(|s| match *s {
                Source::Unit { va, .. } => Some(va),
                _ => None,
            })
            .collect();
        let units = free
            .iter()
            .filter(|(va, _, _)| moving.contains(va))
            .copied()
            .collect();
        let mut moved: FxHashMap<u64, (Arc<Chunk<B>>, Under)> = self
            .unmap_units(units)?
            .into_iter()
            .map(|(va, chunk, under)| (va, (chunk, under)))
            .collect();
        let mut spares: Vec<Option<Arc<Chunk<B>>>> = self.spares.drain(..).map(Some).collect();
        let mut chunks = Vec::new();
        let mut under = Vec::new();
        let mut created = Vec::new();
        let mut failure = None;
        for source in sources {
            let mut was_under = None;
            let chunk = match *source {
                Source::Spare { index, .. } => spares[index].take(),
                Source::Unit { va, size } => {
                    self.stats.remaps += 1;
                    self.stats.bytes_remapped += size;
                    tracing::debug!(
                        from = format_args!("{va:#x}"),
                        size,
                        "remapping a free unit"
                    );
                    moved.remove(&va).map(|(chunk, u)| {
                        was_under = u;
                        chunk
                    })
                }
                Source::New { size } => match self.create_chunk(space, size) {
                    Ok(chunk) => {
                        created.push(chunk.handle());
                        Some(chunk)
                    }
                    Err(err) => {
                        failure = Some(err);
                        break;
                    }
                },
            };
            chunks.push(chunk.expect("every planned chunk was gathered"));
            under.push(was_under);
        }
        self.spares.extend(spares.into_iter().flatten());
        match failure {
            Some(err) => {
                for chunk in chunks {
                    if created.contains(&chunk.handle()) {
                        self.release(chunk);
                    } else {
                        self.keep_spare(chunk);
                    }
                }
                Err(err)
            }
            None => Ok((chunks, under)),
        }
    }

    fn create_chunk(&mut self, space: &Space<B>, size: u64) -> Result<Arc<Chunk<B>>> {
        if self.reserved + size > self.max_size {
            return Err(Error::PoolLimit {
                requested: size,
                reserved: self.reserved,
                max_size: self.max_size,
            });
        }
        let chunk = if space.shareable {
            Chunk::new_shareable(&space.backend, space.device, size as usize)?
        } else {
            Chunk::new(&space.backend, space.device, size as usize)?
        };
        self.reserved += size;
        self.reserved_high = self.reserved_high.max(self.reserved);
        self.stats.chunks_created += 1;
        self.stats.bytes_created += size;
        tracing::debug!(handle = chunk.handle().0, size, "created chunk");
        Ok(chunk)
    }

    /// Maps `chunks` side by side from `start`, each as one unit, then gives
    /// the whole range the pool's access in one driver call: set-access
    /// costs about as much for one chunk as for many (MEASURED.md,
    /// docs/RESULTS.md), so a growth or move of n chunks pays it once. On
    /// failure, what this call mapped is unmapped again and every chunk is
    /// spare.
    fn map_at(&mut self, space: &Space<B>, start: u64, chunks: Vec<Arc<Chunk<B>>>) -> Result<()> {
        let mut at = start;
        let mut done: Vec<u64> = Vec::new();
        let mut chunks = chunks.into_iter();
        let mut failure = None;
        while let Some(chunk) = chunks.next() {
            let size = chunk.size() as u64;
            match Mapping::new(&space.reservation, (at - space.base()) as usize, &chunk) {
                Ok(mapping) => {
                    self.stats.maps += 1;
                    tracing::debug!(
                        va = format_args!("{at:#x}"),
                        len = size,
                        handle = chunk.handle().0,
                        "mapped unit"
                    );
                    self.units.insert(at, mapping);
                    done.push(at);
                    at += size;
                }
                Err(err) => {
                    self.keep_spare(chunk);
                    for chunk in chunks.by_ref() {
                        self.keep_spare(chunk);
                    }
                    failure = Some(err.into());
                }
            }
        }
        if failure.is_none() && at > start {
            let access = self.mapping_access();
            if let Err(err) =
                space
                    .backend
                    .set_access(DevicePtr(start), (at - start) as usize, &access)
            {
                failure = Some(err.into());
            }
        }
        match failure {
            None => Ok(()),
            Some(err) => {
                for va in done {
                    let mapping = self.units.remove(&va).expect("mapped above");
                    self.retire(mapping);
                }
                Err(err)
            }
        }
    }

    /// Unmaps a mapping that is not (or no longer) in the heap, keeping its
    /// chunk as spare; one that will not unmap is quarantined.
    fn retire(&mut self, mapping: Mapping<B>) {
        match mapping.unmap() {
            Ok(chunk) => {
                self.stats.unmaps += 1;
                self.keep_spare(chunk);
            }
            Err((err, mapping)) => {
                tracing::warn!(%err, va = %mapping.va(), "could not unmap; mapping taken out of service");
                self.quarantine.push(mapping);
            }
        }
    }

    fn trim_to(&mut self, keep: u64) -> Result<()> {
        for chunk in std::mem::take(&mut self.unreleased) {
            self.release(chunk);
        }
        if self.reserved <= keep {
            return Ok(());
        }
        let span = tracing::debug_span!("trim", reserved = self.reserved, keep);
        let _enter = span.enter();
        self.stats.trims += 1;
        // Spare chunks and free units can go, largest first.
        let mut candidates: Vec<(u64, Option<FreeUnit>)> = self
            .spares
            .iter()
            .map(|c| (c.size() as u64, None))
            .chain(self.free_units(None).into_iter().map(|u| (u.1, Some(u))))
            .collect();
        candidates.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        let mut after = self.reserved;
        let mut spare_count = 0;
        let mut units = Vec::new();
        for (size, va) in candidates {
            if after <= keep {
                break;
            }
            after -= size;
            match va {
                Some(unit) => units.push(unit),
                None => spare_count += 1,
            }
        }
        // The largest spares are the ones counted above.
        self.spares.sort_by_key(|c| std::cmp::Reverse(c.size()));
        let going: Vec<Arc<Chunk<B>>> = self.spares.drain(..spare_count).collect();
        for chunk in going {
            self.release(chunk);
        }
        for (_, chunk, _) in self.unmap_units(units)? {
            self.release(chunk);
        }
        Ok(())
    }

    /// Drops a chunk the pool no longer wants; the driver frees it.
    /// A chunk the driver will not release stays held (and reserved) in
    /// `unreleased`, for the next trim to try again.
    fn release(&mut self, chunk: Arc<Chunk<B>>) {
        let size = chunk.size() as u64;
        debug_assert_eq!(
            Arc::strong_count(&chunk),
            1,
            "a released chunk has one owner"
        );
        match Chunk::release(chunk) {
            Ok(()) => {
                self.reserved -= size;
                self.stats.chunks_released += 1;
                self.stats.bytes_released += size;
                tracing::debug!(size, "released chunk");
            }
            Err((err, chunk)) => {
                tracing::warn!(%err, size, "could not release a chunk; kept for the next trim");
                self.unreleased.push(chunk);
            }
        }
    }

    /// `allocated`: bytes the heap should hold as allocated (live and
    /// pending).
    fn audit(&self, allocated: u64) -> std::result::Result<(), String> {
        let mut problems = Vec::new();
        let mut chunks: HashMap<ChunkHandle, u64> = HashMap::new();
        let mut hold = |c: &Arc<Chunk<B>>, problems: &mut Vec<String>| {
            if chunks.insert(c.handle(), c.size() as u64).is_some() {
                problems.push(format!("{:?} is held twice", c.handle()));
            }
        };
        let mut mapped = 0;
        let mut prev_end = 0;
        for (&va, m) in &self.units {
            if va < prev_end {
                problems.push(format!("unit at {va:#x} overlaps the one before"));
            }
            prev_end = va + m.size() as u64;
            mapped += m.size() as u64;
            hold(m.chunk(), &mut problems);
        }
        for c in &self.spares {
            hold(c, &mut problems);
        }
        for m in &self.quarantine {
            hold(m.chunk(), &mut problems);
        }
        for c in &self.unreleased {
            hold(c, &mut problems);
        }
        // An alias's chunk is usually mapped at its new place too.
        for (&va, a) in &self.aliases {
            let c = a.mapping.chunk();
            chunks.entry(c.handle()).or_insert(c.size() as u64);
            let end = va + a.mapping.size() as u64;
            if self
                .units
                .range(..end)
                .next_back()
                .is_some_and(|(&u, m)| u + m.size() as u64 > va)
            {
                problems.push(format!("alias at {va:#x} overlaps a unit"));
            }
            if !self.streams.contains_key(&a.stream) {
                problems.push(format!(
                    "alias at {va:#x}: stream {} not registered",
                    a.stream
                ));
            }
        }
        let reserved: u64 = chunks.values().sum();
        if reserved != self.reserved {
            problems.push(format!(
                "reserved {} but chunks add up to {reserved}",
                self.reserved
            ));
        }
        let free: u64 = self.arenas.iter().map(|a| a.heap.free_bytes()).sum();
        let mut free_ranges = Vec::new();
        for arena in &self.arenas {
            arena
                .heap
                .for_each_free(|addr, len, _| free_ranges.push((addr, addr + len)));
        }
        free_ranges.sort_unstable();
        let mut prev_end = 0;
        for (&start, g) in &self.guards {
            let i = free_ranges.partition_point(|&(a, _)| a <= start);
            let inside = i > 0 && free_ranges[i - 1].1 >= g.end;
            if start < prev_end || g.end <= start || !inside {
                problems.push(format!(
                    "guard [{start:#x}, {:#x}) of stream {} is not a free range of its own",
                    g.end, g.stream
                ));
            }
            if !self.streams.contains_key(&g.stream) {
                problems.push(format!(
                    "guard at {start:#x}: stream {} not registered",
                    g.stream
                ));
            }
            prev_end = g.end;
        }
        if free + allocated != mapped {
            problems.push(format!(
                "free {free} + allocated {allocated} != {mapped} bytes mapped"
            ));
        }
        // Planning takes the ranges in use from the heaps' regions: each
        // must be a run of adjacent units, and every run one region.
        for arena in &self.arenas {
            let runs: Vec<(u64, u64)> = self
                .unit_runs(arena.start..arena.end)
                .into_iter()
                .map(|(start, end, _)| (start, end - start))
                .collect();
            if arena.heap.regions() != runs {
                problems.push(format!(
                    "the heap's regions in [{:#x}, {:#x}) are not the runs of its units",
                    arena.start, arena.end
                ));
            }
        }
        if self.stats.chunks_created - self.stats.chunks_released != chunks.len() as u64 {
            problems.push(format!(
                "{} chunks created, {} released, {} held",
                self.stats.chunks_created,
                self.stats.chunks_released,
                chunks.len()
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// Sets `desc` on a run of adjacent mappings with one driver call.
fn set_run_access<B: Backend>(run: &[&Mapping<B>], desc: AccessDesc) -> vmm::Result<()> {
    let first = run[0];
    let size = run.iter().map(|m| m.size()).sum();
    first
        .reservation()
        .backend()
        .set_access(first.va(), size, &[desc])
}
