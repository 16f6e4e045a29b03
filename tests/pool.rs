//! The pool, tested through its public API on every backend: on the host
//! backend always, on CUDA with `--features gpu-tests` (which fails, not
//! skips, without a device). Cases that need a small device (out of memory,
//! injected faults) are host-only, at the bottom.

use std::sync::Arc;

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Backend, DeviceId, DevicePtr};
use vmpool::{
    Allocation, Context, Defragment, Error, FreshStart, PoolAttribute, PoolProps, SleepLevel,
    SMALL_LIMIT,
};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

/// Fills an allocation with `seed`.
fn fill<B: TestBackend>(b: &B, s: &B::Stream, a: &Allocation, seed: u32) {
    let words = (a.size() / 4) as usize;
    if words > 0 {
        b.fill_u32(s, a.ptr(), words, seed).unwrap();
    }
}

/// Checks that the whole allocation still holds `seed`.
fn check<B: TestBackend>(b: &B, s: &B::Stream, a: &Allocation, seed: u32) {
    let len = (a.size() / 4 * 4) as usize;
    if len == 0 {
        return;
    }
    let mut bytes = vec![0u8; len];
    b.copy_to_host(s, a.ptr(), &mut bytes).unwrap();
    assert!(
        bytes == seed.to_ne_bytes().repeat(len / 4),
        "allocation at {} lost its data",
        a.ptr()
    );
}

fn small_pool<B: TestBackend>(ctx: &Context<B>) -> vmpool::Pool<B> {
    pool_reserving(ctx, 4 << 30)
}

/// A pool of `va_size` bytes of address space, the rest by default.
fn pool_reserving<B: TestBackend>(ctx: &Context<B>, va_size: u64) -> vmpool::Pool<B> {
    ctx.create_pool(&PoolProps {
        va_size: Some(va_size),
        ..PoolProps::new(DEV)
    })
    .unwrap()
}

/// A pool whose growth chunks are all one granule, `g` (no divisor), and
/// that does `fresh_start` when emptied.
fn granule_unit_pool<B: TestBackend>(
    ctx: &Context<B>,
    g: u64,
    fresh_start: FreshStart,
) -> vmpool::Pool<B> {
    ctx.create_pool(&PoolProps {
        va_size: Some(4 << 30),
        chunk_size: Some(g),
        chunk_divisor: None,
        fresh_start,
        ..PoolProps::new(DEV)
    })
    .unwrap()
}

/// On a [`granule_unit_pool`]: [x | y | z], a granule each; with x and z
/// freed, two granules in one piece come from moving their units, and are
/// freed again. Returns where x was, and y, still live.
fn move_units_around<B: TestBackend>(pool: &vmpool::Pool<B>, g: u64) -> (DevicePtr, Allocation) {
    let x = pool.allocate(g).unwrap();
    let first = x.ptr();
    let y = pool.allocate(g).unwrap();
    let z = pool.allocate(g).unwrap();
    pool.free(x).unwrap();
    pool.free(z).unwrap();
    let v = pool.allocate(2 * g).unwrap();
    assert!(pool.stats().remaps > 0, "the case needs a move");
    pool.free(v).unwrap();
    (first, y)
}

pub fn sizes_and_alignment<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    let sizes = [
        1,
        3,
        255,
        256,
        257,
        4096,
        SMALL_LIMIT - 1,
        SMALL_LIMIT,
        3 * MIB + 5,
        20 * MIB,
    ];
    let allocations: Vec<Allocation> = sizes.iter().map(|&s| pool.allocate(s).unwrap()).collect();
    for a in &allocations {
        assert_eq!(a.ptr().0 % 256, 0, "{} not 256-aligned", a.ptr());
    }
    let mut spans: Vec<(u64, u64)> = allocations.iter().map(|a| (a.ptr().0, a.size())).collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "allocations overlap: {w:?}");
    }
    let used: u64 = sizes.iter().map(|s| s.next_multiple_of(256)).sum();
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), used);
    for a in allocations {
        pool.free(a).unwrap();
    }
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), 0);
    assert_eq!(pool.attribute(PoolAttribute::UsedMemHigh), used);
    pool.audit().unwrap();
}

pub fn more_than_half_the_device<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.default_pool(DEV).unwrap();
    let total = b.mem_info(DEV).unwrap().total as u64;
    let a = pool.allocate(total / 2 + MIB).unwrap();
    assert_eq!(
        pool.stats().used_bytes,
        (total / 2 + MIB).next_multiple_of(256)
    );
    pool.free(a).unwrap();
    pool.trim_to(0).unwrap();
}

