//! A pool's recorded trace ([`crate::PoolProps::record`]): what goes in it, and
//! writing it out.

use std::path::Path;

use vmm::{Backend, DeviceId};

use crate::allocation::Allocation;
use crate::trace::record::Recorder;
use crate::{Error, Result};

use super::Pool;

impl<B: Backend> Pool<B> {
    pub(super) fn recorder(path: &Path, id: u64, device: DeviceId) -> Result<Recorder> {
        Recorder::create(path, id, device)
            .map_err(|e| Error::InvalidProps(format!("cannot record to {}: {e}", path.display())))
    }

    /// Writes out what the pool has recorded so far (see
    /// [`crate::PoolProps::record`]); a pool that is never dropped, such as one of
    /// the C library's, must be flushed before the process exits.
    pub fn flush_trace(&self) -> std::io::Result<()> {
        match &self.0.recorder {
            Some(r) => r.flush(),
            None => Ok(()),
        }
    }

    pub(super) fn record_free(&self, allocation: &Allocation, stream: u64) {
        if let Some(r) = self
            .0
            .recorder
            .as_ref()
            .filter(|_| allocation.trace_id != 0)
        {
            r.free(allocation.trace_id, stream);
        }
    }
}
