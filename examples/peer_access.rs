//! Peer access: a pool on device 0 made readable and writable by device 1
//! (`cudaMemPoolSetAccess`), checked at the driver (`cuMemGetAccess`) and by
//! work on device 1; then each device's own default pool.
//!
//!     cargo run --release --example peer_access [-- --backend host|cuda]
//!
//! Needs two devices: on CUDA two GPUs (nvidia-h200-x2); the host backend
//! simulates two. Only the host backend shows device 1 being refused before
//! access is granted: on a GPU that is an illegal-address fault that kills
//! the CUDA context.

use std::sync::Arc;

use anyhow::{ensure, Result};
use clap::Parser;
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Access, Backend, DeviceId, DevicePtr};
use vmpool::{Context, Pool};

mod common;

const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);
const SIZE: u64 = 64 << 20;

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
}

/// What the driver says `device` may do with each of the pool's chunks.
fn driver_view<B: Backend>(pool: &Pool<B>, device: DeviceId) -> Result<Vec<Access>> {
    pool.snapshot()
        .units
        .iter()
        .map(|u| Ok(pool.backend().get_access(DevicePtr(u.va), device)?))
        .collect()
}

fn first_word<B: TestBackend>(b: &B, s: &B::Stream, at: DevicePtr) -> vmpool::vmm::Result<u32> {
    let mut word = [0u8; 4];
    b.copy_to_host(s, at, &mut word)?;
    Ok(u32::from_ne_bytes(word))
}

fn run<B: TestBackend>(b: Arc<B>) -> Result<()> {
    ensure!(
        b.device_count()? >= 2,
        "peer access needs two devices; the {} backend has {}",
        b.name(),
        b.device_count()?
    );
    let ctx = Context::new(Arc::clone(&b))?;
    let pool = ctx.default_pool(D0)?;
    let (s0, s1) = (b.create_stream(D0)?, b.create_stream(D1)?);
    let a = pool.allocate(SIZE)?;
    b.fill_u32(&s0, a.ptr(), (SIZE / 4) as usize, 0x600D)?;
    b.synchronize_stream(&s0)?;
    println!("pool on device 0, {} MiB at {}", SIZE >> 20, a.ptr());
    println!(
        "before: device 1 has {:?}; driver says {:?}",
        pool.access(D1)?,
        driver_view(&pool, D1)?
    );
    if b.name() == "host" {
        let probe = b.create_stream(D1)?;
        match first_word(&*b, &probe, a.ptr()) {
            Err(e) => println!("before: a copy on device 1 is refused: {e}"),
            Ok(w) => anyhow::bail!("device 1 read {w:#x} without access"),
        }
    }

    pool.set_access(D1, Access::ReadWrite)?;
    println!(
        "after set_access: device 1 has {:?}; driver says {:?}",
        pool.access(D1)?,
        driver_view(&pool, D1)?
    );
    println!("device 1 reads {:#x}", first_word(&*b, &s1, a.ptr())?);
    b.fill_u32(&s1, a.ptr(), (SIZE / 4) as usize, 0xBEEF)?;
    b.synchronize_stream(&s1)?;
    let seen = first_word(&*b, &s0, a.ptr().byte_add(SIZE as usize - 4))?;
    println!("device 1 wrote 0xbeef; device 0 reads {seen:#x}");
    ensure!(seen == 0xBEEF, "device 0 does not see device 1's write");

    // Memory mapped later gets the pool's access list too.
    let later = pool.allocate(SIZE)?;
    println!(
        "grown afterwards: driver says {:?} for device 1",
        driver_view(&pool, D1)?
    );
    b.fill_u32(&s1, later.ptr(), 1, 7)?;
    b.synchronize_stream(&s1)?;
    pool.free(a)?;
    pool.free(later)?;
    pool.trim_to(0)?;

    // Per-device pools: each allocation lives on its own device.
    for device in [D0, D1] {
        let before = b.mem_info(device)?.free;
        let own = ctx.default_pool(device)?.allocate(SIZE)?;
        let after = b.mem_info(device)?.free;
        println!(
            "default pool of {device}: allocation on {}, {} MiB less free there",
            own.device(),
            (before.saturating_sub(after)) >> 20
        );
        ctx.default_pool(device)?.free(own)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    common::init_tracing();
    match common::open(Args::parse().backend)? {
        Some(cuda) => run(cuda),
        None => run(Host::new(HostConfig {
            devices: 2,
            ..HostConfig::default()
        })?),
    }
}
