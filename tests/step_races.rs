//! Step layouts (Note [Step layouts] in docs/DESIGN.md) under threads:
//! steps marked, by the program or where it empties the pool, while
//! other threads allocate and free, synchronously or in stream order.
//! Each case runs for a fraction of a second; a race shows itself in a
//! fraction of runs, under load, so they are meant to be run in a loop
//! as well as once. On every backend (the host always, CUDA with
//! `--features gpu-tests`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, Pool, PoolAttribute, Stream};

#[allow(dead_code)]
mod common;

use common::{allocate_on, free_on, pool};

const DEV: DeviceId = DeviceId(0);
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The live allocations of a test's threads, by address: an allocation
/// that overlaps a live one fails the test.
#[derive(Default)]
struct Live(Mutex<BTreeMap<u64, u64>>);

impl Live {
    fn allocated(&self, a: &Allocation) {
        let (at, end) = (a.ptr().0, a.ptr().0 + a.size());
        let mut live = self.0.lock().unwrap();
        let before = live.range(..end).next_back();
        assert!(
            before.is_none_or(|(_, e)| *e <= at),
            "{at:#x}..{end:#x} overlaps a live allocation: {before:x?}"
        );
        live.insert(at, end);
    }

    fn freed(&self, a: &Allocation) {
        self.0.lock().unwrap().remove(&a.ptr().0);
    }
}

/// Where a thread's calls go (synchronous, or in order on a stream), and
/// the allocations live.
struct Calls<'t, B: TestBackend> {
    pool: &'t Pool<B>,
    on: Option<&'t Stream<B>>,
    live: &'t Live,
}

impl<B: TestBackend> Calls<'_, B> {
    fn allocate(&self, size: u64) -> Allocation {
        let a = allocate_on(self.pool, self.on, size);
        self.live.allocated(&a);
        a
    }

    fn free(&self, a: Allocation) {
        self.live.freed(&a);
        free_on(self.pool, self.on, a);
    }
}

/// One pass of a program that repeats its work, as `tests/steps.rs`'s
/// steps: layers allocated with a workspace each, then freed, each with
/// a gradient, and the gradients last. It empties what it holds.
fn pass<B: TestBackend>(c: &Calls<'_, B>) {
    let mut live = Vec::new();
    for layer in 0..8u64 {
        live.push(c.allocate(MIB + 64 * KIB * layer));
        let workspace = c.allocate(3 * MIB + 512);
        c.free(workspace);
        live.push(c.allocate(4 * KIB * (layer + 1)));
    }
    let mut grads = Vec::new();
    while let Some(a) = live.pop() {
        grads.push(c.allocate(a.size() / 2 + 256));
        c.free(a);
    }
    for g in grads {
        c.free(g);
    }
}

/// A thread beside the passes: allocations of a few sizes, each held
/// over a few of its calls, until `done`; it holds nothing at its end.
fn beside<B: TestBackend>(c: &Calls<'_, B>, t: u64, done: &AtomicBool) {
    let mut mine = std::collections::VecDeque::new();
    let mut i = 0u64;
    while !done.load(Ordering::Acquire) {
        mine.push_back(c.allocate(256 + (t * 7919 + i * 104_729) % (2 * MIB)));
        if mine.len() > 1 + (i % 3) as usize {
            c.free(mine.pop_front().unwrap());
        }
        i += 1;
        std::thread::yield_now();
    }
    for a in mine {
        c.free(a);
    }
}

/// One thread's work, as in `tests/pool.rs`'s `many_threads`: 300
/// allocations of sizes up to 3 MiB, at most 9 held, each freed in an
/// order that is the same for every thread, so that threads that run one
/// after the other make steps alike (sizes apart).
fn churn<B: TestBackend>(c: &Calls<'_, B>, t: u64) {
    let mut mine = Vec::new();
    for i in 0..300u64 {
        let size = 1 + (t * 7919 + i * 104_729) % (3 * MIB);
        mine.push(c.allocate(size));
        if mine.len() > 8 {
            let a = mine.swap_remove((i as usize * 31) % mine.len());
            c.free(a);
        }
    }
    for a in mine {
        c.free(a);
    }
}

/// Each test's end: every byte back, the tables consistent, every chunk
/// released (an idle layout's region is freed in its stream's order by
/// the first trim, and released by the second).
fn finish<B: TestBackend>(ctx: &Context<B>, pool: &Pool<B>, streams: &[&Stream<B>]) {
    let synchronize = || {
        for s in streams {
            ctx.synchronize_stream(s).unwrap();
        }
    };
    synchronize();
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), 0);
    pool.audit().unwrap();
    pool.trim_to(0).unwrap();
    synchronize();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// How the passes' steps end.
#[derive(Clone, Copy)]
enum Marks {
    /// Where the program empties the pool, by the pool (Note [Steps at
    /// emptying]).
    AtEmptying,
    /// [`Pool::mark_step`] after each pass, by the passes' thread.
    AfterEachPass,
    /// [`Pool::mark_step_at_next_allocation`] after each pass.
    AtTheNextAllocation,
}

