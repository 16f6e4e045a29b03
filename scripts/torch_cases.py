"""What the GPU checks of PyTorch share: each case (an allocator) runs in
a Python process of its own, since PyTorch takes its allocator once per
process, and prints one `RESULT {json}` line for the parent to read."""

import json
import subprocess
import sys


def report(result):
    """The child's side: prints its one result line."""
    print("RESULT " + json.dumps(result), flush=True)


def run_case(script, flag, case):
    """Runs `script flag case` in a new Python process. Returns its result
    (a dict; `None` when it failed to run, having printed why) and the
    finished process, for its log."""
    proc = subprocess.run([sys.executable, str(script), flag, case], capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {case}: failed to run (exit {proc.returncode})\n{proc.stderr[-3000:]}")
        return None, proc
    return json.loads(lines[-1][len("RESULT "):]), proc
