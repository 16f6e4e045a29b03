//! Owners for reservations, chunks and mappings.
//!
//! ```text
//!   Reservation  [base ............................................ base+size)
//!                       Mapping A            Mapping B
//!                     [va, va+size)        [va, va+size)
//!                         │                    │
//!                         ▼                    ▼
//!                  Chunk 1 (whole)       Chunk 2 (whole)
//! ```
//!
//! A [`Mapping`] holds an `Arc` of its [`Chunk`] and of its [`Reservation`],
//! so the driver's teardown order (unmap, then release, then free the address
//! range) holds by construction: a chunk cannot be released, nor a range
//! freed, while a mapping still uses it. Explicit teardown ([`Mapping::unmap`])
//! reports errors; `Drop` does the same work, logs a failure and never panics.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::error::report_drop_error;
use crate::{AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr, Result};

/// A reserved virtual address range, freed when the last owner goes.
pub struct Reservation<B: Backend> {
    backend: Arc<B>,
    base: DevicePtr,
    size: usize,
}

impl<B: Backend> Reservation<B> {
    /// Reserves `size` bytes aligned to `alignment` (0: the granularity).
    pub fn new(backend: &Arc<B>, size: usize, alignment: usize) -> Result<Arc<Self>> {
        let base = backend.reserve(size, alignment)?;
        tracing::debug!(%base, size, "reserved address range");
        Ok(Arc::new(Self {
            backend: Arc::clone(backend),
            base,
            size,
        }))
    }

    /// The first address of the range.
    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// The size of the range in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend the range was reserved from.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }
}

impl<B: Backend> Drop for Reservation<B> {
    fn drop(&mut self) {
        match self.backend.free_reservation(self.base, self.size) {
            Ok(()) => tracing::debug!(base = %self.base, size = self.size, "freed address range"),
            Err(err) => report_drop_error("freeing an address range", &err),
        }
    }
}

/// A physical allocation on one device, released when the last owner goes.
pub struct Chunk<B: Backend> {
    backend: Arc<B>,
    handle: ChunkHandle,
    device: DeviceId,
    size: usize,
    /// Set by a successful [`Chunk::release`], so that `Drop` does not
    /// release twice.
    released: bool,
}

impl<B: Backend> Chunk<B> {
    /// Creates a chunk of `size` bytes of physical memory on `device`.
    pub fn new(backend: &Arc<B>, device: DeviceId, size: usize) -> Result<Arc<Self>> {
        let handle = backend.create_chunk(device, size)?;
        Ok(Self::owning(backend, handle, device, size))
    }

    /// A chunk that can be exported to another process ([`Chunk::export`]).
    pub fn new_shareable(backend: &Arc<B>, device: DeviceId, size: usize) -> Result<Arc<Self>> {
        let handle = backend.create_shareable_chunk(device, size)?;
        Ok(Self::owning(backend, handle, device, size))
    }

    /// A chunk another process exported, from its descriptor (which the
    /// caller keeps) and what that process says it is.
    pub fn import(
        backend: &Arc<B>,
        fd: BorrowedFd<'_>,
        device: DeviceId,
        size: usize,
    ) -> Result<Arc<Self>> {
        let handle = backend.import_chunk(fd, device, size)?;
        Ok(Self::owning(backend, handle, device, size))
    }

    /// The owner of a handle the backend just gave out.
    fn owning(backend: &Arc<B>, handle: ChunkHandle, device: DeviceId, size: usize) -> Arc<Self> {
        Arc::new(Self {
            backend: Arc::clone(backend),
            handle,
            device,
            size,
            released: false,
        })
    }

    /// A new descriptor of this (shareable) chunk for another process.
    pub fn export(&self) -> Result<OwnedFd> {
        self.backend.export_chunk(self.handle)
    }

