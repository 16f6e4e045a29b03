"""How the wheel is built (the metadata is in pyproject.toml).

setuptools-rust builds capi/ as a plain shared library (no Python
bindings: the package loads it with ctypes) and puts it in the package as
libvmpool_c.so, the name the loader and PyTorch's CUDAPluggableAllocator
are given, not a CPython extension's name. Since no Python API is linked,
one wheel serves every Python 3: it is tagged py3-none, with the manylinux
tag that the glibc symbol versions the library needs allow.
"""

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust

LIBRARY = "libvmpool_c.so"


class build_library(build_rust):
    """Puts the library in the package as libvmpool_c.so."""

    def get_dylib_ext_path(self, ext, target_fname):
        return str(Path(super().get_dylib_ext_path(ext, target_fname)).with_name(LIBRARY))


def manylinux_tag(library: Path, arch: str) -> str:
    """manylinux_2_N_ARCH, N the newest glibc symbol version the library
    needs (it links only glibc and libgcc_s, which manylinux allows; the
    CUDA driver is opened at run time)."""
    minors = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", library.read_bytes())]
    return f"manylinux_2_{max(minors + [17])}_{arch}"


class bdist_wheel_py3(bdist_wheel):
    """Tags the wheel py3-none-manylinux_2_N_x86_64."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        if plat.startswith("linux_"):
            built = sorted(Path(self.bdist_dir).rglob(LIBRARY))
            if built:
                plat = manylinux_tag(built[0], plat[len("linux_") :])
        return "py3", "none", plat


setup(
    rust_extensions=[
        RustExtension(
            "vmpool.libvmpool_c",
            path="capi/Cargo.toml",
            binding=Binding.NoBinding,
            args=["--locked"],
        )
    ],
    cmdclass={"build_rust": build_library, "bdist_wheel": bdist_wheel_py3},
    zip_safe=False,
)
