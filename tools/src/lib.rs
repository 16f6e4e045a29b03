//! What vmpool's command-line tools share: the backend option and logging.
//! The tools are `vmpool-replay` and `vmpool-bench` (this package's
//! binaries) and `vmpool-soak` (soak/).

use clap::ValueEnum;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Host,
    Cuda,
}

/// Logs to stderr as `RUST_LOG` asks (stdout stays the report).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
}
