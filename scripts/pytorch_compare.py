#!/usr/bin/env python3
"""vmpool against PyTorch's allocators on real models.

Runs each workload in a process of its own under each allocator:

    native            PyTorch's caching allocator
    expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cudaMallocAsync   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    vmpool            libvmpool_c.so through CUDAPluggableAllocator, a step
                      marked at each optimizer step (install()'s default)
    vmpool-unmarked   the same with no step marked (VMPOOL_MARK_STEPS=0)
    vmpool@SIZE       the same with VMPOOL_CHUNK_SIZE=SIZE (e.g. vmpool@4MiB)
    vmpool/N          the same with VMPOOL_CHUNK_DIVISOR=N (e.g. vmpool/4096;
                      vmpool/off: fixed VMPOOL_CHUNK_SIZE chunks)
    vmpool-steps      vmpool, a step marked after each step of the loop
                      (not at optimizer steps), generation's too
    vmpool-steps/N    the same with VMPOOL_CHUNK_DIVISOR=N
    floor             the calls probe only: libpluggable_floor.so (beside this
                      script; scripts/pluggable_floor.c), the least a pluggable
                      allocator can cost, to tell what PyTorch's
                      CUDAPluggableAllocator costs from what vmpool's calls do
    vmpool=PATH       the same with the library at PATH (VMPOOL_LIB), to
                      compare two builds in one run (scripts/gpu-build.sh
                      bundles an older one with BASE_REV=REV)

and reports, per run: peak reserved (the allocator's own figure, and the
device's used memory from cuMemGetInfo, sampled after every step, less what
was in use before the model was built), peak allocated (the allocator's own
figure), their ratio (the footprint), and the mean time per step after the
warm-up steps (Python's garbage collector runs between steps, not inside
them). For long runs it keeps the footprint as it was after steps 24 and
100 and at the end, and counts the steps that did driver work (vmpool:
mapped or unmapped chunks; native: allocated or freed a segment), in all
and after step 50, when a pool that has settled should do none.

The workloads (scripts/torch_workloads.py says what each runs): GPT-2
training and generation, ResNet-50 training, a decoder with grouped-query
attention trained on lengths drawn each step, ViT-B/16 training, a
diffusion UNet's training, a mixture of experts' training, and a serving
loop of varying batches with a KV cache. Models are random-initialised
from their configurations; nothing is downloaded. Every run uses the same
seed and the same sequence of shapes, so the per-step losses (or generated
tokens) must match native's.

`--workloads gather-probe` runs a probe instead of a model: random reads
over one 16 GiB tensor, to see whether the way an allocator maps its memory
changes how fast kernels run; `--workloads copy-probe` the same for a
kernel that streams (a 2 GiB copy, eight times a step). `--workloads
calls-probe` replays the allocation calls of traces (`--calls-trace
FILE[,FILE...]`, any trace in the shared format; by default GPT-2
training's, traces/gpt2_train_torch.trace.gz) through PyTorch's allocator interface,
with no kernels: what an allocator's calls cost on PyTorch's own path.
Each trace is a workload of its own in the table.

    python3 scripts/pytorch_compare.py [--steps N] [--repeats R] [--workloads a,b]
                                       [--allocators a,b] [--json OUT.json] [--record DIR]
    python3 scripts/pytorch_compare.py --table A.json [B.json ...]

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
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torch_cases import report, run_case  # noqa: E402
from torch_workloads import BUILD, DEFAULT_CALLS_TRACE, MODELS, PROBES  # noqa: E402

# The three workloads of the first runs, what a run without --workloads
# takes; MODELS (all nine) is what gpu-run.sh's long job runs.
DEFAULT_WORKLOADS = ["gpt2-train", "gpt2-generate", "resnet50-train"]
ALLOCATORS = {
    "native": "",
    "expandable": "expandable_segments:True",
    "cudaMallocAsync": "backend:cudaMallocAsync",
    # vmpool as install() leaves it: a step marked at each optimizer step.
    "vmpool": "",
    "vmpool-unmarked": "",
    # vmpool, a step marked after each step of the loop (vmpool.torch.mark_step)
    # instead: from the third step on, a repeating step is served from its layout.
    "vmpool-steps": "",
}
WARMUP = 3
MIB = 1 << 20
# The floor allocator's library (scripts/pluggable_floor.c), beside this script.
FLOOR_LIB = "libpluggable_floor.so"


# ---- a run (the child) --------------------------------------------------------


def child(args):
    vmpool = None
    if is_vmpool(args.allocator):
        import vmpool_torch as vmpool

        vmpool.install()
    import torch

    # A pluggable allocator keeps none of PyTorch's memory statistics.
    floor = args.allocator == "floor"
    if floor:
        lib = HERE / FLOOR_LIB
        if not lib.is_file():
            raise SystemExit(f"floor: no {lib} (build it: see scripts/pluggable_floor.c)")
        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(str(lib), "floor_malloc", "floor_free")
        )

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
    # vmpool only: its counters summed over the timed steps that made no
    # driver call, where its calls are all bookkeeping (CALL_COUNTERS).
    quiet = dict.fromkeys(CALL_COUNTERS, 0)
    quiet["steps"] = 0
    # After every step: the footprint so far (peak reserved over peak
    # allocated), and the driver calls the step made: vmpool's maps and
    # unmaps of chunks; native's segments allocated and freed, each one
    # cudaMalloc or cudaFree. Expandable segments and cudaMallocAsync
    # count nothing that says what they asked of the driver: none.
    step_footprint, step_driver_calls = [], []
    native = args.allocator == "native"
    marks_steps = args.allocator.split("/", 1)[0] == "vmpool-steps"
    segments = segment_calls(torch.cuda.memory_stats()) if native else None
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
        if marks_steps:
            vmpool.mark_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        gc.enable()
        if vmpool is not None:
            after = vmpool.stats()
            step_maps.append(mapped(after) - mapped(before))
            step_call_ms.append((after["call_nanos"] - before["call_nanos"]) / 1e6)
            step_driver_calls.append(driver_calls(after) - driver_calls(before))
            step_footprint.append(after["reserved_high"] / after["used_high"] if after["used_high"] else math.nan)
            if index >= WARMUP and step_driver_calls[-1] == 0:
                quiet["steps"] += 1
                for k in CALL_COUNTERS:
                    quiet[k] += after[k] - before[k]
        elif floor:
            step_footprint.append(math.nan)
        else:
            memory = torch.cuda.memory_stats()
            peak = memory.get("allocated_bytes.all.peak", 0)
            step_footprint.append(memory.get("reserved_bytes.all.peak", 0) / peak if peak else math.nan)
            if native:
                step_driver_calls.append(segment_calls(memory) - segments)
                segments += step_driver_calls[-1]
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
        "reserved_after_empty_cache": vmpool.stats()["reserved_bytes"]
        if vmpool is not None
        else 0
        if floor
        else torch.cuda.memory_reserved(),
        "device_after_empty_cache": total - free - baseline,
    }
    if vmpool is not None:
        s = vmpool.stats()
        reserved, allocated = s["reserved_high"], s["used_high"]
        extra = {
            k: s[k]
            for k in (
                "remaps",
                "bytes_remapped",
                "chunks_created",
                "chunks_released",
                "grows",
                "maps",
                "unmaps",
                "refused_frees",
                "timed_calls",
                "call_nanos",
                "step_layouts",
                "planned",
                "missed",
                "step_region_bytes",
            )
        }
        # vmpool's count of marks, apart from the run's "steps" below.
        extra["step_marks"] = s["steps"]
    elif floor:
        reserved = allocated = 0
        extra = {}
    else:
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        extra = {}
    timed = times[WARMUP:] or times
    # The footprint as it was after step 24 (the length of the short runs),
    # after step 100, and at the end: whether it creeps up over a long run.
    extra["step_footprint"] = step_footprint
    extra["footprint_at"] = {
        **{str(n): step_footprint[n - 1] if len(step_footprint) >= n else None for n in FOOTPRINT_AT},
        "last": step_footprint[-1] if step_footprint else None,
    }
    if vmpool is not None or native:
        # Steps with driver work, in all and after step SETTLED, by when a
        # pool that has grown to the workload should need none.
        extra["step_driver_calls"] = step_driver_calls
        extra["driver_steps"] = sum(1 for n in step_driver_calls if n)
        extra["settled_after"] = SETTLED
        extra["driver_steps_after_settled"] = (
            sum(1 for n in step_driver_calls[SETTLED:] if n) if len(step_driver_calls) > SETTLED else None
        )
    if vmpool is not None:
        # Steps after the warm-up, split by whether they made driver calls
        # (mapped or unmapped chunks): tells the driver's share of the step
        # time from the rest.
        split = list(zip(times, step_driver_calls))[WARMUP:] or list(zip(times, step_driver_calls))
        with_driver = [t for t, calls in split if calls]
        without = [t for t, calls in split if not calls]
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


# The steps after which the footprint is kept (besides the last), and the
# step after which a pool that has grown to its workload should make no
# more driver calls.
FOOTPRINT_AT = (24, 100)
SETTLED = 50
# vmpool's counters that say where its calls' time goes.
CALL_COUNTERS = (
    "timed_calls",
    "call_nanos",
    "timed_frees",
    "free_nanos",
    "allocations",
    "same_stream_reuses",
    "frees_merged",
    "frees_completed",
    "events_recorded",
    "waits_inserted",
)


def calls_breakdown(q):
    """One line on vmpool's calls in the timed steps that made no driver call."""
    if not q or not q["steps"] or not q["timed_calls"]:
        return None
    allocs = q["timed_calls"] - q["timed_frees"]

    def per_step(k):
        return q[k] / q["steps"]

    return (
        f"steps with no driver call ({q['steps']}): {per_step('timed_calls'):.0f} calls a step, "
        f"allocations {(q['call_nanos'] - q['free_nanos']) / max(allocs, 1):.0f} ns "
        f"({100 * q['same_stream_reuses'] / max(q['allocations'], 1):.0f} % without the pool's lock), "
        f"frees {q['free_nanos'] / max(q['timed_frees'], 1):.0f} ns; a step: "
        f"{per_step('events_recorded'):.1f} events recorded, {per_step('frees_merged'):.0f} frees merged, "
        f"{per_step('frees_completed'):.0f} completed, {per_step('waits_inserted'):.1f} waits inserted"
    )


