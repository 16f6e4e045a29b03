//! A stream-ordered pool places the same whether its stream keeps up with
//! the calls or runs far behind them, as a GPU runs behind PyTorch (Note
//! [Stream-ordered frees], "Apart from the GPU's timing", and Note [Guards
//! and aliases], "Growth waits for aliases", in docs/DESIGN.md): the
//! recorded generation loop's first operations, replayed once with no
//! work queued and once with the stream kept behind, reach the same
//! reserved bytes by the same maps. The replay runs on the host always
//! and on CUDA with `--features gpu-tests`.

use std::sync::Arc;
use std::time::Duration;

use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{Allocation, Context, PoolAttribute, PoolStats};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);

/// The operations replayed: the loop's first generation calls, some
/// hundred growths.
const OPS: usize = 150_000;

/// How far behind the stream is kept: work queued after every this many
/// allocations, the stream waited for every `WAIT_EVERY` operations
/// (`vmpool-replay --stream-lag 200,20,400`).
const DELAY: Duration = Duration::from_micros(200);
const DELAY_EVERY: usize = 20;
const WAIT_EVERY: usize = 400;

fn recording() -> Trace {
    common::recorded("gpt2_generate")
}

/// How the stream runs beside the calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lag {
    /// No work queued: every free is passed almost at once.
    KeepingUp,
    /// Delays queued on it, waited for now and then.
    Behind,
}

/// Replays the first [`OPS`] operations of `trace` in stream order on one
/// stream, at the C layer's growth chunks (a 1024th); returns the pool's
/// statistics and its highest reserved bytes.
fn replay<B: TestBackend>(b: &Arc<B>, trace: &Trace, lag: Lag) -> (PoolStats, u64) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = common::pytorch_pool(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let mut live: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
    let mut allocations = 0;
    for (i, op) in trace.ops.iter().take(OPS).enumerate() {
        match *op {
            TraceOp::Alloc { slot, size, .. } => {
                live[slot] = Some(pool.allocate_async(size, &s).unwrap());
                allocations += 1;
                if lag == Lag::Behind && allocations % DELAY_EVERY == 0 {
                    b.delay(s.raw(), DELAY).unwrap();
                }
            }
            TraceOp::Free { slot, .. } => {
                let a = live[slot].take().expect("freed once");
                pool.free_async(a, &s).unwrap();
            }
            _ => unreachable!("the recording holds allocations and frees"),
        }
        if lag == Lag::Behind && i % WAIT_EVERY == 0 {
            // The driver's wait, which the pool is not told of.
            b.synchronize_stream(s.raw()).unwrap();
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
    let (keeping_up, high) = replay(b, trace, Lag::KeepingUp);
    assert!(
        keeping_up.remaps > 0,
        "no unit moved: the case is not covered"
    );
    let (behind, high_behind) = replay(b, trace, Lag::Behind);
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
