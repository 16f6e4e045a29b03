#!/usr/bin/env python3
"""GPT-2 small training over NCCL on every GPU of the machine (or --nproc),
DDP and FSDP2 (`fully_shard`), under native PyTorch (its default and its
expandable segments) and under vmpool (`vmpool.torch.install()` in every
rank): each (mode, allocator) a `torchrun --nproc_per_node=N` run of its
own, one after another, the same seeds and batches. Prints each run's loss
per step, then per mode and rank the footprint (peak reserved and peak
allocated, vmpool's over native's best) and the median step time, and
exits non-zero when a run fails or vmpool's losses differ from native's.

    python3 scripts/torch_ddp.py [--nproc N] [--steps 30] [--modes ddp,fsdp]

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its PyTorch and NVSHMEM
switches). One GPU runs the one-rank case (a process group of one).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALLOCATORS = {
    "native": {},
    "native-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "vmpool": {},
}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WARMUP = 5


def worker(args):
    sys.path.insert(0, str(HERE.parent / "python"))
    sys.path.insert(0, str(HERE))
    if args.allocator == "vmpool":
        import vmpool_torch

        vmpool_torch.install()
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()

    torch.manual_seed(0)
    # No dropout, eager attention: the losses depend on the data alone.
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).to(dev)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[local])
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(1000 + rank)
    shapes = [(4, 512), (8, 256), (4, 1024), (8, 512), (2, 1024)]
    losses, times = [], []
    for step in range(args.steps):
        batch, seq = shapes[step % len(shapes)]
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(dev)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        value = mean.item()
        times.append(time.perf_counter() - start)
        losses.append(value)
        if rank == 0:
            print(f"  {args.mode} {args.allocator} step {step}: loss {value:.6f} {times[-1] * 1e3:.1f} ms", flush=True)
    result = {
        "rank": rank,
        "world": world,
        "losses": losses,
        "times": times,
        "peak_reserved": torch.cuda.max_memory_reserved(dev),
        "peak_allocated": torch.cuda.max_memory_allocated(dev),
    }
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(nproc, mode, allocator, steps, out):
    env = dict(os.environ, **NO_MULTICAST, **ALLOCATORS[allocator])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [__file__, "--worker", "--mode", mode, "--allocator", allocator, "--steps", str(steps), "--out", out]
    print(f"# {mode} {allocator}: torchrun --nproc_per_node={nproc}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def gib(n):
    return f"{n / 2**30:.3f}"


def driver(args):
    import torch

    nproc = args.nproc or torch.cuda.device_count()
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for mode in args.modes.split(","):
            for allocator in ALLOCATORS:
                out = f"{tmp}/{mode}-{allocator}"
                if launch(nproc, mode, allocator, args.steps, out) != 0:
                    failed.append(f"{mode} {allocator}: the run failed")
                    continue
                runs[mode, allocator] = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
        print(f"\n# summary: {nproc} rank(s), {args.steps} steps, step time the median after {WARMUP} steps")
        print(
            "mode  allocator           rank  peak reserved GiB  peak allocated GiB  vs best native  step ms  vs native"
        )
        for (mode, allocator), ranks in runs.items():
            native = runs.get((mode, "native"))
            natives = [runs[mode, a] for a in ALLOCATORS if a != "vmpool" and (mode, a) in runs]
            for r in ranks:
                step = statistics.median(r["times"][WARMUP:] or r["times"])
                best = min(n[r["rank"]]["peak_reserved"] for n in natives) if natives else 0
                ratio = f"{r['peak_reserved'] / best:.3f}" if best else "-"
                base = statistics.median(native[r["rank"]]["times"][WARMUP:]) if native else 0
                vs = f"{step / base:.3f}" if base else "-"
                print(
                    f"{mode:5} {allocator:18} {r['rank']:4}  {gib(r['peak_reserved']):>17}  "
                    f"{gib(r['peak_allocated']):>18}  {ratio:>14}  {step * 1e3:7.1f}  {vs:>9}"
                )
            if native and allocator != "native":
                if ranks[0]["losses"] != native[0]["losses"]:
                    diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], native[0]["losses"]))
                    failed.append(f"{mode} {allocator}: losses differ from native's (max {diff:.3g})")
                else:
                    print(f"{mode} {allocator}: losses equal to native's, all {len(native[0]['losses'])} steps")
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", default="ddp,fsdp")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=list(ALLOCATORS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
