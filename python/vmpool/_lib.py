"""libvmpool_c.so through ctypes: finding and loading it, checking that it
is the library this package was written for, and the calls that need no
PyTorch (statistics, trimming, the address-space map, raw allocations).

The library is found through $VMPOOL_LIB, else beside this file (where the
wheel puts it), else beside the package's folder (a copy of the package
with the library next to it, as the GPU bundle has), else in the source
tree's target/release/ (after `cargo build --release -p vmpool-c`).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import os
import pickle
import sys
import threading
import warnings
from pathlib import Path

from ._version import __version__

#: The layout of what crosses the C interface by value (`vmpool_abi()`):
#: the library's must be this one.
ABI = 3
LIBRARY_NAME = "libvmpool_c.so"
_HERE = Path(__file__).resolve().parent


class VmpoolError(RuntimeError):
    """A vmpool call failed; vmpool's log on stderr says why."""


class LibraryMismatchError(ImportError):
    """The library found is not the one this package was written for: its
    version, or the layout of its structs, differ."""


class OutOfMemoryError(MemoryError):
    """vmpool could not allocate (out of device memory, or over the limit
    set by `set_per_process_memory_fraction`). With PyTorch loaded,
    `alloc()` raises `torch.OutOfMemoryError` instead, as PyTorch does."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """A device's figures (`vmpool_stats_t` in capi/include/vmpool.h, in
    the same order). Bytes are counted as the pool rounds them."""

    reserved_bytes: int
    """Physical bytes the device's pool holds (graph pools' not included)."""
    reserved_high: int
    used_bytes: int
    """Bytes of live allocations."""
    used_high: int
    allocations: int
    frees: int
    grows: int
    remaps: int
    bytes_remapped: int
    chunks_created: int
    chunks_released: int
    largest_free_range: int
    pending_bytes: int
    """Freed in stream order, not yet known to be free for every stream."""
    refused_frees: int
    """Frees of pointers vmpool did not hand out, or not any more."""
    timed_calls: int
    call_nanos: int
    graph_pools: int
    graph_reserved_bytes: int
    timed_frees: int
    free_nanos: int
    grow_nanos: int
    maps: int
    unmaps: int
    same_stream_reuses: int
    frees_merged: int
    frees_completed: int
    events_recorded: int
    waits_inserted: int
    mem_pools: int
    """Memory pools (`torch.cuda.MemPool` under vmpool), released ones
    with live allocations included."""
    mem_pool_reserved_bytes: int
    """Physical bytes the memory pools hold (not in `reserved_bytes`)."""
    mem_pool_used_bytes: int
    """Bytes of the memory pools' live allocations (not in `used_bytes`)."""
    host_bytes: int
    """Page-locked host memory the pool holds for sleeping: the kept bytes
    while asleep, the buffer the next `sleep()` reuses while awake
    (`reserve_host()`, `release_host()`)."""
    steps: int
    """Steps marked (`mark_step()`)."""
    step_layouts: int
    """Layouts made of repeating steps."""
    planned: int
    """Allocations served from a step layout's slot, without the heap."""
    missed: int
    """Allocations that wanted their slot and went to the heap."""
    step_region_bytes: int
    """Bytes of the layouts' regions (in `reserved_bytes`)."""

    def __getitem__(self, name: str) -> int:
        """`stats["used_bytes"]`, as the dict earlier versions returned."""
        return getattr(self, name)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


FIELDS = tuple(field.name for field in dataclasses.fields(Stats))


class _CStats(ctypes.Structure):
    _fields_ = [("valid", ctypes.c_uint64)] + [(name, ctypes.c_uint64) for name in FIELDS]


class MempoolId(ctypes.Structure):
    """PyTorch's id of a private pool (`MempoolId_t`)."""

    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


