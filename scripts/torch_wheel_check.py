#!/usr/bin/env python3
"""Checks, on the GPU machine, the wheel as a user gets it: installed with
`pip install --no-deps --no-index` into a fresh virtual environment (which
sees the machine's PyTorch: --system-site-packages, as the machine has no
network), then GPT-2 training steps (transformers' GPT2LMHeadModel, eager
attention, deterministic kernels) in one process per case:

    native     PyTorch's own allocator, for reference
    install    import vmpool.torch; vmpool.torch.install()
    launcher   python -m vmpool.torch CHILD (no code change)
    script     the vmpool-torch console script, the same way

Each vmpool case checks that the package came from the wheel with its own
library, of the same version, that PyTorch's statistics are vmpool's, and
that `vmpool.alloc()` past the device raises `torch.OutOfMemoryError`. The
losses must equal native's, step for step. Each records the memory history
(install: `vmpool.torch.record_history`; launcher and script: PyTorch's own
`torch.cuda.memory._record_memory_history`, which install() redirects),
dumps the snapshot after `empty_cache()`, and has `torch.cuda._memory_viz`
draw it: snapshot-CASE.html in --out, with segment_map and segment_unmap.

    python3 scripts/torch_wheel_check.py [--wheel PATH] [--steps N] [--out DIR]

The wheel defaults to the one beside this script (scripts/gpu-build.sh puts
it in gpu-bundle/torch/). Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs in the fresh environment, from a folder with nothing else in it, so
# that `import vmpool` can only find the installed wheel.
CHILD = r"""
import json, os, pickle, random, sys
case, steps = sys.argv[1], int(sys.argv[2])
out = os.environ["CHECK_OUT"]
if case == "install":
    import vmpool.torch
    vmpool.torch.install()
    vmpool.torch.record_history(True, max_entries=1_000_000)
import torch
if case in ("launcher", "script"):
    # The launcher installed vmpool: PyTorch's own calls record its history.
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
from transformers import GPT2Config, GPT2LMHeadModel

torch.backends.cudnn.benchmark = False
torch.use_deterministic_algorithms(True, warn_only=True)
dev = torch.device("cuda")
torch.manual_seed(0)
torch.cuda.manual_seed(0)
rng = random.Random(0)
config = GPT2Config()
config._attn_implementation = "eager"
model = GPT2LMHeadModel(config).to(dev)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
losses = []
for _ in range(steps):
    batch, seq = rng.choice([2, 4, 8]), rng.choice([128, 256, 512, 1024])
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
result = {"case": case, "losses": losses}
if case != "native":
    import vmpool, vmpool.torch
    s = vmpool.torch.stats()
    result.update(
        module=vmpool.__file__,
        library=vmpool.library_path(),
        version=vmpool.__version__,
        library_version=vmpool.library_version(),
        backend=vmpool.backend(),
        allocations=s.allocations,
        used_bytes=s.used_bytes,
        torch_allocated=torch.cuda.memory_allocated(),
        reserved_bytes=s.reserved_bytes,
        torch_reserved=torch.cuda.memory_reserved(),
        summary=torch.cuda.memory_summary(),
    )
    try:
        vmpool.alloc(1 << 50)
        result["oom"] = "no error"
    except torch.OutOfMemoryError as e:
        result["oom"] = "torch.OutOfMemoryError: " + str(e)
    except Exception as e:
        result["oom"] = type(e).__name__ + ": " + str(e)
    del model, opt, ids, loss
    torch.cuda.empty_cache()
    result["reserved_after_empty_cache"] = vmpool.torch.stats().reserved_bytes
    # The snapshot, written as each route writes it, read and drawn by
    # PyTorch's own tools.
    path = os.path.join(out, f"snapshot-{case}.pickle")
    if case == "install":
        vmpool.torch.dump_snapshot(path)
    else:
        torch.cuda.memory._dump_snapshot(path)
    from torch.cuda import _memory_viz
    with open(path, "rb") as f:
        snap = pickle.load(f)
    actions = {}
    for trace in snap["device_traces"]:
        for e in trace:
            actions[e["action"]] = actions.get(e["action"], 0) + 1
    result["snapshot_actions"] = actions
    result["snapshot_segments"] = len(snap["segments"])
    html = _memory_viz.trace_plot(snap)
    with open(os.path.join(out, f"snapshot-{case}.html"), "w") as f:
        f.write(html)
    result["snapshot_html_bytes"] = len(html)
    result["segsum"] = _memory_viz.segsum(snap).splitlines()[-12:-9]
    os.remove(path)
