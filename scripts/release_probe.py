#!/usr/bin/env python3
"""How fast the driver gives back many small chunks, alone and beside a copy.

A pool that sleeps unmaps and releases every chunk it holds; for a pool
grown by 2 MiB chunks that is 512 handles a GiB, and on the H200 the
release, not the copy, bounds the first sleep (Note [Sleep and wake] in
docs/DESIGN.md). This probe maps N chunks of one size into a reserved range
and times giving them back: unmap and release one chunk at a time on 1, 2,
4 or 8 threads, or the whole range unmapped in one call and the handles
released after; each with and without a device-to-host copy running on a
stream meanwhile (a pinned buffer, as a sleep copies into). It prints a
line per case and writes JSON with --json.

    python3 scripts/release_probe.py --chunks 512 --chunk-mib 2 --repeat 3

Needs a CUDA GPU and PyTorch (for the copy); calls libcuda through ctypes.
"""

import argparse
import ctypes
import json
import statistics
import threading
import time

import torch

CU = ctypes.CDLL("libcuda.so.1")
MIB = 1 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def current_context():
    ctx = ctypes.c_void_p()
    check(CU.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx


def map_chunks(count, size):
    """Reserves a range and maps `count` fresh chunks of `size` into it."""
    prop = AllocationProp()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Location(1, torch.cuda.current_device())  # DEVICE
    base = ctypes.c_uint64()
    total = count * size
    check(
        CU.cuMemAddressReserve(
            ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(size), ctypes.c_uint64(0), ctypes.c_uint64(0)
        ),
        "cuMemAddressReserve",
    )
    handles = []
    for i in range(count):
        h = ctypes.c_uint64()
        check(
            CU.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)),
            "cuMemCreate",
        )
        check(
            CU.cuMemMap(
                ctypes.c_uint64(base.value + i * size), ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_uint64(0)
            ),
            "cuMemMap",
        )
        handles.append(h)
    access = AccessDesc(prop.location, 3)  # READWRITE
    check(
        CU.cuMemSetAccess(
            ctypes.c_uint64(base.value), ctypes.c_size_t(total), ctypes.byref(access), ctypes.c_size_t(1)
        ),
        "cuMemSetAccess",
    )
    return base.value, handles


def give_back_each(ctx, base, size, handles, indices):
    check(CU.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    for i in indices:
        check(CU.cuMemUnmap(ctypes.c_uint64(base + i * size), ctypes.c_size_t(size)), "cuMemUnmap")
        check(CU.cuMemRelease(handles[i]), "cuMemRelease")


def give_back(mode, threads, base, size, handles):
    """Unmaps and releases every chunk; returns the seconds it took."""
    ctx = current_context()
    count = len(handles)
    started = time.perf_counter()
    if mode == "range":
        check(CU.cuMemUnmap(ctypes.c_uint64(base), ctypes.c_size_t(count * size)), "cuMemUnmap")
        for h in handles:
            check(CU.cuMemRelease(h), "cuMemRelease")
    elif threads == 1:
        give_back_each(ctx, base, size, handles, range(count))
    else:
        workers = [
            threading.Thread(target=give_back_each, args=(ctx, base, size, handles, range(t, count, threads)))
            for t in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    took = time.perf_counter() - started
    check(CU.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(count * size)), "cuMemAddressFree")
    return took


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=512)
    parser.add_argument("--chunk-mib", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-gib", type=int, default=4, help="bytes the copy beside the release moves")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    size = args.chunk_mib * MIB
    src = torch.empty(args.copy_gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(args.copy_gib << 30, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    # Copy bandwidth alone, for scale.
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    copy_s = time.perf_counter() - t
    print(
        f"copy {args.copy_gib} GiB device->pinned host: {copy_s * 1e3:.1f} ms "
        f"({args.copy_gib * (1 << 30) / copy_s / 1e9:.1f} GB/s)"
    )
    cases = [("each", n) for n in (1, 2, 4, 8)] + [("range", 1)]
    rows = []
    for rep in range(args.repeat):
        for copying in (False, True):
            for mode, threads in cases:
                base, handles = map_chunks(args.chunks, size)
                torch.cuda.synchronize()
                if copying:
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                took = give_back(mode, threads, base, size, handles)
                copy_done = stream.query()
                stream.synchronize()
                rows.append(
                    {
                        "rep": rep,
                        "copying": copying,
                        "mode": mode,
                        "threads": threads,
                        "chunks": args.chunks,
                        "chunk_mib": args.chunk_mib,
                        "seconds": took,
                        "copy_still_running_at_end": copying and not copy_done,
                    }
                )
    print(
        f"{args.chunks} chunks of {args.chunk_mib} MiB, unmap+release, median over {args.repeat} (min-max), us a chunk:"
    )
    for copying in (False, True):
        for mode, threads in cases:
            per = [
                r["seconds"] / args.chunks * 1e6
                for r in rows
                if r["copying"] == copying and r["mode"] == mode and r["threads"] == threads
            ]
            covered = all(
                r["copy_still_running_at_end"]
                for r in rows
                if r["copying"] and r["mode"] == mode and r["threads"] == threads
            )
            label = f"{mode:5} x{threads}" + (" beside copy" if copying else "")
            note = "" if not copying else (" (copy outlasted it)" if covered else " (copy ended first)")
            print(f"  {label:24} {statistics.median(per):7.1f} ({min(per):.1f}-{max(per):.1f}){note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_seconds": copy_s, "copy_gib": args.copy_gib, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
