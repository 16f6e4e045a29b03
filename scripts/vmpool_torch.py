"""vmpool as PyTorch's CUDA allocator.

    import vmpool_torch
    vmpool_torch.install()      # before the first CUDA allocation
    ...
    print(vmpool_torch.stats())  # vmpool's figures for the current device

The library is libvmpool_c.so (`cargo build --release -p vmpool-c`), found
through $VMPOOL_LIB, else beside this file, else in the repository's
target/release/. Its settings (release threshold, chunk size, log filter)
come from the environment: see README.md, "PyTorch", or capi/include/vmpool.h.

The statistics part needs only ctypes, so it also works (and is tested)
without PyTorch, on the host backend (VMPOOL_BACKEND=host).
"""

import atexit
import ctypes
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_FIELDS = [
    "valid",
    "reserved_bytes",
    "reserved_high",
    "used_bytes",
    "used_high",
    "allocations",
    "frees",
    "grows",
    "remaps",
    "bytes_remapped",
    "chunks_created",
    "chunks_released",
    "largest_free_range",
    "pending_bytes",
    "refused_frees",
    "timed_calls",
    "call_nanos",
    "graph_pools",
    "graph_reserved_bytes",
    "timed_frees",
    "free_nanos",
    "grow_nanos",
    "maps",
    "unmaps",
    "same_stream_reuses",
    "frees_merged",
    "frees_completed",
    "events_recorded",
    "waits_inserted",
]


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _FIELDS]


class MempoolId(ctypes.Structure):
    """PyTorch's id of a CUDA graph's private pool (`MempoolId_t`)."""

    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


def library_path():
    """Where libvmpool_c.so is: $VMPOOL_LIB, beside this file, or target/release."""
    env = os.environ.get("VMPOOL_LIB")
    candidates = [Path(env)] if env else []
    candidates += [_HERE / "libvmpool_c.so", _HERE.parent / "target" / "release" / "libvmpool_c.so"]
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        "libvmpool_c.so not found (tried %s); build it with "
        "`cargo build --release -p vmpool-c` or set VMPOOL_LIB" % ", ".join(map(str, candidates))
    )


_lib = None


def library():
    """The loaded library (the same instance PyTorch calls into)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        lib.vmpool_alloc.restype = ctypes.c_void_p
        lib.vmpool_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmpool_free.restype = None
        lib.vmpool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmpool_record_stream.restype = None
        lib.vmpool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.vmpool_begin_allocate_to_pool.restype = None
        lib.vmpool_begin_allocate_to_pool.argtypes = [ctypes.c_int, MempoolId, ctypes.c_void_p]
        for name in ("vmpool_end_allocate_to_pool", "vmpool_release_pool"):
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [ctypes.c_int, MempoolId]
        lib.vmpool_stats.restype = _Stats
        lib.vmpool_stats.argtypes = [ctypes.c_int]
        for name in ("vmpool_synchronize", "vmpool_reset_peaks", "vmpool_print_snapshot"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_int]
        lib.vmpool_trim.restype = ctypes.c_int
        lib.vmpool_trim.argtypes = [ctypes.c_int, ctypes.c_uint64]
        lib.vmpool_backend.restype = ctypes.c_char_p
        lib.vmpool_backend.argtypes = []
        lib.vmpool_flush_traces.restype = ctypes.c_int
        lib.vmpool_flush_traces.argtypes = []
        lib.vmpool_empty_cache.restype = None
        lib.vmpool_empty_cache.argtypes = []
        lib.vmpool_set_memory_fraction.restype = None
        lib.vmpool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        # The pools are never dropped: recorded traces (VMPOOL_RECORD) are
        # written out at exit.
        atexit.register(lib.vmpool_flush_traces)
        _lib = lib
    return _lib


def install():
    """Makes vmpool PyTorch's CUDA allocator. Call it before anything
    allocates CUDA memory (PyTorch refuses the change afterwards).

    It also hooks `Tensor.record_stream`, and the private pools of CUDA
    graphs (`torch.cuda.graph`): without the hooks PyTorch drops those
    calls for a pluggable allocator, and memory would be reused under
    another stream's reads, or under a graph's replays. And
    `torch.cuda.empty_cache()`, which then returns vmpool's unused memory
    on every device, and `torch.cuda.set_per_process_memory_fraction()`,
    which then limits vmpool's pool. PyTorch's memory statistics
    (`torch.cuda.memory_allocated()`, `max_memory_reserved()`,
    `memory_stats()`, `reset_peak_memory_stats()`, ...), which raise for a
    pluggable allocator, then report vmpool's figures."""
    import torch

    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "vmpool_alloc", "vmpool_free")
    lib = library()
    hooks = [
        ("set_record_stream_fn", lib.vmpool_record_stream, "Tensor.record_stream"),
        ("set_begin_allocate_to_pool", lib.vmpool_begin_allocate_to_pool, "CUDA graphs' pools"),
        ("set_end_allocate_to_pool_fn", lib.vmpool_end_allocate_to_pool, "CUDA graphs' pools"),
        ("set_release_pool", lib.vmpool_release_pool, "CUDA graphs' pools"),
        ("set_reset_fn", lib.vmpool_empty_cache, "torch.cuda.empty_cache"),
        ("set_memory_fraction_fn", lib.vmpool_set_memory_fraction, "torch.cuda.set_per_process_memory_fraction"),
    ]
    missing = [(name, what) for name, _, what in hooks if not hasattr(allocator.allocator(), name)]
    if missing:
        raise RuntimeError(
            "this PyTorch cannot pass %s to a pluggable allocator (no %s)"
            % (" and ".join(sorted({w for _, w in missing})), ", ".join(n for n, _ in missing))
        )
    for name, fn, _ in hooks:
        getattr(allocator.allocator(), name)(ctypes.cast(fn, ctypes.c_void_p).value)
    torch.cuda.memory.change_current_allocator(allocator)
    _redirect_torch_statistics(torch)
    return allocator