pub fn invalid_requests<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    assert!(matches!(pool.allocate(0), Err(Error::InvalidSize { .. })));
    assert!(matches!(
        pool.allocate(u64::MAX),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        pool.allocate(5 << 30),
        Err(Error::InvalidSize { .. })
    ));
    let other = small_pool(&ctx);
    let a = other.allocate(100).unwrap();
    let ptr = a.ptr().0;
    match pool.free(a) {
        Err(Error::WrongPool { ptr: p }) => assert_eq!(p, ptr),
        r => panic!("freeing into the wrong pool gave {r:?}"),
    }
    assert!(matches!(
        ctx.create_pool(&PoolProps::new(DeviceId(99))),
        Err(Error::InvalidDevice(_))
    ));
    assert!(matches!(
        ctx.create_pool(&PoolProps {
            chunk_divisor: Some(0),
            ..PoolProps::new(DEV)
        }),
        Err(Error::InvalidProps(_))
    ));
    pool.audit().unwrap();
}

/// Growth chunks: at most the pool's reserved bytes over the divisor (at
/// least a granule, at most the chunk size) once the pool holds
/// `granule_growth_below` bytes, one granule before; until the program has
/// marked two steps, one granule while the pool holds under 16 GiB; or the
/// chunk size itself without a divisor.
pub fn growth_chunks_scale_with_the_pool<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let chunk_sizes = |pool: &vmpool::Pool<B>| -> Vec<u64> {
        let s = pool.snapshot();
        let large = s.arenas[1].0;
        s.units
            .iter()
            .filter(|u| u.va >= large)
            .map(|u| u.size)
            .collect()
    };
    let pool = |chunk_divisor, granule_growth_below| {
        ctx.create_pool(&PoolProps {
            va_size: Some(4 << 30),
            chunk_size: Some(16 * g),
            chunk_divisor,
            granule_growth_below,
            ..PoolProps::new(DEV)
        })
        .unwrap()
    };
    // Divisor 4, each growth capped at what the pool held before it over 4:
    // empty, by granules; at 8 granules, by 2; at 16, by 4; at 80, by the
    // chunk size (16, under 80 / 4). With granules below 16 of them, the
    // second growth is by granules too, and before the second step mark
    // every growth is.
    let by_granules = [(8, 1, 8), (8, 1, 8), (64, 1, 64), (32, 1, 32)];
    for (below, marks, growths) in [
        (0, 0, [(8, 1, 8), (8, 2, 4), (64, 4, 16), (32, 16, 2)]),
        (16 * g, 2, [(8, 1, 8), (8, 1, 8), (64, 4, 16), (32, 16, 2)]),
        (16 * g, 0, by_granules),
        (16 * g, 1, by_granules),
    ] {
        let scaled = pool(Some(4), below);
        for _ in 0..marks {
            scaled.mark_step().unwrap();
        }
        let mut live = Vec::new();
        for (granules, chunk, count) in growths {
            let before = chunk_sizes(&scaled).len();
            live.push(scaled.allocate(granules * g).unwrap());
            assert_eq!(
                chunk_sizes(&scaled)[before..],
                vec![chunk * g; count],
                "granules below {below}, {marks} marks, growth of {granules}"
            );
        }
        scaled.audit().unwrap();
        for x in live {
            scaled.free(x).unwrap();
        }
    }
    // No divisor: whole chunks from the first growth on, whatever the
    // granule limit.
    let fixed = pool(None, 16 * g);
    let a = fixed.allocate(20 * g).unwrap();
    assert_eq!(chunk_sizes(&fixed), vec![16 * g, 4 * g]);
    fixed.free(a).unwrap();
}

