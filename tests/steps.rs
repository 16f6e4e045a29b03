//! Step layouts (`Pool::mark_step`, Note [Step layouts] in docs/DESIGN.md):
//! a pool whose program marks its steps serves a repeating step from a
//! laid-out region, with no driver call, and every byte stays where it
//! was written. On every backend (the host always, CUDA with `--features
//! gpu-tests`), then a host-only model test.

use std::sync::Arc;

use proptest::prelude::*;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{
    Allocation, Context, Defragment, Error, Pool, PoolAttribute, PoolProps, Retention, SleepLevel,
    Stream,
};

#[allow(dead_code)]
mod common;

use common::{allocate_on, check_ends, check_span_ends, free_on, mark_ends, pool};

const DEV: DeviceId = DeviceId(0);
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A context, a pool ([`pool`]) and a stream: each test's start.
fn start<B: TestBackend>(b: &Arc<B>) -> (Context<B>, Pool<B>, Stream<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    (ctx, pool, s)
}

/// Each test's end: the stream's work done, the pool's tables consistent.
fn finish<B: TestBackend>(ctx: &Context<B>, pool: &Pool<B>, s: &Stream<B>) {
    ctx.synchronize_stream(s).unwrap();
    pool.audit().unwrap();
}

/// How a step allocates and frees: in stream order on its stream, or
/// synchronously (`Pool::allocate`, `Pool::free`; the stream then only
/// writes and reads the bytes, and each free follows a read of them that
/// waits for the stream).
#[derive(Debug, Clone, Copy)]
enum Calls {
    StreamOrdered,
    Synchronous,
}

impl Calls {
    /// The stream the calls go on: `s`, or none.
    fn on<B: TestBackend>(self, s: &Stream<B>) -> Option<&Stream<B>> {
        match self {
            Calls::StreamOrdered => Some(s),
            Calls::Synchronous => None,
        }
    }

    fn allocate<B: TestBackend>(self, pool: &Pool<B>, s: &Stream<B>, size: u64) -> Allocation {
        allocate_on(pool, self.on(s), size)
    }

    fn free<B: TestBackend>(self, pool: &Pool<B>, s: &Stream<B>, a: Allocation) {
        free_on(pool, self.on(s), a);
    }
}

/// One training-like step at scale `k`: activations made in a forward
/// pass and freed in reverse, a workspace freed at once, gradients made
/// in the backward pass and freed at its end. Every allocation is checked
/// before its free.
fn step<B: TestBackend>(b: &B, pool: &Pool<B>, s: &Stream<B>, k: u64) {
    step_by(b, pool, s, k, Calls::StreamOrdered);
}

/// [`step`], its calls made as `calls` says.
fn step_by<B: TestBackend>(b: &B, pool: &Pool<B>, s: &Stream<B>, k: u64, calls: Calls) {
    if let Some((a, word)) = step_holding(b, pool, s, k, calls, false) {
        check_ends(b, s, &a, word);
        calls.free(pool, s, a);
    }
}

/// `n` steps at scale `k` on `s`, each followed by a mark.
fn marked_steps<B: TestBackend>(b: &B, pool: &Pool<B>, s: &Stream<B>, k: u64, n: usize) {
    for _ in 0..n {
        step(b, pool, s, k);
        pool.mark_step().unwrap();
    }
}

/// [`step`]; with `hold`, the first workspace is not freed but returned,
/// filled with the word returned: a step that keeps what its layout
/// expects to be freed.
fn step_holding<B: TestBackend>(
    b: &B,
    pool: &Pool<B>,
    s: &Stream<B>,
    k: u64,
    calls: Calls,
    hold: bool,
) -> Option<(Allocation, u32)> {
    let mut held = None;
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    for layer in 0..8u32 {
        let a = calls.allocate(pool, s, k * (MIB + 64 * KIB * u64::from(layer)));
        mark_ends(b, s, &a, layer);
        live.push((a, layer));
        let workspace = calls.allocate(pool, s, 3 * MIB + 512);
        let word = 0xAA00 + layer;
        mark_ends(b, s, &workspace, word);
        if hold && held.is_none() {
            held = Some((workspace, word));
        } else {
            check_ends(b, s, &workspace, word);
            calls.free(pool, s, workspace);
        }
        let small = calls.allocate(pool, s, 4 * KIB * u64::from(layer + 1));
        mark_ends(b, s, &small, 0x5A00 + layer);
        live.push((small, 0x5A00 + layer));
    }
    let mut grads = Vec::new();
    while let Some((a, word)) = live.pop() {
        let g = calls.allocate(pool, s, a.size() / 2 + 256);
        mark_ends(b, s, &g, !word);
        grads.push((g, !word));
        check_ends(b, s, &a, word);
        calls.free(pool, s, a);
    }
    for (g, word) in grads {
        check_ends(b, s, &g, word);
        calls.free(pool, s, g);
    }
    held
}

pub fn a_repeated_step_maps_nothing<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    step(b.as_ref(), &pool, &s, 1);
    pool.mark_step().unwrap();
    assert_eq!(pool.step_counters().layouts, 0, "one step is not a pattern");
    step(b.as_ref(), &pool, &s, 1);
    pool.mark_step().unwrap();
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 1);
    assert!(counters.region_bytes > 0);
    let maps = pool.stats().maps;
    marked_steps(b.as_ref(), &pool, &s, 1, 5);
    let after = pool.step_counters();
    assert_eq!(pool.stats().maps, maps, "a laid-out step mapped chunks");
    assert_eq!(after.missed, 0);
    assert_eq!(after.planned, 5 * 40);
    assert_eq!(after.layouts, 1);
    finish(&ctx, &pool, &s);
}

pub fn a_layout_counts_only_what_the_program_holds<B: TestBackend>(b: &Arc<B>) {
    const KEPT: u64 = 256;
    let run = |marked: bool| {
        let (ctx, pool, s) = start(b);
        // Unmarked, a block held throughout keeps the pool from emptying,
        // where the pool would mark steps itself.
        let kept = (!marked).then(|| pool.allocate(KEPT).unwrap());
        for _ in 0..6 {
            step(b.as_ref(), &pool, &s, 2);
            if marked {
                pool.mark_step().unwrap();
            }
        }
        if let Some(kept) = kept {
            pool.free(kept).unwrap();
        }
        finish(&ctx, &pool, &s);
        let region = pool.step_counters().region_bytes;
        assert_eq!(region > 0, marked);
        // Between steps the region is idle: nothing of it is used.
        assert_eq!(pool.stats().used_bytes, 0, "marked: {marked}");
        pool.attribute(PoolAttribute::UsedMemHigh)
    };
    assert_eq!(
        run(true),
        run(false) - KEPT,
        "the high-water marks of used bytes differ"
    );
}

