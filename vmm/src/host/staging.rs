//! Copies between device memory and host buffers on the host backend:
//! what a pool that sleeps uses to keep its bytes (see
//! [`Backend::copy_device_to_host`]).

use super::{sys, HostStream, Memory};
use crate::{Access, DeviceId, DevicePtr, Error, ErrorKind, HostBuffer, HostCopy, Result};

/// Host memory of the host backend: plain bytes.
#[derive(Debug)]
pub struct HostBytes(Vec<u8>);

impl HostBytes {
    pub(super) fn zeroed(size: usize) -> Self {
        Self(vec![0; size])
    }
}

impl HostBuffer for HostBytes {
    fn as_slice(&self) -> &[u8] {
        &self.0
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl Memory {
    /// Runs `f` on [start, start + len) after checking, under the read lock,
    /// that `device` may access all of it as `need` requires.
    pub(super) fn with_access<T>(
        &self,
        device: DeviceId,
        start: DevicePtr,
        len: usize,
        need: Access,
        f: impl FnOnce() -> T,
    ) -> Result<T> {
        let tables = self.tables();
        let covering = tables
            .mappings
            .covering(start.0, len.max(1))
            .ok_or_else(|| {
                Error::rejected(
                    "stream access",
                    ErrorKind::StreamFault,
                    format!("{len} bytes at {start} are not all mapped"),
                )
            })?;
        for (va, m) in covering {
            let has = m.value.access.get(&device).copied().unwrap_or(Access::None);
            let ok = match need {
                Access::ReadWrite => has == Access::ReadWrite,
                Access::Read => has != Access::None,
                Access::None => true,
            };
            if !ok {
                return Err(Error::rejected(
                    "stream access",
                    ErrorKind::StreamFault,
                    format!(
                        "{device} has {has:?} access to the mapping at {va:#x}, needs {need:?}"
                    ),
                ));
            }
        }
        Ok(f())
    }

    /// Reads `dst.len()` bytes at `src`, which `device` may read.
    pub(super) fn read_into(&self, device: DeviceId, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        check_aligned("copy_device_to_host", src)?;
        // SAFETY: `with_access` checked that the range is mapped readable
        // for this device and holds the read lock while the closure runs, so
        // it stays mapped; the address is word aligned (checked above).
        self.with_access(device, src, dst.len(), Access::Read, || unsafe {
            sys::read(src.0 as usize, dst)
        })
    }

    /// Writes `src` at `dst`, which `device` may write.
    pub(super) fn write_from(&self, device: DeviceId, dst: DevicePtr, src: &[u8]) -> Result<()> {
        check_aligned("copy_host_to_device", dst)?;
        // SAFETY: as in `read_into`, for read-write access.
        self.with_access(device, dst, src.len(), Access::ReadWrite, || unsafe {
            sys::write(dst.0 as usize, src)
        })
    }
}

/// The host backend moves whole words (atomically: see `sys::read`).
fn check_aligned(call: &'static str, at: DevicePtr) -> Result<()> {
    if at.is_aligned(4) {
        Ok(())
    } else {
        Err(Error::invalid(
            call,
            format!("{at} is not 4-byte aligned (the host backend moves whole words)"),
        ))
    }
}

impl HostStream {
    /// Runs the copies once the work queued so far has run: the call
    /// blocks until they are done, as the CUDA backend's does, so running
    /// them on this thread after a synchronisation is the same order.
    pub(super) fn copy_out(&self, ranges: &[HostCopy], dst: &mut HostBytes) -> Result<()> {
        self.synchronize()?;
        for r in ranges {
            let out = &mut dst.0[r.host_offset..r.host_offset + r.len];
            self.memory().read_into(self.device(), r.device, out)?;
        }
        Ok(())
    }

    pub(super) fn copy_in(&self, src: &HostBytes, ranges: &[HostCopy]) -> Result<()> {
        self.synchronize()?;
        for r in ranges {
            let from = &src.0[r.host_offset..r.host_offset + r.len];
            self.memory().write_from(self.device(), r.device, from)?;
        }
        Ok(())
    }
}