    /// Releases the chunk now, when `this` is its last owner. On failure
    /// (another owner, or the driver refuses) the chunk comes back with the
    /// error, still held, for the caller to keep and try again; dropping it
    /// tries once more.
    pub fn release(this: Arc<Self>) -> Result<(), (crate::Error, Arc<Self>)> {
        let mut chunk = match Arc::try_unwrap(this) {
            Ok(chunk) => chunk,
            Err(shared) => {
                let err = crate::Error::invalid(
                    "Chunk::release",
                    format!("{:?} has other owners", shared.handle),
                );
                return Err((err, shared));
            }
        };
        match chunk.backend.release_chunk(chunk.handle) {
            Ok(()) => {
                chunk.released = true;
                Ok(())
            }
            Err(err) => Err((err, Arc::new(chunk))),
        }
    }

    /// The backend's handle of the chunk.
    pub fn handle(&self) -> ChunkHandle {
        self.handle
    }

    /// The device whose memory the chunk is.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The chunk's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl<B: Backend> Drop for Chunk<B> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if let Err(err) = self.backend.release_chunk(self.handle) {
            report_drop_error("releasing a chunk", &err);
        }
    }
}

/// A whole chunk mapped at `va` inside a reservation. Unmapped on
/// [`Mapping::unmap`] or on drop.
pub struct Mapping<B: Backend> {
    // Field order is drop order: after `Drop::drop` unmaps, the chunk is
    // released (if this was its last owner) before the range is freed.
    chunk: Arc<Chunk<B>>,
    reservation: Arc<Reservation<B>>,
    va: DevicePtr,
    /// Set by a successful explicit `unmap`, so that `Drop` does not unmap twice.
    unmapped: bool,
}

impl<B: Backend> Mapping<B> {
    /// Maps `chunk` at `reservation`'s base + `offset`. On failure nothing is
    /// mapped and the caller keeps its chunk.
    pub fn new(
        reservation: &Arc<Reservation<B>>,
        offset: usize,
        chunk: &Arc<Chunk<B>>,
    ) -> Result<Self> {
        let size = chunk.size;
        let fits = offset
            .checked_add(size)
            .is_some_and(|end| end <= reservation.size);
        if !fits {
            return Err(crate::Error::invalid(
                "Mapping::new",
                format!(
                    "range at offset {offset} of {size} bytes exceeds the {}-byte reservation",
                    reservation.size
                ),
            ));
        }
        let va = reservation.base.byte_add(offset);
        reservation.backend.map(va, chunk.handle)?;
        tracing::trace!(%va, size, chunk = chunk.handle.0, "mapped");
        Ok(Self {
            chunk: Arc::clone(chunk),
            reservation: Arc::clone(reservation),
            va,
            unmapped: false,
        })
    }

    /// Sets what each device named in `access` may do with the mapped range.
    pub fn set_access(&self, access: &[AccessDesc]) -> Result<()> {
        self.reservation
            .backend
            .set_access(self.va, self.size(), access)
    }

    /// Unmaps and hands the chunk back for reuse. On failure the mapping is
    /// returned untouched with the error, so the caller decides what to do.
    pub fn unmap(mut self) -> Result<Arc<Chunk<B>>, (crate::Error, Self)> {
        match self.reservation.backend.unmap(self.va, self.size()) {
            Ok(()) => {
                tracing::trace!(va = %self.va, size = self.size(), "unmapped");
                self.unmapped = true;
                Ok(Arc::clone(&self.chunk))
            }
            Err(err) => Err((err, self)),
        }
    }

    /// The address the chunk is mapped at.
    pub fn va(&self) -> DevicePtr {
        self.va
    }

    /// The mapped size in bytes (the chunk's size).
    pub fn size(&self) -> usize {
        self.chunk.size
    }

    /// The chunk mapped.
    pub fn chunk(&self) -> &Arc<Chunk<B>> {
        &self.chunk
    }

    /// The reservation the mapping lies in.
    pub fn reservation(&self) -> &Arc<Reservation<B>> {
        &self.reservation
    }
}

impl<B: Backend> Drop for Mapping<B> {
    fn drop(&mut self) {
        if self.unmapped {
            return;
        }
        if let Err(err) = self.reservation.backend.unmap(self.va, self.size()) {
            report_drop_error("unmapping", &err);
        }
    }
}
