"""Marked steps through the package, on the host backend, in a process of
their own: marking steps changes how the device's pool serves every later
allocation, which other tests share."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import ctypes
    import vmpool

    MIB = 1 << 20
    SIZES = [MIB * i + 4096 for i in range(1, 9)]


    def step():
        ptrs = [vmpool.alloc(size) for size in SIZES]
        for i, (ptr, size) in enumerate(zip(ptrs, SIZES)):
            ctypes.memset(ptr, i, size)
        for i, (ptr, size) in reversed(list(enumerate(zip(ptrs, SIZES)))):
            assert ctypes.string_at(ptr, size) == bytes([i]) * size, i
            vmpool.free(ptr, size=size)


    # The first mark comes before the pool exists: it has nothing to do.
    # Then two steps recorded alike: laid out at the second one's end.
    vmpool.mark_step()
    for _ in range(3):
        step()
        vmpool.mark_step()
    maps = vmpool.stats().maps
    for _ in range(5):
        step()
        vmpool.mark_step()
    s = vmpool.stats()
    assert s.step_layouts == 1, s
    assert (s.planned, s.missed) == (5 * len(SIZES), 0), s
    assert s.maps == maps, s
    try:
        vmpool.mark_step(9)
    except vmpool.VmpoolError:
        pass
    else:
        raise AssertionError("a device the host backend lacks")
    print("ok")
    """
)


def test_marked_steps_are_served_from_a_layout() -> None:
    env = dict(os.environ, VMPOOL_BACKEND="host", VMPOOL_HOST_DEVICES="1", VMPOOL_HOST_MEMORY="1GiB", VMPOOL_LOG="off")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
