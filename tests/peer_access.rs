//! Peer access (`cudaMemPoolSetAccess` / `GetAccess`) and per-device pools,
//! on two devices: the host backend's two simulated devices always, and
//! with `--features gpu-tests` two GPUs. The two-GPU cases are `#[ignore]`d
//! in the CUDA module, so that the one-GPU run lists them as ignored; on the
//! two-GPU machine run this binary with `--ignored` (they fail, not skip,
//! with fewer than two devices).
//!
//! "Refused before access is granted" is checked at the driver on both
//! backends (`get_access`, i.e. `cuMemGetAccess`), and by actually touching
//! the memory from the other device: in the test itself on the host
//! backend, and on CUDA in a child process (this binary again, running only
//! `refusal_probe`), since there it is an illegal-address fault that
//! poisons the context for good.

use std::sync::Arc;

use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::testing::faulty::{Call, Faulty};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Access, Backend, DeviceId, ErrorKind};
use vmpool::{Allocation, Context, Error, Pool, PoolAttribute, PoolProps};

// Not every shared helper (the fault-injection driver) is used here.
#[allow(dead_code)]
mod common;

const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);

fn two_devices<B: TestBackend>(b: &Arc<B>) {
    let n = b.device_count().unwrap();
    assert!(
        n >= 2,
        "this case needs two devices, the {} backend has {n} (on CUDA: run it on nvidia-h200-x2)",
        b.name()
    );
}

/// A pool on device 0 that grows by one granule per chunk, so that
/// allocations span several units.
fn granule_pool<B: TestBackend>(ctx: &Context<B>) -> Pool<B> {
    let g = ctx.backend().granularity(D0).unwrap() as u64;
    ctx.create_pool(&PoolProps {
        chunk_size: Some(g),
        va_size: Some(4 << 30),
        ..PoolProps::new(D0)
    })
    .unwrap()
}

fn read<B: TestBackend>(b: &B, s: &B::Stream, a: &Allocation) -> vmpool::vmm::Result<Vec<u32>> {
    let mut bytes = vec![0u8; a.size() as usize];
    b.copy_to_host(s, a.ptr(), &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect())
}

fn fill<B: TestBackend>(b: &B, s: &B::Stream, a: &Allocation, value: u32) {
    b.fill_u32(s, a.ptr(), a.size() as usize / 4, value)
        .unwrap();
    b.synchronize_stream(s).unwrap();
}

/// What the driver says `device` may do with each mapped unit of `pool`.
fn driver_access<B: TestBackend>(pool: &Pool<B>, device: DeviceId) -> Vec<Access> {
    pool.snapshot()
        .units
        .iter()
        .map(|u| {
            pool.backend()
                .get_access(vmpool::vmm::DevicePtr(u.va), device)
                .unwrap()
        })
        .collect()
}

fn all(access: Access, n: usize) -> Vec<Access> {
    vec![access; n]
}

/// On the host backend, touching memory without access from another device
/// is refused (a stream fault); on CUDA it would poison the context.
fn host_refuses<B: TestBackend>(b: &Arc<B>, device: DeviceId, a: &Allocation) {
    if b.name() != "host" {
        return;
    }
    let probe = b.create_stream(device).unwrap();
    let err = read(&**b, &probe, a).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamFault, "{err}");
}

// ---- two devices ---------------------------------------------------------------

