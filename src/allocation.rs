//! A live allocation: what the caller holds between allocate and free.

use vmm::{DeviceId, DevicePtr};

use crate::arena::ArenaId;
use crate::heap::BlockId;
use crate::steps::StepTag;

/// A live allocation. Not `Clone`: it is consumed by [`crate::Pool::free`],
/// so a double free does not compile. Dropping one without a free leaks
/// its memory until the pool goes; [`crate::Buffer`] frees on drop.
#[must_use = "an allocation dropped without a free leaks until its pool goes"]
#[derive(Debug)]
pub struct Allocation {
    pub(crate) ptr: DevicePtr,
    pub(crate) size: u64,
    /// The heap block's size: the request rounded up, or a little more when
    /// a pending block of a near size was reused.
    pub(crate) block_size: u64,
    pub(crate) arena: ArenaId,
    pub(crate) block: BlockId,
    /// The id of the pool it came from.
    pub(crate) pool: u64,
    /// Its id in the pool's recorded trace (0 when not recording).
    pub(crate) trace_id: u64,
    /// Made from the heap in a step the pool records (Note [Step
    /// layouts]): which, and its ordinal there.
    pub(crate) step: Option<StepTag>,
    pub(crate) device: DeviceId,
}

impl Allocation {
    /// A second handle to the same allocation, for the pool's own
    /// bookkeeping only: one of the two is freed, never both.
    pub(crate) fn duplicate(&self) -> Self {
        Self {
            ptr: self.ptr,
            size: self.size,
            block_size: self.block_size,
            arena: self.arena,
            block: self.block,
            pool: self.pool,
            trace_id: self.trace_id,
            step: self.step,
            device: self.device,
        }
    }

    /// The allocation's device address (256-byte aligned); it never moves.
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
