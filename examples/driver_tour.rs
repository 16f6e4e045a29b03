//! A tour of the driver layer: reserve address space, create chunks, map,
//! write, remap a chunk elsewhere and read its data back, order work across
//! streams with events; each step timed. Then what each step of growing and
//! moving physical memory costs per chunk size (medians), which is what the
//! pool's chunk size is chosen from; what giving access to and unmapping a
//! run of adjacent chunks costs in one call; and whether each of those steps waits
//! for work queued on the device; and whether a move's unmap, left to a
//! helper thread, leaves the mapping thread's path; and whether growth
//! spreads over threads. Runs on the GPU when
//! one is present, else on the host backend, and says which.
//!
//!     cargo run --release --example driver_tour [-- --backend host|cuda]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use vmpool::vmm::memory::{Chunk, Mapping, Reservation};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{AccessDesc, Backend, DeviceId};

mod common;

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
}

const DEV: DeviceId = DeviceId(0);

fn timed<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    let out = f().with_context(|| what.to_string())?;
    println!(
        "  {what:<48} {:>10.1} us",
        start.elapsed().as_secs_f64() * 1e6
    );
    Ok(out)
}

/// The middle of `v` once sorted (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn tour<B: TestBackend>(b: Arc<B>) -> Result<()> {
    let b = &b;
    let g = b.granularity(DEV)?;
    let info = b.mem_info(DEV)?;
    println!(
        "{} device(s); granularity {} KiB; device 0: {} MiB free of {} MiB",
        b.device_count()?,
        g >> 10,
        info.free >> 20,
        info.total >> 20
    );
    let stream = b.create_stream(DEV)?;
    let other = b.create_stream(DEV)?;

    let range = timed("reserve 1 TiB of address space", || {
        Ok(Reservation::new(b, 1 << 40, 0)?)
    })?;
    let chunk = timed("create a chunk of one granule", || {
        Ok(Chunk::new(b, DEV, g)?)
    })?;
    let mapping = timed("map it at the start of the range", || {
        Ok(Mapping::new(&range, 0, &chunk)?)
    })?;
    timed("grant read/write to device 0", || {
        Ok(mapping.set_access(&[AccessDesc::read_write(DEV)])?)
    })?;
    b.fill_u32(&stream, mapping.va(), g / 4, 0x7E57_DA7A)?;
    b.synchronize_stream(&stream)?;
    println!("  wrote 0x7E57DA7A over the chunk at {}", mapping.va());

    let chunk = timed("unmap it", || {
        mapping.unmap().map_err(|(e, _)| anyhow::Error::from(e))
    })?;
    let moved = timed("map the same chunk 512 GiB further on", || {
        Ok(Mapping::new(&range, 512 << 30, &chunk)?)
    })?;
    moved.set_access(&[AccessDesc::read_write(DEV)])?;
    let mut bytes = vec![0u8; g];
    b.copy_to_host(&stream, moved.va(), &mut bytes)?;
    let intact = bytes
        .chunks_exact(4)
        .all(|w| u32::from_ne_bytes(w.try_into().unwrap()) == 0x7E57_DA7A);
    ensure!(intact, "the chunk lost its data when remapped");
    println!(
        "  read it back at {}: all {} words intact",
        moved.va(),
        g / 4
    );

    // Stream order across streams: `other` waits for `stream`'s late write.
    let event = b.create_event(DEV)?;
    let start = Instant::now();
    b.delay(&stream, Duration::from_millis(100))?;
    b.fill_u32(&stream, moved.va(), 1, 42)?;
    b.record_event(&event, &stream)?;
    b.stream_wait_event(&other, &event)?;
    println!(
        "  event right after recording: {:?}",
        b.query_event(&event)?
    );
    let mut word = [0u8; 4];
    b.copy_to_host(&other, moved.va(), &mut word)?;
    ensure!(
        u32::from_ne_bytes(word) == 42,
        "the waiting stream read too early"
    );
    println!(
        "  second stream saw the first stream's write after {:.0} ms of delay; event now {:?}",
        start.elapsed().as_secs_f64() * 1e3,
        b.query_event(&event)?
    );
    chunk_costs(b, &range)?;
    runs_of_chunks(b, &range)?;
    behind_queued_work(b, &range)?;
    unmap_on_another_thread(b, &range)?;
    growth_on_threads(b, &range)
}

