#!/usr/bin/env bash
# Builds, here, everything the GPU machine runs, and collects it in
# gpu-bundle/ (git-ignored), to be carried there and run by gpu-run.sh:
#
#   scripts/gpu-build.sh
#   device run, carry ["gpu-bundle"], command: bash gpu-bundle/gpu-run.sh
#   (on nvidia-h200-x2: bash gpu-bundle/gpu-run.sh multi)
#
# The device tool carries at most 64 MiB with the working tree, and the
# whole bundle with the tree is about that. Carry only the parts the jobs
# need, always with gpu-bundle/gpu-run.sh and gpu-bundle/BUILD:
#   tests:                 gpu-bundle/tests.tar.xz (the tests folder, packed)
#   multi:                 gpu-bundle/tests.tar.xz, gpu-bundle/examples
#   examples:              gpu-bundle/examples
#   bench, soak:           gpu-bundle/bin
#   replay, c-calls:       gpu-bundle/bin, gpu-bundle/traces
#   torch and the other PyTorch checks: gpu-bundle/torch
#   calls:                 gpu-bundle/torch (the repository's traces/ serve
#                          when gpu-bundle/traces is not carried)
#   e.g. carry ["gpu-bundle/gpu-run.sh", "gpu-bundle/BUILD", "gpu-bundle/tests.tar.xz", "gpu-bundle/torch"]
#
# BASE_REV=REV scripts/gpu-build.sh also bundles the C library as of REV,
# as torch/libvmpool_c-<REV>.so, to compare two builds in one PyTorch run:
#   TORCH_ARGS="--allocators vmpool,vmpool=gpu-bundle/torch/libvmpool_c-<REV>.so ..."
#
# The GPU machine has no Rust toolchain; binaries load libcuda at run time,
# so nothing here needs CUDA installed.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/examples" "$bundle/bin" "$bundle/traces" "$bundle/torch"

# Test binaries, with the GPU cases switched on.
cargo test --workspace --release --features gpu-tests --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
    # soak/tests/soak.rs and tests/replay_cli.rs run the soak and replay
    # binaries by their paths on this machine, on the host backend; the GPU
    # machine runs the binaries themselves (the soak and replay jobs).
    [ "$name" = soak ] && continue
    [ "$name" = replay_cli ] && continue
    # capi/tests/python.rs checks the Python helper on the host backend,
    # with the library of this machine's build; nothing for the GPU.
    [ "$name" = python ] && continue
    # capi/tests/bad_settings.rs loads this machine's build of the library
    # from Python on the host backend, as python.rs does.
    [ "$name" = bad_settings ] && continue
    # The binaries' own harnesses hold no tests.
    "$exe" --list 2>/dev/null | grep -q '^0 tests' && continue
    cp "$exe" "$bundle/tests/$name"
done

# Examples and command-line tools.
cargo build --workspace --release --examples --bins --features vmpool/cudarc
for src in examples/*.rs; do
    name=$(basename "$src" .rs)
    cp "target/release/examples/$name" "$bundle/examples/$name"
done
# The tools: vmpool-replay and vmpool-bench (tools/: a file or a folder
# each), vmpool-soak (soak/).
for name in $(basename -s .rs tools/src/bin/*) vmpool-soak; do
    cp "target/release/$name" "$bundle/bin/$name"
done
# The C layer's call cost (capi/examples/c_calls.rs), for the c-calls job.
cp target/release/examples/c_calls "$bundle/bin/c_calls"

# The C library and the PyTorch scripts, for the torch job; the Python
# package beside them (vmpool_torch.py imports it, and finds the library
# beside the package's folder); the wheel, which torch_wheel_check.py
# installs into a fresh environment there.
cargo build --release -p vmpool-c
cp target/release/libvmpool_c.so scripts/vmpool_torch.py scripts/pytorch_compare.py scripts/torch_record_stream.py scripts/torch_graphs.py scripts/torch_limits.py scripts/torch_stats.py scripts/torch_marks.py scripts/torch_cases.py scripts/torch_workloads.py scripts/torch_wheel_check.py scripts/torch_sleep.py scripts/torch_mempool.py scripts/torch_ddp.py scripts/nccl_bandwidth.py "$bundle/torch/"
# The calls probe's floor (pytorch_compare.py's `floor` allocator).
cc -O2 -Wall -Wextra -Werror -shared -fPIC -o "$bundle/torch/libpluggable_floor.so" scripts/pluggable_floor.c -ldl
mkdir -p "$bundle/torch/vmpool"
cp python/vmpool/*.py python/vmpool/py.typed "$bundle/torch/vmpool/"
python3 -m pip wheel --quiet --no-deps . -w "$bundle/torch"

# An older build of the C library, for A/B runs.
base_line=
if [ -n "${BASE_REV:-}" ]; then
    rev=$(git rev-parse --short "$BASE_REV")
    tree=$(mktemp -d)
    git worktree add --quiet --detach "$tree" "$rev"
    CARGO_TARGET_DIR="$PWD/target/base" cargo build --release -p vmpool-c --manifest-path "$tree/Cargo.toml"
    git worktree remove --force "$tree"
    cp target/base/release/libvmpool_c.so "$bundle/torch/libvmpool_c-$rev.so"
    base_line="base library: torch/libvmpool_c-$rev.so, built from $(git rev-parse "$rev")"
fi

# The traces recorded here (traces/) and, when VMPOOL_EXTRA_TRACES names a
# folder, the reference traces in it, for the replay job.
cp traces/*.trace.gz "$bundle/traces/"
if [ -n "${VMPOOL_EXTRA_TRACES:-}" ]; then
    cp "$VMPOOL_EXTRA_TRACES"/*.trace.gz "$bundle/traces/"
fi

# The device tool carries at most 64 MiB: symbols go (panics still print
# messages and locations, not function names).
strip "$bundle"/tests/* "$bundle"/examples/* "$bundle"/bin/* "$bundle"/torch/libvmpool_c*.so
# Stripped, the test binaries are still about 60 MiB, more than the tree
# leaves room for: packed, about 6 (gpu-run.sh unpacks them there).
tar -C "$bundle" -cf - tests | xz -9 -T0 >"$bundle/tests.tar.xz"

cp scripts/gpu-run.sh "$bundle/"
{
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo none)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) with $(rustc --version)"
    [ -z "$base_line" ] || echo "$base_line"
} >"$bundle/BUILD"
ls -l "$bundle"/*/
du -sh "$bundle"