/// Which free units growth moves first: by address with fixed chunks; with
/// chunks scaled to the pool, first those of free blocks that start and end
/// on unit boundaries, which leaves no part of a unit beside live bytes cut
/// off from its free block.
pub fn growth_moves_whole_free_blocks_first<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    for (chunk_divisor, moved, kept) in [(None, [3, 4], [7]), (Some(1024), [6, 7], [4])] {
        let pool = ctx
            .create_pool(&PoolProps {
                va_size: Some(4 << 30),
                chunk_size: Some(g),
                chunk_divisor,
                ..PoolProps::new(DEV)
            })
            .unwrap();
        // One unit a granule, in units from p's start:
        // [p 0-2.5 | q 2.5-3 | r 3-5 | s 5-6 | t 6-8 | u 8-9]
        let p = pool.allocate(5 * g / 2).unwrap();
        let q = pool.allocate(g / 2).unwrap();
        let r = pool.allocate(2 * g).unwrap();
        let s = pool.allocate(g).unwrap();
        let t = pool.allocate(2 * g).unwrap();
        let u = pool.allocate(g).unwrap();
        let at = |i: u64| p.ptr().0 + i * g;
        assert_eq!(
            [q.ptr().0, r.ptr().0, s.ptr().0, t.ptr().0, u.ptr().0],
            [at(0) + 5 * g / 2, at(3), at(5), at(6), at(8)]
        );
        // Free blocks: [2.5, 5), beside p's last unit, and [6, 8), whole
        // units at both ends. Nothing free holds three granules, so the
        // request below moves three of the four free units.
        pool.free(q).unwrap();
        pool.free(r).unwrap();
        pool.free(t).unwrap();
        let before = pool.stats();
        let v = pool.allocate(5 * g / 2 + 256).unwrap();
        let after = pool.stats();
        assert_eq!(after.chunks_created, before.chunks_created);
        assert_eq!(after.remaps - before.remaps, 3);
        let mapped: Vec<u64> = pool.snapshot().units.iter().map(|u| u.va).collect();
        for i in moved {
            assert!(
                !mapped.contains(&at(i)),
                "{chunk_divisor:?}: unit {i} did not move"
            );
        }
        for i in kept {
            assert!(mapped.contains(&at(i)), "{chunk_divisor:?}: unit {i} moved");
        }
        pool.audit().unwrap();
        for a in [p, s, u, v] {
            pool.free(a).unwrap();
        }
    }
}

/// A pool the program has emptied, after growth moved units, lays out what
/// comes next as it did from empty (Note [Starting afresh]): its free
/// units go spare, parked where they are, and the next allocation lands
/// where the first one did, on the memory the pool holds. While anything
/// stays live, and after a fresh start with no move since, nothing moves.
pub fn an_emptied_pool_starts_afresh<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let pool = granule_unit_pool(&ctx, g, FreshStart::WhenEmptied);
    let (first, y) = move_units_around(&pool, g);
    // y is live: no fresh start.
    let unmaps = pool.stats().unmaps;
    let w = pool.allocate(g).unwrap();
    assert_eq!(pool.stats().unmaps, unmaps);
    pool.free(w).unwrap();
    pool.free(y).unwrap();
    // Empty: the free units go spare, and growth maps one at the start,
    // where none is parked (x's moved): the highest parked one goes there.
    let before = pool.stats();
    let fresh = pool.allocate(g).unwrap();
    let after = pool.stats();
    assert_eq!(fresh.ptr(), first);
    assert_eq!(after.unmaps - before.unmaps, 1);
    assert_eq!(after.chunks_created, before.chunks_created);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    assert_eq!(pool.snapshot().units.len(), 1);
    assert_eq!(after.mapped_bytes, g);
    assert_eq!(after.spare_bytes, after.reserved_bytes - g);
    pool.audit().unwrap();
    // Emptied again with no move since: the layout stays.
    pool.free(fresh).unwrap();
    let unmaps = pool.stats().unmaps;
    let again = pool.allocate(g).unwrap();
    assert_eq!(pool.stats().unmaps, unmaps);
    assert_eq!(again.ptr(), first);
    pool.free(again).unwrap();
}

/// With `FreshStart::Never`, an emptied pool keeps the layout the last work
/// left: nothing is parked or moved when the next work begins.
pub fn a_pool_told_never_to_start_afresh_keeps_its_layout<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let pool = granule_unit_pool(&ctx, g, FreshStart::Never);
    let (_, y) = move_units_around(&pool, g);
    pool.free(y).unwrap();
    let before = pool.stats();
    let next = pool.allocate(g).unwrap();
    let after = pool.stats();
    assert_eq!(after.spare_bytes, 0, "nothing parked");
    assert_eq!(after.units, before.units);
    assert_eq!(after.unmaps, before.unmaps);
    assert_eq!(after.maps, before.maps);
    pool.free(next).unwrap();
    pool.audit().unwrap();
}

