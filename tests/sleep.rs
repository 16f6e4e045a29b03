//! Sleep and wake (`Pool::sleep`, `Pool::wake`): a pool gives its device
//! memory back and brings it back at the same addresses, the bytes it keeps
//! intact. On every backend (the host always, CUDA with `--features
//! gpu-tests`), then host-only cases: a model test, running out of memory
//! on wake, and injected faults.

use std::sync::Arc;

use proptest::prelude::*;
use vmpool::vmm::testing::faulty::Call;
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Access, Backend, DeviceId};
use vmpool::{Allocation, Context, Error, Pool, PoolProps, Retention, SleepLevel, Stream};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

/// Reads `n` words at `a`'s start.
fn words<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; n * 4];
    b.copy_to_host(s.raw(), a.ptr(), &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect()
}

/// Allocations of several sizes, each filled with its own word.
fn filled<B: TestBackend>(
    b: &Arc<B>,
    pool: &Pool<B>,
    s: &Stream<B>,
    sizes: &[u64],
) -> Vec<(Allocation, u32)> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let a = pool.allocate(size).unwrap();
            let word = 0x5EE9_0000 + i as u32;
            b.fill_u32(s.raw(), a.ptr(), (size / 4) as usize, word)
                .unwrap();
            (a, word)
        })
        .collect()
}

fn check_filled<B: TestBackend>(b: &Arc<B>, s: &Stream<B>, live: &[(Allocation, u32)]) {
    for (a, word) in live {
        let mut bytes = vec![0u8; a.size() as usize];
        b.copy_to_host(s.raw(), a.ptr(), &mut bytes).unwrap();
        // Compared a page at a time (memcmp: quick in a debug build too).
        let page: Vec<u8> = word.to_ne_bytes().repeat(1024);
        assert!(
            bytes.chunks(4096).all(|p| p == &page[..p.len()]),
            "the bytes at {} came back changed",
            a.ptr()
        );
    }
}

pub fn kept_bytes_come_back_at_their_addresses<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    let live = filled(b, &pool, &s, &[4096, 300 * 1024, 3 * MIB, 40 * MIB]);
    let freed = pool.allocate(8 * MIB).unwrap();
    pool.free(freed).unwrap();
    let before = pool.stats();
    let report = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    let asleep = pool.stats();
    assert!(pool.is_asleep() && asleep.asleep);
    assert_eq!(asleep.reserved_bytes, 0, "every chunk released");
    assert_eq!(report.released_bytes, before.reserved_bytes);
    // The live bytes, each block rounded to the heap's quantum.
    let live_bytes: u64 = live
        .iter()
        .map(|(a, _)| a.size().next_multiple_of(256))
        .sum();
    assert_eq!(report.kept_bytes, live_bytes);
    assert_eq!(asleep.kept_on_host_bytes, live_bytes);
    assert_eq!(
        asleep.used_bytes, before.used_bytes,
        "allocations stay live"
    );
    pool.audit().unwrap();
    let woken = pool.wake(&s).unwrap();
    assert_eq!(woken.restored_bytes, live_bytes);
    assert_eq!(
        woken.mapped_bytes,
        before.reserved_bytes - before.spare_bytes
    );
    assert!(!pool.is_asleep());
    check_filled(b, &s, &live);
    pool.audit().unwrap();
    // Business as usual.
    let more = pool.allocate(5 * MIB).unwrap();
    pool.free(more).unwrap();
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    pool.audit().unwrap();
}

pub fn discarded_pools_and_level_two_keep_nothing<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let cache = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let weights = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    weights.set_retention(Retention::Keep);
    let c = cache.allocate(6 * MIB).unwrap();
    let w = filled(b, &weights, &s, &[6 * MIB]);
    assert_eq!(
        cache.sleep(SleepLevel::KeepTagged, &s).unwrap().kept_bytes,
        0
    );
    assert_eq!(
        weights
            .sleep(SleepLevel::DiscardAll, &s)
            .unwrap()
            .kept_bytes,
        0
    );
    cache.wake(&s).unwrap();
    weights.wake(&s).unwrap();
    // The memory is there again, at the same place, to be written anew.
    b.fill_u32(s.raw(), c.ptr(), 1024, 7).unwrap();
    assert_eq!(words(&**b, &s, &c, 4), vec![7; 4]);
    cache.free(c).unwrap();
    weights.free(w.into_iter().next().unwrap().0).unwrap();
    cache.audit().unwrap();
    weights.audit().unwrap();
}

