//! vmpool's C interface (`include/vmpool.h`), built as `libvmpool_c.so`.
//!
//! Its first user is PyTorch: `torch.cuda.memory.CUDAPluggableAllocator`
//! loads the library and calls [`vmpool_alloc`] and [`vmpool_free`] for
//! every tensor; [`vmpool_record_stream`] for `Tensor.record_stream`;
//! [`vmpool_begin_allocate_to_pool`], [`vmpool_end_allocate_to_pool`] and
//! [`vmpool_release_pool`] around CUDA graph captures, and around
//! `torch.cuda.use_mem_pool` for a pool [`vmpool_mem_pool_create`] made
//! (`mem_pool_exports`);
//! [`vmpool_empty_cache`] and [`vmpool_set_memory_fraction`] for
//! `torch.cuda.empty_cache` and `set_per_process_memory_fraction`
//! (the Python package `python/vmpool` does the set-up). Each device gets one
//! stream-ordered vmpool pool on first use, and each graph-pool id one of
//! its own; the caller's streams become vmpool streams; configuration comes
//! from the environment ([`config::Config`], README.md's "PyTorch" section).
//! The Python package checks [`vmpool_version`], [`vmpool_abi`] and
//! [`vmpool_stats_size`] at load, and turns [`vmpool_history`] (recorded
//! after [`vmpool_record_history`]) into PyTorch's memory snapshots.
//!
//! A C caller can only get NULL or -1 back, so every failure is logged
//! with its reason at level error (through `tracing`, to stderr, filtered
//! by `VMPOOL_LOG`, default `warn`: every filter but `off` shows errors).
//! A library that cannot start (a bad setting, no driver) says so on
//! stderr whatever the filter. A free of a pointer vmpool does not own
//! changes nothing and is counted; the first ones are logged in full, then
//! only a count (`refusals`). Nothing a caller passes is dereferenced but
//! the buffers [`vmpool_snapshot`] and [`vmpool_history`] fill. Panics are
//! caught at this boundary.
//!
//! This file and `mem_pool_exports` are the only places outside `vmm`
//! with `unsafe` code: the exported symbols, wrapping the caller's stream handles
//! (`Backend::borrow_stream`), and filling the caller's buffers. Everything
//! else is safe: the calls in [`shim`], the settings in [`config`], the
//! memory history in [`history`], the pointer and stream tables in
//! `pointers` and `streams`; graph pools are the library's
//! ([`vmpool::GraphPools`]).

mod call_error;
pub mod config;
pub mod history;
mod pointers;
mod refusals;
pub mod shim;
mod stats;
mod streams;

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use vmpool::vmm::cuda::Cuda;
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::Backend;
use vmpool::{GraphPoolId, MemPoolId};

use self::config::{BackendChoice, Config};
use self::history::History;
use self::shim::{CallError, Shim};
pub use self::stats::VmpoolStats;

/// The library's one state, made by the first call.
enum Global {
    Cuda(Shim<Cuda>),
    Host(Shim<Host>),
}

/// Runs `$body` with `$shim` bound to the global shim of whichever backend.
macro_rules! with_shim {
    ($global:expr, $shim:ident => $body:expr) => {
        match $global {
            Global::Cuda($shim) => $body,
            Global::Host($shim) => $body,
        }
    };
}

static GLOBAL: OnceLock<Result<Global, String>> = OnceLock::new();

/// The memory history ([`vmpool_record_history`]), off until asked for.
static HISTORY: History = History::new();

/// Runs `f` on the global state while the history records, catching its
/// panics: recording never fails the call it records.
fn recording(f: impl FnOnce(&Global)) {
    if !HISTORY.is_on() {
        return;
    }
    if let Some(global) = global() {
        let _ = catch_unwind(AssertUnwindSafe(|| f(global)));
    }
}

