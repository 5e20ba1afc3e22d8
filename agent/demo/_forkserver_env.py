"""The environment the forkserver of :func:`stepwatch.demo.launch.forked` started with.

The server imports this module first, before torch: importing ``torch._dynamo`` changes
``os.environ`` (it sets ``TORCHINDUCTOR_CACHE_DIR``), and a forked rank must be compared
with the variables the server's process started with, not with what its imports left."""

from __future__ import annotations

import os

AT_START = dict(os.environ)
