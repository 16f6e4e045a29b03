//! The host backend: vmpool's memory model on Linux virtual memory.
//!
//! ```text
//!   reserve      mmap(PROT_NONE, NORESERVE)      [.............................]
//!   create       memfd_create + ftruncate        chunk = a file of N granules
//!   map          mmap(MAP_SHARED|MAP_FIXED, fd)  [....|chunk|..................]
//!   set access   mprotect(READ|WRITE)            [....|rw   |..................]
//!   unmap        mmap(PROT_NONE, MAP_FIXED)      [.............................]
//!   export       dup the memfd                   (chunks are sealed at their size)
//!   import       check the seals and size, dup   a chunk like any other
//! ```
//!
//! Chunks are real shared memory, so data written through one mapping of a
//! chunk is seen through every other, and a chunk keeps its data when it is
//! unmapped and mapped elsewhere: exactly what remapping relies on.
//!
//! Every call is checked against the backend's own tables (reservations,
//! chunks, mappings) before the kernel is asked, so a wrong call is an error,
//! never a stray `MAP_FIXED` over someone else's memory. Stream work (the
//! test work of `testing.rs`) reads and writes memory under the tables' read
//! lock after checking that the range is mapped with access for the
//! stream's device; unmap and set-access take the write lock, so they never
//! pull memory from under running work.
//! "Device memory" is the configured size per device; creating a chunk
//! beyond it fails with [`ErrorKind::OutOfMemory`].
//!
//! Every chunk is a memfd, so any chunk could travel to another process;
//! only those created shareable may be exported, as on CUDA. An importing
//! process accepts only a memfd sealed against growing and shrinking at the
//! announced size, so a foreign descriptor is an error and never a mapping
//! that faults later. Imported chunks do not count as the importer's memory.

mod staging;
mod stream;
mod sys;
#[cfg(feature = "testing")]
mod testing;

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use staging::HostBytes;
pub use stream::{HostEvent, HostStream};

use crate::backend::check_host_ranges;
use crate::ranges::Ranges;
use crate::{
    Access, AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr, Error, ErrorKind, EventStatus,
    HostBuffer, HostCopy, MemInfo, Result,
};

/// Shape of the simulated machine.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// The number of simulated devices.
    pub devices: u32,
    /// Which device of the simulated machine is this backend's device 0,
    /// as `CUDA_VISIBLE_DEVICES` would renumber them: device `i` has the
    /// UUID of machine device `first_device + i`, so two backends (two
    /// processes) can see one device under different ordinals.
    pub first_device: u32,
    /// Physical memory of each device, in bytes.
    pub memory_per_device: usize,
    /// Chunk and mapping unit; a multiple of the system page size.
    pub granularity: usize,
}

impl Default for HostConfig {
    /// One device of 16 GiB with the H200's 2 MiB granularity. Memory is
    /// only committed where it is written, so the size costs nothing unused.
    fn default() -> Self {
        Self {
            devices: 1,
            first_device: 0,
            memory_per_device: 16 << 30,
            granularity: 2 << 20,
        }
    }
}

/// Objects alive in a host backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Census {
    /// Address reservations not yet freed.
    pub reservations: usize,
    /// Chunks whose memory still exists (released handles still mapped count).
    pub chunks: usize,
    /// Mappings not yet unmapped.
    pub mappings: usize,
    /// Events not yet dropped.
    pub events: usize,
}

/// The host backend: the driver's model on Linux virtual memory (memfd
/// chunks mapped into a `PROT_NONE` reservation, worker threads as
/// streams), so that everything built on [`Backend`] runs without a GPU.
pub struct Host {
    config: HostConfig,
    memory: Arc<Memory>,
}

