//! Joining where steps keep moving units (Note [Growth and remapping],
//! "Joining where steps keep moving units", in docs/DESIGN.md): the
//! mixture of experts' recorded steps, replayed in stream order, re-form
//! their largest request's space step after step until the pool joins
//! its free units into larger chunks; the pool then stops moving units,
//! stays consistent at every mark, and no live byte moves or changes; a
//! joining whose driver call fails leaves it so too. The replay runs on
//! the host always and on CUDA with `--features gpu-tests` (the
//! recording's pool holds 10 GB); the faults are injected on the host.

use std::sync::Arc;

use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::host::Census;
use vmpool::vmm::testing::faulty::{Call, Faulty};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, PoolStats};

#[allow(dead_code)]
mod common;

use common::{allocate_on, check_ends, free_on, mark_ends};

const DEV: DeviceId = DeviceId(0);

/// Allocations whose ends are written and checked: the large ones, where
/// the joined units lie.
const CHECKED_FROM: u64 = 1 << 20;

fn recording() -> Trace {
    common::recorded("moe_train_torch_marked300")
}

/// How a replay calls the pool.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Calls {
    /// `allocate_async` and `free_async` on one stream, as PyTorch calls.
    StreamOrdered,
    /// `allocate` and `free`: the same driver calls on every run.
    Synchronous,
}

