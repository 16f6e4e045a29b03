//! Sleep and wake (`Pool::sleep`, `Pool::wake`): a pool gives its device
//! memory back and brings it back at the same addresses, the bytes it keeps
//! intact. On every backend (the host always, CUDA with `--features
//! gpu-tests`), then host-only cases: a model test, running out of memory
//! on wake, and injected faults.

use std::sync::Arc;

use proptest::prelude::*;
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
        let n = (a.size() / 4) as usize;
        assert!(
            words(&**b, s, a, n).iter().all(|w| w == word),
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

suites!(
    kept_bytes_come_back_at_their_addresses,
    discarded_pools_and_level_two_keep_nothing,
    asleep_the_pool_refuses_calls,
    stream_ordered_frees_are_waited_for,
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

/// Every driver call sleep and wake make, failed in turn: a failed sleep
/// leaves the pool awake with its bytes, a failed wake leaves it asleep
/// with its bytes on the host, and a retry succeeds; nothing leaks.
#[test]
fn faults_in_sleep_and_wake_lose_nothing() {
    use vmpool::vmm::testing::faulty::Call;
    let calls = [
        Call::AllocHost,
        Call::CopyDeviceToHost,
        Call::Unmap,
        Call::ReleaseChunk,
        Call::CreateChunk,
        Call::Map,
        Call::SetAccess,
        Call::CopyHostToDevice,
    ];
    let injected = common::at_every_call_site(&calls, |b| {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
        pool.set_retention(Retention::Keep);
        let s = ctx.create_stream(DEV).unwrap();
        let live = {
            let mut live = Vec::new();
            for (i, size) in [3 * MIB, 8 * MIB, 256 * 1024].into_iter().enumerate() {
                // Growth may meet the fault too: then this allocation is
                // not made, and the pool stays as it was.
                if let Ok(a) = pool.allocate(size) {
                    let word = 0xFA_0000 + i as u32;
                    b.fill_u32(s.raw(), a.ptr(), (size / 4) as usize, word)
                        .unwrap();
                    live.push((a, word));
                }
            }
            live
        };
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
        for (a, _) in live {
            pool.free(a).unwrap();
        }
        // The fault may fall here instead, outside sleep and wake.
        if pool.trim_to(0).is_err() {
            pool.trim_to(0).unwrap();
        }
        drop(pool);
        drop(ctx);
        b.disarm()
    });
    assert!(injected >= 8, "only {injected} faults injected");
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
            let live_bytes: u64 = live.iter().map(|(a, _)| a.size().next_multiple_of(256)).sum();
            prop_assert_eq!(report.kept_bytes, if kept { live_bytes } else { 0 });
            prop_assert_eq!(pool.stats().reserved_bytes, 0);
            prop_assert_eq!(pool.stats().used_bytes, before.used_bytes);
            pool.audit().unwrap();
            pool.wake(&s).unwrap();
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