impl Host {
    /// A host backend shaped by `config`.
    pub fn new(config: HostConfig) -> Result<Arc<Self>> {
        let page = rustix::param::page_size();
        if config.devices == 0 {
            return Err(Error::invalid("Host::new", "at least one device is needed"));
        }
        if config.first_device.checked_add(config.devices).is_none() {
            return Err(Error::invalid("Host::new", "device numbers past u32::MAX"));
        }
        if config.granularity == 0 || config.granularity % page != 0 {
            return Err(Error::invalid(
                "Host::new",
                format!(
                    "granularity {} is not a multiple of the page size {page}",
                    config.granularity
                ),
            ));
        }
        sys::raise_fd_limit();
        let memory = Arc::new(Memory {
            tables: RwLock::new(Tables {
                used: vec![0; config.devices as usize],
                ..Tables::default()
            }),
            events: AtomicUsize::new(0),
            captures: Mutex::default(),
        });
        Ok(Arc::new(Self { config, memory }))
    }

    /// What the backend holds right now, to check that nothing leaked.
    pub fn census(&self) -> Census {
        let tables = self.memory.tables();
        Census {
            reservations: tables.reservations.len(),
            chunks: tables.chunks.len(),
            mappings: tables.mappings.len(),
            events: self.memory.events.load(Ordering::Relaxed),
        }
    }

    fn check_device(&self, call: &'static str, device: DeviceId) -> Result<()> {
        if device.0 < self.config.devices {
            Ok(())
        } else {
            Err(Error::rejected(
                call,
                ErrorKind::InvalidDevice,
                format!(
                    "{device} does not exist ({} configured)",
                    self.config.devices
                ),
            ))
        }
    }

    /// Checks that `size` (and `more` values) are granularity multiples.
    fn check_granular(&self, call: &'static str, what: &[(&str, u64)]) -> Result<()> {
        let g = self.config.granularity as u64;
        for (name, value) in what {
            if value % g != 0 {
                return Err(Error::invalid(
                    call,
                    format!("{name} {value:#x} is not a multiple of the granularity {g:#x}"),
                ));
            }
        }
        Ok(())
    }

    fn check_size(&self, call: &'static str, size: usize) -> Result<()> {
        if size == 0 {
            return Err(Error::invalid(call, "size is zero"));
        }
        self.check_granular(call, &[("size", size as u64)])
    }

    /// Creates a chunk (shareable or not) after the checks every creation
    /// makes.
    fn create(
        &self,
        call: &'static str,
        device: DeviceId,
        size: usize,
        shareable: bool,
    ) -> Result<ChunkHandle> {
        self.check_device(call, device)?;
        self.check_size(call, size)?;
        let mut tables = self.memory.tables_mut();
        let used = tables.used[device.0 as usize];
        if size > self.config.memory_per_device - used {
            return Err(Error::rejected(
                call,
                ErrorKind::OutOfMemory,
                format!(
                    "{size} bytes requested, {} of {} free on {device}",
                    self.config.memory_per_device - used,
                    self.config.memory_per_device
                ),
            ));
        }
        let fd = sys::create_memory(size)?;
        tables.next_chunk += 1;
        let handle = tables.next_chunk;
        tables.used[device.0 as usize] += size;
        tables.chunks.insert(
            handle,
            ChunkEntry {
                device,
                size,
                fd: Some(Arc::new(fd)),
                mappings: 0,
                shareable,
                imported: false,
            },
        );
        Ok(ChunkHandle(handle))
    }
}

struct ChunkEntry {
    device: DeviceId,
    size: usize,
    /// `None` once the handle is released; the memory lives on (and counts
    /// as used) until its last mapping goes, as with `cuMemRelease`.
    fd: Option<Arc<OwnedFd>>,
    mappings: usize,
    /// Created shareable or imported: may be exported.
    shareable: bool,
    /// Imported from another process: its memory is counted there, as an
    /// imported CUDA allocation uses no memory of the importer's own.
    imported: bool,
}

struct MappingEntry {
    chunk: u64,
    /// Access granted to each device; a device not listed has none.
    access: HashMap<DeviceId, Access>,
}

#[derive(Default)]
struct Tables {
    reservations: Ranges<()>,
    chunks: HashMap<u64, ChunkEntry>,
    mappings: Ranges<MappingEntry>,
    /// Physical bytes in existence on each device.
    used: Vec<usize>,
    next_chunk: u64,
}

