//! The C functions, called as a C caller would, on the host backend (six
//! devices, so that tests running at once each watch figures of their own).
//! The CUDA path of the same functions is exercised on the GPU by
//! `scripts/pytorch_compare.py` (README.md, "PyTorch").

use std::collections::HashSet;
use std::ffi::{c_void, CStr};
use std::sync::Once;
use std::thread;

use vmpool_c::{
    vmpool_alloc, vmpool_backend, vmpool_begin_allocate_to_pool, vmpool_empty_cache,
    vmpool_end_allocate_to_pool, vmpool_free, vmpool_record_stream, vmpool_release_pool,
    vmpool_reset_peaks, vmpool_set_memory_fraction, vmpool_snapshot, vmpool_stats,
    vmpool_stats_size, vmpool_synchronize, vmpool_trim, vmpool_version, VmpoolMempoolId,
    VmpoolStats,
};

/// Selects the host backend before the library's first call reads the
/// environment.
fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("VMPOOL_BACKEND", "host");
        std::env::set_var("VMPOOL_HOST_DEVICES", "6");
        std::env::set_var("VMPOOL_HOST_MEMORY", "1GiB");
        std::env::set_var("VMPOOL_RELEASE_THRESHOLD", "0");
        std::env::set_var("VMPOOL_TIMING", "1");
        // The defaults for the rest, whatever the caller's environment.
        std::env::remove_var("VMPOOL_CHUNK_SIZE");
        std::env::remove_var("VMPOOL_CHUNK_DIVISOR");
    });
    let backend = backend_name(vmpool_backend());
    assert_eq!(backend, "host");
}

fn backend_name(p: *const std::ffi::c_char) -> String {
    // The library returns pointers to static C strings; reading one needs
    // a raw-pointer dereference, which CStr does for us on a 'static.
    let name: &CStr = [c"cuda", c"host", c"none"]
        .into_iter()
        .find(|c| c.as_ptr() == p)
        .expect("vmpool_backend returns one of its three names");
    name.to_str().unwrap().to_owned()
}

/// An opaque stream handle (the host backend keeps one stream per value).
fn stream(n: usize) -> *mut c_void {
    n as *mut c_void
}

fn stats(device: i32) -> VmpoolStats {
    let s = vmpool_stats(device);
    assert_eq!(s.valid, 1, "stats of device {device}");
    s
}

#[test]
fn round_trip_and_figures() {
    setup();
    let d = 0;
    let sizes = [1usize, 255, 256, 4097, 1 << 20, 3 << 20, 40 << 20];
    let ptrs: Vec<*mut c_void> = sizes
        .iter()
        .map(|&size| vmpool_alloc(size as isize, d, stream(1)))
        .collect();
    for (&p, &size) in ptrs.iter().zip(&sizes) {
        assert!(!p.is_null(), "{size} bytes");
        assert_eq!(p as usize % 256, 0, "aligned to 256 bytes");
    }
    let s = stats(d);
    let live: u64 = sizes
        .iter()
        .map(|&s| (s as u64).next_multiple_of(256))
        .sum();
    assert_eq!(s.used_bytes, live);
    assert!(s.reserved_bytes >= live);
    assert_eq!(s.allocations, sizes.len() as u64);
    // Growth chunks scale with the pool (VMPOOL_CHUNK_DIVISOR's default):
    // one 2 MiB granule each while it holds under 2 GiB, so the 40 MiB
    // allocation alone takes 20 (fixed 32 MiB chunks would take 2).
    assert!(s.chunks_created >= 20, "{} chunks", s.chunks_created);

    for (&p, &size) in ptrs.iter().zip(&sizes) {
        vmpool_free(p, size as isize, d, stream(1));
    }
    assert_eq!(stats(d).used_bytes, 0);
    // Same stream, same size: the memory just freed, without waiting.
    let again = vmpool_alloc(sizes[5] as isize, d, stream(1));
    assert_eq!(again, ptrs[5]);
    vmpool_free(again, sizes[5] as isize, d, stream(1));

    assert_eq!(vmpool_synchronize(d), 0);
    let s = stats(d);
    assert_eq!(s.pending_bytes, 0);
    assert_eq!(s.reserved_bytes, 0, "release threshold 0: all returned");
    assert!(s.reserved_high >= live && s.used_high == live);
    assert_eq!(vmpool_reset_peaks(d), 0);
    let s = stats(d);
    assert_eq!((s.reserved_high, s.used_high), (0, 0));
    assert_eq!(s.refused_frees, 0);
    // VMPOOL_TIMING=1: every allocation and free above, timed.
    assert_eq!(s.timed_calls, 2 * sizes.len() as u64 + 2);
    assert_eq!(s.timed_frees, sizes.len() as u64 + 1);
    assert!(s.call_nanos > s.free_nanos && s.free_nanos > 0);
    assert!(s.grows > 0 && s.grow_nanos > 0 && s.maps > 0);
    assert!(s.same_stream_reuses <= s.allocations);
}

