//! What vmpool's command-line tools share: the backend option, logging,
//! sizes with units and how an error is printed. The tools are
//! `vmpool-replay` and `vmpool-bench` (this package's binaries) and
//! `vmpool-soak` (soak/).

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::ValueEnum;
use vmpool::vmm::cuda::Cuda;

/// `--backend`: which driver layer a tool runs on.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The GPU if one can be opened, else the host backend (the tool says
    /// which).
    Auto,
    /// The CUDA driver; fails without a GPU.
    Cuda,
    /// memfd chunks in an mmap reservation, threads as streams; no GPU.
    Host,
}

/// The backend `kind` selects: `Some` for CUDA, `None` for the host
/// backend. Says which on stderr (stdout is the tool's report), and for
/// `auto` why the GPU was not used.
pub fn open(kind: BackendKind) -> anyhow::Result<Option<Arc<Cuda>>> {
    let cuda = match kind {
        BackendKind::Host => None,
        BackendKind::Cuda => Some(Cuda::new().context("opening the CUDA driver")?),
        BackendKind::Auto => Cuda::new()
            .inspect_err(|e| eprintln!("no GPU ({e}); using the host backend"))
            .ok(),
    };
    match cuda {
        Some(_) => eprintln!("backend: cuda (on the GPU)"),
        None => eprintln!("backend: host (memfd + mmap; no GPU involved)"),
    }
    Ok(cuda)
}

/// Logs to stderr as `RUST_LOG` asks (stdout stays the report), in colour
/// only on a terminal.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// A size option's value (`--chunk-size 1GiB`), read by
/// [`vmpool::parse_bytes`], the parser the C layer's settings use too, and
/// shown in the largest binary unit that divides it (a default of `2GiB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl std::str::FromStr for Bytes {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        vmpool::parse_bytes(text).map(Bytes)
    }
}

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        match units
            .iter()
            .find(|&&(shift, _)| self.0 != 0 && self.0 % (1 << shift) == 0)
        {
            Some(&(shift, unit)) => write!(f, "{}{unit}", self.0 >> shift),
            None => write!(f, "{}", self.0),
        }
    }
}

/// `err` and its causes on one line, each said once: a cause whose text
/// its parent's message already ends with is left out.
pub fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Runs a tool's `main`: on error, prints `TOOL: ERROR` once, on one line
/// ([`one_line`]), and exits with 1.
pub fn run(tool: &str, main: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    match main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{tool}: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}

/// `--defragment`: [`vmpool::Defragment`] as the command line spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DefragmentArg {
    /// `off`: growth maps new memory for every range that does not fit.
    Off,
    /// `units`: spare chunks and any free unit (the default).
    Units,
    /// `whole-regions`: spare chunks, and the units of regions with no
    /// live byte only.
    WholeRegions,
}

impl From<DefragmentArg> for vmpool::Defragment {
    fn from(arg: DefragmentArg) -> Self {
        match arg {
            DefragmentArg::Off => vmpool::Defragment::Off,
            DefragmentArg::Units => vmpool::Defragment::Units,
            DefragmentArg::WholeRegions => vmpool::Defragment::WholeRegions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_show_in_the_largest_unit_and_read_back() {
        for (bytes, text) in [
            (2 << 30, "2GiB"),
            (3 << 19, "1536KiB"),
            (4095, "4095"),
            (0, "0"),
        ] {
            assert_eq!(Bytes(bytes).to_string(), text);
            assert_eq!(text.parse::<Bytes>(), Ok(Bytes(bytes)));
        }
    }

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "unexpected end of file");
        let err = anyhow::Error::new(io).context("reading the trace: unexpected end of file");
        let err = err.context("reading t.gz");
        assert_eq!(
            one_line(&err),
            "reading t.gz: reading the trace: unexpected end of file"
        );
        let plain = anyhow::anyhow!("no allocation").context("t.trace");
        assert_eq!(one_line(&plain), "t.trace: no allocation");
    }
}
