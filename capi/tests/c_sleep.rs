//! `vmpool_sleep` and `vmpool_wake` as a C caller calls them, on the host
//! backend, in a process of their own: a sleep affects every device's
//! pool, which the other C tests share.

use std::ffi::c_void;

use vmpool_c::{
    vmpool_alloc, vmpool_backend, vmpool_free, vmpool_prepare_sleep, vmpool_release_host,
    vmpool_reserve_host, vmpool_set_retention, vmpool_sleep, vmpool_stats, vmpool_wake,
    VmpoolStats,
};

const MIB: usize = 1 << 20;

/// An opaque stream handle (the host backend keeps one stream per value).
fn stream() -> *mut c_void {
    std::ptr::without_provenance_mut(1)
}

fn fill(p: *mut c_void, len: usize, byte: u8) {
    // SAFETY: `p` is a live allocation of `len` bytes from vmpool_alloc on
    // the host backend, whose memory is this process's own, mapped
    // read-write for device 0 while the pool is awake; nothing else
    // touches it during the call.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), byte, len) }
}

fn all(p: *mut c_void, len: usize, byte: u8) -> bool {
    // SAFETY: as in `fill`, reading.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    bytes.iter().all(|&b| b == byte)
}

#[test]
fn sleep_and_wake_through_the_c_functions() {
    std::env::set_var("VMPOOL_BACKEND", "host");
    std::env::set_var("VMPOOL_HOST_DEVICES", "1");
    std::env::set_var("VMPOOL_HOST_MEMORY", "1GiB");
    assert!(!vmpool_backend().is_null());
    assert_eq!(vmpool_set_retention(1), 0);
    let a = vmpool_alloc(4 * MIB as isize, 0, stream());
    let b = vmpool_alloc(300 * 1024, 0, stream());
    assert!(!a.is_null() && !b.is_null());
    fill(a, 4 * MIB, 0xA5);
    fill(b, 300 * 1024, 0x3C);
    let awake = vmpool_stats(0);
    assert!(awake.reserved_bytes > 0);

    assert_eq!(awake.host_bytes, 0, "nothing pinned before a sleep");
    assert_eq!(vmpool_sleep(1), 0);
    assert_eq!(vmpool_stats(0).reserved_bytes, 0, "every chunk released");
    let held = vmpool_stats(0).host_bytes;
    assert!(held >= (4 * MIB + 300 * 1024) as u64, "{held}");
    assert_eq!(
        vmpool_release_host(0),
        -1,
        "asleep, the buffer holds the bytes"
    );
    assert_eq!(vmpool_reserve_host(0, 1 << 30), -1, "nor is it replaced");
    assert!(
        vmpool_alloc(MIB as isize, 0, stream()).is_null(),
        "asleep, nothing is allocated"
    );
    assert_eq!(vmpool_sleep(1), -1, "asleep already");
    assert_eq!(vmpool_wake(), 0);
    assert_eq!(vmpool_stats(0).reserved_bytes, awake.reserved_bytes);
    assert!(
        all(a, 4 * MIB, 0xA5) && all(b, 300 * 1024, 0x3C),
        "kept bytes back"
    );

    // The host buffer stays for the next sleep, until given back.
    assert_eq!(vmpool_stats(0).host_bytes, held);
    assert_eq!(vmpool_release_host(0), held as i64);
    assert_eq!(vmpool_stats(0).host_bytes, 0);
    assert_eq!(vmpool_reserve_host(0, 64 * MIB as u64), 0);
    assert_eq!(vmpool_stats(0).host_bytes, 64 * MIB as u64);
    assert_eq!(vmpool_sleep(1), 0);
    assert_eq!(
        vmpool_stats(0).host_bytes,
        64 * MIB as u64,
        "reserved ahead: used as is"
    );
    assert_eq!(vmpool_wake(), 0);
    assert!(all(a, 4 * MIB, 0xA5) && all(b, 300 * 1024, 0x3C));
    assert_eq!(vmpool_reserve_host(7, MIB as u64), -1, "no such device");

    // Prepared: the same bytes and footprint, fewer chunks (the 40 MiB
    // allocation's 2 MiB units joined), the next sleep as before.
    let c = vmpool_alloc(40 * MIB as isize, 0, stream());
    fill(c, 40 * MIB, 0x77);
    let before = vmpool_stats(0);
    assert_eq!(vmpool_prepare_sleep(), 0);
    let after = vmpool_stats(0);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    let chunks = |s: &VmpoolStats| s.chunks_created - s.chunks_released;
    assert!(
        chunks(&after) * 2 < chunks(&before),
        "{} chunks -> {}",
        chunks(&before),
        chunks(&after)
    );
    assert!(all(a, 4 * MIB, 0xA5) && all(b, 300 * 1024, 0x3C) && all(c, 40 * MIB, 0x77));
    assert_eq!(vmpool_sleep(1), 0);
    assert_eq!(vmpool_prepare_sleep(), -1, "asleep: nothing to prepare");
    assert_eq!(vmpool_wake(), 0);
    assert!(all(c, 40 * MIB, 0x77));
    vmpool_free(c, 40 * MIB as isize, 0, stream());

    // Level 2 keeps nothing, but the memory comes back where it was.
    assert_eq!(vmpool_sleep(2), 0);
    assert_eq!(vmpool_wake(), 0);
    fill(a, 4 * MIB, 0x11);
    assert!(all(a, 4 * MIB, 0x11));

    assert_eq!(vmpool_sleep(3), -1, "no such level");

    // A tensor dropped while its pool sleeps: taken, and not copied back.
    fill(b, 300 * 1024, 0x3C);
    assert_eq!(vmpool_sleep(1), 0);
    vmpool_free(b, 300 * 1024, 0, stream());
    assert_eq!(vmpool_stats(0).used_bytes, 4 * MIB as u64);
    assert_eq!(vmpool_wake(), 0);
    assert!(all(a, 4 * MIB, 0x11));
    vmpool_free(b, 300 * 1024, 0, stream());
    assert_eq!(vmpool_stats(0).refused_frees, 1, "freed once already");
    vmpool_free(a, 4 * MIB as isize, 0, stream());
    assert_eq!(vmpool_stats(0).used_bytes, 0);
}
