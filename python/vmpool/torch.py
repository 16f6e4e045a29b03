"""vmpool as PyTorch's CUDA allocator.

    import vmpool.torch
    vmpool.torch.install()      # before the first CUDA allocation

    vmpool.torch.record_history()               # then, later:
    vmpool.torch.dump_snapshot("snap.pickle")   # for torch.cuda._memory_viz / memory_viz

    reg = vmpool.torch.register(tensor, group)  # NCCL user-buffer registration
    reg.deregister()                            # once its collectives finished

    pool = torch.cuda.MemPool()                 # vmpool's MemPool, once installed
    with torch.cuda.use_mem_pool(pool):
        weights = torch.empty(...)              # from a vmpool pool of its own
    del weights; pool.release()                 # its memory goes back

or, with no change to the program:

    python -m vmpool.torch train.py ARGS...      (or: vmpool-torch train.py ARGS...)
    python -m vmpool.torch -m package.module ARGS...

The functions here take PyTorch's devices (an index, a `torch.device`, or
None for the current one); `vmpool`'s own take an index.
"""

from __future__ import annotations

import ctypes
import functools
import os
import runpy
import sys
import warnings
from typing import Any, Union

from . import _lib, nccl
from ._iterations import Iterations
from ._lib import LibraryMismatchError, Stats, VmpoolError, library, library_path

__all__ = [
    "LibraryMismatchError",
    "MemPool",
    "Stats",
    "VmpoolError",
    "allocator",
    "dump_snapshot",
    "empty_cache",
    "install",
    "main",
    "mark_step",
    "memory_snapshot",
    "print_snapshot",
    "record_history",
    "register",
    "reset_peaks",
    "snapshot",
    "stats",
    "summary",
    "synchronize",
]

Device = Union[int, str, Any, None]


def _index(device: Device) -> int:
    """PyTorch's device index for `device`: the current device for None."""
    if isinstance(device, int):
        return device
    import torch

    return torch.cuda._utils._get_device_index(device, optional=True)


_allocator: Any = None


def allocator() -> Any:
    """vmpool as a `torch.cuda.memory.CUDAPluggableAllocator`, with its
    hooks set (one for the process; `install()` makes it the current
    allocator). Without `install()`, PyTorch's own allocator stays and
    `torch.cuda.MemPool(vmpool.torch.allocator().allocator())` is a pool of
    PyTorch's whose segments vmpool serves (as vLLM's CuMemAllocator uses
    its own allocator).

    Raises `RuntimeError` for a PyTorch that cannot pass the hooks to a
    pluggable allocator."""
    global _allocator
    if _allocator is not None:
        return _allocator
    import torch

    lib = library()
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "vmpool_alloc", "vmpool_free")
    hooks = [
        ("set_record_stream_fn", lib.vmpool_record_stream, "Tensor.record_stream"),
        ("set_begin_allocate_to_pool", lib.vmpool_begin_allocate_to_pool, "CUDA graphs' pools"),
        ("set_end_allocate_to_pool_fn", lib.vmpool_end_allocate_to_pool, "CUDA graphs' pools"),
        ("set_release_pool", lib.vmpool_release_pool, "CUDA graphs' pools"),
        ("set_reset_fn", lib.vmpool_empty_cache, "torch.cuda.empty_cache"),
        ("set_memory_fraction_fn", lib.vmpool_set_memory_fraction, "torch.cuda.set_per_process_memory_fraction"),
    ]
    missing = [(name, what) for name, _, what in hooks if not hasattr(pluggable.allocator(), name)]
    if missing:
        needs = " and ".join(sorted({what for _, what in missing}))
        names = ", ".join(name for name, _ in missing)
        raise RuntimeError(f"this PyTorch cannot pass {needs} to a pluggable allocator (no {names})")
    for name, fn, _ in hooks:
        getattr(pluggable.allocator(), name)(ctypes.cast(fn, ctypes.c_void_p).value)
    _allocator = pluggable
    return pluggable