def library_path() -> str:
    """Where libvmpool_c.so is: $VMPOOL_LIB, in this package, beside it, or
    the source tree's target/release/."""
    env = os.environ.get("VMPOOL_LIB")
    candidates = [Path(env)] if env else []
    candidates += [
        _HERE / LIBRARY_NAME,
        _HERE.parent / LIBRARY_NAME,
        _HERE.parent.parent / "target" / "release" / LIBRARY_NAME,
    ]
    for path in candidates:
        if path.is_file():
            return str(path)
    tried = ", ".join(map(str, candidates))
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found (tried {tried}): reinstall the wheel "
        "(pip install --force-reinstall vmpool-*.whl), or build the library "
        "(cargo build --release -p vmpool-c) or set VMPOOL_LIB"
    )


def _signatures(lib: ctypes.CDLL) -> None:
    c = ctypes
    table = {
        "vmpool_alloc": (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
        "vmpool_free": (None, [c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p]),
        "vmpool_record_stream": (None, [c.c_void_p, c.c_void_p]),
        "vmpool_begin_allocate_to_pool": (None, [c.c_int, MempoolId, c.c_void_p]),
        "vmpool_end_allocate_to_pool": (None, [c.c_int, MempoolId]),
        "vmpool_release_pool": (None, [c.c_int, MempoolId]),
        "vmpool_mem_pool_create": (c.c_int, [c.c_int, MempoolId]),
        "vmpool_mem_pool_release": (c.c_int, [c.c_int, MempoolId, c.c_int]),
        "vmpool_mem_pool_stats": (_CStats, [c.c_int, MempoolId]),
        "vmpool_stats": (_CStats, [c.c_int]),
        "vmpool_synchronize": (c.c_int, [c.c_int]),
        "vmpool_reset_peaks": (c.c_int, [c.c_int]),
        "vmpool_mark_step": (c.c_int, [c.c_int]),
        "vmpool_mark_step_at_next_alloc": (c.c_int, [c.c_int]),
        "vmpool_print_snapshot": (c.c_int, [c.c_int]),
        "vmpool_snapshot": (c.c_ssize_t, [c.c_int, c.c_char_p, c.c_size_t]),
        "vmpool_trim": (c.c_int, [c.c_int, c.c_uint64]),
        "vmpool_backend": (c.c_char_p, []),
        "vmpool_flush_traces": (c.c_int, []),
        "vmpool_empty_cache": (None, []),
        "vmpool_set_memory_fraction": (None, [c.c_double, c.c_int]),
        "vmpool_record_history": (None, [c.c_int, c.c_size_t, c.c_int]),
        "vmpool_history": (c.c_ssize_t, [c.c_int, c.c_char_p, c.c_size_t]),
        "vmpool_set_retention": (c.c_int, [c.c_int]),
        "vmpool_sleep": (c.c_int, [c.c_int]),
        "vmpool_wake": (c.c_int, []),
        "vmpool_prepare_sleep": (c.c_int, []),
        "vmpool_reserve_host": (c.c_int, [c.c_int, c.c_uint64]),
        "vmpool_release_host": (c.c_int64, [c.c_int]),
    }
    for name, (restype, argtypes) in table.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            # An older build let in by VMPOOL_ALLOW_MISMATCH: what it lacks
            # fails when called.
            continue
        fn.restype = restype
        fn.argtypes = argtypes


def check_library(lib: ctypes.CDLL, path: str) -> None:
    """Refuses (`LibraryMismatchError`) a library of another version, or
    whose structs are laid out differently, before anything reads them.
    VMPOOL_ALLOW_MISMATCH=1 turns the refusal into a warning, for A/B runs
    against an older build whose stats struct is known to match."""
    problems = []
    try:
        version_fn, abi_fn, size_fn = lib.vmpool_version, lib.vmpool_abi, lib.vmpool_stats_size
    except AttributeError:
        problems.append("it has no version (older than this check)")
    else:
        version_fn.restype, version_fn.argtypes = ctypes.c_char_p, []
        abi_fn.restype, abi_fn.argtypes = ctypes.c_uint32, []
        size_fn.restype, size_fn.argtypes = ctypes.c_size_t, []
        version = (version_fn() or b"?").decode()
        if version != __version__:
            problems.append(f"it is version {version}, this package {__version__}")
        if abi_fn() != ABI:
            problems.append(f"its interface layout is {abi_fn()}, this package's {ABI}")
        if size_fn() != ctypes.sizeof(_CStats):
            problems.append(f"its stats struct has {size_fn()} bytes, this package's {ctypes.sizeof(_CStats)}")
    if not problems:
        return
    message = (
        f"vmpool {__version__} ({_HERE}) cannot use {path}: {'; '.join(problems)}. "
        "Reinstall both from one build: pip install --force-reinstall vmpool-*.whl "
        "(and unset VMPOOL_LIB), or rebuild the library from this source tree "
        "(cargo build --release -p vmpool-c)."
    )
    if os.environ.get("VMPOOL_ALLOW_MISMATCH") == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise LibraryMismatchError(message)


def _flush_traces(lib: ctypes.CDLL) -> None:
    if os.environ.get("VMPOOL_RECORD"):
        lib.vmpool_flush_traces()


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The loaded, checked library: the same instance PyTorch calls into."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            lib = ctypes.CDLL(path)
            check_library(lib, path)
            _signatures(lib)
            # The pools are never dropped: traces being recorded
            # (VMPOOL_RECORD) are written out at exit. Only then: the call
            # would start a library nothing used.
            atexit.register(_flush_traces, lib)
            _lib = lib
    return _lib


def library_version() -> str:
    """The loaded library's version (equal to `vmpool.__version__`)."""
    return library().vmpool_version().decode()


def _check(call: str, rc: int) -> None:
    if rc != 0:
        raise VmpoolError(f"vmpool_{call} failed (the reason is in vmpool's log on stderr)")


def backend() -> str:
    """'cuda', 'host', or 'none' when the library could not start."""
    return library().vmpool_backend().decode()


def stats(device: int = 0) -> Stats:
    """`device`'s figures. Raises `VmpoolError` for a device vmpool cannot
    use, or when the library could not start."""
    s = library().vmpool_stats(device)
    if not s.valid:
        raise VmpoolError(f"vmpool_stats({device}) failed (the reason is in vmpool's log on stderr)")
    return Stats(*(getattr(s, name) for name in FIELDS))


#: `vmpool_mem_pool_release`'s `when` (vmpool.h).
RELEASE_NOW = 0
RELEASE_WITH_LAST_FREE = 1


def mem_pool_create(device: int, pool: tuple[int, int]) -> None:
    """Makes `pool` (a `MempoolId_t` pair) a memory pool of `device`: the
    graph-pool hooks then put a thread in it (`use_mem_pool`). Raises
    `VmpoolError` when refused (an id that exists, or a graph pool's)."""
    _check("mem_pool_create", library().vmpool_mem_pool_create(device, MempoolId(*pool)))


def mem_pool_release(device: int, pool: tuple[int, int], when: int = RELEASE_NOW) -> bool:
    """Lets memory pool `pool` go with its memory: now (`RELEASE_NOW`,
    refused while an allocation of it is live) or with its last free
    (`RELEASE_WITH_LAST_FREE`). True when it is gone, False when it goes
    with its last free; raises `VmpoolError` when refused."""
    rc = library().vmpool_mem_pool_release(device, MempoolId(*pool), when)
    if rc < 0:
        raise VmpoolError(f"vmpool_mem_pool_release{pool} failed (the reason is in vmpool's log on stderr)")
    return rc == 0


def mem_pool_stats(device: int, pool: tuple[int, int]) -> Stats:
    """Memory pool `pool`'s own figures (the pool fields of `Stats`; the
    rest 0). Raises `VmpoolError` when there is no such pool."""
    s = library().vmpool_mem_pool_stats(device, MempoolId(*pool))
    if not s.valid:
        raise VmpoolError(f"vmpool_mem_pool_stats{pool} failed: no such memory pool")
    return Stats(*(getattr(s, name) for name in FIELDS))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def summary(device: int = 0) -> str:
    """`device`'s figures as a few lines of text."""
    s = stats(device)
    return "\n".join(
        [
            f"vmpool on device {device} ({backend()} backend)",
            f"  used        {_mib(s.used_bytes)} (peak {_mib(s.used_high)})",
            f"  reserved    {_mib(s.reserved_bytes)} (peak {_mib(s.reserved_high)}); "
            f"largest free range {_mib(s.largest_free_range)}; pending frees {_mib(s.pending_bytes)}",
            f"  calls       {s.allocations} allocations, {s.frees} frees, {s.refused_frees} refused frees",
            f"  growth      {s.grows} grows; {s.chunks_created} chunks created, "
            f"{s.chunks_released} released; {s.remaps} remaps ({_mib(s.bytes_remapped)})",
            f"  graph pools {s.graph_pools} ({_mib(s.graph_reserved_bytes)} reserved)",
            f"  host        {_mib(s.host_bytes)} page-locked for sleeping",
        ]
    )


def _text(call: str, fn, *args) -> str:
    """What `fn(*args, buf, len)` copies out, with a buffer large enough."""
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < 0:
            raise VmpoolError(f"vmpool_{call} failed (the reason is in vmpool's log on stderr)")
        if n < size:
            return buf.value.decode()
        size = n + 1


def snapshot(device: int = 0) -> str:
    """`device`'s address-space map (arenas, mapped units, free ranges,
    spare chunks) as text; empty before the device's first allocation."""
    return _text("snapshot", library().vmpool_snapshot, device)


def device_count() -> int:
    """The devices the history covers: PyTorch's count when it is loaded,
    the host backend's, else 16 (devices that do not exist are skipped)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    if backend() == "host":
        return int(os.environ.get("VMPOOL_HOST_DEVICES", "1"))
    return 16


def record_history(enabled: bool = True, max_entries: int = 100_000, devices: int | None = None) -> None:
    """Starts (afresh) or stops recording the memory history that
    `memory_snapshot()` and `dump_snapshot()` give: the last `max_entries`
    allocations, frees, refusals, and maps and unmaps of the pool's units,
    with addresses, sizes, streams and times (no Python stacks). Off by
    default; stopping keeps what was recorded."""
    if max_entries < 1:
        raise ValueError(f"max_entries must be at least 1, not {max_entries}")
    count = device_count() if devices is None else devices
    library().vmpool_record_history(1 if enabled else 0, max_entries, count)


def _blocks(start: int, end: int, free: list, live: list) -> list[dict]:
    """The blocks of the segment [start, end): free ranges inactive, the
    allocations recording saw active with their sizes, and the used bytes
    between them (allocations older than the recording) active too."""
    marks = [(s, s + n, "inactive", n) for s, n in free]
    marks += [(a, a + n, "active_allocated", n) for a, n, _ in live]
    blocks, cursor = [], start
    for s, e, state, requested in sorted(m for m in marks if m[1] > start and m[0] < end):
        s, e = max(s, cursor), min(e, end)
        if e <= s:
            continue
        if s > cursor:
            blocks.append(
                {
                    "address": cursor,
                    "size": s - cursor,
                    "requested_size": s - cursor,
                    "state": "active_allocated",
                    "frames": [],
                }
            )
        size = e - s
        blocks.append(
            {
                "address": s,
                "size": size,
                "requested_size": min(requested, size) if state != "inactive" else 0,
                "state": state,
                "frames": [],
            }
        )
        cursor = e
    if cursor < end:
        blocks.append(
            {
                "address": cursor,
                "size": end - cursor,
                "requested_size": end - cursor,
                "state": "active_allocated",
                "frames": [],
            }
        )
    return blocks


def _segments(device: dict) -> list[dict]:
    """PyTorch's segments for one device: runs of adjacent mapped units."""
    runs: list[list[int]] = []
    for va, size in sorted(device["units"]):
        if runs and runs[-1][1] == va:
            runs[-1][1] = va + size
        else:
            runs.append([va, va + size])
    segments = []
    for start, end in runs:
        blocks = _blocks(start, end, device["free"], device["live"])
        active = [b for b in blocks if b["state"] == "active_allocated"]
        segments.append(
            {
                "device": device["device"],
                "address": start,
                "total_size": end - start,
                "allocated_size": sum(b["size"] for b in active),
                "active_size": sum(b["size"] for b in active),
                "requested_size": sum(b["requested_size"] for b in active),
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": True,
                "frames": [],
                "blocks": blocks,
            }
        )
    return segments


def memory_snapshot(devices: int | None = None) -> dict:
    """The pools and the recorded history in the shape of PyTorch's
    `torch.cuda.memory._snapshot()`: `segments` (runs of mapped units, with
    their blocks) and `device_traces` (alloc, free_requested,
    free_completed, segment_map, segment_unmap, oom), which
    `torch.cuda._memory_viz` and the memory_viz page read."""
    count = device_count() if devices is None else devices
    data = json.loads(_text("history", library().vmpool_history, count))
    traces: list[list[dict]] = [[] for _ in range(count)]
    for action, device, addr, size, stream, time_us in data["entries"]:
        while device >= len(traces):
            traces.append([])
        entry = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us, "frames": []}
        if action == "oom":
            entry["device_free"] = 0
        traces[device].append(entry)
    segments = [segment for device in data["devices"] for segment in _segments(device)]
    return {"segments": segments, "device_traces": traces, "allocator_settings": {"allocator": "vmpool"}}