pub fn asleep_the_pool_refuses_calls<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let a = pool.allocate(MIB).unwrap();
    let c = pool.allocate_async(MIB, &s).unwrap();
    assert!(matches!(pool.wake(&s), Err(Error::SleepState(_))));
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert!(matches!(
        pool.sleep(SleepLevel::KeepTagged, &s),
        Err(Error::SleepState(_))
    ));
    assert!(matches!(pool.allocate(MIB), Err(Error::Asleep)));
    assert!(matches!(pool.allocate_async(MIB, &s), Err(Error::Asleep)));
    if b.device_count().unwrap() > 1 {
        let other = ctx.create_stream(DeviceId(1)).unwrap();
        assert!(matches!(pool.wake(&other), Err(Error::WrongDevice { .. })));
    }
    pool.wake(&s).unwrap();
    pool.free(a).unwrap();
    pool.free_async(c, &s).unwrap();
    ctx.synchronize_device(DEV).unwrap();
    pool.audit().unwrap();
}

/// A free while asleep is taken, synchronous or stream-ordered, from the
/// middle of a kept range or alone: nothing leaks, the freed bytes are not
/// copied back, the others come back intact, and the memory is reused
/// after the wake.
pub fn a_free_while_asleep_is_taken<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    // Adjacent: one kept range, cut in its middle by the second's free.
    let mut live = filled(b, &pool, &s, &[3 * MIB, 2 * MIB, 5 * MIB, 700 * 1024]);
    let bytes = |l: &[(Allocation, u32)]| l.iter().map(|(a, _)| a.size()).sum::<u64>();
    let slept = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!(slept.kept_bytes, bytes(&live));
    let (middle, _) = live.remove(1);
    pool.free(middle).unwrap();
    let (last, _) = live.pop().unwrap();
    pool.free_async(last, &s).unwrap();
    let asleep = pool.stats();
    assert!(asleep.asleep);
    assert_eq!(asleep.kept_on_host_bytes, bytes(&live));
    assert_eq!(asleep.used_bytes, bytes(&live));
    pool.audit().unwrap();
    let woken = pool.wake(&s).unwrap();
    assert_eq!(woken.restored_bytes, bytes(&live));
    check_filled(b, &s, &live);
    pool.audit().unwrap();
    // The freed memory is the pool's again: no growth for it.
    let reserved = pool.stats().reserved_bytes;
    let again = pool.allocate(2 * MIB).unwrap();
    let after = pool.allocate_async(700 * 1024, &s).unwrap();
    assert_eq!(pool.stats().reserved_bytes, reserved);
    pool.free(again).unwrap();
    pool.free_async(after, &s).unwrap();
    // Everything freed while asleep: nothing to copy back.
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    assert_eq!(pool.stats().kept_on_host_bytes, 0);
    assert_eq!(pool.wake(&s).unwrap().restored_bytes, 0);
    ctx.synchronize_device(DEV).unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.audit().unwrap();
}

pub fn stream_ordered_frees_are_waited_for<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    let other = ctx.create_stream(DEV).unwrap();
    let live = filled(b, &pool, &s, &[2 * MIB, MIB]);
    // Work still queued on another stream, then frees behind it.
    b.delay(other.raw(), std::time::Duration::from_millis(100))
        .unwrap();
    for size in [3 * MIB, 512 * 1024] {
        let a = pool.allocate_async(size, &other).unwrap();
        pool.free_async(a, &other).unwrap();
    }
    let report = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!(report.kept_bytes, 3 * MIB, "pending frees are not kept");
    assert_eq!(pool.stats().pending_bytes, 0);
    pool.wake(&s).unwrap();
    check_filled(b, &s, &live);
    pool.audit().unwrap();
}