print("RESULT " + json.dumps(result), flush=True)
"""


def run(cmd, env, cwd, timeout=900):
    print("$ " + " ".join(map(str, cmd)), flush=True)
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(out.stderr[-4000:])
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
        print(line)
    print(f"exit {out.returncode}, no result", flush=True)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="where wheel_check.json goes")
    args = parser.parse_args()
    wheel = args.wheel or next(iter(sorted(HERE.glob("vmpool-*.whl"))), None)
    if wheel is None:
        sys.exit("no wheel: build it (scripts/gpu-build.sh, or pip wheel --no-deps .) or pass --wheel")

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        py = venv / "bin" / "python"
        # When this interpreter is itself a virtual environment (the GPU
        # machine's is), --system-site-packages reaches the base Python's
        # packages, not its own: a .pth file adds them, after the new
        # environment's own, so that the wheel's vmpool comes first.
        purelib = subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        Path(purelib, "machine_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        install = [py, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)]
        print("$ " + " ".join(map(str, install)), flush=True)
        subprocess.run(install, check=True)
        child = tmp / "child.py"
        child.write_text(CHILD)
        env = {k: v for k, v in os.environ.items() if k not in ("VMPOOL_LIB", "PYTHONPATH", "VMPOOL_BACKEND")}
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        out = args.out or tmp
        out.mkdir(parents=True, exist_ok=True)
        env["CHECK_OUT"] = str(out)
        steps = str(args.steps)
        commands = {
            "native": [py, child, "native", steps],
            "install": [py, child, "install", steps],
            "launcher": [py, "-m", "vmpool.torch", child, "launcher", steps],
            "script": [venv / "bin" / "vmpool-torch", child, "script", steps],
        }
        results = {case: run(cmd, env, tmp) for case, cmd in commands.items()}

        native = results["native"]
        if native is None:
            failures.append("native: no result")
        for case in ("install", "launcher", "script"):
            r = results[case]
            if r is None:
                failures.append(f"{case}: no result")
                continue
            checks = {
                "the package is the installed wheel": r["module"].startswith(str(venv)),
                "the library is the wheel's": r["library"].startswith(str(venv)),
                "one version": r["version"] == r["library_version"],
                "the CUDA backend": r["backend"] == "cuda",
                "vmpool allocated the tensors": r["allocations"] > 0,
                "memory_allocated() is vmpool's": r["torch_allocated"] == r["used_bytes"],
                "memory_reserved() is vmpool's": r["torch_reserved"] == r["reserved_bytes"],
                "out of memory is torch.OutOfMemoryError": r["oom"].startswith("torch.OutOfMemoryError"),
                "losses equal native's": native is not None and r["losses"] == native["losses"],
                "the snapshot has allocations and frees": all(
                    r["snapshot_actions"].get(a, 0) > 0 for a in ("alloc", "free_requested", "free_completed")
                ),
                "the snapshot has a remap (segment_unmap and segment_map)": all(
                    r["snapshot_actions"].get(a, 0) > 0 for a in ("segment_map", "segment_unmap")
                ),
                "the snapshot has its out-of-memory refusal": r["snapshot_actions"].get("oom", 0) > 0,
                "memory_viz drew it": r["snapshot_html_bytes"] > 0,
            }
            for what, ok in checks.items():
                print(f"{case}: {what}: {'ok' if ok else 'FAILED'}")
                if not ok:
                    failures.append(f"{case}: {what}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wheel_check.json").write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    for case, r in results.items():
        if r:
            print(f"{case}: losses {r['losses']}")
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
