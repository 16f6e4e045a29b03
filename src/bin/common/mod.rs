//! What the command-line tools share.

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
