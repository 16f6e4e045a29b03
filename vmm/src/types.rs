//! Small value types shared by the trait and its backends.

use std::fmt;

/// A device ordinal, as the driver numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.0)
    }
}

/// A virtual address in the device address space (a `CUdeviceptr`).
///
/// On the host backend it is a real address in this process; either way it is
/// only dereferenced by the backend, never by the allocator.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` further on. Panics on overflow of the 64-bit
    /// address space, which no valid range can reach.
    pub fn byte_add(self, bytes: usize) -> Self {
        Self(
            self.0
                .checked_add(bytes as u64)
                .expect("device address overflow"),
        )
    }

    /// Whether the address is a multiple of `alignment`.
    pub fn is_aligned(self, alignment: usize) -> bool {
        alignment != 0 && self.0 % alignment as u64 == 0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// The backend's name for one physical allocation (a `CUmemGenericAllocationHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkHandle(pub u64);

/// Free and total physical memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Free bytes on the device.
    pub free: usize,
    /// Total bytes on the device.
    pub total: usize,
}

/// What a device may do with a mapped range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// No access: touching the memory faults.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

/// One entry of a set-access call: `device` gets `access`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessDesc {
    /// The device given access.
    pub device: DeviceId,
    /// What it may do.
    pub access: Access,
}

impl AccessDesc {
    /// Read-write access for `device`.
    pub fn read_write(device: DeviceId) -> Self {
        Self {
            device,
            access: Access::ReadWrite,
        }
    }
}

/// The two non-error outcomes of an event query; errors come back as `Err`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventStatus {
    /// Every piece of work captured by the last record has finished.
    Complete,
    /// Some of it is still queued or running.
    Pending,
}

/// One range of a copy between device memory and a host buffer: `len`
/// bytes at `device`, and at `host_offset` in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCopy {
    /// Where the range starts in device memory.
    pub device: DevicePtr,
    /// Where it starts in the host buffer.
    pub host_offset: usize,
    /// Its length in bytes.
    pub len: usize,
}

/// Host memory the device copies to and from (page-locked on CUDA, where
/// that is what lets a copy run at the bus's speed).
pub trait HostBuffer: Send + Sync {
    /// The buffer's bytes.
    fn as_slice(&self) -> &[u8];
    /// The buffer's bytes, to write.
    fn as_mut_slice(&mut self) -> &mut [u8];

    /// Its length in bytes.
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether it holds no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
