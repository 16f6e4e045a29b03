//! vmpool: a defragmenting, stream-ordered GPU memory allocator.
//!
//! ```text
//!   Context        per device: pools (default, current, explicit), streams, events
//!     Pool         one VA reservation, chunks mapped into it, a heap per arena
//!       allocate / free                 synchronous
//!       allocate_async / free_async     stream-ordered (Context::alloc_async, free_async)
//!     Stream       a backend stream, plus what vmpool knows of its order and
//!                  the frees it has pending
//!     set_access / access           peer access for other devices
//!   ipc            sharing a pool with another process: export a handle and
//!                  allocations, import them there; leases keep the memory
//!   trace          the shared trace format: read (vmpool-replay), written by
//!                  pools that record (PoolProps::record, VMPOOL_RECORD)
//!   GraphCapture   a CUDA graph capture under way (Context::graph_capture):
//!                  pools then make no call the driver refuses during one
//! ```
//!
//! The allocator is safe Rust: it does address arithmetic and bookkeeping
//! over the driver layer [`vmm`], where all `unsafe` code lives. An
//! allocator whose bookkeeping cannot corrupt memory is easier to trust.
#![deny(unsafe_code)]

mod capture;
mod context;
mod error;
mod heap;
pub mod ipc;
mod plan;
mod pool;
mod stream;
pub mod trace;

pub use capture::GraphCapture;
pub use context::Context;
pub use error::{Error, Result};
pub use pool::{
    parse_chunk_divisor, Allocation, HandleType, Pool, PoolAttribute, PoolProps, PoolSnapshot,
    PoolStats, UnitView, DEFAULT_CHUNK_DIVISOR, DEFAULT_CHUNK_SIZE, DEFAULT_GRANULE_GROWTH_BELOW,
    SMALL_LIMIT,
};
pub use stream::{Event, Stream};
pub use vmm;