/// A fresh start keeps its chunks mapped where they were (parked): the
/// same work done again on the emptied pool lays out as the first time,
/// and where it lays a chunk of a parked one's size at its place, takes
/// that one without a driver call (Note [Starting afresh]). A trim and a
/// sleep give parked chunks back like any spare.
pub fn a_fresh_start_maps_again_in_place<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let pool = granule_unit_pool(&ctx, g, FreshStart::WhenEmptied);
    // [a: 4 units | x | y | z]; x and z freed, then x's unit moved beside
    // z's to make v.
    let pass = || -> Vec<u64> {
        let a = pool.allocate(4 * g).unwrap();
        let x = pool.allocate(g).unwrap();
        let y = pool.allocate(g).unwrap();
        let z = pool.allocate(g).unwrap();
        let ptrs = vec![a.ptr().0, x.ptr().0, y.ptr().0, z.ptr().0];
        pool.free(x).unwrap();
        pool.free(z).unwrap();
        let v = pool.allocate(2 * g).unwrap();
        let ptrs = [ptrs, vec![v.ptr().0]].concat();
        for done in [a, y, v] {
            pool.free(done).unwrap();
        }
        ptrs
    };
    let first = pass();
    let once = pool.stats();
    assert_eq!(once.chunks_created, 7);
    assert_eq!(once.remaps, 1, "the case needs a move");
    let again = pass();
    let twice = pool.stats();
    assert_eq!(again, first, "laid out as the first time");
    assert_eq!(twice.chunks_created, 7);
    assert_eq!(twice.reserved_bytes, once.reserved_bytes);
    // a, y and z in place; x's place was left empty by the move, so the
    // highest parked chunk (x's, beside z) goes there, and v's move is
    // made again: two maps, where unmapping every unit at the fresh start
    // made eight.
    assert_eq!(twice.maps - once.maps, 2);
    assert_eq!(twice.unmaps - once.unmaps, 2);
    pool.audit().unwrap();
    // Parked chunks go back with a trim, and with a sleep.
    let fresh = pool.allocate(g).unwrap();
    assert!(pool.stats().spare_bytes > 0, "parked");
    pool.free(fresh).unwrap();
    pool.trim_to(0).unwrap();
    let trimmed = pool.stats();
    assert_eq!(
        (
            trimmed.reserved_bytes,
            trimmed.mapped_bytes,
            trimmed.spare_bytes
        ),
        (0, 0, 0)
    );
    pool.audit().unwrap();
    pass();
    let fresh = pool.allocate(g).unwrap();
    assert!(pool.stats().spare_bytes > 0, "parked");
    let s = ctx.create_stream(DEV).unwrap();
    pool.sleep(SleepLevel::DiscardAll, &s).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.audit().unwrap();
    assert_eq!(pool.wake(&s).unwrap().mapped_bytes, g);
    assert_eq!(pool.stats().reserved_bytes, g);
    pool.audit().unwrap();
    pool.free(fresh).unwrap();
}

pub fn small_allocations_are_packed<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    let g = b.granularity(DEV).unwrap() as u64;
    let n = (g / 1024) as usize; // one granule's worth
    let all: Vec<Allocation> = (0..n).map(|_| pool.allocate(1000).unwrap()).collect();
    assert_eq!(pool.attribute(PoolAttribute::ReservedMemCurrent), g);
    for a in all {
        pool.free(a).unwrap();
    }
}

/// The seed's picture: a checkerboard of holes, then one request larger
/// than any hole, served by remapping the free chunks, with no new memory.
pub fn checkerboard_is_served_by_remapping<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let pool = ctx
        .create_pool(&PoolProps {
            chunk_size: Some(g),
            va_size: Some(4 << 30),
            ..PoolProps::new(DEV)
        })
        .unwrap();
    let s = b.create_stream(DEV).unwrap();
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    let mut holes = Vec::new();
    for i in 0..32u32 {
        let a = pool.allocate(g).unwrap();
        if i % 2 == 0 {
            fill(&**b, &s, &a, 0xDA7A_0000 + i);
            live.push((a, 0xDA7A_0000 + i));
        } else {
            holes.push(a);
        }
    }
    for a in holes {
        pool.free(a).unwrap();
    }
    let before = pool.stats();
    assert_eq!(before.largest_free_range, g);
    let big = pool.allocate(15 * g).unwrap();
    let after = pool.stats();
    assert_eq!(
        after.chunks_created, before.chunks_created,
        "grew instead of remapping"
    );
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    assert!(after.remaps >= 14, "only {} remaps", after.remaps);
    fill(&**b, &s, &big, 0xB16);
    for (a, seed) in &live {
        check(&**b, &s, a, *seed);
    }
    check(&**b, &s, &big, 0xB16);
    pool.audit().unwrap();
    pool.free(big).unwrap();
    for (a, _) in live {
        pool.free(a).unwrap();
    }
}