def mapped(stats):
    """Chunks vmpool has mapped so far, new or moved."""
    return stats["chunks_created"] + stats["remaps"]


def driver_calls(stats):
    """Driver calls vmpool has made so far: chunks mapped and unmapped."""
    return stats["maps"] + stats["unmaps"]


def segment_calls(memory):
    """cudaMalloc and cudaFree calls PyTorch's caching allocator has made
    so far (torch.cuda.memory_stats(): segments allocated and freed)."""
    return memory.get("segment.all.allocated", 0) + memory.get("segment.all.freed", 0)


def is_vmpool(allocator):
    return allocator in ("vmpool", "vmpool-unmarked", "vmpool-steps") or allocator.startswith(
        ("vmpool@", "vmpool/", "vmpool=", "vmpool-steps/")
    )


def step_medians(runs):
    """Each step's median over `runs` (ms), which all kept `step_ms`."""
    return [statistics.median(times) for times in zip(*(r["step_ms"] for r in runs))]


def step_time(runs):
    """Each timed step's median over the runs, averaged over the steps (ms).
    Every run of a workload takes the same shapes in the same order (same
    seed), so step i is the same work in every run and under every
    allocator; its median over runs drops a slow moment of the machine
    that the mean over one run's steps would keep."""
    if not all("step_ms" in r for r in runs):
        # Results from before step times were kept: the median run.
        return statistics.median(r["ms_per_step"] for r in runs)
    steps = step_medians(runs)
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
    ratios = sorted(
        step_time(rng.choices(runs, k=len(runs))) / step_time(rng.choices(native_runs, k=len(native_runs)))
        for _ in range(resamples)
    )
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


