//! The stream table: the caller's streams of one device, by handle, as
//! vmpool streams, adopted on first use.

use std::collections::hash_map::Entry;
use std::sync::{PoisonError, RwLock};

use rustc_hash::FxHashMap;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::Stream;

/// How the C layer turns a caller's stream handle into a backend stream:
/// the one `unsafe` step, which it keeps to itself.
pub type Borrow<B> = fn(&B, DeviceId, usize) -> vmpool::vmm::Result<<B as Backend>::Stream>;

/// One device's streams by the caller's handle. Forgotten at each wait for
/// the whole device ([`StreamTable::forget_all`]).
pub(crate) struct StreamTable<B: Backend>(RwLock<FxHashMap<usize, Stream<B>>>);

impl<B: Backend> Default for StreamTable<B> {
    fn default() -> Self {
        Self(RwLock::default())
    }
}

impl<B: Backend> StreamTable<B> {
    /// Calls `f` with the stream for `handle`, made by `adopt` and added
    /// to the table on first use. `f` runs under the table's read lock, so
    /// a call neither clones the stream nor writes to the table. `f` is
    /// not called when the adoption fails.
    #[inline]
    pub(crate) fn with<T>(
        &self,
        handle: usize,
        adopt: impl Fn() -> vmpool::Result<Stream<B>>,
        f: impl FnOnce(&Stream<B>) -> T,
    ) -> vmpool::Result<T> {
        loop {
            {
                let streams = self.0.read().unwrap_or_else(PoisonError::into_inner);
                if let Some(s) = streams.get(&handle) {
                    return Ok(f(s));
                }
            }
            // Found next time round, unless a wait for the device forgot
            // it in between (then it is adopted again).
            self.adopt(handle, &adopt)?;
        }
    }

    /// Adds the stream for `handle`, unless another thread just did.
    #[cold]
    fn adopt(
        &self,
        handle: usize,
        adopt: &impl Fn() -> vmpool::Result<Stream<B>>,
    ) -> vmpool::Result<()> {
        let mut streams = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if let Entry::Vacant(slot) = streams.entry(handle) {
            slot.insert(adopt()?);
        }
        Ok(())
    }

    /// Forgets every stream, once the caller has waited for them all: the
    /// wait left no free pending on any of them. A handle the caller
    /// destroyed may come back as another stream's; its old entry would
    /// carry what vmpool knew of the old stream's order (the other streams
    /// it had waited for) to the new one, which never waited. Adopted
    /// afresh, a stream starts knowing nothing, and the table does not
    /// grow with every stream the caller ever made.
    pub(crate) fn forget_all(&self) {
        self.0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.read().unwrap_or_else(PoisonError::into_inner).len()
    }
}
