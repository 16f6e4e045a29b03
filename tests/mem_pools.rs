//! Memory pools (`MemPools`), on every backend: the host backend always,
//! CUDA with `--features gpu-tests`. An allocation is routed as a caller
//! such as PyTorch's allocator routes it: to the pool the calling thread
//! is in, else to the caller's pool.

use std::sync::Arc;

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{
    Context, MemPoolAllocation, MemPoolError, MemPoolId, MemPools, Pool, PoolProps, Release,
    Released, Stream,
};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

/// A context, its device pool for every thread in no memory pool, and
/// the device's memory pools (which keep all their memory, as the C
/// library's pools do by default, until released).
fn setup<B: TestBackend>(b: &Arc<B>) -> (Context<B>, Pool<B>, MemPools<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    (ctx, pool, MemPools::new(PoolProps::new(DEV), u64::MAX))
}

/// Where an allocation came from, for freeing it there.
enum Routed {
    Device(vmpool::Allocation),
    Mem(MemPoolAllocation),
}

fn alloc<B: TestBackend>(
    pool: &Pool<B>,
    mems: &MemPools<B>,
    size: u64,
    stream: &Stream<B>,
) -> Routed {
    match mems.allocate_async(size, stream).unwrap() {
        Some(m) => Routed::Mem(m),
        None => Routed::Device(pool.allocate_async(size, stream).unwrap()),
    }
}

fn free<B: TestBackend>(pool: &Pool<B>, mems: &MemPools<B>, routed: Routed, stream: &Stream<B>) {
    match routed {
        Routed::Device(a) => pool.free_async(a, stream).unwrap(),
        Routed::Mem(m) => mems.free_async(m, stream).unwrap(),
    }
}

/// Two threads at once, one in a memory pool, one not: the first one's
/// allocations, on any stream, come from the pool; the other's from the
/// device's pool. Freed from the other thread, they go back to the memory
/// pool, and releasing it gives its memory back.
pub fn a_thread_in_a_memory_pool_allocates_from_it_others_do_not<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, mems) = setup(b);
    let id = MemPoolId::new(0, 3);
    let (s, other) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    mems.create(&ctx, id).unwrap();
    assert!(!mems.any_entered(), "created, no thread in it");
    let gate = std::sync::Barrier::new(2);
    let (inside, outside) = std::thread::scope(|scope| {
        let inside = scope.spawn(|| {
            mems.begin(id).unwrap();
            gate.wait();
            let got: Vec<Routed> = [(MIB, &s), (40 * MIB, &other), (3000, &s)]
                .into_iter()
                .map(|(size, stream)| alloc(&pool, &mems, size, stream))
                .collect();
            gate.wait();
            mems.end(id).unwrap();
            got
        });
        let outside = scope.spawn(|| {
            gate.wait();
            // The other thread is in the pool now: not this one.
            assert!(mems.any_entered());
            let got: Vec<Routed> = [(MIB, &s), (8 * MIB, &other)]
                .into_iter()
                .map(|(size, stream)| alloc(&pool, &mems, size, stream))
                .collect();
            gate.wait();
            got
        });
        (inside.join().unwrap(), outside.join().unwrap())
    });
    assert!(inside
        .iter()
        .all(|r| matches!(r, Routed::Mem(m) if m.pool == id)));
    assert!(outside.iter().all(|r| matches!(r, Routed::Device(_))));
    assert!(!mems.any_entered());
    let used = mems.pool_stats(id).unwrap().used_bytes;
    assert!(used >= 41 * MIB, "{used}");
    assert_eq!(mems.stats().pools, 1);
    assert_eq!(pool.stats().used_bytes, 9 * MIB, "the other thread's only");
    // After `end`, this thread allocates from the device's pool again.
    let after = alloc(&pool, &mems, MIB, &s);
    assert!(matches!(after, Routed::Device(_)));
    free(&pool, &mems, after, &s);
    // Still live: not now.
    assert!(matches!(
        mems.release(id, Release::Now),
        Err(MemPoolError::Live { live: 3, .. })
    ));
    for r in inside {
        free(&pool, &mems, r, &other);
    }
    ctx.synchronize_device(DEV).unwrap();
    let held = mems.pool_stats(id).unwrap().reserved_bytes;
    assert!(held >= 41 * MIB);
    let before = b.mem_info(DEV).unwrap().free;
    assert_eq!(
        mems.release(id, Release::Now).unwrap(),
        Released::Gone {
            reserved_bytes: held
        }
    );
    assert!(!mems.contains(id));
    assert_eq!(mems.stats(), Default::default());
    assert_eq!(
        b.mem_info(DEV).unwrap().free - before,
        held as usize,
        "the memory pool's memory is back"
    );
    for r in outside {
        free(&pool, &mems, r, &s);
    }
    ctx.synchronize_device(DEV).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    pool.audit().unwrap();
}

