#!/usr/bin/env python3
"""Checks, on the GPU, that memory another stream still uses is not reused
under it: the `Tensor.record_stream` contract.

A tensor of ones is summed on a side stream behind a ~0.5 s sleep; the
main stream records the side stream as a user, frees the tensor and at once
allocates one of the same size and fills it with zeros. If the allocator
reuses the memory before the side stream's sum has read it, the sum comes
out short. Each case runs in a process of its own:

    native            PyTorch's caching allocator
    vmpool            vmpool_torch.install(), which hooks record_stream
    vmpool-unhooked   vmpool as a bare CUDAPluggableAllocator: PyTorch then
                      drops record_stream calls; shows the check can fail

    python3 scripts/torch_record_stream.py

Exits non-zero when native or vmpool gets a wrong sum (the unhooked case is
expected to, whenever it reuses the memory), or when a case's side stream
had already finished at the free, which would make the check prove nothing.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torch_cases import report, run_checks, torch_for  # noqa: E402

CASES = ["native", "vmpool", "vmpool-unhooked"]
ELEMENTS = 64 << 20  # int32: 256 MiB
SLEEP_CYCLES = 1_000_000_000  # about 0.5 s at the H200's clock


def child(case):
    torch = torch_for(case)
    if case == "vmpool-unhooked":
        import vmpool_torch

        allocator = torch.cuda.memory.CUDAPluggableAllocator(vmpool_torch.library_path(), "vmpool_alloc", "vmpool_free")
        torch.cuda.memory.change_current_allocator(allocator)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()

    def attempt(sleep_cycles):
        x = torch.ones(ELEMENTS, dtype=torch.int32, device="cuda")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
            total = x.sum()
        x.record_stream(side)
        old = x.data_ptr()
        # The check means something only if the side stream has not read
        # the tensor yet when it is freed.
        busy = not side.query()
        del x
        y = torch.zeros(ELEMENTS, dtype=torch.int32, device="cuda")
        reused = y.data_ptr() == old
        torch.cuda.synchronize()
        return busy, reused, int(total.item())

    # Once without the sleep first: the first launch of each kernel loads
    # its module, which can take longer than the sleep.
    attempt(0)
    busy, reused, got = attempt(SLEEP_CYCLES)
    report({"case": case, "busy": busy, "reused": reused, "sum": got, "ok": got == ELEMENTS})


def check(case, r):
    verdict = "right" if r["ok"] else "WRONG"
    if not r["busy"]:
        # The side stream had finished before the free: proves nothing.
        verdict += ", INCONCLUSIVE (the side stream was idle at the free)"
    print(f"{case:16} memory reused at once: {str(r['reused']):5}  sum {r['sum']:>10}  {verdict}")
    return r["busy"] and (case == "vmpool-unhooked" or r["ok"])


def main():
    if sys.argv[1:2] != ["--child"]:
        print(f"expected sum {ELEMENTS}")
    run_checks(__file__, child, CASES, check)


if __name__ == "__main__":
    main()