def dump_snapshot(path: str = "dump_snapshot.pickle", devices: int | None = None) -> None:
    """Writes `memory_snapshot()` to `path` as PyTorch's `_dump_snapshot`
    does: a pickle for `python -m torch.cuda._memory_viz` or memory_viz."""
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(devices), f)


def print_snapshot(device: int = 0) -> None:
    """Writes `device`'s address-space map to stderr."""
    _check("print_snapshot", library().vmpool_print_snapshot(device))


def mark_step(device: int = 0) -> None:
    """Marks the end of a step of a program that repeats its work: once
    steps repeat, `device`'s pool serves them from a layout, without driver
    calls (Note [Step layouts] in docs/DESIGN.md)."""
    _check("mark_step", library().vmpool_mark_step(device))


def mark_step_at_next_alloc(device: int = 0) -> None:
    """`mark_step(device)` at the device pool's next allocation, so that the
    frees until then belong to the step ending (after an optimizer's step,
    before its gradients are freed)."""
    _check("mark_step_at_next_alloc", library().vmpool_mark_step_at_next_alloc(device))


def reset_peaks(device: int = 0) -> None:
    """Resets the reserved and used peaks to their current values."""
    _check("reset_peaks", library().vmpool_reset_peaks(device))


def synchronize(device: int = 0) -> None:
    """Waits for the streams vmpool has seen, frees what they freed, trims
    the pool to its release threshold, and forgets the streams (adopted
    again at their next use)."""
    _check("synchronize", library().vmpool_synchronize(device))


