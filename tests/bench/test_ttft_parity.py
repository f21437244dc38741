"""bench/ttft_breakdown.py's parity checks on CPU (the GPU acceptance runs them on a GPU).

``--parity`` sends greedy requests through the prefill -> decode pair, ``--up-parity`` through a
fresh `pdserve up`'s proxy; both compare with the colocated node and report it in ``--json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_pair_and_up_answers_equal_the_colocated_node(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "bench" / "ttft_breakdown.py"), "--prompt-tokens", "64", "--repeats", "1",
           "--parity", "2", "--up-parity", "2", "--up-env", "PDSERVE_KV_TRANSPORT=tcp", "--json", str(report_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    expected = {"n": 2, "identical": 2, "first_mismatch": None, "transport": "tcp"}
    assert report["parity_pair"] == expected
    assert report["parity_up"] == expected
    assert report["transport"] == "tcp" and report["median"]["kv_mb"] > 0
    assert "parity through `pdserve up`'s proxy (KV over tcp): 2/2" in proc.stdout