/// `vmpool_stats_t` is written out three times: the Rust struct, the C
/// header and the Python package's `Stats` (whose fields follow `valid`). The same names, in the
/// same order, all 64-bit.
#[test]
fn stats_layout_matches_the_header_and_the_python_helper() {
    // In the binary, so that it runs where the source tree is not.
    let header = include_str!("../include/vmpool.h");
    let body = header
        .split("typedef struct {")
        .find_map(|part| part.split_once("} vmpool_stats_t;").map(|(body, _)| body))
        .expect("vmpool_stats_t in the header");
    let in_header: Vec<&str> = body
        .lines()
        .map(|line| line.split("/*").next().unwrap().trim())
        .filter(|decl| !decl.is_empty())
        .flat_map(|decl| {
            let names = decl
                .strip_prefix("uint64_t ")
                .and_then(|rest| rest.strip_suffix(';'))
                .unwrap_or_else(|| panic!("not a uint64_t field: {decl}"));
            names.split(',').map(str::trim)
        })
        .collect();
    // The Python package's `Stats` dataclass: one `name: int` line per
    // field, in order.
    let python = include_str!("../../python/vmpool/_lib.py");
    let class = python
        .split_once("class Stats:")
        .and_then(|(_, rest)| rest.split_once("\n\n    def "))
        .expect("class Stats in python/vmpool/_lib.py")
        .0;
    let in_python: Vec<&str> = class
        .lines()
        .filter_map(|line| line.trim().strip_suffix(": int"))
        .collect();
    let debug = format!("{:?}", VmpoolStats::default());
    let in_rust: Vec<&str> = debug
        .trim_start_matches("VmpoolStats {")
        .trim_end_matches('}')
        .split(',')
        .map(|field| field.split(':').next().unwrap().trim())
        .filter(|name| !name.is_empty())
        .collect();
    assert_eq!(in_header, in_rust);
    assert_eq!(in_python, in_rust[1..]);
    assert_eq!(std::mem::size_of::<VmpoolStats>(), 8 * in_rust.len());
    assert_eq!(vmpool_stats_size(), std::mem::size_of::<VmpoolStats>());
}

