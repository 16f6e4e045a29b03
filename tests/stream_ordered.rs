//! The stream-ordered front end (CUDA's rules for `cudaMallocAsync`), point
//! by point, on every backend: the host backend always, CUDA with
//! `--features gpu-tests`. The samples of CUDA's stream-ordered allocator
//! guide are here too: the in-order reuse loop with
//! and without a release threshold, and a library function that allocates
//! in function scope on its caller's stream.

use std::sync::Arc;
use std::time::Duration;

use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{
    Allocation, Context, Error, Pool, PoolAttribute, PoolProps, Stream, DEFAULT_CHUNK_SIZE,
};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;
/// One whole growth chunk: an allocation of this size leaves no free space
/// in the heap, so the next one must reuse a free or grow.
const WHOLE: u64 = DEFAULT_CHUNK_SIZE;
const LATE: Duration = Duration::from_millis(300);

fn fill<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, value: u32) {
    b.fill_u32(s.raw(), a.ptr(), (a.size() / 4) as usize, value)
        .unwrap();
}

/// Every word of the allocation, read in `s`'s order.
fn assert_holds<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, value: u32) {
    let len = (a.size() / 4 * 4) as usize;
    let mut bytes = vec![0u8; len];
    b.copy_to_host(s.raw(), a.ptr(), &mut bytes).unwrap();
    assert!(
        bytes == value.to_ne_bytes().repeat(len / 4),
        "{} does not hold {value:#x} throughout",
        a.ptr()
    );
}

fn setup<B: TestBackend>(b: &Arc<B>, switches: [u64; 3]) -> (Context<B>, vmpool::Pool<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx
        .create_pool(&PoolProps {
            va_size: Some(8 << 30),
            // Growth by one whole chunk, so that the chunk counts below
            // count growths.
            chunk_divisor: None,
            ..PoolProps::new(DEV)
        })
        .unwrap();
    for (attr, on) in PoolAttribute::REUSE_SWITCHES.into_iter().zip(switches) {
        pool.set_attribute(attr, on).unwrap();
    }
    ctx.set_current_pool(&pool).unwrap();
    (ctx, pool)
}

/// A pool growing by 2 MiB chunks, so that units can be counted in
/// allocations of whole MiB.
fn pool_of_2mib_chunks<B: TestBackend>(ctx: &Context<B>) -> vmpool::Pool<B> {
    ctx.create_pool(&PoolProps {
        chunk_size: Some(2 * MIB),
        ..PoolProps::new(DEV)
    })
    .unwrap()
}

/// [`pool_of_2mib_chunks`] that keeps what it holds when a stream passes
/// (release threshold max): only growth and trims unmap.
fn kept_pool_of_2mib_chunks<B: TestBackend>(ctx: &Context<B>) -> vmpool::Pool<B> {
    let pool = pool_of_2mib_chunks(ctx);
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    pool
}

/// Six 2 MiB units in a row (on a new pool of 2 MiB chunks), under a, b,
/// c and d of 4, 2, 4 and 2 MiB, allocated on `s`.
fn four_in_a_row<B: TestBackend>(pool: &vmpool::Pool<B>, s: &Stream<B>) -> [Allocation; 4] {
    [4 * MIB, 2 * MIB, 4 * MIB, 2 * MIB].map(|size| pool.allocate_async(size, s).unwrap())
}

const ALL_ON: [u64; 3] = [1, 1, 1];
const ALL_OFF: [u64; 3] = [0, 0, 0];

pub fn same_stream_reuse_without_synchronization<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, ALL_ON);
    let s = ctx.create_stream(DEV).unwrap();
    let a = ctx.alloc_async(MIB, &s).unwrap();
    let first = a.ptr();
    fill(&**b, &s, &a, 0xAAAA);
    ctx.free_async(a, &s).unwrap();
    let before = pool.stats();
    let again = ctx.alloc_async(MIB, &s).unwrap();
    assert_eq!(again.ptr(), first, "the same stream did not reuse its free");
    fill(&**b, &s, &again, 0xBBBB);
    assert_holds(&**b, &s, &again, 0xBBBB);
    let after = pool.stats();
    assert_eq!(after.same_stream_reuses, before.same_stream_reuses + 1);
    assert_eq!(after.chunks_created, before.chunks_created);
    ctx.free_async(again, &s).unwrap();
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