def empty_cache(device: int | None = None) -> None:
    """Returns unused memory to the device, as `torch.cuda.empty_cache()`:
    every device's when `device` is None, else that one's."""
    if device is None:
        library().vmpool_empty_cache()
        return
    synchronize(device)
    _check("trim", library().vmpool_trim(device, 0))


def set_retention(keep: bool) -> None:
    """What `sleep(1)` does with the bytes of every device's pool: kept in
    host memory until `wake()` (`keep`), or dropped (the default)."""
    _check("set_retention", library().vmpool_set_retention(int(keep)))


def sleep(level: int = 1) -> None:
    """Gives every device pool's memory back while every pointer into it
    stays valid, as vLLM's sleep mode: level 1 keeps the bytes of pools
    whose retention keeps them (`set_retention(True)`), level 2 keeps
    nothing. Waits for the streams vmpool has seen. Until `wake()`,
    allocations fail and work that touches the memory faults; frees are
    taken, their bytes not copied back. CUDA graphs' pools stay awake."""
    if level not in (1, 2):
        raise ValueError(f"sleep level {level}: 1 or 2")
    _check("sleep", library().vmpool_sleep(level))


def wake() -> None:
    """Maps every sleeping pool's memory back at the same addresses and
    copies the kept bytes back. Raises `VmpoolError` when the device lacks
    the memory; the pool then stays asleep, its bytes on the host, and
    `wake()` can be called again once memory is free."""
    _check("wake", library().vmpool_wake())