/// The version the Python package compares with its own is the crate's.
#[test]
fn the_version_is_the_crate_s() {
    assert_eq!(vmpool_version(), vmpool_c::VERSION.as_ptr());
    assert_eq!(
        vmpool_c::VERSION.to_str().unwrap(),
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(vmpool_c::vmpool_abi(), vmpool_c::ABI);
}

#[test]
fn misuse_is_refused_and_changes_nothing() {
    setup();
    let d = 1;
    let size = 3 << 20;
    let p = vmpool_alloc(size, d, stream(1));
    assert!(!p.is_null());
    let before = stats(d);

    // An interior pointer, a pointer never handed out, the right pointer
    // on the wrong device, NULL.
    vmpool_free(p.wrapping_byte_add(4096), size, d, stream(1));
    vmpool_free(0xdead_0000 as *mut c_void, 64, d, stream(1));
    vmpool_free(p, size, 4, stream(1));
    vmpool_free(std::ptr::null_mut(), 0, d, stream(1));
    let after = stats(d);
    assert_eq!(after.refused_frees, before.refused_frees + 2);
    assert_eq!(stats(4).refused_frees, 1);
    assert_eq!(
        (after.used_bytes, after.reserved_bytes, after.frees),
        (before.used_bytes, before.reserved_bytes, before.frees)
    );

    // Recording a stream for a pointer that is not live changes nothing;
    // for a live one, its free waits for that stream, and frees.
    vmpool_record_stream(0xdead_0000 as *mut c_void, stream(3));
    vmpool_record_stream(p.wrapping_byte_add(4096), stream(3));
    vmpool_record_stream(p, stream(3));
    assert_eq!(stats(d).refused_frees, before.refused_frees + 2);

    // The allocation is still live and frees normally, once.
    vmpool_free(p, size, d, stream(1));
    assert_eq!(stats(d).used_bytes, 0);
    vmpool_free(p, size, d, stream(1));
    assert_eq!(stats(d).refused_frees, before.refused_frees + 3);

    // A size that does not match is logged; the allocation is freed.
    let q = vmpool_alloc(1000, d, stream(1));
    vmpool_free(q, 999, d, stream(1));
    assert_eq!(stats(d).used_bytes, 0);
}

/// The graph-pool hooks as PyTorch calls them (the host backend has no
/// captures: an allocation in the window is served by the device's pool;
/// `capi/src/shim.rs` tests the routing of a capture). Out of order calls
/// are logged and change nothing. Then the empty-cache hook.
#[test]
fn graph_pool_hooks() {
    setup();
    let d = 4;
    let id = VmpoolMempoolId {
        first: 0,
        second: 3,
    };
    vmpool_end_allocate_to_pool(d, id);
    vmpool_release_pool(d, id);
    assert_eq!(stats(d).graph_pools, 0);
    vmpool_begin_allocate_to_pool(d, id, std::ptr::null());
    vmpool_begin_allocate_to_pool(d, id, std::ptr::null());
    assert_eq!(stats(d).graph_pools, 1);
    let p = vmpool_alloc(1 << 20, d, stream(1));
    assert!(!p.is_null());
    assert_eq!(stats(d).used_bytes, 1 << 20);
    assert_eq!(stats(d).graph_reserved_bytes, 0);
    vmpool_end_allocate_to_pool(d, id);
    vmpool_release_pool(d, id);
    assert_eq!(stats(d).graph_pools, 0);
    vmpool_free(p, 1 << 20, d, stream(1));
    vmpool_begin_allocate_to_pool(99, id, std::ptr::null());
    // torch.cuda.empty_cache: every device's unused memory goes.
    vmpool_empty_cache();
    assert_eq!(stats(d).reserved_bytes, 0);
}

/// `torch.cuda.set_per_process_memory_fraction`: the device's pool grows
/// no further than the fraction of its memory (1 GiB here); a bad
/// fraction changes nothing.
#[test]
fn memory_fraction_limits_the_pool() {
    setup();
    let d = 5;
    vmpool_set_memory_fraction(1.5, d);
    vmpool_set_memory_fraction(f64::NAN, d);
    let big = vmpool_alloc(600 << 20, d, stream(1));
    assert!(!big.is_null(), "no limit yet");
    vmpool_free(big, 600 << 20, d, stream(1));
    vmpool_synchronize(d);
    vmpool_set_memory_fraction(0.25, d);
    assert!(
        vmpool_alloc(600 << 20, d, stream(1)).is_null(),
        "over a quarter"
    );
    let fits = vmpool_alloc(200 << 20, d, stream(1));
    assert!(!fits.is_null());
    vmpool_free(fits, 200 << 20, d, stream(1));
    vmpool_set_memory_fraction(1.0, d);
}

#[test]
fn bad_arguments_return_null() {
    setup();
    let d = 3;
    let before = stats(d);
    assert!(vmpool_alloc(0, d, stream(1)).is_null(), "zero bytes");
    assert!(vmpool_alloc(-1, d, stream(1)).is_null(), "negative");
    assert!(vmpool_alloc(isize::MAX, d, stream(1)).is_null(), "absurd");
    assert!(
        vmpool_alloc(2 << 30, d, stream(1)).is_null(),
        "more than the device"
    );
    assert!(vmpool_alloc(64, 6, stream(1)).is_null(), "no device 6");
    assert!(vmpool_alloc(64, -1, stream(1)).is_null(), "no device -1");
    assert_eq!(vmpool_stats(6).valid, 0);
    assert_eq!(vmpool_trim(7, 0), -1);
    assert_eq!(vmpool_synchronize(-3), -1);
    let after = stats(d);
    assert_eq!(
        (after.used_bytes, after.allocations),
        (before.used_bytes, before.allocations)
    );
    // After all that, the device still works.
    let p = vmpool_alloc(64, d, stream(1));
    assert!(!p.is_null());
    // Its map, copied out whole, and cut to what a small buffer holds.
    let full = vmpool_snapshot(d, std::ptr::null_mut(), 0);
    assert!(full > 0);
    let mut buf = vec![0xffu8; full as usize + 1];
    assert_eq!(vmpool_snapshot(d, buf.as_mut_ptr().cast(), buf.len()), full);
    let text = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap();
    assert_eq!(text.len(), full as usize);
    let mut small = [0xffu8; 8];
    assert_eq!(vmpool_snapshot(d, small.as_mut_ptr().cast(), 8), full);
    assert_eq!(&small[..], &[&text.as_bytes()[..7], &[0]].concat()[..]);
    assert_eq!(vmpool_snapshot(6, buf.as_mut_ptr().cast(), buf.len()), -1);
    vmpool_free(p, 64, d, stream(1));
    assert_eq!(vmpool_synchronize(d), 0);
    assert_eq!(vmpool_trim(d, 0), 0);
    assert_eq!(stats(d).reserved_bytes, 0);
}

#[test]
fn threads_each_on_their_stream() {
    setup();
    let d = 2;
    let threads: Vec<_> = (0..8)
        .map(|t| {
            thread::spawn(move || {
                let mut held = Vec::new();
                for i in 0..2000usize {
                    let size = 256 + (i * 7919 + t * 104_729) % (3 << 20);
                    let p = vmpool_alloc(size as isize, d, stream(100 + t));
                    assert!(!p.is_null());
                    held.push((p as usize, size));
                    if held.len() > 16 {
                        let (p, size) = held.swap_remove(i % held.len());
                        vmpool_free(p as *mut c_void, size as isize, d, stream(100 + t));
                    }
                }
                held
            })
        })
        .collect();
    let held: Vec<(usize, usize)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    // Every live pointer distinct, and no two live ranges overlap.
    let mut ranges = held.clone();
    ranges.sort();
    assert_eq!(
        ranges.iter().map(|r| r.0).collect::<HashSet<_>>().len(),
        ranges.len()
    );
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{w:x?} overlap");
    }
    let live: u64 = held
        .iter()
        .map(|&(_, s)| (s as u64).next_multiple_of(256))
        .sum();
    // The pool counts blocks: a reused block may be up to 1/8 larger.
    let used = stats(d).used_bytes;
    assert!(live <= used && used <= live + live / 8, "{used} for {live}");
    for (t, chunk) in held.chunks(17).enumerate() {
        for &(p, size) in chunk {
            vmpool_free(p as *mut c_void, size as isize, d, stream(100 + t % 8));
        }
    }
    assert_eq!(vmpool_synchronize(d), 0);
    let s = stats(d);
    assert_eq!((s.used_bytes, s.pending_bytes, s.reserved_bytes), (0, 0, 0));
    assert_eq!(s.refused_frees, 0);
}
