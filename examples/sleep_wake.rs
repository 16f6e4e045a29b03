//! Sleep and wake, timed: a pool that keeps its bytes (`Retention::Keep`)
//! is filled with `GIB` GiB of live data, then put to sleep and woken
//! `--cycles` times, for each size given. The first cycle pins the host
//! buffer (unless `--reserve-host` pinned it beforehand, timed apart); the
//! later ones reuse it, as a trainer and a rollout engine taking turns do.
//! Side by side, in the same run, the plain page-locked copy bandwidth
//! between the device and host memory (the faster of two copies each way;
//! the first, into a buffer just pinned, is printed too), and each sleep's
//! and wake's share of it: the bar is 80 % both ways.
//! Every kept byte is checked after each wake (sampled words of every
//! buffer, and a checksum of one whole buffer), and the device's free
//! memory is read before and after each sleep.
//!
//! `--prepare` runs `Pool::prepare_sleep` before the first cycle, timed
//! apart: the pool's granules joined into whole chunks for the sleeps.
//!
//!     cargo run --release --example sleep_wake [-- --backend host|cuda] [--gib 1,10,40] [--cycles 3] [--reserve-host] [--prepare]

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use clap::Parser;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{DeviceId, HostBuffer, HostCopy};
use vmpool::{Allocation, Context, Pool, PoolProps, Retention, SleepLevel, Stream};

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
    /// Sleep-wake cycles per size: the first pins the host buffer, the
    /// others reuse it.
    #[arg(long, default_value_t = 3)]
    cycles: u32,
    /// Pin the host buffer before the first cycle (`Pool::reserve_host`),
    /// timed apart: then no cycle pins.
    #[arg(long)]
    reserve_host: bool,
    /// Grow the pool by whole `chunk_size` chunks (`chunk_divisor: None`)
    /// instead of the default granules of a small pool: fewer chunks for
    /// the first sleep to release.
    #[arg(long)]
    whole_chunks: bool,
    /// Get the pool ready to sleep before the first cycle
    /// (`Pool::prepare_sleep`: a sleep and a wake that join an
    /// allocation's units into whole chunks), timed apart.
    #[arg(long)]
    prepare: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    on_backend!(args.backend, run, &args)
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// The bar: a sleep and a wake each at this share of the copy bandwidth.
const BAR: f64 = 0.8;

/// What one size's cycles came to, for the summary.
struct Outcome {
    gib: f64,
    /// (sleep, wake) shares of the copy bandwidth, cycle by cycle, and
    /// whether the cycle pinned host memory.
    cycles: Vec<(f64, f64, bool)>,
}