/// A step of more allocations than are planned in the allocation that
/// carries the mark is planned on a thread of its own: the steps go on
/// from the heap meanwhile, and the layout comes at a later mark, from
/// which the steps are planned.
pub fn a_large_step_is_planned_apart<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    let large_step = |pool: &Pool<B>| {
        let mut live = Vec::new();
        for i in 0..5000u64 {
            live.push(pool.allocate_async(256 * (1 + i % 7), &s).unwrap());
            if i % 3 == 2 {
                pool.free_async(live.swap_remove(live.len() / 2), &s)
                    .unwrap();
            }
        }
        for a in live {
            pool.free_async(a, &s).unwrap();
        }
        pool.mark_step().unwrap();
    };
    let mut marks = 0;
    while pool.step_counters().layouts == 0 {
        assert!(marks < 2000, "no layout after {marks} steps");
        large_step(&pool);
        marks += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(
        marks > 2,
        "laid out at the first repeat: planned in the mark"
    );
    let before = pool.step_counters();
    large_step(&pool);
    let after = pool.step_counters();
    assert_eq!(after.planned - before.planned, 5000, "{after:?}");
    assert_eq!(after.missed, before.missed);
    finish(&ctx, &pool, &s);
}

/// A program that marks no step but empties the pool after each has the
/// pool mark them there (Note [Steps at emptying]): its repeated steps
/// are laid out and then map nothing. Its own first mark ends that.
pub fn an_unmarked_pool_emptied_each_step_lays_it_out<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    for _ in 0..6 {
        step(b.as_ref(), &pool, &s, 2);
    }
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 1, "{counters:?}");
    assert_eq!(pool.stats().used_bytes, 0);
    let maps = pool.stats().maps;
    for _ in 0..4 {
        step(b.as_ref(), &pool, &s, 2);
    }
    assert_eq!(pool.stats().maps, maps, "a laid-out step mapped chunks");
    let planned = pool.step_counters().planned;
    assert!(planned >= 4 * 40, "{planned} planned");
    // Marked by the program from now on: the steps between its marks.
    let steps = pool.step_counters().steps;
    pool.mark_step().unwrap();
    step(b.as_ref(), &pool, &s, 2);
    step(b.as_ref(), &pool, &s, 2);
    assert_eq!(pool.step_counters().steps, steps + 1, "the pool marked one");
    finish(&ctx, &pool, &s);
}

/// A program that allocates and frees synchronously (`Pool::allocate`,
/// `Pool::free`) and empties the pool after each step has its steps
/// marked there too, and laid out.
pub fn a_synchronous_program_emptying_each_step_lays_it_out<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    for _ in 0..6 {
        step_by(b.as_ref(), &pool, &s, 2, Calls::Synchronous);
    }
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 1, "{counters:?}");
    let maps = pool.stats().maps;
    for _ in 0..4 {
        step_by(b.as_ref(), &pool, &s, 2, Calls::Synchronous);
    }
    assert_eq!(pool.stats().maps, maps, "a laid-out step mapped chunks");
    let planned = pool.step_counters().planned;
    assert!(planned >= 4 * 40, "{planned} planned");
    finish(&ctx, &pool, &s);
}

/// Steps marked where the program empties the pool that never repeat
/// lay nothing out: after a run of them the pool marks no more, and the
/// program's calls go as they did before (Note [Steps at emptying]). The
/// program's own marks still lay its steps out.
pub fn emptying_marks_that_lay_nothing_out_end<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    // Each step one more block held throughout than the one before: no
    // two make the same events.
    let unlike = |n: u64| {
        let held: Vec<Allocation> = (0..n)
            .map(|_| pool.allocate_async(64 * KIB, &s).unwrap())
            .collect();
        step(b.as_ref(), &pool, &s, 2);
        for a in held {
            pool.free_async(a, &s).unwrap();
        }
    };
    for n in 0..40 {
        unlike(n);
    }
    let marked = pool.step_counters().steps;
    assert!((8..=24).contains(&marked), "{marked} steps marked");
    for n in 40..50 {
        unlike(n);
    }
    let counters = pool.step_counters();
    assert_eq!(counters.steps, marked, "marked after giving up");
    assert_eq!(counters.layouts, 0, "{counters:?}");
    marked_steps(b.as_ref(), &pool, &s, 2, 6);
    assert_eq!(pool.step_counters().layouts, 1, "the program's marks");
    finish(&ctx, &pool, &s);
}

pub fn steps_of_changing_sizes_settle_at_the_largest<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    for k in [1, 2, 1, 3, 2, 1] {
        step(b.as_ref(), &pool, &s, k);
        pool.mark_step().unwrap();
    }
    let (maps, layouts) = (pool.stats().maps, pool.step_counters().layouts);
    for k in [2, 1, 3, 3, 1, 2] {
        step(b.as_ref(), &pool, &s, k);
        pool.mark_step().unwrap();
    }
    assert_eq!(
        pool.stats().maps,
        maps,
        "steps no larger than seen mapped chunks"
    );
    assert_eq!(pool.step_counters().layouts, layouts);
    finish(&ctx, &pool, &s);
}

/// A transformer-like step whose tensors scale with a batch and a
/// sequence length drawn apart under a token budget (`batch * seq` = 4):
/// activations with the tokens, a per-sample buffer with the batch,
/// attention scores with the square of the length. Its events are the
/// same at every shape.
fn budget_step<B: TestBackend>(pool: &Pool<B>, s: &Stream<B>, batch: u64, seq: u64) {
    let mut live = Vec::new();
    for layer in 0..6 {
        live.push(
            pool.allocate_async(batch * seq * MIB + layer * 4 * KIB, s)
                .unwrap(),
        );
        live.push(pool.allocate_async(batch * 2 * MIB, s).unwrap());
        let scores = pool.allocate_async(seq * seq * MIB / 2, s).unwrap();
        live.push(pool.allocate_async(MIB, s).unwrap());
        pool.free_async(scores, s).unwrap();
    }
    while let Some(a) = live.pop() {
        pool.free_async(a, s).unwrap();
    }
}

