"""How many kinds of step a trace with step marks (`s` lines) makes, and what
a cache of step layouts keyed by the step would serve.

    python3 scripts/step_kinds.py [--after 50] TRACE...

A pool lays out a step once the step before made the same calls (Note
[Step layouts] in docs/DESIGN.md); at shapes drawn from a few choices (a
batch size and a length each step) the steps come in a few kinds, in no
order. Per trace it prints:
- the steps, and the kinds of step: the same calls in the same order (an
  allocation, or the free of the allocation made so many before) with
  the same sizes, and the kinds of calls, sizes aside;
- the steps after step AFTER that are the first of their kind: those a
  cache of one layout a kind could not serve (issue 23's bar: under 5 %
  of the steps after step 50 may call the driver);
- for a key made of a step's first K allocation sizes, how many keys
  name more than one kind of step: a cache must tell a step's kind by
  the time it places the allocation after the key."""

from __future__ import annotations

import argparse
import gzip
import signal
from collections import defaultdict

# The key lengths tried.
KEY_LENGTHS = (1, 2, 4, 8, 16)


def steps_of(path: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each step of the trace at `path` as (calls, allocation sizes): a call
    is -1 for an allocation, k for the free of the allocation made k
    allocations before it in the step, 0 for one made before the step."""
    steps = []
    made: dict[str, int] = {}
    calls: list[int] = []
    sizes: list[int] = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            fields = line.split()
            if not fields or fields[0] == "#":
                continue
            if fields[0] == "s":
                steps.append((tuple(calls), tuple(sizes)))
                made, calls, sizes = {}, [], []
            elif fields[0] == "a":
                made[fields[1]] = len(sizes)
                calls.append(-1)
                sizes.append(int(fields[2]))
            else:
                at = made.pop(fields[1], None)
                calls.append(0 if at is None else len(sizes) - at)
    if calls:
        steps.append((tuple(calls), tuple(sizes)))
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after", type=int, default=50, help="count first occurrences from this step on")
    p.add_argument("traces", nargs="+")
    args = p.parse_args()
    for path in args.traces:
        steps = steps_of(path)
        if len(steps) < 2:
            raise SystemExit(f"{path}: no step marks")
        first_at: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        for i, step in enumerate(steps):
            first_at.setdefault(step, i)
        later = len(steps) - args.after
        new_later = sum(1 for i in first_at.values() if i >= args.after)
        print(
            f"{path}: {len(steps)} steps, {len(first_at)} kinds "
            f"({len({calls for calls, _ in steps})} kinds of calls, sizes aside); "
            f"{len(steps) - len(first_at)} steps repeat an earlier one"
        )
        if later > 0:
            share = 100 * new_later / later
            print(f"  the first of their kind after step {args.after}: {new_later} of {later} ({share:.1f} %)")
        for k in KEY_LENGTHS:
            kinds_of = defaultdict(set)
            for step in first_at:
                kinds_of[step[1][:k]].add(step)
            shared = sum(1 for kinds in kinds_of.values() if len(kinds) > 1)
            print(f"  key of the first {k} allocation sizes: {len(kinds_of)} keys, {shared} naming more than one kind")


if __name__ == "__main__":
    # Piped into `head`, end quietly when the reader goes, as a shell tool does.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
