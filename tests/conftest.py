"""Make shared test helpers importable as ``helpers.*`` (tests dirs have no ``__init__.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on CPU tensors). triton.jit
# reads this when triton is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
