//! Gathering at marks (Note [Growth and remapping], "Gathering at marks",
//! in docs/DESIGN.md): a marked run whose tensors change size every step
//! has its whole free regions moved into one free block at the marks after
//! steps that created chunks, and no live byte moves or changes. On every
//! backend (the host always, CUDA with `--features gpu-tests`).

use std::sync::Arc;

use vmpool::vmm::testing::faulty::Call;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, PoolAttribute};

#[allow(dead_code)]
mod common;

use common::{check_ends, mark_ends};

const DEV: DeviceId = DeviceId(0);
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Experts per layer, and layers: each step makes an activation per
/// expert per layer, of a size that drifts from step to step.
const EXPERTS: u64 = 6;
const LAYERS: u64 = 4;

/// The size of expert `e`'s activation in step `t`: 1 to 9 MiB and some
/// KiB, a different mix every step, all growing by an eighth every four
/// steps (new largest sizes keep coming, and growth with them).
fn expert_size(t: u64, layer: u64, e: u64) -> u64 {
    let h = (t * 7 + layer * 13 + e * 29) % 17;
    (MIB + h * 512 * KIB + (t * 31 + e) % 64 * KIB) * (8 + t / 4) / 8
}

fn drifting_steps_gather_and_keep_every_byte<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = common::pool(&ctx);
    // Kept across synchronizations, as PyTorch's pools keep theirs.
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    // Weights, made before the first mark, live throughout.
    let weights: Vec<Allocation> = (0..8)
        .map(|i| pool.allocate_async(3 * MIB + i * 100 * KIB, &s).unwrap())
        .collect();
    for (i, w) in weights.iter().enumerate() {
        mark_ends(b.as_ref(), &s, w, 0xA000 + i as u32);
    }
    pool.mark_step().unwrap();
    let mut kept: Vec<(u64, (Allocation, u32))> = Vec::new();
    // Long enough to gather more than once on every backend: the host
    // gathers at six marks, from step 58; an H100 at two, from step 91
    // (none in the 60 steps this ran before).
    for t in 0..120u64 {
        let mut live = Vec::new();
        for layer in 0..LAYERS {
            // As many experts as the step routes to: the steps' calls
            // differ, so that no layout serves them (Note [Step layouts]).
            for e in 0..EXPERTS - (t + layer) % 3 {
                let a = pool.allocate_async(expert_size(t, layer, e), &s).unwrap();
                let word = (t * 1000 + layer * 10 + e) as u32;
                mark_ends(b.as_ref(), &s, &a, word);
                live.push((a, word));
            }
            // A temporary, freed at once.
            let tmp = pool.allocate_async((t % 5 + 1) * 700 * KIB, &s).unwrap();
            pool.free_async(tmp, &s).unwrap();
        }
        // Every third step keeps one activation for seven steps (a cache
        // the loop holds), between the memory of the others.
        if t % 3 == 0 {
            kept.push((t + 7, live.swap_remove(live.len() / 2)));
        }
        while let Some((a, word)) = live.pop() {
            check_ends(b.as_ref(), &s, &a, word);
            pool.free_async(a, &s).unwrap();
        }
        while let Some(i) = kept.iter().position(|&(until, _)| until == t) {
            let (_, (a, word)) = kept.swap_remove(i);
            check_ends(b.as_ref(), &s, &a, word);
            pool.free_async(a, &s).unwrap();
        }
        // The frees done, as a training loop's are by its next step.
        ctx.synchronize_stream(&s).unwrap();
        pool.mark_step().unwrap();
        pool.audit().unwrap();
    }
    for (i, w) in weights.iter().enumerate() {
        check_ends(b.as_ref(), &s, w, 0xA000 + i as u32);
    }
    let st = pool.stats();
    assert!(
        st.gathers > 0,
        "no gathering: the case is not covered ({st:?})"
    );
    for (_, (a, word)) in kept {
        check_ends(b.as_ref(), &s, &a, word);
        pool.free_async(a, &s).unwrap();
    }
    for w in weights {
        pool.free_async(w, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

suites!(drifting_steps_gather_and_keep_every_byte);

/// A driver call that fails anywhere in a run of drifting steps (moves
/// and their aliases, gatherings, retired aliases among them) leaves the
/// pool consistent after every call, able to grow, and nothing leaked
/// once it is emptied (host only: the faults are injected). An alias
/// that would not unmap stays out of service where it is, and growth
/// maps around it.
#[test]
fn every_injected_fault_in_drifting_steps_leaves_the_pool_consistent() {
    let calls = [Call::Unmap, Call::Map, Call::SetAccess];
    let injected = common::at_every_call_site(&calls, |b| {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = common::pool(&ctx);
        pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
            .unwrap();
        let s = ctx.create_stream(DEV).unwrap();
        // Each allocation that succeeds is written on the stream, so that
        // its free waits for the stream and the units it frees move under
        // that stream's guard, leaving aliases.
        let made = |size: u64, word: u32| {
            let a = pool.allocate_async(size, &s).ok()?;
            mark_ends(b.as_ref(), &s, &a, word);
            pool.audit().unwrap();
            Some((a, word))
        };
        let weights: Vec<(Allocation, u32)> = (0..8)
            .filter_map(|i| made(3 * MIB + i * 100 * KIB, 0xA000 + i as u32))
            .collect();
        pool.mark_step().unwrap();
        for t in 0..20u64 {
            let mut live = Vec::new();
            for layer in 0..LAYERS {
                for e in 0..EXPERTS - (t + layer) % 3 {
                    let word = (t * 1000 + layer * 10 + e) as u32;
                    live.extend(made(expert_size(t, layer, e), word));
                }
                if let Some((tmp, _)) = made((t % 5 + 1) * 700 * KIB, 0) {
                    pool.free_async(tmp, &s).unwrap();
                }
            }
            for (a, word) in live.into_iter().rev() {
                check_ends(b.as_ref(), &s, &a, word);
                pool.free_async(a, &s).unwrap();
            }
            ctx.synchronize_stream(&s).unwrap();
            pool.mark_step().unwrap();
            pool.audit().unwrap();
        }
        for (a, word) in weights {
            check_ends(b.as_ref(), &s, &a, word);
            pool.free_async(a, &s).unwrap();
        }
        ctx.synchronize_stream(&s).unwrap();
        let fired = b.disarm();
        // After the fault, the pool still grows and gives everything back.
        let a = pool.allocate_async(64 * MIB, &s).unwrap();
        pool.free_async(a, &s).unwrap();
        ctx.synchronize_stream(&s).unwrap();
        pool.trim_to(0).unwrap();
        pool.audit().unwrap();
        fired
    });
    assert!(injected > 100, "only {injected} faults were injected");
}
