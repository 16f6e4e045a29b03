//! Replays an allocation trace and reports footprint and speed.
//!
//!     vmpool-replay [--backend auto|cuda|host] [--allocator vmpool|cuda-async|cuda-malloc]
//!                   [--chunk-size BYTES] [--chunk-divisor N|off] [--stream-ordered]
//!                   [--defragment off|units|whole-regions] [--fresh-start when-emptied|never]
//!                   [--passes N] [--mark-passes] [--hold BYTES] [--json] TRACE
//!
//! Footprint is peak reserved bytes over peak live bytes (1.0 is the
//! floor). Speed is the wall time of the replay loop over the number of
//! operations; parsing is done before the clock starts. Peak reserved is
//! each allocator's own figure: vmpool's and the CUDA pool's reserved-high
//! attribute; for plain cuMemAlloc, the device's used memory (from
//! cuMemGetInfo after each allocation, outside the timed calls) over what
//! it was before the replay.
//!
//! `--passes N` replays the trace N times on the same allocator, freeing
//! what is still live at the end of each pass, as a long-running program
//! repeats its work: it shows whether the footprint stays where the first
//! pass left it. `--mark-passes` marks a step as each pass begins
//! (`Pool::mark_step`), as a program that marks its steps would: from the
//! third pass on, the pool serves the trace from a step layout. `--hold
//! BYTES` keeps one allocation of that size live from before the first
//! pass to after the last, as a program that keeps something (a dataset,
//! a cache) while its models come and go: the pool is then never empty
//! between passes, and does not start afresh there (Note [Starting
//! afresh]); `--fresh-start never` keeps each pass's layout for the next
//! with nothing held. Between passes, vmpool's replay waits for a step
//! layout being planned apart (`Pool::await_step_plan`), so that the pass
//! it comes at is the same on any machine.

use std::fs::File;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::{self, Backend, DeviceId};
use vmpool::{Context, FreshStart, PoolAttribute, PoolProps};

use vmpool_tools::{BackendKind, Bytes, DefragmentArg};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum AllocatorKind {
    /// A vmpool pool, on the backend chosen.
    Vmpool,
    /// CUDA's stream-ordered pool (cuMemAllocAsync), release threshold max.
    CudaAsync,
    /// Plain cuMemAlloc / cuMemFree.
    CudaMalloc,
}

/// `--chunk-divisor`: a divisor, or `None` for `off`.
#[derive(Clone, Copy)]
struct Divisor(Option<u64>);

impl std::fmt::Display for Divisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{d}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_divisor(s: &str) -> Result<Divisor, String> {
    vmpool::parse_chunk_divisor(s).map(Divisor)
}

