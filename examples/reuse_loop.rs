//! The stream-ordered allocator's in-order reuse loop: allocate, launch work,
//! free, synchronize, 100 times on one stream. With the release threshold at
//! 0 the pool gives its memory back at every synchronize and goes to the
//! driver again on the next allocation; with a high threshold it keeps the
//! memory and never calls the driver after the first iteration.
//!
//!     cargo run --release --example reuse_loop [-- --backend host|cuda]

use std::sync::Arc;

use anyhow::Result;
use clap::Parser;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Context, PoolAttribute, PoolStats};

mod common;

const DEV: DeviceId = DeviceId(0);

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
}

/// Driver calls a pool made between two snapshots of its statistics.
fn driver_calls(a: &PoolStats, b: &PoolStats) -> u64 {
    let total = |s: &PoolStats| s.chunks_created + s.chunks_released + s.maps + s.unmaps;
    total(b) - total(a)
}

fn run<B: TestBackend>(b: Arc<B>) -> Result<()> {
    let ctx = Context::new(b)?;
    let pool = ctx.default_pool(DEV)?;
    let stream = ctx.create_stream(DEV)?;
    for threshold in [0, u64::MAX] {
        pool.set_attribute(PoolAttribute::ReleaseThreshold, threshold)?;
        let mut calls = Vec::new();
        for i in 0..100u32 {
            let before = pool.stats();
            let a = ctx.alloc_async(64 << 20, &stream)?;
            // The "kernel": fill the buffer on the stream.
            ctx.backend()
                .fill_u32(stream.raw(), a.ptr(), (a.size() / 4) as usize, i)?;
            ctx.free_async(a, &stream)?;
            ctx.synchronize_stream(&stream)?;
            calls.push(driver_calls(&before, &pool.stats()));
        }
        let name = if threshold == 0 { "0" } else { "max" };
        println!(
            "release threshold {name:>3}: driver calls per iteration: first {}, then {:?}..., {} in iterations 2-100",
            calls[0],
            &calls[1..6],
            calls[1..].iter().sum::<u64>()
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    on_backend!(Args::parse().backend, run)
}
