//! What the pool's test suites share: the backends they run on, and the
//! macro that instantiates a suite once per backend.

use std::sync::Arc;

use vmpool::vmm::host::{Host, HostConfig};

/// A fresh host backend: two devices of 1 GiB, 2 MiB granules.
pub fn host() -> Arc<Host> {
    Host::new(HostConfig {
        devices: 2,
        memory_per_device: 1 << 30,
        granularity: 2 << 20,
    })
    .unwrap()
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
/// (module `cuda`). Each case is a `fn case<B: Backend>(b: &Arc<B>)`.
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
