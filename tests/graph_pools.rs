//! CUDA graphs' private pools (`GraphPools`), on every backend: the host
//! backend always, CUDA with `--features gpu-tests`. An allocation is
//! routed as a caller such as PyTorch's allocator routes it: to the open
//! graph pool when its stream is capturing, else to the caller's pool.

use std::sync::Arc;

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::{
    Closed, Context, Error, GraphAllocation, GraphPoolError, GraphPoolId, GraphPools, Pool,
    PoolProps, Stream,
};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

/// A context, its device pool for everything not captured, and the
/// device's graph pools.
fn setup<B: TestBackend>(b: &Arc<B>) -> (Context<B>, Pool<B>, GraphPools<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    (ctx, pool, GraphPools::new(PoolProps::new(DEV)))
}

/// Where an allocation came from, for freeing it there.
enum Routed {
    Device(vmpool::Allocation),
    Graph(GraphAllocation),
}

impl Routed {
    fn ptr(&self) -> u64 {
        match self {
            Routed::Device(a) => a.ptr().0,
            Routed::Graph(g) => g.allocation.ptr().0,
        }
    }
}

fn alloc<B: TestBackend>(
    pool: &Pool<B>,
    graphs: &GraphPools<B>,
    size: u64,
    stream: &Stream<B>,
) -> Routed {
    match graphs.allocate_async(size, stream).unwrap() {
        Some(g) => Routed::Graph(g),
        None => Routed::Device(pool.allocate_async(size, stream).unwrap()),
    }
}

fn free<B: TestBackend>(
    pool: &Pool<B>,
    graphs: &GraphPools<B>,
    routed: Routed,
    stream: &Stream<B>,
) {
    match routed {
        Routed::Device(a) => pool.free_async(a, stream).unwrap(),
        Routed::Graph(g) => graphs.free_async(g, stream).unwrap(),
    }
}

/// While a graph pool is open, allocations on a capturing stream come from
/// it and nothing else: after the capture, what it freed is not handed to
/// other allocations (a replay would write there), and the pool goes with
/// its last allocation once released.
pub fn a_capture_allocates_from_its_graph_pool_only<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, graphs) = setup(b);
    let id = GraphPoolId::new(0, 7);
    let (s, other) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    let eager = alloc(&pool, &graphs, 4 * MIB, &s);
    assert!(matches!(eager, Routed::Device(_)), "no graph pool open");
    graphs.begin(&ctx, id).unwrap();
    assert!(graphs.any_open());
    // Not capturing: the device's pool.
    let outside = alloc(&pool, &graphs, 4 * MIB, &other);
    assert!(matches!(outside, Routed::Device(_)), "not capturing");
    b.begin_capture(s.raw()).unwrap();
    let mut graph = Vec::new();
    for size in [3000, MIB, 40 * MIB, MIB] {
        graph.push(alloc(&pool, &graphs, size, &s));
    }
    assert!(graph
        .iter()
        .all(|r| matches!(r, Routed::Graph(g) if g.pool == id)));
    let mut ptrs: Vec<u64> = graph.iter().map(Routed::ptr).collect();
    // Intermediates freed in the capture, and reused within it.
    let second = graph.remove(1);
    free(&pool, &graphs, second, &s);
    let reused = alloc(&pool, &graphs, MIB, &s);
    ptrs.push(reused.ptr());
    graph.push(reused);
    let third = graph.remove(1);
    free(&pool, &graphs, third, &s);
    b.end_capture(s.raw()).expect("the capture held");
    assert_eq!(graphs.end(id).unwrap(), Closed::LastOpen);
    assert!(!graphs.any_open());
    let stats = graphs.stats();
    assert_eq!((stats.pools, stats.open), (1, 0));
    assert!(stats.reserved_bytes >= 40 * MIB);
    assert_eq!(pool.stats().used_bytes, 8 * MIB, "eager and outside only");
    // After the capture, on the same stream and others: never the graph's
    // memory, freed or not.
    let mut after = Vec::new();
    for stream in [&s, &other] {
        for size in [3000, MIB, 40 * MIB] {
            let r = alloc(&pool, &graphs, size, stream);
            assert!(matches!(r, Routed::Device(_)));
            assert!(!ptrs.contains(&r.ptr()), "{:#x} is the graph's", r.ptr());
            after.push(r);
        }
    }
    assert_eq!(graphs.release(id).unwrap(), Closed::WasNotOpen);
    assert!(graphs.contains(id), "its allocations live");
    for r in graph {
        free(&pool, &graphs, r, &other);
    }
    assert!(!graphs.contains(id), "gone with its last allocation");
    assert_eq!(graphs.stats(), Default::default());
    for r in after.into_iter().chain([eager]) {
        free(&pool, &graphs, r, &s);
    }
    free(&pool, &graphs, outside, &other);
    assert!(matches!(graphs.end(id), Err(GraphPoolError::NotOpen(i)) if i == id));
    assert!(matches!(graphs.release(id), Err(GraphPoolError::NotInUse(i)) if i == id));
    ctx.synchronize_device(DEV).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    pool.audit().unwrap();
}