/// The peak reserved bytes of `shapes` run as [`budget_step`]s, each
/// followed by a mark if `marked`, and the peak used bytes.
fn budget_run<B: TestBackend>(b: &Arc<B>, shapes: &[(u64, u64)], marked: bool) -> (u64, u64) {
    let (ctx, pool, s) = start(b);
    for &(batch, seq) in shapes {
        budget_step(&pool, &s, batch, seq);
        if marked {
            pool.mark_step().unwrap();
        }
    }
    finish(&ctx, &pool, &s);
    (
        pool.attribute(PoolAttribute::ReservedMemHigh),
        pool.attribute(PoolAttribute::UsedMemHigh),
    )
}

pub fn shapes_that_vary_apart_are_not_laid_out<B: TestBackend>(b: &Arc<B>) {
    // Two alike steps first: laid out, then outgrown by the next shape.
    let shapes = [
        (4, 1),
        (4, 1),
        (1, 4),
        (2, 2),
        (1, 4),
        (4, 1),
        (4, 1),
        (2, 2),
        (1, 4),
        (1, 4),
    ];
    let shapes: Vec<_> = shapes.iter().cycle().take(30).copied().collect();
    let (heap, heap_used) = budget_run(b, &shapes, false);
    let (marked, marked_used) = budget_run(b, &shapes, true);
    // The largest slot of each ordinal, laid out together: 20 MiB a
    // layer, where no step needs more than 14.
    assert!(
        marked * 100 <= heap * 102,
        "marked steps reserved {marked} bytes at their peak, the heap alone {heap}"
    );
    assert_eq!(
        marked_used, heap_used,
        "a layout's unused bytes counted as used"
    );
}

pub fn shapes_drawn_apart_settle_at_their_largest<B: TestBackend>(b: &Arc<B>) {
    // Batch and length drawn apart each step, as GPT-2's training here: a
    // layout of each allocation's largest size so far is refused until
    // the largest shape has come, then holds every step.
    let mut x: u64 = 12345;
    let mut draw = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % 4 + 1
    };
    let shapes: Vec<(u64, u64)> = (0..120).map(|_| (draw(), draw())).collect();
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let marked = pool(&ctx);
    let heap = pool(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let mut settled = None;
    for (i, &(batch, seq)) in shapes.iter().enumerate() {
        budget_step(&heap, &s, batch, seq);
        budget_step(&marked, &s, batch, seq);
        marked.mark_step().unwrap();
        if i == shapes.len() / 2 {
            settled = Some((marked.stats().maps, marked.step_counters()));
        }
    }
    let (maps, counters) = settled.unwrap();
    let after = marked.step_counters();
    assert_eq!(marked.stats().maps, maps, "the second half mapped chunks");
    assert_eq!(after.missed, counters.missed, "the second half missed");
    assert_eq!(after.layouts, counters.layouts);
    let high = |p: &Pool<B>, a| p.attribute(a);
    let (reserved, heap_reserved) = (
        high(&marked, PoolAttribute::ReservedMemHigh),
        high(&heap, PoolAttribute::ReservedMemHigh),
    );
    // With each slot as large as its largest so far, unchecked: 1.46
    // times the heap's.
    assert!(
        reserved * 100 <= heap_reserved * 102,
        "marked steps reserved {reserved} bytes at their peak, the heap alone {heap_reserved}"
    );
    assert_eq!(
        high(&marked, PoolAttribute::UsedMemHigh),
        high(&heap, PoolAttribute::UsedMemHigh)
    );
    ctx.synchronize_stream(&s).unwrap();
    marked.audit().unwrap();
    heap.audit().unwrap();
}

/// How a training step's end is marked.
#[derive(Clone, Copy)]
enum MarkAt {
    /// `mark_step` where the optimizer steps, before the gradients go.
    OptimizerStep,
    /// `mark_step_at_next_allocation` there: the mark lands after them.
    NextAllocation,
}

/// A training step whose end is marked where an optimizer's step hook
/// runs: activations made and freed, gradients made, the mark, then the
/// gradients freed (`zero_grad`).
fn optimizer_step<B: TestBackend>(pool: &Pool<B>, s: &Stream<B>, mark: MarkAt) {
    let acts: Vec<Allocation> = (1..=6)
        .map(|i| pool.allocate_async(i * MIB + 256, s).unwrap())
        .collect();
    let grads: Vec<Allocation> = (1..=6)
        .map(|i| pool.allocate_async(i * 512 * KIB, s).unwrap())
        .collect();
    for a in acts.into_iter().rev() {
        pool.free_async(a, s).unwrap();
    }
    match mark {
        MarkAt::OptimizerStep => pool.mark_step().unwrap(),
        MarkAt::NextAllocation => pool.mark_step_at_next_allocation(),
    }
    for g in grads {
        pool.free_async(g, s).unwrap();
    }
}

pub fn a_mark_at_the_next_allocation_takes_in_the_last_frees<B: TestBackend>(b: &Arc<B>) {
    let planned = |mark: MarkAt| {
        let (ctx, pool, s) = start(b);
        for _ in 0..4 {
            optimizer_step(&pool, &s, mark);
        }
        let (maps, before) = (pool.stats().maps, pool.step_counters());
        for _ in 0..5 {
            optimizer_step(&pool, &s, mark);
        }
        let after = pool.step_counters();
        assert_eq!(pool.stats().maps, maps, "a repeated step mapped chunks");
        assert_eq!(after.missed, before.missed);
        finish(&ctx, &pool, &s);
        after.planned - before.planned
    };
    // Marked before the gradients go, the mark waits for their frees,
    // which the step carries into the next (Note [Step layouts]); marked
    // at the next allocation, it comes after them. Either way the whole
    // step is laid out.
    assert_eq!(planned(MarkAt::OptimizerStep), 5 * 12);
    assert_eq!(planned(MarkAt::NextAllocation), 5 * 12);
}

/// A step of kind `kind`, then a mark: `kind + 2` allocations, freed in
/// reverse, so that two kinds part at the first free of the smaller.
fn kind_step<B: TestBackend>(pool: &Pool<B>, s: &Stream<B>, kind: u64) {
    let live: Vec<Allocation> = (0..kind + 2)
        .map(|i| pool.allocate_async((i + 1) * MIB, s).unwrap())
        .collect();
    for a in live.into_iter().rev() {
        pool.free_async(a, s).unwrap();
    }
    pool.mark_step().unwrap();
}