pub fn trim_returns_every_chunk<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    let all: Vec<Allocation> = [5 * MIB, 100, 7 * MIB, 64 * 1024, 33 * MIB]
        .iter()
        .map(|&s| pool.allocate(s).unwrap())
        .collect();
    for a in all {
        pool.free(a).unwrap();
    }
    let reserved = pool.stats().reserved_bytes;
    pool.trim_to(reserved - 1).unwrap();
    assert!(
        pool.stats().reserved_bytes < reserved,
        "trim released nothing"
    );
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.reserved_bytes, 0);
    assert_eq!(st.chunks_created, st.chunks_released);
    assert!(pool.attribute(PoolAttribute::ReservedMemHigh) >= reserved);
    pool.set_attribute(PoolAttribute::ReservedMemHigh, 0)
        .unwrap();
    assert_eq!(pool.attribute(PoolAttribute::ReservedMemHigh), 0);
    pool.audit().unwrap();
}

pub fn trim_keeps_live_chunks<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    let s = b.create_stream(DEV).unwrap();
    let gone = pool.allocate(40 * MIB).unwrap();
    let keep = pool.allocate(3 * MIB).unwrap();
    fill(&**b, &s, &keep, 77);
    pool.free(gone).unwrap();
    pool.trim_to(0).unwrap();
    let held = pool.stats().reserved_bytes;
    assert!((3 * MIB..40 * MIB).contains(&held), "holds {held}");
    check(&**b, &s, &keep, 77);
    pool.free(keep).unwrap();
}

pub fn attributes_and_current_pool<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.default_pool(DEV).unwrap();
    assert_eq!(pool.attribute(PoolAttribute::ReleaseThreshold), 0);
    for switch in PoolAttribute::REUSE_SWITCHES {
        assert_eq!(pool.attribute(switch), 1, "{switch:?} is on by default");
        pool.set_attribute(switch, 0).unwrap();
        assert_eq!(pool.attribute(switch), 0);
        assert!(pool.set_attribute(switch, 2).is_err());
    }
    pool.set_attribute(PoolAttribute::ReleaseThreshold, 1 << 30)
        .unwrap();
    assert_eq!(pool.attribute(PoolAttribute::ReleaseThreshold), 1 << 30);
    assert!(pool
        .set_attribute(PoolAttribute::UsedMemCurrent, 0)
        .is_err());
    assert!(pool.set_attribute(PoolAttribute::UsedMemHigh, 5).is_err());
    let explicit = small_pool(&ctx);
    ctx.set_current_pool(&explicit).unwrap();
    let a = ctx.current_pool(DEV).unwrap().allocate(10).unwrap();
    explicit.free(a).unwrap();
}

pub fn many_threads<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = small_pool(&ctx);
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let pool = pool.clone();
            scope.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..300u64 {
                    let size = 1 + (t * 7919 + i * 104_729) % (3 * MIB);
                    mine.push(pool.allocate(size).unwrap());
                    if mine.len() > 8 {
                        let a = mine.swap_remove((i as usize * 31) % mine.len());
                        pool.free(a).unwrap();
                    }
                }
                for a in mine {
                    pool.free(a).unwrap();
                }
            });
        }
    });
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), 0);
    pool.audit().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// As with CUDA's pools: dropping the pool (and its context) with memory
/// still allocated leaves that memory mapped and usable.
pub fn live_memory_outlives_its_pool<B: TestBackend>(b: &Arc<B>) {
    let s = b.create_stream(DEV).unwrap();
    let survivor = {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = small_pool(&ctx);
        let a = pool.allocate(3 * MIB).unwrap();
        let gone = pool.allocate(5 * MIB).unwrap();
        pool.free(gone).unwrap();
        a
    };
    fill(&**b, &s, &survivor, 0x5A5A);
    check(&**b, &s, &survivor, 0x5A5A);
}

/// A request the address space could hold, but not beside what is live
/// in it: a typed error that names the way out, nothing changed, and the
/// same request served once the space is free.
pub fn address_space_runs_out<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    // 64 MiB: an eighth for small allocations, 56 MiB for large ones.
    let pool = pool_reserving(&ctx, 64 * MIB);
    let live = pool.allocate(24 * MIB).unwrap();
    let freed = pool.allocate(24 * MIB).unwrap();
    pool.free(freed).unwrap();
    // 32 MiB of the large part free, wherever the two went: 34 MiB does
    // not fit, though it is less than the space.
    let before = pool.stats();
    match pool.allocate(34 * MIB) {
        Err(
            e @ Error::OutOfAddressSpace {
                requested,
                arena_size,
                ..
            },
        ) => {
            assert_eq!((requested, arena_size), (34 * MIB, 56 * MIB));
            assert!(e.to_string().contains("VMPOOL_VA_SIZE"), "{e}");
        }
        r => panic!("expected out of address space, got {r:?}"),
    }
    // Only the time spent looking for room is counted.
    let mut after = pool.stats();
    assert!(after.grow_nanos >= before.grow_nanos);
    after.grow_nanos = before.grow_nanos;
    assert_eq!(after, before, "a refused allocation changed the pool");
    pool.audit().unwrap();
    pool.free(live).unwrap();
    let whole = pool.allocate(34 * MIB).unwrap();
    pool.free(whole).unwrap();
    pool.audit().unwrap();
}