/// On stream `s`: allocates a whole chunk, runs late, writes it, frees it.
/// Returns where it was.
fn late_write_then_free<B: TestBackend>(ctx: &Context<B>, s: &Stream<B>) -> vmpool::vmm::DevicePtr {
    let a = ctx.alloc_async(WHOLE, s).unwrap();
    let ptr = a.ptr();
    ctx.backend().delay(s.raw(), LATE).unwrap();
    fill(&**ctx.backend(), s, &a, 0xA1A1_A1A1);
    ctx.free_async(a, s).unwrap();
    ptr
}

/// Stream A runs late, then writes its block and frees it; stream B, with
/// no dependency on A, allocates the same size and writes. A's late write
/// must never land on B's data.
fn race<B: TestBackend>(b: &Arc<B>, switches: [u64; 3]) -> (bool, vmpool::PoolStats) {
    let (ctx, pool) = setup(b, switches);
    let (sa, sb) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    let a_ptr = late_write_then_free(&ctx, &sa);
    let bb = ctx.alloc_async(WHOLE, &sb).unwrap();
    let same = bb.ptr() == a_ptr;
    fill(&**b, &sb, &bb, 0xB2B2_B2B2);
    // Read after A's late write has surely happened.
    ctx.synchronize_stream(&sa).unwrap();
    assert_holds(&**b, &sb, &bb, 0xB2B2_B2B2);
    ctx.free_async(bb, &sb).unwrap();
    ctx.synchronize_device(DEV).unwrap();
    pool.audit().unwrap();
    (same, pool.stats())
}

/// Frees of one stream serve that stream at any size, merged, before the
/// work that used them has run; no other stream gets them unordered.
pub fn own_frees_are_reused_at_any_size<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, ALL_OFF);
    let (sa, sb) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    let (quarter, half) = (WHOLE / 4, WHOLE / 2);
    let parts: Vec<Allocation> = (0..4)
        .map(|_| ctx.alloc_async(quarter, &sa).unwrap())
        .collect();
    let start = parts.iter().map(|a| a.ptr().0).min().unwrap();
    let inside = |a: &Allocation| a.ptr().0 < start + WHOLE && a.ptr().0 + a.size() > start;
    b.delay(sa.raw(), LATE).unwrap();
    for (i, a) in parts.iter().enumerate() {
        fill(&**b, &sa, a, 0xA0 + i as u32);
    }
    for a in parts {
        ctx.free_async(a, &sa).unwrap();
    }
    let created = pool.stats().chunks_created;
    // The freeing stream takes two quarters as one block, at once; the
    // other two stay free in the heap, guarded.
    let first = ctx.alloc_async(half, &sa).unwrap();
    assert!(inside(&first), "stream A did not reuse its own frees");
    assert_eq!(pool.stats().frees_merged, 4);
    assert_eq!(pool.stats().pending_bytes, half);
    // Another stream, not ordered after the frees, with every switch off,
    // must not get the guarded half: it grows.
    let other = ctx.alloc_async(half, &sb).unwrap();
    assert!(
        !inside(&other),
        "stream B got memory stream A has not passed"
    );
    assert_eq!(pool.stats().chunks_created, created + 1);
    fill(&**b, &sb, &other, 0xBBBB);
    // Stream A may still take it.
    let second = ctx.alloc_async(half, &sa).unwrap();
    assert!(inside(&second));
    assert_eq!(pool.stats().chunks_created, created + 1);
    for (a, v) in [(&first, 0xC1), (&second, 0xC2)] {
        fill(&**b, &sa, a, v);
        assert_holds(&**b, &sa, a, v);
    }
    assert_holds(&**b, &sb, &other, 0xBBBB);
    for a in [first, second] {
        ctx.free_async(a, &sa).unwrap();
    }
    ctx.free_async(other, &sb).unwrap();
    ctx.synchronize_device(DEV).unwrap();
    pool.audit().unwrap();
    assert_eq!(pool.stats().pending_bytes, 0);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// Four allocations in a row; with the stream held back, the first and
/// third are freed and their four units moved, under the stream's work,
/// into an 8 MiB allocation (four aliases, `big`, filled 0xB16); the
/// second is filled 0x11.
struct Moved {
    bb: Allocation,
    d: Allocation,
    big: Allocation,
}

fn four_units_moved_under_work<B: TestBackend>(b: &Arc<B>, pool: &Pool<B>, s: &Stream<B>) -> Moved {
    let [a, bb, c, d] = four_in_a_row(pool, s);
    b.delay(s.raw(), LATE).unwrap();
    fill(&**b, s, &bb, 0x11);
    pool.free_async(a, s).unwrap();
    pool.free_async(c, s).unwrap();
    let big = pool.allocate_async(8 * MIB, s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 8 * MIB);
    fill(&**b, s, &big, 0xB16);
    Moved { bb, d, big }
}