/// Logs to stderr through `filter` (`VMPOOL_LOG`, checked by
/// [`Config`]), in colour only on a terminal.
fn init_logging(filter: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // The host program may have a subscriber already; then it is used.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Wraps the caller's stream handle.
fn borrow<B: Backend>(
    backend: &B,
    device: vmpool::vmm::DeviceId,
    handle: usize,
) -> vmpool::vmm::Result<B::Stream> {
    // SAFETY: the handle is the caller's stream of `device` (vmpool.h
    // states the contract: a stream of the device's primary context, alive
    // while vmpool may order work on it, as PyTorch's streams are); vmm
    // refuses the per-thread default stream.
    unsafe { backend.borrow_stream(device, handle) }
}

fn open(config: Config) -> Result<Global, String> {
    let global = match config.backend {
        BackendChoice::Cuda => {
            let cuda = Cuda::new().map_err(|e| e.to_string())?;
            Global::Cuda(Shim::new(cuda, config, borrow::<Cuda>).map_err(|e| e.to_string())?)
        }
        BackendChoice::Host => {
            let host = Host::new(HostConfig {
                devices: config.host_devices,
                memory_per_device: usize::try_from(config.host_memory)
                    .map_err(|e| e.to_string())?,
                ..HostConfig::default()
            })
            .map_err(|e| e.to_string())?;
            Global::Host(Shim::new(host, config, borrow::<Host>).map_err(|e| e.to_string())?)
        }
    };
    Ok(global)
}

/// The global state, opened on first use; `None` when it could not be
/// opened, which is said once on stderr, whatever `VMPOOL_LOG` filters.
fn global() -> Option<&'static Global> {
    GLOBAL
        .get_or_init(|| {
            let opened = Config::from_env()
                .map_err(|e| e.to_string())
                .and_then(|config| {
                    init_logging(&config.log);
                    open(config)
                });
            match &opened {
                Ok(g) => {
                    let config = with_shim!(g, s => s.config().clone());
                    tracing::info!(?config, "vmpool: ready");
                }
                Err(err) => eprintln!("vmpool: cannot start: {err}"),
            }
            opened
        })
        .as_ref()
        .ok()
}

/// Runs `f` on the global state, logging its error or panic under `call`;
/// `failed` when it has none.
fn call<T>(call: &str, failed: T, f: impl FnOnce(&Global) -> Result<T, CallError>) -> T {
    let Some(global) = global() else {
        return failed;
    };
    match catch_unwind(AssertUnwindSafe(|| f(global))) {
        Ok(Ok(value)) => value,
        // Counted, and said in a later count (`refusals`).
        Ok(Err(CallError::Unlogged)) => failed,
        Ok(Err(err)) => {
            tracing::error!("vmpool: {call}: {err}");
            failed
        }
        Err(_) => {
            tracing::error!("vmpool: {call}: panicked (a bug in vmpool; please report it)");
            failed
        }
    }
}

/// Allocates `size` bytes on `device` for use in stream order on `stream`
/// (PyTorch's `alloc_fn`). NULL for zero bytes, and on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let ptr = call(
        "alloc",
        0,
        |g| with_shim!(g, s => s.alloc(size as i64, i64::from(device), stream as usize)),
    );
    recording(|g| {
        let size = u64::try_from(size).unwrap_or(0);
        with_shim!(g, s => HISTORY.allocated(s, i64::from(device), ptr, size, stream as u64));
    });
    ptr as *mut c_void
}

/// Frees `ptr` in stream order on `stream` (PyTorch's `free_fn`). NULL is
/// ignored; a pointer vmpool did not hand out is refused, counted and
/// logged (the first ones in full, then a count). A `size` other than the
/// allocation's, when not negative, is logged as a warning and the
/// allocation is freed all the same.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    call(
        "free",
        (),
        |g| with_shim!(g, s => s.free(ptr as u64, size as i64, i64::from(device), stream as usize)),
    );
    recording(|g| {
        let (ptr, device) = (ptr as u64, i64::from(device));
        with_shim!(g, s => HISTORY.freed(s, device, ptr, size as i64, stream as u64));
    });
}

/// Notes that work queued on `stream` may use `ptr` until it is freed
/// (PyTorch's `record_stream_fn`): its free then makes the freeing stream
/// wait for that work first. A pointer vmpool does not hold live is
/// logged and changes nothing.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    call(
        "record_stream",
        (),
        |g| with_shim!(g, s => s.record_stream(ptr as u64, stream as usize)),
    )
}

/// PyTorch's id of a CUDA graph's private pool (`c10::cuda::MempoolId_t`,
/// a pair of 64-bit ids), passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct VmpoolMempoolId {
    pub first: u64,
    pub second: u64,
}

impl From<VmpoolMempoolId> for GraphPoolId {
    fn from(id: VmpoolMempoolId) -> Self {
        GraphPoolId::new(id.first, id.second)
    }
}

impl From<VmpoolMempoolId> for MemPoolId {
    fn from(id: VmpoolMempoolId) -> Self {
        MemPoolId::new(id.first, id.second)
    }
}