def install(mark_steps: bool | None = None) -> Any:
    """Makes vmpool PyTorch's CUDA allocator; returns the
    `CUDAPluggableAllocator` (`allocator()`). Call it before anything
    allocates CUDA memory (PyTorch refuses the change afterwards).

    With `mark_steps` (by default, unless `VMPOOL_MARK_STEPS=0`), a
    `torch.optim` optimizer's `step()` ends a step of every device's pool
    at its next allocation, after the gradients are freed, so that a
    training loop whose steps repeat is laid out and stops calling the
    driver without a change to the program (Note [Step layouts] in
    docs/DESIGN.md). With several optimizers (a GAN's two), only the last
    step of each iteration does, once their order has repeated twice. A
    step a `torch.amp.GradScaler` skips (overflowed gradients) counts as
    taken. A loop with no optimizer (a server, a generation loop) calls
    `mark_step()` itself.

    It also hooks `Tensor.record_stream`, and the private pools of CUDA
    graphs (`torch.cuda.graph`): without the hooks PyTorch drops those
    calls for a pluggable allocator, and memory would be reused under
    another stream's reads, or under a graph's replays. And
    `torch.cuda.empty_cache()`, which then returns vmpool's unused memory
    on every device, and `torch.cuda.set_per_process_memory_fraction()`,
    which then limits vmpool's pool. PyTorch's memory statistics
    (`torch.cuda.memory_allocated()`, `max_memory_reserved()`,
    `memory_stats()`, `reset_peak_memory_stats()`, ...), which raise for a
    pluggable allocator, then report vmpool's figures.
    `torch.cuda.MemPool`, which PyTorch 2.11 cannot make over a pluggable
    allocator, becomes vmpool's `MemPool`.

    Raises `RuntimeError` for a PyTorch that cannot pass these hooks to a
    pluggable allocator."""
    import torch

    pluggable = allocator()
    torch.cuda.memory.change_current_allocator(pluggable)
    _redirect_torch_statistics(torch)
    _redirect_torch_history(torch)
    torch.cuda.MemPool = torch.cuda.memory.MemPool = MemPool
    if mark_steps is None:
        mark_steps = _mark_steps_setting(os.environ.get("VMPOOL_MARK_STEPS"))
    if mark_steps:
        _mark_optimizer_steps(torch)
    return pluggable


def _mark_steps_setting(value: str | None) -> bool:
    """`VMPOOL_MARK_STEPS` as `install()` reads it: on unless `0`."""
    if value is None or value.strip() == "1":
        return True
    if value.strip() == "0":
        return False
    raise ValueError(f"VMPOOL_MARK_STEPS={value!r}: 1 (mark a step at each optimizer step, the default) or 0")


_marking_optimizer_steps = False


def _mark_optimizer_steps(torch: Any) -> None:
    """Marks a step of every device's pool after the optimizer step that
    ends a training iteration (every step, with one optimizer; see
    `_iterations`), or after a `GradScaler` step that skipped the
    optimizer's, once per process; none while a CUDA graph is being
    captured (a captured optimizer step runs again at each replay, with no
    Python)."""
    global _marking_optimizer_steps
    if _marking_optimizer_steps:
        return
    if not hasattr(library(), "vmpool_mark_step_at_next_alloc"):
        # An older build let in by VMPOOL_ALLOW_MISMATCH.
        warnings.warn("this vmpool library cannot mark steps at optimizer steps", RuntimeWarning, stacklevel=3)
        return

    iterations = Iterations()
    steps_taken = 0

    def after_step(optimizer: Any, *_: Any) -> None:
        nonlocal steps_taken
        steps_taken += 1
        if not torch.cuda.is_current_stream_capturing() and iterations.ends_iteration(optimizer):
            # At each pool's next allocation: the gradients, freed after
            # the optimizer's step (`zero_grad`), belong to the step ending.
            # Every device: a model split over several GPUs steps on all of
            # them at once (a device with no pool has nothing to mark).
            for device in range(torch.cuda.device_count()):
                _lib.mark_step_at_next_alloc(device)

    # PyTorch's `torch.optim` hides its `optimizer` module: imported by name.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(after_step)

    # A `GradScaler` skips the optimizer's step when the scaled gradients
    # overflowed (mixed precision's first steps, then now and then): no
    # hook runs, yet the iteration ended. Unmarked, that step and the next
    # would make one, unlike the others, and the layout would be given up.
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        scaler_step = scaler.step

        @functools.wraps(scaler_step)
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = steps_taken
            out = scaler_step(self, optimizer, *args, **kwargs)
            if steps_taken == before:
                after_step(optimizer)
            return out

        scaler.step = step
    _marking_optimizer_steps = True