/// Replays the first `steps` steps of `trace` on a pool of `b` at the C
/// layer's growth chunks (a 1024th), checking the ends of the large
/// allocations and auditing the pool at each mark; then frees what is
/// live, trims the pool and drops it. Returns the pool's statistics after
/// each mark.
fn replay<B: TestBackend>(b: &Arc<B>, trace: &Trace, calls: Calls, steps: usize) -> Vec<PoolStats> {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = common::pytorch_pool(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    // The stream the pool's calls are ordered on, if any; the ends are
    // written and checked on `s` either way.
    let on = (calls == Calls::StreamOrdered).then_some(&s);
    let free = |a: Allocation, word: u32| {
        if a.size() >= CHECKED_FROM {
            // A copy to the host: the stream's writes are done.
            check_ends(b.as_ref(), &s, &a, word);
        }
        free_on(&pool, on, a);
    };
    let mut live: Vec<Option<(Allocation, u32)>> = (0..trace.slots).map(|_| None).collect();
    let mut at_marks = Vec::new();
    for op in &trace.ops {
        match *op {
            TraceOp::Alloc { slot, size, .. } => {
                let a = allocate_on(&pool, on, size);
                let word = slot as u32;
                if size >= CHECKED_FROM {
                    mark_ends(b.as_ref(), &s, &a, word);
                }
                live[slot] = Some((a, word));
            }
            TraceOp::Free { slot, .. } => {
                let (a, word) = live[slot].take().expect("freed once");
                free(a, word);
            }
            TraceOp::Step => {
                pool.mark_step().unwrap();
                pool.audit().unwrap();
                at_marks.push(pool.stats());
                if at_marks.len() == steps {
                    break;
                }
            }
            _ => unreachable!("the trace holds allocations, frees and marks"),
        }
    }
    for (a, word) in live.into_iter().flatten() {
        free(a, word);
    }
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    pool.trim_to(0).unwrap();
    at_marks
}

/// The whole recording, synchronously (stream-ordered frees come back
/// to the heap with the stream's timing, and which units growth may then
/// move with it: on the host, one run in six still moved units in half of
/// steps 120-160, the others in none or two). Without joining, every step
/// after the first ones moves units; with it, under 5 % of the steps after
/// step 50 do, issue 23's settling bar.
fn drifting_steps_join_their_free_units_and_settle<B: TestBackend>(b: &Arc<B>, trace: &Trace) {
    let at_marks = replay(b, trace, Calls::Synchronous, usize::MAX);
    let last = at_marks.last().unwrap();
    assert!(
        last.joins > 0,
        "no joining: the case is not covered ({last:?})"
    );
    let moved: Vec<u64> = at_marks
        .windows(2)
        .map(|w| w[1].remaps - w[0].remaps)
        .collect();
    let after = 50..moved.len();
    let moving: Vec<usize> = after.clone().filter(|&t| moved[t] > 0).collect();
    assert!(
        moving.len() * 20 < after.len(),
        "steps after step 50 that moved units: {moving:?} of {} (units moved a step: {moved:?})",
        after.len()
    );
}

/// Stream-ordered, as PyTorch calls the pool: the steps join (the first
/// joining comes at step 9, after the first steps' moves), and every
/// byte of the large allocations stays as written through it.
fn stream_ordered_joining_keeps_every_byte<B: TestBackend>(b: &Arc<B>, trace: &Trace) {
    let at_marks = replay(b, trace, Calls::StreamOrdered, 40);
    let last = at_marks.last().unwrap();
    assert!(
        last.joins > 0,
        "no joining: the case is not covered ({last:?})"
    );
}

mod host {
    #[test]
    fn drifting_steps_join_their_free_units_and_settle() {
        let trace = super::recording();
        super::drifting_steps_join_their_free_units_and_settle(
            &super::common::host_for(&trace),
            &trace,
        );
    }

    #[test]
    fn stream_ordered_joining_keeps_every_byte() {
        let trace = super::recording();
        super::stream_ordered_joining_keeps_every_byte(&super::common::host_for(&trace), &trace);
    }
}

#[cfg(feature = "gpu-tests")]
mod cuda {
    #[test]
    fn drifting_steps_join_their_free_units_and_settle() {
        let trace = super::recording();
        super::drifting_steps_join_their_free_units_and_settle(&super::common::cuda(), &trace);
    }

    #[test]
    fn stream_ordered_joining_keeps_every_byte() {
        let trace = super::recording();
        super::stream_ordered_joining_keeps_every_byte(&super::common::cuda(), &trace);
    }
}

/// The last call of each kind a joining makes (it unmaps and releases the
/// units, then creates and maps the chunks) fails in turn: the mark goes
/// on, the pool stays consistent at every mark after it, every byte is
/// kept, and nothing is left once the pool is trimmed and dropped. The
/// calls are synchronous, so that each run makes the same driver calls
/// up to the fault.
#[test]
fn a_joining_whose_driver_call_fails_leaves_the_pool_consistent() {
    let trace = recording();
    let clean = replay(&common::host_for(&trace), &trace, Calls::Synchronous, 160);
    let at = clean
        .iter()
        .position(|st| st.joins > 0)
        .expect("the recording joins");
    let after = &clean[at];
    let last_of = [
        (Call::Unmap, after.unmaps),
        (Call::ReleaseChunk, after.chunks_released),
        (Call::CreateChunk, after.chunks_created),
        (Call::Map, after.maps),
    ];
    for (call, count) in last_of {
        let host = common::host_for(&trace);
        let b = Faulty::new(Arc::clone(&host));
        b.fail_nth(call, count - 1);
        let faulted = replay(&b, &trace, Calls::Synchronous, at + 20);
        assert!(b.disarm(), "{call:?} #{} did not fail", count - 1);
        // Up to the joining mark the run is the clean one's.
        let calls = |st: &PoolStats| (st.maps, st.unmaps, st.chunks_created, st.remaps);
        assert_eq!(calls(&faulted[at - 1]), calls(&clean[at - 1]), "{call:?}");
        assert_eq!(host.census(), Census::default(), "{call:?} leaked");
        // The fault met the joining: it failed, but for a release, which
        // the pool retries later.
        let failed = if call == Call::ReleaseChunk { 0 } else { 1 };
        assert_eq!(
            faulted[at].joins,
            clean[at].joins - failed,
            "{call:?}: the fault missed the joining"
        );
    }
}