#[derive(Parser)]
#[command(
    name = "vmpool-replay",
    version,
    about = "Replay an allocation trace; report footprint and speed"
)]
struct Args {
    /// Where to replay: `auto` is the GPU if one can be opened, else the
    /// host backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendKind,
    /// Which allocator replays the trace; the CUDA ones need a GPU.
    #[arg(long, value_enum, default_value = "vmpool")]
    allocator: AllocatorKind,
    /// Largest growth chunk, with a unit or in bytes: 32MiB, 2G, 2097152
    /// (default: 32MiB, vmpool::DEFAULT_CHUNK_SIZE).
    #[arg(long, value_name = "BYTES")]
    chunk_size: Option<Bytes>,
    /// Growth chunks of at most the pool's reserved bytes over N
    /// (`PoolProps::chunk_divisor`), or `off`: every growth uses the
    /// largest chunk.
    #[arg(long, value_name = "N|off", value_parser = parse_divisor, default_value_t = Divisor(Some(vmpool::DEFAULT_CHUNK_DIVISOR)))]
    chunk_divisor: Divisor,
    /// With a divisor, growth chunks of one granule while the pool holds
    /// fewer bytes than this (`PoolProps::granule_growth_below`), with a
    /// unit or in bytes: 2G, 512MiB, 0.
    #[arg(long, value_name = "BYTES", default_value_t = Bytes(vmpool::DEFAULT_GRANULE_GROWTH_BELOW))]
    granule_growth_below: Bytes,
    /// vmpool only: the address space the pool reserves
    /// (`PoolProps::va_size`), with a unit or in bytes: 512G, 2T (default:
    /// four times the device's memory; on the host backend the device
    /// holds four times the trace's peak).
    #[arg(long, value_name = "BYTES")]
    va_size: Option<Bytes>,
    /// vmpool only: replay through `allocate_async` / `free_async` on one
    /// stream, as PyTorch calls it, instead of `allocate` / `free`.
    #[arg(long)]
    stream_ordered: bool,
    /// vmpool only: which unused chunks growth may move
    /// (`PoolProps::defragment`): none (`off`: growth creates new ones),
    /// any free unit (`units`), or only units of regions with no live byte
    /// (`whole-regions`).
    #[arg(long, value_enum, default_value = "units")]
    defragment: DefragmentArg,
    /// vmpool only: what the pool does once the replay has emptied it
    /// (`PoolProps::fresh_start`): lay out the next pass as from empty
    /// (`when-emptied`), or keep the last pass's layout (`never`).
    #[arg(long, value_parser = vmpool::parse_fresh_start, default_value = "when-emptied")]
    fresh_start: FreshStart,
    /// Replay the trace this many times on the same allocator, freeing
    /// what is still live at the end of each pass.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,
    /// vmpool only: mark a step as each pass begins (`Pool::mark_step`), so
    /// that the pool lays out the repeated pass (Note [Step layouts]).
    #[arg(long)]
    mark_passes: bool,
    /// Keep one allocation of this size live across every pass (allocated
    /// before the first, freed after the last), with a unit or in bytes:
    /// 2MiB, 1G. It counts in the peak live bytes.
    #[arg(long, value_name = "BYTES")]
    hold: Option<Bytes>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The allocation trace to replay, gzip'd or plain: one allocation or
    /// free a line (the format of `vmpool::trace`; see traces/README.md).
    trace: PathBuf,
}

#[derive(Default)]
struct Report {
    peak_reserved: u64,
    /// Peak reserved bytes as each pass ended.
    pass_peaks: Vec<u64>,
    /// Chunks mapped in each pass (vmpool only).
    pass_maps: Vec<u64>,
    /// Chunks mapped in each marked step (vmpool only).
    step_maps: Vec<u64>,
    ops: u64,
    nanos: u128,
    remaps: u64,
    bytes_remapped: u64,
    chunks_created: u64,
    chunks_released: u64,
    grows: u64,
    grow_nanos: u64,
    maps: u64,
    unmaps: u64,
    /// vmpool's step layouts (`--mark-passes`, or the trace's marks).
    steps: vmpool::StepCounters,
}

impl Report {
    /// Estimated driver time of the replay's growth and remapping on the
    /// H200, in microseconds, from `driver_tour`'s costs (docs/RESULTS.md,
    /// "What a chunk costs"): each chunk created costs about 9 us to create
    /// and 1 to map, and each chunk mapped (new or moved) about 20 us of
    /// set access; each growth's set-access call about 20 us more; each
    /// unmap about 15 us and each release 15 us.
    fn est_driver_us(&self) -> u64 {
        20 * self.grows
            + 9 * self.chunks_created
            + 21 * self.maps
            + 15 * self.unmaps
            + 15 * self.chunks_released
    }
}

fn progress(ops: usize) -> ProgressBar {
    if std::io::stderr().is_terminal() {
        ProgressBar::new(ops as u64).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} ops {elapsed}")
                .expect("valid template"),
        )
    } else {
        ProgressBar::hidden()
    }
}

/// An allocator as the replay drives it.
trait Replayed {
    type Allocation;
    /// Whether [`Replayed::sample`] runs after every allocation.
    const SAMPLES: bool = false;
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation>;
    fn free(&mut self, a: Self::Allocation) -> Result<()>;
    /// Reads what the allocator holds, outside the timed calls.
    fn sample(&mut self) -> Result<()> {
        Ok(())
    }
    /// Checks at the end of each pass, before what is left live is freed.
    fn check(&mut self) -> Result<()> {
        Ok(())
    }
    /// Peak reserved bytes so far.
    fn reserved_high(&mut self) -> Result<u64>;
    /// Chunks mapped so far, where the allocator says.
    fn maps(&mut self) -> u64 {
        0
    }
    /// Where the trace marks the end of a step (`s`); only vmpool lays
    /// steps out.
    fn mark_step(&mut self) -> Result<()> {
        Ok(())
    }
    /// Between passes, outside the clock.
    fn between_passes(&mut self) {}
}

