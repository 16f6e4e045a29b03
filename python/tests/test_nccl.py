"""`vmpool.nccl` against a stand-in for NCCL: C callbacks with NCCL's
prototypes, called through the same ctypes path as the real library's,
that record what was registered. The real NCCL runs on the GPU
(scripts/nccl_bandwidth.py)."""

from __future__ import annotations

import ctypes

import pytest
from vmpool import nccl


class FakeNccl:
    """ncclCommRegister / ncclCommDeregister over a table of live handles;
    `fail` makes the next call return that error; `skip` makes registration
    return a null handle, as NCCL does with its local registration off."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int, int]] = {}
        self.next_handle = 0x1000
        self.fail = 0
        self.skip = False
        self.texts = {5: ctypes.create_string_buffer(b"invalid usage"), 0: ctypes.create_string_buffer(b"some error")}
        self.callbacks = {
            "ncclCommRegister": nccl._REGISTER(self.register),
            "ncclCommDeregister": nccl._DEREGISTER(self.deregister),
            "ncclGetVersion": nccl._VERSION(self.version),
            "ncclGetErrorString": nccl._ERROR_STRING(self.error_string),
        }

    def addresses(self) -> dict[str, int]:
        return {name: ctypes.cast(fn, ctypes.c_void_p).value or 0 for name, fn in self.callbacks.items()}

    def register(self, comm, ptr, size, handle_out):  # type: ignore[no-untyped-def]
        if self.fail:
            rc, self.fail = self.fail, 0
            return rc
        if self.skip:
            handle_out[0] = None
            return 0
        self.next_handle += 0x10
        self.live[self.next_handle] = (comm, ptr, size)
        handle_out[0] = self.next_handle
        return 0

    def deregister(self, comm, handle):  # type: ignore[no-untyped-def]
        if handle not in self.live or self.live[handle][0] != comm:
            return 5  # ncclInvalidUsage
        del self.live[handle]
        return 0

    def version(self, code):  # type: ignore[no-untyped-def]
        code[0] = 22903
        return 0

    def error_string(self, rc):  # type: ignore[no-untyped-def]
        return ctypes.addressof(self.texts[5 if rc == 5 else 0])


@pytest.fixture
def fake() -> FakeNccl:
    return FakeNccl()


def test_register_and_deregister_reach_nccl(fake: FakeNccl) -> None:
    lib = nccl.NcclLibrary(fake.addresses())
    assert lib.version() == (2, 29, 3)
    comm = nccl.Communicator(0xC0, lib)
    owner = object()
    reg = comm.register(0x7F0000200000, 6 << 20, keep=owner)
    assert reg.registered and reg.live
    assert list(fake.live.values()) == [(0xC0, 0x7F0000200000, 6 << 20)]
    assert comm.registrations() == [reg]
    reg.deregister()
    assert fake.live == {} and comm.registrations() == [] and not reg.live
    with pytest.raises(nccl.NcclError, match="deregistered already"):
        reg.deregister()


def test_a_registration_keeps_its_owner_alive_until_it_ends(fake: FakeNccl) -> None:
    import weakref

    class Storage:
        pass

    comm = nccl.Communicator(0xC0, nccl.NcclLibrary(fake.addresses()))
    storage = Storage()
    gone = weakref.ref(storage)
    with comm.register(0x1000, 4096, keep=storage):
        del storage
        assert gone() is not None, "the registered memory was let go"
    assert gone() is None
    assert fake.live == {}


def test_errors_name_the_call_and_change_nothing(fake: FakeNccl) -> None:
    comm = nccl.Communicator(0xC0, nccl.NcclLibrary(fake.addresses()))
    fake.fail = 5
    with pytest.raises(nccl.NcclError, match="ncclCommRegister: error 5: invalid usage"):
        comm.register(0x1000, 4096)
    assert comm.registrations() == [] and fake.live == {}
    with pytest.raises(ValueError):
        comm.register(0x1000, 0)
    with pytest.raises(nccl.NcclError, match="no communicator yet"):
        nccl.Communicator(0, nccl.NcclLibrary(fake.addresses()))


def test_a_skipped_buffer_is_not_deregistered(fake: FakeNccl) -> None:
    comm = nccl.Communicator(0xC0, nccl.NcclLibrary(fake.addresses()))
    fake.skip = True
    reg = comm.register(0x1000, 4096)
    assert not reg.registered
    reg.deregister()  # no NCCL call: the fake would refuse an unknown handle
    assert comm.registrations() == []


def test_a_library_without_the_calls_is_refused(fake: FakeNccl) -> None:
    addresses = fake.addresses()
    del addresses["ncclCommRegister"]
    with pytest.raises(nccl.NcclError, match="no ncclCommRegister"):
        nccl.NcclLibrary(addresses)
