#!/usr/bin/env python3
"""Makes "traces of the same kind" from a shared trace, to check that a
footprint figure is not an accident of one recording.

Every distinct allocation size is scaled by its own random factor in
[0.7, 1.3] (seeded), rounded to 512 bytes: the same program shape with other
tensor sizes, as another model width or batch mix would give.

    scripts/trace_variants.py TRACE OUTDIR [SEEDS]   (SEEDS default 4)
"""

import gzip
import os
import random
import sys


def main():
    src, outdir = sys.argv[1], sys.argv[2]
    seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    opener = gzip.open if src.endswith(".gz") else open
    with opener(src, "rt") as f:
        lines = f.read().splitlines()
    base = os.path.basename(src).split(".")[0]
    os.makedirs(outdir, exist_ok=True)
    for seed in range(seeds):
        rnd = random.Random(seed)
        factor = {}
        out = []
        for line in lines:
            fields = line.split()
            if fields and fields[0] == "a":
                size = int(fields[2])
                f = factor.setdefault(size, rnd.uniform(0.7, 1.3))
                scaled = max(512, int(size * f) // 512 * 512)
                out.append(f"a {fields[1]} {scaled} {fields[3]}")
            else:
                out.append(line)
        path = os.path.join(outdir, f"{base}_v{seed}.trace.gz")
        with gzip.open(path, "wt") as g:
            g.write("\n".join(out) + "\n")
        print(path)


if __name__ == "__main__":
    main()
