//! The shim on the host backend: its tables, the waits for recorded
//! users, and the C layer's part in graph captures. The graph pools
//! themselves are tested in the library (tests/graph_pools.rs).

use super::*;
use crate::config::ConfigError;
use vmpool::vmm::testing::TestBackend;

fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::from_lookup(|name| {
        vars.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| (*v).to_owned())
    })
}

/// Adopts odd stream handles; an even one fails, as a handle of
/// another device would.
fn odd_handles_only(
    b: &vmpool::vmm::host::Host,
    device: DeviceId,
    handle: usize,
) -> vmpool::vmm::Result<vmpool::vmm::host::HostStream> {
    let device = if handle % 2 == 0 {
        DeviceId(u32::MAX)
    } else {
        device
    };
    b.create_stream(device)
}

#[test]
fn a_free_on_a_stream_that_cannot_be_adopted_changes_nothing() {
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
    let ptr = shim.alloc(4096, 0, 1).unwrap();
    assert!(
        shim.alloc(4096, 0, 2).is_err(),
        "stream 2 cannot be adopted"
    );
    assert!(shim.free(ptr, 4096, 0, 2).is_err());
    // Still live, and freed normally on its own stream.
    assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 4096);
    shim.free(ptr, 4096, 0, 1).unwrap();
    let figures = shim.figures(0).unwrap();
    assert_eq!(figures.refused_frees, 0);
    shim.synchronize(0).unwrap();
    assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 0);
}

fn table_len(shim: &Shim<vmpool::vmm::host::Host>) -> usize {
    shim.devices[0].streams.len()
}

#[test]
fn a_synchronize_forgets_the_streams_and_they_are_adopted_again() {
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
    for handle in [1, 3, 5] {
        let ptr = shim.alloc(1 << 20, 0, handle).unwrap();
        shim.free(ptr, 1 << 20, 0, handle).unwrap();
    }
    assert_eq!(table_len(&shim), 3);
    shim.synchronize(0).unwrap();
    assert_eq!(table_len(&shim), 0);
    // Adopted afresh: a stream reuses its own frees at once again.
    let a = shim.alloc(1 << 20, 0, 3).unwrap();
    shim.free(a, 1 << 20, 0, 3).unwrap();
    let b = shim.alloc(1 << 20, 0, 3).unwrap();
    assert_eq!(a, b);
    assert_eq!(table_len(&shim), 1);
    shim.free(b, 1 << 20, 0, 3).unwrap();
    // empty_cache waits for the device too, and forgets as well.
    shim.empty_cache().unwrap();
    assert_eq!(table_len(&shim), 0);
    let figures = shim.figures(0).unwrap();
    assert_eq!((figures.stats.used_bytes, figures.refused_frees), (0, 0));
}

/// The host stream `handle` stands for on device 0.
fn host_stream(
    shim: &Shim<vmpool::vmm::host::Host>,
    handle: usize,
) -> Stream<vmpool::vmm::host::Host> {
    shim.with_stream(&shim.devices[0], handle, Stream::clone)
        .unwrap()
}

#[test]
fn a_free_waits_for_the_streams_recorded_as_users() {
    use std::time::{Duration, Instant};
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
    let ptr = shim.alloc(4096, 0, 1).unwrap();
    let (own, other) = (host_stream(&shim, 1), host_stream(&shim, 3));
    // Stream 3 still uses the memory when stream 1 frees it.
    host.delay(other.raw(), Duration::from_millis(300)).unwrap();
    shim.record_stream(ptr, 3).unwrap();
    shim.record_stream(ptr, 3).unwrap();
    shim.record_stream(ptr, 1).unwrap();
    let events = host.census().events;
    shim.free(ptr, 4096, 0, 1).unwrap();
    // One event made for the wait, and kept.
    assert_eq!(host.census().events, events + 1);
    // Stream 1's next allocation gets the same memory at once (its own
    // free), so its work from here must wait for stream 3's.
    assert_eq!(shim.alloc(4096, 0, 1).unwrap(), ptr);
    let started = Instant::now();
    host.synchronize_stream(own.raw()).unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "stream 1 ran ahead of the work stream 3 queued on the memory"
    );
    // Again: the kept event serves, none is made.
    host.delay(other.raw(), Duration::from_millis(300)).unwrap();
    shim.record_stream(ptr, 3).unwrap();
    shim.free(ptr, 4096, 0, 1).unwrap();
    assert_eq!(shim.alloc(4096, 0, 1).unwrap(), ptr);
    let started = Instant::now();
    host.synchronize_stream(own.raw()).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(host.census().events, events + 1);
}