/// What a run of adjacent 2 MiB chunks costs to give access to and to
/// unmap: one call for the whole run, against one call per chunk. (On the
/// H200 both cost about the same: the driver's work is per mapping.)
fn runs_of_chunks<B: Backend>(b: &Arc<B>, range: &Arc<Reservation<B>>) -> Result<()> {
    const ROUNDS: usize = 9;
    const SIZE: usize = 2 << 20;
    let rw = [AccessDesc::read_write(DEV)];
    println!("
a run of adjacent {} MiB chunks, median of {ROUNDS} (us for the run): set access and unmap, in one call and in one call per chunk", SIZE >> 20);
    println!(
        "{:>7} {:>16} {:>16} {:>16} {:>16}",
        "chunks", "access, 1 call", "access, each", "unmap, 1 call", "unmap, each"
    );
    for n in [1usize, 4, 16, 64] {
        let chunks = (0..n)
            .map(|_| Chunk::new(b, DEV, SIZE))
            .collect::<vmpool::vmm::Result<Vec<_>>>()?;
        let mut t = [(); 4].map(|_| Vec::with_capacity(ROUNDS));
        for _ in 0..ROUNDS {
            for one_call in [true, false] {
                let at = |i: usize| range.base().byte_add((1 << 38) + i * SIZE);
                for (i, c) in chunks.iter().enumerate() {
                    b.map(at(i), c.handle())?;
                }
                let start = Instant::now();
                if one_call {
                    b.set_access(at(0), n * SIZE, &rw)?;
                } else {
                    for i in 0..n {
                        b.set_access(at(i), SIZE, &rw)?;
                    }
                }
                t[usize::from(!one_call)].push(start.elapsed().as_secs_f64() * 1e6);
                let start = Instant::now();
                if one_call {
                    b.unmap(at(0), n * SIZE)?;
                } else {
                    for i in 0..n {
                        b.unmap(at(i), SIZE)?;
                    }
                }
                t[2 + usize::from(!one_call)].push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        let [access_one, access_each, unmap_one, unmap_each] = t.map(median);
        println!(
            "{n:>7} {access_one:>16.1} {access_each:>16.1} {unmap_one:>16.1} {unmap_each:>16.1}"
        );
    }
    Ok(())
}

/// Whether a move's unmap can leave the mapping thread. A move maps a
/// chunk at its new place, gives it access and unmaps its old place (a
/// chunk may be mapped at two places at once). Timed here: 32 moves of
/// 32 MiB chunks with the unmap inline, and with it sent to a helper
/// thread; on an idle device and behind queued work. The mapping
/// thread's time per move is what an allocation waits for.
fn unmap_on_another_thread<B: TestBackend>(b: &Arc<B>, range: &Arc<Reservation<B>>) -> Result<()> {
    const MOVES: usize = 32;
    const SIZE: usize = 32 << 20;
    let rw = [AccessDesc::read_write(DEV)];
    let stream = b.create_stream(DEV)?;
    println!("\n{MOVES} moves of {} MiB chunks (us a move): the mapping thread's time, and until every unmap is done", SIZE >> 20);
    for loaded in [false, true] {
        for helper in [false, true] {
            let chunks = (0..MOVES)
                .map(|_| Ok(Chunk::new(b, DEV, SIZE)?))
                .collect::<Result<Vec<_>>>()?;
            let old = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let m = Mapping::new(range, (5 << 37) + i * SIZE, c)?;
                    m.set_access(&rw)?;
                    Ok(m)
                })
                .collect::<Result<Vec<_>>>()?;
            if loaded {
                b.delay(&stream, Duration::from_secs(2))?;
            }
            let (tx, rx) = std::sync::mpsc::channel::<Mapping<B>>();
            let worker = helper.then(|| {
                std::thread::spawn(move || -> Result<()> {
                    for m in rx {
                        m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
                    }
                    Ok(())
                })
            });
            let start = Instant::now();
            let mut moved = Vec::new();
            for (i, (c, m)) in chunks.iter().zip(old).enumerate() {
                let new = Mapping::new(range, (5 << 37) + (1 << 36) + i * SIZE, c)?;
                new.set_access(&rw)?;
                if helper {
                    tx.send(m)?;
                } else {
                    m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
                }
                moved.push(new);
            }
            let mapping_thread = start.elapsed();
            drop(tx);
            if let Some(worker) = worker {
                worker.join().expect("the unmapping thread panicked")?;
            }
            let all = start.elapsed();
            let per = |d: Duration| d.as_secs_f64() * 1e6 / MOVES as f64;
            println!(
                "  {:<13} unmap {:<18} {:>8.1} {:>8.1}",
                if loaded {
                    "behind work:"
                } else {
                    "idle device:"
                },
                if helper {
                    "on a helper thread"
                } else {
                    "inline"
                },
                per(mapping_thread),
                per(all)
            );
            for m in moved {
                m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
            }
            b.synchronize_stream(&stream)?;
        }
    }
    Ok(())
}

/// Whether a driver step waits for work queued on the device: each step
/// is timed right after queueing 200 ms of delay on a stream, with
/// memory the delayed work never touches. A step that returns at its
/// usual cost with the delay still pending does not wait; one that takes
/// ~200 ms does, and stalls a program that queues work ahead (PyTorch)
/// each time the pool moves memory.
fn behind_queued_work<B: TestBackend>(b: &Arc<B>, range: &Arc<Reservation<B>>) -> Result<()> {
    const DELAY: Duration = Duration::from_millis(200);
    const SIZE: usize = 32 << 20;
    let stream = b.create_stream(DEV)?;
    let queued = b.create_event(DEV)?;
    let rw = [AccessDesc::read_write(DEV)];
    println!(
        "\nbehind {} ms of queued work (us; and whether that work was still queued after the step)",
        DELAY.as_millis()
    );
    let step = |what: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        b.delay(&stream, DELAY)?;
        b.record_event(&queued, &stream)?;
        let start = Instant::now();
        f().with_context(|| what.to_string())?;
        let us = start.elapsed().as_secs_f64() * 1e6;
        let state = b.query_event(&queued)?;
        println!("  {what:<40} {us:>10.1} us   queued work: {state:?}");
        Ok(b.synchronize_stream(&stream)?)
    };
    let mut chunk = None;
    step("create a 32 MiB chunk", &mut || {
        chunk = Some(Chunk::new(b, DEV, SIZE)?);
        Ok(())
    })?;
    let chunk = chunk.expect("created");
    let mut mapping = None;
    step("map it", &mut || {
        mapping = Some(Mapping::new(range, 1 << 37, &chunk)?);
        Ok(())
    })?;
    let mapping = mapping.expect("mapped");
    step("set access", &mut || Ok(mapping.set_access(&rw)?))?;
    let mut mapping = Some(mapping);
    step("unmap it", &mut || {
        let m = mapping.take().expect("mapped");
        m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
        Ok(())
    })?;
    let mut chunk = Some(chunk);
    step("release it", &mut || {
        drop(chunk.take());
        Ok(())
    })
}