impl Tables {
    /// Forgets a chunk once it is both released and unmapped everywhere.
    fn collect(&mut self, handle: u64) {
        if let Some(c) = self.chunks.get(&handle) {
            if c.fd.is_none() && c.mappings == 0 {
                if !c.imported {
                    self.used[c.device.0 as usize] -= c.size;
                }
                self.chunks.remove(&handle);
            }
        }
    }
}

/// The tables, shared with the stream workers.
pub(super) struct Memory {
    tables: RwLock<Tables>,
    /// Live events, for the census.
    pub(super) events: AtomicUsize,
    /// The captures under way on this backend's streams.
    pub(super) captures: Mutex<Vec<Arc<stream::Capture>>>,
}

impl Memory {
    /// Refuses `call` while a capture is under way, as the driver refuses a
    /// synchronising call during a capture in global mode, spoiling every
    /// capture under way.
    pub(super) fn not_in_capture(&self, call: &'static str) -> Result<()> {
        let captures = stream::lock(&self.captures);
        if captures.is_empty() {
            return Ok(());
        }
        for capture in captures.iter() {
            capture.spoil();
        }
        Err(Error::rejected(
            call,
            ErrorKind::Other,
            "not permitted while a stream is capturing (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)",
        ))
    }

    fn tables(&self) -> RwLockReadGuard<'_, Tables> {
        self.tables.read().unwrap_or_else(|p| p.into_inner())
    }

    fn tables_mut(&self) -> RwLockWriteGuard<'_, Tables> {
        self.tables.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl Backend for Host {
    type Stream = HostStream;
    type Event = HostEvent;

    type HostBuffer = HostBytes;

    fn name(&self) -> &'static str {
        "host"
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.config.devices)
    }

    fn granularity(&self, device: DeviceId) -> Result<usize> {
        self.check_device("granularity", device)?;
        Ok(self.config.granularity)
    }

    fn device_uuid(&self, device: DeviceId) -> Result<[u8; 16]> {
        self.check_device("device_uuid", device)?;
        let mut uuid = *b"vmm-host-dev\0\0\0\0";
        uuid[12..].copy_from_slice(&(self.config.first_device + device.0).to_be_bytes());
        Ok(uuid)
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.check_device("mem_info", device)?;
        let used = self.memory.tables().used[device.0 as usize];
        Ok(MemInfo {
            free: self.config.memory_per_device - used,
            total: self.config.memory_per_device,
        })
    }

    fn reserve(&self, size: usize, alignment: usize) -> Result<DevicePtr> {
        self.check_size("reserve", size)?;
        let alignment = if alignment == 0 {
            self.config.granularity
        } else {
            alignment
        };
        if !alignment.is_power_of_two() {
            return Err(Error::invalid(
                "reserve",
                format!("alignment {alignment:#x} is not a power of two"),
            ));
        }
        let start = sys::reserve(size, alignment.max(self.config.granularity))?;
        self.memory
            .tables_mut()
            .reservations
            .insert(start as u64, size, ());
        Ok(DevicePtr(start as u64))
    }

    fn free_reservation(&self, base: DevicePtr, size: usize) -> Result<()> {
        let mut tables = self.memory.tables_mut();
        if tables.reservations.get(base.0).map(|r| r.size) != Some(size) {
            return Err(Error::invalid(
                "free_reservation",
                format!("no reservation of {size} bytes at {base}"),
            ));
        }
        if tables.mappings.overlaps(base.0, size) {
            return Err(Error::invalid(
                "free_reservation",
                format!("the reservation at {base} still has mappings"),
            ));
        }
        sys::release_range(base.0 as usize, size)?;
        tables.reservations.remove(base.0);
        Ok(())
    }

    fn create_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.create("create_chunk", device, size, false)
    }

    fn create_shareable_chunk(&self, device: DeviceId, size: usize) -> Result<ChunkHandle> {
        self.create("create_shareable_chunk", device, size, true)
    }

    fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd> {
        let tables = self.memory.tables();
        match tables.chunks.get(&chunk.0) {
            Some(ChunkEntry {
                fd: Some(fd),
                shareable: true,
                ..
            }) => fd.try_clone().map_err(|e| {
                Error::rejected("export_chunk", ErrorKind::Other, format!("dup: {e}"))
            }),
            Some(ChunkEntry { fd: Some(_), .. }) => Err(Error::invalid(
                "export_chunk",
                format!("{chunk:?} was not created shareable"),
            )),
            _ => Err(Error::invalid(
                "export_chunk",
                format!("{chunk:?} is not a live chunk"),
            )),
        }
    }

    fn import_chunk(
        &self,
        fd: BorrowedFd<'_>,
        device: DeviceId,
        size: usize,
    ) -> Result<ChunkHandle> {
        self.check_device("import_chunk", device)?;
        self.check_size("import_chunk", size)?;
        sys::check_chunk_fd(fd, size)?;
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Error::rejected("import_chunk", ErrorKind::Other, format!("dup: {e}")))?;
        let mut tables = self.memory.tables_mut();
        tables.next_chunk += 1;
        let handle = tables.next_chunk;
        tables.chunks.insert(
            handle,
            ChunkEntry {
                device,
                size,
                fd: Some(Arc::new(owned)),
                mappings: 0,
                shareable: true,
                imported: true,
            },
        );
        Ok(ChunkHandle(handle))
    }

    fn get_access(&self, va: DevicePtr, device: DeviceId) -> Result<Access> {
        self.check_device("get_access", device)?;
        let tables = self.memory.tables();
        match tables.mappings.covering(va.0, 1).as_deref() {
            Some([(_, m)]) => Ok(m.value.access.get(&device).copied().unwrap_or(Access::None)),
            _ => Err(Error::invalid("get_access", format!("{va} is not mapped"))),
        }
    }

    fn release_chunk(&self, chunk: ChunkHandle) -> Result<()> {
        let mut tables = self.memory.tables_mut();
        match tables.chunks.get_mut(&chunk.0) {
            Some(entry) if entry.fd.is_some() => entry.fd = None,
            _ => {
                return Err(Error::invalid(
                    "release_chunk",
                    format!("{chunk:?} is not a live chunk"),
                ))
            }
        }
        tables.collect(chunk.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, chunk: ChunkHandle) -> Result<()> {
        self.check_granular("map", &[("address", va.0)])?;
        let mut tables = self.memory.tables_mut();
        let (fd, size) = match tables.chunks.get(&chunk.0) {
            Some(ChunkEntry {
                fd: Some(fd), size, ..
            }) => (Arc::clone(fd), *size),
            _ => {
                return Err(Error::invalid(
                    "map",
                    format!("{chunk:?} is not a live chunk"),
                ))
            }
        };
        if tables.reservations.containing(va.0, size).is_none() {
            return Err(Error::invalid(
                "map",
                format!("{size} bytes at {va} are not inside one reservation"),
            ));
        }
        if tables.mappings.overlaps(va.0, size) {
            return Err(Error::invalid(
                "map",
                format!("{size} bytes at {va} overlap an existing mapping"),
            ));
        }
        sys::map_shared(va.0 as usize, size, &*fd)?;
        tables.mappings.insert(
            va.0,
            size,
            MappingEntry {
                chunk: chunk.0,
                access: HashMap::new(),
            },
        );
        tables
            .chunks
            .get_mut(&chunk.0)
            .expect("looked up above")
            .mappings += 1;
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.check_size("unmap", size)?;
        let mut tables = self.memory.tables_mut();
        let Some(starts) = tables.mappings.whole_run(va.0, size) else {
            return Err(Error::invalid(
                "unmap",
                format!("{size} bytes at {va} are not a run of whole mappings"),
            ));
        };
        sys::unmap_to_placeholder(va.0 as usize, size)?;
        for start in starts {
            let entry = tables.mappings.remove(start).expect("found above").value;
            tables
                .chunks
                .get_mut(&entry.chunk)
                .expect("a mapped chunk is known")
                .mappings -= 1;
            tables.collect(entry.chunk);
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: usize, access: &[AccessDesc]) -> Result<()> {
        self.check_size("set_access", size)?;
        self.check_granular("set_access", &[("address", va.0)])?;
        for desc in access {
            self.check_device("set_access", desc.device)?;
        }
        let mut tables = self.memory.tables_mut();
        let starts: Vec<u64> = tables
            .mappings
            .covering(va.0, size)
            .ok_or_else(|| {
                Error::invalid(
                    "set_access",
                    format!("{size} bytes at {va} are not all mapped"),
                )
            })?
            .iter()
            .map(|(start, _)| *start)
            .collect();
        if starts.first() != Some(&va.0) {
            return Err(Error::invalid(
                "set_access",
                format!("{va} is not the start of a mapping"),
            ));
        }
        for start in starts {
            let mapping = tables.mappings.get_mut(start).expect("found above");
            let entry = &mut mapping.value;
            for desc in access {
                entry.access.insert(desc.device, desc.access);
            }
            // The host has one set of page protections for all devices: the
            // widest access any device has. Which device may do what is
            // enforced by the stream workers from the table.
            let widest = if entry.access.values().any(|a| *a == Access::ReadWrite) {
                Access::ReadWrite
            } else if entry.access.values().any(|a| *a == Access::Read) {
                Access::Read
            } else {
                Access::None
            };
            sys::protect(start as usize, mapping.size, widest)?;
        }
        Ok(())
    }

    fn create_stream(&self, device: DeviceId) -> Result<HostStream> {
        self.check_device("create_stream", device)?;
        HostStream::spawn(device, Arc::clone(&self.memory))
    }

    unsafe fn borrow_stream(&self, device: DeviceId, _handle: usize) -> Result<HostStream> {
        self.check_device("borrow_stream", device)?;
        HostStream::spawn(device, Arc::clone(&self.memory))
    }

    fn synchronize_stream(&self, stream: &HostStream) -> Result<()> {
        stream.synchronize()
    }

    fn stream_capturing(&self, stream: &HostStream) -> Result<bool> {
        Ok(stream.capturing())
    }

    fn create_event(&self, device: DeviceId) -> Result<HostEvent> {
        self.check_device("create_event", device)?;
        Ok(HostEvent::new(device, Arc::clone(&self.memory)))
    }

    fn record_event(&self, event: &HostEvent, stream: &HostStream) -> Result<()> {
        event.record(stream)
    }

    fn query_event(&self, event: &HostEvent) -> Result<EventStatus> {
        event.query()
    }

    fn synchronize_event(&self, event: &HostEvent) -> Result<()> {
        event.synchronize()
    }

    fn stream_wait_event(&self, stream: &HostStream, event: &HostEvent) -> Result<()> {
        event.make_wait(stream)
    }

    fn alloc_host(&self, size: usize) -> Result<HostBytes> {
        Ok(HostBytes::zeroed(size))
    }

    fn copy_device_to_host(
        &self,
        stream: &HostStream,
        ranges: &[HostCopy],
        dst: &mut HostBytes,
    ) -> Result<()> {
        check_host_ranges("copy_device_to_host", ranges, dst.len())?;
        self.memory.not_in_capture("copy_device_to_host")?;
        stream.copy_out(ranges, dst)
    }

    fn copy_host_to_device(
        &self,
        stream: &HostStream,
        src: &HostBytes,
        ranges: &[HostCopy],
    ) -> Result<()> {
        check_host_ranges("copy_host_to_device", ranges, src.len())?;
        self.memory.not_in_capture("copy_host_to_device")?;
        stream.copy_in(src, ranges)
    }
}

/// Mappings left behind at drop would keep memfds alive in this process
/// forever; say so, since it means an owner leaked.
impl Drop for Host {
    fn drop(&mut self) {
        let tables = self.memory.tables();
        if !tables.mappings.is_empty() || !tables.chunks.is_empty() {
            tracing::warn!(
                mappings = tables.mappings.len(),
                chunks = tables.chunks.len(),
                reservations = tables.reservations.len(),
                "host backend dropped with memory still allocated"
            );
        }
    }
}
