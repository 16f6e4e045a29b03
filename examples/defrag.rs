//! Defragmentation, shown: fill a pool with allocations of mixed sizes, free
//! every other one (a checkerboard of holes), then ask for one allocation
//! larger than any hole.
//!
//! - vmpool remaps the free chunks under the holes into one contiguous
//!   range: the request is served with no new memory.
//! - The same steps on a conventional pool need new memory for it: vmpool
//!   with remapping switched off, and, on the GPU, CUDA's own pool.
//!
//! Runs on the GPU when one is present, else on the host backend, and says
//! which. Writes a picture of the address space before and after
//! (`target/defrag.svg`): one colour per chunk, so moved chunks can be
//! followed.
//!
//!     cargo run --release --example defrag [-- --backend host|cuda --svg FILE]
//!     RUST_LOG=vmpool=debug cargo run --release --example defrag   # every grow, remap, trim

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use svg::node::element::{Rectangle, Text};
use svg::Document;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{self, Backend, DeviceId};
use vmpool::{Allocation, Context, Defragment, PoolAttribute, PoolProps, PoolSnapshot, Stream};

mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;
const COUNT: u64 = 48;

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
    /// Where to write the picture.
    #[arg(long, default_value = "target/defrag.svg")]
    svg: PathBuf,
}

/// Sizes between 1 and 6 MiB, not multiples of the 2 MiB granule, so
/// allocations share chunks with their neighbours.
fn size_of(i: u64) -> u64 {
    MIB + (i * 7 % 5) * MIB + (i * 389 % 1000) * 1024
}

struct Outcome {
    reserved_before: u64,
    reserved_after: u64,
    used_before: u64,
    used_after: u64,
    largest_hole: u64,
    remaps: u64,
    chunks_created: u64,
    micros: f64,
    before: PoolSnapshot,
    after: PoolSnapshot,
}

/// The experiment on a vmpool pool; `request` None: as large as what the
/// free chunks can hold (measured on the first, defragmenting run).
fn on_vmpool<B: TestBackend>(
    b: &Arc<B>,
    defragment: Defragment,
    request: Option<u64>,
) -> Result<(u64, Outcome)> {
    let ctx = Context::new(Arc::clone(b))?;
    let pool = ctx.create_pool(&PoolProps {
        chunk_size: Some(2 * MIB),
        defragment,
        ..PoolProps::new(DEV)
    })?;
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
    ctx.set_current_pool(&pool)?;
    let s: Stream<B> = ctx.create_stream(DEV)?;
    let mut all: Vec<Allocation> = Vec::new();
    for i in 0..COUNT {
        let a = ctx.alloc_async(size_of(i), &s)?;
        b.fill_u32(s.raw(), a.ptr(), (a.size() / 4) as usize, i as u32)?;
        all.push(a);
    }
    let mut live = Vec::new();
    for (i, a) in all.into_iter().enumerate() {
        // Every other one; the last stays, so no hole is open-ended.
        if i % 2 == 1 && i as u64 != COUNT - 1 {
            ctx.free_async(a, &s)?;
        } else {
            live.push((a, i as u32));
        }
    }
    ctx.synchronize_stream(&s)?;
    let before = pool.snapshot();
    let largest_hole = before.stats.largest_free_range;
    // What remapping can assemble: every chunk no live byte touches.
    let movable: u64 = before
        .units
        .iter()
        .filter(|u| before.free_in(u.va, u.size) == u.size)
        .map(|u| u.size)
        .sum();
    let request = request.unwrap_or(movable);
    ensure!(request > largest_hole, "the request must exceed every hole");
    let start = Instant::now();
    let big = ctx.alloc_async(request, &s)?;
    let micros = start.elapsed().as_secs_f64() * 1e6;
    b.fill_u32(s.raw(), big.ptr(), (request / 4) as usize, 0xB16)?;
    let after = pool.snapshot();
    // The live allocations kept their data while chunks moved around them.
    for (a, value) in &live {
        let mut word = [0u8; 4];
        let last = a.ptr().byte_add((a.size() / 4 - 1) as usize * 4);
        b.copy_to_host(s.raw(), last, &mut word)?;
        ensure!(
            u32::from_ne_bytes(word) == *value,
            "live data changed at {}",
            a.ptr()
        );
    }
    let outcome = Outcome {
        reserved_before: before.stats.reserved_bytes,
        reserved_after: after.stats.reserved_bytes,
        used_before: before.stats.used_bytes,
        used_after: after.stats.used_bytes,
        largest_hole,
        remaps: after.stats.remaps - before.stats.remaps,
        chunks_created: after.stats.chunks_created - before.stats.chunks_created,
        micros,
        before,
        after,
    };
    ctx.free_async(big, &s)?;
    for (a, _) in live {
        ctx.free_async(a, &s)?;
    }
    ctx.synchronize_stream(&s)?;
    Ok((request, outcome))
}

