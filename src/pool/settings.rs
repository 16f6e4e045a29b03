//! A pool's settings, as CUDA's pools have them: which devices may access
//! its memory, its attributes (release threshold, reuse switches,
//! high-water marks), and its size limit.

use vmm::{Access, AccessDesc, Backend, DeviceId};

use super::Pool;
use crate::stats::PoolAttribute;
use crate::{Error, Result};

impl<B: Backend> Pool<B> {
    /// Changes the most physical bytes the pool may hold
    /// ([`crate::PoolProps::max_size`]; `None`: no limit but the device's memory).
    /// Growth past it fails with [`Error::PoolLimit`]; memory held above it
    /// now stays until it is freed and trimmed.
    pub fn set_max_size(&self, max_size: Option<u64>) {
        self.lock().space.set_max_size(max_size.unwrap_or(u64::MAX));
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
        self.lock().space.set_access(AccessDesc { device, access })
    }

    /// What `device` may do with the pool's memory
    /// (`cudaMemPoolGetAccess`).
    pub fn access(&self, device: DeviceId) -> Result<Access> {
        if device.0 >= self.backend().device_count()? {
            return Err(Error::InvalidDevice(device));
        }
        Ok(self.lock().space.access(device))
    }

    /// An attribute's current value (`cudaMemPoolGetAttribute`): switches
    /// are 0 or 1, the others are bytes.
    pub fn attribute(&self, attribute: PoolAttribute) -> u64 {
        let inner = self.lock();
        let rules = inner.streams.rules;
        match attribute {
            PoolAttribute::ReleaseThreshold => inner.release_threshold,
            PoolAttribute::ReuseFollowEventDependencies => rules.follow_event_dependencies as u64,
            PoolAttribute::ReuseAllowOpportunistic => rules.allow_opportunistic as u64,
            PoolAttribute::ReuseAllowInternalDependencies => {
                rules.allow_internal_dependencies as u64
            }
            PoolAttribute::ReservedMemCurrent => inner.space.reserved(),
            PoolAttribute::ReservedMemHigh => inner.space.reserved_high(),
            PoolAttribute::UsedMemCurrent => inner.used_bytes(),
            PoolAttribute::UsedMemHigh => inner.usage.used_high,
        }
    }

    /// Sets an attribute (`cudaMemPoolSetAttribute`): the release threshold,
    /// a reuse switch (0 or 1), or a high-water mark (only to 0, which resets
    /// it to the current value). Others are [`Error::InvalidAttribute`].
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
        let rules = &mut inner.streams.rules;
        match attribute {
            PoolAttribute::ReleaseThreshold => inner.release_threshold = value,
            PoolAttribute::ReuseFollowEventDependencies => {
                rules.follow_event_dependencies = flag(value)?
            }
            PoolAttribute::ReuseAllowOpportunistic => rules.allow_opportunistic = flag(value)?,
            PoolAttribute::ReuseAllowInternalDependencies => {
                rules.allow_internal_dependencies = flag(value)?
            }
            PoolAttribute::ReservedMemHigh | PoolAttribute::UsedMemHigh if value != 0 => {
                return Err(invalid("a high-water mark can only be reset, with 0"))
            }
            PoolAttribute::ReservedMemHigh => inner.space.reset_reserved_high(),
            PoolAttribute::UsedMemHigh => {
                inner.settle();
                inner.usage.used_high = inner.used_bytes();
            }
            PoolAttribute::ReservedMemCurrent | PoolAttribute::UsedMemCurrent => {
                return Err(invalid("read-only"))
            }
        }
        Ok(())
    }
}
