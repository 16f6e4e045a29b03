"""What a step layout costs a marked trace by splitting the step's
allocations from the rest (Note [Step layouts]): a layout holds, in its
region, the allocations made and freed within one step; everything else
(weights, optimizer state, what one step leaves to the next) stays on the
heap beside it. The region is as large as the peak of the step's own
allocations, the heap as the peak of the rest, and the two peaks need
not come together:

    python3 scripts/step_split.py TRACE [--step K]

prints, for step K (by default the third from the last: a step in the
steady state), the peak of its own allocations, the peak of the rest
(and what the rest held at the mark, and of that what the step before
made and this one frees: carried across the mark), their sum, the peak
of both together, and the sum over that peak: what a perfect layout
beside a perfect heap would cost over the trace's footprint floor.

    python3 scripts/step_split.py TRACE --shift N
    python3 scripts/step_split.py TRACE --best-shifts 5

weigh the step as if each mark came N operations later; the second
tries every shift within the step and prints the five whose split
costs least, the largest own peak first among equals."""

from __future__ import annotations

import argparse
import gzip
from collections.abc import Iterator
from typing import NamedTuple

MIB = 1 << 20


def operations(path: str) -> Iterator[list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].startswith("#"):
                yield fields


class Split(NamedTuple):
    """The peaks of one window of operations, in bytes: of the allocations
    made and freed within it, of the rest, and of both together; what the
    rest held as the window opened, and of that what the window before (as
    long) made and this one frees."""

    own: int
    rest: int
    both: int
    at_start: int
    carried: int

    @property
    def cost(self) -> float:
        return (self.own + self.rest) / self.both


def split(ops: list[list[str]], lo: int, hi: int, made: dict, freed: dict, size: dict) -> Split:
    """The split of the window `ops[lo:hi]`; `made` and `freed` give each
    allocation's operation index (freed: absent if never)."""
    live_at_start = [a for a, at in made.items() if at < lo and freed.get(a, len(ops)) > lo]
    rest = sum(size[a] for a in live_at_start)
    before = lo - (hi - lo)
    carried = sum(size[a] for a in live_at_start if made[a] >= before and freed.get(a, len(ops)) < hi)
    own, own_peak, rest_peak, both_peak = 0, 0, rest, rest
    at_start = rest
    for i in range(lo, hi):
        op = ops[i]
        if op[0] == "s":
            continue
        a = op[1]
        within = made[a] >= lo and freed.get(a, len(ops)) < hi
        delta = size[a] if op[0] == "a" else -size[a]
        if within:
            own += delta
        else:
            rest += delta
        own_peak, rest_peak, both_peak = max(own_peak, own), max(rest_peak, rest), max(both_peak, own + rest)
    return Split(own_peak, rest_peak, both_peak, at_start, carried)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--step", type=int, help="the step to weigh, from 0 (default: the third from the last)")
    shifting = p.add_mutually_exclusive_group()
    shifting.add_argument("--shift", type=int, default=0, help="weigh the step as if each mark came N operations later")
    shifting.add_argument("--best-shifts", type=int, metavar="N", help="print the N shifts whose split costs least")
    args = p.parse_args()
    ops = list(operations(args.trace))
    marks = [i for i, op in enumerate(ops) if op[0] == "s"]
    made, freed, size = {}, {}, {}
    for i, op in enumerate(ops):
        if op[0] == "a":
            made[op[1]], size[op[1]] = i, int(op[2])
        elif op[0] == "f":
            freed[op[1]] = i
    steps = len(marks)
    if steps < 2:
        raise SystemExit(f"{args.trace}: {steps} step marks; a split needs a step between two")
    k = steps - 3 if args.step is None else args.step
    if not 0 < k < steps:
        raise SystemExit(f"--step {k}: the trace's whole steps are 1 to {steps - 1}")
    start, end = marks[k - 1], marks[k]
    if args.best_shifts is not None and args.best_shifts < 1:
        raise SystemExit(f"--best-shifts {args.best_shifts}: at least 1")
    if args.best_shifts is None:
        if not 0 <= args.shift < end - start or end + args.shift > len(ops):
            raise SystemExit(f"--shift {args.shift}: step {k} has {end - start} operations")
        shifts = [args.shift]
    else:
        shifts = range(0, min(end - start, len(ops) - end))
    found = [(shift, split(ops, start + shift, end + shift, made, freed, size)) for shift in shifts]
    if args.best_shifts is not None:
        found = sorted(found, key=lambda f: (round(f[1].cost, 4), -f[1].own))[: args.best_shifts]
    for shift, s in found:
        print(
            f"{args.trace}: step {k} of {steps}, marks {shift} operations later: "
            f"its own allocations' peak {s.own / MIB:.1f} MiB, "
            f"the rest's {s.rest / MIB:.1f} (at the mark {s.at_start / MIB:.1f}, "
            f"{s.carried / MIB:.1f} of it carried across), "
            f"sum {(s.own + s.rest) / MIB:.1f}, both together {s.both / MIB:.1f}: {s.cost:.4f}"
        )


if __name__ == "__main__":
    main()