/// A copy on device 1 reads and writes device 0's pool memory once access is
/// granted, and is refused before.
pub fn peer_reads_and_writes_after_access_is_granted<B: TestBackend>(b: &Arc<B>) {
    two_devices(b);
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = granule_pool(&ctx);
    let g = b.granularity(D0).unwrap() as u64;
    let a = pool.allocate(3 * g).unwrap();
    let units = pool.snapshot().units.len();
    assert_eq!(units, 3);
    let (s0, s1) = (b.create_stream(D0).unwrap(), b.create_stream(D1).unwrap());
    fill(&**b, &s0, &a, 0x600D);

    assert_eq!(pool.access(D0).unwrap(), Access::ReadWrite);
    assert_eq!(pool.access(D1).unwrap(), Access::None);
    assert_eq!(driver_access(&pool, D0), all(Access::ReadWrite, units));
    assert_eq!(driver_access(&pool, D1), all(Access::None, units));
    host_refuses(b, D1, &a);

    pool.set_access(D1, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(D1).unwrap(), Access::ReadWrite);
    assert_eq!(driver_access(&pool, D1), all(Access::ReadWrite, units));
    assert_eq!(
        read(&**b, &s1, &a).unwrap(),
        vec![0x600D; a.size() as usize / 4]
    );
    fill(&**b, &s1, &a, 0xBEEF);
    assert_eq!(
        read(&**b, &s0, &a).unwrap(),
        vec![0xBEEF; a.size() as usize / 4]
    );
    pool.free(a).unwrap();
    pool.audit().unwrap();
}

/// A checkerboard of granules, every other one freed, then a range larger
/// than any hole, served by remapping the free chunks: the granules kept,
/// and the range.
fn checkerboard<B: TestBackend>(pool: &Pool<B>, g: u64) -> (Vec<Allocation>, Allocation) {
    let (mut keep, mut holes) = (Vec::new(), Vec::new());
    for i in 0..9 {
        let a = pool.allocate(g).unwrap();
        if i % 2 == 0 {
            keep.push(a)
        } else {
            holes.push(a)
        }
    }
    for a in holes {
        pool.free(a).unwrap();
    }
    (keep, pool.allocate(3 * g).unwrap())
}

/// Memory mapped after access was granted (growth, and free chunks remapped
/// into a new range) gets it too; revoking it takes it from everything.
pub fn access_follows_growth_and_remaps<B: TestBackend>(b: &Arc<B>) {
    two_devices(b);
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = granule_pool(&ctx);
    let g = b.granularity(D0).unwrap() as u64;
    pool.set_access(D1, Access::ReadWrite).unwrap();
    let (keep, big) = checkerboard(&pool, g);
    assert!(pool.stats().remaps > 0, "{:?}", pool.stats());
    let units = pool.snapshot().units.len();
    assert_eq!(driver_access(&pool, D1), all(Access::ReadWrite, units));
    let s1 = b.create_stream(D1).unwrap();
    fill(&**b, &s1, &big, 7);
    let s0 = b.create_stream(D0).unwrap();
    assert_eq!(
        read(&**b, &s0, &big).unwrap(),
        vec![7; big.size() as usize / 4]
    );

    // Revoked: from every mapping, and new ones do not get it.
    b.synchronize_stream(&s1).unwrap();
    pool.set_access(D1, Access::None).unwrap();
    assert_eq!(pool.access(D1).unwrap(), Access::None);
    let more = pool.allocate(2 * g).unwrap();
    let units = pool.snapshot().units.len();
    assert_eq!(driver_access(&pool, D1), all(Access::None, units));
    assert_eq!(driver_access(&pool, D0), all(Access::ReadWrite, units));
    host_refuses(b, D1, &more);
    for a in keep.into_iter().chain([big, more]) {
        pool.free(a).unwrap();
    }
    pool.audit().unwrap();
}

/// Chunks a fresh start parks (Note [Starting afresh]) get access changed
/// while they are parked, so that growth can take them in place, with no
/// driver call, and the peer can use them.
pub fn parked_chunks_follow_access_changes<B: TestBackend>(b: &Arc<B>) {
    two_devices(b);
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = granule_pool(&ctx);
    let g = b.granularity(D0).unwrap() as u64;
    let pass = || -> Vec<Allocation> {
        let (mut keep, big) = checkerboard(&pool, g);
        keep.push(big);
        keep
    };
    for a in pass() {
        pool.free(a).unwrap();
    }
    assert!(pool.stats().remaps > 0, "the case needs a move");
    // Emptied: the next allocation starts afresh and parks the rest.
    let first = pool.allocate(g).unwrap();
    assert!(pool.stats().spare_bytes > 0, "parked");
    pool.set_access(D1, Access::ReadWrite).unwrap();
    pool.free(first).unwrap();
    let maps = pool.stats().maps;
    let live = pass();
    let units = pool.snapshot().units.len();
    assert!(
        pool.stats().maps - maps < units as u64,
        "some chunks were taken in place"
    );
    assert_eq!(driver_access(&pool, D1), all(Access::ReadWrite, units));
    for a in live {
        pool.free(a).unwrap();
    }
    pool.audit().unwrap();
}

