//! One device's primary context, how it is bound to threads, and the delay
//! kernel loaded into it.

use std::ffi::{c_int, CStr};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys;

use super::result;
use crate::error::report_drop_error;
use crate::Result;

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

#[derive(Debug)]
struct DelayKernel {
    module: sys::CUmodule,
    function: sys::CUfunction,
}

/// A retained primary context, released when the last owner goes: the
/// backend and each of its streams and events hold one, so the context
/// outlives every handle made in it.
#[derive(Debug)]
pub(super) struct DeviceContext {
    ordinal: c_int,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: usize,
    /// Loaded on the first `delay` on one of this device's streams.
    delay: Mutex<Option<DelayKernel>>,
}

// SAFETY: the raw pointers are driver handles (context, module, function),
// which the CUDA driver API lets any thread use; the only mutable state is
// behind the mutex.
unsafe impl Send for DeviceContext {}
// SAFETY: as for `Send`: no method mutates through `&self` except under the
// mutex, and the driver synchronises its own use of the handles.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    /// Retains the primary context of the device of ordinal `ordinal`.
    pub(super) fn open(ordinal: c_int) -> Result<Self> {
        let device = result::device_get(ordinal)?;
        let ctx = result::device_primary_ctx_retain(device)?;
        // From here on, an early return drops `this`, which releases `ctx`.
        let mut this = Self {
            ordinal,
            device,
            ctx,
            granularity: 0,
            delay: Mutex::new(None),
        };
        this.granularity = result::mem_get_allocation_granularity(ordinal)?;
        Ok(this)
    }

    pub(super) fn ordinal(&self) -> c_int {
        self.ordinal
    }

    /// The driver's handle of the device.
    pub(super) fn device(&self) -> sys::CUdevice {
        self.device
    }

    /// Minimum granularity of pinned memory on this device.
    pub(super) fn granularity(&self) -> usize {
        self.granularity
    }

    /// Makes this context current on the calling thread until the guard
    /// goes, which puts back the context that was current before. vmm runs
    /// inside programs that bind contexts of their own (PyTorch, through the
    /// runtime API, binds the current device's primary context), and must
    /// leave each thread bound as it found it.
    pub(super) fn bind(&self) -> Result<Bound> {
        let previous = result::ctx_get_current()?;
        if previous == self.ctx {
            return Ok(Bound { previous: None });
        }
        // SAFETY: `ctx` stays retained until `self` is dropped, and the guard
        // returned, which cannot outlive this call's caller's use of `self`,
        // unbinds it again.
        unsafe { result::ctx_set_current(self.ctx) }?;
        Ok(Bound {
            previous: Some(previous),
        })
    }

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
}

/// A context made current by [`DeviceContext::bind`]; dropping it binds the
/// one that was current before. Not `Send`: it belongs to its thread.
#[must_use = "the context stays bound only while the guard lives"]
pub(super) struct Bound {
    /// The context to put back; `None` when `bind` changed nothing.
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was current on this thread when the guard
            // was made, so whoever bound it keeps it alive for this thread;
            // null (nothing was bound) is accepted and unbinds.
            if let Err(err) = unsafe { result::ctx_set_current(previous) } {
                report_drop_error("restoring the caller's current context", &err);
            }
        }
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
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
        // SAFETY: balances the retain in `open`. This is the last owner:
        // every stream and event made in the context held one, so they are
        // all destroyed and nothing uses the context after this.
        if let Err(err) = unsafe { result::device_primary_ctx_release(self.device) } {
            report_drop_error("releasing a primary context", &err);
        }
    }
}
