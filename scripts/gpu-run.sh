#!/usr/bin/env bash
# Runs, on the GPU machine, what scripts/gpu-build.sh bundled, and writes one
# log, $OUT/gpu-run.log (./gpu-run.log when OUT is unset), each program's
# output under a header that says what ran, when, from which commit. Each
# call starts its log afresh: to keep several calls' logs (a loop over
# seeds, say), give each call a folder of its own, OUT=$OUT/seed1 ...
#
#   bash gpu-bundle/gpu-run.sh [tests] [examples] [bench] [replay] [soak] [sleep] [torch] [long] [calls] [record-stream] [graphs] [limits] [stats] [marks] [wheel] [torch-sleep] [mempool] [c-calls] [multi] [ddp] [nccl]
#   (default: tests, examples, bench and replay;
#   soak runs SOAK_SECONDS, default 300)
#
# torch: scripts/pytorch_compare.py with TORCH_ARGS (e.g. "--steps 3
# --allocators vmpool" for a quick check); its JSON goes to $OUT.
#
# long: scripts/pytorch_compare.py over the models in WORKLOADS (default
# all nine), the ALLOCATORS (default native, vmpool and vmpool-steps:
# vmpool marks a step at each optimizer step, vmpool-steps at each step of
# the loop) interleaved, REPEATS runs (default 3) of
# STEPS steps (default 300) each, to $OUT/long.json; then one vmpool run of
# RECORD_STEPS steps (default 24) of each workload in RECORD (default the
# five added for issue 23; empty: none) records its allocation trace to
# $OUT/traces, gzipped. docs/GPU.md says how long each workload takes.
# long and calls time the steps with vmpool's own call timing off (it
# costs two clock reads a call, counted against vmpool); CALL_TIMING=1
# turns it on, to see vmpool's share of a step.
#
# calls: the calls probe over the bundled traces (else the repository's
# traces/, when the bundle's are not carried) named in CALLS_TRACES
# (comma-separated names without .trace.gz; default all), the ALLOCATORS
# as for long, REPEATS runs (default 3) of CALLS_STEPS steps (default 12), to
# $OUT/calls.json.
#
# record-stream: scripts/torch_record_stream.py, whether memory another
# stream still uses (Tensor.record_stream) is reused under it.
#
# graphs: scripts/torch_graphs.py, whether CUDA graphs (torch.cuda.graph)
# capture and replay right, without their memory going to eager tensors.
#
# limits: scripts/torch_limits.py, whether set_per_process_memory_fraction
# limits the allocator and empty_cache gives the memory back.
#
# stats: scripts/torch_stats.py, whether PyTorch's memory statistics
# (torch.cuda.memory_allocated() and the rest) report vmpool's figures.
#
# marks: scripts/torch_marks.py, whether install() marks one step an
# iteration under PyTorch: one optimizer, two, and a GradScaler that skips
# optimizer steps.
#
# sleep: examples/sleep_wake.rs, a pool keeping SLEEP_GIB GiB (default
# 1,10,40) put to sleep and woken SLEEP_CYCLES times (default 3: the first
# pins the host buffer, the others reuse it), each timed beside the
# page-locked copy bandwidth, every kept byte checked; then two cycles
# with the buffer pinned ahead (--reserve-host).
#
# torch-sleep: scripts/torch_sleep.py, sleep and wake under PyTorch: a
# model's outputs and a CUDA graph's replay equal across them, the memory
# free while asleep.
#
# mempool: scripts/torch_mempool.py, torch.cuda.MemPool and use_mem_pool
# over vmpool: a MemPool's tensors from a vmpool pool of its own, released
# with its memory given back; a model's weights in one, its forward pass
# equal to native; and a PyTorch MemPool whose segments vmpool serves.
#
# wheel: scripts/torch_wheel_check.py: the wheel installed into a fresh
# environment, training under vmpool.torch.install() and the launcher
# against native, the package's statistics and errors.
#
# ddp: scripts/torch_ddp.py, GPT-2 small trained over NCCL on every GPU,
# DDP and FSDP2 (fully_shard), native PyTorch (default and expandable
# segments) against vmpool.torch.install() in every rank, each a torchrun
# run of its own: losses equal, footprint per rank, step time. DDP_ARGS
# passes options (e.g. "--steps 10"). One GPU: a process group of one.
#
# nccl: scripts/nccl_bandwidth.py, all-reduce bus bandwidth 1 MiB..1 GiB
# over native memory and vmpool memory, unregistered and registered with
# NCCL (vmpool.torch.register, and PyTorch's register_mem_pool), every
# buffer's result checked; then collectives over buffers on remapped
# chunks, registered. NCCL_ARGS passes options (e.g. "--max-mib 256").
# NVLink multicast stays off in both.
#
# c-calls: capi/examples/c_calls.rs on the generation trace, what a call
# through vmpool_alloc / vmpool_free costs, without and with VMPOOL_TIMING
# (which pytorch_compare.py turns on for every vmpool run).
#
# multi: on a machine with two GPUs (nvidia-h200-x2): peer access and
# per-device pools (tests/peer_access with its two-GPU cases, which are
# #[ignore]d elsewhere), sharing a pool between processes (tests/ipc, with
# its two-GPU case: an importer that numbers devices otherwise), and the
# peer_access and ipc examples.
#
# replay: every bundled trace through vmpool-replay on the CUDA backend, with
# CUDA's pool, plain cuMemAlloc, and vmpool with each setting in
# REPLAY_VMPOOL (';'-separated vmpool-replay options, e.g.
# "--chunk-divisor 1024;--chunk-size 2097152"; default: one run at the
# defaults), synchronous and stream-ordered.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
outdir=${OUT:-$PWD}
mkdir -p "$outdir"
log=$outdir/gpu-run.log
: >"$log"
status=0

