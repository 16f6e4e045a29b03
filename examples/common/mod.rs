//! What the examples share: choosing the backend.

use anyhow::{Context as _, Result};
use clap::ValueEnum;
use std::sync::Arc;
use vmpool::vmm::cuda::Cuda;

#[derive(Clone, Copy, ValueEnum)]
pub enum Which {
    /// The GPU if one can be opened, else the host backend.
    Auto,
    Cuda,
    Host,
}

/// Logs what vmpool does as `RUST_LOG` asks (`vmpool=debug`: growth,
/// remaps, trims; `vmpool=trace`: every allocation too), in colour only
/// on a terminal.
pub fn init_tracing() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_ansi(std::io::stdout().is_terminal())
        .init();
}

/// The CUDA backend if `which` asks for it (or allows it and a GPU can be
/// opened); `None` for the host backend. Says which, and why.
pub fn open(which: Which) -> Result<Option<Arc<Cuda>>> {
    let cuda = match which {
        Which::Host => None,
        Which::Cuda => Some(Cuda::new().context("opening the CUDA driver")?),
        Which::Auto => Cuda::new().inspect_err(|e| println!("no GPU ({e})")).ok(),
    };
    match cuda {
        Some(_) => println!("backend: cuda (on the GPU)"),
        None => println!("backend: host (memfd + mmap; no GPU involved)"),
    }
    Ok(cuda)
}

/// Runs the generic `$run(backend, ..)` on the backend `$which` selects.
#[macro_export]
macro_rules! on_backend {
    ($which:expr, $run:ident $(, $arg:expr)*) => {{
        common::init_tracing();
        match common::open($which)? {
            Some(cuda) => $run(cuda $(, $arg)*),
            None => $run(
                vmpool::vmm::host::Host::new(vmpool::vmm::host::HostConfig::default())?
                $(, $arg)*
            ),
        }
    }};
}