/// Opens the private pool `pool` of a CUDA graph about to be captured on
/// `device`: until [`vmpool_end_allocate_to_pool`], allocations on a
/// capturing stream come from it (PyTorch's `beginAllocateToPool`). For a
/// memory pool [`vmpool_mem_pool_create`] made, puts the calling thread in
/// it instead (`torch.cuda.use_mem_pool`). The third argument is PyTorch's
/// filter, a C++ object vmpool neither reads nor calls: it asks the driver
/// whether the stream is capturing, or compares the calling thread.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_begin_allocate_to_pool(
    device: c_int,
    pool: VmpoolMempoolId,
    _filter: *const c_void,
) {
    let device = i64::from(device);
    call("begin_allocate_to_pool", (), |g| {
        with_shim!(g, s => if s.is_mem_pool(device, pool.into())? {
            s.enter_mem_pool(device, pool.into())
        } else {
            s.begin_graph_pool(device, pool.into())
        })
    });
}

/// Closes `pool` at the end of its capture (PyTorch's `endAllocateToPool`);
/// for a memory pool, takes the calling thread out of it.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_end_allocate_to_pool(device: c_int, pool: VmpoolMempoolId) {
    let device = i64::from(device);
    call("end_allocate_to_pool", (), |g| {
        with_shim!(g, s => if s.is_mem_pool(device, pool.into())? {
            s.leave_mem_pool(device, pool.into())
        } else {
            s.end_graph_pool(device, pool.into())
        })
    });
}

/// A graph that captured into `pool` is gone (PyTorch's `releasePool`):
/// once every such graph is, the pool and its memory go when its last
/// allocation is freed. For a memory pool (`use_mem_pool` ends with this
/// call) nothing: it goes at [`vmpool_mem_pool_release`].
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_release_pool(device: c_int, pool: VmpoolMempoolId) {
    let device = i64::from(device);
    call("release_pool", (), |g| {
        with_shim!(g, s => if s.is_mem_pool(device, pool.into())? {
            Ok(())
        } else {
            s.release_graph_pool(device, pool.into())
        })
    });
}

/// Waits for every stream vmpool has seen on `device`, makes their frees
/// reusable everywhere, trims the pool to its release threshold, and
/// forgets the streams (adopted again at their next use, so that a
/// destroyed stream's handle can come back as another stream). 0 on
/// success, -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_synchronize(device: c_int) -> c_int {
    let rc = call(
        "synchronize",
        -1,
        |g| with_shim!(g, s => s.synchronize(i64::from(device)).map(|()| 0)),
    );
    recording(|g| with_shim!(g, s => HISTORY.remapped(s, i64::from(device))));
    rc
}

/// Releases unused physical memory of `device`'s pool down to `keep`
/// bytes (frees still pending on a stream count as used until
/// [`vmpool_synchronize`]). 0 on success, -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_trim(device: c_int, keep: u64) -> c_int {
    let rc = call(
        "trim",
        -1,
        |g| with_shim!(g, s => s.trim(i64::from(device), keep).map(|()| 0)),
    );
    recording(|g| with_shim!(g, s => HISTORY.remapped(s, i64::from(device))));
    rc
}

/// Returns every device's unused memory: waits for the streams vmpool has
/// seen (and forgets them, as [`vmpool_synchronize`] does), then trims
/// each device's pool to nothing unused (PyTorch's
/// `torch.cuda.empty_cache`, which `vmpool.torch.install` hooks). Graph
/// pools keep theirs for their graphs. Failures are logged.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_empty_cache() {
    call("empty_cache", (), |g| with_shim!(g, s => s.empty_cache()));
    for device in HISTORY.devices() {
        recording(|g| with_shim!(g, s => HISTORY.remapped(s, device)));
    }
}

/// What [`vmpool_sleep`] at level 1 does with each device pool's bytes:
/// `keep` non-zero keeps them in host memory until [`vmpool_wake`], zero
/// (the default) drops them. 0, or -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_set_retention(keep: c_int) -> c_int {
    call(
        "set_retention",
        -1,
        |g| with_shim!(g, s => s.set_retention(keep != 0).map(|()| 0)),
    )
}

/// Gives every device pool's memory back, every pointer into it staying
/// valid: level 1 keeps the bytes of pools whose retention keeps them
/// ([`vmpool_set_retention`]), level 2 keeps nothing. Waits for the
/// streams vmpool has seen first. Until [`vmpool_wake`], allocations
/// return NULL and frees are refused (logged). Graph pools stay awake. 0,
/// or -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_sleep(level: c_int) -> c_int {
    call(
        "sleep",
        -1,
        |g| with_shim!(g, s => s.sleep(i64::from(level)).map(|()| 0)),
    )
}

