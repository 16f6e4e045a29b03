//! Host-side cost of stream-ordered allocation: vmpool side by side with
//! CUDA's own allocators (on the GPU).
//!
//!     vmpool-bench [--backend auto|cuda|host] [--json]
//!
//! - pair: allocate + free of one size on one stream, memory reused in
//!   stream order (256 B, 1 MiB, 64 MiB). vmpool versus cuMemAllocAsync /
//!   cuMemFreeAsync (default pool, release threshold max) and cuMemAlloc /
//!   cuMemFree.
//! - cross-stream pair: allocate on stream A, free on stream B, so every
//!   allocation reuses memory another stream freed.
//! - pair in a laid-out step: the same pair, a step marked every 100
//!   pairs (`Pool::mark_step`), so that the pool serves it from a step
//!   layout (the mark's own cost included).
//! - threads: 8 threads, each with its own stream, doing pairs on one pool;
//!   throughput against one thread.
//!
//! Every figure is the median over batches of the mean time per pair in a
//! batch, after a warm-up batch.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use vmpool::vmm::{self, Backend, DeviceId};
use vmpool::{Context, PoolAttribute, PoolProps};

use vmpool_tools::BackendKind;

const DEV: DeviceId = DeviceId(0);
const SIZES: [u64; 3] = [256, 1 << 20, 64 << 20];
const BATCHES: usize = 31;
/// Pairs per marked step in the laid-out pair.
const STEP_PAIRS: u64 = 100;

#[derive(Parser)]
#[command(
    name = "vmpool-bench",
    version,
    about = "Time stream-ordered alloc + free pairs: vmpool and CUDA's allocators"
)]
struct Args {
    /// Where to run: `auto` is the GPU if one can be opened (then CUDA's
    /// allocators are timed too), else the host backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendKind,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Median over batches of ns per call of `pair`, `per_batch` calls a batch.
fn median_ns(per_batch: usize, mut pair: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut batch = || -> Result<f64> {
        let start = Instant::now();
        for _ in 0..per_batch {
            pair()?;
        }
        Ok(start.elapsed().as_nanos() as f64 / per_batch as f64)
    };
    batch()?; // warm-up: first growth, first events
    let mut means: Vec<f64> = (0..BATCHES).map(|_| batch()).collect::<Result<_>>()?;
    means.sort_by(f64::total_cmp);
    Ok(means[BATCHES / 2])
}

#[derive(Default)]
struct Figures {
    pair_ns: BTreeMap<u64, f64>,
    cuda_async_pair_ns: BTreeMap<u64, f64>,
    cuda_malloc_pair_ns: BTreeMap<u64, f64>,
    cross_stream_pair_ns: f64,
    stepped_pair_ns: f64,
    /// Pairs per second, by thread count.
    pairs_per_s: BTreeMap<usize, f64>,
}

fn bench_vmpool<B: Backend>(backend: Arc<B>, figures: &mut Figures) -> Result<()> {
    let ctx = Context::new(backend)?;
    let pool = ctx.create_pool(&PoolProps::new(DEV))?;
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
    let s = ctx.create_stream(DEV)?;
    for size in SIZES {
        let ns = median_ns(10_000, || {
            let a = pool.allocate_async(black_box(size), &s)?;
            pool.free_async(a, &s)?;
            Ok(())
        })?;
        figures.pair_ns.insert(size, ns);
    }
    let other = ctx.create_stream(DEV)?;
    figures.cross_stream_pair_ns = median_ns(1_000, || {
        let a = pool.allocate_async(1 << 20, &s)?;
        pool.free_async(a, &other)?;
        Ok(())
    })?;
    let stepped = ctx.create_pool(&PoolProps::new(DEV))?;
    stepped.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
    stepped.mark_step()?;
    let mut pairs = 0;
    figures.stepped_pair_ns = median_ns(10_000, || {
        let a = stepped.allocate_async(black_box(1 << 20), &s)?;
        stepped.free_async(a, &s)?;
        pairs += 1;
        if pairs % STEP_PAIRS == 0 {
            stepped.mark_step()?;
        }
        Ok(())
    })?;
    anyhow::ensure!(
        stepped.step_counters().planned > 0,
        "the marked steps were not laid out"
    );
    ctx.synchronize_device(DEV)?;
    for threads in [1, 2, 8] {
        let per_thread = 200_000;
        let barrier = Barrier::new(threads + 1);
        let mut elapsed = 0.0;
        std::thread::scope(|scope| -> Result<()> {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let (ctx, pool, barrier) = (&ctx, &pool, &barrier);
                    scope.spawn(move || -> Result<()> {
                        let s = ctx.create_stream(DEV)?;
                        barrier.wait();
                        for _ in 0..per_thread {
                            let a = pool.allocate_async(black_box(1 << 20), &s)?;
                            pool.free_async(a, &s)?;
                        }
                        ctx.synchronize_stream(&s)?;
                        Ok(())
                    })
                })
                .collect();
            barrier.wait();
            let start = Instant::now();
            for w in workers {
                w.join().expect("bench thread panicked")?;
            }
            elapsed = start.elapsed().as_secs_f64();
            Ok(())
        })?;
        figures
            .pairs_per_s
            .insert(threads, (threads * per_thread) as f64 / elapsed);
    }
    Ok(())
}