# Where the gap to native's time is split: the steps after the warm-up
# up to the first of these, between them, and from the last on.
GAP_SPANS = (10, 50)


def time_gap(runs, native_runs):
    """Where `runs` lose or gain time against `native_runs`, as text: each
    step's median run less native's, summed over the spans GAP_SPANS
    cuts the timed steps into, in ms and as a share of native's time from
    the warm-up on; and the costliest step. None without per-step times."""
    if not all("step_ms" in r for r in runs + native_runs):
        return None
    ours, theirs = step_medians(runs), step_medians(native_runs)
    steps = min(len(ours), len(theirs))
    if steps <= WARMUP:
        return None
    gap = [ours[i] - theirs[i] for i in range(steps)]
    total = sum(theirs[WARMUP:steps])
    edges = [WARMUP, *(e for e in GAP_SPANS if WARMUP < e < steps), steps]
    spans = [
        f"steps {a}-{b - 1} {sum(gap[a:b]):+.0f} ms ({100 * sum(gap[a:b]) / total:+.2f} %)"
        for a, b in zip(edges, edges[1:])
    ]
    worst = max(range(WARMUP, steps), key=lambda i: gap[i])
    return f"{', '.join(spans)} of native's {total / 1000:.1f} s; the costliest step {worst}, {gap[worst]:+.0f} ms"


