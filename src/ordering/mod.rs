//! Stream order: vmpool's streams and events, the frees each stream has
//! pending, the guards over free space a stream may still touch, and the
//! rules by which one stream's frees go to another.
//!
//! ```text
//!   stream.rs   Stream, Event and their clocks: which stream is ordered after which
//!   frees.rs    a stream's pending frees in each pool: the same-stream hot path
//!   guards.rs   free heap ranges a stream may still touch
//!   streams.rs  a pool's table of the streams with frees in it, and its events
//! ```
//!
//! The pool reaches a stream's frees only through [`StreamShared`]'s hot
//! path methods and [`Streams`]; nothing here knows the pool's tables
//! (Note [Stream-ordered frees] in docs/DESIGN.md).

mod frees;
mod guards;
mod stream;
mod streams;

pub(crate) use frees::{Counted, Pending};
pub(crate) use guards::{Guard, Guards, StreamPos};
pub(crate) use stream::StreamShared;
pub use stream::{Event, Stream};
pub(crate) use streams::Streams;