/// Before growth plans, it waits for the streams that may still use the
/// old places of units it moved (Note [Guards and aliases], "Growth waits
/// for aliases"): the next growth finds them gone, whatever the stream's
/// timing, and every byte written is kept. It waits for those streams
/// only: another stream's pending free stays pending.
pub fn growth_waits_for_the_old_places_of_moved_units<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _) = setup(b, ALL_OFF);
    let pool = kept_pool_of_2mib_chunks(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let other = ctx.create_stream(DEV).unwrap();
    // In the small arena, apart from the units that move.
    let small = pool.allocate_async(64 << 10, &other).unwrap();
    let Moved { bb, d, big } = four_units_moved_under_work(b, &pool, &s);
    b.delay(other.raw(), 4 * LATE).unwrap();
    pool.free_async(small, &other).unwrap();
    // The next growth waits for the stream first: the aliases go.
    let fence = pool.allocate_async(2 * MIB, &s).unwrap();
    let st = pool.stats();
    assert_eq!(st.aliased_bytes, 0, "the growth did not wait ({st:?})");
    assert_eq!(
        st.pending_bytes,
        64 << 10,
        "the growth waited for a stream with no alias ({st:?})"
    );
    pool.audit().unwrap();
    fill(&**b, &s, &fence, 0xFE);
    assert_holds(&**b, &s, &big, 0xB16);
    assert_holds(&**b, &s, &bb, 0x11);
    assert_holds(&**b, &s, &fence, 0xFE);
    for x in [big, bb, d, fence] {
        pool.free_async(x, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    ctx.synchronize_stream(&other).unwrap();
    trim_gives_every_byte_back(&pool);
}

/// Units moved under a stream's queued work move again for it before it
/// passes, where growth cannot wait for it: in a graph capture (Note
/// [Guards and aliases], "Units moved again"). Their chunks are then
/// mapped at three places, and growth creates only what the moved units
/// do not cover.
pub fn aliased_units_move_again_before_the_stream_passes<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _) = setup(b, ALL_OFF);
    let pool = kept_pool_of_2mib_chunks(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let Moved { bb, d, big } = four_units_moved_under_work(b, &pool, &s);
    let capture = ctx.graph_capture();
    b.begin_capture(s.raw()).unwrap();
    // A fence after them keeps the range from growing in place.
    let fence = pool.allocate_async(2 * MIB, &s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 8 * MIB);
    pool.free_async(big, &s).unwrap();
    let before = pool.stats();
    // 12 MiB: no free range is that large; the four units move again, the
    // places they leave stay mapped too (the stream still works there).
    let bigger = pool.allocate_async(12 * MIB, &s).unwrap();
    let st = pool.stats();
    b.end_capture(s.raw())
        .expect("the pool spoiled the capture");
    drop(capture);
    assert_eq!(
        st.chunks_created,
        before.chunks_created + 2,
        "only what the moved units do not cover is new ({st:?})"
    );
    assert_eq!(st.remaps, before.remaps + 4);
    assert_eq!(st.aliased_bytes, 16 * MIB);
    pool.audit().unwrap();
    // In stream order, after the late writes through both old places.
    fill(&**b, &s, &bigger, 0xB166);
    assert_holds(&**b, &s, &bigger, 0xB166);
    assert_holds(&**b, &s, &bb, 0x11);
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
    for x in [bigger, bb, d, fence] {
        pool.free_async(x, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    trim_gives_every_byte_back(&pool);
}

/// The old places of units moved under a stream's queued work stay
/// mapped after the stream passes them, until the pool's next growth or
/// trim: their unmaps join driver calls made anyway, and a step that
/// follows a growth, served from free memory, calls the driver for none.
pub fn passed_aliases_unmap_with_the_next_growth<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _) = setup(b, ALL_OFF);
    // No trim when a stream passes: only growth may unmap.
    let pool = kept_pool_of_2mib_chunks(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let [a, bb, c, d] = four_in_a_row(&pool, &s);
    b.delay(s.raw(), LATE).unwrap();
    pool.free_async(a, &s).unwrap();
    pool.free_async(c, &s).unwrap();
    // The four free units move under the stream's work: four aliases.
    let big = pool.allocate_async(8 * MIB, &s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 8 * MIB);
    pool.free_async(d, &s).unwrap();
    ctx.synchronize_stream(&s).unwrap();
    let passed = pool.stats();
    assert_eq!(passed.pending_bytes, 0);
    assert_eq!(
        passed.aliased_bytes,
        8 * MIB,
        "mapped until the next growth"
    );
    pool.audit().unwrap();
    // Served from d's free unit: no driver call, the aliases stay.
    let again = pool.allocate_async(2 * MIB, &s).unwrap();
    let st = pool.stats();
    assert_eq!((st.maps, st.unmaps), (passed.maps, passed.unmaps));
    assert_eq!(st.aliased_bytes, 8 * MIB);
    // A growth unmaps them with its own maps.
    let grown = pool.allocate_async(4 * MIB, &s).unwrap();
    let st = pool.stats();
    assert!(st.maps > passed.maps, "the growth maps");
    assert!(
        st.unmaps >= passed.unmaps + 4,
        "and unmaps the four aliases"
    );
    assert_eq!(st.aliased_bytes, 0);
    pool.audit().unwrap();
    fill(&**b, &s, &grown, 0x6E);
    assert_holds(&**b, &s, &grown, 0x6E);
    for x in [big, bb, again, grown] {
        pool.free_async(x, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    trim_gives_every_byte_back(&pool);
}

/// A trim to nothing, once the stream has passed every free: no byte
/// reserved, no alias left, the tables consistent.
fn trim_gives_every_byte_back<B: TestBackend>(pool: &Pool<B>) {
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.reserved_bytes, st.aliased_bytes), (0, 0));
    pool.audit().unwrap();
}

/// Aliases that their streams passed, with nothing else holding their
/// chunks, go at a trim: the pool gives every byte back.
pub fn a_trim_unmaps_passed_aliases<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _) = setup(b, ALL_OFF);
    let pool = kept_pool_of_2mib_chunks(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let a = pool.allocate_async(4 * MIB, &s).unwrap();
    let keep = pool.allocate_async(2 * MIB, &s).unwrap();
    b.delay(s.raw(), LATE).unwrap();
    pool.free_async(a, &s).unwrap();
    let big = pool.allocate_async(6 * MIB, &s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 4 * MIB);
    for x in [big, keep] {
        pool.free_async(x, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 4 * MIB);
    trim_gives_every_byte_back(&pool);
}

/// Defragmenting under a stream that runs behind: the free chunks under
/// its own frees move to build a larger range at once, without new memory
/// and without waiting; their old places stay mapped until it passes them.
pub fn own_frees_move_before_the_stream_passes<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _) = setup(b, ALL_OFF);
    let pool = pool_of_2mib_chunks(&ctx);
    let s = ctx.create_stream(DEV).unwrap();
    let blocks = four_in_a_row(&pool, &s);
    b.delay(s.raw(), LATE).unwrap();
    for (i, a) in blocks.iter().enumerate() {
        fill(&**b, &s, a, 0x10 + i as u32);
    }
    let [a, bb, c, d] = blocks;
    pool.free_async(a, &s).unwrap();
    pool.free_async(c, &s).unwrap();
    let before = pool.stats();
    // 8 MiB: no free range is that large; the four free units move.
    let big = pool.allocate_async(8 * MIB, &s).unwrap();
    let st = pool.stats();
    assert_eq!(st.chunks_created, before.chunks_created, "no new memory");
    assert_eq!(st.remaps, before.remaps + 4);
    assert_eq!(st.aliased_bytes, 8 * MIB, "old places still mapped");
    assert_eq!(st.reserved_bytes, before.reserved_bytes);
    pool.audit().unwrap();
    // In stream order, after the late fills of a and c through their old
    // addresses.
    fill(&**b, &s, &big, 0xB16);
    assert_holds(&**b, &s, &big, 0xB16);
    assert_holds(&**b, &s, &bb, 0x11);
    assert_holds(&**b, &s, &d, 0x13);
    ctx.synchronize_stream(&s).unwrap();
    assert_eq!(pool.stats().aliased_bytes, 0, "unmapped once passed");
    pool.audit().unwrap();
    for x in [big, bb, d] {
        pool.free_async(x, &s).unwrap();
    }
    ctx.synchronize_stream(&s).unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.reserved_bytes, st.mapped_bytes, st.spare_bytes),
        (0, 0, 0)
    );
}