pub fn layouts_that_do_not_last_wait_for_longer_runs<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    // Kinds two steps each: the first pair is laid out and left at the
    // next step; later pairs wait for a third step alike, which never
    // comes.
    for kind in 0..10 {
        kind_step(&pool, &s, kind);
        kind_step(&pool, &s, kind);
    }
    assert_eq!(pool.step_counters().layouts, 1);
    // A kind that repeats long enough is laid out, and once its layout
    // has served a whole step, a pair is laid out again.
    for _ in 0..4 {
        kind_step(&pool, &s, 3);
    }
    assert_eq!(pool.step_counters().layouts, 2);
    let planned = pool.step_counters().planned;
    kind_step(&pool, &s, 3);
    assert_eq!(pool.step_counters().planned, planned + 5);
    kind_step(&pool, &s, 7);
    kind_step(&pool, &s, 7);
    assert_eq!(pool.step_counters().layouts, 3);
    finish(&ctx, &pool, &s);
}

pub fn what_outlives_its_step_stays_intact<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    let other = ctx.create_stream(DEV).unwrap();
    pool.mark_step().unwrap();
    let mut kept: Vec<(Allocation, u32)> = Vec::new();
    for i in 0..6u32 {
        // In step 3, a planned workspace lives on: its slot stays taken
        // while steps 4 and 5 want it.
        kept.extend(step_holding(
            b.as_ref(),
            &pool,
            &s,
            1,
            Calls::StreamOrdered,
            i == 3,
        ));
        // Made like the step's own allocations, but kept past the mark.
        let a = pool.allocate_async(2 * MIB, &s).unwrap();
        mark_ends(b.as_ref(), &s, &a, 0x1000 + i);
        kept.push((a, 0x1000 + i));
        // A planned allocation freed on another stream, once laid out.
        let c = pool.allocate_async(MIB, &s).unwrap();
        ctx.synchronize_stream(&s).unwrap();
        pool.free_async(c, &other).unwrap();
        pool.mark_step().unwrap();
    }
    for (a, word) in kept {
        check_ends(b.as_ref(), &s, &a, word);
        pool.free_async(a, &s).unwrap();
    }
    assert!(pool.step_counters().planned > 0);
    ctx.synchronize_stream(&s).unwrap();
    ctx.synchronize_stream(&other).unwrap();
    pool.audit().unwrap();
}

pub fn steps_that_never_repeat_give_their_region_back<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    for n in 1..8u64 {
        // A different number of allocations each step.
        let live: Vec<Allocation> = (0..n)
            .map(|i| pool.allocate_async((i + n) * MIB, &s).unwrap())
            .collect();
        for a in live {
            pool.free_async(a, &s).unwrap();
        }
        pool.mark_step().unwrap();
    }
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 0);
    assert_eq!(counters.region_bytes, 0);
    finish(&ctx, &pool, &s);
}

pub fn steps_that_free_nothing_within_are_not_laid_out<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    // Each step's allocations are freed in the next one (outputs kept
    // until the step after): the steps repeat, but nothing in them would
    // take a slot, and a layout of nothing would ask for a region of no
    // bytes.
    let mut kept: Vec<Allocation> = Vec::new();
    for _ in 0..6 {
        let made: Vec<Allocation> = (1..=3)
            .map(|i| pool.allocate_async(i * MIB, &s).unwrap())
            .collect();
        pool.mark_step().unwrap();
        for a in std::mem::replace(&mut kept, made) {
            pool.free_async(a, &s).unwrap();
        }
    }
    let counters = pool.step_counters();
    assert_eq!(
        (counters.layouts, counters.region_bytes),
        (0, 0),
        "{counters:?}"
    );
    for a in kept {
        pool.free_async(a, &s).unwrap();
    }
    finish(&ctx, &pool, &s);
}

pub fn a_step_that_goes_another_way_gives_its_region_back<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 2, 3);
    let region = pool.step_counters().region_bytes;
    assert!(region > 12 * MIB, "{region}");
    let reserved = pool.stats().reserved_bytes;
    // Another kind of step (an evaluation): where its events leave the
    // layout's (its third allocation), the layout goes, and its region
    // goes back to the heap once the two allocations planned before that
    // are freed. The pool grows by no more than what the step asked for
    // while the region was held.
    let other: Vec<Allocation> = (1..=4)
        .map(|i| pool.allocate_async(i * MIB + 4096, &s).unwrap())
        .collect();
    for a in other {
        pool.free_async(a, &s).unwrap();
    }
    assert_eq!(pool.step_counters().region_bytes, 0);
    let grown = pool.stats().reserved_bytes - reserved;
    assert!(grown <= 8 * MIB, "the other step grew the pool by {grown}");
    pool.mark_step().unwrap();
    // The training steps again: laid out once more after two of them.
    marked_steps(b.as_ref(), &pool, &s, 2, 3);
    assert_eq!(pool.step_counters().layouts, 2);
    finish(&ctx, &pool, &s);
}

pub fn a_trim_gives_an_idle_layout_back<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    let lay_out = || {
        marked_steps(b.as_ref(), &pool, &s, 2, 3);
        assert!(pool.step_counters().region_bytes > 0);
    };
    pool.mark_step().unwrap();
    lay_out();
    // Idle between steps: given up, its region freed in stream order,
    // released by a trim once the stream has passed the free.
    pool.trim_to(0).unwrap();
    assert_eq!(pool.step_counters().region_bytes, 0);
    ctx.synchronize_stream(&s).unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    // Laid out again; with a planned allocation live, a trim keeps it.
    lay_out();
    let planned = pool.step_counters().planned;
    let a = pool.allocate_async(2 * MIB, &s).unwrap();
    assert_eq!(pool.step_counters().planned, planned + 1);
    pool.trim_to(0).unwrap();
    assert!(pool.step_counters().region_bytes > 0);
    pool.free_async(a, &s).unwrap();
    finish(&ctx, &pool, &s);
}