header() {
    echo "# $1"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    cat "$here/BUILD"
    echo "command: $2"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    echo
}

# run TITLE PROGRAM [ARGS...]: the command as shown is the program's path
# inside the bundle with its arguments.
run() {
    local title=$1
    shift
    header "$title" "${*//$here/gpu-bundle}" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "exit: $rc" | tee -a "$log"
    echo | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

# The test binaries come packed (gpu-build.sh): unpacked once, here.
if [ ! -d "$here/tests" ] && [ -f "$here/tests.tar.xz" ]; then
    tar -C "$here" -xJf "$here/tests.tar.xz" || status=1
fi

call_timing=--no-call-timing
[ "${CALL_TIMING:-0}" = 1 ] && call_timing=
jobs=${*:-tests examples bench replay}
for job in $jobs; do
    # The parts of the bundle each job needs (scripts/gpu-build.sh says
    # what to carry).
    case $job in
    tests) parts=tests ;;
    multi) parts="tests examples" ;;
    examples | sleep) parts=examples ;;
    bench | soak) parts=bin ;;
    replay | c-calls) parts="bin traces" ;;
    torch | long | record-stream | graphs | limits | stats | marks | wheel | torch-sleep | mempool | ddp | nccl) parts=torch ;;
    calls) parts=torch ;;
    *) parts= ;;
    esac
    missing=
    for part in $parts; do
        [ -d "$here/$part" ] || missing="$missing gpu-bundle/$part"
    done
    if [ -n "$missing" ]; then
        echo "job $job: not carried:$missing" | tee -a "$log"
        status=1
        continue
    fi
    case $job in
    tests)
        # One test at a time: with four at once, a case that checks an event
        # is still pending behind a 300 ms delay once saw it complete
        # (docs/gpu-runs/2026-11-29T1816-examples-bench-replay.log), as if a
        # driver call had waited for another test's work on the device.
        for exe in "$here"/tests/*; do
            run "test $(basename "$exe")" "$exe" --test-threads=1
        done
        ;;
    examples)
        # From the output folder, so that what they write (target/defrag.svg)
        # comes back.
        pushd "$outdir" >/dev/null || exit 1
        mkdir -p target
        for exe in "$here"/examples/*; do
            # Needs two GPUs: the multi job runs it.
            [ "$(basename "$exe")" = peer_access ] && continue
            # Timed at 1, 10 and 40 GiB: the sleep job runs it.
            [ "$(basename "$exe")" = sleep_wake ] && continue
            run "example $(basename "$exe")" "$exe"
        done
        popd >/dev/null || exit 1
        ;;
    sleep)
        run "sleep and wake" "$here/examples/sleep_wake" --backend cuda --gib "${SLEEP_GIB:-1,10,40}" --cycles "${SLEEP_CYCLES:-3}"
        run "sleep and wake, the host buffer pinned ahead" "$here/examples/sleep_wake" --backend cuda --gib "${SLEEP_GIB:-1,10,40}" --cycles 2 --reserve-host
        run "sleep and wake, prepared (granules joined) after the host buffer pinned ahead" "$here/examples/sleep_wake" --backend cuda --gib "${SLEEP_GIB:-1,10,40}" --cycles 2 --reserve-host --prepare
        ;;
    bench)
        run "bench" "$here/bin/vmpool-bench" --backend cuda
        run "bench (json)" "$here/bin/vmpool-bench" --backend cuda --json
        ;;
    soak)
        run "soak" "$here/bin/vmpool-soak" --backend cuda --threads 8 --seconds "${SOAK_SECONDS:-300}"
        ;;
    torch)
        # shellcheck disable=SC2086 # TORCH_ARGS is a list of arguments
        run "pytorch compare" python3 "$here/torch/pytorch_compare.py" ${TORCH_ARGS:-} --json "$outdir/pytorch_compare.json"
        ;;
    long)
        steps=${STEPS:-300}
        # A run's limit grows with its steps: gpt2-generate takes about
        # half a second a step.
        run "pytorch long runs" python3 "$here/torch/pytorch_compare.py" --workloads "${WORKLOADS:-models}" \
            --allocators "${ALLOCATORS:-native,vmpool,vmpool-steps}" --repeats "${REPEATS:-3}" --steps "$steps" \
            --timeout $((120 + 2 * steps)) ${call_timing:+"$call_timing"} \
            --json "$outdir/long.json"
        record=${RECORD-gqa-decoder-train,vit-train,unet-train,moe-train,serve-loop}
        if [ -n "$record" ]; then
            # Apart from the timed runs: writing the trace costs time in
            # every call.
            run "pytorch long runs, recording" python3 "$here/torch/pytorch_compare.py" --workloads "$record" \
                --allocators vmpool --steps "${RECORD_STEPS:-24}" --record "$outdir/traces" \
                --json "$outdir/long-record.json"
            for trace in "$outdir"/traces/*.trace; do
                [ -f "$trace" ] && gzip -f "$trace"
            done
        fi
        ;;
    calls)
        # The bundle's traces if carried, else the repository's traces/
        # (the same recordings, without VMPOOL_EXTRA_TRACES's): the bundle's
        # traces and its torch part together pass the carry's 64 MiB.
        trace_dir=$here/traces
        [ -d "$trace_dir" ] || trace_dir=$here/../traces
        if [ ! -d "$trace_dir" ]; then
            echo "job calls: no traces (neither gpu-bundle/traces nor traces/)" | tee -a "$log"
            status=1
            continue
        fi
        names=${CALLS_TRACES:-$(cd "$trace_dir" && ls -- *.trace.gz | sed 's/\.trace\.gz$//' | paste -sd, -)}
        traces=$(tr ',' '\n' <<<"$names" | sed "s|.*|$trace_dir/&.trace.gz|" | paste -sd, -)
        run "pytorch calls probe" python3 "$here/torch/pytorch_compare.py" --workloads calls-probe \
            --calls-trace "$traces" --allocators "${ALLOCATORS:-native,vmpool,vmpool-steps}" --repeats "${REPEATS:-3}" \
            --steps "${CALLS_STEPS:-12}" ${call_timing:+"$call_timing"} --json "$outdir/calls.json"
        ;;
    record-stream)
        run "pytorch record_stream" python3 "$here/torch/torch_record_stream.py"
        ;;
    graphs)
        run "pytorch graphs" python3 "$here/torch/torch_graphs.py"
        ;;
    torch-sleep)
        run "pytorch sleep and wake" python3 "$here/torch/torch_sleep.py"
        ;;
    mempool)
        run "pytorch mempool" python3 "$here/torch/torch_mempool.py"
        ;;
    ddp)
        # shellcheck disable=SC2086 # DDP_ARGS is a list of options
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            run "pytorch ddp and fsdp" python3 "$here/torch/torch_ddp.py" ${DDP_ARGS:-}
        ;;
    nccl)
        # shellcheck disable=SC2086 # NCCL_ARGS is a list of options
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            run "nccl bandwidth and registration" python3 "$here/torch/nccl_bandwidth.py" ${NCCL_ARGS:-}
        ;;
    limits)
        run "pytorch limits" python3 "$here/torch/torch_limits.py"
        ;;
    stats)
        run "pytorch stats" python3 "$here/torch/torch_stats.py"
        ;;
    marks)
        run "pytorch step marks" python3 "$here/torch/torch_marks.py"
        ;;
    wheel)
        run "pytorch wheel" python3 "$here/torch/torch_wheel_check.py" --out "$outdir"
        ;;
    c-calls)
        run "c_calls" env VMPOOL_TIMING=0 "$here/bin/c_calls" "$here/traces/gpt2_generate.trace.gz"
        run "c_calls, timed" env VMPOOL_TIMING=1 "$here/bin/c_calls" "$here/traces/gpt2_generate.trace.gz"
        ;;
    replay)
        for trace in "$here"/traces/*; do
            for allocator in cuda-async cuda-malloc; do
                run "replay $(basename "$trace") $allocator" "$here/bin/vmpool-replay" --backend cuda --allocator "$allocator" "$trace"
            done
            IFS=';' read -ra settings <<<"${REPLAY_VMPOOL:-}"
            for setting in "${settings[@]:-}"; do
                # shellcheck disable=SC2086 # a setting is a list of options
                run "replay $(basename "$trace") vmpool $setting" "$here/bin/vmpool-replay" --backend cuda $setting "$trace"
                # shellcheck disable=SC2086
                run "replay $(basename "$trace") vmpool $setting stream-ordered" "$here/bin/vmpool-replay" --backend cuda $setting --stream-ordered "$trace"
            done
        done
        ;;
    multi)
        nvidia-smi topo -m 2>/dev/null | sed 's/^/topology: /' | tee -a "$log"
        run "test peer_access (two GPUs)" "$here/tests/peer_access" --include-ignored --test-threads=1
        run "test misuse (two GPUs)" "$here/tests/misuse" --include-ignored --test-threads=1
        # Three times: its fault case once failed on this machine
        # (docs/gpu-runs/2026-11-29T2008-x2-multi-tests-examples-torch-record.log).
        for round in 1 2 3; do
            run "test ipc (two processes), round $round" "$here/tests/ipc" --include-ignored --test-threads=1
        done
        run "example peer_access" "$here/examples/peer_access" --backend cuda
        run "example ipc" "$here/examples/ipc" --backend cuda
        ;;
    *)
        echo "unknown job $job" >&2
        exit 2
        ;;
    esac
done
exit $status
