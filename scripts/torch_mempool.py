#!/usr/bin/env python3
"""Checks, on the GPU, `torch.cuda.MemPool` and `torch.cuda.use_mem_pool`
over vmpool, each case in a process of its own:

    installed    vmpool.torch.install(): torch.cuda.MemPool is vmpool's, a
                 vmpool pool of its own. Tensors made inside use_mem_pool
                 come from it (its figures grow, the device pool's do not);
                 another thread's, and this thread's after the context, do
                 not. A release while they live is refused; once they are
                 freed, release() gives the pool's memory back (vmpool's
                 figures and cudaMemGetInfo). A second pool dropped with a
                 tensor live goes with that tensor. Then vLLM's use: a
                 model's weights made in a MemPool, a forward pass equal to
                 native PyTorch's, the pool released after.
    native-pool  PyTorch's allocator stays; torch.cuda.MemPool over
                 vmpool.torch.allocator() (as vLLM's CuMemAllocator puts its
                 own allocator under a MemPool): the pool's segments come
                 from vmpool, tensors outside it do not, the same forward
                 pass, and deleting the pool and emptying the caches gives
                 the memory back.
    native       plain PyTorch: the reference forward pass.

    python3 scripts/torch_mempool.py

Exits non-zero when any check fails.
"""

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))

import vmpool_torch  # noqa: E402,F401  (the package, from python/ or installed)
from torch_cases import Checks  # noqa: E402

MIB = 1 << 20
check = Checks()


def forward(torch, model_in_pool):
    """vLLM's use: a model whose weights are made by `model_in_pool` (in a
    MemPool or not), seeded, run on a seeded input. Returns the model and
    its output."""
    torch.manual_seed(0)
    model = model_in_pool(
        lambda: torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 4096)).cuda()
    )
    torch.manual_seed(1)
    x = torch.randn(256, 4096, device="cuda")
    with torch.no_grad():
        out = model(x)
    torch.cuda.synchronize()
    return model, out


def in_pool_of(torch, pool):
    """A `model_in_pool` for `forward`: makes the model inside
    `use_mem_pool(pool)`."""

    def in_pool(make):
        with torch.cuda.use_mem_pool(pool):
            return make()

    return in_pool


def same_as_native(torch, out, reference):
    ref = torch.load(reference)
    check(torch.allclose(out.cpu(), ref, rtol=1e-5, atol=1e-5), "the forward pass equals native PyTorch's")


def case_native(reference):
    import torch

    _, out = forward(torch, lambda make: make())
    torch.save(out.cpu(), reference)
    print("reference saved", flush=True)


def case_installed(reference):
    import vmpool
    import vmpool.torch as vt

    vt.install()
    import torch

    check(torch.cuda.MemPool is vt.MemPool, "torch.cuda.MemPool is vmpool's once installed")
    base = vt.stats()
    pool = torch.cuda.MemPool()
    print(f"      pool id {pool.id}", flush=True)
    other = []

    def elsewhere():
        other.append(torch.empty(32 * MIB, dtype=torch.uint8, device="cuda"))

    with torch.cuda.use_mem_pool(pool):
        inside = [torch.randn(4096, 4096, device="cuda") for _ in range(8)]  # 8 x 64 MiB
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    outside = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    own, s = pool.stats(), vt.stats()
    print(
        f"      pool used {own.used_bytes / MIB:.0f} MiB reserved {own.reserved_bytes / MIB:.0f} MiB; "
        f"device pool used {(s.used_bytes - base.used_bytes) / MIB:.0f} MiB more",
        flush=True,
    )
    check(own.used_bytes == 512 * MIB, "the tensors made inside use_mem_pool are the pool's 512 MiB")
    check((s.mem_pools, s.mem_pool_used_bytes) == (1, 512 * MIB), "vmpool's figures count the MemPool")
    check(
        96 * MIB <= s.used_bytes - base.used_bytes < 512 * MIB,
        "another thread's tensor and this thread's after the context come from the device's pool",
    )
    try:
        pool.release()
        check(False, "a release while tensors of the pool live is refused")
    except vmpool.VmpoolError:
        check(pool.stats().used_bytes == 512 * MIB, "a release while tensors of the pool live is refused")
    other.clear()
    del inside, outside
    torch.cuda.synchronize()
    check(pool.stats().used_bytes == 0, "freed, the pool has nothing in use")
    held = pool.stats().reserved_bytes
    free_before, _ = torch.cuda.mem_get_info()
    pool.release()
    del pool
    free_after, _ = torch.cuda.mem_get_info()
    s = vt.stats()
    print(
        f"      released {held / MIB:.0f} MiB; device free grew {(free_after - free_before) / MIB:.0f} MiB", flush=True
    )
    check((s.mem_pools, s.mem_pool_reserved_bytes) == (0, 0), "released, vmpool holds nothing for it")
    check(
        held >= 512 * MIB and free_after - free_before >= 0.99 * held, "released, cudaMemGetInfo shows its memory free"
    )

    second = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(second):
        kept = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
    del second
    check(vt.stats().mem_pools == 1, "a MemPool dropped with a tensor live stays for it")
    del kept
    torch.cuda.synchronize()
    check(vt.stats().mem_pools == 0, "and goes with that tensor")

    weights = torch.cuda.MemPool()

    model, out = forward(torch, in_pool_of(torch, weights))
    check(weights.stats().used_bytes >= 256 * MIB, "the model's weights are in the MemPool")
    same_as_native(torch, out, reference)
    del model, out
    torch.cuda.synchronize()
    try:
        weights.release()
        released = True
    except vmpool.VmpoolError as err:
        print(f"      {err}", flush=True)
        released = False
    check(released and vt.stats().mem_pools == 0, "the weights' MemPool released once the model is gone")


def case_native_pool(reference):
    import torch
    import vmpool.torch as vt

    pool = torch.cuda.MemPool(vt.allocator().allocator())
    base = vt.stats()
    with torch.cuda.use_mem_pool(pool):
        inside = [torch.randn(4096, 4096, device="cuda") for _ in range(8)]
    outside = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    s = vt.stats()
    print(f"      vmpool used {s.used_bytes / MIB:.0f} MiB", flush=True)
    check(s.used_bytes - base.used_bytes >= 512 * MIB, "the MemPool's segments come from vmpool")
    mark = vt.stats().used_bytes
    more = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    check(vt.stats().used_bytes == mark, "a tensor outside the MemPool does not")

    model, out = forward(torch, in_pool_of(torch, pool))
    same_as_native(torch, out, reference)
    del inside, outside, more, model, out
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    held = vt.stats().reserved_bytes
    del pool
    torch.cuda.empty_cache()
    vt.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    s = vt.stats()
    print(
        f"      vmpool held {held / MIB:.0f} MiB; device free grew {(free_after - free_before) / MIB:.0f} MiB",
        flush=True,
    )
    check((s.used_bytes, s.reserved_bytes) == (0, 0), "the MemPool deleted, vmpool holds nothing")
    check(free_after - free_before >= 0.99 * held, "cudaMemGetInfo shows its memory free")


CASES = {"native": case_native, "installed": case_installed, "native-pool": case_native_pool}


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--case":
        CASES[sys.argv[2]](sys.argv[3])
        return check.summary()
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        reference = os.path.join(tmp, "reference.pt")
        for case in CASES:
            print(f"== {case}", flush=True)
            rc = subprocess.run([sys.executable, __file__, "--case", case, reference]).returncode
            print(f"== {case}: exit {rc}", flush=True)
            status |= rc != 0
    print("mempool: all cases passed" if not status else "mempool: a case failed", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
