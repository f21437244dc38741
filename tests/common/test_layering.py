"""Layers point down only (STYLE.md): common/ is the libraries the processes share and imports
none of the process packages nor the start-up package (pdserve/); the engine and the model
import nothing of the cluster (ZMQ, the registry, the node's config, the KV transfer)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = {"proxy", "prefill_node", "decode_node", "pdserve"}


def _imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_common_imports_no_process_package() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) & PROCESS_PACKAGES)
        for path in sorted((ROOT / "common").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_engine_and_model_load_nothing_of_the_cluster() -> None:
    """Importing the engine (and with it the model) loads no ZMQ, registry, node config or KV
    transfer module: checked in a fresh interpreter, so nothing a test imported first counts."""
    code = ("import sys; import common.engine.async_engine, common.engine.llm_engine, common.model; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'pdserve') or m in "
            "('common.config', 'common.registry_client', 'common.cluster_auth') or m.startswith('common.kv_transfer')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
