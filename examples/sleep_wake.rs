//! Sleep and wake, timed: a pool that keeps its bytes (`Retention::Keep`)
//! is filled with `GIB` GiB of live data, put to sleep and woken again, for
//! each size given. Side by side, in the same run, the plain page-locked
//! copy bandwidth between the device and host memory, which sleep (copy
//! out) and wake (copy back) should come close to. Every kept byte is
//! checked after waking (sampled words of every buffer, and a checksum of
//! one whole buffer), and the device's free memory is read before and
//! after the sleep.
//!
//!     cargo run --release --example sleep_wake [-- --backend host|cuda] [--gib 1,10,40]

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use clap::Parser;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{DeviceId, HostBuffer, HostCopy};
use vmpool::{Allocation, Context, PoolProps, Retention, SleepLevel};

mod common;

const DEV: DeviceId = DeviceId(0);
const GIB: u64 = 1 << 30;
/// Live data is made of buffers of this size.
const BUFFER: u64 = 256 << 20;

#[derive(Parser)]
#[command(about = "Time sleep and wake of a pool that keeps its bytes")]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
    /// Sizes of live data to keep, in GiB (the host backend takes a
    /// hundredth of each, in whole buffers).
    #[arg(long, value_delimiter = ',', default_value = "1,10,40")]
    gib: Vec<u64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    on_backend!(args.backend, run, &args.gib)
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn run<B: TestBackend>(b: Arc<B>, sizes: &[u64]) -> Result<()> {
    let on_host = b.name() == "host";
    let ctx = Context::new(Arc::clone(&b))?;
    let stream = ctx.create_stream(DEV)?;
    println!(
        "{:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "live", "copy out", "copy in", "sleep", "sleep", "wake", "wake", "freed by", "check"
    );
    println!(
        "{:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "GiB", "GB/s", "GB/s", "s", "GB/s", "s", "GB/s", "sleep", ""
    );
    for &gib in sizes {
        let bytes = if on_host {
            (gib * GIB / 100).next_multiple_of(BUFFER)
        } else {
            gib * GIB
        };
        let pool = ctx.create_pool(&PoolProps::new(DEV))?;
        pool.set_retention(Retention::Keep);
        let mut live: Vec<(Allocation, u32)> = Vec::new();
        for i in 0..bytes / BUFFER {
            let a = pool.allocate(BUFFER)?;
            let word = 0x5EE9_0000 ^ i as u32;
            b.fill_u32(stream.raw(), a.ptr(), (BUFFER / 4) as usize, word)?;
            live.push((a, word));
        }
        ctx.synchronize_stream(&stream)?;
        // The reference: the same bytes through one page-locked buffer.
        let ranges: Vec<HostCopy> = live
            .iter()
            .enumerate()
            .map(|(i, (a, _))| HostCopy {
                device: a.ptr(),
                host_offset: i * BUFFER as usize,
                len: BUFFER as usize,
            })
            .collect();
        let (copy_out, copy_in) = {
            let mut host = b.alloc_host(bytes as usize)?;
            let t = Instant::now();
            b.copy_device_to_host(stream.raw(), &ranges, &mut host)?;
            let out = t.elapsed().as_secs_f64();
            let t = Instant::now();
            b.copy_host_to_device(stream.raw(), &host, &ranges)?;
            let back = t.elapsed().as_secs_f64();
            let sum: u64 = host.as_slice()[..BUFFER as usize]
                .chunks_exact(8)
                .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
                .fold(0, u64::wrapping_add);
            ensure!(sum != 0, "the reference copy read nothing");
            (out, back)
        };
        let checksum = |a: &Allocation| -> Result<u64> {
            let mut bytes = vec![0u8; BUFFER as usize];
            b.copy_to_host(stream.raw(), a.ptr(), &mut bytes)?;
            Ok(bytes
                .chunks_exact(8)
                .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
                .fold(0, u64::wrapping_add))
        };
        let before_sum = checksum(&live[live.len() / 2].0)?;
        let free_before = b.mem_info(DEV)?.free as u64;
        let reserved = pool.stats().reserved_bytes;
        let t = Instant::now();
        let slept = pool.sleep(SleepLevel::KeepTagged, &stream)?;
        let sleep_s = t.elapsed().as_secs_f64();
        let freed = b.mem_info(DEV)?.free as u64 - free_before;
        ensure!(
            slept.kept_bytes == bytes,
            "kept {} of {bytes}",
            slept.kept_bytes
        );
        let t = Instant::now();
        let woken = pool.wake(&stream)?;
        let wake_s = t.elapsed().as_secs_f64();
        ensure!(woken.restored_bytes == bytes);
        // Every buffer, sampled at its start, middle and end; one whole.
        for (a, word) in &live {
            for at in [0, BUFFER / 2, BUFFER - 4096] {
                let mut sample = [0u8; 4096];
                b.copy_to_host(stream.raw(), a.ptr().byte_add(at as usize), &mut sample)?;
                ensure!(
                    sample
                        .chunks_exact(4)
                        .all(|w| u32::from_ne_bytes(w.try_into().expect("4 bytes")) == *word),
                    "the bytes at {} came back changed",
                    a.ptr()
                );
            }
        }
        ensure!(
            checksum(&live[live.len() / 2].0)? == before_sum,
            "checksum differs"
        );
        println!(
            "{:>8.2} {:>10.1} {:>10.1} {:>10.3} {:>10.1} {:>10.3} {:>10.1} {:>11.1}% {:>12}",
            bytes as f64 / GIB as f64,
            gbps(bytes, copy_out),
            gbps(bytes, copy_in),
            sleep_s,
            gbps(bytes, sleep_s),
            wake_s,
            gbps(bytes, wake_s),
            100.0 * freed as f64 / reserved as f64,
            "intact"
        );
        for (a, _) in live {
            pool.free(a)?;
        }
        pool.trim_to(0)?;
    }
    println!(
        "sleep: wait, copy out, unmap and release every chunk; wake: create, map, copy back. \
         \"freed by sleep\": the device's free memory gained, over the pool's reserved bytes."
    );
    Ok(())
}