/// Gets every device pool ready for a [`vmpool_sleep`] at the copy's
/// speed: a sleep that keeps every live byte, then a wake, so that each
/// allocation's memory comes back as few chunks, and the next sleep has
/// few to release (a pool under 2 GiB grows by 2 MiB chunks, which the
/// driver releases more slowly than their bytes copy). Pins host memory for
/// the live bytes, as [`vmpool_reserve_host`]. Waits for the streams
/// vmpool has seen first; refused during a graph capture. 0, or -1 on
/// failure (logged; a pool the device then lacks memory for stays asleep,
/// to be woken by [`vmpool_wake`]).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_prepare_sleep() -> c_int {
    call(
        "prepare_sleep",
        -1,
        |g| with_shim!(g, s => s.prepare_sleep().map(|()| 0)),
    )
}

/// Brings the memory of every sleeping device pool back at the same
/// addresses, the kept bytes restored. A pool the device lacks memory for
/// stays asleep, its bytes on the host, to be woken again (the log says
/// how many bytes it needs). 0, or -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_wake() -> c_int {
    call("wake", -1, |g| with_shim!(g, s => s.wake().map(|()| 0)))
}

/// Makes `device`'s pool hold at least `bytes` of page-locked host memory
/// for its next [`vmpool_sleep`], which then pins none: pinning is most of
/// a first sleep's time. The memory stays until [`vmpool_release_host`].
/// Refused while the pool sleeps with bytes kept there. 0, or -1 on
/// failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_reserve_host(device: c_int, bytes: u64) -> c_int {
    call(
        "reserve_host",
        -1,
        |g| with_shim!(g, s => s.reserve_host(i64::from(device), bytes).map(|()| 0)),
    )
}

/// Frees the page-locked host memory `device`'s pool keeps from one
/// [`vmpool_sleep`] to the next (the next sleep that keeps bytes pins it
/// again). Returns the bytes freed, or -1 on failure (logged; refused while
/// the pool sleeps with bytes kept there).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_release_host(device: c_int) -> i64 {
    call(
        "release_host",
        -1,
        |g| with_shim!(g, s => s.release_host(i64::from(device)).map(|bytes| bytes as i64)),
    )
}

/// Limits `device`'s pool to `fraction` (in (0, 1]) of the device's memory:
/// growth past it fails as out of memory (PyTorch's
/// `torch.cuda.set_per_process_memory_fraction`, which
/// `vmpool.torch.install` hooks). A bad fraction is logged and changes
/// nothing.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_set_memory_fraction(fraction: f64, device: c_int) {
    call(
        "set_memory_fraction",
        (),
        |g| with_shim!(g, s => s.set_memory_fraction(fraction, i64::from(device))),
    );
}

/// Marks the end of a step of a program that repeats its work (a training
/// step, a serving iteration) on `device`'s pool: once steps repeat, the
/// pool serves them from a layout, without driver calls (Note [Step
/// layouts] in docs/DESIGN.md). 0, or -1 on failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_mark_step(device: c_int) -> c_int {
    call(
        "mark_step",
        -1,
        |g| with_shim!(g, s => s.mark_step(i64::from(device)).map(|()| 0)),
    )
}

/// Marks the end of a step on `device`'s pool at its next allocation, so
/// that the frees until then belong to the step ending: for a hook that
/// runs before a step's last frees (`vmpool.torch.install()` calls it after
/// each optimizer step; the gradients are freed after it). 0, or -1 on
/// failure (logged).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_mark_step_at_next_alloc(device: c_int) -> c_int {
    call(
        "mark_step_at_next_alloc",
        -1,
        |g| with_shim!(g, s => s.mark_step_at_next_alloc(i64::from(device)).map(|()| 0)),
    )
}

/// Resets the reserved and used high-water marks to their current values.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_reset_peaks(device: c_int) -> c_int {
    call(
        "reset_peaks",
        -1,
        |g| with_shim!(g, s => s.reset_peaks(i64::from(device)).map(|()| 0)),
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn vmpool_stats(device: c_int) -> VmpoolStats {
    call(
        "stats",
        VmpoolStats::default(),
        |g| with_shim!(g, s => s.figures(i64::from(device)).map(VmpoolStats::from)),
    )
}

/// Writes the pool's address-space dump to stderr. 0 on success (also
/// when the device has no pool yet), -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_print_snapshot(device: c_int) -> c_int {
    call("print_snapshot", -1, |g| {
        with_shim!(g, s => s.snapshot(i64::from(device))).map(|dump| {
            eprintln!(
                "{}",
                dump.as_deref()
                    .unwrap_or("vmpool: no pool on this device yet")
            );
            0
        })
    })
}