/// Released with allocations live (PyTorch dropping a `MemPool` whose
/// tensors outlive it), a memory pool takes no thread any more and goes
/// with its last free.
pub fn a_released_memory_pool_goes_with_its_last_free<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, mems) = setup(b);
    let id = MemPoolId::new(0, 1);
    let s = ctx.create_stream(DEV).unwrap();
    mems.create(&ctx, id).unwrap();
    mems.begin(id).unwrap();
    let a = alloc(&pool, &mems, 4 * MIB, &s);
    let c = alloc(&pool, &mems, 4 * MIB, &s);
    assert!(matches!(
        mems.release(id, Release::WithLastFree),
        Err(MemPoolError::InUse { threads: 1, .. })
    ));
    mems.end(id).unwrap();
    assert_eq!(
        mems.release(id, Release::WithLastFree).unwrap(),
        Released::WithLastFree { live: 2 }
    );
    assert!(!mems.contains(id), "released");
    assert!(matches!(mems.begin(id), Err(MemPoolError::NoSuchPool(i)) if i == id));
    assert_eq!(mems.stats().pools, 1, "its allocations live");
    free(&pool, &mems, a, &s);
    assert_eq!(mems.stats().pools, 1);
    free(&pool, &mems, c, &s);
    assert_eq!(mems.stats(), Default::default(), "gone with its last free");
    assert_eq!(pool.stats().used_bytes, 0);
}

/// Each misuse is refused and changes nothing: an id created twice, a
/// thread entering a second pool (or the same one twice), leaving one it is
/// not in, an unknown id.
pub fn misuse_is_refused_and_changes_nothing<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool, mems) = setup(b);
    let (one, two, unknown) = (
        MemPoolId::new(0, 1),
        MemPoolId::new(0, 2),
        MemPoolId::new(0, 9),
    );
    let s = ctx.create_stream(DEV).unwrap();
    mems.create(&ctx, one).unwrap();
    mems.create(&ctx, two).unwrap();
    assert!(matches!(mems.create(&ctx, one), Err(MemPoolError::Exists(i)) if i == one));
    mems.begin(one).unwrap();
    for id in [one, two] {
        let err = mems.begin(id).unwrap_err();
        assert!(
            matches!(err, MemPoolError::AlreadyIn { id: i, current } if i == id && current == one)
        );
    }
    assert_eq!(
        mems.begin(two).unwrap_err().to_string(),
        "this thread is in memory pool (0, 1) already: it cannot enter (0, 2) too"
    );
    assert!(matches!(mems.end(two), Err(MemPoolError::NotIn(i)) if i == two));
    for err in [
        mems.begin(unknown).unwrap_err(),
        mems.end(unknown).unwrap_err(),
        mems.release(unknown, Release::Now).unwrap_err(),
    ] {
        assert!(matches!(err, MemPoolError::NoSuchPool(i) if i == unknown));
    }
    // Still in `one`, once.
    let a = alloc(&pool, &mems, MIB, &s);
    assert!(matches!(&a, Routed::Mem(m) if m.pool == one));
    mems.end(one).unwrap();
    assert!(!mems.any_entered());
    assert!(matches!(mems.end(one), Err(MemPoolError::NotIn(_))));
    free(&pool, &mems, a, &s);
    for id in [one, two] {
        assert!(matches!(
            mems.release(id, Release::Now).unwrap(),
            Released::Gone { .. }
        ));
    }
    assert!(matches!(
        mems.release(one, Release::Now),
        Err(MemPoolError::NoSuchPool(_))
    ));
}

suites!(
    a_thread_in_a_memory_pool_allocates_from_it_others_do_not,
    a_released_memory_pool_goes_with_its_last_free,
    misuse_is_refused_and_changes_nothing,
);
