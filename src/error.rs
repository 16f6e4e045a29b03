//! vmpool's errors: typed, so callers can match on them.

use vmm::DeviceId;

/// What went wrong in a vmpool call. A refused call changes nothing: the
/// pool is as it was before.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The device could not supply the memory, even after every pool on it
    /// released what it had unused.
    #[error(
        "out of memory on {device}: {requested} bytes requested; the pool holds {reserved} bytes \
         ({used} in use), the device has {device_free} bytes free"
    )]
    OutOfMemory {
        /// The device out of memory.
        device: DeviceId,
        /// Bytes asked for.
        requested: u64,
        /// Physical bytes the pool held when it gave up.
        reserved: u64,
        /// Bytes of live allocations in the pool.
        used: u64,
        /// Free memory the device reported.
        device_free: u64,
    },
    /// The pool's own limit (`PoolProps::max_size`) would be exceeded.
    #[error("pool limit reached: {requested} bytes requested, {reserved} of at most {max_size} bytes held")]
    PoolLimit {
        /// Bytes asked for.
        requested: u64,
        /// Physical bytes the pool held.
        reserved: u64,
        /// The pool's limit.
        max_size: u64,
    },
    /// A size no allocation can have: zero, or larger than the pool's
    /// address range.
    #[error("invalid allocation size {requested}: {reason}")]
    InvalidSize {
        /// Bytes asked for.
        requested: u64,
        /// Why the size cannot be served.
        reason: &'static str,
    },
    /// No free range of the pool's address space is wide enough for the
    /// request, though the space is larger than it: live allocations and
    /// the memory between them leave no room that wide. A pool reserves
    /// its address space once; reserve more ([`crate::PoolProps::va_size`],
    /// `VMPOOL_VA_SIZE` in the C layer) for a program whose allocations
    /// spread over more of it.
    #[error(
        "out of address space: no free range of {requested} bytes in the {arena_size} bytes the \
         pool reserves for allocations of this size ({reserved} bytes of memory held); reserve \
         more address space (PoolProps::va_size, VMPOOL_VA_SIZE)"
    )]
    OutOfAddressSpace {
        /// Bytes asked for.
        requested: u64,
        /// The part of the address space that serves this size (small
        /// allocations have an eighth of it, larger ones the rest).
        arena_size: u64,
        /// Physical bytes the pool held.
        reserved: u64,
    },
    /// The allocation belongs to another pool.
    #[error("the allocation at {ptr:#x} belongs to another pool")]
    WrongPool {
        /// The allocation's address.
        ptr: u64,
    },
    /// No device of this number.
    #[error("{0} does not exist")]
    InvalidDevice(DeviceId),
    /// A stream or event of one device used with a pool, stream or event of
    /// another. A pool serves streams of its own device only: it maps its
    /// memory for that device and orders frees with that device's events.
    #[error("a stream or event of {found} used with {expected}")]
    WrongDevice {
        /// The device of the pool (or of the first stream or event).
        expected: DeviceId,
        /// The device of the stream or event passed.
        found: DeviceId,
    },
    /// A pool property that cannot be served; says which and why.
    #[error("invalid pool property: {0}")]
    InvalidProps(String),
    /// An attribute set to a value it cannot take, or one that is read-only.
    #[error("attribute {attribute:?} cannot be set to {value}: {reason}")]
    InvalidAttribute {
        /// The attribute.
        attribute: crate::PoolAttribute,
        /// The value refused.
        value: u64,
        /// Why.
        reason: &'static str,
    },
    /// Access a pool cannot give (less than read-write for its own device).
    #[error("{device} cannot be given that access: {reason}")]
    InvalidAccess {
        /// The device named.
        device: DeviceId,
        /// Why it cannot have that access.
        reason: &'static str,
    },
    /// Sharing with another process needs a pool created with
    /// `HandleType::PosixFileDescriptor`.
    #[error("the pool was not created with a shareable handle type")]
    NotShareable,
    /// The exported allocation has been freed since it was exported (or was
    /// never exported by this pool).
    #[error("the exported allocation at {ptr:#x} is no longer live")]
    StaleExport {
        /// The exported allocation's address.
        ptr: u64,
    },
    /// The export data names another pool than the one imported.
    #[error("the export data of {ptr:#x} comes from another pool")]
    ForeignExport {
        /// The exported allocation's address.
        ptr: u64,
    },
    /// The exporting pool's device (`device` in the exporter's numbering)
    /// is none of this process's devices.
    #[error("the exporting pool's device (its {device}) is not one this process sees")]
    DeviceNotVisible {
        /// The device, as the exporting process numbers it.
        device: DeviceId,
    },
    /// Talking to the other process failed: it is gone, or the descriptor
    /// or data is not what vmpool sends.
    #[error("sharing with another process: {0}")]
    Ipc(String),
    /// The pool is asleep (`Pool::sleep`): it allocates nothing and marks
    /// no step until `Pool::wake`. (Frees are taken: their bytes are not
    /// copied back.)
    #[error("the pool is asleep: wake it before allocating")]
    Asleep,
    /// `Pool::sleep` of a pool asleep already, or `Pool::wake` of one that
    /// is awake.
    #[error("the pool is {0}")]
    SleepState(&'static str),
    /// `Pool::sleep` found memory a stream may still use that it cannot
    /// wait for (a graph capture is under way).
    #[error("the pool cannot sleep during a graph capture")]
    SleepDuringCapture,
    /// `Pool::wake` could not get its memory back from the device. Nothing
    /// changed: the pool is still asleep with its bytes on the host, and
    /// waking can be tried again once memory is free.
    #[error(
        "waking needs {needed} bytes on {device}; the device has {device_free} bytes free \
         ({kept} bytes wait on the host)"
    )]
    WakeOutOfMemory {
        /// The pool's device.
        device: DeviceId,
        /// Bytes of the units to map back.
        needed: u64,
        /// Free memory the device reported.
        device_free: u64,
        /// Live bytes waiting in host memory.
        kept: u64,
    },
    /// A driver call failed; the pool is still consistent.
    #[error(transparent)]
    Driver(#[from] vmm::Error),
}

/// vmpool's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What [`crate::Pool::audit`] found wrong: each way the pool's tables
/// disagree with one another or with its totals. Displayed as the problems
/// joined by `; `.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditError {
    /// One line per problem found, in the order checked.
    pub problems: Vec<String>,
}

impl std::fmt::Display for AuditError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pool audit: {}", self.problems.join("; "))
    }
}

impl std::error::Error for AuditError {}
