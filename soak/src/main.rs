//! A bounded-time soak: several threads, each with its own stream, allocate
//! in stream order with trace-like sizes, fill every allocation with a
//! pattern of its own, check it before freeing it (sometimes on another
//! stream, ordered by an event), synchronize now and then (so pools trim),
//! and at the end show that memory is back to where it started.
//!
//!     vmpool-soak [--backend auto|cuda|host] [--seconds N] [--threads T]
//!                 [--live-per-thread BYTES] [--json]
//!
//! It says how far it is on stderr every few seconds.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{self, DeviceId};
use vmpool::{Allocation, Context, PoolAttribute, Stream};
use vmpool_tools::{BackendKind, Bytes};

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;
/// Bytes checked at each end of an allocation, and words in between.
const CHECK_EDGE: u64 = 64 << 10;
const CHECK_WORDS: usize = 16;
/// How often the soak says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

#[derive(Parser)]
#[command(
    name = "vmpool-soak",
    version,
    about = "Soak vmpool's stream-ordered allocator for a bounded time"
)]
struct Args {
    /// Where to run: `auto` is the GPU if one can be opened, else the host
    /// backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendKind,
    /// How long the threads allocate, fill, check and free, in seconds (at
    /// least 1); then what is live is checked and freed.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    /// Threads, each with its own stream, all on the device's default pool
    /// (at least 1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Live bytes each thread may hold at most, with a unit or in bytes:
    /// 512MiB, 1G.
    #[arg(long, value_name = "BYTES", default_value_t = Bytes(512 * MIB))]
    live_per_thread: Bytes,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Default)]
struct Totals {
    allocations: u64,
    frees: u64,
    cross_stream_frees: u64,
    synchronizations: u64,
    bytes_allocated: u64,
    bytes_checked: u64,
}

/// Sizes shaped like the training traces: mostly small, some tens of MiB,
/// a few hundreds.
fn trace_like_size(rng: &mut SmallRng) -> u64 {
    let log2 = match rng.random_range(0..100) {
        0..60 => rng.random_range(8.0..20.0),
        60..95 => rng.random_range(20.0..26.0),
        _ => rng.random_range(26.0..28.5),
    };
    (2f64.powf(log2) as u64).max(4)
}

fn fill<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, value: u32) -> Result<()> {
    Ok(b.fill_u32(s.raw(), a.ptr(), (a.size() / 4) as usize, value)?)
}

/// Checks both ends and some words in between; returns the bytes read.
fn check<B: TestBackend>(
    b: &B,
    s: &Stream<B>,
    a: &Allocation,
    value: u32,
    rng: &mut SmallRng,
) -> Result<u64> {
    let words = a.size() / 4;
    let edge = (CHECK_EDGE / 4).min(words);
    let mut spans = vec![(0, edge), (words - edge, edge)];
    spans.extend((0..CHECK_WORDS).map(|_| (rng.random_range(0..words), 1)));
    let mut read = 0;
    for (word, count) in spans {
        let mut bytes = vec![0u8; count as usize * 4];
        b.copy_to_host(s.raw(), a.ptr().byte_add(word as usize * 4), &mut bytes)?;
        ensure!(
            bytes == value.to_ne_bytes().repeat(count as usize),
            "allocation at {} lost its pattern {value:#x} near word {word}",
            a.ptr()
        );
        read += bytes.len() as u64;
    }
    Ok(read)
}

/// What the threads have done so far, for the progress lines.
#[derive(Default)]
struct Progress {
    allocations: AtomicU64,
    bytes_checked: AtomicU64,
}

fn worker<B: TestBackend>(
    ctx: &Context<B>,
    streams: &[Stream<B>],
    me: usize,
    args: &Args,
    deadline: Instant,
    progress: &Progress,
) -> Result<Totals> {
    let b = ctx.backend();
    let s = &streams[me];
    let mut rng = SmallRng::seed_from_u64(0x50A4 + me as u64);
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    let mut live_bytes = 0;
    let mut t = Totals::default();
    let mut serial = 0u32;
    while Instant::now() < deadline {
        let size = trace_like_size(&mut rng);
        if live_bytes + size <= args.live_per_thread.0 && rng.random_range(0..100) < 55 {
            let a = ctx.alloc_async(size, s)?;
            serial += 1;
            let value = ((me as u32) << 24) | (serial & 0xFF_FFFF);
            fill(&**b, s, &a, value)?;
            live_bytes += a.size();
            t.allocations += 1;
            t.bytes_allocated += a.size();
            progress.allocations.fetch_add(1, Ordering::Relaxed);
            live.push((a, value));
        } else if !live.is_empty() {
            let (a, value) = live.swap_remove(rng.random_range(0..live.len()));
            let read = check(&**b, s, &a, value, &mut rng)?;
            t.bytes_checked += read;
            progress.bytes_checked.fetch_add(read, Ordering::Relaxed);
            live_bytes -= a.size();
            t.frees += 1;
            if rng.random_range(0..100) < 20 && streams.len() > 1 {
                // Free on another stream, ordered after this one's use.
                let other = &streams[(me + 1) % streams.len()];
                let e = ctx.create_event(DEV)?;
                ctx.record_event(&e, s)?;
                ctx.stream_wait_event(other, &e)?;
                ctx.free_async(a, other)?;
                t.cross_stream_frees += 1;
            } else {
                ctx.free_async(a, s)?;
            }
        }
        if rng.random_range(0..1000) < 5 {
            ctx.synchronize_stream(s)?;
            t.synchronizations += 1;
        }
    }
    for (a, value) in live {
        t.bytes_checked += check(&**b, s, &a, value, &mut rng)?;
        ctx.free_async(a, s)?;
        t.frees += 1;
    }
    Ok(t)
}