/// Copies the pool's address-space dump (what [`vmpool_print_snapshot`]
/// writes) into `buf`, at most `len - 1` bytes and a NUL, so that a caller
/// can show it where it likes. Returns the dump's full length in bytes
/// (without the NUL: call again with a larger buffer when it is not less
/// than `len`), 0 when the device has no pool yet, -1 on failure (logged).
/// `buf` may be NULL when `len` is 0.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_snapshot(device: c_int, buf: *mut std::ffi::c_char, len: usize) -> isize {
    let dump = call("snapshot", None, |g| {
        with_shim!(g, s => s.snapshot(i64::from(device))).map(|dump| Some(dump.unwrap_or_default()))
    });
    let Some(dump) = dump else {
        return -1;
    };
    copy_out(&dump, buf, len)
}

/// Copies `text` into the caller's `buf` of `len` bytes, cut to `len - 1`
/// bytes and a NUL; returns its full length.
fn copy_out(text: &str, buf: *mut std::ffi::c_char, len: usize) -> isize {
    let bytes = text.as_bytes();
    if !buf.is_null() && len > 0 {
        let n = bytes.len().min(len - 1);
        // SAFETY: vmpool.h's contract: `buf` points to `len` writable
        // bytes that nothing else uses during the call; `n + 1 <= len`.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), n + 1) };
        out[..n].copy_from_slice(&bytes[..n]);
        out[n] = 0;
    }
    isize::try_from(bytes.len()).unwrap_or(isize::MAX)
}

/// Starts (`enabled` non-zero) or stops recording the memory history: a
/// ring of the last `max_entries` allocations, frees, refusals, and maps
/// and unmaps of the pools' units, on devices `0..devices` (and any other
/// used while recording). Starting drops what was recorded before;
/// stopping keeps it for [`vmpool_history`]. Off by default.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_record_history(enabled: c_int, max_entries: usize, devices: c_int) {
    if enabled == 0 {
        HISTORY.stop();
        return;
    }
    call("record_history", (), |g| {
        with_shim!(g, s => HISTORY.start(s, max_entries, i64::from(devices)));
        Ok(())
    });
}

/// The memory history and the pools of devices `0..devices` as JSON
/// (`history::History::to_json` gives the shape), copied into `buf` as
/// [`vmpool_snapshot`] copies; -1 when the library could not start.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_history(devices: c_int, buf: *mut std::ffi::c_char, len: usize) -> isize {
    let json = call("history", None, |g| {
        Ok(Some(
            with_shim!(g, s => HISTORY.to_json(s, i64::from(devices))),
        ))
    });
    json.map_or(-1, |json| copy_out(&json, buf, len))
}

/// Writes out the allocation traces being recorded (`VMPOOL_RECORD`): the
/// library's pools live until the process ends, so a caller that records
/// calls this before exiting (the Python package does, at exit). 0 / -1.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_flush_traces() -> c_int {
    call(
        "flush_traces",
        -1,
        |g| with_shim!(g, s => s.flush_traces().map(|()| 0)),
    )
}

/// The backend in use, so a user sees what was measured: "cuda", "host",
/// or "none" when the library could not start (the reason is logged).
/// [`vmpool_backend`] for C callers.
pub fn backend() -> &'static std::ffi::CStr {
    match global() {
        Some(Global::Cuda(_)) => c"cuda",
        Some(Global::Host(_)) => c"host",
        None => c"none",
    }
}

/// [`backend`]'s name, a static C string.
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_backend() -> *const std::ffi::c_char {
    backend().as_ptr()
}

/// The library's version, the package's (`capi/Cargo.toml`), as a C
/// string: the Python package refuses a library of another version.
pub const VERSION: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
) {
    Ok(version) => version,
    Err(_) => panic!("the package version has a NUL byte"),
};

/// The layout of what crosses this interface by value: bumped whenever a
/// struct's fields or a function's signature change, so that a caller
/// built for another layout can refuse the library instead of misreading
/// it.
pub const ABI: u32 = 3;

/// [`VERSION`], a static C string; loads nothing (the library need not
/// start for a caller to check it).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_version() -> *const std::ffi::c_char {
    VERSION.as_ptr()
}

/// [`ABI`].
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_abi() -> u32 {
    ABI
}

/// The size of `vmpool_stats_t` ([`VmpoolStats`]) in bytes, for callers
/// that mirror the struct (the Python package's ctypes fields).
#[unsafe(no_mangle)]
pub extern "C" fn vmpool_stats_size() -> usize {
    std::mem::size_of::<VmpoolStats>()
}

mod mem_pool_exports;
pub use mem_pool_exports::*;
