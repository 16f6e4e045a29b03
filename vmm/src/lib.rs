//! vmm: vmpool's driver layer.
//!
//! ```text
//!   vmpool (the allocator: safe Rust, address arithmetic and bookkeeping)
//!      │ sees only the Backend trait and the owners in `memory`
//!   ───┼────────────────────────────────────────────────────────────────
//!   vmm│
//!      ├── backend.rs  the trait: devices, VA ranges, chunks, mappings,
//!      │               access (set and query), chunk export / import as
//!      │               POSIX descriptors, streams and events
//!      ├── memory.rs   Reservation / Chunk / Mapping: teardown order by ownership
//!      ├── ranges.rs   the reservation and mapping tables both backends
//!      │               check every call against
//!      ├── cuda/       CUDA driver API, libcuda opened at run time
//!      ├── host/       the same model on Linux: memfd chunks mmap'd into a
//!      │               PROT_NONE reservation, streams as worker threads
//!      └── testing/    (feature `testing`) work for tests to queue on a
//!                      stream, a backend wrapper that injects faults, and
//!                      a stream kept behind the calls (lag.rs)
//! ```
//!
//! Every `unsafe` block of the project is in this crate, and each carries a
//! `// SAFETY:` comment.

#![warn(missing_docs)]

mod backend;
pub mod cuda;
mod error;
pub mod host;
pub mod memory;
mod ranges;
#[cfg(feature = "testing")]
pub mod testing;
mod types;

pub use backend::Backend;
pub use error::{Error, ErrorKind, Result};
pub use types::{
    Access, AccessDesc, ChunkHandle, DeviceId, DevicePtr, EventStatus, HostBuffer, HostCopy,
    MemInfo,
};
