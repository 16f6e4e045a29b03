//! Model-based property test of the pool on the host backend: random
//! sequences of allocate / free / trim against a plain list of what is live.
//! After every step: no two live allocations overlap, accounting matches a
//! recount, and every live allocation still holds the pattern written into
//! it (so remapping other chunks never touched its data). At the end, an
//! idle pool trimmed to 0 holds no chunk and the backend holds nothing.

use std::sync::Arc;

use proptest::prelude::*;
use vmpool::vmm::host::{Census, Host, HostConfig};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::{Allocation, Context, Error, PoolAttribute, PoolProps, SMALL_LIMIT};

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
    Trim(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..4096u64).prop_map(Op::Alloc),
        3 => (4096..SMALL_LIMIT).prop_map(Op::Alloc),
        4 => (SMALL_LIMIT..12 * MIB).prop_map(Op::Alloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (0..64 * MIB).prop_map(Op::Trim),
    ]
}

fn word_at<B: TestBackend>(b: &B, s: &B::Stream, a: &Allocation, word: u64) -> u32 {
    let mut bytes = [0u8; 4];
    b.copy_to_host(s, a.ptr().byte_add(word as usize * 4), &mut bytes)
        .unwrap();
    u32::from_ne_bytes(bytes)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_every_invariant(
        ops in proptest::collection::vec(op(), 1..80),
        chunk_granules in 1..6u64,
        // Whole chunks, or chunks scaled to the pool: with this device's
        // 96 MiB, a 2048th is always one granule, a quarter is up to the
        // largest chunk.
        chunk_divisor in proptest::option::of(prop_oneof![Just(4u64), Just(2048)]),
        // With a divisor: by granules throughout, or until the pool holds
        // 16 MiB (past the first steps, which the test marks for it: in
        // them growth is by granules up to 16 GiB).
        granule_growth_below in prop_oneof![Just(0u64), Just(16 * MIB), Just(u64::MAX)],
    ) {
        let host = Host::new(HostConfig {
            devices: 1,
            first_device: 0,
            memory_per_device: 96 << 20,
            granularity: 2 << 20,
        })
        .unwrap();
        {
            let b = Arc::clone(&host);
            let ctx = Context::new(Arc::clone(&b)).unwrap();
            let pool = ctx
                .create_pool(&PoolProps {
                    chunk_size: Some(chunk_granules * 2 * MIB),
                    chunk_divisor,
                    granule_growth_below,
                    ..PoolProps::new(DEV)
                })
                .unwrap();
            pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX).unwrap();
            if granule_growth_below == 16 * MIB {
                pool.mark_step().unwrap();
                pool.mark_step().unwrap();
            }
            let s = b.create_stream(DEV).unwrap();
            let mut live: Vec<(Allocation, u32)> = Vec::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Alloc(size) => match pool.allocate(size) {
                        Ok(a) => {
                            let seed = 0x5EED_0000 + step as u32;
                            let words = (a.size() / 4) as usize;
                            if words > 0 {
                                b.fill_u32(&s, a.ptr(), words, seed).unwrap();
                            }
                            live.push((a, seed));
                        }
                        // Legitimate only if nothing could have served it:
                        // no free range large enough, and too little in
                        // free chunks (which remapping would move) and on
                        // the device together.
                        Err(Error::OutOfMemory { device_free, .. }) => {
                            let snap = pool.snapshot();
                            let movable: u64 = snap
                                .units
                                .iter()
                                .filter(|u| snap.free_in(u.va, u.size) == u.size)
                                .map(|u| u.size)
                                .sum::<u64>()
                                + snap.stats.spare_bytes;
                            prop_assert!(snap.stats.largest_free_range < size.next_multiple_of(256), "out of memory with a free range of {} for {size}", snap.stats.largest_free_range);
                            prop_assert!(movable + device_free < size, "out of memory for {size} with {movable} movable and {device_free} free on the device");
                        }
                        Err(e) => prop_assert!(false, "allocate({size}): {e}"),
                    },
                    Op::Free(i) if !live.is_empty() => {
                        let (a, _) = live.swap_remove(i % live.len());
                        pool.free(a).unwrap();
                    }
                    Op::Free(_) => {}
                    Op::Trim(keep) => {
                        pool.trim_to(keep).unwrap();
                        let st = pool.stats();
                        // Whatever is held beyond `keep` is under live bytes.
                        prop_assert!(st.reserved_bytes <= keep || st.spare_bytes == 0);
                    }
                }
                pool.audit().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let used: u64 = live.iter().map(|(a, _)| a.size().next_multiple_of(256)).sum();
                prop_assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), used);
                let mut spans: Vec<(u64, u64)> = live.iter().map(|(a, _)| (a.ptr().0, a.size())).collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {:?}", w);
                }
                for (a, seed) in &live {
                    let words = a.size() / 4;
                    if words > 0 {
                        prop_assert_eq!(word_at(&*b, &s, a, 0), *seed);
                        prop_assert_eq!(word_at(&*b, &s, a, words - 1), *seed);
                    }
                }
            }
            // Every byte of every survivor, then an idle pool gives all back.
            for (a, seed) in &live {
                let len = (a.size() / 4 * 4) as usize;
                let mut bytes = vec![0u8; len];
                b.copy_to_host(&s, a.ptr(), &mut bytes).unwrap();
                prop_assert!(bytes == seed.to_ne_bytes().repeat(len / 4), "allocation at {} lost its data", a.ptr());
            }
            for (a, _) in live {
                pool.free(a).unwrap();
            }
            pool.trim_to(0).unwrap();
            let st = pool.stats();
            prop_assert_eq!(st.reserved_bytes, 0);
            prop_assert_eq!(st.chunks_created, st.chunks_released);
        }
        prop_assert_eq!(host.census(), Census::default());
    }
}
