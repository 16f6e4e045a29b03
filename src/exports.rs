//! A pool's allocations exported to other processes, and the leases those
//! processes hold on them (Note [IPC leases] in docs/DESIGN.md). The pool
//! consults it on every free; [`crate::ipc`] fills it.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use vmm::Backend;

use crate::allocation::Allocation;
use crate::ordering::StreamShared;
use crate::sync::lock;
use crate::{Error, Result};

/// A free that waits for the last lease on its allocation to end, with its
/// stream for a stream-ordered free.
pub(crate) struct DeferredFree<B: Backend> {
    pub(crate) allocation: Allocation,
    pub(crate) stream: Option<Arc<StreamShared<B>>>,
}

/// Every free reads `live`; the rest, boxed, only while something is
/// exported.
pub(crate) struct Exports<B: Backend> {
    /// Entries in `state.by_ptr`: a free looks no further while it is 0.
    live: AtomicUsize,
    state: Box<Mutex<ExportState<B>>>,
}

impl<B: Backend> Default for Exports<B> {
    fn default() -> Self {
        Self {
            live: AtomicUsize::new(0),
            state: Box::new(Mutex::new(ExportState {
                by_ptr: HashMap::new(),
                next_serial: 0,
                ending: 0,
                connections: Vec::new(),
            })),
        }
    }
}

struct ExportState<B: Backend> {
    /// Live exported allocations by address.
    by_ptr: HashMap<u64, Exported<B>>,
    next_serial: u64,
    /// Last leases whose deferred free is being carried out: still counted
    /// as leases, so that nobody sees none before the free is done.
    ending: u64,
    /// The pool's ends of its connections, shut down when the pool goes so
    /// that their threads end.
    connections: Vec<Weak<OwnedFd>>,
}

struct Exported<B: Backend> {
    serial: u64,
    /// Imports of it that other processes hold.
    leases: u64,
    /// Freed while leased: the free to carry out when the last lease ends.
    deferred: Option<DeferredFree<B>>,
}

impl<B: Backend> Exports<B> {
    /// Whether any allocation is exported: a free looks no further when
    /// none is. One atomic load.
    #[inline(always)]
    pub(crate) fn any(&self) -> bool {
        self.live.load(Ordering::Acquire) != 0
    }

    /// What a free of `allocation` frees now, while some allocation is
    /// exported ([`Exports::any`]): the allocation itself, or `None` while
    /// another process holds a lease on it (the free is then carried out
    /// when the last lease ends).
    #[cold]
    pub(crate) fn on_free(
        &self,
        allocation: Allocation,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Option<Allocation> {
        let ptr = allocation.ptr().0;
        let mut state = lock(&self.state);
        match state.by_ptr.get_mut(&ptr) {
            Some(e) if e.leases > 0 => {
                tracing::debug!(ptr = %allocation.ptr(), leases = e.leases, "free deferred: imported elsewhere");
                e.deferred = Some(DeferredFree {
                    allocation,
                    stream: stream.cloned(),
                });
                None
            }
            Some(_) => {
                state.by_ptr.remove(&ptr);
                self.live.fetch_sub(1, Ordering::Release);
                Some(allocation)
            }
            None => Some(allocation),
        }
    }

    /// Leases held now, the ones ending included.
    pub(crate) fn leases(&self) -> u64 {
        let state = lock(&self.state);
        state.ending + state.by_ptr.values().map(|e| e.leases).sum::<u64>()
    }

    /// Notes a connection of the pool's, to shut down when the pool goes.
    pub(crate) fn add_connection(&self, conn: &Arc<OwnedFd>) {
        let mut state = lock(&self.state);
        state.connections.retain(|c| c.strong_count() > 0);
        state.connections.push(Arc::downgrade(conn));
    }

    /// Exports the live allocation at `ptr`; returns its serial, the same
    /// for as long as it stays exported.
    pub(crate) fn export(&self, ptr: u64) -> u64 {
        let mut state = lock(&self.state);
        if let Some(e) = state.by_ptr.get(&ptr) {
            return e.serial;
        }
        state.next_serial += 1;
        let serial = state.next_serial;
        state.by_ptr.insert(
            ptr,
            Exported {
                serial,
                leases: 0,
                deferred: None,
            },
        );
        self.live.fetch_add(1, Ordering::Release);
        serial
    }

    /// Takes a lease on the allocation at `ptr` exported as `serial`;
    /// refused once it is freed or exported anew.
    pub(crate) fn lease(&self, ptr: u64, serial: u64) -> Result<()> {
        let mut state = lock(&self.state);
        match state.by_ptr.get_mut(&ptr) {
            Some(e) if e.serial == serial && e.deferred.is_none() => {
                e.leases += 1;
                Ok(())
            }
            _ => Err(Error::StaleExport { ptr }),
        }
    }

    /// Ends a lease on the allocation at `ptr`. The last one hands back a
    /// free that was deferred, to carry out and then report with
    /// [`Exports::deferred_done`].
    pub(crate) fn end_lease(&self, ptr: u64) -> Option<DeferredFree<B>> {
        let mut state = lock(&self.state);
        let e = state.by_ptr.get_mut(&ptr)?;
        e.leases -= 1;
        if e.leases > 0 || e.deferred.is_none() {
            return None;
        }
        let e = state.by_ptr.remove(&ptr).expect("found above");
        self.live.fetch_sub(1, Ordering::Release);
        state.ending += 1;
        e.deferred
    }

    /// A free [`Exports::end_lease`] handed back is done.
    pub(crate) fn deferred_done(&self) {
        lock(&self.state).ending -= 1;
    }
}

impl<B: Backend> Drop for Exports<B> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for conn in state.connections.iter().filter_map(Weak::upgrade) {
            // Ends the serving thread's wait; it finds the pool gone.
            let _ = rustix::net::shutdown(&*conn, rustix::net::Shutdown::Both);
        }
    }
}