/// The same steps on CUDA's stream-ordered pool (release threshold max):
/// (reserved before the request, reserved after).
fn on_cuda_pool(cuda: &Arc<vmm::cuda::Cuda>, request: u64) -> Result<(u64, u64)> {
    let pool = vmm::cuda::peers::CudaAsyncPool::new(cuda, DEV)?;
    let s = cuda.create_stream(DEV)?;
    let all: Vec<_> = (0..COUNT)
        .map(|i| pool.alloc(size_of(i) as usize, &s))
        .collect::<Result<_, _>>()?;
    let mut live = Vec::new();
    for (i, a) in all.into_iter().enumerate() {
        if i % 2 == 1 && i as u64 != COUNT - 1 {
            pool.free(a, &s)?;
        } else {
            live.push(a);
        }
    }
    cuda.synchronize_stream(&s)?;
    let before = pool.reserved_current()?;
    let big = pool.alloc(request as usize, &s)?;
    let after = pool.reserved_current()?;
    pool.free(big, &s)?;
    for a in live {
        pool.free(a, &s)?;
    }
    cuda.synchronize_stream(&s)?;
    Ok((before, after))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

/// The large arena's mapped span, before and after, one row each.
fn draw(path: &PathBuf, rows: &[(&str, &PoolSnapshot)]) -> Result<()> {
    let (width, row_h, label_h) = (1200.0, 60.0, 22.0);
    let arena = rows[0].1.arenas[1];
    let end = rows
        .iter()
        .flat_map(|(_, s)| s.units.iter().map(|u| u.va + u.size))
        .max()
        .unwrap_or(arena.1);
    let span = (end - arena.0) as f64;
    let x = |va: u64| (va - arena.0) as f64 / span * width;
    let color = |chunk: u64| format!("hsl({}, 70%, 50%)", chunk * 47 % 360);
    let height = rows.len() as f64 * (row_h + label_h) + 10.0;
    let mut doc = Document::new()
        .set("viewBox", (0, 0, width, height))
        .set("width", width)
        .set("height", height)
        .set("font-family", "sans-serif")
        .set("font-size", 13);
    for (r, (label, snap)) in rows.iter().enumerate() {
        let top = r as f64 * (row_h + label_h) + label_h;
        doc = doc
            .add(Text::new(*label).set("x", 2).set("y", top - 6.0))
            .add(
                Rectangle::new()
                    .set("x", 0)
                    .set("y", top)
                    .set("width", width)
                    .set("height", row_h)
                    .set("fill", "#eeeeee"),
            );
        for u in snap.units.iter().filter(|u| u.va >= arena.0) {
            // The chunk's colour, pale where the memory is free.
            doc = doc.add(
                Rectangle::new()
                    .set("x", x(u.va))
                    .set("y", top)
                    .set("width", x(u.va + u.size) - x(u.va))
                    .set("height", row_h)
                    .set("fill", color(u.chunk))
                    .set("fill-opacity", 0.25)
                    .set("stroke", "white")
                    .set("stroke-width", 0.5),
            );
            let mut at = u.va;
            let unit_end = u.va + u.size;
            let mut frees: Vec<(u64, u64)> = snap
                .free
                .iter()
                .map(|&(s, l)| (s.max(u.va), (s + l).min(unit_end)))
                .filter(|(s, e)| e > s)
                .collect();
            frees.push((unit_end, unit_end));
            for (fs, fe) in frees {
                if fs > at {
                    doc = doc.add(
                        Rectangle::new()
                            .set("x", x(at))
                            .set("y", top + 8.0)
                            .set("width", x(fs) - x(at))
                            .set("height", row_h - 16.0)
                            .set("fill", color(u.chunk)),
                    );
                }
                at = fe;
            }
        }
    }
    svg::save(path, &doc).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn run<B: TestBackend>(
    b: &Arc<B>,
    cuda: Option<&Arc<vmm::cuda::Cuda>>,
    svg_path: &PathBuf,
) -> Result<()> {
    println!(
        "{COUNT} allocations of 1-6 MiB, every other one freed, then one request larger than any hole.\n"
    );
    let (request, on) = on_vmpool(b, Defragment::Units, None)?;
    let (_, off) = on_vmpool(b, Defragment::Off, Some(request))?;
    println!(
        "largest hole {}; request {} (all the chunks under the holes that no live byte touches)\n",
        mib(on.largest_hole),
        mib(request)
    );
    println!(
        "{:<32} {:>14} {:>14} {:>12} {:>8} {:>10} {:>10}",
        "", "reserved before", "reserved after", "new memory", "remaps", "new chunks", "time"
    );
    for (name, o) in [("vmpool (remapping)", &on), ("vmpool, remapping off", &off)] {
        println!(
            "{:<32} {:>14} {:>14} {:>12} {:>8} {:>10} {:>8.0} us",
            name,
            mib(o.reserved_before),
            mib(o.reserved_after),
            mib(o.reserved_after - o.reserved_before),
            o.remaps,
            o.chunks_created,
            o.micros
        );
    }
    if let Some(cuda) = cuda {
        let (before, after) = on_cuda_pool(cuda, request)?;
        println!(
            "{:<32} {:>14} {:>14} {:>12}",
            "CUDA's pool (cuMemAllocAsync)",
            mib(before),
            mib(after),
            mib(after.saturating_sub(before))
        );
    }
    println!(
        "\nvmpool used {} before and {} after; live data checked intact after the remap.",
        mib(on.used_before),
        mib(on.used_after)
    );
    ensure!(
        on.reserved_after == on.reserved_before,
        "vmpool needed new memory"
    );
    draw(
        svg_path,
        &[
            (
                "before: live allocations (solid) and holes (pale), one colour per chunk",
                &on.before,
            ),
            (
                &format!(
                    "after: {} served by remapping {} free chunks, no new memory",
                    mib(request),
                    on.remaps
                ),
                &on.after,
            ),
        ],
    )?;
    println!(
        "picture of the large arena before and after: {}",
        svg_path.display()
    );
    let dump = on.after.to_string();
    let lines: Vec<&str> = dump.lines().collect();
    println!("\npool after the request (Pool::snapshot), first lines:");
    for line in lines.iter().take(10) {
        println!("{line}");
    }
    println!("    ... {} more units", lines.len().saturating_sub(10));
    Ok(())
}

fn main() -> Result<()> {
    common::init_tracing();
    let args = Args::parse();
    let cuda = common::open(args.backend)?;
    match &cuda {
        Some(cuda) => run(cuda, Some(cuda), &args.svg),
        None => run(
            &vmm::host::Host::new(vmm::host::HostConfig::default())?,
            None,
            &args.svg,
        ),
    }
}
