#!/usr/bin/env bash
# Runs, on the GPU machine, what scripts/gpu-build.sh bundled, and writes one
# log, $OUT/gpu-run.log (./gpu-run.log when OUT is unset), each program's
# output under a header that says what ran, when, from which commit.
#
#   bash gpu-bundle/gpu-run.sh [NAME ...]   NAME: test or example to run (default: all)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
log=${OUT:-$PWD}/gpu-run.log
: >"$log"

header() {
    echo "# $1"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    cat "$here/BUILD"
    echo "command: $2"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    echo
}

# run TITLE COMMAND-AS-SHOWN PROGRAM [ARGS...]
run() {
    local title=$1 shown=$2
    shift 2
    header "$title" "$shown" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "exit: $rc" | tee -a "$log"
    echo | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

wanted() { [[ " $WANT " == *" $1 "* ]]; }
WANT="$*"
status=0
for exe in "$here"/tests/*; do
    name=$(basename "$exe")
    [ -z "$WANT" ] || wanted "$name" || continue
    cmd="gpu-bundle/tests/$name --test-threads=4"
    run "test $name" "$cmd" "$exe" --test-threads=4
done
for exe in "$here"/bin/*; do
    name=$(basename "$exe")
    [ -z "$WANT" ] || wanted "$name" || continue
    cmd="gpu-bundle/bin/$name"
    run "example $name" "$cmd" "$exe"
done
exit $status