/// Where a replay marks steps (`Pool::mark_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marks {
    /// Where the trace does (`s` lines).
    Trace,
    /// There, and as each pass begins (`--mark-passes`).
    EachPass,
}

/// How a trace is replayed: how many times, where steps are marked, and
/// what is kept live throughout.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    passes: usize,
    marks: Marks,
    /// Bytes of the allocation held across every pass (`--hold`); 0: none.
    hold: u64,
}

/// What a replay measured, pass by pass.
struct Passes {
    nanos: u128,
    /// Peak reserved bytes as each pass ended.
    peaks: Vec<u64>,
    /// Chunks mapped during each pass.
    maps: Vec<u64>,
    /// Chunks mapped during each marked step (from one mark to the next).
    step_maps: Vec<u64>,
}

/// Replays `trace` on `a` as `schedule` says, freeing what is left live
/// after each pass.
fn replay<A: Replayed>(a: &mut A, trace: &Trace, schedule: &Schedule) -> Result<Passes> {
    let Schedule {
        passes,
        marks,
        hold,
    } = *schedule;
    let bar = progress(trace.ops.len() * passes);
    let mut measured = Passes {
        nanos: 0,
        peaks: Vec::with_capacity(passes),
        maps: Vec::with_capacity(passes),
        step_maps: Vec::new(),
    };
    // Chunks mapped as of the last mark.
    let mut at_mark = None;
    let mut mark = |a: &mut A, step_maps: &mut Vec<u64>| -> Result<()> {
        a.mark_step()?;
        let maps = a.maps();
        if let Some(before) = at_mark.replace(maps) {
            step_maps.push(maps - before);
        }
        Ok(())
    };
    let held = (hold > 0).then(|| a.alloc(hold)).transpose()?;
    for pass in 0..passes {
        if marks == Marks::EachPass {
            mark(a, &mut measured.step_maps)?;
        }
        let maps_before = a.maps();
        let mut live: Vec<Option<A::Allocation>> = Vec::with_capacity(trace.slots);
        live.resize_with(trace.slots, || None);
        let mut sampling = Duration::ZERO;
        let start = Instant::now();
        for (i, op) in trace.ops.iter().enumerate() {
            match *op {
                TraceOp::Alloc { slot, size, .. } => {
                    live[slot] = Some(a.alloc(size)?);
                    if A::SAMPLES {
                        let sampled = Instant::now();
                        a.sample()?;
                        sampling += sampled.elapsed();
                    }
                }
                TraceOp::Free { slot, .. } => {
                    a.free(live[slot].take().expect("trace frees a live id"))?
                }
                TraceOp::Step => mark(a, &mut measured.step_maps)?,
                _ => anyhow::bail!("trace operation {i} is of a kind this replay does not know"),
            }
            if i % 4096 == 0 {
                bar.set_position((pass * trace.ops.len() + i) as u64);
            }
        }
        measured.nanos += (start.elapsed() - sampling).as_nanos();
        a.check()?;
        for x in live.into_iter().flatten() {
            a.free(x)?;
        }
        measured.peaks.push(a.reserved_high()?);
        measured.maps.push(a.maps() - maps_before);
        a.between_passes();
    }
    if let Some(held) = held {
        a.free(held)?;
    }
    bar.finish_and_clear();
    Ok(measured)
}

/// A vmpool pool, synchronous or stream-ordered on one stream.
struct VmpoolReplay<B: Backend> {
    pool: vmpool::Pool<B>,
    /// `Some`: stream-ordered on this stream.
    stream: Option<vmpool::Stream<B>>,
}