class MemPool:
    """A `torch.cuda.MemPool` once vmpool is PyTorch's allocator
    (`install()` makes `torch.cuda.MemPool` this class): a vmpool pool of
    its own. Inside `torch.cuda.use_mem_pool(pool)` the calling thread's
    allocations on the pool's device come from it, on any stream (a CUDA
    graph capture's go to the graph's pool first); other threads' do not.
    Tensors freed from any thread go back to it. `release()` gives its
    memory and address space back; dropping the object without it lets the
    pool go with its last tensor, as PyTorch drops a MemPool.

    PyTorch 2.11 cannot make its own MemPool over a pluggable allocator
    (it raises "does not yet support createOrIncrefPool"); `use_mem_pool`
    needs only `.id`, and passes it to vmpool's hooks. The id is drawn from
    `torch.cuda.graph_pool_handle()`, so no PyTorch pool shares it. Do not
    capture a CUDA graph into it (`torch.cuda.graph(pool=p.id)`): vmpool
    takes that begin for `use_mem_pool`'s."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, symmetric: bool = False) -> None:
        import torch

        own = _allocator.allocator() if _allocator is not None else None
        if allocator is not None and allocator is not own:
            raise ValueError("under vmpool a MemPool's memory comes from vmpool: pass no allocator")
        if use_on_oom or symmetric:
            raise ValueError("vmpool's MemPool has no use_on_oom or symmetric mode")
        self._released = True
        self._device = _index(None)
        first, second = torch.cuda.graph_pool_handle()
        self._id = (int(first), int(second))
        _lib.mem_pool_create(self._device, self._id)
        self._released = False

    @property
    def id(self) -> tuple[int, int]:
        """PyTorch's id of the pool (`MempoolId_t`), for `use_mem_pool`."""
        return self._id

    @property
    def device(self) -> int:
        """The CUDA device whose memory the pool holds."""
        return self._device

    def stats(self) -> Stats:
        """The pool's own figures: its reserved and used bytes, counts."""
        return _lib.mem_pool_stats(self._device, self._id)

    def release(self) -> None:
        """Gives the pool's memory and address space back now. Raises
        `VmpoolError` while a tensor of it lives or a thread is in it
        (vmpool's log says which); the pool is then unchanged."""
        if self._released:
            raise VmpoolError(f"memory pool {self._id} was released already")
        _lib.mem_pool_release(self._device, self._id, _lib.RELEASE_NOW)
        self._released = True

    def __del__(self) -> None:
        if getattr(self, "_released", True):
            return
        try:
            _lib.mem_pool_release(self._device, self._id, _lib.RELEASE_WITH_LAST_FREE)
        except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone
            pass
        self._released = True


_communicators: dict[int, nccl.Communicator] = {}