/// The page-locked host buffer stays with the pool from one cycle to the
/// next: the second sleep allocates none, a larger one replaces it, and
/// `release_host` / `reserve_host` give it back and take it ahead, as the
/// statistics say; the bytes come back every time.
pub fn the_host_buffer_is_kept_between_cycles<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    let mut live = filled(b, &pool, &s, &[5 * MIB, 12 * MIB, 300 * 1024]);
    assert_eq!(pool.stats().host_bytes, 0, "nothing pinned before a sleep");
    let first = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    let held = pool.stats().host_bytes;
    assert!(first.pinned_bytes >= first.kept_bytes && held == first.pinned_bytes);
    assert!(first.batches > 1, "the copy goes in batches: {first:?}");
    let woken = pool.wake(&s).unwrap();
    assert!(woken.batches > 1, "the mapping goes in batches: {woken:?}");
    check_filled(b, &s, &live);
    assert_eq!(pool.stats().host_bytes, held, "kept after the wake");

    // Steady cycles pin nothing.
    for _ in 0..2 {
        let again = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
        assert_eq!(
            (again.kept_bytes, again.pinned_bytes),
            (first.kept_bytes, 0)
        );
        pool.wake(&s).unwrap();
        check_filled(b, &s, &live);
    }

    // More to keep: a larger buffer replaces the old one.
    live.extend(filled(b, &pool, &s, &[20 * MIB]));
    let grown = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert!(grown.pinned_bytes >= grown.kept_bytes && grown.kept_bytes > first.kept_bytes);
    assert_eq!(pool.stats().host_bytes, grown.pinned_bytes);
    // Asleep, the buffer holds the bytes: neither given back nor replaced.
    assert!(matches!(pool.release_host(), Err(Error::SleepState(_))));
    assert!(matches!(
        pool.reserve_host(1 << 30),
        Err(Error::SleepState(_))
    ));
    pool.wake(&s).unwrap();
    check_filled(b, &s, &live);

    // Given back, and taken again by the next sleep.
    assert_eq!(pool.release_host().unwrap(), grown.pinned_bytes);
    assert_eq!(pool.stats().host_bytes, 0);
    assert_eq!(pool.release_host().unwrap(), 0);
    let repinned = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!(repinned.pinned_bytes, grown.pinned_bytes);
    pool.wake(&s).unwrap();
    check_filled(b, &s, &live);

    // Taken ahead: the sleep after it pins nothing; a smaller reservation
    // changes nothing.
    pool.release_host().unwrap();
    pool.reserve_host(64 * MIB).unwrap();
    assert_eq!(pool.stats().host_bytes, 64 * MIB);
    pool.reserve_host(MIB).unwrap();
    assert_eq!(pool.stats().host_bytes, 64 * MIB);
    let reserved = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!(reserved.pinned_bytes, 0);
    pool.wake(&s).unwrap();
    check_filled(b, &s, &live);

    // A pool that drops its bytes pins nothing, and keeps what it holds;
    // asleep with nothing kept, the buffer may go.
    pool.set_retention(Retention::Discard);
    let dropped = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!((dropped.kept_bytes, dropped.pinned_bytes), (0, 0));
    assert_eq!(pool.stats().host_bytes, 64 * MIB);
    assert_eq!(pool.release_host().unwrap(), 64 * MIB);
    pool.wake(&s).unwrap();
    assert_eq!(pool.stats().host_bytes, 0);
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    pool.audit().unwrap();
}

