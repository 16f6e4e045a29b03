"""The PyTorch drop-in under its earlier name: `vmpool.torch` from the
Python package (python/vmpool), found installed (`pip install` of the
wheel), else in this source tree, else beside this file (the GPU bundle
copies the package there).

    import vmpool_torch
    vmpool_torch.install()      # the same as vmpool.torch.install()

New code imports `vmpool.torch` itself.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
try:
    import vmpool  # noqa: F401
except ModuleNotFoundError:
    for _where in (_HERE.parent / "python", _HERE):
        if (_where / "vmpool" / "__init__.py").is_file():
            sys.path.insert(0, str(_where))
            break

from vmpool import FIELDS, Stats, library, library_version  # noqa: E402,F401
from vmpool._lib import MempoolId  # noqa: E402,F401
from vmpool.torch import (  # noqa: E402,F401
    backend,
    empty_cache,
    install,
    library_path,
    mark_step,
    print_snapshot,
    reset_peaks,
    snapshot,
    stats,
    summary,
    synchronize,
)
