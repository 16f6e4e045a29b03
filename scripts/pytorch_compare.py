#!/usr/bin/env python3
"""vmpool against PyTorch's allocators on real models.

Runs each workload in a process of its own under each allocator:

    native            PyTorch's caching allocator
    expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cudaMallocAsync   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    vmpool            libvmpool_c.so through CUDAPluggableAllocator
    vmpool@SIZE       the same with VMPOOL_CHUNK_SIZE=SIZE (e.g. vmpool@4MiB)
    vmpool/N          the same with VMPOOL_CHUNK_DIVISOR=N (e.g. vmpool/4096;
                      vmpool/off: fixed VMPOOL_CHUNK_SIZE chunks)
    vmpool=PATH       the same with the library at PATH (VMPOOL_LIB), to
                      compare two builds in one run (scripts/gpu-build.sh
                      bundles an older one with BASE_REV=REV)

and reports, per run: peak reserved (the allocator's own figure, and the
device's used memory from cuMemGetInfo, sampled after every step, less what
was in use before the model was built), peak allocated (the allocator's own
figure), their ratio, and the mean time per step after the warm-up steps
(Python's garbage collector runs between steps, not inside them).
The workloads (scripts/torch_workloads.py says what each runs): GPT-2
training and generation, ResNet-50 training, a decoder with grouped-query
attention trained on lengths drawn each step, ViT-B/16 training, a
diffusion UNet's training, a mixture of experts' training, and a serving
loop of varying batches with a KV cache. Models are random-initialised
from their configurations; nothing is downloaded. Every run uses the same seed and the same sequence of shapes,
so the per-step losses (or generated tokens) must match native's.

`--workloads gather-probe` runs a probe instead of a model: random reads
over one 16 GiB tensor, to see whether the way an allocator maps its memory
changes how fast kernels run. `--workloads calls-probe` replays the
allocation calls of a trace recorded under PyTorch (`--calls-trace FILE`;
by default GPT-2 training's, traces/gpt2_train_torch.trace.gz) through
PyTorch's allocator interface, with no kernels: what an allocator's calls
cost on PyTorch's own path.

    python3 scripts/pytorch_compare.py [--steps N] [--repeats R] [--workloads a,b]
                                       [--allocators a,b] [--json OUT.json] [--record DIR]

Needs a GPU, PyTorch, transformers and torchvision (the GPU machine has
them), and libvmpool_c.so (see vmpool_torch.library_path). Exits non-zero
when a run fails or a loss differs.
"""

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_cases import report, run_case  # noqa: E402
from torch_workloads import BUILD, DEFAULT_CALLS_TRACE, PROBES  # noqa: E402

# The three workloads of the first runs, what a run without --workloads
# takes; torch_workloads.MODELS has all of them.
DEFAULT_WORKLOADS = ["gpt2-train", "gpt2-generate", "resnet50-train"]
ALLOCATORS = {
    "native": "",
    "expandable": "expandable_segments:True",
    "cudaMallocAsync": "backend:cudaMallocAsync",
    "vmpool": "",
}
WARMUP = 3
MIB = 1 << 20


# ---- a run (the child) --------------------------------------------------------


