//! The CUDA backend's test work (the `testing` feature): fills and copies
//! are the driver's own, a delay is a kernel that spins, and a graph
//! capture is the driver's, in global mode.

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::PoisonError;
use std::time::Duration;

use super::sys;

use super::context::DeviceContext;
use super::{result, Cuda, CudaStream};
use crate::error::report_drop_error;
use crate::testing::TestBackend;
use crate::{DevicePtr, Error, Result};

/// Spins one thread until `ns` nanoseconds of the GPU's global timer have
/// passed. PTX rather than a cubin, so that the driver compiles it for
/// whatever GPU it meets; sm_70 and PTX 7.0 are far below anything that has
/// the virtual-memory API's features vmm relies on.
const DELAY_PTX: &CStr = c"
.version 7.0
.target sm_70
.address_size 64

.visible .entry vmm_delay(
    .param .u64 vmm_delay_param_ns
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [vmm_delay_param_ns];
    mov.u64 %rd2, %globaltimer;
$L_spin:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L_spin;
    ret;
}
";
const DELAY_ENTRY: &CStr = c"vmm_delay";

/// The delay kernel, loaded into one context.
#[derive(Debug)]
pub(super) struct DelayKernel {
    module: sys::CUmodule,
    function: sys::CUfunction,
}

impl DeviceContext {
    /// The delay kernel in this context, loaded on first use.
    pub(super) fn delay_function(&self) -> Result<sys::CUfunction> {
        let mut delay = self.delay.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(kernel) = &*delay {
            return Ok(kernel.function);
        }
        let _bound = self.bind()?;
        let module = result::module_load_data(DELAY_PTX)?;
        // SAFETY: `module` was just loaded and is not unloaded before this.
        match unsafe { result::module_get_function(module, DELAY_ENTRY) } {
            Ok(function) => {
                *delay = Some(DelayKernel { module, function });
                Ok(function)
            }
            Err(err) => {
                // SAFETY: `module` is live, its context is current (bound
                // above on this thread) and nothing has used it.
                if let Err(unload) = unsafe { result::module_unload(module) } {
                    tracing::warn!(err = %unload, "unloading the delay module failed");
                }
                Err(err)
            }
        }
    }

    /// Unloads the delay kernel, if it was loaded; on the context's drop.
    pub(super) fn unload_delay_kernel(&mut self) {
        let delay = self
            .delay
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(kernel) = delay {
            // Streams destroyed just before may still be running the kernel.
            let unloaded = self.bind().and_then(|_bound| {
                result::ctx_synchronize()?;
                // SAFETY: the module is live and its context current; the
                // synchronisation above finished all work in the context, and
                // no stream is left to queue more (each holds an owner of
                // `self`).
                unsafe { result::module_unload(kernel.module) }
            });
            if let Err(err) = unloaded {
                report_drop_error("unloading the delay module", &err);
            }
        }
    }
}

impl TestBackend for Cuda {
    fn fill_u32(
        &self,
        stream: &CudaStream,
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
        let len = count
            .checked_mul(4)
            .ok_or_else(|| Error::invalid("fill_u32", "count overflows"))?;
        let _mapped = self.mapped("fill_u32", dst, len.max(1))?;
        let _bound = stream.context.bind()?;
        // SAFETY: the stream is live until dropped; the range lies in vmm's
        // mappings, held so while the work is queued, and the caller
        // guarantees (trait contract) that it is not unmapped before the
        // work has run.
        unsafe { result::memset_d32_async(dst.0, value, count, stream.stream) }
    }

    fn copy_to_host(&self, stream: &CudaStream, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let _bound = stream.context.bind()?;
        {
            let _mapped = self.mapped("copy_to_host", src, dst.len().max(1))?;
            if !dst.is_empty() {
                // SAFETY: the stream is live until dropped; the source lies
                // in vmm's mappings, held so while the copy is queued and
                // not unmapped before it has run (trait contract); `dst` is
                // borrowed for this whole call and not touched until the
                // synchronisation below, after which the copy is complete
                // (or the context has faulted and runs no more work).
                unsafe { result::memcpy_dtoh_async(dst, src.0, stream.stream) }?;
            }
        }
        // SAFETY: a `CudaStream` holds a live stream until it is dropped.
        unsafe { result::stream_synchronize(stream.stream) }
    }

    fn begin_capture(&self, stream: &CudaStream) -> Result<()> {
        let _bound = stream.context.bind()?;
        // SAFETY: a `CudaStream` holds a live stream until it is dropped;
        // the driver refuses the legacy default stream.
        unsafe { result::stream_begin_capture(stream.stream) }
    }

    fn end_capture(&self, stream: &CudaStream) -> Result<()> {
        let _bound = stream.context.bind()?;
        // SAFETY: a live stream (as above); the driver refuses one that is
        // not capturing, or whose capture another thread began.
        unsafe { result::stream_end_capture(stream.stream) }
    }

    fn delay(&self, stream: &CudaStream, duration: Duration) -> Result<()> {
        let function = stream.context.delay_function()?;
        let _bound = stream.context.bind()?;
        let mut ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let mut params = [ptr::from_mut(&mut ns).cast::<c_void>()];
        // SAFETY: `function` is vmm_delay, loaded in the stream's own context
        // (kept alive by the stream); its one parameter is a .u64 and
        // `params` holds one pointer to a u64, which the driver copies
        // before returning. The kernel touches no memory.
        unsafe { result::launch_single_thread(function, stream.stream, &mut params) }
    }
}