def fmt_ms(ms):
    return "-" if ms is None else f"{ms:.2f} ms"


def check_allocator(allocator):
    if allocator.startswith("vmpool="):
        if not Path(allocator.split("=", 1)[1]).is_file():
            raise SystemExit(f"{allocator!r}: no library at that path")
    elif allocator.startswith(("vmpool/", "vmpool-steps/")):
        n = allocator.split("/", 1)[1]
        if n != "off" and (not n.isdigit() or int(n) < 1):
            raise SystemExit(f"{allocator!r}: /N takes a whole number, at least 1, or off")
    elif allocator not in ALLOCATORS and allocator != "floor" and not allocator.startswith("vmpool@"):
        raise SystemExit(
            f"unknown allocator {allocator!r}: one of {', '.join(ALLOCATORS)}, vmpool@SIZE, "
            "vmpool/N, vmpool-steps/N, vmpool=PATH or floor"
        )


def trace_name(path):
    """A trace's file name without .trace.gz (or .trace)."""
    name = Path(path).name
    for suffix in (".gz", ".trace"):
        name = name.removesuffix(suffix)
    return name


def label(result):
    """What the tables call a run's workload: its name, and for the calls
    probe the trace it replayed (each trace a workload of its own)."""
    trace = result.get("calls_trace")
    return f"{result['workload']} {trace_name(trace)}" if trace else result["workload"]