/// Each device's default pool allocates on its own device, and the other
/// device may not touch it until given access.
pub fn per_device_pools<B: TestBackend>(b: &Arc<B>) {
    two_devices(b);
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let size: u64 = 64 << 20;
    let free = |d| b.mem_info(d).unwrap().free as i64;
    let mut allocations = Vec::new();
    for (mine, other) in [(D0, D1), (D1, D0)] {
        let pool = ctx.default_pool(mine).unwrap();
        let (before_mine, before_other) = (free(mine), free(other));
        let a = pool.allocate(size).unwrap();
        assert_eq!(a.device(), mine);
        assert!(
            before_mine - free(mine) >= size as i64,
            "{mine} lost {} bytes for a {size}-byte allocation",
            before_mine - free(mine)
        );
        assert!(
            (before_other - free(other)).abs() < size as i64 / 2,
            "{other} changed by {} bytes",
            before_other - free(other)
        );
        let s = b.create_stream(mine).unwrap();
        fill(&**b, &s, &a, mine.0 + 1);
        assert_eq!(
            read(&**b, &s, &a).unwrap(),
            vec![mine.0 + 1; size as usize / 4]
        );
        host_refuses(b, other, &a);
        allocations.push((pool, a));
    }
    for (pool, a) in allocations {
        pool.free(a).unwrap();
        pool.trim_to(0).unwrap();
        assert_eq!(pool.attribute(PoolAttribute::ReservedMemCurrent), 0);
    }
}

// ---- any number of devices ----------------------------------------------------

/// Access for a device that does not exist, or less than read-write for the
/// pool's own device: typed errors, nothing changed.
pub fn bad_access_requests_change_nothing<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = granule_pool(&ctx);
    let a = pool.allocate(1 << 20).unwrap();
    let missing = DeviceId(b.device_count().unwrap());
    assert!(matches!(
        pool.set_access(missing, Access::ReadWrite),
        Err(Error::InvalidDevice(d)) if d == missing
    ));
    assert!(matches!(pool.access(missing), Err(Error::InvalidDevice(_))));
    for weaker in [Access::Read, Access::None] {
        assert!(matches!(
            pool.set_access(D0, weaker),
            Err(Error::InvalidAccess { device: D0, .. })
        ));
    }
    pool.set_access(D0, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(D0).unwrap(), Access::ReadWrite);
    assert_eq!(driver_access(&pool, D0), vec![Access::ReadWrite]);
    pool.free(a).unwrap();
}

