#!/usr/bin/env python3
"""Checks, on the GPU, sleep and wake under PyTorch (`vmpool.torch.sleep`,
`wake`, `prepare_sleep`): a small transformer's outputs before a level-1
sleep, after `prepare_sleep` and after the wake are equal, as are its
parameters' checksums; a CUDA graph captured
before the sleep replays right after it; `torch.cuda.mem_get_info()` shows
the pool's memory free while asleep; an allocation while asleep fails; and
after a level-2 sleep (nothing kept) the weights loaded again give the
same outputs.

    python3 scripts/torch_sleep.py

Exits non-zero when any check fails.
"""

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))

import vmpool.torch as vt  # noqa: E402
import vmpool_torch  # noqa: E402,F401  (the package, from python/ or installed)
from torch_cases import Checks  # noqa: E402


def main() -> int:
    vt.install()
    import torch

    check = Checks()

    torch.manual_seed(0)
    dev = torch.device("cuda")
    vt.set_retention(True)
    # About 2.4 GB of weights: a model of the size people put to sleep,
    # beside which the driver's own few MiB (a stream for the copies) are
    # small.
    layer = torch.nn.TransformerEncoderLayer(d_model=2048, nhead=16, dim_feedforward=8192, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=12).to(dev).eval()
    # The input is kept on the host too: level 2 drops every device byte.
    x_host = torch.randn(8, 128, 2048)
    x = x_host.to(dev)
    with torch.no_grad():
        before = model(x).clone()
    sums = [p.detach().double().sum().item() for p in model.parameters()]
    # A graph captured before the sleep, its input static.
    static_in = torch.randn(8, 128, 2048, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = model(static_in)
    graph.replay()
    graph_before = static_out.clone()
    torch.cuda.synchronize()

    # Ready to sleep: the weights' 2 MiB units joined into whole chunks,
    # nothing else changed.
    chunks = vt.stats().chunks_created - vt.stats().chunks_released
    t = time.perf_counter()
    vt.prepare_sleep()
    took = time.perf_counter() - t
    joined = vt.stats().chunks_created - vt.stats().chunks_released
    print(f"      prepare_sleep: {chunks} chunks -> {joined} in {took:.3f} s")
    check(joined < chunks, "prepare_sleep joins the pool's chunks")
    with torch.no_grad():
        check(torch.equal(before, model(x)), "outputs equal after prepare_sleep")
    graph.replay()
    torch.cuda.synchronize()
    check(torch.equal(graph_before, static_out), "the graph replays right after prepare_sleep")

    free_awake, _ = torch.cuda.mem_get_info()
    reserved = vt.stats().reserved_bytes
    t = time.perf_counter()
    vt.sleep(1)
    print(f"      sleep(1) after prepare_sleep: {time.perf_counter() - t:.3f} s")
    free_asleep, _ = torch.cuda.mem_get_info()
    gained = free_asleep - free_awake
    print(f"      pool reserved {reserved} bytes; device free {free_awake} awake, {free_asleep} asleep")
    check(
        gained >= 0.99 * reserved,
        f"asleep, the device gained {gained / 2**20:.0f} MiB of the pool's {reserved / 2**20:.0f} MiB",
    )
    try:
        torch.empty(1 << 20, device=dev)
        refused = False
    except Exception:  # noqa: BLE001  (PyTorch's error for a NULL allocation)
        refused = True
    check(refused or vt.stats().reserved_bytes == 0, "asleep, an allocation does not take memory")
    vt.wake()
    with torch.no_grad():
        after = model(x)
    check(torch.equal(before, after), "outputs equal after a level-1 sleep")
    check(sums == [p.detach().double().sum().item() for p in model.parameters()], "parameters' checksums equal")
    graph.replay()
    torch.cuda.synchronize()
    check(torch.equal(graph_before, static_out), "the graph captured before the sleep replays right")

    # Level 2: nothing kept; the weights loaded again from the host.
    # Level 2 drops every device byte, the reference output's too.
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    before_host = before.cpu()
    vt.sleep(2)
    vt.wake()
    model.load_state_dict(state)
    x = x_host.to(dev)
    with torch.no_grad():
        again = model(x)
    check(torch.equal(before_host, again.cpu()), "outputs equal after a level-2 sleep and a reload")
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