/// Median microseconds of each driver step for one chunk of several sizes:
/// the cost model behind the pool's growth chunk size.
fn chunk_costs<B: Backend>(b: &Arc<B>, range: &Arc<Reservation<B>>) -> Result<()> {
    const ROUNDS: usize = 15;
    println!("\nper chunk, median of {ROUNDS} (us): create, map, set access, unmap, release, and a move (unmap + map + set access)");
    println!(
        "{:>10} {:>8} {:>8} {:>11} {:>8} {:>8} {:>8}",
        "size", "create", "map", "set access", "unmap", "release", "move"
    );
    for mib in [2usize, 8, 32, 64, 256] {
        let size = mib << 20;
        let mut t = [(); 6].map(|_| Vec::with_capacity(ROUNDS));
        for _ in 0..ROUNDS {
            let us = |start: Instant| start.elapsed().as_secs_f64() * 1e6;
            let start = Instant::now();
            let chunk = Chunk::new(b, DEV, size)?;
            t[0].push(us(start));
            let start = Instant::now();
            let m = Mapping::new(range, 1 << 38, &chunk)?;
            t[1].push(us(start));
            let start = Instant::now();
            m.set_access(&[AccessDesc::read_write(DEV)])?;
            t[2].push(us(start));
            let start = Instant::now();
            m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
            t[3].push(us(start));
            let start = Instant::now();
            let moved = Mapping::new(range, 3 << 38, &chunk)?;
            moved.set_access(&[AccessDesc::read_write(DEV)])?;
            moved.unmap().map_err(|(e, _)| anyhow::Error::from(e))?;
            t[5].push(us(start));
            let start = Instant::now();
            drop(chunk);
            t[4].push(us(start));
        }
        let [create, map, access, unmap, release, moved] = t.map(median);
        println!("{:>7} MiB {create:>8.1} {map:>8.1} {access:>11.1} {unmap:>8.1} {release:>8.1} {moved:>8.1}", mib);
    }
    Ok(())
}

