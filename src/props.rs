//! A pool's properties, fixed at creation (as `cudaMemPoolProps`), their
//! defaults, and the text forms the tools and the C layer read.

use std::path::PathBuf;

use vmm::DeviceId;

/// Properties fixed when a pool is created (as `cudaMemPoolProps`).
///
/// Built with struct-update syntax from [`PoolProps::new`]:
/// `PoolProps { max_size: Some(1 << 30), ..PoolProps::new(device) }`. It is
/// deliberately not `#[non_exhaustive]`, which would forbid that syntax
/// outside this crate; a field added later comes with a default in `new`,
/// so code written this way keeps compiling.
#[derive(Debug, Clone)]
pub struct PoolProps {
    /// The device whose memory the pool holds.
    pub device: DeviceId,
    /// Most physical bytes the pool may hold; `None`: no limit but the
    /// device's memory. [`crate::Pool::set_max_size`] changes it later.
    pub max_size: Option<u64>,
    /// Largest chunk a growth of the large-allocation arena creates, in bytes
    /// (rounded up to the granularity); `None`: [`DEFAULT_CHUNK_SIZE`]. The
    /// small-allocation arena always grows by one granule.
    pub chunk_size: Option<u64>,
    /// Scales growth chunks with the pool: a growth of the large-allocation
    /// arena creates chunks of at most the pool's reserved bytes over this
    /// divisor (at least one granule, at most `chunk_size`), so that the
    /// free memory a partly used chunk can strand stays a small share of
    /// the pool, at the price of more chunks, each a driver call, while the
    /// pool is small. With it, growth also moves first the free units whose
    /// free block ends on unit boundaries at both ends. Default
    /// [`DEFAULT_CHUNK_DIVISOR`]; `None`: every growth uses `chunk_size`,
    /// fewer driver calls for a larger footprint. See Note [Growth chunk
    /// size] in docs/DESIGN.md.
    pub chunk_divisor: Option<u64>,
    /// With a `chunk_divisor`: while the pool holds fewer bytes than this,
    /// growth creates chunks of one granule, whatever the divisor gives. A
    /// small pool's footprint is the most sensitive to its chunk size, and
    /// growing to this size takes at most this over the granule in chunks,
    /// so a coarse divisor saves driver calls where they add up, in large
    /// pools. Until the program has marked two steps ([`crate::Pool::mark_step`]),
    /// growth is by granules up to 16 GiB too: what the first steps leave
    /// live stays for the whole run, and granules strand the least beside
    /// it. Default [`DEFAULT_GRANULE_GROWTH_BELOW`]; 0: the divisor alone,
    /// from the first step. See Note [Growth chunk size] in docs/DESIGN.md.
    pub granule_growth_below: u64,
    /// Virtual address space to reserve; `None`: four times the device's
    /// memory, so that address space never runs short before memory does.
    pub va_size: Option<u64>,
    /// Which unused chunks growth may remap into the new range (see
    /// [`Defragment`]); [`Defragment::Units`] by default.
    pub defragment: Defragment,
    /// What the pool does once the program has emptied it (see
    /// [`FreshStart`]); [`FreshStart::WhenEmptied`] by default.
    pub fresh_start: FreshStart,
    /// Record every allocation and free of the pool to this file, in the
    /// shared trace format (`vmpool-replay` replays it). `None`: the
    /// environment variable `VMPOOL_RECORD`, if set, names a path prefix,
    /// and each pool records to `PREFIX.<pool id>.trace`.
    pub record: Option<PathBuf>,
    /// How the pool's memory can be shared with other processes
    /// (`cudaMemPoolProps::handleTypes`); see [`crate::ipc`].
    /// [`HandleType::PosixFileDescriptor`] also makes the pool's memory
    /// registrable with NCCL (`ncclCommRegister`): see Note [NCCL
    /// registration] in docs/DESIGN.md.
    pub handle_type: HandleType,
}

/// What a pool does once the program has held none of its bytes, after
/// growth moved units ([`PoolProps::fresh_start`]; Note [Starting afresh]
/// in docs/DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FreshStart {
    /// Lays out what comes next as from empty, its free units parked in
    /// place (the default): work repeated on an emptied pool keeps the
    /// first pass's footprint, at the price of growing and laying out again
    /// after each emptying (docs/RESULTS.md, "Fresh starts that keep their
    /// chunks mapped").
    #[default]
    WhenEmptied,
    /// Keeps the layout the last work left: repeated work grows less, but
    /// its footprint may creep from one emptying to the next.
    Never,
}

/// Which unused memory growth may move into a new range
/// ([`PoolProps::defragment`]; Note [Growth and remapping] in
/// docs/DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Defragment {
    /// Nothing: growth maps new memory for every range that does not fit,
    /// as a conventional pool does.
    Off,
    /// Spare chunks and any free unit (the default): the least new memory
    /// on a first pass, at the price of remapping on every later one.
    #[default]
    Units,
    /// Spare chunks, and free units only of mapped regions with no live
    /// byte: moving one then splits no region, so repeated work finds the
    /// same layout and the pool stops remapping once it has seen its peak,
    /// at a larger footprint on the first pass (docs/RESULTS.md, "Growth
    /// that splits no region").
    WholeRegions,
}