/// With no room left in the large allocations' part of the address
/// space, a large request is served from the small allocations' free
/// memory, as when the device is full.
pub fn a_full_address_space_borrows_the_other_arenas_memory<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = pool_reserving(&ctx, 64 * MIB);
    let base = pool.snapshot().arenas[0].0;
    // A small allocation maps a granule of the small part; the rest of
    // it stays free there (a unit with a live byte does not move).
    let small = pool.allocate(256).unwrap();
    let large = pool.allocate(56 * MIB).unwrap();
    let borrowed = pool.allocate(SMALL_LIMIT).unwrap();
    assert!(
        borrowed.ptr().0 < base + 8 * MIB,
        "{} is not in the small part",
        borrowed.ptr()
    );
    assert!(matches!(
        pool.allocate(8 * MIB),
        Err(Error::OutOfAddressSpace { .. })
    ));
    pool.free(borrowed).unwrap();
    pool.free(large).unwrap();
    pool.free(small).unwrap();
    pool.audit().unwrap();
}

pub fn pool_limit<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx
        .create_pool(&PoolProps {
            max_size: Some(8 * MIB),
            va_size: Some(1 << 30),
            ..PoolProps::new(DEV)
        })
        .unwrap();
    let a = pool.allocate(6 * MIB).unwrap();
    assert!(matches!(
        pool.allocate(4 * MIB),
        Err(Error::PoolLimit { .. })
    ));
    pool.audit().unwrap();
    pool.free(a).unwrap();
    let whole = pool.allocate(8 * MIB).unwrap();
    pool.free(whole).unwrap();
    // Raised later: room for more. Lowered under what is held: that stays,
    // growth fails, and trimming brings the pool under the limit.
    pool.set_max_size(Some(16 * MIB));
    let a = pool.allocate(12 * MIB).unwrap();
    pool.set_max_size(Some(4 * MIB));
    assert!(pool.stats().reserved_bytes >= 12 * MIB);
    assert!(matches!(
        pool.allocate(12 * MIB),
        Err(Error::PoolLimit { max_size, .. }) if max_size == 4 * MIB
    ));
    pool.free(a).unwrap();
    pool.trim_to(0).unwrap();
    let small = pool.allocate(4 * MIB).unwrap();
    pool.free(small).unwrap();
    pool.set_max_size(None);
    let big = pool.allocate(64 * MIB).unwrap();
    pool.free(big).unwrap();
    pool.audit().unwrap();
}

/// `Defragment::WholeRegions` moves no unit out of a region that holds live
/// bytes (which would split it); `Units` does, and `Off` moves nothing.
pub fn whole_regions_split_no_region<B: TestBackend>(b: &Arc<B>) {
    for (scope, moved) in [
        (Defragment::Units, 1),
        (Defragment::WholeRegions, 0),
        (Defragment::Off, 0),
    ] {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = ctx
            .create_pool(&PoolProps {
                chunk_size: Some(2 * MIB),
                chunk_divisor: None,
                defragment: scope,
                va_size: Some(4 << 30),
                ..PoolProps::new(DEV)
            })
            .unwrap();
        // One region of three units; the middle one freed.
        let a = pool.allocate(2 * MIB).unwrap();
        let hole = pool.allocate(2 * MIB).unwrap();
        let c = pool.allocate(2 * MIB).unwrap();
        pool.free(hole).unwrap();
        let before = pool.stats();
        let d = pool.allocate(4 * MIB).unwrap();
        let after = pool.stats();
        assert_eq!(after.remaps - before.remaps, moved, "{scope:?}");
        assert_eq!(
            after.chunks_created - before.chunks_created,
            2 - moved,
            "{scope:?}"
        );
        pool.audit().unwrap();
        for x in [a, c, d] {
            pool.free(x).unwrap();
        }
        pool.audit().unwrap();
    }
}

