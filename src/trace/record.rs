//! Recording a pool's allocations and frees as a trace (see
//! [`crate::PoolProps::record`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use vmm::DeviceId;

use crate::sync::lock;

/// Where pool `id` records: the path given, else `PREFIX.<id>.trace` when
/// the environment variable `VMPOOL_RECORD` names a prefix, else nowhere.
pub(crate) fn record_path(given: Option<&Path>, id: u64) -> Option<PathBuf> {
    given.map(Path::to_path_buf).or_else(|| {
        std::env::var_os("VMPOOL_RECORD").map(|prefix| {
            let mut path = prefix;
            path.push(format!(".{id}.trace"));
            PathBuf::from(path)
        })
    })
}

/// Writes a pool's operations as a trace. Shared by the pool's callers
/// behind a mutex; every call that records goes through it.
pub(crate) struct Recorder(Mutex<Lines>);

struct Lines {
    out: BufWriter<File>,
    next_id: u64,
    /// The line being written: formatted whole before it goes to `out`, so
    /// that the buffer never reaches the file with half a line in it. A
    /// program that ends without flushing (pools are often never dropped)
    /// then leaves a shorter trace, not a broken one.
    line: String,
}

impl Lines {
    fn line(&mut self, args: std::fmt::Arguments<'_>) {
        self.line.clear();
        // Formatting into a String does not fail.
        let _ = std::fmt::Write::write_fmt(&mut self.line, args);
        if let Err(err) = self.out.write_all(self.line.as_bytes()) {
            tracing::warn!(%err, "writing the allocation trace failed");
        }
    }
}

impl Recorder {
    /// Starts the trace of pool `pool` on `device` at `path`, with its
    /// header line.
    pub(crate) fn create(path: &Path, pool: u64, device: DeviceId) -> std::io::Result<Self> {
        let mut lines = Lines {
            out: BufWriter::new(File::create(path)?),
            next_id: 1,
            line: String::new(),
        };
        lines.line(format_args!(
            "# vmpool pool {pool} on {device}: a <id> <bytes> <stream> | f <id> <stream> | s\n"
        ));
        Ok(Self(Mutex::new(lines)))
    }

    /// Records an allocation; returns its id in the trace. Out of line:
    /// the allocation hot path only tests whether there is a recorder.
    #[cold]
    pub(crate) fn allocation(&self, size: u64, stream: u64) -> u64 {
        let mut r = lock(&self.0);
        let id = r.next_id;
        r.next_id += 1;
        r.line(format_args!("a {id} {size} {stream}\n"));
        id
    }

    #[cold]
    pub(crate) fn free(&self, id: u64, stream: u64) {
        lock(&self.0).line(format_args!("f {id} {stream}\n"));
    }

    /// Records the end of a step ([`crate::Pool::mark_step`]).
    #[cold]
    pub(crate) fn step(&self) {
        lock(&self.0).line(format_args!("s\n"));
    }

    pub(crate) fn flush(&self) -> std::io::Result<()> {
        lock(&self.0).out.flush()
    }
}