pub fn cross_stream_race_with_switches_on<B: TestBackend>(b: &Arc<B>) {
    let (same, stats) = race(b, ALL_ON);
    // Either other memory, or the same memory after a wait for A's free.
    assert!(
        !same || stats.waits_inserted == 1,
        "reused without waiting: {stats:?}"
    );
}

pub fn cross_stream_race_with_switches_off<B: TestBackend>(b: &Arc<B>) {
    let (same, stats) = race(b, ALL_OFF);
    assert!(!same, "B got A's memory before any synchronization");
    assert_eq!(stats.waits_inserted, 0);
    assert_eq!(stats.chunks_created, 2);
}

pub fn internal_dependency_reuses_instead_of_growing<B: TestBackend>(b: &Arc<B>) {
    let (same, stats) = race(b, [0, 0, 1]);
    assert!(
        same,
        "with internal dependencies on, B should wait and reuse"
    );
    assert_eq!(stats.waits_inserted, 1);
    assert_eq!(stats.chunks_created, 1);
}

pub fn explicit_event_dependency_is_followed<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, [1, 0, 0]);
    let (sa, sb) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    let a_ptr = late_write_then_free(&ctx, &sa);
    let e = ctx.create_event(DEV).unwrap();
    ctx.record_event(&e, &sa).unwrap();
    ctx.stream_wait_event(&sb, &e).unwrap();
    let bb = ctx.alloc_async(WHOLE, &sb).unwrap();
    assert_eq!(
        bb.ptr(),
        a_ptr,
        "B waits on A's event but did not get A's memory"
    );
    fill(&**b, &sb, &bb, 2);
    assert_holds(&**b, &sb, &bb, 2);
    assert_eq!(pool.stats().dependency_reuses, 1);
    assert_eq!(pool.stats().chunks_created, 1);
    ctx.free_async(bb, &sb).unwrap();
    ctx.synchronize_device(DEV).unwrap();
}

