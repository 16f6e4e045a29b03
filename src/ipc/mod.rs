//! Sharing a pool with another process (`cudaMemPoolExportToShareableHandle`,
//! `cudaMemPoolImportFromShareableHandle`, `cudaMemPoolExportPointer`,
//! `cudaMemPoolImportPointer`).
//!
//! ```text
//!   exporting process                         importing process
//!   Pool (HandleType::PosixFileDescriptor)
//!     export_to_shareable_handle() ──fd──►  ImportedPool::from_shareable_handle(fd)
//!       (one end of a socket pair,            (the other end: requests go
//!        served by a thread of the pool)       over it, chunk fds come back)
//!     export_pointer(&a) ──ExportData──►     import_pointer(&data)
//!       a's ptr, size, serial                   lease ◄── exporter: +1 on a
//!                                               chunk fds (SCM_RIGHTS) of the
//!                                               units under a
//!                                             reserve VA, map the chunks side by
//!                                             side, read-write for the pool's
//!                                             device: ptr = base + offset
//!   free(a) while leased: deferred        ◄── drop(ImportedAllocation): unmap,
//!   until the last lease ends                   then "release lease"
//!                                         ◄── connection closed (process died):
//!                                               every lease of it ends
//! ```
//!
//! **Leases.** Importing an allocation takes a lease on it in the exporting
//! pool; the importer holds it until its [`ImportedAllocation`] is dropped,
//! or until its connection closes, which is how a process that dies holding
//! imports is noticed. While an allocation is leased, freeing it
//! ([`crate::Pool::free`] or `free_async`) is deferred: the memory stays
//! allocated in the exporter's heap until the last lease ends, and only then
//! is the free carried out, in the order it was asked for (a stream-ordered
//! free is queued on its stream at that moment, after everything the stream
//! did before). The pool moves, unmaps and releases only units with no
//! allocated byte on them, so the chunks an importer maps are never remapped,
//! reused or released under it. Its bytes are not handed to another
//! allocation either. Other allocations that share those chunks are
//! visible to the importer, as whole granules are with CUDA's IPC.
//!
//! **Export data** ([`ExportData`], 32 bytes, as CUDA's 64-byte
//! `cudaMemPoolPtrExportData`) names the pool by a token unique to the
//! process and pool, and the allocation by address, size and a serial.
//! Data whose allocation has been freed since (no lease left) is
//! [`Error::StaleExport`]; data of another pool is [`Error::ForeignExport`].
//!
//! **Descriptors.** The pool handle is a Unix socket (one end of a
//! `SOCK_SEQPACKET` pair): send it to the other process over any Unix socket
//! ([`send_handle`] / [`recv_handle`] do that with `SCM_RIGHTS`), and then
//! drop your copy, so that the connection closes when the importer dies.
//! Chunks travel as the backend's exported descriptors (memfds on the host
//! backend, `cuMemExportToShareableHandle` on CUDA), one at a time: the
//! exporter exports each as it sends it, and the importer imports each as
//! it comes, closing the descriptor then, so neither side holds more than
//! one however many chunks an allocation spans. A chunk that cannot be
//! exported comes without its descriptor, and so do the rest; the importer
//! then reads them all and gives the lease back. Everything goes through
//! rustix's safe socket calls with owned descriptors: no `unsafe` here.
//!
//! An imported allocation gives read-write access to the exporting pool's
//! device only (the importer's own peers get none). The exporter names its
//! device by UUID, and the importer finds it among its own devices by that,
//! so the two processes may number devices differently (another
//! `CUDA_VISIBLE_DEVICES`); a device the importer does not see is
//! [`Error::DeviceNotVisible`]. Dropping it unmaps at
//! once, like `cudaFree` of an imported pointer: work queued on it must have
//! finished.

mod import;
mod serve;
mod wire;

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::thread;

use rustix::net::{AddressFamily, SocketFlags, SocketType};
use vmm::Backend;

use crate::{Allocation, Error, Pool, Result};
pub use import::{ImportedAllocation, ImportedPool};
pub use wire::{recv_handle, send_handle, ExportData};

impl<B: Backend> Pool<B> {
    /// A handle another process imports the pool by
    /// (`cudaMemPoolExportToShareableHandle`): one end of a socket pair whose
    /// other end a thread of this pool serves. Send it with [`send_handle`],
    /// then drop it here. The pool needs [`crate::HandleType::PosixFileDescriptor`].
    pub fn export_to_shareable_handle(&self) -> Result<OwnedFd> {
        if !self.is_shareable() {
            return Err(Error::NotShareable);
        }
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| wire::ipc_error("socketpair", e))?;
        let ours = Arc::new(ours);
        self.exports().add_connection(&ours);
        let pool = self.downgrade();
        thread::Builder::new()
            .name("vmpool-export".into())
            .spawn(move || serve::serve(&pool, &ours))
            .map_err(|e| Error::Ipc(format!("starting the export thread: {e}")))?;
        Ok(theirs)
    }

    /// The data another process imports `allocation` by
    /// (`cudaMemPoolExportPointer`). Valid until the allocation is freed;
    /// the same allocation exported twice gives the same data.
    pub fn export_pointer(&self, allocation: &Allocation) -> Result<ExportData> {
        if !self.is_shareable() {
            return Err(Error::NotShareable);
        }
        if !self.owns(allocation) {
            return Err(Error::WrongPool {
                ptr: allocation.ptr().0,
            });
        }
        let ptr = allocation.ptr().0;
        Ok(ExportData {
            token: wire::pool_token(self.id()),
            serial: self.exports().export(ptr),
            ptr,
            size: allocation.size(),
        })
    }

    /// Imports of this pool's allocations that other processes hold now.
    pub fn leases(&self) -> u64 {
        self.exports().leases()
    }
}
