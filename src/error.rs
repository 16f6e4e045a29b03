//! vmpool's errors: typed, so callers can match on them.

use vmm::DeviceId;

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
        device: DeviceId,
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
        requested: u64,
        reserved: u64,
        max_size: u64,
    },
    #[error("invalid allocation size {requested}: {reason}")]
    InvalidSize {
        requested: u64,
        reason: &'static str,
    },
    /// The allocation belongs to another pool.
    #[error("the allocation at {ptr:#x} belongs to another pool")]
    WrongPool { ptr: u64 },
    #[error("{0} does not exist")]
    InvalidDevice(DeviceId),
    /// A stream or event of one device used with a pool, stream or event of
    /// another. A pool serves streams of its own device only: it maps its
    /// memory for that device and orders frees with that device's events.
    #[error("a stream or event of {found} used with {expected}")]
    WrongDevice { expected: DeviceId, found: DeviceId },
    #[error("invalid pool property: {0}")]
    InvalidProps(String),
    #[error("attribute {attribute:?} cannot be set to {value}: {reason}")]
    InvalidAttribute {
        attribute: crate::PoolAttribute,
        value: u64,
        reason: &'static str,
    },
    /// A driver call failed; the pool is still consistent.
    #[error(transparent)]
    Driver(#[from] vmm::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