/// 40 [`pass`]es on `main` (`None`: synchronous), their steps ended as
/// `marks` says, beside 3 threads of [`beside`], on `others`' streams in
/// turn (synchronous if empty).
fn passes_beside_threads<B: TestBackend>(
    b: &Arc<B>,
    main: Option<usize>,
    others: &[usize],
    marks: Marks,
) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool(&ctx);
    let streams: Vec<Stream<B>> = (0..4).map(|_| ctx.create_stream(DEV).unwrap()).collect();
    let live = Live::default();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for t in 0..3 {
            let on = others.get(t % others.len().max(1)).map(|&i| &streams[i]);
            let (pool, live, done) = (&pool, &live, &done);
            scope.spawn(move || beside(&Calls { pool, on, live }, t as u64, done));
        }
        let c = Calls {
            pool: &pool,
            on: main.map(|i| &streams[i]),
            live: &live,
        };
        let passes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for _ in 0..40 {
                pass(&c);
                match marks {
                    Marks::AtEmptying => {}
                    Marks::AfterEachPass => pool.mark_step().unwrap(),
                    Marks::AtTheNextAllocation => pool.mark_step_at_next_allocation(),
                }
            }
        }));
        done.store(true, Ordering::Release);
        if let Err(panic) = passes {
            std::panic::resume_unwind(panic);
        }
    });
    finish(&ctx, &pool, &streams.iter().collect::<Vec<_>>());
}

/// Synchronous passes, marked by their thread, beside synchronous threads.
pub fn synchronous_passes_marked_beside_synchronous_threads<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, None, &[], Marks::AfterEachPass);
}

/// As [`synchronous_passes_marked_beside_synchronous_threads`], the marks
/// taken at the next allocation, by whichever thread makes it.
pub fn synchronous_passes_marked_at_the_next_allocation<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, None, &[], Marks::AtTheNextAllocation);
}

/// Synchronous passes beside synchronous threads, the pool marking steps
/// where they empty it.
pub fn synchronous_passes_emptying_the_pool<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, None, &[], Marks::AtEmptying);
}

/// Synchronous threads that each make a [`pass`] and then wait for the
/// others, round after round: the pool empties between rounds and marks
/// a step there, steps that are no one thread's and repeat only now and
/// then.
pub fn synchronous_threads_emptying_the_pool_together<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool(&ctx);
    let live = Live::default();
    let rounds = Barrier::new(4);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            let (pool, live, rounds) = (&pool, &live, &rounds);
            scope.spawn(move || {
                let c = Calls {
                    pool,
                    on: None,
                    live,
                };
                for _ in 0..24 {
                    pass(&c);
                    rounds.wait();
                }
            });
        }
    });
    let steps = pool.step_counters().steps;
    assert!(
        steps > 0,
        "no step marked where the threads emptied the pool"
    );
    finish(&ctx, &pool, &[]);
}

/// Synchronous threads of [`churn`] beside a thread that marks steps over
/// and over.
pub fn synchronous_threads_beside_a_marking_thread<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool(&ctx);
    let live = Live::default();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let (pool, live) = (&pool, &live);
                scope.spawn(move || {
                    churn(
                        &Calls {
                            pool,
                            on: None,
                            live,
                        },
                        t,
                    )
                })
            })
            .collect();
        scope.spawn(|| {
            while !done.load(Ordering::Acquire) {
                pool.mark_step().unwrap();
                std::thread::yield_now();
            }
        });
        let joined: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        done.store(true, Ordering::Release);
        for j in joined {
            if let Err(panic) = j {
                std::panic::resume_unwind(panic);
            }
        }
    });
    finish(&ctx, &pool, &[]);
}

/// Passes on a stream that other threads allocate and free on too, the
/// pool marking steps where they empty it: the thread that finds it
/// emptied marks, while the others' calls go on in the step.
pub fn threads_of_one_stream_emptying_the_pool<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, Some(0), &[0], Marks::AtEmptying);
}

/// Passes on a stream that other threads share, marked by its thread.
pub fn threads_of_one_stream_marked<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, Some(0), &[0], Marks::AfterEachPass);
}

/// Passes on a stream beside threads of other streams, the pool marking
/// steps where the passes empty it.
pub fn threads_of_several_streams_emptying_the_pool<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, Some(0), &[1, 2, 3], Marks::AtEmptying);
}

/// Passes on a stream beside threads of two other streams, marked by the
/// passes' thread.
pub fn threads_of_several_streams_marked<B: TestBackend>(b: &Arc<B>) {
    passes_beside_threads(b, Some(0), &[1, 2], Marks::AfterEachPass);
}

suites!(
    synchronous_passes_marked_beside_synchronous_threads,
    synchronous_passes_marked_at_the_next_allocation,
    synchronous_passes_emptying_the_pool,
    synchronous_threads_emptying_the_pool_together,
    synchronous_threads_beside_a_marking_thread,
    threads_of_one_stream_emptying_the_pool,
    threads_of_one_stream_marked,
    threads_of_several_streams_emptying_the_pool,
    threads_of_several_streams_marked,
);
