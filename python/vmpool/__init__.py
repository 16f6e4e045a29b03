"""vmpool: a stream-ordered, defragmenting GPU memory allocator on CUDA's
virtual-memory API, here as a Python package around its C library.

    import vmpool.torch
    vmpool.torch.install()      # PyTorch now allocates through vmpool

`vmpool` itself needs no PyTorch: `stats()`, `summary()`, `snapshot()`,
`empty_cache()`, the memory history (`record_history()`,
`dump_snapshot()`), `sleep()` / `wake()` (with `prepare_sleep()`,
`reserve_host()` / `release_host()`) and the raw `alloc()` / `free()` work on any backend
(VMPOOL_BACKEND=host runs without a GPU). Importing it loads the library
and refuses one of another version (`LibraryMismatchError`).
"""

from ._lib import (
    ABI,
    FIELDS,
    LibraryMismatchError,
    OutOfMemoryError,
    Stats,
    VmpoolError,
    alloc,
    backend,
    device_count,
    dump_snapshot,
    empty_cache,
    free,
    library,
    library_path,
    library_version,
    mark_step,
    memory_snapshot,
    prepare_sleep,
    print_snapshot,
    record_history,
    release_host,
    reserve_host,
    reset_peaks,
    set_retention,
    sleep,
    snapshot,
    stats,
    summary,
    synchronize,
    wake,
)
from ._version import __version__

library()

__all__ = [
    "ABI",
    "FIELDS",
    "LibraryMismatchError",
    "OutOfMemoryError",
    "Stats",
    "VmpoolError",
    "__version__",
    "alloc",
    "backend",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "free",
    "library",
    "library_path",
    "library_version",
    "mark_step",
    "memory_snapshot",
    "prepare_sleep",
    "print_snapshot",
    "record_history",
    "release_host",
    "reserve_host",
    "reset_peaks",
    "set_retention",
    "sleep",
    "snapshot",
    "stats",
    "summary",
    "synchronize",
    "wake",
]