fn run<B: TestBackend>(b: Arc<B>, args: &Args) -> Result<()> {
    let on_host = b.name() == "host";
    let ctx = Context::new(Arc::clone(&b))?;
    let stream = ctx.create_stream(DEV)?;
    let mut outcomes = Vec::new();
    for &gib in &args.gib {
        let bytes = if on_host {
            (gib * GIB / 100).next_multiple_of(BUFFER)
        } else {
            gib * GIB
        };
        let mut props = PoolProps::new(DEV);
        if args.whole_chunks {
            props.chunk_divisor = None;
        }
        let pool = ctx.create_pool(&props)?;
        pool.set_retention(Retention::Keep);
        let mut live: Vec<(Allocation, u32)> = Vec::new();
        for i in 0..bytes / BUFFER {
            let a = pool.allocate(BUFFER)?;
            let word = 0x5EE9_0000 ^ i as u32;
            b.fill_u32(stream.raw(), a.ptr(), (BUFFER / 4) as usize, word)?;
            live.push((a, word));
        }
        ctx.synchronize_stream(&stream)?;
        let Reference {
            pin,
            copy_out,
            copy_in,
            first_out,
            first_in,
        } = reference(&b, &stream, &live, bytes)?;
        println!();
        println!(
            "{:.2} GiB kept, in {} buffers, {} chunks: copy out {:.1} GB/s, copy in {:.1} GB/s \
             (page-locked buffer, the faster of two each way); pinning it took {pin:.3} s ({:.1} GB/s); \
             the first copies, into and out of the buffer just pinned: out {:.1} GB/s, in {:.1} GB/s",
            bytes as f64 / GIB as f64,
            live.len(),
            pool.stats().units,
            gbps(bytes, copy_out),
            gbps(bytes, copy_in),
            gbps(bytes, pin),
            gbps(bytes, first_out),
            gbps(bytes, first_in),
        );
        if args.reserve_host {
            let t = Instant::now();
            pool.reserve_host(bytes)?;
            let s = t.elapsed().as_secs_f64();
            println!(
                "reserve_host: {:.2} GiB pinned ahead in {s:.3} s ({:.1} GB/s)",
                pool.stats().host_bytes as f64 / GIB as f64,
                gbps(bytes, s)
            );
        }
        if args.prepare {
            let t = Instant::now();
            let report = pool.prepare_sleep(&stream)?;
            let s = t.elapsed().as_secs_f64();
            check(&b, &stream, &live)?;
            println!(
                "prepare_sleep: {} chunks -> {} in {s:.3} s ({:.2} GiB kept, {:.2} GiB pinned); bytes intact",
                report.chunks_before,
                report.chunks_after,
                report.sleep.kept_bytes as f64 / GIB as f64,
                report.sleep.pinned_bytes as f64 / GIB as f64,
            );
        }
        println!(
            "{:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>8}",
            "cycle",
            "pinned",
            "sleep",
            "sleep",
            "of copy",
            "wake",
            "wake",
            "of copy",
            "batches",
            "80 %",
            "freed by",
            "check"
        );
        println!(
            "{:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>8}",
            "", "GiB", "s", "GB/s", "out", "s", "GB/s", "in", "out/in", "both", "sleep", ""
        );
        let mut outcome = Outcome {
            gib: bytes as f64 / GIB as f64,
            cycles: Vec::new(),
        };
        for cycle in 1..=args.cycles {
            let c = one_cycle(&b, &pool, &stream, &live, bytes)?;
            let sleep_share = copy_out / c.sleep_s;
            let wake_share = copy_in / c.wake_s;
            let meets = sleep_share >= BAR && wake_share >= BAR;
            println!(
                "{:>6} {:>8.2} {:>9.3} {:>9.1} {:>8.0}% {:>9.3} {:>9.1} {:>8.0}% {:>9} {:>7} {:>8.1}% {:>8}",
                cycle,
                c.pinned as f64 / GIB as f64,
                c.sleep_s,
                gbps(bytes, c.sleep_s),
                100.0 * sleep_share,
                c.wake_s,
                gbps(bytes, c.wake_s),
                100.0 * wake_share,
                format!("{}/{}", c.batches.0, c.batches.1),
                if meets { "yes" } else { "no" },
                100.0 * c.freed as f64 / c.reserved as f64,
                "intact"
            );
            outcome.cycles.push((sleep_share, wake_share, c.pinned > 0));
        }
        outcomes.push(outcome);
        for (a, _) in live {
            pool.free(a)?;
        }
        pool.trim_to(0)?;
        pool.release_host()?;
    }
    println!();
    println!(
        "sleep: wait, copy out into the pool's page-locked buffer (pinned by the first sleep, kept \
         for the next), releasing each batch's chunks once copied; wake: create and map a batch, \
         copy it back while the next is mapped. \"of copy\": the sleep's (wake's) GB/s over the \
         copy out (in) GB/s of the same run. \"freed by sleep\": the device's free memory gained, \
         over the pool's reserved bytes."
    );
    for o in &outcomes {
        let (pinning, steady): (Vec<_>, Vec<_>) = o.cycles.iter().partition(|c| c.2);
        let worst = |cycles: &[&(f64, f64, bool)]| {
            cycles
                .iter()
                .fold((f64::INFINITY, f64::INFINITY), |(s, w), c| {
                    (s.min(c.0), w.min(c.1))
                })
        };
        let verdict = |(s, w): (f64, f64)| {
            format!(
                "sleep {:.0} %, wake {:.0} % of the copy bandwidth: {}",
                100.0 * s,
                100.0 * w,
                if s >= BAR && w >= BAR {
                    "meets 80 %"
                } else {
                    "BELOW 80 %"
                }
            )
        };
        if !pinning.is_empty() {
            println!(
                "{:>6.2} GiB, cycle that pins: {}",
                o.gib,
                verdict(worst(&pinning))
            );
        }
        if !steady.is_empty() {
            println!(
                "{:>6.2} GiB, {} cycles on the kept buffer, the worst: {}",
                o.gib,
                steady.len(),
                verdict(worst(&steady))
            );
        }
    }
    Ok(())
}

