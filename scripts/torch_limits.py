#!/usr/bin/env python3
"""Checks, on the GPU, that `torch.cuda.set_per_process_memory_fraction`
limits an allocator: with a fraction of 0.05 (about 7 GB on an H200) a
1 GiB tensor fits and a 12 GiB one is refused; at 1.0 the 12 GiB one fits.
Then `torch.cuda.empty_cache()` gives the memory back. How the refusal
shows is reported too: native PyTorch raises its out-of-memory error; for
a pluggable allocator, which can only return NULL, PyTorch 2.11 makes a
tensor with a null pointer and raises nothing. Each case runs in a process
of its own:

    native   PyTorch's caching allocator
    vmpool   vmpool_torch.install()

    python3 scripts/torch_limits.py

Exits non-zero when a case behaves otherwise.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_cases import report, run_checks, torch_for  # noqa: E402

GIB = 1 << 30


def child(case):
    torch = torch_for(case)
    dev = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(0.05)
    small = torch.empty(GIB, dtype=torch.uint8, device=dev)
    try:
        over = torch.empty(12 * GIB, dtype=torch.uint8, device=dev)
        raised, refused = False, over.data_ptr() == 0
        del over
    except torch.OutOfMemoryError:
        raised, refused = True, True
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(12 * GIB, dtype=torch.uint8, device=dev)
    del small, big
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    report({"refused_over_fraction": refused, "raised": raised, "used_after_empty_cache": total - free})


def check(case, r):
    how = "an out-of-memory error" if r["raised"] else "a tensor with a null pointer, no error"
    print(
        f"{case:8} 12 GiB over a 0.05 fraction: "
        f"{'refused, as ' + how if r['refused_over_fraction'] else 'ALLOWED'}; "
        f"fits at 1.0; device memory in use after empty_cache: {r['used_after_empty_cache'] / GIB:.2f} GiB"
    )
    return r["refused_over_fraction"]


def main():
    run_checks(__file__, child, ("native", "vmpool"), check)


if __name__ == "__main__":
    main()