/// Whether growth can spread over threads: 256 chunks of 4 MiB created,
/// mapped side by side and given access, by 1, 2, 4 and 8 threads each
/// taking an equal share; then unmapped and released the same way. If the
/// driver serialises these calls the time per chunk stays the same
/// whatever the thread count; if it does not, a growth of many chunks
/// could take a fraction of its time.
fn growth_on_threads<B: Backend>(b: &Arc<B>, range: &Arc<Reservation<B>>) -> Result<()> {
    const CHUNKS: usize = 256;
    const SIZE: usize = 4 << 20;
    const ROUNDS: usize = 5;
    let rw = [AccessDesc::read_write(DEV)];
    println!("\n{CHUNKS} chunks of {} MiB, median of {ROUNDS} (us a chunk, wall time over the chunks): growth (create + map + set access) and teardown (unmap + release) split over threads", SIZE >> 20);
    println!("{:>8} {:>10} {:>10}", "threads", "growth", "teardown");
    for threads in [1usize, 2, 4, 8] {
        let mut grow = Vec::with_capacity(ROUNDS);
        let mut tear = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let share = CHUNKS / threads;
            let start = Instant::now();
            let mapped = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        s.spawn(move || -> Result<Vec<Mapping<B>>> {
                            (t * share..(t + 1) * share)
                                .map(|i| {
                                    let chunk = Chunk::new(b, DEV, SIZE)?;
                                    let m = Mapping::new(range, (6 << 37) + i * SIZE, &chunk)?;
                                    m.set_access(&rw)?;
                                    Ok(m)
                                })
                                .collect()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a growth thread panicked"))
                    .collect::<Result<Vec<_>>>()
            })?;
            grow.push(start.elapsed().as_secs_f64() * 1e6 / CHUNKS as f64);
            let start = Instant::now();
            std::thread::scope(|s| {
                let handles: Vec<_> = mapped
                    .into_iter()
                    .map(|ms| {
                        s.spawn(move || -> Result<()> {
                            for m in ms {
                                drop(m.unmap().map_err(|(e, _)| anyhow::Error::from(e))?);
                            }
                            Ok(())
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .try_for_each(|h| h.join().expect("a teardown thread panicked"))
            })?;
            tear.push(start.elapsed().as_secs_f64() * 1e6 / CHUNKS as f64);
        }
        println!("{threads:>8} {:>10.1} {:>10.1}", median(grow), median(tear));
    }
    Ok(())
}

fn main() -> Result<()> {
    on_backend!(Args::parse().backend, tour)
}