/// The reference copies of one size, in seconds.
struct Reference {
    /// Pinning the page-locked buffer.
    pin: f64,
    /// The faster of two copies out, and of two in.
    copy_out: f64,
    copy_in: f64,
    /// The first copy out, into the buffer just pinned, and the first in:
    /// what a sleep into a buffer just reserved pays, if a fresh buffer
    /// costs its first copy more.
    first_out: f64,
    first_in: f64,
}

/// The reference: the same bytes through one page-locked buffer, which is
/// freed again before the pool's cycles.
fn reference<B: TestBackend>(
    b: &Arc<B>,
    stream: &Stream<B>,
    live: &[(Allocation, u32)],
    bytes: u64,
) -> Result<Reference> {
    let ranges: Vec<HostCopy> = live
        .iter()
        .enumerate()
        .map(|(i, (a, _))| HostCopy {
            device: a.ptr(),
            host_offset: i * BUFFER as usize,
            len: BUFFER as usize,
        })
        .collect();
    let t = Instant::now();
    let mut host = b.alloc_host(bytes as usize)?;
    let pin = t.elapsed().as_secs_f64();
    let (mut outs, mut ins) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let t = Instant::now();
        b.copy_device_to_host(stream.raw(), &ranges, &mut host)?;
        outs.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b.copy_host_to_device(stream.raw(), &host, &ranges)?;
        ins.push(t.elapsed().as_secs_f64());
    }
    let sum: u64 = host.as_slice()[..BUFFER as usize]
        .chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .fold(0, u64::wrapping_add);
    ensure!(sum != 0, "the reference copy read nothing");
    let fastest = |times: &[f64]| times.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(Reference {
        pin,
        copy_out: fastest(&outs),
        copy_in: fastest(&ins),
        first_out: outs[0],
        first_in: ins[0],
    })
}

/// One sleep and wake, timed and checked.
struct Cycle {
    sleep_s: f64,
    wake_s: f64,
    pinned: u64,
    /// Batches of the sleep and of the wake.
    batches: (u64, u64),
    freed: u64,
    reserved: u64,
}

/// Every buffer of `live`, sampled at its start, middle and end, holds
/// its word.
fn check<B: TestBackend>(b: &Arc<B>, stream: &Stream<B>, live: &[(Allocation, u32)]) -> Result<()> {
    for (a, word) in live {
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
    Ok(())
}

fn one_cycle<B: TestBackend>(
    b: &Arc<B>,
    pool: &Pool<B>,
    stream: &Stream<B>,
    live: &[(Allocation, u32)],
    bytes: u64,
) -> Result<Cycle> {
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
    let slept = pool.sleep(SleepLevel::KeepTagged, stream)?;
    let sleep_s = t.elapsed().as_secs_f64();
    let freed = b.mem_info(DEV)?.free as u64 - free_before;
    ensure!(
        slept.kept_bytes == bytes,
        "kept {} of {bytes}",
        slept.kept_bytes
    );
    let t = Instant::now();
    let woken = pool.wake(stream)?;
    let wake_s = t.elapsed().as_secs_f64();
    ensure!(woken.restored_bytes == bytes);
    check(b, stream, live)?;
    ensure!(
        checksum(&live[live.len() / 2].0)? == before_sum,
        "checksum differs"
    );
    Ok(Cycle {
        sleep_s,
        wake_s,
        pinned: slept.pinned_bytes,
        batches: (slept.batches, woken.batches),
        freed,
        reserved,
    })
}