def _redirect_torch_statistics(torch):
    """PyTorch keeps no statistics for a pluggable allocator: asked for
    them (`torch.cuda.memory_allocated()`, `max_memory_reserved()`,
    `memory_stats()`, `reset_peak_memory_stats()`, ...) it raises. These
    functions all go through `memory_stats_as_nested_dict` and
    `reset_peak_memory_stats` in `torch.cuda.memory`; pointed at vmpool,
    they report the device pool's own figures: allocated and active bytes
    are vmpool's used bytes, reserved bytes its reserved bytes (CUDA
    graphs' pools not included), each with its peak. `memory_summary()`,
    whose table needs figures vmpool does not keep (segments, splits),
    gives vmpool's own summary instead (`summary()`)."""
    memory = torch.cuda.memory

    def index(device):
        return torch.cuda._utils._get_device_index(device, optional=True)

    def memory_stats_as_nested_dict(device=None):
        s = stats(index(device))
        used = {"all": {"current": s["used_bytes"], "peak": s["used_high"]}}
        return {
            "allocated_bytes": used,
            "active_bytes": used,
            "reserved_bytes": {"all": {"current": s["reserved_bytes"], "peak": s["reserved_high"]}},
            "allocation": {"all": {"allocated": s["allocations"], "freed": s["frees"]}},
        }

    def reset_peak_memory_stats(device=None):
        reset_peaks(index(device))

    def memory_summary(device=None, abbreviated=False):
        return summary(index(device))

    for module in (memory, torch.cuda):
        module.memory_stats_as_nested_dict = memory_stats_as_nested_dict
        module.reset_peak_memory_stats = reset_peak_memory_stats
        module.memory_summary = memory_summary


def _device(device):
    if device is not None:
        return int(device)
    import torch

    return torch.cuda.current_device()


def _check(call, rc):
    if rc != 0:
        raise RuntimeError("vmpool_%s failed (the reason is in vmpool's log on stderr)" % call)


def backend():
    """'cuda', 'host', or 'none' when the library could not start."""
    return library().vmpool_backend().decode()


def stats(device=None):
    """vmpool's figures for `device` (default: the current CUDA device) as a dict."""
    device = _device(device)
    s = library().vmpool_stats(device)
    if not s.valid:
        raise RuntimeError("vmpool_stats(%d) failed (see vmpool's log on stderr)" % device)
    return {name: getattr(s, name) for name in _FIELDS if name != "valid"}


def summary(device=None):
    """vmpool's figures for `device` as a few lines of text."""
    device = _device(device)
    s = stats(device)

    def mib(n):
        return "%.1f MiB" % (n / (1 << 20))

    return "\n".join([
        "vmpool on device %d (%s backend)" % (device, backend()),
        "  used        %s (peak %s)" % (mib(s["used_bytes"]), mib(s["used_high"])),
        "  reserved    %s (peak %s); largest free range %s; pending frees %s"
        % (mib(s["reserved_bytes"]), mib(s["reserved_high"]), mib(s["largest_free_range"]), mib(s["pending_bytes"])),
        "  calls       %d allocations, %d frees, %d refused frees"
        % (s["allocations"], s["frees"], s["refused_frees"]),
        "  growth      %d grows; %d chunks created, %d released; %d remaps (%s)"
        % (s["grows"], s["chunks_created"], s["chunks_released"], s["remaps"], mib(s["bytes_remapped"])),
        "  graph pools %d (%s reserved)" % (s["graph_pools"], mib(s["graph_reserved_bytes"])),
    ])


def reset_peaks(device=None):
    _check("reset_peaks", library().vmpool_reset_peaks(_device(device)))


def synchronize(device=None):
    """Waits for the streams vmpool has seen, frees what they freed, trims
    the pool to its release threshold, and forgets the streams (adopted
    again at their next use)."""
    _check("synchronize", library().vmpool_synchronize(_device(device)))


def empty_cache(device=None):
    """Like torch.cuda.empty_cache(): returns all unused memory to the device."""
    device = _device(device)
    synchronize(device)
    _check("trim", library().vmpool_trim(device, 0))


def print_snapshot(device=None):
    """Writes the pool's address-space map to stderr."""
    _check("print_snapshot", library().vmpool_print_snapshot(_device(device)))