/// Graphs may share a pool (`torch.cuda.graph(pool=...)`): it stays while
/// any of them lives, even with nothing allocated, since their replays use
/// what the captures freed.
pub fn a_shared_graph_pool_stays_until_every_graph_is_released<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, graphs) = setup(b);
    let id = GraphPoolId::new(0, 9);
    let s = ctx.create_stream(DEV).unwrap();
    for _ in 0..2 {
        graphs.begin(&ctx, id).unwrap();
        b.begin_capture(s.raw()).unwrap();
        let r = alloc(&pool, &graphs, 8 * MIB, &s);
        assert!(matches!(r, Routed::Graph(_)));
        free(&pool, &graphs, r, &s);
        b.end_capture(s.raw()).unwrap();
        graphs.end(id).unwrap();
    }
    // Freed and passed: the graph pool still keeps its memory.
    ctx.synchronize_device(DEV).unwrap();
    graphs.release(id).unwrap();
    let stats = graphs.stats();
    assert_eq!(stats.pools, 1, "the other graph still replays into it");
    assert!(stats.reserved_bytes >= 8 * MIB);
    graphs.release(id).unwrap();
    assert_eq!(graphs.stats().pools, 0);
    assert!(
        matches!(graphs.release(id), Err(GraphPoolError::NotInUse(_))),
        "released more often than begun"
    );
    assert_eq!(
        pool.stats().allocations,
        0,
        "nothing went to the device pool"
    );
}

/// With two graph pools open, a capturing allocation cannot be told which
/// capture it belongs to, and is refused; one not capturing is the
/// caller's as usual.
pub fn two_open_graph_pools_refuse_a_capturing_allocation<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, graphs) = setup(b);
    let (one, two) = (GraphPoolId::new(0, 1), GraphPoolId::new(0, 2));
    graphs.begin(&ctx, one).unwrap();
    assert!(matches!(
        graphs.begin(&ctx, one),
        Err(GraphPoolError::AlreadyOpen(id)) if id == one
    ));
    graphs.begin(&ctx, two).unwrap();
    assert_eq!(graphs.stats().open, 2);
    let (s, other) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    b.begin_capture(s.raw()).unwrap();
    assert!(matches!(
        graphs.allocate_async(4096, &s),
        Err(GraphPoolError::WhichCapture { open: 2 })
    ));
    let r = alloc(&pool, &graphs, 4096, &other);
    assert!(matches!(r, Routed::Device(_)));
    b.end_capture(s.raw()).unwrap();
    free(&pool, &graphs, r, &other);
    assert_eq!(graphs.end(one).unwrap(), Closed::OthersOpen);
    // One open again: its capture is served.
    b.begin_capture(s.raw()).unwrap();
    let r = alloc(&pool, &graphs, 4096, &s);
    assert!(matches!(&r, Routed::Graph(g) if g.pool == two));
    free(&pool, &graphs, r, &s);
    b.end_capture(s.raw()).unwrap();
    // A release closes a pool still open.
    assert_eq!(graphs.release(two).unwrap(), Closed::LastOpen);
    graphs.release(one).unwrap();
    assert_eq!(graphs.stats(), Default::default());
}

/// While a graph pool is open, its capture is announced to the context:
/// the device pool, serving another stream meanwhile, takes no free that
/// would need a wait, and the capture holds.
pub fn an_open_graph_pool_announces_its_capture<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, graphs) = setup(b);
    let id = GraphPoolId::new(3, 0);
    let (s, other) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    // A free on `s` that `other` has not passed.
    let theirs = pool.allocate_async(8 * MIB, &s).unwrap();
    b.delay(s.raw(), std::time::Duration::from_millis(100))
        .unwrap();
    pool.free_async(theirs, &s).unwrap();
    let waits = pool.stats().waits_inserted;
    graphs.begin(&ctx, id).unwrap();
    b.begin_capture(s.raw()).unwrap();
    let captured = alloc(&pool, &graphs, MIB, &s);
    let mine = alloc(&pool, &graphs, 8 * MIB, &other);
    assert!(matches!(mine, Routed::Device(_)));
    assert_eq!(
        pool.stats().waits_inserted,
        waits,
        "a wait during the capture"
    );
    b.end_capture(s.raw()).expect("the capture held");
    graphs.end(id).unwrap();
    free(&pool, &graphs, mine, &other);
    free(&pool, &graphs, captured, &s);
    graphs.release(id).unwrap();
    assert!(!graphs.contains(id));
    ctx.synchronize_device(DEV).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
}