fn bench_cuda_peers(cuda: &Arc<vmm::cuda::Cuda>, figures: &mut Figures) -> Result<()> {
    let pool = vmm::cuda::peers::CudaAsyncPool::new(cuda, DEV)?;
    let malloc = vmm::cuda::peers::CudaMalloc::new(cuda, DEV)?;
    let s = cuda.create_stream(DEV)?;
    for size in SIZES {
        let ns = median_ns(10_000, || {
            let a = pool.alloc(black_box(size as usize), &s)?;
            pool.free(a, &s)?;
            Ok(())
        })?;
        figures.cuda_async_pair_ns.insert(size, ns);
        let ns = median_ns(20, || {
            let a = malloc.alloc(black_box(size as usize))?;
            malloc.free(a)?;
            Ok(())
        })?;
        figures.cuda_malloc_pair_ns.insert(size, ns);
    }
    cuda.synchronize_stream(&s)?;
    Ok(())
}

fn main() -> ExitCode {
    vmpool_tools::init_tracing();
    let args = Args::parse();
    vmpool_tools::run("vmpool-bench", || bench_main(&args))
}

fn bench_main(args: &Args) -> Result<()> {
    let mut figures = Figures::default();
    let backend = match vmpool_tools::open(args.backend)? {
        None => {
            bench_vmpool(
                vmm::host::Host::new(vmm::host::HostConfig::default())?,
                &mut figures,
            )?;
            "host"
        }
        Some(cuda) => {
            bench_vmpool(Arc::clone(&cuda), &mut figures)?;
            bench_cuda_peers(&cuda, &mut figures)?;
            "cuda"
        }
    };
    if args.json {
        let keyed = |m: &BTreeMap<u64, f64>| -> serde_json::Map<String, serde_json::Value> {
            m.iter()
                .map(|(k, v)| (k.to_string(), (*v).into()))
                .collect()
        };
        println!(
            "{}",
            serde_json::json!({
                "backend": backend,
                "pair_ns": keyed(&figures.pair_ns),
                "cuda_async_pair_ns": keyed(&figures.cuda_async_pair_ns),
                "cuda_malloc_pair_ns": keyed(&figures.cuda_malloc_pair_ns),
                "cross_stream_pair_ns": figures.cross_stream_pair_ns,
                "stepped_pair_ns": figures.stepped_pair_ns,
                "pairs_per_s": figures.pairs_per_s.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect::<serde_json::Map<_, _>>(),
            })
        );
        return Ok(());
    }
    println!("backend: {backend}; median ns per alloc + free pair, one stream");
    println!(
        "{:>10}  {:>10}  {:>16}  {:>12}",
        "size", "vmpool", "cuMemAllocAsync", "cuMemAlloc"
    );
    for size in SIZES {
        let peer =
            |m: &BTreeMap<u64, f64>| m.get(&size).map_or("-".to_string(), |v| format!("{v:.0}"));
        println!(
            "{size:>10}  {:>10.1}  {:>16}  {:>12}",
            figures.pair_ns[&size],
            peer(&figures.cuda_async_pair_ns),
            peer(&figures.cuda_malloc_pair_ns)
        );
    }
    println!(
        "cross-stream pair (alloc on A, free on B), 1 MiB: {:.0} ns",
        figures.cross_stream_pair_ns
    );
    println!(
        "pair in a laid-out step (a step marked every {STEP_PAIRS} pairs), 1 MiB: {:.0} ns",
        figures.stepped_pair_ns
    );
    let one = figures.pairs_per_s[&1];
    let eight = figures.pairs_per_s[&8];
    println!(
        "threads, own stream each, 1 MiB pairs: 1 thread {:.2} M pairs/s, 8 threads {:.2} M pairs/s ({:.2}x)",
        one / 1e6,
        eight / 1e6,
        eight / one
    );
    Ok(())
}
