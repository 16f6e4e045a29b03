#!/usr/bin/env python3
"""Checks, on the GPU, the steps `vmpool_torch.install()` marks under the
real PyTorch: one mark an iteration, so that a loop whose steps repeat is
laid out (Note [Step layouts] in docs/DESIGN.md). The Python package's
tests check the same against a stand-in for PyTorch; this is the real
optimizer hooks and `torch.amp.GradScaler`. Each case runs in a process
of its own, vmpool installed, a small model on fixed shapes:

    one-optimizer   AdamW over an MLP, ITERATIONS steps
    two-optimizers  a GAN's loop: a discriminator's AdamW step, then a
                    generator's, each iteration
    grad-scaler     fp16 autocast under a GradScaler whose first scale
                    overflows, so that it skips the optimizer's step
                    (no optimizer hook runs) until the scale has come down,
                    and again whenever it grows too far

    python3 scripts/torch_marks.py

Each case passes when the pool counts the steps expected, has made a
layout, and served allocations from it; grad-scaler also needs skipped
steps, or it proves nothing. Exits non-zero otherwise. Expected: one mark
an iteration, the last waiting for an allocation that does not come
(ITERATIONS - 1); with two optimizers, a mark at each of the first four
optimizer steps, until their order has repeated twice, then one an
iteration (ITERATIONS + 1).
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torch_cases import report, run_checks, torch_for  # noqa: E402

ITERATIONS = 40
EXPECTED_STEPS = {
    "one-optimizer": ITERATIONS - 1,
    "two-optimizers": ITERATIONS + 1,
    "grad-scaler": ITERATIONS - 1,
}
CASES = list(EXPECTED_STEPS)
BATCH, WIDTH = 256, 1024


def mlp(nn, width_in, width_out, device):
    return nn.Sequential(nn.Linear(width_in, WIDTH), nn.ReLU(), nn.Linear(WIDTH, width_out)).to(device)


def train(torch, case, device, iterations=ITERATIONS):
    """Runs `case`'s loop on `device`; returns how many of its steps the
    GradScaler skipped (0 but for grad-scaler). scripts/torch_cpu_checks.py
    runs it on the CPU too."""
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    skipped = 0
    if case == "one-optimizer":
        model = mlp(nn, WIDTH, WIDTH, device)
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(iterations):
            x = torch.randn(BATCH, WIDTH, device=device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif case == "two-optimizers":
        generator, discriminator = mlp(nn, 64, WIDTH, device), mlp(nn, WIDTH, 1, device)
        opt_g = torch.optim.AdamW(generator.parameters())
        opt_d = torch.optim.AdamW(discriminator.parameters())
        ones = torch.ones(BATCH, 1, device=device)
        for _ in range(iterations):
            real = torch.randn(BATCH, WIDTH, device=device)
            fake = generator(torch.randn(BATCH, 64, device=device))
            loss_d = F.binary_cross_entropy_with_logits(discriminator(real), ones) + (
                F.binary_cross_entropy_with_logits(discriminator(fake.detach()), 1 - ones)
            )
            loss_d.backward()
            opt_d.step()
            opt_d.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(discriminator(fake), ones).backward()
            opt_g.step()
            opt_g.zero_grad(set_to_none=True)
    else:
        model = mlp(nn, WIDTH, WIDTH, device)
        opt = torch.optim.AdamW(model.parameters())
        # 2^40 overflows fp16 gradients: the first steps are skipped, each
        # halving it, until they fit; doubling it every 4 good steps
        # overflows again now and then.
        scaler = torch.amp.GradScaler(device, init_scale=2.0**40, growth_interval=4)
        for _ in range(iterations):
            x = torch.randn(BATCH, WIDTH, device=device)
            with torch.autocast(device, dtype=torch.float16):
                loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
            opt.zero_grad(set_to_none=True)
    return skipped


def child(case):
    torch = torch_for("vmpool")
    import vmpool_torch

    skipped = train(torch, case, "cuda")
    torch.cuda.synchronize()
    stats = vmpool_torch.stats()
    report(
        {
            "case": case,
            "steps": stats.steps,
            "layouts": stats.step_layouts,
            "planned": stats.planned,
            "missed": stats.missed,
            "skipped": skipped,
        }
    )


def check(case, r):
    expected = EXPECTED_STEPS[case]
    ok = r["steps"] == expected and r["layouts"] >= 1 and r["planned"] > 0
    if case == "grad-scaler":
        ok &= r["skipped"] > 0
    print(
        f"{case:15} steps {r['steps']:3} (expected {expected}), layouts {r['layouts']}, "
        f"planned {r['planned']}, missed {r['missed']}, skipped by the scaler {r['skipped']}: "
        + ("ok" if ok else "FAIL"),
        flush=True,
    )
    return ok


def main():
    run_checks(__file__, child, CASES, check)


if __name__ == "__main__":
    main()