def prepare_sleep() -> None:
    """Gets every device pool ready for a `sleep(1)` at the copy's speed: a
    sleep that keeps every live byte, then a wake, after which each
    allocation's memory is few chunks to release (the driver releases many
    small ones more slowly than their bytes copy). Pins host memory for the
    live bytes, as `reserve_host()`. Waits for the streams vmpool has seen.
    Raises `VmpoolError` on failure; should the device then lack memory,
    the pool stays asleep, its bytes on the host, and `wake()` brings it
    back."""
    _check("prepare_sleep", library().vmpool_prepare_sleep())


def reserve_host(nbytes: int, device: int = 0) -> None:
    """Makes `device`'s pool hold at least `nbytes` of page-locked host
    memory for its next `sleep(1)`, which then pins none. Pinning is the
    kernel's work, a few GB/s, and most of a first sleep's time; the memory
    stays with the pool from one sleep to the next until `release_host()`.
    Raises `VmpoolError` while the pool sleeps with bytes kept there."""
    if nbytes < 0:
        raise ValueError(f"reserve_host: {nbytes} bytes")
    _check("reserve_host", library().vmpool_reserve_host(device, nbytes))


def release_host(device: int = 0) -> int:
    """Frees the page-locked host memory `device`'s pool keeps from one
    `sleep()` to the next, and returns its size in bytes; the next sleep
    that keeps bytes pins it again. Raises `VmpoolError` while the pool
    sleeps (that memory holds its bytes then)."""
    freed = library().vmpool_release_host(device)
    if freed < 0:
        raise VmpoolError("vmpool_release_host failed (the reason is in vmpool's log on stderr)")
    return freed


