"""The proxy tests' fakes (fake nodes behind real uvicorn servers) are reused here."""

from __future__ import annotations

import sys
from pathlib import Path

_PROXY_TESTS = str(Path(__file__).resolve().parents[1] / "proxy")
if _PROXY_TESTS not in sys.path:
    sys.path.append(_PROXY_TESTS)