/// A region given up goes back to the heap in its stream's order, its
/// bytes counted out of the used ones by the pool's lock: they were never
/// the program's, so they lend the stream's hot path no credit. With
/// credit, the next allocation of the region's size took the pending
/// region on the hot path, and the program held more than the high-water
/// mark said.
pub fn a_region_given_up_lends_its_stream_no_credit<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 2, 3);
    let region = pool.step_counters().region_bytes;
    assert!(region > 0);
    // The high-water mark reset to what the program holds (nothing). The
    // next step's first allocation outgrows its slot: the layout ends,
    // its region freed in stream order, and the allocation, of the
    // region's size, could take it on the hot path.
    pool.set_attribute(PoolAttribute::UsedMemHigh, 0).unwrap();
    let a = pool.allocate_async(region, &s).unwrap();
    assert_eq!(pool.step_counters().region_bytes, 0);
    let used = pool.attribute(PoolAttribute::UsedMemCurrent);
    assert_eq!(used, region.next_multiple_of(256));
    assert_eq!(pool.attribute(PoolAttribute::UsedMemHigh), used);
    pool.free_async(a, &s).unwrap();
    finish(&ctx, &pool, &s);
}

/// A planned allocation freed on another stream while a graph capture is
/// under way, when that stream cannot be waited for, keeps its slot until
/// the capture is over; the next mark waits and frees it. Kept for good
/// before, its bytes stayed used and its slot taken.
pub fn a_planned_free_during_a_capture_is_carried_out_after_it<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    let other = ctx.create_stream(DEV).unwrap();
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 1, 3);
    let planned = pool.step_counters().planned;
    let a = pool.allocate_async(MIB, &s).unwrap();
    assert_eq!(pool.step_counters().planned, planned + 1);
    let capture = ctx.graph_capture();
    let e = ctx.create_event(DEV).unwrap();
    ctx.record_event(&e, &s).unwrap();
    ctx.stream_wait_event(&other, &e).unwrap();
    pool.free_async(a, &other).unwrap();
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), MIB);
    drop(capture);
    pool.mark_step().unwrap();
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), 0);
    // Nothing is left of it: the layout, idle, goes with a trim, and its
    // memory with the next once the streams have passed the frees.
    pool.trim_to(0).unwrap();
    ctx.synchronize_stream(&s).unwrap();
    ctx.synchronize_stream(&other).unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    finish(&ctx, &pool, &s);
}

pub fn a_quiet_stream_hands_the_layout_on<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool(&ctx);
    let first = ctx.create_stream(DEV).unwrap();
    let second = ctx.create_stream(DEV).unwrap();
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &first, 1, 3);
    assert_eq!(pool.step_counters().layouts, 1);
    // The program moves to another stream. Its first step is not the
    // layout's stream's, which makes no allocation: the layout goes, and
    // the other stream's steps are laid out in their turn.
    marked_steps(b.as_ref(), &pool, &second, 1, 4);
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 2);
    let planned = counters.planned;
    step(b.as_ref(), &pool, &second, 1);
    assert_eq!(pool.step_counters().planned, planned + 40);
    ctx.synchronize_stream(&first).unwrap();
    ctx.synchronize_stream(&second).unwrap();
    pool.audit().unwrap();
}

pub fn a_step_that_does_more_at_its_end_keeps_its_layout<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 1, 3);
    // Every few steps, a little more after the step's own work (a log):
    // served by the heap, grown by under a hundredth of the region, the
    // layout kept.
    for _ in 0..3 {
        step(b.as_ref(), &pool, &s, 1);
        let extra = pool.allocate_async(64 * KIB, &s).unwrap();
        pool.free_async(extra, &s).unwrap();
        pool.mark_step().unwrap();
        step(b.as_ref(), &pool, &s, 1);
        pool.mark_step().unwrap();
    }
    let counters = pool.step_counters();
    assert_eq!(counters.layouts, 1);
    assert_eq!(counters.planned, 7 * 40, "the third step on, all planned");
    finish(&ctx, &pool, &s);
}

pub fn a_step_that_goes_on_past_its_layout_gives_it_up_before_growing<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 1, 3);
    assert!(pool.step_counters().region_bytes > 0);
    let reserved = pool.attribute(PoolAttribute::ReservedMemHigh);
    // The laid-out step, then as much again before the next mark (a new
    // model built and trained after the last): the heap takes the idle
    // region's memory instead of growing beside it.
    step(b.as_ref(), &pool, &s, 1);
    step(b.as_ref(), &pool, &s, 1);
    assert_eq!(pool.step_counters().region_bytes, 0, "given up");
    let grown = pool.attribute(PoolAttribute::ReservedMemHigh);
    assert!(
        grown * 100 <= reserved * 105,
        "reserved {grown} bytes at the peak, {reserved} before"
    );
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 1, 3);
    assert_eq!(pool.step_counters().layouts, 2, "laid out again");
    finish(&ctx, &pool, &s);
}

/// A program that empties the pool and goes on past the layout (a new
/// model built after the last mark) finds the pool as from empty: its
/// first allocation gives the idle layout up and starts afresh (Note
/// [Starting afresh]), instead of taking the heap's leftovers beside the
/// region.
pub fn an_emptied_pool_gives_its_idle_layout_up_and_starts_afresh<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    // A model's weights, live across its steps, then freed with the rest.
    let weights = pool.allocate_async(7 * MIB, &s).unwrap();
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 1, 3);
    step(b.as_ref(), &pool, &s, 1);
    assert!(pool.step_counters().region_bytes > 0);
    assert!(pool.stats().remaps > 0, "the case needs a move");
    pool.free_async(weights, &s).unwrap();
    let before = pool.stats();
    let first = pool.allocate_async(5 * MIB + 4096, &s).unwrap();
    let after = pool.stats();
    assert_eq!(pool.step_counters().region_bytes, 0, "given up");
    assert!(
        after.spare_bytes > before.spare_bytes,
        "started afresh: the free units parked"
    );
    assert_eq!(after.chunks_created, before.chunks_created);
    pool.free_async(first, &s).unwrap();
    finish(&ctx, &pool, &s);
}