pub fn dependencies_follow_a_chain_of_streams<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, [1, 0, 0]);
    let s: Vec<Stream<B>> = (0..3).map(|_| ctx.create_stream(DEV).unwrap()).collect();
    let a = ctx.alloc_async(WHOLE, &s[0]).unwrap();
    let a_ptr = a.ptr();
    b.delay(s[0].raw(), LATE).unwrap();
    ctx.free_async(a, &s[0]).unwrap();
    let e1 = ctx.create_event(DEV).unwrap();
    ctx.record_event(&e1, &s[0]).unwrap();
    ctx.stream_wait_event(&s[1], &e1).unwrap();
    let e2 = ctx.create_event(DEV).unwrap();
    ctx.record_event(&e2, &s[1]).unwrap();
    ctx.stream_wait_event(&s[2], &e2).unwrap();
    let c = ctx.alloc_async(WHOLE, &s[2]).unwrap();
    assert_eq!(
        c.ptr(),
        a_ptr,
        "the dependency did not carry along the chain"
    );
    assert_eq!(pool.stats().dependency_reuses, 1);
    ctx.free_async(c, &s[2]).unwrap();
    ctx.synchronize_device(DEV).unwrap();
}

pub fn completed_frees_are_reused_opportunistically<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, [0, 1, 0]);
    let (sa, sb) = (
        ctx.create_stream(DEV).unwrap(),
        ctx.create_stream(DEV).unwrap(),
    );
    let a = ctx.alloc_async(WHOLE, &sa).unwrap();
    let a_ptr = a.ptr();
    // Work still queued before the free: it cannot have completed yet.
    b.delay(sa.raw(), LATE).unwrap();
    ctx.free_async(a, &sa).unwrap();
    // This miss records an event after A's free, which stays pending
    // behind the delay: grow.
    let other = ctx.alloc_async(WHOLE, &sb).unwrap();
    assert_ne!(other.ptr(), a_ptr);
    // A's stream is idle, so its event completes; the next miss sees it.
    b.synchronize_stream(sa.raw()).unwrap();
    let reused = ctx.alloc_async(WHOLE, &sb).unwrap();
    assert_eq!(reused.ptr(), a_ptr, "a completed free was not reused");
    let st = pool.stats();
    assert_eq!(st.frees_completed, 1);
    assert_eq!(st.chunks_created, 2);
    ctx.free_async(other, &sb).unwrap();
    ctx.free_async(reused, &sb).unwrap();
    ctx.synchronize_device(DEV).unwrap();
}

/// The article's loop: allocate, launch, free, synchronize, 100 times.
fn reuse_loop<B: TestBackend>(b: &Arc<B>, threshold: u64) -> vmpool::PoolStats {
    let (ctx, pool) = setup(b, ALL_ON);
    pool.set_attribute(PoolAttribute::ReleaseThreshold, threshold)
        .unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    for i in 0..100 {
        let a = ctx.alloc_async(4 * MIB, &s).unwrap();
        fill(&**b, &s, &a, i);
        ctx.free_async(a, &s).unwrap();
        ctx.synchronize_stream(&s).unwrap();
    }
    pool.stats()
}

