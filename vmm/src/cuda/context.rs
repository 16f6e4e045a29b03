//! One device's primary context and how it is bound to threads.

use std::ffi::c_int;
#[cfg(feature = "testing")]
use std::sync::Mutex;

use super::sys;

use super::result;
use crate::error::report_drop_error;
use crate::Result;

/// A retained primary context, released when the last owner goes: the
/// backend and each of its streams and events hold one, so the context
/// outlives every handle made in it.
#[derive(Debug)]
pub(super) struct DeviceContext {
    ordinal: c_int,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: usize,
    /// The test work's delay kernel, loaded on the first `delay` on one of
    /// this device's streams.
    #[cfg(feature = "testing")]
    pub(super) delay: Mutex<Option<super::testing::DelayKernel>>,
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
            #[cfg(feature = "testing")]
            delay: Mutex::new(None),
        };
        this.granularity = result::mem_get_allocation_granularity(ordinal)?;
        Ok(this)
    }

    pub(super) fn ordinal(&self) -> c_int {
        self.ordinal
    }

    /// The driver's handle of the context.
    #[cfg(feature = "cudarc")]
    pub(super) fn raw(&self) -> sys::CUcontext {
        self.ctx
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
        #[cfg(feature = "testing")]
        self.unload_delay_kernel();
        // SAFETY: balances the retain in `open`. This is the last owner:
        // every stream and event made in the context held one, so they are
        // all destroyed and nothing uses the context after this.
        if let Err(err) = unsafe { result::device_primary_ctx_release(self.device) } {
            report_drop_error("releasing a primary context", &err);
        }
    }
}
