"""Make shared test helpers importable as ``helpers.*`` (tests dirs have no ``__init__.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)