impl<B: Backend> Replayed for VmpoolReplay<B> {
    type Allocation = vmpool::Allocation;
    fn alloc(&mut self, size: u64) -> Result<vmpool::Allocation> {
        Ok(match &self.stream {
            Some(s) => self.pool.allocate_async(size, s)?,
            None => self.pool.allocate(size)?,
        })
    }
    fn free(&mut self, a: vmpool::Allocation) -> Result<()> {
        match &self.stream {
            Some(s) => self.pool.free_async(a, s)?,
            None => self.pool.free(a)?,
        }
        Ok(())
    }
    fn check(&mut self) -> Result<()> {
        self.pool.audit().map_err(anyhow::Error::msg)
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.pool.attribute(PoolAttribute::ReservedMemHigh))
    }
    fn maps(&mut self) -> u64 {
        self.pool.stats().maps
    }
    fn mark_step(&mut self) -> Result<()> {
        Ok(self.pool.mark_step()?)
    }
    fn between_passes(&mut self) {
        self.pool.await_step_plan();
    }
}

/// Replays on a vmpool pool of the given backend.
fn replay_vmpool<B: Backend>(
    backend: Arc<B>,
    trace: &Trace,
    props: &PoolProps,
    stream_ordered: bool,
    schedule: &Schedule,
) -> Result<Report> {
    let ctx = Context::new(backend)?;
    let pool = ctx.create_pool(props)?;
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
    let stream = ctx.create_stream(DeviceId(0))?;
    let mut replayed = VmpoolReplay {
        pool,
        stream: stream_ordered.then(|| stream.clone()),
    };
    let measured = replay(&mut replayed, trace, schedule)?;
    let pool = replayed.pool;
    let stats = pool.stats();
    ctx.synchronize_stream(&stream)?;
    Ok(Report {
        peak_reserved: pool.attribute(PoolAttribute::ReservedMemHigh),
        pass_peaks: measured.peaks,
        pass_maps: measured.maps,
        step_maps: measured.step_maps,
        ops: (trace.ops.len() * schedule.passes) as u64,
        nanos: measured.nanos,
        remaps: stats.remaps,
        bytes_remapped: stats.bytes_remapped,
        chunks_created: stats.chunks_created,
        chunks_released: stats.chunks_released,
        grows: stats.grows,
        grow_nanos: stats.grow_nanos,
        maps: stats.maps,
        unmaps: stats.unmaps,
        steps: pool.step_counters(),
    })
}

/// CUDA's stream-ordered pool on one stream.
struct CudaAsyncReplay {
    pool: vmm::cuda::peers::CudaAsyncPool,
    stream: vmm::cuda::CudaStream,
}

impl Replayed for CudaAsyncReplay {
    type Allocation = vmm::cuda::peers::PeerAllocation;
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation> {
        Ok(self.pool.alloc(size as usize, &self.stream)?)
    }
    fn free(&mut self, a: Self::Allocation) -> Result<()> {
        Ok(self.pool.free(a, &self.stream)?)
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.pool.reserved_high()?)
    }
}

/// Replays on CUDA's stream-ordered pool, release threshold max, one stream.
fn replay_cuda_async(
    cuda: &Arc<vmm::cuda::Cuda>,
    trace: &Trace,
    schedule: &Schedule,
) -> Result<Report> {
    let mut replayed = CudaAsyncReplay {
        pool: vmm::cuda::peers::CudaAsyncPool::new(cuda, DeviceId(0))?,
        stream: cuda.create_stream(DeviceId(0))?,
    };
    let measured = replay(&mut replayed, trace, schedule)?;
    cuda.synchronize_stream(&replayed.stream)?;
    Ok(Report {
        peak_reserved: replayed.pool.reserved_high()?,
        pass_peaks: measured.peaks,
        pass_maps: measured.maps,
        ops: (trace.ops.len() * schedule.passes) as u64,
        nanos: measured.nanos,
        ..Report::default()
    })
}

/// Plain cuMemAlloc / cuMemFree; its footprint is the device's used
/// memory, sampled after each allocation, over what it was before.
struct CudaMallocReplay {
    malloc: vmm::cuda::peers::CudaMalloc,
    cuda: Arc<vmm::cuda::Cuda>,
    baseline: u64,
    peak: u64,
}

impl CudaMallocReplay {
    fn used(&self) -> Result<u64> {
        let m = self.cuda.mem_info(DeviceId(0))?;
        Ok((m.total - m.free) as u64)
    }
}

