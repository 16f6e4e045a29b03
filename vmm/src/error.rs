//! One error type for every backend.
//!
//! A CUDA failure keeps the driver's own words (which call, which `CUresult`,
//! its name and description); a host-backend failure says which call and why.
//! Both carry an [`ErrorKind`] so that callers (and the conformance suite) can
//! match on what went wrong without caring which backend said it.

use std::fmt;

/// What went wrong, independent of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A size, alignment, address or handle the call does not accept
    /// (`CUDA_ERROR_INVALID_VALUE` and its relatives).
    InvalidArgument,
    /// The device has no physical memory left for the request.
    OutOfMemory,
    /// No such device.
    InvalidDevice,
    /// Work queued on a stream failed (an access to unmapped memory, say);
    /// reported by the next synchronising call, like CUDA's sticky errors.
    StreamFault,
    /// The driver is shutting down; harmless in `Drop` at process exit.
    Deinitialized,
    /// The CUDA driver library could not be loaded or initialised.
    DriverUnavailable,
    /// Anything else the driver reports.
    Other,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidArgument => "invalid argument",
            Self::OutOfMemory => "out of memory",
            Self::InvalidDevice => "invalid device",
            Self::StreamFault => "stream fault",
            Self::Deinitialized => "driver deinitialized",
            Self::DriverUnavailable => "driver unavailable",
            Self::Other => "driver error",
        })
    }
}

/// An error from a driver call.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver call returned something other than `CUDA_SUCCESS`.
    #[error("{call} failed with {name} ({code}): {description}")]
    Cuda {
        /// The driver entry point, e.g. `cuMemMap`.
        call: &'static str,
        /// What kind of failure it is.
        kind: ErrorKind,
        /// The numeric `CUresult`.
        code: u32,
        /// The `CUresult`'s name, from `cuGetErrorName`.
        name: String,
        /// Its description, from `cuGetErrorString`.
        description: String,
    },
    /// A call refused by vmm itself (host backend, or a check made before the
    /// driver is called).
    #[error("{call}: {kind}: {reason}")]
    Rejected {
        /// The backend call refused.
        call: &'static str,
        /// What kind of failure it is.
        kind: ErrorKind,
        /// Why it was refused.
        reason: String,
    },
}

impl Error {
    /// Backend-independent classification.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Cuda { kind, .. } | Self::Rejected { kind, .. } => *kind,
        }
    }

    /// The driver call (or trait method) that failed.
    pub fn call(&self) -> &'static str {
        match self {
            Self::Cuda { call, .. } | Self::Rejected { call, .. } => call,
        }
    }

    pub(crate) fn rejected(call: &'static str, kind: ErrorKind, reason: impl Into<String>) -> Self {
        Self::Rejected {
            call,
            kind,
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(call: &'static str, reason: impl Into<String>) -> Self {
        Self::rejected(call, ErrorKind::InvalidArgument, reason)
    }
}

/// The driver layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Logs a failure to free something in `Drop`, which must not panic. At
/// process exit the driver may already be shut down and have freed
/// everything itself: not worth a warning.
pub(crate) fn report_drop_error(what: &str, err: &Error) {
    if err.kind() == ErrorKind::Deinitialized {
        tracing::debug!(%err, "{what} after driver shutdown");
    } else {
        tracing::warn!(%err, "{what} failed in drop");
    }
}