/// `PoolSnapshot::slack`: a part-used unit's free bytes are shared ones,
/// an empty unit's whole, and the parts add up to the reserved bytes; a
/// free range that ends its region counts at the region's ends.
pub fn slack_says_where_the_reserved_bytes_lie<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let g = b.granularity(DEV).unwrap() as u64;
    let pool = granule_unit_pool(&ctx, g, FreshStart::Never);
    let adds_up = |s: vmpool::Slack| {
        assert_eq!(
            s.reserved,
            s.used + s.free_whole_units + s.free_in_shared_units + s.spare + s.pending + s.other,
            "{s:?}"
        );
        assert!(s.free_at_region_ends <= s.free_in_shared_units, "{s:?}");
    };
    // One and a half granules: two units, the second half free.
    let a = pool.allocate(g + g / 2).unwrap();
    let s = pool.snapshot().slack();
    adds_up(s);
    assert_eq!(s.reserved, 2 * g, "{s:?}");
    assert_eq!(s.used, g + g / 2);
    assert_eq!(
        (s.free_in_shared_units, s.shared_units),
        (g / 2, 1),
        "{s:?}"
    );
    // Those free bytes end the one mapped region.
    assert_eq!((s.free_at_region_ends, s.regions), (g / 2, 1), "{s:?}");
    assert_eq!((s.free_whole_units, s.other), (0, 0), "{s:?}");
    // A granule more, then freed: its unit, or the units it spanned, free.
    let b2 = pool.allocate(2 * g).unwrap();
    pool.free(b2).unwrap();
    let s = pool.snapshot().slack();
    adds_up(s);
    assert_eq!(s.used, g + g / 2);
    assert!(s.free_whole_units >= g, "{s:?}");
    assert_eq!(s.other, 0, "{s:?}");
    pool.free(a).unwrap();
    let s = pool.snapshot().slack();
    adds_up(s);
    assert_eq!(
        (
            s.used,
            s.free_in_shared_units,
            s.shared_units,
            s.free_at_region_ends
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.free_whole_units + s.spare, s.reserved, "{s:?}");
    // After a fresh start, the units parked where they were are spares,
    // counted once.
    let pool = granule_unit_pool(&ctx, g, FreshStart::WhenEmptied);
    let (_, y) = move_units_around(&pool, g);
    pool.free(y).unwrap();
    let fresh = pool.allocate(g).unwrap();
    let s = pool.snapshot().slack();
    adds_up(s);
    assert_eq!((s.used, s.spare), (g, s.reserved - g), "{s:?}");
    assert_eq!((s.free_whole_units, s.other), (0, 0), "{s:?}");
    pool.free(fresh).unwrap();
}

suites!(
    slack_says_where_the_reserved_bytes_lie,
    whole_regions_split_no_region,
    sizes_and_alignment,
    more_than_half_the_device,
    invalid_requests,
    growth_chunks_scale_with_the_pool,
    growth_moves_whole_free_blocks_first,
    an_emptied_pool_starts_afresh,
    a_fresh_start_maps_again_in_place,
    a_pool_told_never_to_start_afresh_keeps_its_layout,
    small_allocations_are_packed,
    checkerboard_is_served_by_remapping,
    trim_returns_every_chunk,
    trim_keeps_live_chunks,
    attributes_and_current_pool,
    many_threads,
    live_memory_outlives_its_pool,
    pool_limit,
    address_space_runs_out,
    a_full_address_space_borrows_the_other_arenas_memory,
);

// ---- host only: a small device, filled up, and injected faults ---------------

mod small_device {
    use super::*;
    use vmpool::vmm::host::{Host, HostConfig};
    use vmpool::vmm::testing::faulty::Call;

    fn device(mib: usize) -> Arc<Host> {
        Host::new(HostConfig {
            devices: 1,
            first_device: 0,
            memory_per_device: mib << 20,
            granularity: 2 << 20,
        })
        .unwrap()
    }

    #[test]
    fn out_of_memory_reports_what_it_had() {
        let b = device(64);
        let ctx = Context::new(Arc::clone(&b)).unwrap();
        let pool = ctx.default_pool(DEV).unwrap();
        let a = pool.allocate(60 * MIB).unwrap();
        match pool.allocate(8 * MIB) {
            Err(Error::OutOfMemory {
                requested,
                reserved,
                used,
                device_free,
                ..
            }) => {
                assert_eq!(requested, 8 * MIB);
                assert_eq!(reserved, 60 * MIB);
                assert_eq!(used, 60 * MIB);
                assert_eq!(device_free, 4 * MIB);
            }
            r => panic!("expected out-of-memory, got {r:?}"),
        }
        pool.audit().unwrap();
        // Nothing was lost: the rest of the device is still usable.
        let rest = pool.allocate(4 * MIB).unwrap();
        pool.free(rest).unwrap();
        pool.free(a).unwrap();
    }

