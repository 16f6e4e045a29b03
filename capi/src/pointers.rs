//! The pointer table: what vmpool handed out on one device and the caller
//! has not freed, by pointer, so that a free names its allocation by
//! pointer and a pointer vmpool never gave out is refused, not trusted.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};

use rustc_hash::FxHashMap;
use vmpool::vmm::Backend;
use vmpool::{Allocation, GraphPoolId, MemPoolId, Stream};

/// A live allocation, and what few have besides: other streams the
/// caller said use it (`vmpool_record_stream`, PyTorch's
/// `Tensor.record_stream`), whose queued work its free waits for, and a
/// pool other than the device's own. Those are boxed, so that the common
/// entry, read and written on every call, stays small (96 bytes with its
/// key, two cache lines at most, where 136 took three).
pub(crate) struct Live<B: Backend> {
    pub(crate) allocation: Allocation,
    extra: Option<Box<Extra<B>>>,
}

/// What a [`Live`] allocation has besides the device pool's common case.
struct Extra<B: Backend> {
    used_on: Vec<Stream<B>>,
    owner: Owner,
}

impl<B: Backend> Extra<B> {
    fn new(owner: Owner) -> Box<Self> {
        Box::new(Self {
            used_on: Vec::new(),
            owner,
        })
    }
}

impl<B: Backend> Live<B> {
    pub(crate) fn new(allocation: Allocation, owner: Owner) -> Self {
        let extra = (owner != Owner::Device).then(|| Extra::new(owner));
        Self { allocation, extra }
    }

    /// The streams besides its own that use it.
    pub(crate) fn used_on(&self) -> &[Stream<B>] {
        self.extra.as_ref().map_or(&[], |e| &e.used_on)
    }

    /// The pool it came from, and goes back to.
    pub(crate) fn owner(&self) -> Owner {
        self.extra.as_ref().map_or(Owner::Device, |e| e.owner)
    }

    fn add_user(&mut self, stream: Stream<B>) {
        let extra = self.extra.get_or_insert_with(|| Extra::new(Owner::Device));
        if !extra.used_on.contains(&stream) {
            extra.used_on.push(stream);
        }
    }
}

/// Which pool of a device an allocation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// The device's own pool.
    Device,
    /// A CUDA graph's private pool.
    Graph(GraphPoolId),
    /// A memory pool (`torch.cuda.MemPool`).
    Mem(MemPoolId),
}

/// A free put off until no capture is under way (`Device::deferred_frees`
/// in the shim): the allocation, taken out of the table, and the caller's
/// stream it was freed on.
pub(crate) struct DeferredFree<B: Backend> {
    pub(crate) ptr: u64,
    pub(crate) live: Live<B>,
    pub(crate) stream: usize,
}

/// One device's live allocations by pointer.
pub(crate) struct PointerTable<B: Backend>(Mutex<FxHashMap<u64, Live<B>>>);

impl<B: Backend> Default for PointerTable<B> {
    fn default() -> Self {
        Self(Mutex::default())
    }
}

impl<B: Backend> PointerTable<B> {
    fn lock(&self) -> MutexGuard<'_, FxHashMap<u64, Live<B>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline(always)]
    pub(crate) fn insert(&self, ptr: u64, live: Live<B>) {
        self.lock().insert(ptr, live);
    }

    /// Takes `ptr`'s allocation out of the table, if it is live.
    #[inline(always)]
    pub(crate) fn remove(&self, ptr: u64) -> Option<Live<B>> {
        self.lock().remove(&ptr)
    }

    pub(crate) fn contains(&self, ptr: u64) -> bool {
        self.lock().contains_key(&ptr)
    }

    /// Adds `stream` to the users of `ptr`'s allocation; `false` when it is
    /// not live.
    pub(crate) fn add_user(&self, ptr: u64, stream: Stream<B>) -> bool {
        let mut live = self.lock();
        let Some(entry) = live.get_mut(&ptr) else {
            return false;
        };
        entry.add_user(stream);
        true
    }

    /// The live allocation `ptr` points inside of (not at its start), as
    /// its address range.
    pub(crate) fn containing(&self, ptr: u64) -> Option<Range<u64>> {
        self.lock()
            .values()
            .map(|l| &l.allocation)
            .find(|a| a.ptr().0 < ptr && ptr < a.ptr().0 + a.size())
            .map(|a| a.ptr().0..a.ptr().0 + a.size())
    }
}
