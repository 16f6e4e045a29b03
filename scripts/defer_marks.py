"""Moves a marked trace's step marks (`s` lines) as a pool would that
deferred each mark past the frees its step carries into the next, so
that a replay shows what the rule would do (docs/RESULTS.md, "Marks
deferred past the frees they carry"):

    python3 scripts/defer_marks.py TRACE OUT [--keep-last]

The rule: at a mark, if the step that ends freed an allocation of an
earlier step, and allocations it made are still live, the mark waits
until those are freed and goes to the next allocation; the trace's next
mark ends the wait (the mark is then made there). `--keep-last` leaves
the trace's last mark where it was recorded. It prints how many marks
moved and by how many operations."""

from __future__ import annotations

import argparse
import gzip
from collections import Counter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--keep-last", action="store_true", help="leave the last mark where it was recorded")
    args = p.parse_args()
    with gzip.open(args.trace, "rt") as f:
        lines = f.readlines()
    last_mark = max((i for i, line in enumerate(lines) if line.startswith("s")), default=-1)

    out: list[str] = []
    step = 0
    made_in: dict[str, int] = {}  # a live allocation's id: the step that made it
    freed_earlier = False  # the step freed an allocation of an earlier one
    waiting: set[str] | None = None  # what must be freed before the mark
    mark_next = False  # the mark goes to the next allocation
    since_mark = 0  # operations since the trace's mark that waits
    moved: Counter[int] = Counter()

    def mark() -> None:
        nonlocal step, freed_earlier, waiting, mark_next
        out.append("s\n")
        step += 1
        freed_earlier, waiting, mark_next = False, None, False

    for i, line in enumerate(lines):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            out.append(line)
            continue
        if fields[0] == "s":
            if waiting is not None or mark_next:
                mark()
            live = {a for a, s in made_in.items() if s == step}
            if freed_earlier and live and not (args.keep_last and i == last_mark):
                waiting, since_mark = live, 0
            else:
                mark()
            continue
        if fields[0] == "a":
            if mark_next:
                moved[since_mark] += 1
                mark()
            made_in[fields[1]] = step
        elif fields[0] == "f":
            made = made_in.pop(fields[1], None)
            if made is not None and made < step:
                freed_earlier = True
            if waiting is not None:
                waiting.discard(fields[1])
                if not waiting:
                    waiting, mark_next = None, True
        since_mark += 1
        out.append(line)

    with gzip.open(args.out, "wt") as f:
        f.writelines(out)
    shifts = ", ".join(f"{n} by {ops} operations" for ops, n in sorted(moved.items()))
    print(f"{args.trace}: marks moved: {shifts or 'none'}")


if __name__ == "__main__":
    main()
