//! Streams shared with cudarc (feature `cudarc`): a cudarc stream adopted
//! as a vmm stream, which keeps it alive.
//!
//! cudarc is a dependency here without a CUDA version or linking feature:
//! the program that uses both crates picks those on its own cudarc
//! dependency, and vmm never calls into cudarc's driver bindings.

use std::ffi::c_void;
use std::sync::Arc;

use super::{sys, Cuda, CudaStream};
use crate::{DeviceId, Error, ErrorKind, Result};

impl Cuda {
    /// Wraps a cudarc stream as a vmm stream of the same device, so that
    /// vmm orders its work on it. The returned stream holds `stream` (it
    /// stays alive while vmm uses it) and never destroys the driver's
    /// stream itself. Refused unless the stream lives in its device's
    /// primary context, the one vmm uses (cudarc's `CudaContext::new`
    /// retains that one).
    pub fn adopt_cudarc_stream(
        &self,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<(DeviceId, CudaStream)> {
        const CALL: &str = "adopt_cudarc_stream";
        let ordinal = stream.context().ordinal();
        let device = DeviceId(u32::try_from(ordinal).map_err(|_| {
            Error::invalid(CALL, format!("device ordinal {ordinal} is out of range"))
        })?);
        let context = self.device(CALL, device)?;
        if !std::ptr::eq(stream.context().cu_ctx().cast::<c_void>(), context.raw()) {
            return Err(Error::rejected(
                CALL,
                ErrorKind::InvalidArgument,
                format!("the stream's context is not device {ordinal}'s primary context"),
            ));
        }
        Ok((
            device,
            CudaStream {
                stream: stream.cu_stream() as usize as sys::CUstream,
                context: Arc::clone(context),
                owned: false,
                cudarc: Some(Arc::clone(stream)),
            },
        ))
    }
}

impl CudaStream {
    /// The cudarc stream this stream was adopted from
    /// ([`Cuda::adopt_cudarc_stream`]); `None` for one vmm made or borrowed.
    pub fn cudarc(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        self.cudarc.as_ref()
    }
}
