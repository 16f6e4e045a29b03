#!/usr/bin/env python3
"""Makes a long run out of short recordings: one model trained for STEPS
steps, each step drawn at random from the steady steps of traces of one
workload at other seeds. A host replay of it shows what a long run at
random shapes does to the pool (the creep and the steps that map after
step 50) without a GPU run of hundreds of steps recorded.

    python3 scripts/splice_steps.py --steps 300 --seed 1 OUT TRACE [TRACE ...]

Each TRACE must mark its steps (`s` lines; `scripts/mark_steps.py` adds
them to a trace recorded without). The first trace's first PROLOGUE
steps (the model built, its first steps, the optimizer's state made) are
kept whole; then every step is one drawn from all traces' steps after
their own first PROLOGUE, the last (cut short by the recording's end)
left out. A step's allocations get fresh ids. What a step leaves live at
its end (carried to the step after it in its recording) is freed there,
and a step's frees of allocations it did not make are dropped: its own
recording's step before is not the one before it here. What the
prologue leaves live and its recording's next step frees is freed at
the prologue's end; the rest (weights, optimizer state) lives
throughout.
"""

from __future__ import annotations

import argparse
import gzip
import random

Op = list[str]
Step = list[Op]


def read_steps(path: str) -> list[Step]:
    """The trace's operations, cut at its marks."""
    steps: list[Step] = [[]]
    with gzip.open(path, "rt") as f:
        for line in f:
            fields = line.split()
            if not fields or fields[0] == "#":
                continue
            if fields[0] == "s":
                steps.append([])
            else:
                steps[-1].append(fields)
    return steps


class Writer:
    """Fresh allocation ids, and the lines written so far."""

    def __init__(self) -> None:
        self.lines = ["# splice_steps.py: a <id> <bytes> <stream> | f <id> <stream> | s"]
        self.next_id = 0
        # Allocations that outlive the step that made them: their id in
        # the step's recording, their id here and stream.
        self.kept: dict[str, tuple[int, str]] = {}

    def step(self, ops: Step, drawn: bool) -> None:
        """Writes one step: a drawn one frees what it leaves live at its
        end and frees nothing it did not make (ids of another recording
        are not these); a prologue step keeps what it leaves live."""
        own: dict[str, tuple[int, str]] = {}
        for op in ops:
            if op[0] == "a":
                self.next_id += 1
                own[op[1]] = (self.next_id, op[3])
                self.lines.append(f"a {self.next_id} {op[2]} {op[3]}")
            elif op[0] == "f":
                made = own.pop(op[1], None)
                if made is None and not drawn:
                    made = self.kept.pop(op[1], None)
                if made is not None:
                    self.lines.append(f"f {made[0]} {op[2]}")
        if drawn:
            for ident, stream in own.values():
                self.lines.append(f"f {ident} {stream}")
        else:
            self.kept.update(own)
        self.lines.append("s")

    def free_kept(self, recorded: set[str]) -> None:
        """Frees the kept allocations whose recorded ids are in RECORDED."""
        for old in sorted(recorded & self.kept.keys()):
            ident, stream = self.kept.pop(old)
            self.lines.append(f"f {ident} {stream}")


def splice(out: str, traces: list[str], steps: int, seed: int, prologue: int) -> int:
    recorded = [read_steps(path) for path in traces]
    first = recorded[0]
    if len(first) <= prologue + 1:
        raise SystemExit(f"{traces[0]}: {len(first) - 1} marks, the prologue needs more than {prologue}")
    drawn = [step for trace in recorded for step in trace[prologue:-1]]
    if not drawn:
        raise SystemExit("no steady steps to draw from")
    writer = Writer()
    for step in first[:prologue]:
        writer.step(step, drawn=False)
    writer.free_kept({op[1] for op in first[prologue] if op[0] == "f"})
    rng = random.Random(seed)
    for _ in range(steps):
        writer.step(rng.choice(drawn), drawn=True)
    with gzip.open(out, "wt") as w:
        w.write("\n".join(writer.lines) + "\n")
    return len(drawn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the spliced trace (.trace.gz)")
    p.add_argument("traces", nargs="+", help="traces with step marks; the first gives the model")
    p.add_argument("--steps", type=int, default=300, help="steps drawn after the prologue (default 300)")
    p.add_argument("--seed", type=int, default=1, help="seed of the draw (default 1)")
    p.add_argument("--prologue", type=int, default=4, help="the first trace's steps kept whole (default 4)")
    args = p.parse_args()
    pool = splice(args.out, args.traces, args.steps, args.seed, args.prologue)
    print(f"{args.out}: {args.prologue} steps of {args.traces[0]}, then {args.steps} drawn from {pool}")


if __name__ == "__main__":
    main()