def child(args):
    vmpool = None
    if is_vmpool(args.allocator):
        import vmpool_torch as vmpool

        vmpool.install()
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # Some backward kernels (adaptive average pooling) have no deterministic
    # version; they warn, and their losses may differ in the last digits.
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the context, before the baseline
    free, total = torch.cuda.mem_get_info()
    baseline = total - free
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)
    rng = random.Random(args.seed)
    shapes, step = BUILD[args.workload](torch, dev, rng, args.steps)

    losses, times, device_peak = [], [], 0
    # What exists now (torch, the model, its parameters) stays for the
    # whole run: out of the collector's sight, so that the collection
    # before each step is quick.
    gc.collect()
    gc.freeze()
    # vmpool only: chunks each step mapped (new or moved), and the time
    # spent in vmpool's calls (VMPOOL_TIMING).
    step_maps, step_call_ms = [], []
    # vmpool only: its counters summed over the timed steps that mapped no
    # chunk, where its calls are all bookkeeping (CALL_COUNTERS).
    quiet = dict.fromkeys(CALL_COUNTERS, 0)
    quiet["steps"] = 0
    for index, shape in enumerate(shapes):
        before = vmpool.stats() if vmpool is not None else None
        # Python's collector runs outside the timed window: when it runs
        # depends on every Python object made, vmpool's statistics between
        # steps included, so inside the window it would land on different
        # steps under different allocators and cost one of them tens of
        # milliseconds the other does not pay.
        gc.collect()
        gc.disable()
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step(shape))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        gc.enable()
        if vmpool is not None:
            after = vmpool.stats()
            step_maps.append(mapped(after) - mapped(before))
            step_call_ms.append((after["call_nanos"] - before["call_nanos"]) / 1e6)
            if index >= WARMUP and step_maps[-1] == 0:
                quiet["steps"] += 1
                for k in CALL_COUNTERS:
                    quiet[k] += after[k] - before[k]
        free, _ = torch.cuda.mem_get_info()
        device_peak = max(device_peak, total - free - baseline)

    # What torch.cuda.empty_cache() gives back (vmpool_torch.install hooks
    # it), with the workload's tensors gone.
    del step
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    after_empty_cache = {
        "reserved_after_empty_cache": vmpool.stats()["reserved_bytes"] if vmpool is not None
        else torch.cuda.memory_reserved(),
        "device_after_empty_cache": total - free - baseline,
    }
    if vmpool is not None:
        s = vmpool.stats()
        reserved, allocated = s["reserved_high"], s["used_high"]
        extra = {k: s[k] for k in ("remaps", "bytes_remapped", "chunks_created", "grows", "refused_frees",
                                   "timed_calls", "call_nanos")}
    else:
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        extra = {}
    timed = times[WARMUP:] or times
    if vmpool is not None:
        # Steps after the warm-up, split by whether they grew or moved chunks:
        # tells the driver's share of the step time from the rest.
        split = list(zip(times, step_maps))[WARMUP:] or list(zip(times, step_maps))
        with_driver = [t for t, maps in split if maps]
        without = [t for t, maps in split if not maps]
        extra["step_maps"] = step_maps
        extra["step_call_ms"] = step_call_ms
        extra["calls_without_driver_work"] = quiet
        extra["steps_with_driver_work"] = len(with_driver)
        extra["ms_median_with_driver_work"] = 1000 * statistics.median(with_driver) if with_driver else None
        extra["ms_median_without_driver_work"] = 1000 * statistics.median(without) if without else None
    result = {
        "workload": args.workload,
        "allocator": args.allocator,
        "steps": len(shapes),
        "peak_reserved": reserved,
        "peak_allocated": allocated,
        "ratio": reserved / allocated if allocated else float("nan"),
        "device_peak": device_peak,
        "ms_per_step": 1000 * statistics.fmean(timed),
        "ms_median": 1000 * statistics.median(timed),
        "step_ms": [1000 * t for t in times],
        "losses": losses,
        **after_empty_cache,
        **extra,
    }
    report(result)


# ---- the comparison (parent) ---------------------------------------------------


# vmpool's counters that say where its calls' time goes.
CALL_COUNTERS = ("timed_calls", "call_nanos", "timed_frees", "free_nanos", "allocations",
                 "same_stream_reuses", "frees_merged", "frees_completed", "events_recorded",
                 "waits_inserted")


def calls_breakdown(q):
    """One line on vmpool's calls in the timed steps that mapped nothing."""
    if not q or not q["steps"] or not q["timed_calls"]:
        return None
    allocs = q["timed_calls"] - q["timed_frees"]

    def per_step(k):
        return q[k] / q["steps"]

    return (f"steps that mapped nothing ({q['steps']}): {per_step('timed_calls'):.0f} calls a step, "
            f"allocations {(q['call_nanos'] - q['free_nanos']) / max(allocs, 1):.0f} ns "
            f"({100 * q['same_stream_reuses'] / max(q['allocations'], 1):.0f} % without the pool's lock), "
            f"frees {q['free_nanos'] / max(q['timed_frees'], 1):.0f} ns; a step: "
            f"{per_step('events_recorded'):.1f} events recorded, {per_step('frees_merged'):.0f} frees merged, "
            f"{per_step('frees_completed'):.0f} completed, {per_step('waits_inserted'):.1f} waits inserted")


def mapped(stats):
    """Chunks vmpool has mapped so far, new or moved."""
    return stats["chunks_created"] + stats["remaps"]


def is_vmpool(allocator):
    return allocator == "vmpool" or allocator.startswith(("vmpool@", "vmpool/", "vmpool="))