def register(tensor: Any, group: Any = None) -> nccl.Registration:
    """Registers `tensor`'s storage with the NCCL communicator of `group`
    (default: the default process group) on the tensor's device
    (`ncclCommRegister`), so that collectives over it take NCCL's zero-copy
    paths; returns the `vmpool.nccl.Registration`, whose `deregister()`
    (or the end of a `with` block) ends it once its collectives finished.
    The registration keeps the storage alive, so vmpool never moves its
    chunks while NCCL's peers map them (Note [NCCL registration] in
    docs/DESIGN.md). Set `VMPOOL_HANDLE_TYPE=posix_fd` before the first
    allocation: NCCL exports the chunks to its peers, and registers nothing
    it cannot export. Register whole buffers and run the first collective
    over the whole buffer: NCCL maps for its peers the chunks under the
    first collective it sees.

    PyTorch's own route, `ProcessGroupNCCL.register_mem_pool`, takes
    PyTorch's MemPools only: it lists their segments from the caching
    allocator's snapshot, which a pluggable allocator does not have. It
    serves `torch.cuda.MemPool(allocator().allocator())` with PyTorch's
    allocator current, whose segments vmpool allocates."""
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cuda", tensor.device.index))
    comm = int(backend._comm_ptr())
    if comm not in _communicators:
        _communicators[comm] = nccl.Communicator(comm, nccl.NcclLibrary.loaded())
    storage = tensor.untyped_storage()
    return _communicators[comm].register(storage.data_ptr(), storage.nbytes(), keep=storage)


def _redirect_torch_statistics(torch: Any) -> None:
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

    def memory_stats_as_nested_dict(device: Device = None) -> dict:
        s = stats(device)
        used = {"all": {"current": s.used_bytes, "peak": s.used_high}}
        return {
            "allocated_bytes": used,
            "active_bytes": used,
            "reserved_bytes": {"all": {"current": s.reserved_bytes, "peak": s.reserved_high}},
            "allocation": {"all": {"allocated": s.allocations, "freed": s.frees}},
        }

    def reset_peak_memory_stats(device: Device = None) -> None:
        reset_peaks(device)

    def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
        return summary(device)

    for module in (memory, torch.cuda):
        module.memory_stats_as_nested_dict = memory_stats_as_nested_dict
        module.reset_peak_memory_stats = reset_peak_memory_stats
        module.memory_summary = memory_summary


