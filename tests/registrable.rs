//! Pools whose memory NCCL can register (Note [NCCL registration] in
//! docs/DESIGN.md): their reservation starts on a granule, every chunk is
//! exportable as a POSIX descriptor, chunks moved by a remap included, and
//! a live buffer's chunks stay where a peer imported them while the pool
//! remaps around it. NCCL's registration exports a buffer's chunks and
//! its peers import them; here a second host backend plays the peer.

use std::sync::Arc;

use vmpool::ipc::ImportedPool;
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::{Allocation, Context, HandleType, Pool, PoolProps};

const DEV: DeviceId = DeviceId(0);
const GRANULE: u64 = 2 << 20;

fn host() -> Arc<Host> {
    Host::new(HostConfig {
        devices: 1,
        first_device: 0,
        memory_per_device: 1 << 30,
        granularity: GRANULE as usize,
    })
    .unwrap()
}

fn registrable_pool(ctx: &Context<Host>) -> Pool<Host> {
    ctx.create_pool(&PoolProps {
        chunk_size: Some(GRANULE),
        chunk_divisor: None,
        va_size: Some(4 << 30),
        handle_type: HandleType::PosixFileDescriptor,
        ..PoolProps::new(DEV)
    })
    .unwrap()
}

/// Every word of `[ptr, ptr + size)` as `backend` reads it, when they are
/// all one value.
fn uniform<B: TestBackend>(b: &B, ptr: vmpool::vmm::DevicePtr, size: u64) -> Option<u32> {
    let s = b.create_stream(DEV).unwrap();
    let mut bytes = vec![0u8; size as usize];
    b.copy_to_host(&s, ptr, &mut bytes).unwrap();
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect();
    let first = *words.first()?;
    words.iter().all(|&w| w == first).then_some(first)
}

fn fill(b: &Host, a: &Allocation, value: u32) {
    let s = b.create_stream(DEV).unwrap();
    b.fill_u32(&s, a.ptr(), a.size() as usize / 4, value)
        .unwrap();
    b.synchronize_stream(&s).unwrap();
}

/// Frees every other one of `n` granule-sized allocations: `n / 2` free
/// units, each between live ones, so that a larger allocation fits in
/// none of them and growth moves them.
fn fragment(pool: &Pool<Host>, n: usize) -> Vec<Allocation> {
    let parts: Vec<Allocation> = (0..n).map(|_| pool.allocate(GRANULE).unwrap()).collect();
    let mut live = Vec::new();
    for (i, a) in parts.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free(a).unwrap();
        } else {
            live.push(a);
        }
    }
    live
}

#[test]
fn the_reservation_starts_on_a_granule() {
    let b = host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    for handle_type in [HandleType::None, HandleType::PosixFileDescriptor] {
        let pool = ctx
            .create_pool(&PoolProps {
                handle_type,
                ..PoolProps::new(DEV)
            })
            .unwrap();
        let snap = pool.snapshot();
        assert_eq!(
            snap.base % GRANULE,
            0,
            "{handle_type:?}: base {:#x}",
            snap.base
        );
        assert!(snap.units.iter().all(|u| u.va % GRANULE == 0));
    }
}

/// A buffer growth assembles from moved chunks is exported and imported
/// whole, as NCCL's registration does with a peer, and both sides see the
/// same bytes; while it is live (registered), further remaps move other
/// chunks, never its own.
#[test]
fn a_buffer_on_remapped_chunks_exports_and_stays_put() {
    let b = host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = registrable_pool(&ctx);
    let live = fragment(&pool, 8);
    let created = pool.stats().chunks_created;
    let buffer = pool.allocate(4 * GRANULE).unwrap();
    let stats = pool.stats();
    assert!(stats.remaps > 0, "no remap: {stats:?}");
    assert_eq!(stats.chunks_created, created, "growth made new chunks");
    fill(&b, &buffer, 0x51);

    let peer = host();
    let imported =
        ImportedPool::from_shareable_handle(&peer, pool.export_to_shareable_handle().unwrap())
            .unwrap();
    let mapped = imported
        .import_pointer(&pool.export_pointer(&buffer).unwrap())
        .unwrap();
    assert_eq!(uniform(&*peer, mapped.ptr(), mapped.size()), Some(0x51));

    // The other live buffers go and a larger one makes the pool remap
    // their chunks: the imported buffer's chunks stay where the peer maps
    // them, so what one side writes the other reads.
    let remaps = pool.stats().remaps;
    for a in live {
        pool.free(a).unwrap();
    }
    let other = pool.allocate(4 * GRANULE).unwrap();
    assert!(
        pool.stats().remaps > remaps,
        "the second growth did not remap"
    );
    fill(&b, &other, 0x77);
    fill(&b, &buffer, 0x52);
    assert_eq!(uniform(&*peer, mapped.ptr(), mapped.size()), Some(0x52));
    let s = peer.create_stream(DEV).unwrap();
    peer.fill_u32(&s, mapped.ptr(), mapped.size() as usize / 4, 0x53)
        .unwrap();
    peer.synchronize_stream(&s).unwrap();
    assert_eq!(uniform(&*b, buffer.ptr(), buffer.size()), Some(0x53));
    assert_eq!(uniform(&*b, other.ptr(), other.size()), Some(0x77));

    drop(mapped);
    drop(imported);
    pool.free(buffer).unwrap();
    pool.free(other).unwrap();
    pool.audit().unwrap();
}