def step_time(runs):
    """Each timed step's median over the runs, averaged over the steps (ms).
    Every run of a workload takes the same shapes in the same order (same
    seed), so step i is the same work in every run and under every
    allocator; its median over runs drops a slow moment of the machine
    that the mean over one run's steps would keep."""
    if not all("step_ms" in r for r in runs):
        # Results from before step times were kept: the median run.
        return statistics.median(r["ms_per_step"] for r in runs)
    steps = [statistics.median(times) for times in zip(*(r["step_ms"] for r in runs))]
    return statistics.fmean(steps[WARMUP:] or steps)


def speed_interval(runs, native_runs, resamples=2000):
    """The 5th and 95th percentiles of step_time(runs) / step_time(native_runs)
    when each side's runs are drawn again with replacement (a bootstrap
    over runs; seeded, so a table prints the same every time); None
    with fewer than three runs a side or without per-step times. Runs
    differ by more than steps of one run do, so this, not the spread of
    steps, says whether a difference of a few percent is there."""
    if min(len(runs), len(native_runs)) < 3 or not all("step_ms" in r for r in runs + native_runs):
        return None
    rng = random.Random(0)
    ratios = sorted(step_time(rng.choices(runs, k=len(runs))) /
                    step_time(rng.choices(native_runs, k=len(native_runs)))
                    for _ in range(resamples))
    return ratios[resamples // 20], ratios[resamples - 1 - resamples // 20]


def fastest_ratio(runs, native_runs):
    """Each timed step's fastest run, summed, over native's: for work that
    is the same in every run, the time left when the machine's slow
    moments (which land on any step, under any allocator) are dropped.
    None without per-step times."""
    if not all("step_ms" in r for r in runs + native_runs):
        return None

    def fastest(rs):
        steps = [min(times) for times in zip(*(r["step_ms"] for r in rs))]
        return sum(steps[WARMUP:] or steps)

    return fastest(runs) / fastest(native_runs)


def fmt_ms(ms):
    return "-" if ms is None else f"{ms:.2f} ms"


def check_allocator(allocator):
    if allocator.startswith("vmpool="):
        if not Path(allocator.split("=", 1)[1]).is_file():
            raise SystemExit(f"{allocator!r}: no library at that path")
    elif allocator.startswith("vmpool/"):
        n = allocator.split("/", 1)[1]
        if n != "off" and (not n.isdigit() or int(n) < 1):
            raise SystemExit(f"{allocator!r}: vmpool/N takes a whole number, at least 1, or off")
    elif allocator not in ALLOCATORS and not allocator.startswith("vmpool@"):
        raise SystemExit(f"unknown allocator {allocator!r}: one of {', '.join(ALLOCATORS)}, vmpool@SIZE, "
                         "vmpool/N or vmpool=PATH")


def run_child(workload, allocator, args):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if ALLOCATORS.get(allocator):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[allocator]
    if allocator.startswith("vmpool@"):
        env["VMPOOL_CHUNK_SIZE"] = allocator.split("@", 1)[1]
    if allocator.startswith("vmpool/"):
        env["VMPOOL_CHUNK_DIVISOR"] = allocator.split("/", 1)[1]
    if allocator.startswith("vmpool="):
        env["VMPOOL_LIB"] = str(Path(allocator.split("=", 1)[1]).resolve())
        # Another build (gpu-build.sh's BASE_REV) may predate the package's
        # version check, or be of another version: warn, do not refuse.
        env["VMPOOL_ALLOW_MISMATCH"] = "1"
    if is_vmpool(allocator):
        # Two clock reads a call, to show vmpool's share of the step time:
        # 60-100 ns a call on the H200's host, counted against vmpool's
        # step time (README.md, "PyTorch"); --no-call-timing leaves it out.
        env["VMPOOL_TIMING"] = "0" if args.no_call_timing else "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONUNBUFFERED"] = "1"
    if args.record and is_vmpool(allocator):
        Path(args.record).mkdir(parents=True, exist_ok=True)
        env["VMPOOL_RECORD"] = str(Path(args.record) / workload)
    if args.calls_trace:
        env["VMPOOL_CALLS_TRACE"] = str(Path(args.calls_trace).resolve())
    started = time.perf_counter()
    result, proc = run_case(Path(__file__).resolve(), "--child", "--workload", workload, "--allocator",
                            allocator, "--steps", str(args.steps), "--seed", str(args.seed), env=env,
                            timeout=args.timeout, label=f"!! {workload} / {allocator}")
    wall = time.perf_counter() - started
    if result is None:
        return None
    noise = [l for l in proc.stderr.splitlines() if "vmpool" in l and ("ERROR" in l or "WARN" in l)]
    for line in noise[:10]:
        print(f"   {allocator} log: {line}")
    result["wall_s"] = wall
    if workload == "calls-probe":
        result["calls_trace"] = args.calls_trace or f"traces/{DEFAULT_CALLS_TRACE}"
    return result


