#!/usr/bin/env python3
"""Prints the plan figures of every trace, so that two builds can be diffed.

For each trace in traces/ and in the folder VMPOOL_EXTRA_TRACES names (or
--shared DIR), replayed synchronously and
stream-ordered, at 1 and 24 passes and at three growth settings (the
default, `--chunk-divisor off`, `--chunk-divisor 256`), one line of the
figures that do not depend on timing: footprint ratios of every pass,
peaks, chunks created and released, maps, unmaps, remaps, bytes remapped.
A change that must keep the allocator's behaviour keeps this output
byte for byte:

    cargo build --release -p vmpool-tools
    scripts/replay_plans.py > before.txt     # on the old commit
    scripts/replay_plans.py > after.txt      # on the new one
    diff before.txt after.txt
"""

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = (
    "pass_ratios",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "chunks_created",
    "chunks_released",
    "grows",
    "maps",
    "unmaps",
    "remaps",
    "bytes_remapped",
    "ops",
)
SETTINGS = ([], ["--chunk-divisor", "off"], ["--chunk-divisor", "256"])


def replay(binary, trace, mode, passes, setting):
    cmd = [binary, "--backend", "host", "--json", "--passes", str(passes), *setting, *mode, trace]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    figures = json.loads(out.stdout)
    picked = " ".join(f"{k}={figures[k]}" for k in FIELDS)
    label = " ".join(setting) or "default"
    return f"{os.path.basename(trace)} {'so' if mode else 'sync'} passes={passes} {label}: {picked}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replay", default=os.path.join(ROOT, "target", "release", "vmpool-replay"))
    p.add_argument(
        "--shared",
        default=os.environ.get("VMPOOL_EXTRA_TRACES"),
        help="folder of more traces (default: $VMPOOL_EXTRA_TRACES)",
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    if not os.path.exists(args.replay):
        sys.exit(f"{args.replay} not found: cargo build --release -p vmpool-tools")
    traces = sorted(glob.glob(os.path.join(ROOT, "traces", "*.trace.gz")))
    if args.shared:
        traces += sorted(glob.glob(os.path.join(args.shared, "*.trace.gz")))
    jobs = [
        (t, mode, passes, setting)
        for t in traces
        for mode in ([], ["--stream-ordered"])
        for passes in (1, 24)
        for setting in SETTINGS
    ]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        for line in ex.map(lambda j: replay(args.replay, *j), jobs):
            print(line)


if __name__ == "__main__":
    main()