impl Replayed for CudaMallocReplay {
    type Allocation = vmm::cuda::peers::PeerAllocation;
    const SAMPLES: bool = true;
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation> {
        Ok(self.malloc.alloc(size as usize)?)
    }
    fn free(&mut self, a: Self::Allocation) -> Result<()> {
        Ok(self.malloc.free(a)?)
    }
    fn sample(&mut self) -> Result<()> {
        self.peak = self.peak.max(self.used()?);
        Ok(())
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.peak - self.baseline)
    }
}

/// Replays on plain cuMemAlloc / cuMemFree.
fn replay_cuda_malloc(
    cuda: &Arc<vmm::cuda::Cuda>,
    trace: &Trace,
    schedule: &Schedule,
) -> Result<Report> {
    let mut replayed = CudaMallocReplay {
        malloc: vmm::cuda::peers::CudaMalloc::new(cuda, DeviceId(0))?,
        cuda: Arc::clone(cuda),
        baseline: 0,
        peak: 0,
    };
    replayed.baseline = replayed.used()?;
    replayed.peak = replayed.baseline;
    let measured = replay(&mut replayed, trace, schedule)?;
    Ok(Report {
        peak_reserved: replayed.reserved_high()?,
        pass_peaks: measured.peaks,
        pass_maps: measured.maps,
        ops: (trace.ops.len() * schedule.passes) as u64,
        nanos: measured.nanos,
        ..Report::default()
    })
}

fn main() -> ExitCode {
    vmpool_tools::init_tracing();
    let args = Args::parse();
    vmpool_tools::run("vmpool-replay", || replay_main(&args))
}