/// Preparing to sleep keeps every live byte whatever the retention,
/// brings an allocation's units back as few chunks with the same mapped
/// bytes, pins the host buffer, and leaves the next sleep those chunks to
/// release and nothing to pin.
pub fn preparing_joins_chunks_and_keeps_every_byte<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    // 2 MiB units (a small pool): the 100 MiB allocation covers about 50.
    let live = filled(b, &pool, &s, &[100 * MIB, 3 * MIB, 700 * 1024]);
    let before = pool.stats();
    let report = pool.prepare_sleep(&s).unwrap();
    assert!(!pool.is_asleep());
    assert_eq!(pool.retention(), Retention::Discard, "retention unchanged");
    let live_bytes: u64 = live
        .iter()
        .map(|(a, _)| a.size().next_multiple_of(256))
        .sum();
    assert_eq!(report.sleep.kept_bytes, live_bytes, "{report:?}");
    assert_eq!(report.wake.restored_bytes, live_bytes);
    check_filled(b, &s, &live);
    pool.audit().unwrap();
    let after = pool.stats();
    assert_eq!(after.mapped_bytes, before.mapped_bytes);
    assert_eq!(after.used_bytes, before.used_bytes);
    assert_eq!(report.chunks_before, before.units);
    assert_eq!(report.chunks_after, after.units);
    assert!(
        after.units * 5 < before.units,
        "{} units before, {} after",
        before.units,
        after.units
    );
    assert!(after.host_bytes >= live_bytes, "the buffer stays pinned");
    // The next sleep releases the joined chunks and pins nothing.
    pool.set_retention(Retention::Keep);
    let slept = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert_eq!((slept.kept_bytes, slept.pinned_bytes), (live_bytes, 0));
    let created = pool.stats().chunks_created;
    pool.wake(&s).unwrap();
    assert_eq!(pool.stats().chunks_created - created, after.units);
    check_filled(b, &s, &live);
    // Asleep, there is nothing to prepare.
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    assert!(matches!(pool.prepare_sleep(&s), Err(Error::SleepState(_))));
    pool.wake(&s).unwrap();
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    pool.audit().unwrap();
}

suites!(
    kept_bytes_come_back_at_their_addresses,
    discarded_pools_and_level_two_keep_nothing,
    asleep_the_pool_refuses_calls,
    a_free_while_asleep_is_taken,
    stream_ordered_frees_are_waited_for,
    the_host_buffer_is_kept_between_cycles,
    preparing_joins_chunks_and_keeps_every_byte,
);

/// Peers keep their access across a sleep (two devices: the host backend).
#[test]
fn peers_keep_their_access() {
    let b = common::host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let s = ctx.create_stream(DEV).unwrap();
    let a = pool.allocate(4 * MIB).unwrap();
    pool.set_access(DeviceId(1), Access::Read).unwrap();
    pool.sleep(SleepLevel::DiscardAll, &s).unwrap();
    pool.wake(&s).unwrap();
    assert_eq!(b.get_access(a.ptr(), DeviceId(1)).unwrap(), Access::Read);
    assert_eq!(pool.access(DeviceId(1)).unwrap(), Access::Read);
    pool.free(a).unwrap();
}

/// Too little device memory to wake: a typed error with the figures; still
/// asleep, the bytes still on the host; waking again once memory is free
/// brings them back.
#[test]
fn waking_without_memory_fails_cleanly_and_can_be_retried() {
    let b = common::host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    let live = filled(&b, &pool, &s, &[300 * MIB, 100 * MIB]);
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    let other = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let hog = other.allocate(800 * MIB).unwrap();
    let chunks_asleep = b.census().chunks;
    match pool.wake(&s) {
        Err(Error::WakeOutOfMemory {
            needed,
            device_free,
            kept,
            ..
        }) => {
            assert!(
                needed >= 400 * MIB && device_free < needed,
                "{needed} {device_free}"
            );
            assert_eq!(kept, 400 * MIB);
        }
        other => panic!("expected WakeOutOfMemory, got {other:?}"),
    }
    assert!(pool.is_asleep());
    assert_eq!(b.census().chunks, chunks_asleep, "nothing left behind");
    assert_eq!(pool.stats().kept_on_host_bytes, 400 * MIB);
    pool.audit().unwrap();
    other.free(hog).unwrap();
    other.trim_to(0).unwrap();
    pool.wake(&s).unwrap();
    check_filled(&b, &s, &live);
    pool.audit().unwrap();
}

/// Every driver call a sleep or a wake makes, for the fault injection.
const SLEEP_CALLS: [Call; 8] = [
    Call::AllocHost,
    Call::CopyDeviceToHost,
    Call::Unmap,
    Call::ReleaseChunk,
    Call::CreateChunk,
    Call::Map,
    Call::SetAccess,
    Call::CopyHostToDevice,
];

