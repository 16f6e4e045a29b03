#!/usr/bin/env python3
"""Replays every trace of docs/RESULTS.md's "Real traces miss it too" on the
host backend and sums them up: the footprint of the first pass and of the
last of several passes on one pool, the estimated driver time, and for
the traces of long runs (more than LONG_RUN steps marked) how many of the
first pass's steps after step 50 map chunks (issue 23's settling bar: under
5 %).

The set: training, the two reference traces (gpt2_train and resnet_train,
in the folder --shared DIR or VMPOOL_EXTRA_TRACES names), those recorded
under PyTorch (traces/*_train_torch*.trace.gz) and four variants of
gpt2_train (scripts/trace_variants.py); generation, the recorded
generation trace, four variants of it and the serving loop
(traces/serve_loop_torch.trace.gz). Each is replayed synchronously and
stream-ordered: 46 training replays and 12 generation ones today.

    cargo build --release -p vmpool-tools
    scripts/replay_suite.py [--passes 8] [--jobs 2] [-- VMPOOL-REPLAY OPTIONS]
    scripts/replay_suite.py -- --chunk-divisor 1024
"""

import argparse
import concurrent.futures
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# The step after which the settling bar counts, pytorch_compare.py's for
# its long runs (it imports torch only when it runs them).
from pytorch_compare import SETTLED  # noqa: E402

# A trace with more steps marked than this is a long run.
LONG_RUN = 100


def settling(result):
    """(steps after SETTLED that mapped chunks, steps after it) of a
    replay's first pass, or None for a trace that is no long run."""
    maps = result["step_maps"]
    if len(maps) <= LONG_RUN:
        return None
    later = maps[SETTLED:]
    return sum(1 for m in later if m > 0), len(later)


def variants(trace, outdir):
    """Four variants of `trace` in `outdir` (made once, then reused)."""
    base = os.path.basename(trace).split(".")[0]
    paths = [os.path.join(outdir, f"{base}_v{seed}.trace.gz") for seed in range(4)]
    if not all(os.path.exists(p) for p in paths):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "trace_variants.py"), trace, outdir, "4"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return paths


def replay(binary, trace, stream_ordered, passes, options):
    cmd = [binary, "--backend", "host", "--json", "--passes", str(passes), *options]
    if stream_ordered:
        cmd.append("--stream-ordered")
    out = subprocess.run([*cmd, trace], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} {trace} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=8, help="passes of the second replay of each trace (default 8)")
    p.add_argument("--jobs", type=int, default=2, help="replays at once (default 2)")
    p.add_argument("--replay", default=os.path.join(ROOT, "target", "release", "vmpool-replay"))
    p.add_argument("--shared", default=os.environ.get("VMPOOL_EXTRA_TRACES"), help="folder of the reference traces")
    p.add_argument("--variants", help="folder for the variants (default: a temporary one)")
    p.add_argument("options", nargs="*", help="passed to vmpool-replay (after --)")
    args = p.parse_args()
    if args.passes < 2:
        p.error("--passes must be at least 2")
    if not os.path.exists(args.replay):
        sys.exit(f"{args.replay} not found: cargo build --release -p vmpool-tools")
    if not args.shared:
        sys.exit("the reference traces: --shared DIR or VMPOOL_EXTRA_TRACES")
    shared = [os.path.join(args.shared, f"{name}.trace.gz") for name in ("gpt2_train", "resnet_train")]
    missing = [t for t in shared if not os.path.exists(t)]
    if missing:
        sys.exit(f"shared traces not found: {', '.join(missing)} (--shared DIR)")
    recorded = sorted(glob.glob(os.path.join(ROOT, "traces", "*_train_torch*.trace.gz")))
    generate = os.path.join(ROOT, "traces", "gpt2_generate.trace.gz")
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.variants or tmp
        training = shared + recorded + variants(shared[0], outdir)
        serving = os.path.join(ROOT, "traces", "serve_loop_torch.trace.gz")
        generation = [generate] + variants(generate, outdir) + [serving]
        jobs = [(t, so) for t in training + generation for so in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
            first = list(ex.map(lambda j: replay(args.replay, j[0], j[1], 1, args.options), jobs))
            last = list(ex.map(lambda j: replay(args.replay, j[0], j[1], args.passes, args.options), jobs))
    later = args.passes - 1
    rows = []
    for (trace, so), a, b in zip(jobs, first, last):
        name = os.path.basename(trace).split(".")[0]
        row = {
            "name": name,
            "generation": trace in generation,
            "first": a["ratio"],
            "last": b["pass_ratios"][-1],
            "est_first_ms": a["est_driver_us"] / 1000,
            "est_later_ms": (b["est_driver_us"] - a["est_driver_us"]) / later / 1000,
            "settling": settling(a),
        }
        rows.append(row)
        settled = ""
        if row["settling"]:
            mapping, steps = row["settling"]
            settled = f"  steps mapping after {SETTLED}: {mapping} of {steps} ({100 * mapping / steps:.1f} %)"
        print(
            f"{name:32} {'so' if so else 'sync':4} pass 1 {row['first']:.4f}  pass {args.passes} {row['last']:.4f}"
            f"  est. driver: pass 1 {row['est_first_ms']:7.1f} ms, later {row['est_later_ms']:6.1f} ms a pass{settled}"
        )
    training = [r for r in rows if not r["generation"]]
    generation = [r for r in rows if r["generation"]]
    for label, group in (("training", training), ("generation", generation)):
        firsts = [r["first"] for r in group]
        lasts = [r["last"] for r in group]
        print(
            f"{label}: pass 1 mean {statistics.mean(firsts):.4f} max {max(firsts):.4f}"
            f" (over 1.01: {sum(f > 1.01 for f in firsts)} of {len(group)});"
            f" pass {args.passes} mean {statistics.mean(lasts):.4f} max {max(lasts):.4f};"
            f" est. driver: pass 1 total {sum(r['est_first_ms'] for r in group):.0f} ms,"
            f" later {sum(r['est_later_ms'] for r in group):.1f} ms a pass"
        )
    long_runs = [r["settling"] for r in rows if r["settling"]]
    if long_runs:
        print(
            f"long runs: steps mapping after step {SETTLED}"
            f" {min(100 * m / n for m, n in long_runs):.1f}-{max(100 * m / n for m, n in long_runs):.1f} %"
            f" (under 5 %: {sum(m * 20 < n for m, n in long_runs)} of {len(long_runs)})"
        )


if __name__ == "__main__":
    main()
