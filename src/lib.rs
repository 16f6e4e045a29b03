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

mod allocation;
mod arena;
mod capture;
mod context;
mod error;
mod exports;
mod growth;
mod heap;
pub mod ipc;
mod ordering;
mod plan;
mod pool;
mod props;
mod space;
mod stats;
mod sync;
pub mod trace;

pub use allocation::Allocation;
pub use capture::GraphCapture;
pub use context::Context;
pub use error::{Error, Result};
pub use ordering::{Event, Stream};
pub use pool::Pool;
pub use props::{
    parse_chunk_divisor, HandleType, PoolProps, DEFAULT_CHUNK_DIVISOR, DEFAULT_CHUNK_SIZE,
    DEFAULT_GRANULE_GROWTH_BELOW, SMALL_LIMIT,
};
pub use stats::{PoolAttribute, PoolSnapshot, PoolStats, UnitView};
pub use vmm;