def _out_of_memory(message: str) -> Exception:
    torch = sys.modules.get("torch")
    error = getattr(torch, "OutOfMemoryError", None)
    if isinstance(error, type) and issubclass(error, Exception):
        return error(message)
    return OutOfMemoryError(message)


def alloc(size: int, device: int = 0, stream: int = 0) -> int:
    """`size` bytes on `device` for use in stream order on `stream` (a
    CUstream handle, 0 for the legacy default stream); the address. Raises
    `torch.OutOfMemoryError` (without PyTorch: `vmpool.OutOfMemoryError`)
    when vmpool cannot allocate, as `torch.cuda.caching_allocator_alloc`
    does."""
    if size < 0:
        raise ValueError(f"size must not be negative, not {size}")
    if size == 0:
        return 0
    ptr = library().vmpool_alloc(size, device, stream)
    if not ptr:
        raise _out_of_memory(
            f"vmpool could not allocate {size} bytes on device {device} (vmpool's log on stderr says why)"
        )
    return ptr


def free(ptr: int, device: int = 0, stream: int = 0, size: int = -1) -> None:
    """Frees `ptr` (from `alloc`) in stream order on `stream`; `size`, when
    not negative, is checked against the allocation. A pointer vmpool did
    not hand out changes nothing and is counted in `refused_frees`."""
    library().vmpool_free(ptr, size, device, stream)
