"""The Makefile's install step: done from scratch (CI), skipped when nothing changed.

``make -n`` prints what make would run without running it, against a stand-in venv
directory, so these tests neither create a venv nor touch the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAMP = ".pdserve-installed"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(target: str, venv: Path) -> str:
    # Under `make test` (CI) the outer make's MAKELEVEL/MAKEFLAGS would make this one a
    # sub-make that prints "Entering directory" lines around its plan: run it as a top-level make.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def fake_venv(tmp_path: Path, stamp_age_s: float | None) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    if stamp_age_s is not None:
        stamp = venv / STAMP
        stamp.touch()
        when = (REPO / "pyproject.toml").stat().st_mtime + stamp_age_s
        os.utime(stamp, (when, when))
    return venv


def test_from_scratch_install_makes_the_venv_and_installs(tmp_path: Path) -> None:
    out = dry_run("install", tmp_path / "venv")
    assert "-m venv" in out and "pip install -q torch==" in out and "pip install -q -e '.[test]'" in out
    assert out.index("torch==") < out.index("-e '.[test]'")  # torch pinned first: the CPU wheel


@pytest.mark.parametrize("target", ["up", "test", "install"])
def test_an_up_to_date_install_is_skipped(tmp_path: Path, target: str) -> None:
    out = dry_run(target, fake_venv(tmp_path, stamp_age_s=60))
    assert "pip install" not in out and "-m venv" not in out


def test_a_changed_pyproject_reinstalls(tmp_path: Path) -> None:
    out = dry_run("up", fake_venv(tmp_path, stamp_age_s=-60))
    assert "pip install -q -e '.[test]'" in out and "-m venv" not in out
    assert out.rstrip().endswith("pdserve up")


def test_a_venv_without_the_stamp_installs(tmp_path: Path) -> None:
    """An interrupted install (or one from before the stamp existed) is finished, not trusted."""
    assert "pip install -q -e '.[test]'" in dry_run("test", fake_venv(tmp_path, stamp_age_s=None))


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], "python3 bench/gpu_check.py gpu-check-out"),
    (["PYTHON=/opt/py/bin/python", "OUT=/tmp/x"], "/opt/py/bin/python bench/gpu_check.py /tmp/x"),
])
def test_gpu_check_runs_the_given_python_without_a_venv(overrides: list[str], expected: str) -> None:
    """An offline GPU machine has its own torch: `make gpu-check` neither makes a venv nor installs."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "PYTHON", "OUT")}
    result = subprocess.run(["make", "-n", "gpu-check", *overrides], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
