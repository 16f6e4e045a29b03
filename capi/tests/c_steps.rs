//! `vmpool_mark_step` (and its `_at_next_alloc` form) as a C caller calls
//! it, on the host backend, in a process of its own: marking steps changes
//! how the device's pool serves every later allocation, which the other C
//! tests share.

use std::ffi::c_void;

use vmpool_c::{
    vmpool_alloc, vmpool_backend, vmpool_empty_cache, vmpool_free, vmpool_mark_step,
    vmpool_mark_step_at_next_alloc, vmpool_stats,
};

const MIB: isize = 1 << 20;

/// An opaque stream handle (the host backend keeps one stream per value).
fn stream() -> *mut c_void {
    std::ptr::without_provenance_mut(1)
}

/// A step: eight allocations, freed in reverse, each written whole and
/// checked before its free.
fn step() {
    let sizes: Vec<isize> = (1..=8).map(|i| i * MIB + 4096 * i).collect();
    let ptrs: Vec<*mut c_void> = sizes
        .iter()
        .map(|&s| vmpool_alloc(s, 0, stream()))
        .collect();
    for (i, (&p, &len)) in ptrs.iter().zip(&sizes).enumerate() {
        assert!(!p.is_null());
        // SAFETY: `p` is a live allocation of `len` bytes from
        // vmpool_alloc on the host backend, whose memory is this process's
        // own, mapped read-write for device 0; nothing else touches it.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), i as u8, len as usize) };
    }
    for (i, (&p, &len)) in ptrs.iter().zip(&sizes).enumerate().rev() {
        // SAFETY: as above, reading.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len as usize) };
        assert!(
            bytes.iter().all(|&b| b == i as u8),
            "allocation {i} changed"
        );
        vmpool_free(p, len, 0, stream());
    }
}

#[test]
fn marked_steps_are_served_from_a_layout() {
    std::env::set_var("VMPOOL_BACKEND", "host");
    std::env::set_var("VMPOOL_HOST_DEVICES", "1");
    std::env::set_var("VMPOOL_HOST_MEMORY", "1GiB");
    assert!(!vmpool_backend().is_null());
    // Before the pool exists, a mark has nothing to do.
    assert_eq!(vmpool_mark_step(0), 0);
    // Two steps recorded alike: laid out at the second one's end.
    for _ in 0..3 {
        step();
        assert_eq!(vmpool_mark_step(0), 0);
    }
    let laid_out = vmpool_stats(0);
    assert_eq!(laid_out.step_layouts, 1);
    assert!(laid_out.step_region_bytes >= 36 * MIB as u64);
    for _ in 0..4 {
        step();
        assert_eq!(vmpool_mark_step(0), 0);
    }
    let after = vmpool_stats(0);
    assert_eq!(after.planned, 4 * 8);
    assert_eq!(after.missed, 0);
    assert_eq!(after.maps, laid_out.maps, "a laid-out step mapped chunks");
    assert_eq!(vmpool_mark_step(7), -1, "a device the host backend lacks");
    // empty_cache gives the idle layout's region back with the rest.
    vmpool_empty_cache();
    let emptied = vmpool_stats(0);
    assert_eq!(emptied.step_region_bytes, 0);
    assert_eq!(emptied.reserved_bytes, 0);
    // The steps lay out again once two of them repeat.
    for _ in 0..3 {
        step();
        assert_eq!(vmpool_mark_step(0), 0);
    }
    assert_eq!(vmpool_stats(0).step_layouts, 2);
    // A mark at the next allocation: the frees before it end the step.
    let marks = vmpool_stats(0).steps;
    let grads = vmpool_alloc(MIB, 0, stream());
    assert_eq!(vmpool_mark_step_at_next_alloc(0), 0);
    vmpool_free(grads, MIB, 0, stream());
    assert_eq!(vmpool_stats(0).steps, marks, "no allocation yet");
    step();
    assert_eq!(vmpool_stats(0).steps, marks + 1);
    assert_eq!(
        vmpool_mark_step_at_next_alloc(7),
        -1,
        "a device the host backend lacks"
    );
}
