//! Why a call of the C layer did nothing: logged, since a C caller only
//! sees NULL or -1.

use vmpool::vmm::DeviceId;
use vmpool::{GraphPoolError, GraphPoolId, MemPoolError, MemPoolId};

/// Why a call did nothing. Logged by the C layer, which can only return
/// NULL or -1.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("device {0} does not exist")]
    NoDevice(i64),
    #[error("invalid size {0}")]
    Size(i64),
    #[error("free of {ptr:#x} on device {device}: {why}")]
    NotOurs { ptr: u64, device: u32, why: String },
    /// Refused frees past the first ones, as a count (`refusals.rs`).
    #[error(
        "{more} more refused frees on device {device} ({total} in all; the next count at {next})"
    )]
    RefusedFrees {
        device: u32,
        more: u64,
        total: u64,
        next: u64,
    },
    /// A refused free counted but not logged: a later count says it.
    #[error("a refused free, counted")]
    Unlogged,
    #[error("{ptr:#x} is not a live allocation of vmpool's on any device")]
    NotLive { ptr: u64 },
    #[error(transparent)]
    Vmpool(#[from] vmpool::Error),
    #[error("writing the allocation trace: {0}")]
    Trace(std::io::Error),
    #[error(
        "an allocation on a capturing stream while {open} graph pools are open on device {device}: \
         vmpool cannot tell which capture it belongs to (one capture at a time per device)"
    )]
    WhichCapture { device: u32, open: usize },
    #[error("memory fraction {0}: not in (0, 1]")]
    Fraction(f64),
    #[error("sleep level {0}: 1 (keep what the retention keeps) or 2 (keep nothing)")]
    SleepLevel(i64),
    #[error("graph pool {id} on device {device}: {why}")]
    GraphPool {
        device: u32,
        id: GraphPoolId,
        why: &'static str,
    },
    /// A graph pool refusal the other variants do not name.
    #[error("graph pools of device {device}: {source}")]
    GraphPools { device: u32, source: GraphPoolError },
    /// A memory pool (`torch.cuda.MemPool`) refusal.
    #[error("memory pools of device {device}: {source}")]
    MemPool { device: u32, source: MemPoolError },
    #[error("memory pool {id} on device {device}: a graph pool has that id")]
    IdOfAGraph { device: i64, id: MemPoolId },
    #[error("memory pool {id} on device {device}: it does not exist")]
    NoMemPool { device: i64, id: MemPoolId },
}

impl CallError {
    /// `err` of `device`'s graph pools, in the C layer's words.
    pub(crate) fn graph(device: DeviceId, err: GraphPoolError) -> Self {
        let device = device.0;
        let pool = |id, why| CallError::GraphPool { device, id, why };
        match err {
            GraphPoolError::AlreadyOpen(id) => pool(id, "opened twice"),
            GraphPoolError::NotOpen(id) => pool(id, "closed but not open"),
            GraphPoolError::NotInUse(id) => pool(id, "released more often than opened"),
            GraphPoolError::NoSuchPool(id) => pool(id, "it does not exist"),
            GraphPoolError::WhichCapture { open } => CallError::WhichCapture { device, open },
            GraphPoolError::Pool(err) => CallError::Vmpool(err),
            source => CallError::GraphPools { device, source },
        }
    }

    /// `err` of `device`'s memory pools, in the C layer's words.
    pub(crate) fn mem_pool(device: DeviceId, err: MemPoolError) -> Self {
        match err {
            MemPoolError::Pool(err) => CallError::Vmpool(err),
            source => CallError::MemPool {
                device: device.0,
                source,
            },
        }
    }
}