/// [`filled`] under injected faults: the allocations growth can make, each
/// filled with `first_word` plus its index. Growth may meet the fault
/// too: then that allocation is not made, and the pool stays as it was.
fn filled_where_growth_allows<B: TestBackend>(
    b: &Arc<B>,
    pool: &Pool<B>,
    s: &Stream<B>,
    sizes: &[u64],
    first_word: u32,
) -> Vec<(Allocation, u32)> {
    let mut live = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        if let Ok(a) = pool.allocate(size) {
            let word = first_word + i as u32;
            b.fill_u32(s.raw(), a.ptr(), (size / 4) as usize, word)
                .unwrap();
            live.push((a, word));
        }
    }
    live
}

/// The end of a fault-injection case: every allocation freed and the
/// pool trimmed. The fault may fall in the trim instead, outside sleep and
/// wake; the trim tried again then works.
fn free_and_trim<B: TestBackend>(pool: &Pool<B>, live: Vec<(Allocation, u32)>) {
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    if pool.trim_to(0).is_err() {
        pool.trim_to(0).unwrap();
    }
}

/// Every driver call sleep and wake make, failed in turn: a failed sleep
/// leaves the pool awake with its bytes, a failed wake leaves it asleep
/// with its bytes on the host, and a retry succeeds; nothing leaks.
#[test]
fn faults_in_sleep_and_wake_lose_nothing() {
    let injected = common::at_every_call_site(&SLEEP_CALLS, |b| {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
        pool.set_retention(Retention::Keep);
        let s = ctx.create_stream(DEV).unwrap();
        // Two cycles, the second keeping more: its sleep frees the host
        // buffer of the first and allocates a larger one.
        let mut live =
            filled_where_growth_allows(b, &pool, &s, &[3 * MIB, 8 * MIB, 256 * 1024], 0xFA_0000);
        for cycle in 0..2 {
            if cycle == 1 {
                if let Ok(a) = pool.allocate(6 * MIB) {
                    b.fill_u32(s.raw(), a.ptr(), (6 * MIB / 4) as usize, 0xFA_00FF)
                        .unwrap();
                    live.push((a, 0xFA_00FF));
                }
            }
            if pool.sleep(SleepLevel::KeepTagged, &s).is_err() {
                pool.audit().unwrap();
                if !pool.is_asleep() {
                    check_filled(b, &s, &live);
                    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
                }
            }
            pool.audit().unwrap();
            if pool.wake(&s).is_err() {
                assert!(pool.is_asleep(), "a failed wake leaves the pool asleep");
                pool.audit().unwrap();
                pool.wake(&s).unwrap();
            }
            check_filled(b, &s, &live);
            pool.audit().unwrap();
        }
        free_and_trim(&pool, live);
        drop(pool);
        drop(ctx);
        b.disarm()
    });
    eprintln!("{injected} faults injected");
    assert!(injected >= 20, "only {injected} faults injected");
}

/// A fault anywhere in preparing to sleep loses nothing: the pool is
/// awake with every byte, or asleep with them on the host and woken by
/// `wake`; preparing again then works.
#[test]
fn faults_in_preparing_lose_nothing() {
    let injected = common::at_every_call_site(&SLEEP_CALLS, |b| {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
        let s = ctx.create_stream(DEV).unwrap();
        let live =
            filled_where_growth_allows(b, &pool, &s, &[9 * MIB, 3 * MIB, 256 * 1024], 0xFB_0000);
        if pool.prepare_sleep(&s).is_err() {
            pool.audit().unwrap();
            // A wake that meets the fault stays asleep; the next works.
            if pool.is_asleep() && pool.wake(&s).is_err() {
                pool.wake(&s).unwrap();
            }
            check_filled(b, &s, &live);
            pool.prepare_sleep(&s).unwrap();
        }
        check_filled(b, &s, &live);
        pool.audit().unwrap();
        free_and_trim(&pool, live);
        drop(pool);
        drop(ctx);
        b.disarm()
    });
    eprintln!("{injected} faults injected");
    assert!(injected >= 20, "only {injected} faults injected");
}

