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

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread;

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use vmm::memory::{Chunk, Mapping, Reservation};
use vmm::{AccessDesc, Backend, DeviceId, DevicePtr};

use crate::pool::{Allocation, Pool, Shared};
use crate::stream::{lock, Stream, StreamShared};
use crate::{Error, Result};

// ---- export data -------------------------------------------------------------

/// What another process needs to import one allocation
/// (`cudaMemPoolPtrExportData`). Plain bytes: send them any way you like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportData {
    /// The exporting pool (see [`pool_token`]).
    token: u64,
    /// Tells this export from an earlier one at the same address.
    serial: u64,
    ptr: u64,
    size: u64,
}

impl ExportData {
    pub const LEN: usize = 32;

    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        for (i, word) in [self.token, self.serial, self.ptr, self.size]
            .into_iter()
            .enumerate()
        {
            out[i * 8..][..8].copy_from_slice(&word.to_le_bytes());
        }
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != Self::LEN {
            return Err(Error::Ipc(format!(
                "export data has {} bytes, not {}",
                bytes.len(),
                Self::LEN
            )));
        }
        let words = words(bytes);
        Ok(Self {
            token: words[0],
            serial: words[1],
            ptr: words[2],
            size: words[3],
        })
    }

    /// The allocation's address in the exporting process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A pool's name across processes: its id mixed with a number drawn once
/// per process, so that pool 1 of one process is not pool 1 of another.
fn pool_token(pool_id: u64) -> u64 {
    static SALT: OnceLock<u64> = OnceLock::new();
    let salt = *SALT.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    salt ^ pool_id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

// ---- the exporting side --------------------------------------------------------

/// A pool's exported allocations and their leases. Every free reads
/// `live`; the rest, boxed, only while something is exported.
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
    /// Freed while leased: the free to carry out when the last lease ends
    /// (with its stream for a stream-ordered free).
    deferred: Option<(Allocation, Option<Arc<StreamShared<B>>>)>,
}

