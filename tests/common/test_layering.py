"""common/ is what the three processes share: it imports none of them (STYLE.md's layering)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = {"proxy", "prefill_node", "decode_node"}


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
