//! The stream-ordered allocator's library example: a library function
//! allocates scratch memory, launches work on the caller's stream and frees
//! it, all in function scope, with no synchronization. The caller's stream
//! order makes it safe, and the pool reuses the memory on every call without
//! going back to the driver.
//!
//!     cargo run --release --example library_scope [-- --backend host|cuda]

use std::sync::Arc;

use anyhow::{ensure, Result};
use clap::Parser;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Context, Stream};

mod common;

const DEV: DeviceId = DeviceId(0);

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
}

/// The library: it knows nothing of the caller's memory management.
fn library_func<B: TestBackend>(ctx: &Context<B>, stream: &Stream<B>, n: u32) -> Result<()> {
    let scratch = ctx.alloc_async(16 << 20, stream)?;
    ctx.backend().fill_u32(
        stream.raw(),
        scratch.ptr(),
        (scratch.size() / 4) as usize,
        n,
    )?;
    ctx.free_async(scratch, stream)?;
    Ok(())
}

fn run<B: TestBackend>(b: Arc<B>) -> Result<()> {
    let ctx = Context::new(b)?;
    let stream = ctx.create_stream(DEV)?;
    let mine = ctx.alloc_async(1 << 20, &stream)?;
    ctx.backend()
        .fill_u32(stream.raw(), mine.ptr(), (mine.size() / 4) as usize, 7)?;
    for n in 0..1000 {
        library_func(&ctx, &stream, n)?;
    }
    let mut word = [0u8; 4];
    ctx.backend()
        .copy_to_host(stream.raw(), mine.ptr(), &mut word)?;
    ensure!(u32::from_ne_bytes(word) == 7, "the caller's data changed");
    let st = ctx.current_pool(DEV)?.stats();
    println!(
        "1000 library calls on the caller's stream, no synchronization: {} chunk(s) created, {} reuses of the stream's own frees, {} grows",
        st.chunks_created, st.same_stream_reuses, st.grows
    );
    ctx.free_async(mine, &stream)?;
    ctx.synchronize_stream(&stream)?;
    Ok(())
}

fn main() -> Result<()> {
    on_backend!(Args::parse().backend, run)
}
