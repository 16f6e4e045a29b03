//! The host backend's test work (the `testing` feature): fills, copies back
//! and delays run by the stream workers, and graph captures that refuse what
//! the driver refuses during one (see [`HostStream::set_capturing`]).

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use super::{sys, Host, HostStream, Memory};
use crate::testing::TestBackend;
use crate::{Access, DeviceId, DevicePtr, Error, Result};

/// Test work queued on a stream, run by its worker in order with the rest.
pub(super) enum Work {
    Fill {
        dst: DevicePtr,
        count: usize,
        value: u32,
    },
    Copy {
        src: DevicePtr,
        len: usize,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
    Delay(Duration),
}

impl Work {
    /// Runs on the worker of a stream of `device`. A stream already faulted
    /// skips the work (a copy gets the fault as its answer); a failure
    /// faults the stream.
    pub(super) fn run(self, device: DeviceId, memory: &Memory, fault: &mut Option<Error>) {
        if let Some(err) = fault {
            if let Work::Copy { reply, .. } = self {
                let _ = reply.send(Err(err.clone()));
            }
            return;
        }
        match self {
            Work::Fill { dst, count, value } => {
                if let Err(err) = memory.fill(device, dst, count, value) {
                    *fault = Some(err);
                }
            }
            Work::Copy { src, len, reply } => {
                let result = memory.read_bytes(device, src, len);
                if let Err(err) = &result {
                    *fault = Some(err.clone());
                }
                // The caller may have gone (it never does: it blocks on this).
                let _ = reply.send(result);
            }
            Work::Delay(duration) => thread::sleep(duration),
        }
    }
}

impl Memory {
    fn fill(&self, device: DeviceId, dst: DevicePtr, count: usize, value: u32) -> Result<()> {
        let len = count
            .checked_mul(4)
            .ok_or_else(|| Error::invalid("fill_u32", "count overflows"))?;
        // SAFETY: `with_access` checked that the range is mapped read-write
        // for this device and holds the read lock while the closure runs, so
        // it stays mapped; `fill_u32` (the trait method) checked alignment.
        self.with_access(device, dst, len, Access::ReadWrite, || unsafe {
            sys::fill_u32(dst.0 as usize, count, value)
        })
    }

    fn read_bytes(&self, device: DeviceId, src: DevicePtr, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0; len];
        // SAFETY: as in `fill`, for read access; `copy_to_host` checked the
        // alignment.
        self.with_access(device, src, len, Access::Read, || unsafe {
            sys::read(src.0 as usize, &mut out)
        })?;
        Ok(out)
    }
}

impl TestBackend for Host {
    fn fill_u32(
        &self,
        stream: &HostStream,
        dst: DevicePtr,
        count: usize,
        value: u32,
    ) -> Result<()> {
        if !dst.is_aligned(4) {
            return Err(Error::invalid(
                "fill_u32",
                format!("{dst} is not 4-byte aligned"),
            ));
        }
        stream.fill(dst, count, value)
    }

    fn copy_to_host(&self, stream: &HostStream, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        if !src.is_aligned(4) {
            return Err(Error::invalid(
                "copy_to_host",
                format!("{src} is not 4-byte aligned (the host backend reads whole words)"),
            ));
        }
        stream.copy(src, dst)
    }

    fn begin_capture(&self, stream: &HostStream) -> Result<()> {
        stream.set_capturing("begin_capture", true)
    }

    fn end_capture(&self, stream: &HostStream) -> Result<()> {
        stream.set_capturing("end_capture", false)
    }

    fn delay(&self, stream: &HostStream, duration: Duration) -> Result<()> {
        stream.delay(duration)
    }
}
