#!/usr/bin/env python3
"""What of the PyTorch integration can be checked without a GPU, against
the real PyTorch: the PyPI wheel installs and imports on a machine with no
driver (`pip install torch`); only its CUDA calls fail.

- `gan-train` (scripts/torch_workloads.py) runs three steps on the CPU: its
  shapes fit and its losses are finite.
- `install()` itself: every allocator hook it passes exists in this
  PyTorch, and PyTorch's memory statistics and snapshots then answer
  with vmpool's.
- `install()`'s step marks under PyTorch's own optimizer hooks and
  `torch.amp.GradScaler`, over the loops scripts/torch_marks.py runs on
  the GPU, here on the CPU: one mark an iteration with one optimizer; with
  two, one at each of the first four optimizer steps, then one an
  iteration; with a GradScaler whose scale overflows, one an iteration,
  skipped steps included. The marks are counted instead of made, and the
  two CUDA queries the hook makes are answered for one device that is not
  capturing.

    cargo build --release -p vmpool-c
    VMPOOL_BACKEND=host python3 scripts/torch_cpu_checks.py

scripts/torch_marks.py checks the same marks on the GPU, with vmpool as
PyTorch's allocator and the pool's own counts. Exits non-zero when a check
fails.
"""

import math
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# torch_workloads beside this file; the package from this tree.
sys.path[:0] = [str(HERE), str(HERE.parent / "python")]

import torch  # noqa: E402
import torch_marks  # noqa: E402
import torch_workloads  # noqa: E402
import vmpool  # noqa: E402
from vmpool import _lib  # noqa: E402
from vmpool import torch as vmpool_torch  # noqa: E402


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    return ok


def gan_train():
    torch.manual_seed(0)
    shapes, step = torch_workloads.gan_train(torch, torch.device("cpu"), random.Random(0), 3)
    losses = [step(shape) for shape in shapes]
    return check(all(math.isfinite(loss) for loss in losses), f"gan-train on the CPU, losses {losses}")


def install():
    vmpool_torch.install()
    stats = [torch.cuda.memory_allocated(0), torch.cuda.max_memory_reserved(0)]
    ok = check(torch.cuda.MemPool is vmpool_torch.MemPool, "install(): torch.cuda.MemPool is vmpool's")
    ok &= check(stats == [0, 0], f"install(): memory_allocated, max_memory_reserved answer {stats}")
    ok &= check("vmpool" in torch.cuda.memory_summary(0), "install(): memory_summary is vmpool's")
    torch.cuda.memory._record_memory_history(max_entries=1000)
    vmpool.free(vmpool.alloc(1 << 20))
    traces = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    actions = sorted({t["action"] for t in traces})
    return ok & check(
        {"alloc", "free_completed"} <= set(actions), f"install(): a snapshot's history is vmpool's: {actions}"
    )


def marks():
    """After `install()`: its optimizer hook, counted, over the loops of
    scripts/torch_marks.py run on the CPU. A pool counts a step at each
    mark but the last, which waits for an allocation: one mark more than
    torch_marks.py's expected steps."""
    made = []
    _lib.mark_step_at_next_alloc = lambda device=0: made.append(device)
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_current_stream_capturing = lambda: False
    ok = True
    for case, steps in torch_marks.EXPECTED_STEPS.items():
        made.clear()
        skipped = torch_marks.train(torch, case, "cpu")
        what = f"{case}: {len(made)} marks in {torch_marks.ITERATIONS} iterations, {skipped} skipped by the scaler"
        ok &= check(len(made) == steps + 1 and (case != "grad-scaler" or skipped > 0), what)
    return ok


def main():
    ok = gan_train()
    ok &= install()
    ok &= marks()
    print("all checks passed" if ok else "checks failed", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
