//! A stream-ordered pool places the same whether its stream keeps up with
//! the calls or runs far behind them, as a GPU runs behind PyTorch (Note
//! [Stream-ordered frees], "Apart from the GPU's timing", and Note [Guards
//! and aliases], "Growth waits for aliases", in docs/DESIGN.md): the
//! recorded generation loop's first operations, replayed once with no
//! work queued and once with the stream kept behind, reach the same
//! reserved bytes by the same maps. The replay runs on the host always
//! and on CUDA with `--features gpu-tests`.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::testing::lag::{Lagging, StreamLag};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, PoolAttribute, PoolStats};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);

/// The operations replayed: the loop's first generation calls, some
/// hundred growths.
const OPS: usize = 150_000;

/// How far behind the stream is kept: 200 us of work after every 20th
/// allocation, the stream waited for every 400 operations
/// (`vmpool-replay --stream-lag 200,20,400`).
fn kept_behind() -> StreamLag {
    StreamLag {
        delay: Duration::from_micros(200),
        every: NonZeroU64::new(20).unwrap(),
        wait_every: NonZeroU64::new(400).unwrap(),
    }
}

fn recording() -> Trace {
    common::recorded("gpt2_generate")
}

/// Replays the first [`OPS`] operations of `trace` in stream order on one
/// stream, at the C layer's growth chunks (a 1024th), the stream kept
/// behind by `lag` or, with `None`, keeping up (no work queued: every free
/// is passed almost at once); returns the pool's statistics and its
/// highest reserved bytes.
fn replay<B: TestBackend>(b: &Arc<B>, trace: &Trace, lag: Option<StreamLag>) -> (PoolStats, u64) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = common::pytorch_pool(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let mut lagging = lag.map(|lag| Lagging::new(Arc::clone(b), lag));
    let mut live: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
    for op in trace.ops.iter().take(OPS) {
        match *op {
            TraceOp::Alloc { slot, size, .. } => {
                live[slot] = Some(pool.allocate_async(size, &s).unwrap());
                if let Some(lagging) = &mut lagging {
                    lagging.allocated(s.raw()).unwrap();
                }
            }
            TraceOp::Free { slot, .. } => {
                let a = live[slot].take().expect("freed once");
                pool.free_async(a, &s).unwrap();
                if let Some(lagging) = &mut lagging {
                    lagging.freed(s.raw()).unwrap();
                }
            }
            _ => unreachable!("the recording holds allocations and frees"),
        }
    }
    let stats = pool.stats();
    let high = pool.attribute(PoolAttribute::ReservedMemHigh);
    for a in live.into_iter().flatten() {
        pool.free_async(a, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    (stats, high)
}

fn a_lagging_stream_changes_no_placement<B: TestBackend>(b: &Arc<B>, trace: &Trace) {
    let (keeping_up, high) = replay(b, trace, None);
    assert!(
        keeping_up.remaps > 0,
        "no unit moved: the case is not covered"
    );
    let (behind, high_behind) = replay(b, trace, Some(kept_behind()));
    assert_eq!(
        (high_behind, behind.maps, behind.chunks_created),
        (high, keeping_up.maps, keeping_up.chunks_created),
        "reserved high, maps, chunks created: behind ({behind:?}) against keeping up ({keeping_up:?})"
    );
}

mod host {
    #[test]
    fn a_lagging_stream_changes_no_placement() {
        let trace = super::recording();
        let b = super::common::host_for(&trace);
        super::a_lagging_stream_changes_no_placement(&b, &trace);
    }
}

#[cfg(feature = "gpu-tests")]
mod cuda {
    #[test]
    fn a_lagging_stream_changes_no_placement() {
        let trace = super::recording();
        super::a_lagging_stream_changes_no_placement(&super::common::cuda(), &trace);
    }
}
