//! Replays an allocation trace and reports footprint and speed.
//!
//!     vmpool-replay [--backend auto|cuda|host] [--allocator vmpool|cuda-async|cuda-malloc]
//!                   [--chunk-size BYTES] [--chunk-divisor N|off] [--stream-ordered [--stream-lag MICROS,EVERY,WAIT]]
//!                   [--defragment off|units|whole-regions] [--fresh-start when-emptied|never]
//!                   [--passes N] [--mark-passes] [--hold BYTES] [--slack] [--mapping-ops] [--json] TRACE
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

mod lag;
mod pools;
mod replay;

use std::fs::File;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _, Result};
use clap::{Parser, ValueEnum};
use vmpool::trace::Trace;
use vmpool::vmm::testing::lag::StreamLag;
use vmpool::vmm::{self, DeviceId};
use vmpool::{FreshStart, PoolProps};

use vmpool_tools::{BackendKind, Bytes, DefragmentArg};

use lag::parse_stream_lag;
use pools::{replay_cuda_async, replay_cuda_malloc, replay_vmpool, VmpoolRun};
use replay::{Marks, Schedule};

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
    /// vmpool, stream-ordered only: keep the stream behind the calls as a
    /// GPU keeps a program's stream behind its allocations: MICROS of work
    /// queued on it after every EVERY-th allocation, and the stream waited
    /// for every WAIT operations (`100,20,200`). The footprint then follows
    /// the timing, run by run; the replay's time is the delays'.
    #[arg(long, value_name = "MICROS,EVERY,WAIT", value_parser = parse_stream_lag)]
    stream_lag: Option<StreamLag>,
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
    /// vmpool only: report where the reserved bytes that no live
    /// allocation holds lay when the pool's reserved bytes first reached
    /// their peak (`PoolSnapshot::slack`): in free units growth may move,
    /// in free bytes of units that hold other bytes too (and how many of
    /// those end a mapped region), in spares, pending frees, or otherwise
    /// (step regions' idle slots); and how many mapped regions there were.
    /// A snapshot at each new high, outside the timed calls.
    #[arg(long)]
    slack: bool,
    /// vmpool only: list the allocations after which the pool had mapped
    /// chunks: the trace operation (counted from 0 over every pass), the
    /// bytes asked for, and the chunks mapped since the allocation before
    /// (by its growth, or by a step layout at a mark between). From the
    /// pool's statistics after every allocation, outside the timed calls.
    #[arg(long)]
    mapping_ops: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The allocation trace to replay, gzip'd or plain: one allocation or
    /// free a line (the format of `vmpool::trace`; see traces/README.md).
    trace: PathBuf,
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
    if args.stream_lag.is_some() && !args.stream_ordered {
        bail!("--stream-lag keeps a stream behind the calls: it needs --stream-ordered");
    }
    if args.defragment != DefragmentArg::Units && args.allocator != AllocatorKind::Vmpool {
        bail!("--defragment is for vmpool");
    }
    if args.mark_passes && args.allocator != AllocatorKind::Vmpool {
        bail!("--mark-passes is for vmpool");
    }
    if args.slack && args.allocator != AllocatorKind::Vmpool {
        bail!("--slack is for vmpool");
    }
    if args.mapping_ops && args.allocator != AllocatorKind::Vmpool {
        bail!("--mapping-ops is for vmpool");
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
    let run = VmpoolRun {
        props: &props,
        stream_ordered: args.stream_ordered,
        slack: args.slack,
        mapping_ops: args.mapping_ops,
        stream_lag: args.stream_lag,
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
            replay_vmpool(vmm::host::Host::new(config)?, &trace, &run, &schedule)?
        }
        (Some(cuda), AllocatorKind::Vmpool) => replay_vmpool(cuda, &trace, &run, &schedule)?,
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
                "gathers": report.gathers,
                "joins": report.joins,
                "grow_ns_per_op": report.grow_nanos as f64 / report.ops as f64,
                "maps": report.maps,
                "unmaps": report.unmaps,
                "steps": report.steps.steps,
                "step_layouts": report.steps.layouts,
                "planned": report.steps.planned,
                "missed": report.steps.missed,
                "step_region_bytes": report.steps.region_bytes,
                "est_driver_us": report.est_driver_us(),
                "slack_at_peak": report.slack_at_peak.map(|s| serde_json::json!({
                    "reserved_bytes": s.reserved,
                    "used_bytes": s.used,
                    "free_whole_units_bytes": s.free_whole_units,
                    "free_in_shared_units_bytes": s.free_in_shared_units,
                    "shared_units": s.shared_units,
                    "free_at_region_ends_bytes": s.free_at_region_ends,
                    "regions": s.regions,
                    "spare_bytes": s.spare,
                    "pending_bytes": s.pending,
                    "other_bytes": s.other,
                })),
                "mapping_ops": report.mapping_ops.as_ref().map(|ops| ops
                    .iter()
                    .map(|m| serde_json::json!({"op": m.op, "size": m.size, "maps": m.maps}))
                    .collect::<Vec<_>>()),
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
            "grows / maps    {:>14} / {} ({} unmaps); {} gathers, {} joins",
            report.grows, report.maps, report.unmaps, report.gathers, report.joins
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
        if let Some(s) = report.slack_at_peak {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "slack at peak   {:>14.1} MiB reserved, {:.1} live; free {:.1} in whole units, {:.1} in {} units shared with other bytes ({:.1} at the ends of the {} mapped regions); spare {:.1}, pending {:.1}, otherwise {:.1}",
                mib(s.reserved),
                mib(s.used),
                mib(s.free_whole_units),
                mib(s.free_in_shared_units),
                s.shared_units,
                mib(s.free_at_region_ends),
                s.regions,
                mib(s.spare),
                mib(s.pending),
                mib(s.other)
            );
        }
        for m in report.mapping_ops.iter().flatten() {
            let at =
                m.op.map_or("the held allocation".to_string(), |op| format!("op {op}"));
            println!(
                "mapped at       {at:>14}: {} bytes asked, {} chunks",
                m.size, m.maps
            );
        }
    }
    Ok(())
}