fn soak<B: TestBackend>(backend: Arc<B>, args: &Args) -> Result<serde_json::Value> {
    let baseline_free = backend.mem_info(DEV)?.free;
    let ctx = Context::new(backend)?;
    let pool = ctx.default_pool(DEV)?;
    // Keep some memory across synchronizations, trim the rest.
    pool.set_attribute(PoolAttribute::ReleaseThreshold, 256 * MIB)?;
    let streams: Vec<Stream<B>> = (0..args.threads)
        .map(|_| ctx.create_stream(DEV))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.seconds);
    let progress = Progress::default();
    let results: Vec<Result<Totals>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams.len())
            .map(|me| {
                let (ctx, streams, progress) = (&ctx, &streams, &progress);
                scope.spawn(move || worker(ctx, streams, me, args, deadline, progress))
            })
            .collect();
        report_progress(&handles, &progress, started, args.seconds);
        handles
            .into_iter()
            .map(|h| h.join().expect("soak thread panicked"))
            .collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let mut total = Totals::default();
    for r in results {
        let t = r?;
        total.allocations += t.allocations;
        total.frees += t.frees;
        total.cross_stream_frees += t.cross_stream_frees;
        total.synchronizations += t.synchronizations;
        total.bytes_allocated += t.bytes_allocated;
        total.bytes_checked += t.bytes_checked;
    }
    ctx.synchronize_device(DEV)?;
    let peak_reserved = pool.attribute(PoolAttribute::ReservedMemHigh);
    let peak_used = pool.attribute(PoolAttribute::UsedMemHigh);
    pool.audit().map_err(anyhow::Error::msg)?;
    pool.trim_to(0)?;
    let st = pool.stats();
    ensure!(
        st.used_bytes == 0 && st.pending_bytes == 0,
        "memory still in use after the soak: {st:?}"
    );
    ensure!(
        st.reserved_bytes == 0,
        "memory still held after trim_to(0): {st:?}"
    );
    ensure!(
        st.chunks_created == st.chunks_released,
        "chunks not all released: {st:?}"
    );
    let end_free = ctx.backend().mem_info(DEV)?.free;
    Ok(serde_json::json!({
        "backend": ctx.backend().name(),
        "seconds": elapsed,
        "threads": args.threads,
        "allocations": total.allocations,
        "frees": total.frees,
        "cross_stream_frees": total.cross_stream_frees,
        "synchronizations": total.synchronizations,
        "bytes_allocated": total.bytes_allocated,
        "bytes_checked": total.bytes_checked,
        "peak_used_bytes": peak_used,
        "peak_reserved_bytes": peak_reserved,
        "chunks_created": st.chunks_created,
        "remaps": st.remaps,
        "device_free_before": baseline_free,
        "device_free_after": end_free,
    }))
}

/// Says on stderr how far the soak is, every [`PROGRESS_EVERY`], until
/// every thread has finished.
fn report_progress<T>(
    threads: &[std::thread::ScopedJoinHandle<'_, T>],
    progress: &Progress,
    started: Instant,
    seconds: u64,
) {
    let mut next = started + PROGRESS_EVERY;
    while !threads.iter().all(|t| t.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        if Instant::now() < next {
            continue;
        }
        next += PROGRESS_EVERY;
        eprintln!(
            "vmpool-soak: {:.0} s of {seconds}: {} allocations, {} MiB checked",
            started.elapsed().as_secs_f64(),
            progress.allocations.load(Ordering::Relaxed),
            progress.bytes_checked.load(Ordering::Relaxed) / MIB
        );
    }
}

fn main() -> ExitCode {
    vmpool_tools::init_tracing();
    let args = Args::parse();
    vmpool_tools::run("vmpool-soak", || soak_main(&args))
}

fn soak_main(args: &Args) -> Result<()> {
    let report = match vmpool_tools::open(args.backend)? {
        None => soak(
            vmm::host::Host::new(vmm::host::HostConfig::default())?,
            args,
        )?,
        Some(cuda) => soak(cuda, args)?,
    };
    if args.json {
        println!("{report}");
    } else {
        for (k, v) in report.as_object().expect("an object") {
            println!("{k:<22} {v}");
        }
        println!("memory back to its baseline: used 0, reserved 0, every chunk released");
    }
    Ok(())
}
