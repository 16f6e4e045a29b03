"""Sleep and wake through the package, on the host backend, in a process of
their own: a sleep reaches every device's pool, which other tests share."""

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
    vmpool.set_retention(True)
    ptr = vmpool.alloc(4 * MIB)
    ctypes.memset(ptr, 0xA5, 4 * MIB)
    reserved = vmpool.stats().reserved_bytes
    vmpool.sleep(1)
    assert vmpool.stats().reserved_bytes == 0
    try:
        vmpool.alloc(MIB)
    except vmpool.OutOfMemoryError:
        pass
    else:
        raise AssertionError("an allocation while asleep")
    held = vmpool.stats().host_bytes
    assert held >= 4 * MIB, held
    try:
        vmpool.release_host()
    except vmpool.VmpoolError:
        pass
    else:
        raise AssertionError("release_host while asleep")
    vmpool.wake()
    assert vmpool.stats().reserved_bytes == reserved
    assert ctypes.string_at(ptr, 4 * MIB) == b"\\xa5" * (4 * MIB)
    # The host buffer stays for the next sleep, until given back.
    assert vmpool.stats().host_bytes == held
    assert vmpool.release_host() == held
    assert vmpool.stats().host_bytes == 0
    vmpool.reserve_host(16 * MIB)
    assert vmpool.stats().host_bytes == 16 * MIB
    vmpool.sleep(1)
    vmpool.wake()
    assert vmpool.stats().host_bytes == 16 * MIB
    assert ctypes.string_at(ptr, 4 * MIB) == b"\\xa5" * (4 * MIB)
    # A buffer dropped while asleep is freed, and its bytes are not copied back.
    other = vmpool.alloc(2 * MIB)
    vmpool.sleep(1)
    vmpool.free(other)
    assert vmpool.stats().used_bytes == 4 * MIB
    vmpool.wake()
    assert ctypes.string_at(ptr, 4 * MIB) == b"\\xa5" * (4 * MIB)
    assert vmpool.stats().refused_frees == 0
    # Prepared: the same bytes and reservation in fewer chunks.
    big = vmpool.alloc(40 * MIB)
    ctypes.memset(big, 0x5A, 40 * MIB)
    before = vmpool.stats()
    vmpool.prepare_sleep()
    after = vmpool.stats()
    assert after.reserved_bytes == before.reserved_bytes
    chunks_before = before.chunks_created - before.chunks_released
    chunks_after = after.chunks_created - after.chunks_released
    assert chunks_after * 2 < chunks_before, (chunks_before, chunks_after)
    assert ctypes.string_at(big, 40 * MIB) == b"\\x5a" * (40 * MIB)
    assert ctypes.string_at(ptr, 4 * MIB) == b"\\xa5" * (4 * MIB)
    vmpool.free(big)
    vmpool.sleep(2)
    vmpool.wake()
    try:
        vmpool.sleep(3)
    except ValueError:
        pass
    else:
        raise AssertionError("level 3")
    vmpool.free(ptr, size=4 * MIB)
    print("ok")
    """
)


def test_sleep_and_wake_keep_the_bytes_at_their_addresses():
    env = dict(os.environ, VMPOOL_BACKEND="host", VMPOOL_HOST_DEVICES="1", VMPOOL_LOG="off")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
