#!/usr/bin/env python3
"""NCCL all-reduce over vmpool memory, on every GPU of the machine (or
--nproc), two `torchrun --nproc_per_node=N` runs one after the other:

    table  PyTorch's allocator current: all-reduce bus bandwidth (and
           algorithm bandwidth) from 1 MiB to 1 GiB, in one run, over
             native          PyTorch's own memory
             vmpool          a torch.cuda.MemPool whose segments vmpool
                             allocates (vmpool.torch.allocator()), not
                             registered
             vmpool+reg      the same, each buffer registered with the
                             communicator by vmpool.torch.register
             vmpool+pg-reg   the same, the pool registered by PyTorch
                             (ProcessGroupNCCL.register_mem_pool), where
                             this PyTorch can
           Every buffer's first all-reduce is checked (rank r adds r + 1).
    remap  vmpool.torch.install(): the pool fragmented (every other 4 MiB
           tensor freed, some of them registered, used and deregistered
           first), then a 64 MiB buffer that growth assembles from the
           moved chunks (vmpool's `remaps` must grow), registered, and an
           all-reduce over it checked; three rounds.

    python3 scripts/nccl_bandwidth.py [--nproc N] [--max-mib 1024]

VMPOOL_HANDLE_TYPE=posix_fd (exportable chunks) and NCCL_CUMEM_ENABLE=1 in
both; NVLink multicast off. One rank runs every call (registration
included; bus bandwidth is 0 there by definition). Exits non-zero when a
run fails or a result is wrong.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_CUMEM_ENABLE": "1",
    "VMPOOL_HANDLE_TYPE": "posix_fd",
}
MIB = 1 << 20


def setup(install):
    sys.path.insert(0, str(HERE.parent / "python"))
    sys.path.insert(0, str(HERE))
    import vmpool_torch  # noqa: F401  (the package, from python/ or installed)

    if install:
        vmpool_torch.install()
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    # A first collective creates the communicator vmpool registers with.
    probe = torch.ones(1, device=dev)
    dist.all_reduce(probe)
    return torch, dist, dev


def check(torch, dist, buf, what):
    """Rank r writes r + 1; after a sum every element is n(n+1)/2."""
    n, r = dist.get_world_size(), dist.get_rank()
    buf.fill_(r + 1)
    dist.all_reduce(buf)
    want = n * (n + 1) / 2
    bad = int((buf != want).sum().item())
    if bad:
        raise SystemExit(f"rank {r}: {what}: {bad} of {buf.numel()} elements differ from {want}")


def timed(torch, dist, buf, size):
    for _ in range(3):
        dist.all_reduce(buf)
    iters = max(5, min(40, (4 << 30) // size))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    n = dist.get_world_size()
    alg = size / seconds / 1e9
    return alg * 2 * (n - 1) / n, alg


def table(args):
    torch, dist, dev = setup(install=False)
    import vmpool.torch
    from vmpool import nccl

    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    pluggable = vmpool.torch.allocator().allocator()
    sizes = [MIB << k for k in range(args.max_mib.bit_length()) if MIB << k <= args.max_mib * MIB]
    kinds = ["native", "vmpool", "vmpool+reg", "vmpool+pg-reg"]
    figures = {}
    notes = []
    for kind in kinds:
        pool = None if kind == "native" else torch.cuda.MemPool(pluggable)
        if kind == "vmpool+pg-reg":
            try:
                pg._get_backend(dev).register_mem_pool(pool)
            except Exception as e:  # reported; the column stays empty
                notes.append(f"vmpool+pg-reg: register_mem_pool refused: {type(e).__name__}: {e}")
                continue
        taken = 0
        for size in sizes:
            if pool is None:
                buf = torch.empty(size // 4, dtype=torch.float32, device=dev)
            else:
                with torch.cuda.use_mem_pool(pool):
                    buf = torch.empty(size // 4, dtype=torch.float32, device=dev)
            reg = vmpool.torch.register(buf, pg) if kind == "vmpool+reg" else None
            taken += bool(reg and reg.registered)
            check(torch, dist, buf, f"{kind} {size // MIB} MiB")
            figures[kind, size] = timed(torch, dist, buf, size)
            if reg:
                torch.cuda.synchronize()
                reg.deregister()
            del buf
        if kind == "vmpool+reg":
            notes.append(f"vmpool+reg: NCCL took {taken} of {len(sizes)} registrations")
        if kind == "vmpool+pg-reg":
            pg._get_backend(dev).deregister_mem_pool(pool)
        del pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if rank == 0:
        version = nccl.NcclLibrary.loaded().version()
        print(f"# all-reduce, float32 sum, {n} rank(s), NCCL {'.'.join(map(str, version))}: bus GB/s (algorithm GB/s)")
        print(f"{'size':>9}" + "".join(f"{k:>22}" for k in kinds))
        for size in sizes:
            cells = [figures.get((k, size)) for k in kinds]
            row = "".join(f"{'-':>22}" if c is None else f"{c[0]:>11.1f} ({c[1]:>7.1f})" for c in cells)
            print(f"{size // MIB:>5} MiB{row}")
        for note in notes:
            print(note)
        print(f"every buffer's all-reduce checked: {len(figures)} buffers right")
    dist.destroy_process_group()


def remap(args):
    torch, dist, dev = setup(install=True)
    import vmpool.torch

    rank, pg = dist.get_rank(), dist.group.WORLD
    piece = 4 * MIB
    for round_ in range(3):
        # Unused memory goes back first, so that no free range left by the
        # round before holds the large buffer without a growth.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = vmpool.torch.stats(dev).remaps
        pieces = [torch.empty(piece // 4, dtype=torch.float32, device=dev) for _ in range(32)]
        # Some of the pieces that will go are registered and used first, so
        # that chunks registered at one address are moved to another.
        for i in range(0, 8, 2):
            with vmpool.torch.register(pieces[i], pg):
                check(torch, dist, pieces[i], f"round {round_}: piece {i}")
                torch.cuda.synchronize()
        pieces = [p for i, p in enumerate(pieces) if i % 2]
        torch.cuda.synchronize()
        vmpool.torch.synchronize(dev)
        big = torch.empty(16 * piece // 4, dtype=torch.float32, device=dev)
        remaps = vmpool.torch.stats(dev).remaps - before
        if remaps == 0:
            raise SystemExit(f"rank {rank}: round {round_}: the 64 MiB buffer was not assembled from moved chunks")
        with vmpool.torch.register(big, pg) as reg:
            check(torch, dist, big, f"round {round_}: 64 MiB on remapped chunks")
            torch.cuda.synchronize()
        if rank == 0:
            print(
                f"round {round_}: 64 MiB buffer after {remaps} remap(s), registered={reg.registered}, all-reduce right",
                flush=True,
            )
        del big, pieces
    if rank == 0:
        print(vmpool.torch.summary(dev))
    dist.destroy_process_group()


def driver(args):
    import torch

    nproc = args.nproc or torch.cuda.device_count()
    env = dict(os.environ, **ENV)
    status = 0
    for phase in ("table", "remap"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += [__file__, "--phase", phase, "--max-mib", str(args.max_mib)]
        print(f"# {phase}: torchrun --nproc_per_node={nproc}", flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        print(f"# {phase}: exit {rc}", flush=True)
        status |= rc != 0
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU)")
    parser.add_argument("--max-mib", type=int, default=1024, help="largest buffer, MiB (a power of two)")
    parser.add_argument("--phase", choices=["table", "remap"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "table":
        table(args)
    elif args.phase == "remap":
        remap(args)
    else:
        return driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
