//! vmpool: a defragmenting, stream-ordered GPU memory allocator.
//!
//! The allocator is safe Rust over the driver layer [`vmm`], where all
//! `unsafe` code lives; it is being built. Today this crate re-exports
//! [`vmm`].
#![deny(unsafe_code)]

pub use vmm;
