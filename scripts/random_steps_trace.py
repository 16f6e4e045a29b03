#!/usr/bin/env python3
"""Writes a trace of a transformer's training at a batch and a sequence
length drawn at random each step, a step marked after each (`s` lines):
the case where GPT-2 under PyTorch, steps marked, kept re-making its
layout as new largest shapes came (docs/RESULTS.md, "Step layouts under
PyTorch, five workloads"), for the host to replay it at any length.

Weights and optimizer state are made first and live throughout. Each step
makes, per layer, the activations a forward pass keeps (attention scores
growing with the square of the length), the logits, then frees them in
reverse in the backward pass beside its temporaries and gradients. Batch
and length are drawn from 2-16 and 64-1024 under a budget of 8,192
tokens.

    python3 scripts/random_steps_trace.py --seed 1 --steps 300 OUT.trace.gz
    target/release/vmpool-replay --backend host --json OUT.trace.gz
"""

from __future__ import annotations

import argparse
import gzip
import random

LAYERS, WIDTH, HEADS, VOCAB = 12, 1024, 16, 50257
TOKEN_BUDGET = 8192


class Trace:
    """Allocation ids and the trace's lines, on stream 1."""

    def __init__(self) -> None:
        self.lines = ["# random_steps_trace.py: a <id> <bytes> <stream> | f <id> <stream> | s"]
        self.next_id = 0

    def alloc(self, size: int) -> int:
        self.next_id += 1
        self.lines.append(f"a {self.next_id} {size} 1")
        return self.next_id

    def free(self, ident: int) -> None:
        self.lines.append(f"f {ident} 1")


def step(t: Trace, batch: int, length: int) -> None:
    tokens = batch * length
    scores = batch * HEADS * length * length * 2
    kept = []
    x = t.alloc(tokens * WIDTH * 4)
    for _ in range(LAYERS):
        kept.append(
            [
                t.alloc(tokens * 3 * WIDTH * 2),
                t.alloc(scores),
                t.alloc(tokens * WIDTH * 2),
                t.alloc(tokens * 4 * WIDTH * 2),
                t.alloc(tokens * WIDTH * 4),
            ]
        )
    logits = t.alloc(tokens * VOCAB * 4)
    grads = [t.alloc(VOCAB * WIDTH * 4)]
    t.free(logits)
    for layer in reversed(kept):
        mlp_grad, score_grad = t.alloc(tokens * 4 * WIDTH * 2), t.alloc(scores)
        t.free(score_grad)
        t.free(mlp_grad)
        for ident in reversed(layer):
            t.free(ident)
        grads.append(t.alloc(12 * WIDTH * WIDTH * 4))
    t.free(x)
    for ident in grads:
        t.free(ident)
    t.lines.append("s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("out", help="the trace to write (.trace.gz)")
    args = p.parse_args()
    rnd = random.Random(args.seed)
    t = Trace()
    t.alloc(VOCAB * WIDTH * 4)
    for _ in range(LAYERS):
        t.alloc(12 * WIDTH * WIDTH * 4)
    t.alloc(VOCAB * WIDTH * 4 * 2)
    for _ in range(LAYERS):
        t.alloc(12 * WIDTH * WIDTH * 4 * 2)
    for _ in range(args.steps):
        batch, length = rnd.randint(2, 16), rnd.randint(64, 1024)
        while batch * length > TOKEN_BUDGET:
            batch //= 2
        step(t, batch, length)
    with gzip.open(args.out, "wt") as w:
        w.write("\n".join(t.lines) + "\n")


if __name__ == "__main__":
    main()