def same(a, b):
    return all(x == y or (math.isclose(x, y, rel_tol=1e-3)) for x, y in zip(a, b)) and len(a) == len(b)


def table(results):
    """Prints the summary table of `results` (as --json writes them);
    whether some losses differ from native's."""
    failed = False
    repeats = max(r["repeat"] for r in results) + 1
    print()
    print(f"Each row: {repeats} run(s). Footprint: the run with the highest ratio. Time: each step "
          "after the warm-up takes its median over the runs (a step has the same shapes in every run and "
          "under every allocator), and those are averaged; in brackets, the range of the runs' own mean "
          "step times. 'vs native' divides the averages; in brackets, with three runs or more a side, the "
          "5th-95th percentiles of that ratio when the runs are resampled (bootstrap). Under the rows, "
          "'fastest': each step's fastest run, summed, against native's.")
    print()
    print("| workload | allocator | peak reserved (MiB) | device used (MiB) | peak allocated (MiB) "
          "| reserved / allocated | ms per step (range of runs) | vs native | losses |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for workload in dict.fromkeys(r["workload"] for r in results):
        summary = {}
        for allocator in dict.fromkeys(r["allocator"] for r in results):
            runs = [r for r in results if r["workload"] == workload and r["allocator"] == allocator]
            if runs:
                times = [r["ms_per_step"] for r in runs]
                summary[allocator] = (max(runs, key=lambda r: r["ratio"]), step_time(runs),
                                      min(times), max(times), runs)
        native = summary.get("native")
        # Each allocator's bootstrap interval against native's, for its row
        # and its time bar.
        intervals = {}
        for allocator, (worst, step, low, high, runs) in summary.items():
            if native is None:
                check, speed = "no native run", "-"
            elif allocator == "native":
                check, speed = "reference", "1.000"
            else:
                reference = native[4][0]["losses"]
                checks = ["equal" if r["losses"] == reference
                          else ("within 1e-3" if same(r["losses"], reference) else "DIFFER") for r in runs]
                check = "DIFFER" if "DIFFER" in checks else ("within 1e-3" if "within 1e-3" in checks else "equal")
                failed |= check == "DIFFER"
                speed = f"{step / native[1]:.3f}"
                interval = intervals[allocator] = speed_interval(runs, native[4])
                if interval:
                    speed += f" ({interval[0]:.3f}-{interval[1]:.3f})"
            print(f"| {workload} | {allocator} | {worst['peak_reserved'] / MIB:.1f} | {worst['device_peak'] / MIB:.1f} "
                  f"| {worst['peak_allocated'] / MIB:.1f} | {worst['ratio']:.4f} | {step:.2f} ({low:.2f}-{high:.2f}) "
                  f"| {speed} | {check} |")
        for allocator, v in summary.items():
            ratio = fastest_ratio(v[4], native[4]) if native is not None and allocator != "native" else None
            if ratio is not None:
                print(f"|   fastest | {allocator}: each step's fastest of {len(v[4])} runs, summed, vs native's "
                      f"fastest of {len(native[4])}: {ratio:.3f} | | | | | | | |")
        others = {a: v[0]["ratio"] for a, v in summary.items() if not is_vmpool(a)}
        # The bar is against all three of PyTorch's configurations; a run
        # without some of them checks less, and says so.
        missing = [a for a in ALLOCATORS if not is_vmpool(a) and a not in others]
        partial = f" (without {', '.join(missing)}: a partial check)" if missing else ""
        for allocator, v in summary.items():
            # The footprint bar is for the models, not the probes.
            if not others or not is_vmpool(allocator) or workload in PROBES:
                continue
            ratio = v[0]["ratio"]
            best = min(others.values())
            against = ", ".join(f"{a} {r:.4f}" for a, r in others.items())
            print(f"|   bar | {allocator} ratio {ratio:.4f} vs the best of PyTorch's ({against}) "
                  f"and 1.02: {'met' if ratio <= min(best, 1.02) else 'NOT met'}{partial} | | | | | | | |")
        # The time bar: within 3 % of native's time per step.
        for allocator, v in summary.items():
            if native is None or not is_vmpool(allocator) or workload in PROBES:
                continue
            speed = v[1] / native[1]
            interval = intervals[allocator]
            reach = (f"; its interval {interval[0]:.3f}-{interval[1]:.3f} "
                     f"{'stays under' if interval[1] <= 1.03 else 'reaches past'} 1.03" if interval else
                     "; no interval with fewer than three runs a side")
            print(f"|   bar | {allocator} time {speed:.3f} of native's vs 1.03: "
                  f"{'met' if speed <= 1.03 else 'NOT met'} on the point estimate{reach} | | | | | | | |")
    return failed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=list(BUILD))
    p.add_argument("--allocator")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"from {', '.join(BUILD)} (default: {', '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=1, help="runs of each allocator, interleaved")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--json", help="write all results here (again after every run)")
    p.add_argument("--no-call-timing", action="store_true",
                   help="vmpool runs without VMPOOL_TIMING: no time of its own calls, none of the "
                        "clock reads' cost in its step time")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run's --json and exit")
    p.add_argument("--calls-trace", metavar="FILE",
                   help="the trace the calls probe replays (gzip or plain; default: GPT-2 training's)")
    p.add_argument("--record", metavar="DIR", help="vmpool runs write their allocation traces here "
                   "(VMPOOL_RECORD=DIR/WORKLOAD), for vmpool-replay")
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.table:
        return 1 if table(json.loads(Path(args.table).read_text())) else 0

    allocators = args.allocators.split(",")
    for allocator in allocators:
        check_allocator(allocator)
    for workload in args.workloads.split(","):
        if workload not in BUILD:
            raise SystemExit(f"unknown workload {workload!r}: one of {', '.join(BUILD)}")
    results, failed = [], False
    for workload in args.workloads.split(","):
        # Repeats interleave the allocators (A B C A B C ...), so that a
        # drift of the machine over time falls on all of them alike.
        for repeat in range(args.repeats):
            for allocator in allocators:
                r = run_child(workload, allocator, args)
                if r is None:
                    failed = True
                    continue
                r["repeat"] = repeat
                results.append(r)
                if args.json:
                    # After every run, so that a run cut short keeps the ones done.
                    Path(args.json).write_text(json.dumps(results, indent=1))
                print(f"{workload:15} {allocator:16} reserved {r['peak_reserved'] / MIB:9.1f} MiB  "
                      f"allocated {r['peak_allocated'] / MIB:9.1f} MiB  ratio {r['ratio']:.4f}  "
                      f"device {r['device_peak'] / MIB:9.1f} MiB  {r['ms_per_step']:8.2f} ms/step  "
                      f"({r['wall_s']:.0f} s)", flush=True)
                print(f"{'':15} {'':16} after torch.cuda.empty_cache(): reserved "
                      f"{r['reserved_after_empty_cache'] / MIB:.1f} MiB, device "
                      f"{r['device_after_empty_cache'] / MIB:.1f} MiB", flush=True)
                if "steps_with_driver_work" in r:
                    print(f"{'':15} {'':16} timed steps that mapped chunks: {r['steps_with_driver_work']} "
                          f"({sum(r['step_maps'][WARMUP:])} chunks), "
                          f"median {fmt_ms(r['ms_median_with_driver_work'])}; the others: median "
                          f"{fmt_ms(r['ms_median_without_driver_work'])}; all: median {r['ms_median']:.2f} ms",
                          flush=True)
                    calls = r["step_call_ms"][WARMUP:] or r["step_call_ms"]
                    if r["timed_calls"]:
                        print(f"{'':15} {'':16} in vmpool's calls: {statistics.fmean(calls):.2f} ms a timed "
                              f"step on average ({r['timed_calls']} calls in the run)", flush=True)
                    breakdown = calls_breakdown(r.get("calls_without_driver_work"))
                    if breakdown:
                        print(f"{'':15} {'':16} {breakdown}", flush=True)

    if results:
        failed |= table(results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
