#!/usr/bin/env python3
"""Checks, on the GPU, that PyTorch's memory statistics work under vmpool:
`torch.cuda.memory_allocated()`, `max_memory_allocated()`,
`memory_reserved()`, `max_memory_reserved()`, `memory_stats()` and
`reset_peak_memory_stats()`, and that `memory_summary()` runs (under
vmpool it gives vmpool's own summary). PyTorch keeps none for a pluggable allocator
(asked, it raises); `vmpool_torch.install()` points them at vmpool's own
figures. Each case runs in a process of its own:

    native   PyTorch's caching allocator, for reference
    vmpool   vmpool_torch.install()

    python3 scripts/torch_stats.py

Exits non-zero when a statistic is missing or disagrees with what the
allocator itself reports (vmpool: `vmpool_torch.stats()`), or a peak does
not reset.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vmpool_torch  # noqa: E402
from torch_cases import report, run_checks, torch_for  # noqa: E402

MIB = 1 << 20


def child(case):
    torch = torch_for(case)
    dev = torch.device("cuda")
    a = torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
    b = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    del a
    got = {
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(dev),
        "reserved": torch.cuda.memory_reserved(0),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "stats_allocated": torch.cuda.memory_stats()["allocated_bytes.all.current"],
    }
    torch.cuda.reset_peak_memory_stats()
    got["max_allocated_after_reset"] = torch.cuda.max_memory_allocated()
    try:
        text = torch.cuda.memory_summary()
        got["memory_summary"] = "works: " + text.strip().splitlines()[0][:60]
    except Exception as e:  # what it raises is what is reported
        got["memory_summary"] = f"raises {type(e).__name__}: {str(e)[:80]}"
    if case == "vmpool":
        s = vmpool_torch.stats()
        got["own"] = {"used": s["used_bytes"], "reserved": s["reserved_bytes"], "reserved_high": s["reserved_high"]}
        try:
            torch._C._cuda_memoryStats(0)
            got["pytorch_itself"] = "reports"
        except RuntimeError as e:
            got["pytorch_itself"] = "raises: " + str(e).splitlines()[0][:120]
    del b
    report(got)


def check(case, r):
    line = ", ".join(
        f"{k} {r[k] / MIB:.0f} MiB"
        for k in ("allocated", "max_allocated", "reserved", "max_reserved", "max_allocated_after_reset")
    )
    print(f"{case:8} {line}; memory_summary() {r['memory_summary']}")
    ok = (
        r["memory_summary"].startswith("works")
        and r["allocated"] == r["stats_allocated"] >= 64 * MIB
        and r["max_allocated"] >= 320 * MIB
        and r["max_allocated_after_reset"] == r["allocated"]
        and r["max_reserved"] >= r["reserved"] >= r["allocated"]
    )
    if case == "vmpool":
        own = r["own"]
        print(
            f"         vmpool's own: used {own['used'] / MIB:.0f} MiB, reserved {own['reserved'] / MIB:.0f} MiB; "
            f"PyTorch's own statistics for it: {r['pytorch_itself']}"
        )
        ok &= (
            r["allocated"] == own["used"]
            and r["reserved"] == own["reserved"]
            and r["max_reserved"] == own["reserved_high"]
        )
    print(f"         {'right' if ok else 'WRONG'}")
    return ok


def main():
    run_checks(__file__, child, ("native", "vmpool"), check)


if __name__ == "__main__":
    main()