pub fn threshold_zero_goes_to_the_driver_every_iteration<B: TestBackend>(b: &Arc<B>) {
    let st = reuse_loop(b, 0);
    assert_eq!(st.chunks_created, 100, "{st:?}");
    assert_eq!(st.chunks_released, 100);
    assert_eq!(st.reserved_bytes, 0);
}

pub fn high_threshold_never_goes_to_the_driver_after_the_first<B: TestBackend>(b: &Arc<B>) {
    let st = reuse_loop(b, u64::MAX);
    assert_eq!(st.chunks_created, 1, "{st:?}");
    assert_eq!(st.chunks_released, 0);
    assert_eq!(st.maps, 1);
}

/// The article's library: allocation in function scope on the caller's
/// stream, with no synchronization anywhere.
fn library_func<B: TestBackend>(ctx: &Context<B>, stream: &Stream<B>, value: u32) {
    let scratch = ctx.alloc_async(8 * MIB, stream).unwrap();
    ctx.backend()
        .fill_u32(stream.raw(), scratch.ptr(), (8 * MIB / 4) as usize, value)
        .unwrap();
    ctx.free_async(scratch, stream).unwrap();
}

pub fn library_allocates_in_function_scope<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, ALL_ON);
    let s = ctx.create_stream(DEV).unwrap();
    let mine = ctx.alloc_async(MIB, &s).unwrap();
    fill(&**b, &s, &mine, 0x600D);
    for i in 0..10 {
        library_func(&ctx, &s, i);
    }
    assert_holds(&**b, &s, &mine, 0x600D);
    let st = pool.stats();
    assert_eq!(st.same_stream_reuses, 9);
    ctx.free_async(mine, &s).unwrap();
    ctx.synchronize_stream(&s).unwrap();
}

pub fn free_async_to_another_context_fails<B: TestBackend>(b: &Arc<B>) {
    let (ctx, _pool) = setup(b, ALL_ON);
    let (other, _other_pool) = setup(b, ALL_ON);
    let s = ctx.create_stream(DEV).unwrap();
    let a = other
        .alloc_async(1000, &other.create_stream(DEV).unwrap())
        .unwrap();
    assert!(matches!(
        ctx.free_async(a, &s),
        Err(Error::WrongPool { .. })
    ));
}

pub fn many_threads_many_streams<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, ALL_ON);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let ctx = &ctx;
            scope.spawn(move || {
                let s = ctx.create_stream(DEV).unwrap();
                let mut live: Vec<(Allocation, u32)> = Vec::new();
                for i in 0..150u32 {
                    let size = 1 + ((t as u64 * 7919 + i as u64 * 104_729) % (5 * MIB));
                    let a = ctx.alloc_async(size, &s).unwrap();
                    let value = (t << 24) | i;
                    if a.size() >= 4 {
                        fill(&**ctx.backend(), &s, &a, value);
                    }
                    live.push((a, value));
                    if live.len() > 6 {
                        let (a, value) = live.swap_remove((i as usize * 13) % live.len());
                        if a.size() >= 4 {
                            assert_holds(&**ctx.backend(), &s, &a, value);
                        }
                        ctx.free_async(a, &s).unwrap();
                    }
                }
                for (a, value) in live {
                    if a.size() >= 4 {
                        assert_holds(&**ctx.backend(), &s, &a, value);
                    }
                    ctx.free_async(a, &s).unwrap();
                }
            });
        }
    });
    ctx.synchronize_device(DEV).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    assert_eq!(pool.stats().pending_bytes, 0);
    pool.audit().unwrap();
}

