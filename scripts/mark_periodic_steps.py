"""Marks the steps of a recorded trace whose steps repeat exactly (a
workload at fixed shapes: vit_train_torch, unet_train_torch), for traces
recorded before pools wrote step marks (`s` lines): a replay of the
result marks a step where the program would have (Note [Step layouts]).

    python3 scripts/mark_periodic_steps.py TRACE OUT

The period is the shortest number of operations after which the second
half of the trace repeats (allocations and frees of the same sizes, 98 %
of them: a few frees come in another order); steps end where the fewest bytes are live within a period (after
the optimizer step, before the next forward pass). A trace whose steps do
not repeat is refused."""

from __future__ import annotations

import gzip
import sys

# The share of operations that must repeat.
REPEATS = 0.98


def read(path: str) -> list[str]:
    with open(path, "rb") as head:
        gzipped = head.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rt") if gzipped else open(path) as f:
        return f.read().splitlines()


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, out = sys.argv[1:]
    lines = read(src)
    ops = [i for i, line in enumerate(lines) if line and line[0] in "af"]
    if any(line.split() == ["s"] for line in lines):
        raise SystemExit(f"{src} already marks its steps")
    # Each operation as a token: what it does and how many bytes.
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
    n = len(tokens)
    tail = n // 2

    def repeats(p: int, at: range) -> bool:
        return sum(tokens[i] == tokens[i + p] for i in at) >= REPEATS * len(at)

    # A few hundred places first, then every one.
    period = next(
        (
            p
            for p in range(16, n // 4)
            if repeats(p, range(tail, n - p, max(1, (n - p - tail) // 400))) and repeats(p, range(tail, n - p))
        ),
        None,
    )
    if period is None:
        raise SystemExit(f"{src}: its steps do not repeat")
    # Where a step ends: the fewest live bytes in the last whole period.
    last = range(n - 2 * period, n - period)
    phase = min(last, key=lambda i: live_after[i]) % period
    ends = {ops[i] for i in range(phase, n, period)}
    marked = []
    for i, line in enumerate(lines):
        marked.append(line)
        if i in ends:
            marked.append("s")
    with gzip.open(out, "wt") if out.endswith(".gz") else open(out, "w") as f:
        f.write("\n".join(marked) + "\n")
    print(f"{src}: {n} operations, a step every {period}; {len(ends)} steps marked in {out}")


if __name__ == "__main__":
    main()
