#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod allocation;
mod arena;
mod buffer;
mod capture;
mod context;
#[cfg(feature = "cudarc")]
mod cudarc;
mod error;
mod exports;
mod graph_pools;
mod growth;
mod heap;
pub mod ipc;
mod layout;
mod mem_pools;
mod ordering;
mod plan;
mod pool;
mod props;
mod space;
mod stats;
mod steps;
mod sync;
pub mod trace;
mod va;

pub use allocation::Allocation;
pub use buffer::Buffer;
pub use capture::GraphCapture;
pub use context::Context;
pub use error::{AuditError, Error, Result};
pub use graph_pools::{
    Closed, GraphAllocation, GraphPoolError, GraphPoolId, GraphPools, GraphPoolsStats,
};
pub use mem_pools::{
    MemPoolAllocation, MemPoolError, MemPoolId, MemPools, MemPoolsStats, Release, Released,
};
pub use ordering::{Event, Stream};
pub use pool::{Pool, PrepareReport, Retention, SleepLevel, SleepReport, WakeReport};
pub use props::{
    parse_bytes, parse_chunk_divisor, parse_fresh_start, parse_handle_type, Defragment, FreshStart,
    HandleType, PoolProps, DEFAULT_CHUNK_DIVISOR, DEFAULT_CHUNK_SIZE, DEFAULT_GRANULE_GROWTH_BELOW,
    SMALL_LIMIT,
};
pub use stats::{PoolAttribute, PoolSnapshot, PoolStats, Slack, UnitView};
pub use steps::StepCounters;
pub use vmm;