/// A stream capturing a graph (as under PyTorch's `torch.cuda.graph`, in
/// the driver's global mode) allocates, frees, reuses its own frees and
/// grows, and the capture holds: with the capture announced
/// (`Context::graph_capture`), the pool queries, records and waits for no
/// event (the driver refuses the first during a capture, from any stream,
/// and the others on or for the capturing stream; a refused call spoils
/// the capture). Memory another stream freed and has not passed is not taken
/// during the capture, as that needs a wait; afterwards it is.
pub fn a_capturing_stream_allocates_without_spoiling_the_capture<B: TestBackend>(b: &Arc<B>) {
    let (ctx, pool) = setup(b, ALL_ON);
    let s = ctx.create_stream(DEV).unwrap();
    let other = ctx.create_stream(DEV).unwrap();
    let theirs = pool.allocate_async(WHOLE, &other).unwrap();
    b.delay(other.raw(), LATE).unwrap();
    pool.free_async(theirs, &other).unwrap();
    // A miss on the other stream merges its free into the heap, guarded,
    // and records an event after it: one a wait could use, as it covers
    // the other stream's latest free.
    let miss = pool.allocate_async(3 * MIB, &other).unwrap();
    let (waits, events) = (pool.stats().waits_inserted, pool.stats().events_recorded);
    let capture = ctx.graph_capture();
    b.begin_capture(s.raw()).unwrap();
    let mut live = Vec::new();
    for _ in 0..4 {
        for size in [3000, MIB, 8 * MIB, WHOLE, WHOLE + 5 * MIB] {
            live.push(pool.allocate_async(size, &s).unwrap());
        }
        // Frees in the capture, reused by the next round.
        for a in live.drain(..3) {
            pool.free_async(a, &s).unwrap();
        }
    }
    assert_eq!(pool.stats().waits_inserted, waits, "a wait in the capture");
    assert_eq!(
        pool.stats().events_recorded,
        events,
        "an event in the capture"
    );
    b.end_capture(s.raw())
        .expect("the pool spoiled the capture");
    drop(capture);
    for a in live {
        pool.free_async(a, &s).unwrap();
    }
    pool.free_async(miss, &other).unwrap();
    // After the capture the other stream's free is usable again, by a
    // wait if it has not passed yet.
    let after = pool.allocate_async(WHOLE, &s).unwrap();
    pool.free_async(after, &s).unwrap();
    ctx.synchronize_device(DEV).unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.audit().unwrap();
}

suites!(
    a_capturing_stream_allocates_without_spoiling_the_capture,
    same_stream_reuse_without_synchronization,
    own_frees_are_reused_at_any_size,
    own_frees_move_before_the_stream_passes,
    growth_waits_for_the_old_places_of_moved_units,
    aliased_units_move_again_before_the_stream_passes,
    passed_aliases_unmap_with_the_next_growth,
    a_trim_unmaps_passed_aliases,
    cross_stream_race_with_switches_on,
    cross_stream_race_with_switches_off,
    internal_dependency_reuses_instead_of_growing,
    explicit_event_dependency_is_followed,
    dependencies_follow_a_chain_of_streams,
    completed_frees_are_reused_opportunistically,
    threshold_zero_goes_to_the_driver_every_iteration,
    high_threshold_never_goes_to_the_driver_after_the_first,
    library_allocates_in_function_scope,
    free_async_to_another_context_fails,
    many_threads_many_streams,
);

// ---- host only: a full device ------------------------------------------------------

/// Out of memory in one pool waits for another pool's stream-ordered frees
/// before giving up: memory freed but not yet passed is unused once it is.
#[test]
fn a_full_device_waits_for_the_frees_of_other_pools() {
    let b = common::host(); // 1 GiB a device
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pools: Vec<_> = (0..2)
        .map(|_| ctx.create_pool(&PoolProps::new(DEV)).unwrap())
        .collect();
    for pool in &pools {
        pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
            .unwrap();
    }
    let s = ctx.create_stream(DEV).unwrap();
    let first = pools[0].allocate_async(640 * MIB, &s).unwrap();
    b.delay(s.raw(), LATE).unwrap();
    pools[0].free_async(first, &s).unwrap();
    assert_eq!(pools[0].stats().pending_bytes, 640 * MIB);
    // Only the first pool's pending free can make room for this.
    let second = pools[1].allocate(640 * MIB).unwrap();
    assert_eq!(pools[0].stats().reserved_bytes, 0);
    pools[1].free(second).unwrap();
    for pool in &pools {
        pool.audit().unwrap();
    }
}

// ---- host only: injected faults and interleavings on the stream-ordered paths

mod faults {
    use super::*;
    use vmpool::vmm::testing::faulty::{Call, Faulty};

    /// Another thread records an event again while a stream is made to
    /// wait on it, after the driver took the earlier record: the stream
    /// waits for the earlier point only, and must not reuse (following the
    /// event) what was freed between the two records.
    #[test]
    fn a_wait_follows_the_record_the_driver_waited_for() {
        let b = Faulty::new(common::host());
        // Following event dependencies is the only way across streams.
        let (ctx, pool) = setup(&b, [1, 0, 0]);
        let ctx = Arc::new(ctx);
        let (s1, s2) = (
            ctx.create_stream(DEV).unwrap(),
            ctx.create_stream(DEV).unwrap(),
        );
        let e = Arc::new(ctx.create_event(DEV).unwrap());
        ctx.record_event(&e, &s1).unwrap();
        let a_ptr = late_write_then_free(&ctx, &s1);
        let (other, again, on) = (Arc::clone(&ctx), Arc::clone(&e), s1.clone());
        b.interleave(
            Call::StreamWaitEvent,
            Box::new(move || other.record_event(&again, &on).unwrap()),
        );
        ctx.stream_wait_event(&s2, &e).unwrap();
        let bb = ctx.alloc_async(WHOLE, &s2).unwrap();
        assert_ne!(bb.ptr(), a_ptr, "reused a free the wait does not cover");
        fill(&*b, &s2, &bb, 0xB2B2_B2B2);
        ctx.synchronize_stream(&s1).unwrap();
        assert_holds(&*b, &s2, &bb, 0xB2B2_B2B2);
        assert_eq!(pool.stats().dependency_reuses, 0);
        ctx.free_async(bb, &s2).unwrap();
        ctx.synchronize_device(DEV).unwrap();
        pool.audit().unwrap();
    }