    #[test]
    fn other_pools_release_their_unused_memory_first() {
        let b = device(64);
        let ctx = Context::new(Arc::clone(&b)).unwrap();
        let hoarder = ctx.default_pool(DEV).unwrap();
        hoarder
            .set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
            .unwrap();
        let held = hoarder.allocate(48 * MIB).unwrap();
        hoarder.free(held).unwrap();
        assert_eq!(hoarder.stats().reserved_bytes, 48 * MIB);
        let other = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
        let a = other.allocate(40 * MIB).unwrap();
        assert_eq!(
            hoarder.stats().reserved_bytes,
            0,
            "the hoarder kept its cache"
        );
        other.free(a).unwrap();
    }

    #[test]
    fn a_full_fragmented_device_still_serves_half_of_it_in_one_piece() {
        let b = device(64);
        let ctx = Context::new(Arc::clone(&b)).unwrap();
        let pool = ctx
            .create_pool(&PoolProps {
                chunk_size: Some(2 * MIB),
                ..PoolProps::new(DEV)
            })
            .unwrap();
        let all: Vec<Allocation> = (0..32).map(|_| pool.allocate(2 * MIB).unwrap()).collect();
        let mut keep = Vec::new();
        for (i, a) in all.into_iter().enumerate() {
            if i % 2 == 0 {
                keep.push(a);
            } else {
                pool.free(a).unwrap();
            }
        }
        assert_eq!(b.mem_info(DEV).unwrap().free, 0, "the device is full");
        let big = pool.allocate(32 * MIB).unwrap();
        pool.audit().unwrap();
        pool.free(big).unwrap();
        for a in keep {
            pool.free(a).unwrap();
        }
    }

    /// Grows, remaps and trims; errors are allowed (a fault was injected),
    /// inconsistency is not.
    fn workload<B: TestBackend>(pool: &vmpool::Pool<B>) {
        let mut live = Vec::new();
        for i in 0..24u64 {
            if let Ok(a) = pool.allocate(MIB + (i % 5) * MIB + i * 1000) {
                live.push(a);
            }
            pool.audit().unwrap();
        }
        // Free every other one, then ask for large ranges: remaps.
        let mut kept = Vec::new();
        for (i, a) in live.into_iter().enumerate() {
            if i % 2 == 0 {
                pool.free(a).unwrap();
            } else {
                kept.push(a);
            }
        }
        for size in [9 * MIB, 17 * MIB, 3 * MIB] {
            if let Ok(a) = pool.allocate(size) {
                kept.push(a);
            }
            pool.audit().unwrap();
        }
        let _ = pool.trim_to(0);
        pool.audit().unwrap();
        for a in kept {
            pool.free(a).unwrap();
        }
        // Emptied after moves: the next allocations start afresh, on
        // parked chunks, in place or unmapped and mapped elsewhere.
        let mut again = Vec::new();
        for size in [5 * MIB, MIB, 9 * MIB] {
            if let Ok(a) = pool.allocate(size) {
                again.push(a);
            }
            pool.audit().unwrap();
        }
        for a in again {
            pool.free(a).unwrap();
        }
        let _ = pool.trim_to(0);
        pool.audit().unwrap();
    }

    #[test]
    fn every_injected_fault_leaves_the_pool_consistent_and_nothing_leaked() {
        let calls = [
            Call::CreateChunk,
            Call::Map,
            Call::SetAccess,
            Call::Unmap,
            Call::ReleaseChunk,
        ];
        let injected = crate::common::at_every_call_site(&calls, |b| {
            let ctx = Context::new(Arc::clone(b)).unwrap();
            let pool = ctx
                .create_pool(&PoolProps {
                    chunk_size: Some(4 * MIB),
                    ..PoolProps::new(DEV)
                })
                .unwrap();
            workload(&pool);
            let fired = b.disarm();
            // After the fault, the pool still works.
            let a = pool.allocate(5 * MIB).unwrap();
            pool.free(a).unwrap();
            pool.trim_to(0).unwrap();
            assert_eq!(pool.stats().reserved_bytes, 0);
            fired
        });
        assert!(injected > 40, "only {injected} faults were injected");
    }
}
