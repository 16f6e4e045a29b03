"""Marks the steps of a trace recorded before pools wrote step marks (`s`
lines), so that a replay marks a step where the program would have (Note
[Step layouts]), and says how alike the steps are.

    python3 scripts/mark_steps.py TRACE OUT                 # steps that repeat exactly
    python3 scripts/mark_steps.py --anchor BYTES TRACE OUT  # one allocation of BYTES a step

Steps are found one of two ways:
- periodic (a workload at fixed shapes: vit_train_torch, unet_train_torch):
  the shortest number of operations after which the second half of the
  trace repeats, allocations and frees of the same sizes (98 % of them: a
  few frees come in another order); a trace whose steps do not repeat is
  refused;
- `--anchor BYTES` (shapes drawn at random: resnet50_train_torch with
  8192000): an allocation of that size made once a step, at steady
  spacing (check: not every size made once a step on average is).
Either way a step ends where the fewest bytes are live between two
starts (after the optimizer step, before the next forward pass).

It prints how many of the steps make the same calls in the same order
(their sizes aside) as an earlier step, and as the step just before: a
pool lays out a step that repeats the one before."""

from __future__ import annotations

import argparse
import gzip
from collections import Counter

# The share of operations that must repeat for a period.
REPEATS = 0.98


def read(path: str) -> list[str]:
    with open(path, "rb") as head:
        gzipped = head.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rt") if gzipped else open(path) as f:
        return f.read().splitlines()


def period_of(tokens: list[int]) -> int | None:
    """The shortest period of the second half of `tokens`, if any."""
    n, tail = len(tokens), len(tokens) // 2

    def repeats(p: int, at: range) -> bool:
        return sum(tokens[i] == tokens[i + p] for i in at) >= REPEATS * len(at)

    # A few hundred places first, then every one.
    return next(
        (
            p
            for p in range(16, n // 4)
            if repeats(p, range(tail, n - p, max(1, (n - p - tail) // 400))) and repeats(p, range(tail, n - p))
        ),
        None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchor", type=int, metavar="BYTES", help="an allocation of this size starts each step")
    p.add_argument("trace")
    p.add_argument("out")
    args = p.parse_args()
    lines = read(args.trace)
    if any(line.split() == ["s"] for line in lines):
        raise SystemExit(f"{args.trace} already marks its steps")
    ops = [i for i, line in enumerate(lines) if line and line[0] in "af"]
    # Each operation as a token: the bytes allocated, or freed (negative).
    sizes: dict[str, int] = {}
    tokens, live, live_after = [], 0, []
    for i in ops:
        fields = lines[i].split()
        if fields[0] == "a":
            sizes[fields[1]] = int(fields[2])
            tokens.append(int(fields[2]))
            live += int(fields[2])
        else:
            size = sizes.pop(fields[1])
            tokens.append(-size)
            live -= size
        live_after.append(live)
    if args.anchor is None:
        period = period_of(tokens)
        if period is None:
            raise SystemExit(f"{args.trace}: its steps do not repeat")
        starts = list(range(0, len(tokens), period))
        how = f"a step every {period} operations"
    else:
        starts = [i for i, t in enumerate(tokens) if t == args.anchor]
        if len(starts) < 3:
            raise SystemExit(f"{args.trace}: {len(starts)} allocations of {args.anchor} bytes")
        how = f"{len(starts)} allocations of {args.anchor} bytes"
    # A step ends where the fewest bytes are live between two starts.
    ends = [min(range(a, b), key=lambda i: live_after[i]) for a, b in zip(starts, starts[1:])]
    # What each step calls, its sizes aside: an allocation, or the free of
    # the allocation made so many allocations before.
    calls = []
    for a, b in zip(ends, ends[1:]):
        made: dict[str, int] = {}
        step = []
        for i in ops[a + 1 : b + 1]:
            fields = lines[i].split()
            if fields[0] == "a":
                made[fields[1]] = len(made)
                step.append(-1)
            else:
                step.append(len(made) - made[fields[1]] if fields[1] in made else -2)
        calls.append(tuple(step))
    marked_at = {ops[i] for i in ends}
    marked = []
    for i, line in enumerate(lines):
        marked.append(line)
        if i in marked_at:
            marked.append("s")
    with gzip.open(args.out, "wt") if args.out.endswith(".gz") else open(args.out, "w") as f:
        f.write("\n".join(marked) + "\n")
    kinds = Counter(calls)
    print(
        f"{args.trace}: {len(tokens)} operations, {how}; {len(ends)} steps marked in {args.out}. "
        f"Of {len(calls)} whole steps, {len(kinds)} kinds of calls (the most common {kinds.most_common(1)[0][1]} "
        f"times); {len(calls) - len(kinds)} repeat an earlier step, "
        f"{sum(x == y for x, y in zip(calls, calls[1:]))} the step just before"
    )


if __name__ == "__main__":
    main()