def run_child(workload, allocator, args, trace=None):
    """One run of `workload` under `allocator` in a process of its own
    (`trace`: the calls probe's trace, None for its default); its result,
    None when it failed."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if ALLOCATORS.get(allocator):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[allocator]
    if allocator.startswith("vmpool@"):
        env["VMPOOL_CHUNK_SIZE"] = allocator.split("@", 1)[1]
    if allocator.startswith(("vmpool/", "vmpool-steps/")):
        env["VMPOOL_CHUNK_DIVISOR"] = allocator.split("/", 1)[1]
    if allocator.startswith("vmpool="):
        env["VMPOOL_LIB"] = str(Path(allocator.split("=", 1)[1]).resolve())
        # Another build (gpu-build.sh's BASE_REV) may predate the package's
        # version check, or be of another version: warn, do not refuse.
        env["VMPOOL_ALLOW_MISMATCH"] = "1"
    if is_vmpool(allocator):
        # Marks at optimizer steps (install()'s), unless the loop marks its
        # own steps or none are wanted.
        unmarked = allocator == "vmpool-unmarked" or allocator.startswith("vmpool-steps")
        env["VMPOOL_MARK_STEPS"] = "0" if unmarked else "1"
        # Two clock reads a call, to show vmpool's share of the step time:
        # 60-100 ns a call on the H200's host, counted against vmpool's
        # step time (README.md, "PyTorch"); --no-call-timing leaves it out.
        env["VMPOOL_TIMING"] = "0" if args.no_call_timing else "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONUNBUFFERED"] = "1"
    name = f"{workload}-{trace_name(trace)}" if trace else workload
    if args.record and is_vmpool(allocator):
        Path(args.record).mkdir(parents=True, exist_ok=True)
        env["VMPOOL_RECORD"] = str(Path(args.record) / name)
    if trace:
        env["VMPOOL_CALLS_TRACE"] = str(Path(trace).resolve())
    started = time.perf_counter()
    result, proc = run_case(
        Path(__file__).resolve(),
        "--child",
        "--workload",
        workload,
        "--allocator",
        allocator,
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        env=env,
        timeout=args.timeout,
        label=f"!! {name} / {allocator}",
    )
    wall = time.perf_counter() - started
    if result is None:
        return None
    noise = [line for line in proc.stderr.splitlines() if "vmpool" in line and ("ERROR" in line or "WARN" in line)]
    for line in noise[:10]:
        print(f"   {allocator} log: {line}")
    result["wall_s"] = wall
    if workload == "calls-probe":
        result["calls_trace"] = trace or f"traces/{DEFAULT_CALLS_TRACE}"
    return result


def same(a, b):
    return all(x == y or (math.isclose(x, y, rel_tol=1e-3)) for x, y in zip(a, b)) and len(a) == len(b)


def table(results):
    """Prints the summary table of `results` (as --json writes them);
    whether some losses differ from native's."""
    failed = False
    repeats = max(r["repeat"] for r in results) + 1
    print()
    print(
        f"Each row: {repeats} run(s). Footprint: the run with the highest ratio. Time: each step "
        "after the warm-up takes its median over the runs (a step has the same shapes in every run and "
        "under every allocator), and those are averaged; in brackets, the range of the runs' own mean "
        "step times. 'vs native' divides the averages; in brackets, with three runs or more a side, the "
        "5th-95th percentiles of that ratio when the runs are resampled (bootstrap). Under the rows, "
        "'fastest': each step's fastest run, summed, against native's."
    )
    print()
    print(
        "| workload | allocator | peak reserved (MiB) | device used (MiB) | peak allocated (MiB) "
        "| reserved / allocated | ms per step (range of runs) | vs native | losses |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for workload in dict.fromkeys(label(r) for r in results):
        summary = {}
        for allocator in dict.fromkeys(r["allocator"] for r in results):
            runs = [r for r in results if label(r) == workload and r["allocator"] == allocator]
            if runs:
                times = [r["ms_per_step"] for r in runs]
                summary[allocator] = (
                    max(runs, key=lambda r: r["ratio"]),
                    step_time(runs),
                    min(times),
                    max(times),
                    runs,
                )
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
                # A run matches native when its losses are those of one of
                # native's runs: some kernels are not deterministic, and
                # native's own runs can part from one another.
                references = [n["losses"] for n in native[4]]
                checks = [
                    "equal"
                    if r["losses"] in references
                    else ("within 1e-3" if any(same(r["losses"], n) for n in references) else "DIFFER")
                    for r in runs
                ]
                check = "DIFFER" if "DIFFER" in checks else ("within 1e-3" if "within 1e-3" in checks else "equal")
                if check == "DIFFER" and any(n != references[0] for n in references):
                    # Not the allocator's doing where native differs from itself.
                    check = "differ, as native's own runs do"
                failed |= check == "DIFFER"
                speed = f"{step / native[1]:.3f}"
                interval = intervals[allocator] = speed_interval(runs, native[4])
                if interval:
                    speed += f" ({interval[0]:.3f}-{interval[1]:.3f})"
            print(
                f"| {workload} | {allocator} | {worst['peak_reserved'] / MIB:.1f} | {worst['device_peak'] / MIB:.1f} "
                f"| {worst['peak_allocated'] / MIB:.1f} | {worst['ratio']:.4f} | {step:.2f} ({low:.2f}-{high:.2f}) "
                f"| {speed} | {check} |"
            )
        for allocator, v in summary.items():
            ratio = fastest_ratio(v[4], native[4]) if native is not None and allocator != "native" else None
            if ratio is not None:
                print(
                    f"|   fastest | {allocator}: each step's fastest of {len(v[4])} runs, summed, vs native's "
                    f"fastest of {len(native[4])}: {ratio:.3f} | | | | | | | |"
                )
        others = {a: v[0]["ratio"] for a, v in summary.items() if not is_vmpool(a)}
        # The bar is against all three of PyTorch's configurations; a run
        # without some of them checks less, and says so.
        missing = [a for a in ALLOCATORS if not is_vmpool(a) and a not in others]
        partial = f" (without {', '.join(missing)}: a partial check)" if missing else ""
        for allocator, v in summary.items():
            # The issue's footprint bar is for the models, not the probes.
            if not others or not is_vmpool(allocator) or v[4][0]["workload"] in PROBES:
                continue
            ratio = v[0]["ratio"]
            best = min(others.values())
            against = ", ".join(f"{a} {r:.4f}" for a, r in others.items())
            print(
                f"|   bar | {allocator} ratio {ratio:.4f} vs the best of PyTorch's ({against}) "
                f"and 1.02: {'met' if ratio <= min(best, 1.02) else 'NOT met'}{partial} | | | | | | | |"
            )
        # The time bar: within 3 % of native's time per step.
        for allocator, v in summary.items():
            if native is None or not is_vmpool(allocator) or v[4][0]["workload"] in PROBES:
                continue
            speed = v[1] / native[1]
            interval = intervals[allocator]
            reach = (
                f"; its interval {interval[0]:.3f}-{interval[1]:.3f} "
                f"{'stays under' if interval[1] <= 1.03 else 'reaches past'} 1.03"
                if interval
                else "; no interval with fewer than three runs a side"
            )
            print(
                f"|   bar | {allocator} time {speed:.3f} of native's vs 1.03: "
                f"{'met' if speed <= 1.03 else 'NOT met'} on the point estimate{reach} | | | | | | | |"
            )
    return failed


def highest(values):
    """The highest of `values` that are numbers (None and NaN left out);
    None when none is."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return max(values) if values else None


def long_table(results):
    """Prints what the long runs show, per workload and allocator: the time
    per step against native's (with the bootstrap interval, and each step's
    fastest run against native's), the footprint after steps 24 and 100
    and at the end (the highest of the runs), and how many of the steps
    after the pool should have settled made driver calls. Nothing for
    results from before these were kept."""
    if not any("footprint_at" in r for r in results):
        return
    print()
    print(
        "Long runs. Time: as above; in brackets, the bootstrap's 5th-95th percentiles. Fastest: each "
        "step's fastest run, summed, against native's. Footprint: peak reserved over peak allocated as it "
        "was after that step, the highest of the runs. Driver calls: steps that mapped or unmapped chunks "
        "(vmpool) or allocated or freed segments (native), of all the runs' steps after the step named."
    )
    print()
    print(
        "| workload | allocator | runs x steps | time vs native | fastest vs native "
        f"| footprint after {FOOTPRINT_AT[0]} | after {FOOTPRINT_AT[1]} | at the end | steps with driver calls |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for workload in dict.fromkeys(label(r) for r in results):
        by_allocator = {}
        for r in results:
            if label(r) == workload:
                by_allocator.setdefault(r["allocator"], []).append(r)
        native = by_allocator.get("native")
        for allocator, runs in by_allocator.items():
            speed = fastest = "-"
            ratio = fastest_run = None
            if allocator == "native":
                speed = "1.000"
            elif native:
                ratio = step_time(runs) / step_time(native)
                speed = f"{ratio:.3f}"
                interval = speed_interval(runs, native)
                if interval:
                    speed += f" ({interval[0]:.3f}-{interval[1]:.3f})"
                fastest_run = fastest_ratio(runs, native)
                if fastest_run is not None:
                    fastest = f"{fastest_run:.3f}"
            footprints = []
            for at in [*map(str, FOOTPRINT_AT), "last"]:
                value = footprint_after(runs, at)
                footprints.append("-" if value is None else f"{value:.4f}")
            driver = driver_steps(runs)
            calls = (
                "-"
                if driver is None
                else f"{100 * driver.steps / driver.of:.1f} % ({driver.steps} of {driver.of} after step {driver.after})"
            )
            print(
                f"| {workload} | {allocator} | {len(runs)} x {runs[0]['steps']} | {speed} | {fastest} "
                f"| {' | '.join(footprints)} | {calls} |"
            )
            if is_vmpool(allocator) and ratio is not None:
                print(f"|   issue 23 | {issue23_verdict(runs, by_allocator, ratio, fastest_run)} | | | | | | | |")
                gap = time_gap(runs, native)
                if gap is not None:
                    print(f"|   time gap | {gap} | | | | | | | |")


def footprint_after(runs, at):
    """The highest footprint of `runs` after step `at` (a step number as
    text, or "last"); None when no run kept it."""
    return highest(r.get("footprint_at", {}).get(at) for r in runs)


class DriverSteps(NamedTuple):
    """Steps that made driver calls (`steps`) of those counted (`of`): each
    run's steps after step `after`, where the pool should have settled."""

    steps: int
    of: int
    after: int


def driver_steps(runs):
    """The runs' DriverSteps; None for results from before these were kept."""
    settled = [r for r in runs if r.get("driver_steps_after_settled") is not None]
    if not settled:
        return None
    return DriverSteps(
        steps=sum(r["driver_steps_after_settled"] for r in settled),
        of=sum(r["steps"] - r["settled_after"] for r in settled),
        after=settled[0]["settled_after"],
    )


def issue23_verdict(runs, by_allocator, speed, fastest):
    """Issue 23's bars for a long run of a vmpool build, as text: at least
    three runs a side of at least 300 steps; step time (`speed`, against
    native's) at most 1.02, each step's fastest run (`fastest`, None
    without per-step times) at most 1.00; the footprint at the end (the
    highest run) at most 1.01 and at most the best of PyTorch's
    allocators in the results; under 5 % of the steps after the settling
    step mapping (the bar for random shapes; fixed shapes ask none after
    each shape's first occurrence, which only the per-step counts show)."""
    native = by_allocator["native"]

    def bar(ok):
        return "met" if ok else "NOT met"

    a_side = min(len(runs), len(native))
    enough = a_side >= 3 and min(r["steps"] for r in runs + native) >= 300
    parts = [f"{a_side} runs a side of {runs[0]['steps']} steps: {bar(enough)}"]
    parts.append(f"time {speed:.4f} <= 1.02: {bar(speed <= 1.02)}")
    if fastest is not None:
        parts.append(f"fastest {fastest:.4f} <= 1.00: {bar(fastest <= 1.00)}")
    end = footprint_after(runs, "last")
    if end is not None:
        known = [
            (value, name)
            for name in ("native", "expandable", "cudaMallocAsync")
            if name in by_allocator and (value := footprint_after(by_allocator[name], "last")) is not None
        ]
        if known:
            best, name = min(known)
            parts.append(
                f"footprint {end:.4f} <= 1.01 and <= PyTorch's best ({name} {best:.4f}): "
                f"{bar(end <= 1.01 and end <= best)}"
            )
        else:
            parts.append(f"footprint {end:.4f} <= 1.01 (no PyTorch footprint to compare): {bar(end <= 1.01)}")
    driver = driver_steps(runs)
    if driver is not None:
        parts.append(
            f"steps mapping {100 * driver.steps / driver.of:.1f} % < 5 %: {bar(driver.steps * 20 < driver.of)}"
        )
    return "; ".join(parts)


def main():
    global WARMUP
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=list(BUILD))
    p.add_argument("--allocator")
    p.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"from {', '.join(BUILD)}, or models: all {len(MODELS)} but the probes "
        f"(default: {', '.join(DEFAULT_WORKLOADS)})",
    )
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=1, help="runs of each allocator, interleaved")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--json", help="write all results here (again after every run)")
    p.add_argument(
        "--no-call-timing",
        action="store_true",
        help="vmpool runs without VMPOOL_TIMING: no time of its own calls, none of the "
        "clock reads' cost in its step time",
    )
    p.add_argument(
        "--table",
        metavar="JSON",
        nargs="+",
        help="print the tables of earlier runs' --json (several: their runs together) and exit",
    )
    p.add_argument(
        "--from-step",
        type=int,
        default=WARMUP,
        metavar="N",
        help=f"time steps from step N on, the first N being warm-up (default {WARMUP}); "
        "with --table, a steady state after a layout, say",
    )
    p.add_argument(
        "--calls-trace",
        metavar="FILE[,FILE...]",
        help="the traces the calls probe replays, each a workload of its own (the shared format, "
        "gzip or plain; default: GPT-2 training's)",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="vmpool runs write their allocation traces here (VMPOOL_RECORD=DIR/WORKLOAD), for vmpool-replay",
    )
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.from_step < 0:
        raise SystemExit("--from-step: a step number, 0 or more")
    WARMUP = args.from_step
    if args.table:
        results = [r for path in args.table for r in json.loads(Path(path).read_text())]
        failed = table(results)
        long_table(results)
        return 1 if failed else 0

    allocators = args.allocators.split(",")
    for allocator in allocators:
        check_allocator(allocator)
    workloads = [w for name in args.workloads.split(",") for w in (MODELS if name == "models" else [name])]
    for workload in workloads:
        if workload not in BUILD:
            raise SystemExit(f"unknown workload {workload!r}: one of {', '.join(BUILD)}, or models")
    if "floor" in allocators and any(w != "calls-probe" for w in workloads):
        raise SystemExit("floor: the calls probe only (it never gives memory back, nor orders streams)")
    traces = args.calls_trace.split(",") if args.calls_trace else [None]
    for trace in traces:
        if trace is not None and not Path(trace).is_file():
            raise SystemExit(f"--calls-trace: no file {trace!r}")
    results, failed = [], False
    for workload in workloads:
        for trace in traces if workload == "calls-probe" else [None]:
            # Repeats interleave the allocators (A B C A B C ...), so that a
            # drift of the machine over time falls on all of them alike.
            for repeat in range(args.repeats):
                for allocator in allocators:
                    r = run_child(workload, allocator, args, trace)
                    if r is None:
                        failed = True
                        continue
                    r["repeat"] = repeat
                    results.append(r)
                    if args.json:
                        # After every run, so that a run cut short keeps the ones done.
                        Path(args.json).write_text(json.dumps(results, indent=1))
                    print_run(r)

    if results:
        failed |= table(results)
        long_table(results)
    return 1 if failed else 0


