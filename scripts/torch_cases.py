"""What the GPU checks of PyTorch share: each case (an allocator) runs in
a Python process of its own, since PyTorch takes its allocator once per
process, and prints one `RESULT {json}` line for the parent to read."""

import json
import subprocess
import sys


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
        proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {label}: failed to run (no result in {timeout} s)", flush=True)
        return None, None
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        print(f"  {label}: failed to run (exit {proc.returncode})\n{tail}", flush=True)
        return None, proc
    return json.loads(lines[-1][len("RESULT "):]), proc