/// A copy that fails halfway through a pipelined sleep, after some batches
/// were released: they are mapped and copied back, and the pool is awake
/// with every byte; when mapping them back fails too, the pool is asleep
/// with those batches' bytes on the host, and waking brings everything
/// back. Either way sleeping again works.
#[test]
fn a_sleep_failing_halfway_loses_nothing() {
    use vmpool::vmm::testing::faulty::Faulty;
    for undo_fails in [false, true] {
        for batch in 1..4 {
            let b = Faulty::new(common::host());
            let ctx = Context::new(Arc::clone(&b)).unwrap();
            let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
            pool.set_retention(Retention::Keep);
            let s = ctx.create_stream(DEV).unwrap();
            let live = filled(&b, &pool, &s, &[6 * MIB, 700 * 1024, 9 * MIB]);
            let before = pool.stats();
            b.fail_nth(Call::CopyDeviceToHost, batch);
            if undo_fails {
                b.also_fail_nth(Call::CreateChunk, 0);
            }
            assert!(pool.sleep(SleepLevel::KeepTagged, &s).is_err());
            assert!(b.disarm(), "both faults fired");
            pool.audit().unwrap();
            assert_eq!(pool.is_asleep(), undo_fails);
            if undo_fails {
                let asleep = pool.stats();
                assert!(asleep.reserved_bytes < before.reserved_bytes);
                assert!(asleep.kept_on_host_bytes > 0);
                assert!(matches!(pool.allocate(MIB), Err(Error::Asleep)));
                pool.wake(&s).unwrap();
            }
            assert_eq!(pool.stats().mapped_bytes, before.mapped_bytes);
            check_filled(&b, &s, &live);
            let report = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
            assert_eq!(report.pinned_bytes, 0, "the host buffer was kept");
            pool.wake(&s).unwrap();
            check_filled(&b, &s, &live);
            for (a, _) in live {
                pool.free(a).unwrap();
            }
            pool.audit().unwrap();
        }
    }
}

/// A copy back that fails halfway through a pipelined wake: what the wake
/// mapped goes again, the pool stays asleep with its bytes on the host,
/// nothing is left mapped, and waking again brings every byte back.
#[test]
fn a_wake_failing_halfway_loses_nothing() {
    use vmpool::vmm::testing::faulty::Faulty;
    let host = common::host();
    let b = Faulty::new(Arc::clone(&host));
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    let live = filled(&b, &pool, &s, &[6 * MIB, 700 * 1024, 9 * MIB]);
    let slept = pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    let chunks_asleep = host.census().chunks;
    // Batch after batch, until the wake has fewer batches than that.
    for batch in 0.. {
        b.fail_nth(Call::CopyHostToDevice, batch);
        if let Ok(woken) = pool.wake(&s) {
            assert!(!b.disarm(), "the fault did not fire");
            assert_eq!(woken.batches, batch);
            assert!(batch > 1, "the wake went in batches");
            break;
        }
        assert!(b.disarm());
        assert!(pool.is_asleep());
        assert_eq!(host.census().chunks, chunks_asleep, "nothing left mapped");
        assert_eq!(pool.stats().kept_on_host_bytes, slept.kept_bytes);
        pool.audit().unwrap();
    }
    check_filled(&b, &s, &live);
    pool.audit().unwrap();
}

