//! The importing side: a connection to another process's pool, and the
//! allocations imported over it, mapped here.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use vmm::memory::{Chunk, Mapping, Reservation};
use vmm::{AccessDesc, Backend, DeviceId, DevicePtr};

use super::wire::{
    ipc_error, recv, request, words, ExportData, FAILED, FOREIGN, HELLO, HELLO_TIMEOUT, IMPORT, OK,
    PROTOCOL, RELEASE, STALE,
};
use crate::sync::lock;
use crate::{Error, Result};

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
    /// [`crate::Pool::export_to_shareable_handle`]). A descriptor that is not such
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

    /// The allocation's size in bytes, as exported.
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

#[cfg(test)]
mod tests {
    use super::super::wire::{message, send};
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