#[test]
fn record_stream_refuses_what_is_not_live() {
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
    let ptr = shim.alloc(4096, 0, 1).unwrap();
    assert!(matches!(
        shim.record_stream(ptr + 256, 3),
        Err(CallError::NotLive { .. })
    ));
    // A stream that cannot be adopted is refused at the record, and the
    // free goes on as if it had not been named.
    assert!(shim.record_stream(ptr, 2).is_err());
    shim.free(ptr, 4096, 0, 1).unwrap();
    assert!(matches!(
        shim.record_stream(ptr, 3),
        Err(CallError::NotLive { .. })
    ));
    shim.synchronize(0).unwrap();
    assert_eq!(shim.figures(0).unwrap().stats.used_bytes, 0);
}

/// While a graph pool is open, allocations on a capturing stream come
/// from it and nothing else: after the capture, what it freed is not
/// handed to other allocations (a replay would write there), and the
/// During a capture, a free of memory another stream was recorded on
/// waits for the capture's end: the freeing stream may wait for no
/// event recorded outside the capture, and the memory must not be
/// reused before the other stream's work. Then it is freed, behind
/// that work.
#[test]
fn a_free_with_recorded_users_waits_for_the_end_of_the_capture() {
    use std::time::{Duration, Instant};
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
    let id = GraphPoolId::new(0, 11);
    let (s, other) = (host_stream(&shim, 1), host_stream(&shim, 3));
    shim.begin_graph_pool(0, id).unwrap();
    host.begin_capture(s.raw()).unwrap();
    let p = shim.alloc(1 << 20, 0, 1).unwrap();
    shim.record_stream(p, 3).unwrap();
    shim.free(p, -1, 0, 1).unwrap();
    // Not free yet: the same size on the same stream gets other memory.
    let q = shim.alloc(1 << 20, 0, 1).unwrap();
    assert_ne!(q, p);
    shim.free(q, -1, 0, 1).unwrap();
    host.end_capture(s.raw()).expect("the capture survived");
    host.delay(other.raw(), Duration::from_millis(300)).unwrap();
    shim.end_graph_pool(0, id).unwrap();
    // Freed now, behind stream 3's work.
    assert!(shim.free(p, -1, 0, 1).is_err(), "freed once already");
    let started = Instant::now();
    host.synchronize_stream(s.raw()).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(200));
    shim.release_graph_pool(0, id).unwrap();
    assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
}

/// The graph pool calls route through the pointer table (a capturing
/// allocation is freed by pointer to its graph pool, from any stream) and
/// keep the C layer's messages.
#[test]
fn graph_pool_calls_route_by_pointer_and_keep_their_messages() {
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(Arc::clone(&host), config(&[]).unwrap(), odd_handles_only).unwrap();
    let (one, two) = (GraphPoolId::new(0, 1), GraphPoolId::new(0, 2));
    shim.begin_graph_pool(0, one).unwrap();
    let err = shim.begin_graph_pool(0, one).unwrap_err();
    assert_eq!(
        err.to_string(),
        "graph pool (0, 1) on device 0: opened twice"
    );
    let s = host_stream(&shim, 1);
    host.begin_capture(s.raw()).unwrap();
    let p = shim.alloc(1 << 20, 0, 1).unwrap();
    shim.begin_graph_pool(0, two).unwrap();
    let err = shim.alloc(4096, 0, 1).unwrap_err();
    assert!(
        matches!(err, CallError::WhichCapture { device: 0, open: 2 }),
        "{err}"
    );
    assert!(err.to_string().starts_with(
        "an allocation on a capturing stream while 2 graph pools are open on device 0: "
    ));
    host.end_capture(s.raw()).unwrap();
    shim.end_graph_pool(0, one).unwrap();
    let figures = shim.figures(0).unwrap();
    assert_eq!(figures.graph_pools, 2);
    assert!(figures.graph_reserved_bytes >= 1 << 20);
    assert_eq!(figures.stats.used_bytes, 0, "not the device's pool");
    let err = shim.end_graph_pool(0, one).unwrap_err();
    assert_eq!(
        err.to_string(),
        "graph pool (0, 1) on device 0: closed but not open"
    );
    shim.release_graph_pool(0, one).unwrap();
    shim.release_graph_pool(0, two).unwrap();
    assert_eq!(shim.figures(0).unwrap().graph_pools, 1, "p is live");
    shim.free(p, -1, 0, 3).unwrap();
    assert_eq!(shim.figures(0).unwrap().graph_pools, 0);
    let err = shim.release_graph_pool(0, one).unwrap_err();
    assert_eq!(
        err.to_string(),
        "graph pool (0, 1) on device 0: released more often than opened"
    );
    assert!(matches!(
        shim.begin_graph_pool(1, one),
        Err(CallError::NoDevice(1))
    ));
}

