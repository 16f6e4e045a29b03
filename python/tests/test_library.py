"""The package against the library it loads, on the host backend."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import vmpool
from vmpool import _lib

MIB = 1 << 20
SOURCE = Path(__file__).resolve().parents[2]


def test_the_library_is_this_package_s_version():
    assert vmpool.backend() == "host"
    assert vmpool.library_version() == vmpool.__version__
    assert vmpool.library().vmpool_abi() == vmpool.ABI


def test_the_version_is_the_crate_s():
    cargo = SOURCE / "capi" / "Cargo.toml"
    if not cargo.is_file():
        pytest.skip("not run from the source tree")
    version = re.search(r'^version = "([^"]+)"', cargo.read_text(), re.M).group(1)
    assert vmpool.__version__ == version


def test_the_stats_struct_has_the_library_s_layout():
    assert vmpool.library().vmpool_stats_size() == ctypes.sizeof(_lib._CStats)
    assert vmpool.FIELDS == tuple(f.name for f in dataclasses.fields(vmpool.Stats))
    header = SOURCE / "capi" / "include" / "vmpool.h"
    if header.is_file():
        body = header.read_text().split("typedef struct {")[-1].split("} vmpool_stats_t;")[0]
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        names = [n.strip() for decl in re.findall(r"uint64_t ([^;]+);", body) for n in decl.split(",")]
        assert names == ["valid", *vmpool.FIELDS]


def test_stats_summary_snapshot_and_empty_cache():
    ptr = vmpool.alloc(3 * MIB)
    assert ptr and ptr % 256 == 0
    s = vmpool.stats()
    assert isinstance(s, vmpool.Stats)
    assert s.used_bytes == 3 * MIB and s.reserved_bytes >= 3 * MIB
    assert s["used_bytes"] == s.used_bytes and s.as_dict()["used_bytes"] == s.used_bytes
    text = vmpool.summary()
    assert text.startswith("vmpool on device 0 (host backend)")
    assert "used        3.0 MiB" in text
    assert vmpool.snapshot().strip()
    vmpool.free(ptr + 256)  # an interior pointer: refused, counted
    assert vmpool.stats().refused_frees == s.refused_frees + 1
    vmpool.free(ptr, size=3 * MIB)
    vmpool.empty_cache(0)
    s = vmpool.stats()
    assert (s.used_bytes, s.reserved_bytes, s.pending_bytes) == (0, 0, 0)
    vmpool.reset_peaks()
    assert vmpool.stats().reserved_high == 0


def test_errors_are_exceptions():
    with pytest.raises(vmpool.VmpoolError):
        vmpool.stats(3)  # the host backend has one device
    with pytest.raises(ValueError):
        vmpool.alloc(-1)
    assert vmpool.alloc(0) == 0
    assert "torch" not in sys.modules
    with pytest.raises(vmpool.OutOfMemoryError):
        vmpool.alloc(1 << 40)


class _Fn:
    """A stand-in for a ctypes function: takes restype/argtypes, returns `value`."""

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


class _FakeLibrary:
    def __init__(self, version=None, abi=vmpool.ABI, size=None):
        self.vmpool_version = _Fn(vmpool.__version__.encode() if version is None else version)
        self.vmpool_abi = _Fn(abi)
        self.vmpool_stats_size = _Fn(ctypes.sizeof(_lib._CStats) if size is None else size)


def test_a_matching_library_passes():
    _lib.check_library(_FakeLibrary(), "fake.so")


@pytest.mark.parametrize(
    ("fake", "said"),
    [
        (_FakeLibrary(version=b"0.0.9"), "it is version 0.0.9"),
        (_FakeLibrary(abi=vmpool.ABI + 1), "interface layout"),
        (_FakeLibrary(size=8), "stats struct has 8 bytes"),
        (object(), "no version"),
    ],
)
def test_a_mismatch_is_refused_with_what_to_reinstall(fake, said, monkeypatch):
    monkeypatch.delenv("VMPOOL_ALLOW_MISMATCH", raising=False)
    with pytest.raises(vmpool.LibraryMismatchError) as refused:
        _lib.check_library(fake, "fake.so")
    message = str(refused.value)
    assert said in message and "fake.so" in message
    assert "pip install --force-reinstall" in message and "cargo build --release -p vmpool-c" in message


def test_a_mismatch_can_be_allowed_with_a_warning(monkeypatch):
    monkeypatch.setenv("VMPOOL_ALLOW_MISMATCH", "1")
    with pytest.warns(RuntimeWarning, match="it is version 0.0.9"):
        _lib.check_library(_FakeLibrary(version=b"0.0.9"), "fake.so")


def test_the_launcher_explains_itself():
    out = subprocess.run([sys.executable, "-m", "vmpool.torch"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage: python -m vmpool.torch" in out.stderr


def test_importing_starts_nothing():
    # Without a GPU the CUDA backend cannot start; importing must not try
    # (nor exiting afterwards).
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMPOOL_")}
    out = subprocess.run(
        [sys.executable, "-c", "import vmpool, vmpool.torch; print(vmpool.__version__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == vmpool.__version__
    assert out.stderr == ""


def test_an_older_library_let_in_lacks_only_what_it_lacks(monkeypatch):
    # VMPOOL_ALLOW_MISMATCH=1 lets in a build from before the version
    # exports (A/B runs); the functions it has are declared, the rest fail
    # when called.
    monkeypatch.setenv("VMPOOL_ALLOW_MISMATCH", "1")

    class Old:
        def __init__(self):
            self.vmpool_alloc = _Fn(0)

    old = Old()
    with pytest.warns(RuntimeWarning, match="no version"):
        _lib.check_library(old, "old.so")
    _lib._signatures(old)
    assert old.vmpool_alloc.restype is ctypes.c_void_p
    assert not hasattr(old, "vmpool_history")