    /// Another thread queues work on a stream and frees there while an
    /// event is being recorded on it, after the driver recorded the point:
    /// the event's completion must not claim that free, whose work comes
    /// after the point. Claimed, it would be trimmed away (the release
    /// threshold is 0) under the late write, and the stream fault.
    #[test]
    fn a_free_made_while_an_event_records_is_not_claimed_by_it() {
        let b = Faulty::new(common::host());
        let (ctx, pool) = setup(&b, ALL_ON);
        let ctx = Arc::new(ctx);
        pool.set_attribute(PoolAttribute::ReleaseThreshold, 0)
            .unwrap();
        let s = ctx.create_stream(DEV).unwrap();
        let a = ctx.alloc_async(WHOLE, &s).unwrap();
        let (other, on) = (Arc::clone(&ctx), s.clone());
        b.interleave(
            Call::RecordEvent,
            Box::new(move || {
                other.backend().delay(on.raw(), LATE).unwrap();
                fill(&**other.backend(), &on, &a, 0xA1A1_A1A1);
                other.free_async(a, &on).unwrap();
            }),
        );
        let e = ctx.create_event(DEV).unwrap();
        ctx.record_event(&e, &s).unwrap();
        ctx.synchronize_event(&e).unwrap();
        assert_eq!(pool.stats().pending_bytes, WHOLE, "the free was claimed");
        ctx.synchronize_stream(&s).unwrap();
        assert_eq!(pool.stats().pending_bytes, 0);
        pool.audit().unwrap();
    }

    /// Cross-stream reuse through every rule, on a pool whose driver calls
    /// may fail: errors are allowed, inconsistency is not.
    fn workload<B: TestBackend>(ctx: &Context<B>, pool: &vmpool::Pool<B>) {
        let s: Vec<Stream<B>> = (0..3).map(|_| ctx.create_stream(DEV).unwrap()).collect();
        let mut live: Vec<(Allocation, usize)> = Vec::new();
        for i in 0..30usize {
            let on = i % 3;
            if let Ok(a) = ctx.alloc_async(WHOLE / 2 + (i as u64 % 3) * MIB, &s[on]) {
                live.push((a, on));
            }
            if live.len() > 3 {
                // Freed on another stream than it was allocated on.
                let (a, on) = live.remove(0);
                ctx.free_async(a, &s[(on + 1) % 3]).unwrap();
            }
            if i % 7 == 0 {
                let e = ctx.create_event(DEV);
                if let Ok(e) = e {
                    if ctx.record_event(&e, &s[on]).is_ok() {
                        let _ = ctx.stream_wait_event(&s[(on + 2) % 3], &e);
                    }
                }
            }
            pool.audit().unwrap();
        }
        for (a, on) in live {
            ctx.free_async(a, &s[on]).unwrap();
        }
        ctx.synchronize_device(DEV).unwrap();
        pool.audit().unwrap();
        let st = pool.stats();
        assert_eq!((st.used_bytes, st.pending_bytes), (0, 0));
        assert!(
            st.frees_completed + st.dependency_reuses + st.waits_inserted > 0,
            "no cross-stream path ran: {st:?}"
        );
    }

    #[test]
    fn every_injected_fault_leaves_the_pool_consistent() {
        let calls = [
            Call::CreateEvent,
            Call::RecordEvent,
            Call::StreamWaitEvent,
            Call::CreateChunk,
            Call::Map,
        ];
        let injected = crate::common::at_every_call_site(&calls, |b| {
            let (ctx, pool) = setup(b, ALL_ON);
            workload(&ctx, &pool);
            let fired = b.disarm();
            pool.trim_to(0).unwrap();
            assert_eq!(pool.stats().reserved_bytes, 0);
            fired
        });
        assert!(injected > 20, "only {injected} faults were injected");
    }
}