/// What the calls refuse, and that a refused call changes nothing.
pub fn misuse_is_refused_and_changes_nothing<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, graphs) = setup(b);
    let (id, unknown) = (GraphPoolId::new(0, 5), GraphPoolId::new(5, 0));
    assert_eq!(id.to_string(), "(0, 5)");
    assert!(matches!(
        graphs.end(unknown),
        Err(GraphPoolError::NotOpen(_))
    ));
    assert!(matches!(
        graphs.release(unknown),
        Err(GraphPoolError::NotInUse(_))
    ));
    // A pool that cannot be created (no such device) is not kept.
    let nowhere = GraphPools::<B>::new(PoolProps::new(DeviceId(99)));
    assert!(matches!(
        nowhere.begin(&ctx, id),
        Err(GraphPoolError::Pool(Error::InvalidDevice(_)))
    ));
    assert!(!nowhere.any_open() && !nowhere.contains(id));

    let s = ctx.create_stream(DEV).unwrap();
    graphs.begin(&ctx, id).unwrap();
    b.begin_capture(s.raw()).unwrap();
    let g = graphs.allocate_async(MIB, &s).unwrap().expect("capturing");
    b.end_capture(s.raw()).unwrap();
    graphs.end(id).unwrap();
    graphs.release(id).unwrap();
    // Named with another pool's id: refused, and the pool stays for it.
    let misnamed = GraphAllocation {
        allocation: pool.allocate_async(MIB, &s).unwrap(),
        pool: id,
    };
    assert!(matches!(
        graphs.free_async(misnamed, &s),
        Err(GraphPoolError::Pool(Error::WrongPool { .. }))
    ));
    assert!(graphs.contains(id));
    let orphan = GraphAllocation {
        allocation: pool.allocate_async(MIB, &s).unwrap(),
        pool: unknown,
    };
    assert!(matches!(
        graphs.free_async(orphan, &s),
        Err(GraphPoolError::NoSuchPool(i)) if i == unknown
    ));
    graphs.free_async(g, &s).unwrap();
    assert!(!graphs.contains(id));
    // A stream of another device: refused by the pool, nothing counted.
    if b.device_count().unwrap() > 1 {
        let elsewhere = ctx.create_stream(DeviceId(1)).unwrap();
        graphs.begin(&ctx, id).unwrap();
        b.begin_capture(elsewhere.raw()).unwrap();
        assert!(matches!(
            graphs.allocate_async(MIB, &elsewhere),
            Err(GraphPoolError::Pool(Error::WrongDevice { .. }))
        ));
        b.end_capture(elsewhere.raw()).unwrap();
        graphs.release(id).unwrap();
        assert!(!graphs.contains(id), "nothing live in it");
    }
}

suites!(
    a_capture_allocates_from_its_graph_pool_only,
    a_shared_graph_pool_stays_until_every_graph_is_released,
    two_open_graph_pools_refuse_a_capturing_allocation,
    an_open_graph_pool_announces_its_capture,
    misuse_is_refused_and_changes_nothing,
);

/// A graph pool's free memory is what its graphs replay into: nothing
/// unmaps it while they live.
mod replay_memory {
    use super::*;

    /// Growth in a capture does not back a new range with free units of
    /// the same pool (the defragmenting remap): they would move, and their
    /// old addresses, which the graph replays into, be unmapped once the
    /// stream passes them.
    #[test]
    fn a_remap_in_a_capture_keeps_the_graphs_addresses_mapped() {
        let b = common::host();
        let (ctx, _pool, graphs) = setup(&b);
        let id = GraphPoolId::new(0, 1);
        let s = ctx.create_stream(DEV).unwrap();
        graphs.begin(&ctx, id).unwrap();
        b.begin_capture(s.raw()).unwrap();
        let a = graphs.allocate_async(8 * MIB, &s).unwrap().unwrap();
        let after_a = graphs.allocate_async(3 * MIB, &s).unwrap().unwrap();
        let freed = a.allocation.ptr();
        graphs.free_async(a, &s).unwrap();
        let larger = graphs.allocate_async(16 * MIB, &s).unwrap().unwrap();
        b.end_capture(s.raw()).unwrap();
        graphs.end(id).unwrap();
        ctx.synchronize_device(DEV).unwrap();
        // A replay writes where the capture had its first allocation.
        b.fill_u32(s.raw(), freed, (8 * MIB / 4) as usize, 7)
            .unwrap();
        b.synchronize_stream(s.raw())
            .expect("the graph's addresses are mapped");
        graphs.free_async(after_a, &s).unwrap();
        graphs.free_async(larger, &s).unwrap();
    }

    /// Another pool of the device running out of memory asks every pool
    /// on it to release what it holds unused, graph pools excepted.
    #[test]
    fn another_pool_out_of_memory_leaves_graph_pools_alone() {
        let b = common::host();
        let (ctx, pool, graphs) = setup(&b);
        let id = GraphPoolId::new(0, 1);
        let s = ctx.create_stream(DEV).unwrap();
        graphs.begin(&ctx, id).unwrap();
        b.begin_capture(s.raw()).unwrap();
        let a = graphs.allocate_async(256 * MIB, &s).unwrap().unwrap();
        graphs.free_async(a, &s).unwrap();
        b.end_capture(s.raw()).unwrap();
        graphs.end(id).unwrap();
        ctx.synchronize_device(DEV).unwrap();
        let held = graphs.stats().reserved_bytes;
        assert!(held >= 256 * MIB);
        // The device has 1 GiB: this takes what the graph pool does not hold.
        let _ = pool.allocate(900 * MIB);
        assert_eq!(graphs.stats().reserved_bytes, held);
    }
}
