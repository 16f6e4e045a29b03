//! What a call through the C layer costs: replays an allocation trace
//! through `vmpool_alloc` / `vmpool_free` as PyTorch calls them (on the
//! default stream), several rounds on the same pool, and prints the
//! nanoseconds a call of each round and the footprint so far (reserved
//! over in use, at their highs). The first round grows the pool; the
//! later ones reuse it, so they show the calls' own cost. The backend is
//! the one `VMPOOL_BACKEND` names (default `cuda`); with `VMPOOL_TIMING=1`
//! every call is also timed, and the difference is what that costs.
//!
//!     VMPOOL_BACKEND=host cargo run --release -p vmpool-c --example c_calls -- traces/gpt2_generate.trace.gz
//!     VMPOOL_BACKEND=host VMPOOL_TIMING=1 cargo run --release -p vmpool-c --example c_calls -- traces/gpt2_generate.trace.gz
//!
//! `--touch-between KIB` touches that much other memory between calls, a
//! cache line in each of as many scattered pages, as a program's own work
//! does between its allocations: the calls then run on cold caches and
//! TLBs, as under PyTorch, where they cost three to four times what they
//! do back to back (docs/RESULTS.md, "Calls on cold caches"). The
//! touching is not counted in the times.
//!
//! The same trace through the Rust API, for comparison:
//! `vmpool-replay --stream-ordered --passes 3 TRACE`.

use std::ffi::c_void;
use std::fs::File;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use vmpool::trace::{Trace, TraceOp};
use vmpool_c::{vmpool_alloc, vmpool_free, vmpool_mark_step, vmpool_stats};

#[derive(Parser)]
struct Args {
    /// An allocation trace (the format `vmpool-replay` reads, gzip or plain).
    trace: PathBuf,
    /// Rounds over the trace on the same pool.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// KiB of other memory to touch between calls (0: none).
    #[arg(long, value_name = "KIB", default_value_t = 0)]
    touch_between: usize,
}

/// Memory a program's own work would touch between its allocation calls.
struct Elsewhere {
    memory: Vec<u8>,
    at: usize,
    lines: usize,
}

impl Elsewhere {
    /// Writes one byte in each of `lines` cache lines, 28 KiB apart (a new
    /// page each time, so the TLB is cold too), going round a 64 MiB buffer.
    fn new(kib: usize) -> Self {
        Self {
            memory: vec![0; 64 << 20],
            at: 0,
            lines: kib * 1024 / 64,
        }
    }

    fn touch(&mut self) {
        for _ in 0..self.lines {
            self.memory[self.at] = self.memory[self.at].wrapping_add(1);
            self.at = (self.at + 7 * 4096 + 64) % self.memory.len();
        }
    }
}

const DEVICE: i32 = 0;

fn main() -> Result<()> {
    let args = Args::parse();
    let trace = Trace::read(
        File::open(&args.trace).with_context(|| format!("opening {}", args.trace.display()))?,
    )
    .with_context(|| format!("reading {}", args.trace.display()))?;
    let backend = vmpool_c::backend().to_str().context("the backend's name")?;
    if backend == "none" {
        bail!("vmpool has no backend (VMPOOL_BACKEND unusable, or no GPU and not `host`): see its log");
    }
    let stream: *mut c_void = std::ptr::null_mut();
    let mut live: Vec<(*mut c_void, isize)> = vec![(std::ptr::null_mut(), 0); trace.slots];
    println!(
        "{} operations of {} through vmpool_alloc / vmpool_free, {backend} backend{}",
        trace.ops.len(),
        args.trace.display(),
        match args.touch_between {
            0 => String::new(),
            kib => format!(", {kib} KiB of other memory touched between calls"),
        }
    );
    let mut elsewhere = (args.touch_between > 0).then(|| Elsewhere::new(args.touch_between));
    for round in 1..=args.rounds {
        let mut touching = std::time::Duration::ZERO;
        let start = Instant::now();
        for op in &trace.ops {
            if let Some(e) = &mut elsewhere {
                let t = Instant::now();
                e.touch();
                touching += t.elapsed();
            }
            match *op {
                TraceOp::Alloc { slot, size, .. } => {
                    let size = isize::try_from(size).context("allocation size")?;
                    let ptr = vmpool_alloc(size, DEVICE, stream);
                    if ptr.is_null() {
                        bail!(
                            "vmpool_alloc({size}) returned NULL in round {round}: see vmpool's log"
                        );
                    }
                    live[slot] = (ptr, size);
                }
                TraceOp::Free { slot, .. } => {
                    let (ptr, size) = std::mem::replace(&mut live[slot], (std::ptr::null_mut(), 0));
                    vmpool_free(ptr, size, DEVICE, stream);
                }
                TraceOp::Step => {
                    if vmpool_mark_step(DEVICE) != 0 {
                        bail!("vmpool_mark_step failed in round {round}: see vmpool's log");
                    }
                }
                _ => bail!("a trace operation of a kind this example does not know"),
            }
        }
        let ns = (start.elapsed() - touching).as_secs_f64() * 1e9 / trace.ops.len() as f64;
        // The pool's high-water marks so far: reserved over in use.
        let stats = vmpool_stats(DEVICE);
        let footprint = stats.reserved_high as f64 / stats.used_high.max(1) as f64;
        println!("  round {round}: {ns:7.1} ns a call, footprint {footprint:.4}");
        // What the trace left live goes, so that the next round starts alike.
        for (ptr, size) in live.iter_mut().filter(|(ptr, _)| !ptr.is_null()) {
            vmpool_free(*ptr, *size, DEVICE, stream);
            *ptr = std::ptr::null_mut();
        }
    }
    let stats = vmpool_stats(DEVICE);
    if stats.valid == 0 {
        bail!("vmpool_stats({DEVICE}) found no pool");
    }
    if stats.timed_calls > 0 {
        let allocs = stats.timed_calls - stats.timed_frees;
        let per = |nanos: u64, calls: u64| nanos as f64 / calls.max(1) as f64;
        println!(
            "  timed by the library (VMPOOL_TIMING=1): {:.1} ns a call inside it, over {} calls \
             (allocations {:.1} ns, {:.1} without growth; frees {:.1} ns)",
            per(stats.call_nanos, stats.timed_calls),
            stats.timed_calls,
            per(stats.call_nanos - stats.free_nanos, allocs),
            per(
                (stats.call_nanos - stats.free_nanos).saturating_sub(stats.grow_nanos),
                allocs
            ),
            per(stats.free_nanos, stats.timed_frees),
        );
    }
    println!(
        "  allocations: {} of {} without the pool's lock (the stream's own frees); {} events recorded",
        stats.same_stream_reuses, stats.allocations, stats.events_recorded
    );
    println!(
        "  pool: {} grows, {} chunks created, {} remaps; {} refused frees",
        stats.grows, stats.chunks_created, stats.remaps, stats.refused_frees
    );
    if stats.refused_frees > 0 {
        bail!("vmpool refused {} frees", stats.refused_frees);
    }
    Ok(())
}
