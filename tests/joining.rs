//! Joining where steps keep moving units (Note [Growth and remapping],
//! "Joining where steps keep moving units", in docs/DESIGN.md): the
//! mixture of experts' recorded steps, replayed in stream order, re-form
//! their largest request's space step after step until the pool joins
//! its free units into larger chunks; the pool then stops moving units,
//! stays consistent at every mark, and no live byte moves or changes.
//! Host backend only: the recording's pool holds 10 GB.

use std::sync::Arc;

use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, PoolAttribute, PoolProps};

#[allow(dead_code)]
mod common;

use common::{check_ends, mark_ends};

const DEV: DeviceId = DeviceId(0);

/// The recording's steps replayed: past the last step that moves units
/// with joining (108 of 300), and far enough that without it every step
/// after the first ones moves units.
const STEPS: usize = 160;

/// Allocations whose ends are written and checked: the large ones, where
/// the joined units lie.
const CHECKED_FROM: u64 = 1 << 20;

#[test]
fn drifting_steps_join_their_free_units_and_settle() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/traces/moe_train_torch_marked300.trace.gz"
    );
    let trace = Trace::read(std::fs::File::open(path).unwrap()).unwrap();
    let b = Host::new(HostConfig {
        memory_per_device: 4 * trace.peak_live as usize,
        ..HostConfig::default()
    })
    .unwrap();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    // The C layer's growth chunks (a 1024th of the pool).
    let pool = ctx
        .create_pool(&PoolProps {
            chunk_divisor: Some(1024),
            ..PoolProps::new(DEV)
        })
        .unwrap();
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let mut live: Vec<Option<(Allocation, u32)>> = (0..trace.slots).map(|_| None).collect();
    // Units moved in each step.
    let mut moved = Vec::new();
    let mut before = 0;
    for op in &trace.ops {
        match *op {
            TraceOp::Alloc { slot, size, .. } => {
                let a = pool.allocate_async(size, &s).unwrap();
                let word = slot as u32;
                if size >= CHECKED_FROM {
                    mark_ends(b.as_ref(), &s, &a, word);
                }
                live[slot] = Some((a, word));
            }
            TraceOp::Free { slot, .. } => {
                let (a, word) = live[slot].take().expect("freed once");
                if a.size() >= CHECKED_FROM {
                    check_ends(b.as_ref(), &s, &a, word);
                }
                pool.free_async(a, &s).unwrap();
            }
            TraceOp::Step => {
                pool.mark_step().unwrap();
                pool.audit().unwrap();
                let remaps = pool.stats().remaps;
                moved.push(remaps - before);
                before = remaps;
                if moved.len() == STEPS {
                    break;
                }
            }
            _ => unreachable!("the trace holds allocations, frees and marks"),
        }
    }
    let st = pool.stats();
    assert!(st.joins > 0, "no joining: the case is not covered ({st:?})");
    let late: Vec<usize> = (120..moved.len()).filter(|&t| moved[t] > 0).collect();
    assert!(
        late.is_empty(),
        "steps after step 120 that moved units: {late:?} (units moved a step: {moved:?})"
    );
    for (a, word) in live.into_iter().flatten() {
        if a.size() >= CHECKED_FROM {
            check_ends(b.as_ref(), &s, &a, word);
        }
        pool.free_async(a, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
}