def print_run(r):
    """A run's lines, as it ends."""
    pad = f"{'':15} {'':16}"
    print(
        f"{label(r):15} {r['allocator']:16} reserved {r['peak_reserved'] / MIB:9.1f} MiB  "
        f"allocated {r['peak_allocated'] / MIB:9.1f} MiB  ratio {r['ratio']:.4f}  "
        f"device {r['device_peak'] / MIB:9.1f} MiB  {r['ms_per_step']:8.2f} ms/step  "
        f"({r['wall_s']:.0f} s)",
        flush=True,
    )
    print(
        f"{pad} after torch.cuda.empty_cache(): reserved {r['reserved_after_empty_cache'] / MIB:.1f} MiB, "
        f"device {r['device_after_empty_cache'] / MIB:.1f} MiB",
        flush=True,
    )
    at = ", ".join(
        f"{'at the end' if k == 'last' else 'after step ' + k} {v:.4f}"
        for k, v in r["footprint_at"].items()
        if v is not None
    )
    driver = ""
    if "driver_steps" in r:
        driver = f"; steps with driver calls: {r['driver_steps']} of {r['steps']}"
        if r["driver_steps_after_settled"] is not None:
            driver += (
                f", {r['driver_steps_after_settled']} of the {r['steps'] - r['settled_after']} "
                f"after step {r['settled_after']}"
            )
    print(f"{pad} footprint {at}{driver}", flush=True)
    if "steps_with_driver_work" in r:
        print(
            f"{pad} timed steps with driver calls: {r['steps_with_driver_work']} "
            f"({sum(r['step_maps'][WARMUP:])} chunks mapped), "
            f"median {fmt_ms(r['ms_median_with_driver_work'])}; the others: median "
            f"{fmt_ms(r['ms_median_without_driver_work'])}; all: median {r['ms_median']:.2f} ms",
            flush=True,
        )
        calls = r["step_call_ms"][WARMUP:] or r["step_call_ms"]
        if r["timed_calls"]:
            print(
                f"{pad} in vmpool's calls: {statistics.fmean(calls):.2f} ms a timed "
                f"step on average ({r['timed_calls']} calls in the run)",
                flush=True,
            )
        breakdown = calls_breakdown(r.get("calls_without_driver_work"))
        if breakdown:
            print(f"{pad} {breakdown}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
