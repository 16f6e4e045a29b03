//! Small requests in the large arena (Note [Placement], "Small requests in
//! the large arena", in docs/DESIGN.md): once a marked program's first
//! steps are over, in a step that no layout serves, a small request that
//! the small arena's free memory cannot serve takes the large arena's free
//! memory instead of growing the small arena (which moves a unit of the
//! large arena's, or maps a new chunk); in the first steps, and in a step a
//! layout serves, the small arena grows, as in a step the pool marked
//! where the program emptied it. On every backend (the host always, CUDA
//! with `--features gpu-tests`).

use std::sync::Arc;

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, Pool, PoolAttribute, Stream};

#[allow(dead_code)]
mod common;

use common::{check_ends, mark_ends};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const SMALL: u64 = 512 * KIB;

/// Small allocations beyond the small arena's free memory, and where
/// they went.
struct Overflow {
    allocations: Vec<(Allocation, u32)>,
    /// Of them, those in the large arena.
    in_large: usize,
    /// Units the pool mapped for them (growth moves free units of the
    /// large arena, or maps new chunks).
    maps: u64,
}

/// Makes as many [`SMALL`] allocations as the small arena has free
/// memory for, and two more, each written at its ends.
fn overflow_small_arena<B: TestBackend>(b: &B, pool: &Pool<B>, s: &Stream<B>) -> Overflow {
    let before = pool.snapshot();
    let (small_start, small_end) = before.arenas[0];
    let (large_start, large_end) = before.arenas[1];
    let small_free: u64 = (before.free.iter())
        .filter(|&&(at, _)| (small_start..small_end).contains(&at))
        .map(|&(_, len)| len)
        .sum();
    let allocations: Vec<(Allocation, u32)> = (0..small_free / SMALL + 2)
        .map(|i| {
            let a = pool.allocate(SMALL).unwrap();
            let word = 0xC000 + i as u32;
            mark_ends(b, s, &a, word);
            (a, word)
        })
        .collect();
    let in_large = (allocations.iter())
        .filter(|(a, _)| (large_start..large_end).contains(&a.ptr().0))
        .count();
    let maps = pool.stats().maps - before.stats.maps;
    Overflow {
        allocations,
        in_large,
        maps,
    }
}

/// Checks and frees what [`overflow_small_arena`] made.
fn free_checked<B: TestBackend>(b: &B, pool: &Pool<B>, s: &Stream<B>, overflow: Overflow) {
    for (a, word) in overflow.allocations {
        check_ends(b, s, &a, word);
        pool.free(a).unwrap();
    }
}

/// A step that allocates `sizes` and frees them.
fn step<B: TestBackend>(pool: &Pool<B>, sizes: &[u64]) {
    let made: Vec<Allocation> = sizes.iter().map(|&n| pool.allocate(n).unwrap()).collect();
    for a in made {
        pool.free(a).unwrap();
    }
}

/// A pool that keeps what it maps, and a stream.
fn keeping_pool<B: TestBackend>(b: &Arc<B>) -> (Context<B>, Pool<B>, Stream<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = common::pool(&ctx);
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    let s = ctx.create_stream(DeviceId(0)).unwrap();
    (ctx, pool, s)
}

/// A pool that keeps what it maps, with weights live throughout and
/// 16 MiB of free memory in its large arena.
fn start<B: TestBackend>(b: &Arc<B>) -> (Context<B>, Pool<B>, Stream<B>, Allocation) {
    let (ctx, pool, s) = keeping_pool(b);
    let weights = pool.allocate(16 * MIB).unwrap();
    step(&pool, &[16 * MIB]);
    (ctx, pool, s, weights)
}

fn small_requests_take_large_free_memory_after_the_first_steps<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s, weights) = start(b);
    // The first two steps make what the run keeps: their small
    // allocations stay in the small arena, which grows. (Each step makes
    // more allocations than the one before: nothing is laid out.)
    for step in 0..2 {
        let first = overflow_small_arena(b.as_ref(), &pool, &s);
        assert_eq!(first.in_large, 0, "step {step}");
        assert!(first.maps > 0, "step {step}");
        free_checked(b.as_ref(), &pool, &s, first);
        pool.mark_step().unwrap();
    }
    assert_eq!(pool.step_counters().layouts, 0);
    let later = overflow_small_arena(b.as_ref(), &pool, &s);
    assert_eq!(later.in_large, 2, "{}", pool.snapshot());
    assert_eq!(later.maps, 0);
    free_checked(b.as_ref(), &pool, &s, later);
    pool.free(weights).unwrap();
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

fn small_requests_grow_in_a_laid_out_step<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s, weights) = start(b);
    pool.mark_step().unwrap();
    // Steps that repeat: the third is laid out.
    for _ in 0..3 {
        step(&pool, &[4 * MIB, 2 * MIB]);
        pool.mark_step().unwrap();
    }
    assert_eq!(pool.step_counters().layouts, 1);
    // The layout's step, then small allocations past its last event.
    step(&pool, &[4 * MIB, 2 * MIB]);
    let laid_out = overflow_small_arena(b.as_ref(), &pool, &s);
    assert_eq!(laid_out.in_large, 0);
    assert!(laid_out.maps > 0);
    assert!(pool.step_counters().planned >= 2);
    free_checked(b.as_ref(), &pool, &s, laid_out);
    pool.free(weights).unwrap();
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

/// A program that marks no step and empties its pool after each one:
/// the pool marks its steps there, and nothing it keeps from the first
/// steps lies among them, so the small arena grows.
fn small_requests_grow_after_marks_at_emptying<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = keeping_pool(b);
    // Steps of more allocations each time, so that nothing is laid out;
    // the pool marks each as the next one begins (its first step moved
    // free units: growth for `c` takes `a`'s).
    for n in 1..=3 {
        let a = pool.allocate(8 * MIB).unwrap();
        let kept = pool.allocate(8 * MIB).unwrap();
        pool.free(a).unwrap();
        let c = pool.allocate(12 * MIB).unwrap();
        step(&pool, &vec![MIB; n]);
        pool.free(kept).unwrap();
        pool.free(c).unwrap();
    }
    // The step's first allocation marks it; freed, it leaves the large
    // arena free memory (an emptied pool starts afresh, its units parked
    // out of the heap).
    step(&pool, &[16 * MIB]);
    let emptied = overflow_small_arena(b.as_ref(), &pool, &s);
    assert_eq!(pool.step_counters().layouts, 0);
    assert!(
        pool.step_counters().steps >= 3,
        "{:?}",
        pool.step_counters()
    );
    assert_eq!(emptied.in_large, 0, "{}", pool.snapshot());
    assert!(emptied.maps > 0);
    free_checked(b.as_ref(), &pool, &s, emptied);
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

suites!(
    small_requests_take_large_free_memory_after_the_first_steps,
    small_requests_grow_in_a_laid_out_step,
    small_requests_grow_after_marks_at_emptying,
);