macro_rules! suite {
    ($backend:ident, $open:path, $(#[$multi:meta])*) => {
        mod $backend {
            #[test]
            $(#[$multi])*
            fn peer_reads_and_writes_after_access_is_granted() {
                super::peer_reads_and_writes_after_access_is_granted(&$open());
            }
            #[test]
            $(#[$multi])*
            fn access_follows_growth_and_remaps() {
                super::access_follows_growth_and_remaps(&$open());
            }
            #[test]
            $(#[$multi])*
            fn parked_chunks_follow_access_changes() {
                super::parked_chunks_follow_access_changes(&$open());
            }
            #[test]
            $(#[$multi])*
            fn per_device_pools() {
                super::per_device_pools(&$open());
            }
            #[test]
            fn bad_access_requests_change_nothing() {
                super::bad_access_requests_change_nothing(&$open());
            }
        }
    };
}

suite!(host, crate::common::host,);
#[cfg(feature = "gpu-tests")]
suite!(
    cuda,
    crate::common::cuda,
    #[ignore = "needs two GPUs: run with --ignored on nvidia-h200-x2"]
);

// ---- host only ---------------------------------------------------------------

/// A read-only peer may read but not write (read-only peer mappings are not
/// something every GPU offers, so this is checked on the host only).
#[test]
fn read_only_peer_access() {
    let b = common::host();
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = granule_pool(&ctx);
    let a = pool.allocate(4096).unwrap();
    pool.set_access(D1, Access::Read).unwrap();
    assert_eq!(driver_access(&pool, D1), vec![Access::Read]);
    let s1 = b.create_stream(D1).unwrap();
    read(&*b, &s1, &a).unwrap();
    b.fill_u32(&s1, a.ptr(), 1, 1).unwrap();
    assert_eq!(
        b.synchronize_stream(&s1).unwrap_err().kind(),
        ErrorKind::StreamFault
    );
    pool.free(a).unwrap();
}

/// A set-access that fails on some mapping leaves every mapping, and the
/// pool's access list, as they were.
#[test]
fn failed_set_access_rolls_back() {
    let host = Host::new(HostConfig {
        devices: 2,
        first_device: 0,
        memory_per_device: 1 << 30,
        granularity: 2 << 20,
    })
    .unwrap();
    let b = Faulty::new(Arc::clone(&host));
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = granule_pool(&ctx);
    let g = 2 << 20;
    // Three units with a hole in the middle: two runs, two driver calls.
    let (x, y, z) = (
        pool.allocate(g).unwrap(),
        pool.allocate(g).unwrap(),
        pool.allocate(g).unwrap(),
    );
    pool.free(y).unwrap();
    pool.trim_to(2 * g).unwrap();
    assert_eq!(pool.snapshot().units.len(), 2);
    for n in 0..2 {
        b.fail_nth(Call::SetAccess, n);
        assert!(matches!(
            pool.set_access(D1, Access::ReadWrite),
            Err(Error::Driver(_))
        ));
        assert!(b.disarm(), "fault #{n} did not fire");
        assert_eq!(pool.access(D1).unwrap(), Access::None);
        assert_eq!(driver_access(&pool, D1), vec![Access::None; 2]);
    }
    pool.set_access(D1, Access::ReadWrite).unwrap();
    assert_eq!(driver_access(&pool, D1), vec![Access::ReadWrite; 2]);
    pool.free(x).unwrap();
    pool.free(z).unwrap();
    drop((pool, ctx, b));
    assert_eq!(host.census(), vmpool::vmm::host::Census::default());
}

// ---- CUDA: the refusal itself, in a child process --------------------------

/// Set in the child that [`cuda_peer_write_without_access_faults`] starts.
#[cfg(feature = "gpu-tests")]
const PROBE_ENV: &str = "VMPOOL_PEER_PROBE";

/// On a GPU, device 1 writing device 0's pool memory without access is an
/// illegal-address fault that poisons the context for good, so it is tried
/// in a child process: this binary again, running only `refusal_probe`.
#[cfg(feature = "gpu-tests")]
#[test]
#[ignore = "needs two GPUs: run with --ignored on nvidia-h200-x2"]
fn cuda_peer_write_without_access_faults() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "refusal_probe",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PROBE_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("probe: refused"),
        "device 1 was not refused ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child's side: does nothing unless started by the test above.
#[cfg(feature = "gpu-tests")]
#[test]
fn refusal_probe() {
    if std::env::var_os(PROBE_ENV).is_none() {
        return;
    }
    let b = common::cuda();
    two_devices(&b);
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = granule_pool(&ctx);
    let a = pool.allocate(4096).unwrap();
    assert_eq!(b.get_access(a.ptr(), D1).unwrap(), Access::None);
    let s1 = b.create_stream(D1).unwrap();
    match b
        .fill_u32(&s1, a.ptr(), 1, 1)
        .and_then(|()| b.synchronize_stream(&s1))
    {
        Err(e) => println!("probe: refused: {e}"),
        Ok(()) => println!("probe: allowed"),
    }
    // Nothing is dropped: the context may be poisoned.
    std::process::exit(0);
}
