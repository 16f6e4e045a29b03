"""NCCL user-buffer registration of vmpool memory, through the NCCL library
the process already runs (PyTorch's), by ctypes:

    comm = Communicator(comm_pointer, NcclLibrary.loaded())
    with comm.register(ptr, size, keep=storage):   # ncclCommRegister
        ...collectives over [ptr, ptr + size)...   # NCCL's zero-copy paths
                                                   # ncclCommDeregister

`vmpool.torch.register(tensor, group)` does this for a tensor and a
`torch.distributed` process group. A registration keeps `keep` (the
tensor's storage) alive: its bytes stay allocated, so vmpool never moves
the chunks under them, and NCCL's record of them (its peers map those
chunks) stays right while the pool remaps others. Deregister once the
collectives over the buffer have finished, as for `ncclCommDeregister`.
The pool's chunks must be exportable (`VMPOOL_HANDLE_TYPE=posix_fd`): NCCL
exports them to its peers, and without that falls back to copies. See
Note [NCCL registration] in docs/DESIGN.md."""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["Communicator", "NcclError", "NcclLibrary", "Registration"]

_REGISTER = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
)
_DEREGISTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_VERSION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
# The description is returned as an address: NCCL keeps the text.
_ERROR_STRING = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)

# The entry points used, each with its C prototype.
_ENTRY_POINTS = {
    "ncclCommRegister": _REGISTER,
    "ncclCommDeregister": _DEREGISTER,
    "ncclGetVersion": _VERSION,
    "ncclGetErrorString": _ERROR_STRING,
}


class NcclError(RuntimeError):
    """An NCCL call returned an error; the message names the call and
    NCCL's description."""


class NcclLibrary:
    """NCCL's registration calls, from their addresses (`from_cdll` takes
    them from a loaded library)."""

    def __init__(self, addresses: dict[str, int]) -> None:
        missing = sorted(set(_ENTRY_POINTS) - set(addresses))
        if missing:
            raise NcclError(f"this NCCL has no {', '.join(missing)}")
        self._fns: dict[str, Any] = {name: proto(addresses[name]) for name, proto in _ENTRY_POINTS.items()}

    @classmethod
    def from_cdll(cls, lib: ctypes.CDLL) -> NcclLibrary:
        addresses = {}
        for name in _ENTRY_POINTS:
            fn = getattr(lib, name, None)
            if fn is not None:
                addresses[name] = ctypes.cast(fn, ctypes.c_void_p).value or 0
        return cls(addresses)

    @classmethod
    def loaded(cls) -> NcclLibrary:
        """The libnccl this process has loaded (PyTorch's), found in
        /proc/self/maps: a communicator must be passed to the library that
        made it. Raises `NcclError` when none is loaded (a PyTorch that
        links NCCL statically, or none imported yet)."""
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libnccl.so" in line.rsplit("/", 1)[-1]}
        if len(paths) != 1:
            raise NcclError(
                f"expected one libnccl loaded in this process, found {sorted(paths) or 'none'}"
                " (a PyTorch that links NCCL statically has none to call)"
            )
        return cls.from_cdll(ctypes.CDLL(paths.pop()))

    def _check(self, call: str, rc: int) -> None:
        if rc != 0:
            text = self._fns["ncclGetErrorString"](rc)
            raise NcclError(f"{call}: error {rc}: {ctypes.string_at(text).decode() if text else 'unknown'}")

    def version(self) -> tuple[int, int, int]:
        """NCCL's version, as (major, minor, patch)."""
        code = ctypes.c_int()
        self._check("ncclGetVersion", self._fns["ncclGetVersion"](ctypes.byref(code)))
        major, rest = divmod(code.value, 10000)
        minor, patch = divmod(rest, 100)
        return major, minor, patch

    def comm_register(self, comm: int, ptr: int, size: int) -> int:
        """`ncclCommRegister`: the handle, 0 when NCCL skipped the buffer
        (NCCL_LOCAL_REGISTER=0, or peers that copy through the host)."""
        handle = ctypes.c_void_p()
        self._check("ncclCommRegister", self._fns["ncclCommRegister"](comm, ptr, size, ctypes.byref(handle)))
        return handle.value or 0

    def comm_deregister(self, comm: int, handle: int) -> None:
        self._check("ncclCommDeregister", self._fns["ncclCommDeregister"](comm, handle))


class Registration:
    """One buffer registered with one communicator, until `deregister()`
    (or the end of a `with` block). It holds `keep`, so that the buffer
    stays allocated, and its chunks in place, while NCCL may use it."""

    def __init__(self, communicator: Communicator, ptr: int, size: int, handle: int, keep: Any) -> None:
        self.communicator = communicator
        self.ptr = ptr
        self.size = size
        self.handle = handle
        self._keep = keep
        self._live = True

    @property
    def registered(self) -> bool:
        """Whether NCCL took the buffer (it skips buffers when its local
        registration is off or its peers copy through the host)."""
        return self.handle != 0

    @property
    def live(self) -> bool:
        return self._live

    def deregister(self) -> None:
        """`ncclCommDeregister`, then lets the buffer go. Call it once the
        collectives over the buffer have finished. Raises `NcclError` when
        already deregistered."""
        if not self._live:
            raise NcclError(f"buffer {self.ptr:#x} was deregistered already")
        self.communicator._deregister(self)
        self._live = False
        self._keep = None

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.deregister()


class Communicator:
    """An NCCL communicator (`ncclComm_t`, as a pointer), and the buffers
    registered with it through vmpool."""

    def __init__(self, comm: int, library: NcclLibrary) -> None:
        if not comm:
            raise NcclError("no communicator yet: pass device_id to init_process_group, or run a collective first")
        self.comm = comm
        self.library = library
        self._live: dict[int, Registration] = {}

    def register(self, ptr: int, size: int, keep: Any = None) -> Registration:
        """Registers `[ptr, ptr + size)`, keeping `keep` (what owns the
        memory) alive until the registration ends."""
        if size <= 0:
            raise ValueError(f"cannot register {size} bytes")
        handle = self.library.comm_register(self.comm, ptr, size)
        registration = Registration(self, ptr, size, handle, keep)
        self._live[id(registration)] = registration
        return registration

    def _deregister(self, registration: Registration) -> None:
        if registration.handle:
            self.library.comm_deregister(self.comm, registration.handle)
        del self._live[id(registration)]

    def registrations(self) -> list[Registration]:
        """The live registrations, oldest first."""
        return list(self._live.values())
