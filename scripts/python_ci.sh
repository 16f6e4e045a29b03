#!/usr/bin/env bash
# The Python package's checks, as CI runs them: builds the wheel the way a
# user does (`pip wheel --no-deps .`, needing Rust and PyPI, not CUDA),
# installs it into a fresh virtual environment, checks its manylinux tag,
# then lints and formats (ruff), checks the type hints (mypy) and runs
# python/tests (pytest) against the installed package, on vmpool's host
# backend.
#
#   bash scripts/python_ci.sh
set -euo pipefail
cd "$(dirname "$0")/.."
unset VMPOOL_LIB VMPOOL_ALLOW_MISMATCH

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/build"
"$work/build/bin/pip" wheel --quiet --no-deps . -w "$work/dist"
wheel=$(ls "$work"/dist/vmpool-*.whl)
echo "built $(basename "$wheel")"

python3 -m venv "$work/test"
"$work/test/bin/pip" install --quiet "$wheel" pytest ruff mypy auditwheel
"$work/test/bin/auditwheel" show "$wheel" | tr '\n' ' ' | grep -q "consistent with the following platform tag: \"manylinux_2_[0-9]*_x86_64\"" ||
    { "$work/test/bin/auditwheel" show "$wheel"; echo "the wheel's manylinux tag does not hold" >&2; exit 1; }
# The installed package, with the library it carries, and their versions.
(cd "$work" && VMPOOL_BACKEND=host "$work/test/bin/python" -c '
import sys, vmpool
assert vmpool.library_path().startswith(sys.prefix), vmpool.library_path()
assert vmpool.__version__ == vmpool.library_version(), (vmpool.__version__, vmpool.library_version())
print("vmpool", vmpool.__version__, "from", vmpool.library_path())
')

"$work/test/bin/ruff" check
"$work/test/bin/ruff" format --check
"$work/test/bin/mypy"
# From the repository's root, `import vmpool` finds the installed package
# (the source is under python/, not on the path).
"$work/test/bin/python" -m pytest python/tests