def _redirect_torch_history(torch: Any) -> None:
    """PyTorch's memory snapshots (`torch.cuda.memory._record_memory_history`,
    `_snapshot`, `_dump_snapshot`) raise for a pluggable allocator; pointed
    at vmpool they record and give vmpool's history, in PyTorch's shape."""
    memory = torch.cuda.memory

    def _record_memory_history(enabled: Any = "all", *args: Any, max_entries: int = 100_000, **kwargs: Any) -> None:
        record_history(enabled not in (None, False), max_entries)

    def _snapshot(device: Device = None, *args: Any, **kwargs: Any) -> dict:
        return memory_snapshot()

    def _dump_snapshot(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
        dump_snapshot(filename)

    memory._record_memory_history = _record_memory_history
    memory._snapshot = _snapshot
    memory._dump_snapshot = _dump_snapshot


def record_history(enabled: bool = True, max_entries: int = 100_000) -> None:
    """Starts (afresh) or stops recording vmpool's memory history on every
    CUDA device: the last `max_entries` allocations, frees, refusals, and
    maps and unmaps of the pool's units. Off by default; once `install()`
    ran, `torch.cuda.memory._record_memory_history()` does the same."""
    _lib.record_history(enabled, max_entries)


def memory_snapshot() -> dict:
    """The pools and the history in the shape of
    `torch.cuda.memory._snapshot()`."""
    return _lib.memory_snapshot()


def dump_snapshot(path: str = "dump_snapshot.pickle") -> None:
    """Writes `memory_snapshot()` as a pickle that `torch.cuda._memory_viz`
    and the memory_viz page read (`torch.cuda.memory._dump_snapshot()`
    too, once `install()` ran)."""
    _lib.dump_snapshot(path)


def backend() -> str:
    """'cuda', 'host', or 'none' when the library could not start."""
    return _lib.backend()


def stats(device: Device = None) -> Stats:
    """vmpool's figures for `device` (default: the current CUDA device)."""
    return _lib.stats(_index(device))


def summary(device: Device = None) -> str:
    """vmpool's figures for `device` as a few lines of text."""
    return _lib.summary(_index(device))


def snapshot(device: Device = None) -> str:
    """`device`'s address-space map as text."""
    return _lib.snapshot(_index(device))


def print_snapshot(device: Device = None) -> None:
    """Writes `device`'s address-space map to stderr."""
    _lib.print_snapshot(_index(device))


def mark_step(device: Device = None) -> None:
    """Marks the end of a step of a program that repeats its work (a
    training step, a serving iteration) on `device`'s pool. Once two steps
    in a row make the same allocations in the same order (sizes may
    differ), the pool lays them out in one region and serves every later
    step there: no driver call and no search, however long the program
    runs. A step that goes another way or outgrows the layout goes to the
    pool's heap as before; shapes that vary apart (a long sequence in one
    step, a large batch in another) are not laid out until one step has
    needed about as much as the layout holds. `stats()` counts `planned`
    and `missed` allocations."""
    _lib.mark_step(_index(device))


def reset_peaks(device: Device = None) -> None:
    """Resets `device`'s reserved and used peaks."""
    _lib.reset_peaks(_index(device))


def synchronize(device: Device = None) -> None:
    """Waits for the streams vmpool has seen on `device`, frees what they
    freed, trims the pool to its release threshold, and forgets the
    streams."""
    _lib.synchronize(_index(device))


def empty_cache(device: Device = None) -> None:
    """Returns `device`'s unused memory (`torch.cuda.empty_cache()`, once
    `install()` hooked it, returns every device's)."""
    _lib.empty_cache(_index(device))


def set_retention(keep: bool) -> None:
    """What `sleep(1)` does with the bytes of every device's pool: kept in
    host memory until `wake()` (`keep`, for a model's weights), or dropped
    (the default, for a cache)."""
    _lib.set_retention(keep)


def sleep(level: int = 1) -> None:
    """Gives the GPU memory back while every tensor's pointer stays valid,
    as vLLM's sleep mode: level 1 keeps the bytes when `set_retention(True)`
    was called, level 2 keeps nothing. `torch.cuda.mem_get_info()` shows the
    memory free until `wake()`; allocating meanwhile fails, and a tensor
    dropped meanwhile is freed (its bytes are not copied back). CUDA graphs
    captured before the sleep replay after the wake (their own pools stay
    awake). A pool under 2 GiB is made of 2 MiB chunks, and its first sleep
    pays for releasing each (30-60 us apiece on an H200) unless
    `prepare_sleep()` joined them; with `VMPOOL_CHUNK_DIVISOR=off` it grows
    by whole chunks instead."""
    _lib.sleep(level)


def prepare_sleep() -> None:
    """Gets the pools ready for a `sleep(1)` at the copy's speed (after
    loading a model, say): a sleep that keeps every live byte, then a wake,
    after which each tensor's memory is few chunks to release. Pins host
    memory for the live bytes, as `reserve_host()`; the tensors and their
    bytes stay as they were."""
    _lib.prepare_sleep()


def wake() -> None:
    """Brings the memory back at the same addresses, the kept bytes with it."""
    _lib.wake()


def reserve_host(nbytes: int, device: Device = None) -> None:
    """Pins `nbytes` of host memory for `device`'s next `sleep(1)` now (at
    start-up, say), so that the sleep runs at the copy's speed: pinning is
    most of a first sleep's time. The memory stays from one sleep to the
    next (as PyTorch's pinned-memory cache does) until `release_host()`."""
    _lib.reserve_host(nbytes, _index(device))


def release_host(device: Device = None) -> int:
    """Frees the page-locked host memory `device`'s pool keeps between
    sleeps; returns its size in bytes. Not while it holds a sleeping pool's
    bytes."""
    return _lib.release_host(_index(device))


def main(argv: list[str] | None = None) -> None:
    """`python -m vmpool.torch SCRIPT ARGS...` (or `-m MODULE ARGS...`):
    installs vmpool, then runs the program as `python SCRIPT ARGS...`
    would, with vmpool as its allocator."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m vmpool.torch SCRIPT [ARGS...] | -m MODULE [ARGS...]"
    if not args or args[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        raise SystemExit(0 if args else 2)
    install()
    if args[0] == "-m":
        if len(args) < 2:
            print(usage, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        # As `python SCRIPT` does: the script's folder first on the path.
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
