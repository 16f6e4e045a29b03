"""The tests run on vmpool's host backend: no GPU, no PyTorch. The setting
is read at the library's first call, so it is set before any test runs."""

import os

os.environ["VMPOOL_BACKEND"] = "host"
os.environ.setdefault("VMPOOL_HOST_MEMORY", "1G")