/// The kinds of handle a pool's memory can be exported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HandleType {
    /// Not shareable (the default).
    #[default]
    None,
    /// POSIX file descriptors (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`):
    /// chunks are created exportable, and the pool can be exported to
    /// another process. It is the handle type NCCL's user-buffer
    /// registration exports a buffer's chunks with (with the reservation's
    /// start on a granule, which every pool's is).
    PosixFileDescriptor,
}

/// A [`HandleType`] as text, as `VMPOOL_HANDLE_TYPE` takes it: `none` or
/// `posix_fd`, case and spaces aside. The error says what was expected.
///
/// ```
/// use vmpool::{parse_handle_type, HandleType};
/// assert_eq!(parse_handle_type("posix_fd"), Ok(HandleType::PosixFileDescriptor));
/// assert_eq!(parse_handle_type(" None "), Ok(HandleType::None));
/// assert!(parse_handle_type("fabric").is_err());
/// ```
pub fn parse_handle_type(text: &str) -> std::result::Result<HandleType, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "none" => Ok(HandleType::None),
        "posix_fd" => Ok(HandleType::PosixFileDescriptor),
        _ => Err(format!("{text:?}: expected none or posix_fd")),
    }
}

/// A [`FreshStart`] from its text form, as `vmpool-replay` and the C
/// layer read it: `when-emptied` or `never`, in any case.
///
/// ```
/// use vmpool::{parse_fresh_start, FreshStart};
/// assert_eq!(parse_fresh_start("never"), Ok(FreshStart::Never));
/// assert_eq!(parse_fresh_start(" When-Emptied "), Ok(FreshStart::WhenEmptied));
/// assert!(parse_fresh_start("off").is_err());
/// ```
pub fn parse_fresh_start(text: &str) -> std::result::Result<FreshStart, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "when-emptied" => Ok(FreshStart::WhenEmptied),
        "never" => Ok(FreshStart::Never),
        _ => Err(format!("{text:?}: expected when-emptied or never")),
    }
}

impl PoolProps {
    /// The defaults for a pool on `device`: no size limit, growth chunks of
    /// at most [`DEFAULT_CHUNK_SIZE`] and a [`DEFAULT_CHUNK_DIVISOR`]th of the
    /// reserved bytes, a reservation of four times the device's memory,
    /// remapping on, no shareable handles, no trace.
    pub fn new(device: DeviceId) -> Self {
        Self {
            device,
            max_size: None,
            chunk_size: None,
            chunk_divisor: Some(DEFAULT_CHUNK_DIVISOR),
            granule_growth_below: DEFAULT_GRANULE_GROWTH_BELOW,
            va_size: None,
            defragment: Defragment::Units,
            fresh_start: FreshStart::WhenEmptied,
            record: None,
            handle_type: HandleType::None,
        }
    }
}

/// The largest growth chunk by default, 32 MiB. Each chunk costs a fixed
/// driver time to create, map and give access to, and to move, whatever its
/// size, so small chunks make growth slow; physical memory moves only in
/// whole chunks, so large ones strand free memory. Pools of 64 GiB and more
/// grow by it; smaller ones by smaller chunks ([`DEFAULT_CHUNK_DIVISOR`]).
/// See Note [Growth chunk size] in docs/DESIGN.md.
pub const DEFAULT_CHUNK_SIZE: u64 = 32 << 20;

/// The default [`PoolProps::chunk_divisor`]: growth chunks of at most a
/// 2048th of the pool, so 2 MiB granules until the pool holds 4 GiB: the
/// footprint of fine chunks on every training trace, paid for in growth
/// time (docs/RESULTS.md).
pub const DEFAULT_CHUNK_DIVISOR: u64 = 2048;

/// The default [`PoolProps::granule_growth_below`], 2 GiB: 1,024 chunks of
/// 2 MiB. At the default divisor it changes nothing (a 2048th of the pool
/// is under a granule until 4 GiB); at a coarser one, such as the C
/// layer's, it keeps small pools at the footprint of fine chunks.
pub const DEFAULT_GRANULE_GROWTH_BELOW: u64 = 2 << 30;

/// Allocations below this size share the small arena (see Note
/// \[Placement\] in docs/DESIGN.md).
pub const SMALL_LIMIT: u64 = 1 << 20;

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

/// Bytes as text, as the tools' size options (`--chunk-size 1GiB`) and the
/// C layer's byte settings (`VMPOOL_CHUNK_SIZE=512MiB`) take them: a number,
/// whole or with a fraction, then an optional unit, case and spaces aside:
/// `B`, or `K`, `M`, `G`, `T`, `P`, `E` with or without `B` or `iB`, each a
/// power of 1024 (memory sizes, as PyTorch's settings count them: `2G` and
/// `2GB` are both `2GiB`); or `max` for [`u64::MAX`]. The error says what
/// was expected.
///
/// ```
/// assert_eq!(vmpool::parse_bytes("512MiB"), Ok(512 << 20));
/// assert_eq!(vmpool::parse_bytes("2G"), Ok(2 << 30));
/// assert_eq!(vmpool::parse_bytes("4096"), Ok(4096));
/// assert!(vmpool::parse_bytes("2 GX").is_err());
/// ```
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    if text.trim().eq_ignore_ascii_case("max") {
        return Ok(u64::MAX);
    }
    parse_size::Config::new()
        .with_binary()
        .parse_size(text)
        .map_err(|_| format!("{text:?}: expected bytes, such as 1073741824, 512MiB, 2G or max"))
}