/// Adjacent units wholly inside one allocation come back from a wake as
/// one chunk, up to the growth chunk size: fewer chunks to create, map and
/// release at every later cycle. The bytes, the mapped range and the
/// footprint are the same; once freed, the memory goes back whole.
#[test]
fn a_wake_joins_the_units_of_an_allocation() {
    let b = common::host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    pool.set_retention(Retention::Keep);
    let s = ctx.create_stream(DEV).unwrap();
    // 2 MiB units (a small pool): the 100 MiB allocation covers about 50.
    let live = filled(&b, &pool, &s, &[100 * MIB, 3 * MIB, 700 * 1024]);
    let before = pool.stats();
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    let woken = pool.wake(&s).unwrap();
    let after = pool.stats();
    check_filled(&b, &s, &live);
    pool.audit().unwrap();
    assert_eq!(after.mapped_bytes, before.mapped_bytes);
    assert_eq!(woken.mapped_bytes, before.mapped_bytes);
    assert!(
        after.units * 5 < before.units,
        "{} units before, {} after",
        before.units,
        after.units
    );
    // No chunk larger than the growth chunk size (32 MiB).
    let largest = pool.snapshot().units.iter().map(|u| u.size).max().unwrap();
    assert_eq!(largest, 32 * MIB);
    // The next cycle has as few chunks to release and create.
    let chunks = after.chunks_created;
    pool.sleep(SleepLevel::KeepTagged, &s).unwrap();
    pool.wake(&s).unwrap();
    assert_eq!(pool.stats().chunks_created - chunks, after.units);
    check_filled(&b, &s, &live);
    for (a, _) in live {
        pool.free(a).unwrap();
    }
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.audit().unwrap();
    // Business as usual after: allocations reuse nothing stale.
    let a = pool.allocate(40 * MIB).unwrap();
    pool.free(a).unwrap();
    pool.audit().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random live sets, retentions and levels, over sleep/wake cycles:
    /// every kept byte intact at its address, the accounting exact.
    #[test]
    fn sleep_wake_model(
        rounds in proptest::collection::vec(
            (
                proptest::collection::vec(1u64..(6 << 20), 1..8),
                proptest::collection::vec(any::<bool>(), 8),
                any::<bool>(),
                any::<bool>(),
            ),
            1..5,
        ),
    ) {
        let b = common::host();
        let ctx = Context::new(Arc::clone(&b)).unwrap();
        let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
        let s = ctx.create_stream(DEV).unwrap();
        let mut live: Vec<(Allocation, u32)> = Vec::new();
        let mut next_word = 1u32;
        for (sizes, frees, keep, level_two) in rounds {
            for size in sizes {
                let size = size.next_multiple_of(4);
                let a = pool.allocate(size).unwrap();
                b.fill_u32(s.raw(), a.ptr(), (size / 4) as usize, next_word).unwrap();
                live.push((a, next_word));
                next_word += 1;
            }
            for (i, free) in frees.into_iter().enumerate() {
                if free && i < live.len() {
                    let (a, _) = live.swap_remove(i);
                    pool.free(a).unwrap();
                }
            }
            pool.set_retention(if keep { Retention::Keep } else { Retention::Discard });
            let level = if level_two { SleepLevel::DiscardAll } else { SleepLevel::KeepTagged };
            let before = pool.stats();
            let report = pool.sleep(level, &s).unwrap();
            let kept = keep && !level_two;
            let rounded = |l: &[(Allocation, u32)]| -> u64 {
                l.iter().map(|(a, _)| a.size().next_multiple_of(256)).sum()
            };
            prop_assert_eq!(report.kept_bytes, if kept { rounded(&live) } else { 0 });
            prop_assert_eq!(pool.stats().reserved_bytes, 0);
            prop_assert_eq!(pool.stats().used_bytes, before.used_bytes);
            // Frees while asleep, every third from the end: not copied back.
            let mut i = live.len();
            while i >= 3 {
                i -= 3;
                let (a, _) = live.remove(i);
                pool.free(a).unwrap();
            }
            let on_host = pool.stats().kept_on_host_bytes;
            prop_assert_eq!(on_host, if kept { rounded(&live) } else { 0 });
            pool.audit().unwrap();
            prop_assert_eq!(pool.wake(&s).unwrap().restored_bytes, on_host);
            pool.audit().unwrap();
            if kept {
                check_filled(&b, &s, &live);
            } else {
                // Dropped bytes: write them anew.
                for (a, word) in &live {
                    b.fill_u32(s.raw(), a.ptr(), (a.size() / 4) as usize, *word).unwrap();
                }
            }
        }
        for (a, _) in live {
            pool.free(a).unwrap();
        }
        pool.trim_to(0).unwrap();
        prop_assert_eq!(pool.stats().reserved_bytes, 0);
    }
}