/// The fields of a device that every call reads (see `Device`) are on its
/// first two cache lines, none across a line: the pool, the pointer table,
/// the count of open graph pools (`GraphPools` is `repr(C)` with it first),
/// the stream table and the count of threads in a memory pool (`MemPools`
/// likewise).
#[test]
fn a_devices_hot_fields_are_on_its_first_two_lines() {
    use std::mem::{offset_of, size_of};
    type H = vmpool::vmm::host::Host;
    type D = Device<H>;
    let hot = [
        (offset_of!(D, pool), size_of::<OnceLock<Pool<H>>>()),
        (offset_of!(D, live), size_of::<PointerTable<H>>()),
        (offset_of!(D, graphs), size_of::<usize>()),
        (offset_of!(D, streams), size_of::<StreamTable<H>>()),
        (offset_of!(D, mem_pools), size_of::<usize>()),
    ];
    for (start, size) in hot {
        let end = start + size;
        assert!(end <= 128 && start / 64 == (end - 1) / 64, "{hot:?}");
    }
}

/// Two threads freeing the same pointers over and over: every refusal is
/// counted, the first ten are errors in full, and after them only a count
/// at each power of ten is one; the rest are not logged.
#[test]
fn repeated_refused_frees_are_counted_not_each_logged() {
    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let shim = Shim::new(host, config(&[]).unwrap(), odd_handles_only).unwrap();
    let ptrs: Vec<u64> = (0..500).map(|_| shim.alloc(4096, 0, 1).unwrap()).collect();
    for &p in &ptrs {
        shim.free(p, 4096, 0, 1).unwrap();
    }
    let errors: Vec<CallError> = std::thread::scope(|scope| {
        let racers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    (0..2)
                        .flat_map(|_| ptrs.iter().map(|&p| shim.free(p, 4096, 0, 1).unwrap_err()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        racers.into_iter().flat_map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(errors.len(), 2_000);
    assert_eq!(shim.figures(0).unwrap().refused_frees, 2_000);
    let in_full: Vec<&CallError> = errors
        .iter()
        .filter(|e| matches!(e, CallError::NotOurs { .. }))
        .collect();
    assert_eq!(in_full.len(), 10);
    assert_eq!(
        in_full
            .iter()
            .filter(|e| e.to_string().contains("later refused frees are counted"))
            .count(),
        1
    );
    let mut counts: Vec<String> = errors
        .iter()
        .filter(|e| matches!(e, CallError::RefusedFrees { .. }))
        .map(ToString::to_string)
        .collect();
    counts.sort();
    assert_eq!(
        counts,
        [
            "90 more refused frees on device 0 (100 in all; the next count at 1000)",
            "900 more refused frees on device 0 (1000 in all; the next count at 10000)",
        ]
    );
    let unlogged = errors
        .iter()
        .filter(|e| matches!(e, CallError::Unlogged))
        .count();
    assert_eq!(unlogged, 2_000 - 10 - 2);
}

/// `VMPOOL_HANDLE_TYPE=posix_fd` makes the device's pool shareable, the
/// handle type NCCL's registration exports chunks with; by default it is
/// not.
#[test]
fn the_handle_type_setting_makes_pools_shareable() {
    for (vars, shareable) in [
        (&[][..], false),
        (&[("VMPOOL_HANDLE_TYPE", "posix_fd")][..], true),
    ] {
        let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
        let shim = Shim::new(host, config(vars).unwrap(), odd_handles_only).unwrap();
        let ptr = shim.alloc(4 << 20, 0, 1).unwrap();
        let pool = shim.devices[0].pool.get().unwrap();
        assert_eq!(
            pool.export_to_shareable_handle().is_ok(),
            shareable,
            "{vars:?}"
        );
        shim.free(ptr, 4 << 20, 0, 1).unwrap();
    }
}

#[test]
fn the_devices_pool_reserves_the_address_space_asked_for() {
    let default = Shim::new(
        vmpool::vmm::host::Host::new(Default::default()).unwrap(),
        config(&[]).unwrap(),
        odd_handles_only,
    )
    .unwrap();
    let ptr = default.alloc(4096, 0, 1).unwrap();
    let memory = vmpool::vmm::host::HostConfig::default().memory_per_device as u64;
    assert_eq!(
        default.pool_snapshot(0).unwrap().unwrap().va_size,
        4 * memory
    );
    default.free(ptr, 4096, 0, 1).unwrap();

    let host = vmpool::vmm::host::Host::new(Default::default()).unwrap();
    let vars = [("VMPOOL_VA_SIZE", "64MiB")];
    let shim = Shim::new(host, config(&vars).unwrap(), odd_handles_only).unwrap();
    let ptr = shim.alloc(32 << 20, 0, 1).unwrap();
    assert_eq!(shim.pool_snapshot(0).unwrap().unwrap().va_size, 64 << 20);
    let err = shim.alloc(128 << 20, 0, 1).unwrap_err();
    assert!(err.to_string().contains("address space"), "{err}");
    shim.free(ptr, 32 << 20, 0, 1).unwrap();
}
