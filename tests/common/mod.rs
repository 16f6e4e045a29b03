//! What the pool's test suites share: the backends they run on, and the
//! macro that instantiates a suite once per backend.

use std::sync::Arc;

use vmpool::trace::Trace;
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{DeviceId, DevicePtr};
use vmpool::{Allocation, Context, Pool, PoolAttribute, PoolProps, Stream};

/// A fresh host backend: two devices of 1 GiB, 2 MiB granules.
pub fn host() -> Arc<Host> {
    Host::new(HostConfig {
        devices: 2,
        first_device: 0,
        memory_per_device: 1 << 30,
        granularity: 2 << 20,
    })
    .unwrap()
}

/// A pool of device 0 reserving 4 GiB of address space, at the other
/// defaults: the step suites' pool.
pub fn pool<B: TestBackend>(ctx: &Context<B>) -> Pool<B> {
    ctx.create_pool(&PoolProps {
        va_size: Some(4 << 30),
        ..PoolProps::new(DeviceId(0))
    })
    .unwrap()
}

/// The recorded trace `traces/NAME.trace.gz`, opened from the
/// repository's root: where cargo runs the tests, and where the GPU
/// machine runs the built binaries (scripts/gpu-run.sh).
pub fn recorded(name: &str) -> Trace {
    let path = format!("traces/{name}.trace.gz");
    let file = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; run from the repository's root"));
    Trace::read(file).unwrap()
}

/// A host backend whose device holds four times `trace`'s peak.
pub fn host_for(trace: &Trace) -> Arc<Host> {
    Host::new(HostConfig {
        memory_per_device: 4 * trace.peak_live as usize,
        ..HostConfig::default()
    })
    .unwrap()
}

/// A pool of device 0 as the C layer makes one for PyTorch: growth
/// chunks of a 1024th, and nothing released to a threshold.
pub fn pytorch_pool<B: TestBackend>(ctx: &Context<B>) -> Pool<B> {
    let pool = ctx
        .create_pool(&PoolProps {
            chunk_divisor: Some(1024),
            ..PoolProps::new(DeviceId(0))
        })
        .unwrap();
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)
        .unwrap();
    pool
}

/// Allocates `size` bytes of `pool`: in stream order on `on`, or
/// synchronously (`None`).
pub fn allocate_on<B: TestBackend>(
    pool: &Pool<B>,
    on: Option<&Stream<B>>,
    size: u64,
) -> Allocation {
    match on {
        Some(s) => pool.allocate_async(size, s),
        None => pool.allocate(size),
    }
    .unwrap()
}

/// Frees `a` as [`allocate_on`] allocates.
pub fn free_on<B: TestBackend>(pool: &Pool<B>, on: Option<&Stream<B>>, a: Allocation) {
    match on {
        Some(s) => pool.free_async(a, s),
        None => pool.free(a),
    }
    .unwrap();
}

/// Fills the first and last word of `a` with `word`: enough to catch two
/// live allocations that overlap, quick on every backend.
pub fn mark_ends<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, word: u32) {
    b.fill_u32(s.raw(), a.ptr(), 1, word).unwrap();
    let last = DevicePtr(a.ptr().0 + a.size() / 4 * 4 - 4);
    b.fill_u32(s.raw(), last, 1, word).unwrap();
}

/// Checks the words [`mark_ends`] wrote at the ends of `a`.
pub fn check_ends<B: TestBackend>(b: &B, s: &Stream<B>, a: &Allocation, word: u32) {
    check_span_ends(b, s, a.ptr().0, a.size(), word);
}

/// [`check_ends`] of the `size` bytes at `ptr`.
pub fn check_span_ends<B: TestBackend>(b: &B, s: &Stream<B>, ptr: u64, size: u64, word: u32) {
    for at in [ptr, ptr + size / 4 * 4 - 4] {
        let mut bytes = [0u8; 4];
        b.copy_to_host(s.raw(), DevicePtr(at), &mut bytes).unwrap();
        assert_eq!(
            u32::from_ne_bytes(bytes),
            word,
            "the bytes at {at:#x} changed"
        );
    }
}

/// The GPU; fails loudly when the gpu-tests feature asks for one that is
/// not there.
#[cfg(feature = "gpu-tests")]
pub fn cuda() -> Arc<vmpool::vmm::cuda::Cuda> {
    vmpool::vmm::cuda::Cuda::new().unwrap_or_else(|e| {
        panic!("the gpu-tests feature is on, but no CUDA device could be opened: {e}")
    })
}

/// `suites!(case, ...)`: a test per case on the host backend (module
/// `host`), and with `--features gpu-tests` on the CUDA backend too
/// (module `cuda`). Each case is a `fn case<B: TestBackend>(b: &Arc<B>)`.
#[macro_export]
macro_rules! suites {
    ($($case:ident),* $(,)?) => {
        mod host {
            $(
                #[test]
                fn $case() {
                    super::$case(&$crate::common::host());
                }
            )*
        }
        #[cfg(feature = "gpu-tests")]
        mod cuda {
            $(
                #[test]
                fn $case() {
                    super::$case(&$crate::common::cuda());
                }
            )*
        }
    };
}

/// Makes the n-th call of each kind in `calls` fail, for n = 0, 1, ... in
/// turn, each time on a fresh host backend, until `scenario` makes fewer
/// than n such calls. `scenario` builds its pool on the backend, checks it
/// stayed consistent, and returns whether the fault fired (what
/// `Faulty::disarm` says). After each run the backend must hold nothing.
/// Returns how many faults were injected.
pub fn at_every_call_site(
    calls: &[vmpool::vmm::testing::faulty::Call],
    scenario: impl Fn(&Arc<vmpool::vmm::testing::faulty::Faulty<Host>>) -> bool,
) -> usize {
    let mut injected = 0;
    for &call in calls {
        for n in 0.. {
            let host = Host::new(HostConfig {
                devices: 1,
                first_device: 0,
                memory_per_device: 1 << 30,
                granularity: 2 << 20,
            })
            .unwrap();
            let b = vmpool::vmm::testing::faulty::Faulty::new(Arc::clone(&host));
            b.fail_nth(call, n);
            let fired = scenario(&b);
            assert_eq!(
                host.census(),
                vmpool::vmm::host::Census::default(),
                "{call:?} #{n} leaked"
            );
            if !fired {
                break;
            }
            injected += 1;
        }
    }
    injected
}