impl<B: Backend> Exports<B> {
    /// What a free of `allocation` frees now: the allocation itself, or
    /// `None` while another process holds a lease on it (the free is then
    /// carried out when the last lease ends). Without exports, one atomic
    /// load.
    #[inline(always)]
    pub(crate) fn on_free(
        &self,
        allocation: Allocation,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Option<Allocation> {
        if self.live.load(Ordering::Acquire) == 0 {
            return Some(allocation);
        }
        self.on_free_exported(allocation, stream)
    }

    /// [`Exports::on_free`] while some allocation is exported.
    #[cold]
    fn on_free_exported(
        &self,
        allocation: Allocation,
        stream: Option<&Arc<StreamShared<B>>>,
    ) -> Option<Allocation> {
        let ptr = allocation.ptr().0;
        let mut state = lock(&self.state);
        match state.by_ptr.get_mut(&ptr) {
            Some(e) if e.leases > 0 => {
                tracing::debug!(ptr = %allocation.ptr(), leases = e.leases, "free deferred: imported elsewhere");
                e.deferred = Some((allocation, stream.cloned()));
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

    fn leases(&self) -> u64 {
        let state = lock(&self.state);
        state.ending + state.by_ptr.values().map(|e| e.leases).sum::<u64>()
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
        .map_err(|e| ipc_error("socketpair", e))?;
        let ours = Arc::new(ours);
        {
            let mut state = lock(&self.shared().exports.state);
            state.connections.retain(|c| c.strong_count() > 0);
            state.connections.push(Arc::downgrade(&ours));
        }
        let pool = Arc::downgrade(self.shared());
        thread::Builder::new()
            .name("vmpool-export".into())
            .spawn(move || serve(&pool, &ours))
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
        let exports = &self.shared().exports;
        let mut state = lock(&exports.state);
        let ptr = allocation.ptr().0;
        let serial = match state.by_ptr.get(&ptr) {
            Some(e) => e.serial,
            None => {
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
                exports.live.fetch_add(1, Ordering::Release);
                serial
            }
        };
        Ok(ExportData {
            token: pool_token(self.id()),
            serial,
            ptr,
            size: allocation.size(),
        })
    }

    /// Imports of this pool's allocations that other processes hold now.
    pub fn leases(&self) -> u64 {
        self.shared().exports.leases()
    }

    /// Takes a lease on the allocation `data` names; returns its first
    /// unit's address and the chunks under it.
    fn lease(&self, data: &ExportData) -> Result<(u64, Vec<Arc<Chunk<B>>>)> {
        if data.token != pool_token(self.id()) {
            return Err(Error::ForeignExport { ptr: data.ptr });
        }
        {
            let mut state = lock(&self.shared().exports.state);
            match state.by_ptr.get_mut(&data.ptr) {
                Some(e) if e.serial == data.serial && e.deferred.is_none() => e.leases += 1,
                _ => return Err(Error::StaleExport { ptr: data.ptr }),
            }
        }
        Ok(self.units_under(data.ptr, data.size))
    }

    /// Ends a lease on the allocation at `ptr`; the last one carries out a
    /// free that was deferred.
    fn end_lease(&self, ptr: u64) {
        let deferred = {
            let exports = &self.shared().exports;
            let mut state = lock(&exports.state);
            let Some(e) = state.by_ptr.get_mut(&ptr) else {
                return;
            };
            e.leases -= 1;
            if e.leases > 0 || e.deferred.is_none() {
                return;
            }
            let e = state.by_ptr.remove(&ptr).expect("found above");
            exports.live.fetch_sub(1, Ordering::Release);
            state.ending += 1;
            e.deferred
        };
        if let Some((allocation, stream)) = deferred {
            tracing::debug!(ptr = %allocation.ptr(), "last lease ended: deferred free carried out");
            let freed = match stream {
                Some(stream) => self.free_async(allocation, &Stream(stream)),
                None => self.free(allocation),
            };
            if let Err(err) = freed {
                tracing::warn!(%err, "a deferred free failed");
            }
            lock(&self.shared().exports.state).ending -= 1;
        }
    }
}

// The protocol: one request, one reply, over a SOCK_SEQPACKET pair. Each
// message is little-endian u64 words; an error reply adds its text.
const HELLO: u64 = 1;
/// The protocol's version, in the hello: builds that speak another refuse
/// each other by name rather than misreading each other's messages.
/// Version 1 had no version word and no device UUID in the answer.
const PROTOCOL: u64 = 2;
/// How long [`ImportedPool::from_shareable_handle`] waits for the exporter.
const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
const IMPORT: u64 = 2;
const RELEASE: u64 = 3;
const OK: u64 = 0;
const STALE: u64 = 1;
const FOREIGN: u64 = 2;
const FAILED: u64 = 3;

/// A reply: messages, each with the chunk whose descriptor goes with it.
/// A chunk is exported as its message is sent, and its descriptor closed
/// once sent, so that this side holds one at a time however many chunks an
/// allocation spans.
type Reply<B> = Vec<(Vec<u8>, Option<Arc<Chunk<B>>>)>;

fn reply<B: Backend>(words: &[u64], text: &str) -> Reply<B> {
    vec![(message(words, text), None)]
}

/// Sends `answer`. A chunk that fails to export goes without its
/// descriptor, and so do the ones after it: the importer, finding one
/// missing, reads the rest and gives the lease back.
fn send_reply<B: Backend>(conn: BorrowedFd<'_>, answer: Reply<B>) -> Result<()> {
    let mut failed = false;
    for (bytes, chunk) in answer {
        // The chunk goes before its message does: once the importer has
        // the last one, this side holds none of them.
        let exported = chunk.filter(|_| !failed).map(|c| c.export());
        let fd = match exported {
            Some(Ok(fd)) => Some(fd),
            Some(Err(err)) => {
                tracing::warn!(%err, "exporting a chunk for an import");
                failed = true;
                None
            }
            None => None,
        };
        send(conn, &bytes, fd.as_ref().map(|f| f.as_fd()))?;
    }
    Ok(())
}

/// Serves one connection until it closes or the pool goes, then ends the
/// leases it still holds.
fn serve<B: Backend>(pool: &Weak<Shared<B>>, conn: &OwnedFd) {
    // Lease id -> the leased allocation's address.
    let mut leases: HashMap<u64, u64> = HashMap::new();
    let mut next_lease = 0;
    let mut buf = [0u8; 256];
    loop {
        let request = match recv(conn.as_fd(), &mut buf) {
            Ok((0, _)) | Err(_) => break,
            Ok((n, _)) => words(&buf[..n]),
        };
        let Some(shared) = pool.upgrade() else { break };
        let pool = Pool::from_shared(shared);
        let answer = match request.as_slice() {
            &[HELLO, version] if version != PROTOCOL => reply(
                &[FAILED],
                &format!("the importer speaks protocol {version}, this exporter {PROTOCOL}"),
            ),
            [HELLO] => reply(
                &[FAILED],
                &format!("the importer speaks protocol 1, this exporter {PROTOCOL}"),
            ),
            [HELLO, _] => match pool.backend().device_uuid(pool.device()) {
                Ok(uuid) => {
                    let (high, low) = uuid.split_at(8);
                    let word = |half: &[u8]| u64::from_be_bytes(half.try_into().expect("8 bytes"));
                    reply(
                        &[
                            OK,
                            pool_token(pool.id()),
                            u64::from(pool.device().0),
                            pool.backend().granularity(pool.device()).unwrap_or(0) as u64,
                            word(high),
                            word(low),
                        ],
                        "",
                    )
                }
                Err(err) => reply(&[FAILED], &err.to_string()),
            },
            &[IMPORT, token, serial, ptr, size] => {
                let data = ExportData {
                    token,
                    serial,
                    ptr,
                    size,
                };
                next_lease += 1;
                grant(&pool, &data, next_lease, &mut leases)
            }
            &[RELEASE, lease] => match leases.remove(&lease) {
                Some(ptr) => {
                    pool.end_lease(ptr);
                    reply(&[OK], "")
                }
                None => reply(&[FAILED], "no such lease"),
            },
            _ => reply(&[FAILED], "unknown request"),
        };
        // Let go of the pool before answering: once answered, the other
        // side may expect everything to be as it left it, the pool gone
        // included, when this process drops it.
        drop(pool);
        if send_reply(conn.as_fd(), answer).is_err() {
            break;
        }
    }
    if leases.is_empty() {
        // Nothing to end: do not touch the pool, which this thread would
        // otherwise keep alive, for a moment, past its owner's last drop.
        return;
    }
    tracing::debug!(
        leases = leases.len(),
        "an importing process went away: its leases end"
    );
    if let Some(shared) = pool.upgrade() {
        let pool = Pool::from_shared(shared);
        for ptr in leases.into_values() {
            pool.end_lease(ptr);
        }
    }
}

/// Takes a lease for an import and answers with a header, then one message
/// per chunk with its descriptor ([`send_reply`] exports them). The lease
/// is recorded before anything is sent, so that a connection that breaks
/// half-way still ends it.
fn grant<B: Backend>(
    pool: &Pool<B>,
    data: &ExportData,
    lease: u64,
    leases: &mut HashMap<u64, u64>,
) -> Reply<B> {
    let (first, chunks) = match pool.lease(data) {
        Ok(found) => found,
        Err(err) => {
            let code = match err {
                Error::StaleExport { .. } => STALE,
                Error::ForeignExport { .. } => FOREIGN,
                _ => FAILED,
            };
            return reply(&[code], &err.to_string());
        }
    };
    leases.insert(lease, data.ptr);
    let mut answer = reply(&[OK, lease, data.ptr - first, chunks.len() as u64], "");
    for chunk in chunks {
        answer.push((
            message(&[chunk.handle().0, chunk.size() as u64], ""),
            Some(chunk),
        ));
    }
    answer
}

// ---- the importing side --------------------------------------------------------

/// Another process's pool, imported (`cudaMemPoolImportFromShareableHandle`).
pub struct ImportedPool<B: Backend> {
    importer: Arc<Importer<B>>,
}

struct Importer<B: Backend> {
    backend: Arc<B>,
    /// One request and its reply at a time.
    conn: Mutex<OwnedFd>,
    token: u64,
    device: DeviceId,
    /// Chunks imported and still mapped, by the exporter's handle: a chunk
    /// under two imported allocations is imported once.
    chunks: Mutex<HashMap<u64, Weak<Chunk<B>>>>,
}

impl<B: Backend> ImportedPool<B> {
    /// Connects to the pool that made `handle` (see
    /// [`Pool::export_to_shareable_handle`]). A descriptor that is not such
    /// a handle, or an exporter that has gone, is [`Error::Ipc`].
    pub fn from_shareable_handle(backend: &Arc<B>, handle: OwnedFd) -> Result<Self> {
        // A socket that nobody serves would never answer.
        let timeout = |t| {
            rustix::net::sockopt::set_socket_timeout(
                &handle,
                rustix::net::sockopt::Timeout::Recv,
                t,
            )
            .map_err(|e| ipc_error("setsockopt", e))
        };
        timeout(Some(HELLO_TIMEOUT))?;
        let reply = request(handle.as_fd(), &[HELLO, PROTOCOL])?;
        timeout(None)?;
        let &[OK, token, device, granule, high, low] = reply.0.as_slice() else {
            return Err(Error::Ipc(match reply.0.as_slice() {
                // An exporter of protocol 1 knows no hello with a version.
                [FAILED] if reply.1 == "unknown request" => {
                    format!("the exporter speaks protocol 1, this importer {PROTOCOL}")
                }
                [FAILED] => format!("the exporter could not answer: {}", reply.1),
                other => format!("unexpected answer to hello: {other:?}"),
            }));
        };
        // The exporter's device as this process numbers it.
        let mut uuid = [0; 16];
        uuid[..8].copy_from_slice(&high.to_be_bytes());
        uuid[8..].copy_from_slice(&low.to_be_bytes());
        let mut ours = None;
        for d in (0..backend.device_count()?).map(DeviceId) {
            if backend.device_uuid(d)? == uuid {
                ours = Some(d);
                break;
            }
        }
        let device = ours.ok_or(Error::DeviceNotVisible {
            device: DeviceId(device as u32),
        })?;
        if backend.granularity(device)? as u64 != granule {
            return Err(Error::Ipc(format!(
                "the exporter's granularity {granule} differs from this backend's"
            )));
        }
        Ok(Self {
            importer: Arc::new(Importer {
                backend: Arc::clone(backend),
                conn: Mutex::new(handle),
                token,
                device,
                chunks: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The exporting pool's device, as this process numbers it.
    pub fn device(&self) -> DeviceId {
        self.importer.device
    }

    /// Maps the allocation `data` names into this process
    /// (`cudaMemPoolImportPointer`). It stays mapped, and the exporter keeps
    /// it, until the result is dropped.
    pub fn import_pointer(&self, data: &ExportData) -> Result<ImportedAllocation<B>> {
        let importer = &self.importer;
        if data.token != importer.token {
            return Err(Error::ForeignExport { ptr: data.ptr });
        }
        let Grant {
            lease: id,
            offset,
            chunks,
        } = importer.ask_import(data)?;
        // From here on, dropping `lease` gives it back.
        let lease = Lease {
            importer: Arc::clone(importer),
            id,
        };
        let backend = &importer.backend;
        let total: usize = chunks.iter().map(|c| c.size()).sum();
        let reservation = Reservation::new(backend, total, 0)?;
        let mut mappings = Vec::with_capacity(chunks.len());
        let mut at = 0;
        for chunk in &chunks {
            let mapping = Mapping::new(&reservation, at, chunk)?;
            mapping.set_access(&[AccessDesc::read_write(importer.device)])?;
            at += chunk.size();
            mappings.push(mapping);
        }
        Ok(ImportedAllocation {
            ptr: reservation.base().byte_add(offset as usize),
            size: data.size,
            mappings,
            reservation,
            lease,
        })
    }
}

impl<B: Backend> Importer<B> {
    /// Asks the exporter for a lease on `data` and the chunks under it, and
    /// imports each chunk as its descriptor comes (closing the descriptor
    /// then), so that this side holds one at a time.
    fn ask_import(&self, data: &ExportData) -> Result<Grant<B>> {
        let conn = lock(&self.conn);
        let (reply, text) = request(
            conn.as_fd(),
            &[IMPORT, data.token, data.serial, data.ptr, data.size],
        )?;
        let &[OK, lease, offset, count] = reply.as_slice() else {
            return Err(match reply.first() {
                Some(&STALE) => Error::StaleExport { ptr: data.ptr },
                Some(&FOREIGN) => Error::ForeignExport { ptr: data.ptr },
                _ => Error::Ipc(format!("the exporter refused the import: {text}")),
            });
        };
        lock(&self.chunks).retain(|_, c| c.strong_count() > 0);
        let mut chunks = Vec::new();
        let mut buf = [0u8; 64];
        for i in 0..count {
            let chunk = match recv(conn.as_fd(), &mut buf) {
                Ok((16, Some(fd))) => {
                    let w = words(&buf[..16]);
                    self.import_chunk(w[0], w[1] as usize, fd)
                }
                // A descriptor goes missing when the exporter could not
                // export its chunk, or when this process is at its
                // open-file limit (the kernel drops it).
                Ok((n, _)) => Err(Error::Ipc(format!(
                    "a chunk message of {n} bytes without a descriptor"
                ))),
                Err(err) => return Err(err),
            };
            match chunk {
                Ok(chunk) => chunks.push(chunk),
                Err(err) => {
                    // The rest of the grant is on its way: read it, so that
                    // the next reply read is the next request's; then give
                    // the lease back.
                    drop(chunks);
                    for _ in i + 1..count {
                        recv(conn.as_fd(), &mut buf)?;
                    }
                    let _ = request(conn.as_fd(), &[RELEASE, lease]);
                    return Err(err);
                }
            }
        }
        Ok(Grant {
            lease,
            offset,
            chunks,
        })
    }

    /// The exporter's chunk `handle`, imported from `fd` unless an earlier
    /// import of this process still holds it.
    fn import_chunk(&self, handle: u64, size: usize, fd: OwnedFd) -> Result<Arc<Chunk<B>>> {
        let mut cache = lock(&self.chunks);
        if let Some(chunk) = cache.get(&handle).and_then(Weak::upgrade) {
            return Ok(chunk);
        }
        let chunk = Chunk::import(&self.backend, fd.as_fd(), self.device, size)?;
        cache.insert(handle, Arc::downgrade(&chunk));
        Ok(chunk)
    }
}

/// What the exporter sends for an import: the lease, the allocation's
/// offset in its first chunk, and its chunks, imported.
struct Grant<B: Backend> {
    lease: u64,
    offset: u64,
    chunks: Vec<Arc<Chunk<B>>>,
}

/// A lease on an exported allocation; given back when dropped.
struct Lease<B: Backend> {
    importer: Arc<Importer<B>>,
    id: u64,
}

impl<B: Backend> Drop for Lease<B> {
    fn drop(&mut self) {
        let conn = lock(&self.importer.conn);
        match request(conn.as_fd(), &[RELEASE, self.id]) {
            Ok((reply, _)) if reply == [OK] => {}
            Ok((_, text)) => tracing::warn!(lease = self.id, "releasing a lease: {text}"),
            // The exporter is gone: nothing is left to give back.
            Err(err) => tracing::debug!(%err, lease = self.id, "releasing a lease"),
        }
    }
}

/// An allocation of another process's pool, mapped here. Dropping it unmaps
/// it (queued work on it must have finished) and gives the lease back.
pub struct ImportedAllocation<B: Backend> {
    ptr: DevicePtr,
    size: u64,
    // Field order is drop order: unmap, free the address range, and only
    // then tell the exporter.
    mappings: Vec<Mapping<B>>,
    reservation: Arc<Reservation<B>>,
    lease: Lease<B>,
}

impl<B: Backend> ImportedAllocation<B> {
    /// Where the allocation is in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

impl<B: Backend> std::fmt::Debug for ImportedAllocation<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedAllocation")
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .field("chunks", &self.mappings.len())
            .field("range", &self.reservation.base())
            .field("lease", &self.lease.id)
            .finish()
    }
}

// ---- descriptors over Unix sockets -----------------------------------------------

/// Sends `handle` over the Unix socket `socket` (`SCM_RIGHTS`), with one
/// byte of data. The receiver gets its own descriptor; drop yours after.
pub fn send_handle(socket: impl AsFd, handle: BorrowedFd<'_>) -> Result<()> {
    send(socket.as_fd(), b"h", Some(handle))
}

/// Receives a descriptor that [`send_handle`] sent.
pub fn recv_handle(socket: impl AsFd) -> Result<OwnedFd> {
    let mut byte = [0u8; 1];
    match recv(socket.as_fd(), &mut byte)? {
        (1, Some(fd)) => Ok(fd),
        (0, _) => Err(Error::Ipc("the socket closed before a handle came".into())),
        _ => Err(Error::Ipc("a message without a descriptor".into())),
    }
}

fn ipc_error(call: &str, err: Errno) -> Error {
    Error::Ipc(format!("{call}: {err}"))
}

fn message(words: &[u64], text: &str) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.extend_from_slice(text.as_bytes());
    out
}

/// The whole little-endian words at the start of `bytes`.
fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect()
}

/// Sends one request and reads its reply: its words, or for an error
/// reply its code and text.
fn request(conn: BorrowedFd<'_>, words_out: &[u64]) -> Result<(Vec<u64>, String)> {
    send(conn, &message(words_out, ""), None)?;
    let mut buf = [0u8; 1024];
    let (n, _) = recv(conn, &mut buf)?;
    if n == 0 {
        return Err(Error::Ipc("the exporting process is gone".into()));
    }
    if n < 8 {
        return Err(Error::Ipc(format!("a reply of {n} bytes")));
    }
    let code = words(&buf[..8])[0];
    if code == OK {
        Ok((words(&buf[..n]), String::new()))
    } else {
        Ok((vec![code], String::from_utf8_lossy(&buf[8..n]).into_owned()))
    }
}

fn send(socket: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<()> {
    let fds = fd.as_slice();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    loop {
        match rustix::net::sendmsg(
            socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(ipc_error("sendmsg", e)),
        }
    }
}

/// Receives one message into `buf`: its length (0: the other end closed)
/// and the descriptor that came with it, if any (extra ones are closed).
fn recv(socket: BorrowedFd<'_>, buf: &mut [u8]) -> Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = loop {
        match rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(ipc_error("recvmsg", e)),
        }
    };
    let mut fd = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for received in fds {
                fd.get_or_insert(received);
            }
        }
    }
    Ok((received.bytes, fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Context, HandleType, PoolProps};

    /// Builds of another protocol version are refused by name, both ways.
    #[test]
    fn another_protocol_version_is_refused_by_name() {
        let host = vmm::host::Host::new(vmm::host::HostConfig::default()).unwrap();
        let ctx = Context::new(Arc::clone(&host)).unwrap();
        let pool = ctx
            .create_pool(&PoolProps {
                handle_type: HandleType::PosixFileDescriptor,
                ..PoolProps::new(DeviceId(0))
            })
            .unwrap();
        let handle = pool.export_to_shareable_handle().unwrap();
        for (hello, speaks) in [(vec![HELLO], 1), (vec![HELLO, PROTOCOL + 1], PROTOCOL + 1)] {
            let (words, text) = request(handle.as_fd(), &hello).unwrap();
            assert_eq!(words, [FAILED]);
            assert_eq!(
                text,
                format!("the importer speaks protocol {speaks}, this exporter {PROTOCOL}")
            );
        }
        // The right version still connects.
        let (words, _) = request(handle.as_fd(), &[HELLO, PROTOCOL]).unwrap();
        assert_eq!(words[0], OK);
    }

    /// A grant whose second chunk comes without its descriptor (as when the
    /// importer is at its open-file limit): the import fails, the rest of
    /// the grant is read, the lease goes back, and the connection's next
    /// request gets its own reply.
    #[test]
    fn a_grant_broken_part_way_is_read_to_its_end() {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        let host = vmm::host::Host::new(vmm::host::HostConfig::default()).unwrap();
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let data = ExportData {
            token: 7,
            serial: 1,
            ptr: 0x1000,
            size: 3 << 21,
        };
        // The exporter's side, by hand: three chunks, the second without
        // its descriptor; then it expects the lease back, then a hello.
        let chunk = Chunk::new_shareable(&host, DeviceId(0), 2 << 20).unwrap();
        let exported = chunk.export().unwrap();
        let exporter = std::thread::spawn(move || {
            let mut buf = [0u8; 1024];
            let (n, _) = recv(theirs.as_fd(), &mut buf).unwrap();
            assert_eq!(words(&buf[..n]), [IMPORT, 7, 1, 0x1000, 3 << 21]);
            send(theirs.as_fd(), &message(&[OK, 42, 0, 3], ""), None).unwrap();
            let fd = exported.as_fd();
            for (i, fd) in [Some(fd), None, Some(fd)].into_iter().enumerate() {
                send(theirs.as_fd(), &message(&[i as u64, 2 << 20], ""), fd).unwrap();
            }
            let (n, _) = recv(theirs.as_fd(), &mut buf).unwrap();
            assert_eq!(words(&buf[..n]), [RELEASE, 42], "the lease went back");
            send(theirs.as_fd(), &message(&[OK], ""), None).unwrap();
            let (n, _) = recv(theirs.as_fd(), &mut buf).unwrap();
            assert_eq!(words(&buf[..n]), [HELLO, PROTOCOL]);
            send(theirs.as_fd(), &message(&[OK, 99], ""), None).unwrap();
        });
        let importer = Importer {
            backend: Arc::clone(&host),
            conn: Mutex::new(ours),
            token: 7,
            device: DeviceId(0),
            chunks: Mutex::default(),
        };
        let err = importer
            .ask_import(&data)
            .err()
            .expect("a chunk had no descriptor");
        assert!(err.to_string().contains("without a descriptor"), "{err}");
        let (words, _) = request(lock(&importer.conn).as_fd(), &[HELLO, PROTOCOL]).unwrap();
        assert_eq!(
            words,
            [OK, 99],
            "the reply to the hello, not a chunk of the grant"
        );
        exporter.join().unwrap();
        // The first chunk was imported as it came, and let go again.
        drop(chunk);
        assert!(lock(&importer.chunks)
            .values()
            .all(|c| c.strong_count() == 0));
        assert_eq!(host.census().chunks, 0);
    }
}