pub fn a_region_given_up_around_live_allocations_goes_back_at_once<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, s) = start(b);
    pool.mark_step().unwrap();
    marked_steps(b.as_ref(), &pool, &s, 2, 3);
    let region = pool.step_counters().region_bytes;
    assert!(region > 20 * MIB, "{region}");
    let (reserved, planned) = (pool.stats().reserved_bytes, pool.step_counters().planned);
    // The step's first two allocations take their slots and live on; the
    // third call is not the layout's (it frees the second there).
    let kept: Vec<(Allocation, u32)> = (0..2u32)
        .map(|i| {
            let a = pool.allocate_async(2 * MIB, &s).unwrap();
            mark_ends(b.as_ref(), &s, &a, 0xC0 + i);
            (a, 0xC0 + i)
        })
        .collect();
    assert_eq!(pool.step_counters().planned, planned + 2);
    let other = pool.allocate_async(MIB, &s).unwrap();
    // The layout went, and its region with it but for the two: the rest is
    // the heap's at once, which serves a large allocation without growing.
    assert_eq!(pool.step_counters().region_bytes, 0);
    let large = pool.allocate_async(region - 8 * MIB, &s).unwrap();
    assert_eq!(pool.stats().reserved_bytes, reserved, "the pool grew");
    for (a, word) in kept {
        check_ends(b.as_ref(), &s, &a, word);
        pool.free_async(a, &s).unwrap();
    }
    pool.free_async(other, &s).unwrap();
    pool.free_async(large, &s).unwrap();
    finish(&ctx, &pool, &s);
    assert_eq!(pool.stats().used_bytes, 0);
}

pub fn a_pool_dropped_with_an_idle_layout_gives_its_memory_back<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let free = || b.mem_info(DEV).unwrap().free;
    let before = free();
    {
        let pool = pool(&ctx);
        pool.mark_step().unwrap();
        marked_steps(b.as_ref(), &pool, &s, 1, 3);
        assert!(pool.step_counters().region_bytes > 0);
        ctx.synchronize_stream(&s).unwrap();
    }
    assert_eq!(free(), before, "the dropped pool kept memory mapped");
}

pub fn marking_a_sleeping_pool_is_refused<B: TestBackend>(b: &Arc<B>) {
    let (_ctx, pool, s) = start(b);
    pool.sleep(SleepLevel::DiscardAll, &s).unwrap();
    assert!(matches!(pool.mark_step(), Err(Error::Asleep)));
    pool.wake(&s).unwrap();
    pool.mark_step().unwrap();
}

/// Three allocations of 8 MiB on `s`, freed at the end of the step.
fn three_step<B: TestBackend>(pool: &Pool<B>, s: &Stream<B>) {
    let a = pool.allocate_async(8 * MIB, s).unwrap();
    let b = pool.allocate_async(8 * MIB, s).unwrap();
    let c = pool.allocate_async(8 * MIB, s).unwrap();
    for x in [a, b, c] {
        pool.free_async(x, s).unwrap();
    }
}

/// Once `s`'s steps are done, `other` frees 8 MiB and keeps the 4 MiB
/// after them, the island it returns, in the middle of the steps' free
/// memory: no free block then holds three_step's 24 MiB.
fn leave_island<B: TestBackend>(
    ctx: &Context<B>,
    pool: &Pool<B>,
    s: &Stream<B>,
    other: &Stream<B>,
) -> Allocation {
    ctx.synchronize_stream(s).unwrap();
    let x = pool.allocate_async(8 * MIB, other).unwrap();
    let island = pool.allocate_async(4 * MIB, other).unwrap();
    pool.free_async(x, other).unwrap();
    ctx.synchronize_stream(other).unwrap();
    island
}

pub fn a_layout_the_pool_cannot_afford_is_given_up<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    // Nothing unused moves, and the limit holds the steps but not a
    // region beside them.
    let pool = ctx
        .create_pool(&PoolProps {
            va_size: Some(4 << 30),
            max_size: Some(32 * MIB),
            defragment: Defragment::Off,
            ..PoolProps::new(DEV)
        })
        .unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let other = ctx.create_stream(DEV).unwrap();
    pool.mark_step().unwrap();
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    // Between the steps, another stream leaves an allocation in the middle
    // of the step's memory: [8 MiB free][island][12 MiB free].
    let island = leave_island(&ctx, &pool, &s, &other);
    three_step(&pool, &s);
    // The step repeats, but no free block holds its 24 MiB, and growing
    // one would pass the limit.
    pool.mark_step().unwrap();
    let counters = pool.step_counters();
    assert_eq!((counters.layouts, counters.refused), (0, 1), "{counters:?}");
    assert_eq!(counters.region_bytes, 0);
    // The steps go on from the heap; the next try waits for two repeats.
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    assert_eq!(pool.step_counters().refused, 1, "tried again at once");
    pool.free_async(island, &other).unwrap();
    ctx.synchronize_stream(&other).unwrap();
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    let counters = pool.step_counters();
    assert_eq!((counters.layouts, counters.refused), (1, 1), "{counters:?}");
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    assert_eq!(pool.step_counters().planned, 3);
    finish(&ctx, &pool, &s);
}

pub fn after_a_layout_that_did_not_last_a_region_comes_from_free_memory<B: TestBackend>(
    b: &Arc<B>,
) {
    let (ctx, pool, s) = start(b);
    let other = ctx.create_stream(DEV).unwrap();
    pool.mark_step().unwrap();
    // A pair alike is laid out; the next step goes another way in its
    // first step, so the layout did not last.
    kind_step(&pool, &s, 0);
    kind_step(&pool, &s, 0);
    kind_step(&pool, &s, 1);
    assert_eq!(pool.step_counters().layouts, 1);
    // Another stream leaves an allocation in the steps' memory, so that
    // no free block holds three_step's 24 MiB: a region would map.
    let island = leave_island(&ctx, &pool, &s, &other);
    // Three steps alike (after a layout that did not last, a run of two
    // repeats): the region is refused, no chunk mapped at the mark.
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    three_step(&pool, &s);
    let maps = pool.stats().maps;
    pool.mark_step().unwrap();
    let counters = pool.step_counters();
    assert_eq!((counters.layouts, counters.refused), (1, 1), "{counters:?}");
    assert_eq!(pool.stats().maps, maps, "a region mapped chunks");
    // With the allocation gone, free memory holds it: laid out.
    pool.free_async(island, &other).unwrap();
    ctx.synchronize_stream(&other).unwrap();
    for _ in 0..3 {
        three_step(&pool, &s);
        pool.mark_step().unwrap();
    }
    let counters = pool.step_counters();
    assert_eq!((counters.layouts, counters.refused), (2, 1), "{counters:?}");
    three_step(&pool, &s);
    pool.mark_step().unwrap();
    assert_eq!(pool.step_counters().planned, counters.planned + 3);
    finish(&ctx, &pool, &s);
}

