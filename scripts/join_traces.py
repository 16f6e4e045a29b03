#!/usr/bin/env python3
"""Joins traces into one, run after run, as one program that runs them in
turn on one pool: a long run whose steps change shape (the seeds of one
workload, each drawing its own shapes) out of recordings of 24 steps.

Each trace's allocation ids are moved past the ones before, and what a
trace leaves live at its end is freed there, so the next starts on a pool
holding none of it. Step marks (`s` lines) pass through.

    python3 scripts/join_traces.py OUT TRACE [TRACE ...]
"""

from __future__ import annotations

import argparse
import gzip


def join(out: str, traces: list[str]) -> None:
    offset = 0
    with gzip.open(out, "wt") as w:
        for index, path in enumerate(traces):
            top = 0
            live: dict[int, str] = {}
            with gzip.open(path, "rt") as f:
                for line in f:
                    fields = line.split()
                    if not fields:
                        continue
                    if fields[0] == "#":
                        if index == 0:
                            w.write(line)
                        continue
                    if fields[0] == "a":
                        ident = int(fields[1])
                        top = max(top, ident)
                        live[ident] = fields[3]
                        fields[1] = str(ident + offset)
                    elif fields[0] == "f":
                        ident = int(fields[1])
                        live.pop(ident, None)
                        fields[1] = str(ident + offset)
                    w.write(" ".join(fields) + "\n")
            for ident, stream in sorted(live.items()):
                w.write(f"f {ident + offset} {stream}\n")
            offset += top + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the joined trace (.trace.gz)")
    p.add_argument("traces", nargs="+", help="traces to join, in order (.trace.gz)")
    args = p.parse_args()
    join(args.out, args.traces)


if __name__ == "__main__":
    main()
