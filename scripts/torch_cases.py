"""What the GPU checks of PyTorch share: each case (an allocator) runs in
a Python process of its own, since PyTorch takes its allocator once per
process, and prints one `RESULT {json}` line for the parent to read."""

import json
import subprocess
import sys


class Checks:
    """The named checks of one process: each prints `ok` or `FAIL` and what
    it checked; `summary()` prints the count and returns the exit status."""

    def __init__(self):
        self.failures = []

    def __call__(self, ok, what):
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            self.failures.append(what)

    def summary(self):
        n = len(self.failures)
        print("all checks passed" if not n else f"{n} checks failed", flush=True)
        return 1 if n else 0


def torch_for(case):
    """The child's side: imports PyTorch, with vmpool as its allocator
    when `case` is "vmpool"; returns the module."""
    import torch

    if case == "vmpool":
        import vmpool_torch

        vmpool_torch.install()
    return torch


def report(result):
    """The child's side: prints its one result line."""
    print("RESULT " + json.dumps(result), flush=True)


def run_case(script, *args, env=None, timeout=None, label=None):
    """Runs `script args...` in a new Python process (with `env`, within
    `timeout` seconds, when given). Returns its result (a dict; `None` when
    it failed to run, having printed why, under `label`, by default the
    last argument) and the finished process, for its log (`None` when it
    ran out of time)."""
    label = label or args[-1]
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        print(f"  {label}: failed to run (no result in {timeout} s)", flush=True)
        return None, None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        print(f"  {label}: failed to run (exit {proc.returncode})\n{tail}", flush=True)
        return None, proc
    return json.loads(lines[-1][len("RESULT ") :]), proc


def run_checks(script, child, cases, check):
    """A check script's `main`: as a child (`script --child CASE`), runs
    `child(CASE)`; as the parent, runs each of `cases` in a child and
    `check(case, result)`, which prints its line and says whether the case
    passed. Exits non-zero when one failed or did not run."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    failed = False
    for case in cases:
        result, _ = run_case(script, "--child", case)
        failed |= result is None or not check(case, result)
    sys.exit(1 if failed else 0)