suites!(
    a_repeated_step_maps_nothing,
    a_mark_at_the_next_allocation_takes_in_the_last_frees,
    a_layout_counts_only_what_the_program_holds,
    an_unmarked_pool_emptied_each_step_lays_it_out,
    a_synchronous_program_emptying_each_step_lays_it_out,
    a_large_step_is_planned_apart,
    emptying_marks_that_lay_nothing_out_end,
    steps_of_changing_sizes_settle_at_the_largest,
    shapes_that_vary_apart_are_not_laid_out,
    shapes_drawn_apart_settle_at_their_largest,
    layouts_that_do_not_last_wait_for_longer_runs,
    what_outlives_its_step_stays_intact,
    steps_that_never_repeat_give_their_region_back,
    steps_that_free_nothing_within_are_not_laid_out,
    a_step_that_goes_another_way_gives_its_region_back,
    a_trim_gives_an_idle_layout_back,
    a_region_given_up_lends_its_stream_no_credit,
    a_planned_free_during_a_capture_is_carried_out_after_it,
    a_quiet_stream_hands_the_layout_on,
    a_region_given_up_around_live_allocations_goes_back_at_once,
    a_step_that_does_more_at_its_end_keeps_its_layout,
    a_step_that_goes_on_past_its_layout_gives_it_up_before_growing,
    an_emptied_pool_gives_its_idle_layout_up_and_starts_afresh,
    a_pool_dropped_with_an_idle_layout_gives_its_memory_back,
    marking_a_sleeping_pool_is_refused,
    a_layout_the_pool_cannot_afford_is_given_up,
    after_a_layout_that_did_not_last_a_region_comes_from_free_memory,
);

/// How the model test's program calls the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelCalls {
    /// In stream order, marking its steps.
    Marked,
    /// Synchronously, marking its steps.
    Synchronous,
    /// In stream order, marking none: the pool marks a step where the
    /// program empties it (Note [Steps at emptying]).
    Unmarked,
    /// Synchronously, marking none, as [`ModelCalls::Unmarked`].
    SynchronousUnmarked,
}

impl ModelCalls {
    fn order(self) -> Calls {
        match self {
            ModelCalls::Synchronous | ModelCalls::SynchronousUnmarked => Calls::Synchronous,
            ModelCalls::Marked | ModelCalls::Unmarked => Calls::StreamOrdered,
        }
    }

    /// Whether the program marks its steps.
    fn marks(self) -> bool {
        !matches!(self, ModelCalls::Unmarked | ModelCalls::SynchronousUnmarked)
    }
}

/// How the model test's program ends a step.
#[derive(Debug, Clone, Copy)]
enum ModelMark {
    /// [`Pool::mark_step`].
    Now,
    /// [`Pool::mark_step_at_next_allocation`].
    AtTheNextAllocation,
}

/// One step of the model test: which template, at what scale, how it is
/// marked, and what goes differently. `n`: the n-th allocation of the
/// step's template.
#[derive(Debug, Clone)]
struct ModelStep {
    template: usize,
    scale: u64,
    mark: ModelMark,
    /// The n-th allocation lives on past the step, to the test's end.
    hold: Option<usize>,
    /// The n-th allocation is freed in the next step, after its first
    /// allocation: across the mark.
    carry: Option<usize>,
    /// The n-th allocation is not made.
    skip: Option<usize>,
    /// The n-th allocation is freed on another stream, behind an event.
    away: Option<usize>,
    /// The pool is trimmed to nothing after the n-th allocation.
    trim: Option<usize>,
    /// The pool sleeps, keeping its bytes, and wakes after the mark.
    sleep: bool,
    /// After the n-th allocation, to the step's end, a graph capture is
    /// announced to the pools (Note [Graph captures]): nothing planned,
    /// nothing waited for.
    captured: Option<usize>,
}

/// A run of steps alike, so that layouts are made, each step sometimes
/// going differently.
fn model_run() -> impl Strategy<Value = Vec<ModelStep>> {
    let odd = || prop::option::weighted(0.15, 0..12usize);
    let mark = prop_oneof![3 => Just(ModelMark::Now), 1 => Just(ModelMark::AtTheNextAllocation)];
    (0..3usize, 1..4u64, 1..6usize).prop_flat_map(move |(template, scale, len)| {
        prop::collection::vec(
            (
                mark.clone(),
                odd(),
                odd(),
                odd(),
                odd(),
                prop::option::weighted(0.05, 0..12usize),
                prop::bool::weighted(0.05),
                prop::option::weighted(0.1, 0..12usize),
            ),
            len,
        )
        .prop_map(move |steps| {
            steps
                .into_iter()
                .map(
                    |(mark, hold, carry, skip, away, trim, sleep, captured)| ModelStep {
                        template,
                        scale,
                        mark,
                        hold,
                        carry,
                        skip,
                        away,
                        trim,
                        sleep,
                        captured,
                    },
                )
                .collect()
        })
    })
}

/// The model test's program: its live allocations, each with the word at
/// its ends, and the bytes it holds as the pool counts them.
struct ModelProgram<'p, B: TestBackend> {
    b: &'p B,
    pool: &'p Pool<B>,
    ctx: &'p Context<B>,
    s: &'p Stream<B>,
    other: &'p Stream<B>,
    calls: ModelCalls,
    /// Start -> end, and the word at its ends, of every live allocation.
    live: std::collections::BTreeMap<u64, (u64, u32)>,
    holds: u64,
    most: u64,
    next_word: u32,
    /// A block freed on the other stream may since have served a request
    /// up to an eighth smaller, whole, on the program's: the pool then
    /// counts a little more than the program asked for.
    freed_away: bool,
}

