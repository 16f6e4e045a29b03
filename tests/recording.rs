//! A pool records its allocations as a trace in the shared format, which
//! the trace reader (and so `vmpool-replay`) takes back.

use vmpool::trace::{Trace, TraceOp};
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::DeviceId;
use vmpool::{Context, Pool, PoolProps};

/// A host-backend context and a pool of it that records to `path`.
fn recording_pool(path: &std::path::Path) -> (Context<Host>, Pool<Host>) {
    let ctx = Context::new(Host::new(HostConfig::default()).unwrap()).unwrap();
    let pool = ctx
        .create_pool(&PoolProps {
            record: Some(path.to_owned()),
            ..PoolProps::new(DeviceId(0))
        })
        .unwrap();
    (ctx, pool)
}

#[test]
fn a_recorded_trace_replays() {
    let path = std::env::temp_dir().join(format!("vmpool-record-{}.trace", std::process::id()));
    let sizes = [1000u64, 5 << 20, 77, 40 << 20];
    {
        let (ctx, pool) = recording_pool(&path);
        let s = ctx.create_stream(DeviceId(0)).unwrap();
        let sync: Vec<_> = sizes.iter().map(|&n| pool.allocate(n).unwrap()).collect();
        let a = pool.allocate_async(123_456, &s).unwrap();
        pool.free_async(a, &s).unwrap();
        let again = pool.allocate_async(123_456, &s).unwrap();
        for a in sync {
            pool.free(a).unwrap();
        }
        pool.free_async(again, &s).unwrap();
        ctx.synchronize_stream(&s).unwrap();
    }
    let trace = Trace::read(std::fs::File::open(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(trace.ops.len(), 12);
    assert_eq!(trace.peak_live, sizes.iter().sum::<u64>() + 123_456);
    let allocs: Vec<u64> = trace
        .ops
        .iter()
        .filter_map(|op| match op {
            TraceOp::Alloc { size, .. } => Some(*size),
            _ => None,
        })
        .collect();
    assert_eq!(allocs, [1000, 5 << 20, 77, 40 << 20, 123_456, 123_456]);
    // Replays on a fresh pool.
    let ctx = Context::new(Host::new(HostConfig::default()).unwrap()).unwrap();
    let pool = ctx.default_pool(DeviceId(0)).unwrap();
    let mut live: Vec<Option<vmpool::Allocation>> = (0..trace.slots).map(|_| None).collect();
    for op in &trace.ops {
        match *op {
            TraceOp::Alloc { slot, size, .. } => live[slot] = Some(pool.allocate(size).unwrap()),
            TraceOp::Free { slot, .. } => pool.free(live[slot].take().unwrap()).unwrap(),
            _ => unreachable!("the trace holds allocations and frees only"),
        }
    }
    assert_eq!(pool.stats().used_bytes, 0);
}

/// A program may end without the pool being dropped or flushed (PyTorch's
/// pools live until exit): what reached the file must still be whole lines,
/// so that the trace reads back, only shorter.
#[test]
fn an_unflushed_trace_ends_on_a_whole_line() {
    let path = std::env::temp_dir().join(format!("vmpool-unflushed-{}.trace", std::process::id()));
    let (_ctx, pool) = recording_pool(&path);
    // Lines of many lengths, enough to fill the recorder's buffer many times.
    for i in 0..5000u64 {
        let a = pool.allocate(256 + (i * 7919) % 100_000).unwrap();
        pool.free(a).unwrap();
    }
    let written = std::fs::read_to_string(&path).unwrap();
    assert!(
        !written.is_empty(),
        "the buffer filled, so some lines were written"
    );
    assert!(
        written.ends_with('\n'),
        "the file ends inside a line: {:?}",
        &written[written.len().saturating_sub(40)..]
    );
    let trace = Trace::read(written.as_bytes()).unwrap();
    assert!(!trace.ops.is_empty());
    drop(pool);
    std::fs::remove_file(&path).unwrap();
}

/// Step marks are recorded as `s` lines; a step layout's region is the
/// pool's own and stays out of the trace, so that a replay of it asks for
/// what the program asked for.
#[test]
fn steps_are_recorded_and_layout_regions_are_not() {
    let path = std::env::temp_dir().join(format!("vmpool-steps-{}.trace", std::process::id()));
    let (_ctx, pool) = recording_pool(&path);
    for _ in 0..4 {
        let a = pool.allocate(3 << 20).unwrap();
        let b = pool.allocate(5 << 20).unwrap();
        pool.free(a).unwrap();
        pool.free(b).unwrap();
        pool.mark_step().unwrap();
    }
    assert!(
        pool.step_counters().region_bytes > 0,
        "the steps were laid out"
    );
    pool.flush_trace().unwrap();
    let trace = Trace::read(std::fs::File::open(&path).unwrap()).unwrap();
    let steps = trace.ops.iter().filter(|op| **op == TraceOp::Step).count();
    assert_eq!(steps, 4);
    assert_eq!(trace.slots, 8, "the program's eight allocations, no region");
    assert_eq!(trace.peak_live, 8 << 20);
    drop(pool);
    std::fs::remove_file(&path).unwrap();
}
