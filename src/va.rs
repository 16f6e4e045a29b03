//! Addresses in a pool's reservation.

use std::fmt;
use std::ops::{Add, AddAssign};

use vmm::DevicePtr;

/// A virtual address in a pool's reservation, in bytes. The heap and the
/// planner count in plain bytes; the space, which maps chunks, takes and
/// gives `Va`s, and only it turns one into the driver's offset inside the
/// reservation ([`Va::offset_from`]), so an address is never passed where
/// an offset or a size is meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Va(pub(crate) u64);

impl Va {
    /// The offset of this address from `base`, as the driver takes it.
    /// Panics if the address lies below `base`: a bug, not a driver error.
    pub(crate) fn offset_from(self, base: Va) -> usize {
        let offset = self
            .0
            .checked_sub(base.0)
            .expect("an address in the reservation");
        usize::try_from(offset).expect("an offset the host can index")
    }
}

/// The address some bytes further on.
impl Add<u64> for Va {
    type Output = Va;

    fn add(self, bytes: u64) -> Va {
        Va(self.0 + bytes)
    }
}

impl AddAssign<u64> for Va {
    fn add_assign(&mut self, bytes: u64) {
        self.0 += bytes;
    }
}

impl From<Va> for DevicePtr {
    fn from(va: Va) -> Self {
        DevicePtr(va.0)
    }
}

impl fmt::LowerHex for Va {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}