impl<B: TestBackend> ModelProgram<'_, B> {
    /// Whether the pool's count `counted` is the program's `bytes`: the
    /// same, or (since a free on the other stream) at most an eighth more
    /// a block.
    fn counts(&self, counted: u64, bytes: u64) -> bool {
        if self.freed_away {
            bytes <= counted && counted * 7 <= bytes * 8
        } else {
            counted == bytes
        }
    }

    fn allocate(&mut self, size: u64) -> Result<(Allocation, u32), TestCaseError> {
        let a = self.calls.order().allocate(self.pool, self.s, size);
        let (at, end) = (a.ptr().0, a.ptr().0 + a.size());
        let before = self.live.range(..=at).next_back();
        prop_assert!(
            before.is_none_or(|(_, &(e, _))| e <= at),
            "{at:#x} overlaps a live allocation"
        );
        prop_assert!(
            self.live.range(at..end).next().is_none(),
            "{at:#x} overlaps a live allocation"
        );
        self.next_word += 1;
        self.live.insert(at, (end, self.next_word));
        self.holds += a.size().next_multiple_of(256);
        self.most = self.most.max(self.holds);
        mark_ends(self.b, self.s, &a, self.next_word);
        Ok((a, self.next_word))
    }

    /// Sleeps the pool, keeping its bytes, and wakes it: every live
    /// allocation keeps the words at its ends.
    fn sleep_and_wake(&self) {
        self.pool.sleep(SleepLevel::KeepTagged, self.s).unwrap();
        self.pool.wake(self.s).unwrap();
        for (&at, &(end, word)) in &self.live {
            check_span_ends(self.b, self.s, at, end - at, word);
        }
    }

    /// Checks the allocation's ends, then frees it on the program's
    /// stream, or (`away`) on the other stream behind an event; at once
    /// if the program's calls are synchronous.
    fn free(&mut self, (a, word): (Allocation, u32), away: bool) {
        check_ends(self.b, self.s, &a, word);
        self.live.remove(&a.ptr().0);
        self.holds -= a.size().next_multiple_of(256);
        match (self.calls.order(), away) {
            (Calls::StreamOrdered, true) => {
                self.freed_away = true;
                let e = self.ctx.create_event(DEV).unwrap();
                self.ctx.record_event(&e, self.s).unwrap();
                self.ctx.stream_wait_event(self.other, &e).unwrap();
                self.pool.free_async(a, self.other).unwrap();
            }
            (order, _) => order.free(self.pool, self.s, a),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Runs of steps drawn from three templates, at random scales, called
    /// in stream order or synchronously, marked now or at the next
    /// allocation or (unmarked, either way) where the pool empties, some
    /// holding an allocation past their end or into the next step, leaving
    /// one out, freeing one on another stream, trimming the pool or
    /// sleeping it (keeping its bytes) between steps: no allocation ever
    /// overlaps a live one, each keeps the words written at its ends
    /// until its free, the pool's tables stay consistent, and its used
    /// bytes are what the program holds, and at their most what it held
    /// (or a little more, as [`ModelProgram::counts`] says).
    #[test]
    fn model(
        runs in prop::collection::vec(model_run(), 1..6),
        calls in prop_oneof![
            2 => Just(ModelCalls::Marked),
            1 => Just(ModelCalls::Synchronous),
            1 => Just(ModelCalls::Unmarked),
            1 => Just(ModelCalls::SynchronousUnmarked),
        ],
    ) {
        let b = common::host();
        let ctx = Context::new(Arc::clone(&b)).unwrap();
        let pool = pool(&ctx);
        pool.set_retention(Retention::Keep);
        let s = ctx.create_stream(DEV).unwrap();
        let other = ctx.create_stream(DEV).unwrap();
        let templates: [&[u64]; 3] = [
            &[MIB, 3 * MIB, 256, 2 * MIB + 256, 64 * KIB, 5 * MIB, 700, MIB, 3 * MIB, 12 * KIB, 2 * MIB, 9 * MIB],
            &[4 * MIB, 4 * MIB, 1024, 4 * MIB, 300 * KIB, 8 * MIB, 4 * MIB, 512, MIB, MIB, 2 * MIB, 6 * MIB],
            &[256, 512, 768, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144],
        ];
        let mut p = ModelProgram {
            b: &*b,
            pool: &pool,
            ctx: &ctx,
            s: &s,
            other: &other,
            calls,
            live: std::collections::BTreeMap::new(),
            holds: 0,
            most: 0,
            next_word: 0,
            freed_away: false,
        };
        let mut held = Vec::new();
        let mut carried: Vec<(Allocation, u32)> = Vec::new();
        let marks = calls.marks();
        if marks {
            pool.mark_step().unwrap();
        }
        for st in runs.iter().flatten() {
            let mut capture = None;
            let mut made: Vec<(usize, (Allocation, u32))> = Vec::new();
            for (i, &size) in templates[st.template].iter().enumerate() {
                if st.skip == Some(i) {
                    continue;
                }
                made.push((i, p.allocate(size * st.scale)?));
                if st.captured == Some(i) {
                    capture = Some(ctx.graph_capture());
                }
                if i == 0 || (st.skip == Some(0) && i == 1) {
                    // On the other stream where this step frees one there.
                    for a in carried.drain(..) {
                        p.free(a, st.away.is_some());
                    }
                }
                // Every third allocation frees the one before it.
                if i % 3 == 2 && made.len() >= 2 {
                    let (j, a) = made.remove(made.len() - 2);
                    if st.hold == Some(j) {
                        held.push(a);
                    } else {
                        p.free(a, st.away == Some(j));
                    }
                }
                if st.trim == Some(i) {
                    pool.trim_to(0).unwrap();
                }
            }
            for (j, a) in made.into_iter().rev() {
                if st.hold == Some(j) {
                    held.push(a);
                } else if st.carry == Some(j) {
                    carried.push(a);
                } else {
                    p.free(a, st.away == Some(j));
                }
            }
            drop(capture);
            match st.mark {
                _ if !marks => {}
                ModelMark::Now => pool.mark_step().unwrap(),
                ModelMark::AtTheNextAllocation => pool.mark_step_at_next_allocation(),
            }
            // A planned allocation freed on the other stream under the
            // capture stays counted until the pool's next call that can
            // wait for that stream: the mark, unless the pool marks.
            if marks || st.captured.is_none() {
                let used = pool.attribute(PoolAttribute::UsedMemCurrent);
                prop_assert!(p.counts(used, p.holds), "{used} bytes used, {} held", p.holds);
            }
            if st.sleep {
                p.sleep_and_wake();
            }
        }
        for a in held.into_iter().chain(carried) {
            p.free(a, false);
        }
        ctx.synchronize_stream(&s).unwrap();
        ctx.synchronize_stream(&other).unwrap();
        // A trim carries out what a capture deferred, if nothing since has.
        pool.trim_to(u64::MAX).unwrap();
        pool.audit().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(pool.stats().used_bytes, 0);
        let high = pool.attribute(PoolAttribute::UsedMemHigh);
        prop_assert!(p.counts(high, p.most), "{high} bytes used at most, {} held", p.most);
    }
}