fn replay_main(args: &Args) -> Result<()> {
    let trace = Trace::read(
        File::open(&args.trace).with_context(|| format!("opening {}", args.trace.display()))?,
    )
    .with_context(|| format!("reading {}", args.trace.display()))?;
    if trace.peak_live == 0 {
        bail!(
            "{}: no allocation to replay (the trace is empty or holds only comments)",
            args.trace.display()
        );
    }
    if args.stream_ordered && args.allocator != AllocatorKind::Vmpool {
        bail!("--stream-ordered is for vmpool; the CUDA pool replays stream-ordered always");
    }
    if args.defragment != DefragmentArg::Units && args.allocator != AllocatorKind::Vmpool {
        bail!("--defragment is for vmpool");
    }
    if args.mark_passes && args.allocator != AllocatorKind::Vmpool {
        bail!("--mark-passes is for vmpool");
    }
    if args.fresh_start != FreshStart::WhenEmptied && args.allocator != AllocatorKind::Vmpool {
        bail!("--fresh-start is for vmpool");
    }
    let schedule = Schedule {
        passes: args.passes as usize,
        marks: if args.mark_passes {
            Marks::EachPass
        } else {
            Marks::Trace
        },
        hold: args.hold.map_or(0, |b| b.0),
    };
    // What the replay holds at its peak: the trace's peak, and the held
    // allocation.
    let peak_live = trace.peak_live + schedule.hold;
    let props = PoolProps {
        chunk_size: args.chunk_size.map(|b| b.0),
        chunk_divisor: args.chunk_divisor.0,
        granule_growth_below: args.granule_growth_below.0,
        va_size: args.va_size.map(|b| b.0),
        defragment: args.defragment.into(),
        fresh_start: args.fresh_start,
        ..PoolProps::new(DeviceId(0))
    };
    if args.allocator != AllocatorKind::Vmpool && args.backend == BackendKind::Host {
        bail!("the CUDA allocators need a GPU: --backend cuda or auto");
    }
    let cuda = vmpool_tools::open(args.backend)?;
    let backend = if cuda.is_some() { "cuda" } else { "host" };
    let report = match (cuda, args.allocator) {
        (None, AllocatorKind::Vmpool) => {
            // A device large enough for the trace: four times its peak.
            let config = vmm::host::HostConfig {
                memory_per_device: (4 * peak_live as usize)
                    .next_multiple_of(2 << 20)
                    .max(1 << 30),
                ..vmm::host::HostConfig::default()
            };
            replay_vmpool(
                vmm::host::Host::new(config)?,
                &trace,
                &props,
                args.stream_ordered,
                &schedule,
            )?
        }
        (Some(cuda), AllocatorKind::Vmpool) => {
            replay_vmpool(cuda, &trace, &props, args.stream_ordered, &schedule)?
        }
        (Some(cuda), AllocatorKind::CudaAsync) => replay_cuda_async(&cuda, &trace, &schedule)?,
        (Some(cuda), AllocatorKind::CudaMalloc) => replay_cuda_malloc(&cuda, &trace, &schedule)?,
        (None, _) => bail!("the CUDA allocators need a GPU, and none could be opened"),
    };
    let ratio = report.peak_reserved as f64 / peak_live as f64;
    let pass_ratios: Vec<f64> = report
        .pass_peaks
        .iter()
        .map(|&p| p as f64 / peak_live as f64)
        .collect();
    let ns_per_op = report.nanos as f64 / report.ops as f64;
    let mut allocator = args
        .allocator
        .to_possible_value()
        .expect("named")
        .get_name()
        .to_string();
    if args.stream_ordered {
        allocator += " (stream-ordered)";
    }
    match args.defragment {
        DefragmentArg::Off => allocator += " (no defragmentation)",
        DefragmentArg::WholeRegions => allocator += " (moving whole free regions only)",
        DefragmentArg::Units => {}
    }
    if args.fresh_start == FreshStart::Never {
        allocator += " (no fresh starts)";
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "trace": args.trace.display().to_string(),
                "backend": backend,
                "allocator": allocator,
                "peak_live_bytes": peak_live,
                "peak_reserved_bytes": report.peak_reserved,
                "ratio": ratio,
                "passes": schedule.passes,
                "held_bytes": schedule.hold,
                "pass_ratios": pass_ratios,
                "pass_maps": report.pass_maps,
                "step_maps": report.step_maps,
                "ops": report.ops,
                "ns_per_op": ns_per_op,
                "remaps": report.remaps,
                "bytes_remapped": report.bytes_remapped,
                "chunks_created": report.chunks_created,
                "chunks_released": report.chunks_released,
                "grows": report.grows,
                "grow_ns_per_op": report.grow_nanos as f64 / report.ops as f64,
                "maps": report.maps,
                "unmaps": report.unmaps,
                "steps": report.steps.steps,
                "step_layouts": report.steps.layouts,
                "planned": report.steps.planned,
                "missed": report.steps.missed,
                "step_region_bytes": report.steps.region_bytes,
                "est_driver_us": report.est_driver_us(),
            })
        );
    } else {
        println!("trace           {}", args.trace.display());
        println!("allocator       {allocator} on the {backend} backend");
        println!("peak live       {:>14} bytes", peak_live);
        println!("peak reserved   {:>14} bytes", report.peak_reserved);
        println!("ratio           {ratio:>14.4}");
        if schedule.passes > 1 {
            let each: Vec<String> = pass_ratios.iter().map(|r| format!("{r:.4}")).collect();
            println!("after each pass {:>14}", each.join(" "));
            if report.pass_maps.iter().any(|&m| m > 0) {
                let each: Vec<String> = report.pass_maps.iter().map(u64::to_string).collect();
                println!("maps each pass  {:>14}", each.join(" "));
            }
        }
        println!("ops             {:>14}", report.ops);
        println!("ns per op       {ns_per_op:>14.1}");
        println!(
            "remaps          {:>14} ({} bytes)",
            report.remaps, report.bytes_remapped
        );
        println!(
            "chunks          {:>14} created, {} released",
            report.chunks_created, report.chunks_released
        );
        println!(
            "grows / maps    {:>14} / {} ({} unmaps)",
            report.grows, report.maps, report.unmaps
        );
        if report.steps.steps > 0 {
            let st = &report.steps;
            println!(
                "steps           {:>14} marked, {} layouts; {} planned, {} missed; region {} bytes",
                st.steps, st.layouts, st.planned, st.missed, st.region_bytes
            );
            let mapping = report.step_maps.iter().filter(|&&m| m > 0).count();
            println!(
                "steps mapping   {:>14} of {} (chunks mapped between two marks)",
                mapping,
                report.step_maps.len()
            );
        }
        println!(
            "driver, est.    {:>14} us (20 per growth, 9 per chunk created, 21 per map, 15 per unmap, 15 per release)",
            report.est_driver_us()
        );
        println!(
            "growing         {:>14.1} ns per op of the above",
            report.grow_nanos as f64 / report.ops as f64
        );
    }
    Ok(())
}
