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
(and what the rest held at the mark), their sum, the peak of both
together, and the sum over that peak: what a perfect layout beside a
perfect heap would cost over the trace's footprint floor."""

from __future__ import annotations

import argparse
import gzip
from collections.abc import Iterator

MIB = 1 << 20


def operations(path: str) -> Iterator[list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].startswith("#"):
                yield fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--step", type=int, help="the step to weigh, from 0 (default: the third from the last)")
    args = p.parse_args()
    ops = list(operations(args.trace))
    # The step each allocation is made and freed in.
    step, made, freed, size = 0, {}, {}, {}
    for op in ops:
        if op[0] == "s":
            step += 1
        elif op[0] == "a":
            made[op[1]], size[op[1]] = step, int(op[2])
        elif op[0] == "f":
            freed[op[1]] = step
    steps = step
    if steps < 2:
        raise SystemExit(f"{args.trace}: {steps} step marks; a split needs a step between two")
    k = steps - 3 if args.step is None else args.step
    if not 0 < k < steps:
        raise SystemExit(f"--step {k}: the trace's whole steps are 1 to {steps - 1}")
    step, live, own, rest = 0, set(), 0, 0
    at_mark = own_peak = rest_peak = both_peak = 0
    for op in ops:
        if op[0] == "s":
            step += 1
            if step == k:
                rest = at_mark = sum(size[a] for a in live)
                rest_peak = both_peak = rest
            continue
        if step > k:
            break
        if step < k:
            if op[0] == "a":
                live.add(op[1])
            else:
                live.discard(op[1])
            continue
        within = made[op[1]] == k and freed.get(op[1]) == k
        delta = size[op[1]] if op[0] == "a" else -size[op[1]]
        if within:
            own += delta
        else:
            rest += delta
        own_peak, rest_peak, both_peak = max(own_peak, own), max(rest_peak, rest), max(both_peak, own + rest)
    print(
        f"{args.trace}: step {k} of {steps}: its own allocations' peak {own_peak / MIB:.1f} MiB, "
        f"the rest's {rest_peak / MIB:.1f} (at the mark {at_mark / MIB:.1f}), "
        f"sum {(own_peak + rest_peak) / MIB:.1f}, both together {both_peak / MIB:.1f}: "
        f"{(own_peak + rest_peak) / both_peak:.4f}"
    )


if __name__ == "__main__":
    main()
