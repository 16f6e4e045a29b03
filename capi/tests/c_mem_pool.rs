//! Memory pools (`torch.cuda.MemPool`) through the C functions, called as
//! `vmpool.torch.MemPool` and PyTorch's `use_mem_pool` call them, on the
//! host backend, in a process of their own (one device, whose figures no
//! other test touches).

use std::ffi::c_void;
use std::sync::Barrier;
use std::thread;

use vmpool_c::{
    vmpool_alloc, vmpool_backend, vmpool_begin_allocate_to_pool, vmpool_empty_cache,
    vmpool_end_allocate_to_pool, vmpool_free, vmpool_mem_pool_create, vmpool_mem_pool_release,
    vmpool_mem_pool_stats, vmpool_release_pool, vmpool_stats, VmpoolMempoolId, VmpoolStats,
    VMPOOL_RELEASE_NOW, VMPOOL_RELEASE_WITH_LAST_FREE,
};

const MIB: isize = 1 << 20;

/// An opaque stream handle (the host backend keeps one stream per value).
fn stream(n: usize) -> *mut c_void {
    std::ptr::without_provenance_mut(n)
}

fn stats() -> VmpoolStats {
    let s = vmpool_stats(0);
    assert_eq!(s.valid, 1);
    s
}

/// A pointer as it crosses a thread (raw pointers are not `Send`).
struct Ptr(usize);

fn alloc(size: isize, on: usize) -> Ptr {
    let p = vmpool_alloc(size, 0, stream(on));
    assert!(!p.is_null());
    Ptr(p as usize)
}

fn free(p: Ptr, size: isize, on: usize) {
    vmpool_free(p.0 as *mut c_void, size, 0, stream(on));
}

/// As PyTorch does: `torch.cuda.MemPool` (vmpool's: create), then in one
/// thread `with use_mem_pool(pool)` (begin, allocations, end, release)
/// while another thread allocates outside it. The first thread's
/// allocations go to the memory pool, the other's to the device's pool;
/// released once they are freed, the pool's memory is gone. Misuse is
/// refused and changes nothing.
#[test]
fn a_thread_in_use_mem_pool_allocates_from_its_pool() {
    std::env::set_var("VMPOOL_BACKEND", "host");
    std::env::set_var("VMPOOL_HOST_DEVICES", "1");
    std::env::set_var("VMPOOL_HOST_MEMORY", "1GiB");
    assert!(!vmpool_backend().is_null());
    let id = VmpoolMempoolId {
        first: 0,
        second: 5,
    };
    assert_eq!(vmpool_mem_pool_create(0, id), 0);
    assert_eq!(vmpool_mem_pool_create(0, id), -1, "made twice");
    assert_eq!(stats().mem_pools, 1);
    let gate = Barrier::new(2);
    let (inside, outside) = thread::scope(|scope| {
        let inside = scope.spawn(|| {
            vmpool_begin_allocate_to_pool(0, id, std::ptr::null());
            gate.wait();
            let got = [alloc(4 * MIB, 1), alloc(32 * MIB, 3)];
            gate.wait();
            vmpool_end_allocate_to_pool(0, id);
            vmpool_release_pool(0, id);
            got
        });
        let outside = scope.spawn(|| {
            gate.wait();
            let got = alloc(2 * MIB, 1);
            gate.wait();
            got
        });
        (inside.join().unwrap(), outside.join().unwrap())
    });
    let pool = vmpool_mem_pool_stats(0, id);
    assert_eq!((pool.valid, pool.used_bytes), (1, 36 << 20));
    let s = stats();
    assert_eq!((s.used_bytes, s.mem_pool_used_bytes), (2 << 20, 36 << 20));
    assert!(s.mem_pool_reserved_bytes >= 36 << 20);
    // `use_mem_pool` is over: this thread allocates from the device's pool.
    let after = alloc(MIB, 1);
    assert_eq!(stats().used_bytes, 3 << 20);
    free(after, MIB, 1);
    free(outside, 2 * MIB, 1);

    assert_eq!(
        vmpool_mem_pool_release(0, id, VMPOOL_RELEASE_NOW),
        -1,
        "live"
    );
    assert_eq!(vmpool_mem_pool_release(0, id, 7), -1, "no such `when`");
    let [a, b] = inside;
    free(a, 4 * MIB, 3);
    free(b, 32 * MIB, 1);
    assert_eq!(vmpool_mem_pool_release(0, id, VMPOOL_RELEASE_NOW), 0);
    let s = stats();
    assert_eq!((s.mem_pools, s.mem_pool_reserved_bytes), (0, 0));
    assert_eq!(vmpool_mem_pool_stats(0, id).valid, 0, "gone");
    assert_eq!(vmpool_mem_pool_release(0, id, VMPOOL_RELEASE_NOW), -1);

    // Dropped with a tensor live: it goes with that tensor.
    let other = VmpoolMempoolId {
        first: 0,
        second: 6,
    };
    assert_eq!(vmpool_mem_pool_create(0, other), 0);
    vmpool_begin_allocate_to_pool(0, other, std::ptr::null());
    let kept = alloc(MIB, 1);
    vmpool_end_allocate_to_pool(0, other);
    assert_eq!(
        vmpool_mem_pool_release(0, other, VMPOOL_RELEASE_WITH_LAST_FREE),
        1
    );
    assert_eq!(stats().mem_pools, 1);
    free(kept, MIB, 1);
    assert_eq!(stats().mem_pools, 0);
    vmpool_empty_cache();
    assert_eq!(stats().reserved_bytes, 0);
}
