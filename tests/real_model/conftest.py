"""The real default model for the tests that need real weights: fetched and converted once per
machine into the user cache (as `pdserve up` would), then shared by every test here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.defaults import DEFAULT_CACHE_DIR
from common.model.sources import DEFAULT_MODEL, resolve_model


@dataclass(frozen=True)
class RealModel:
    directory: Path  # the converted Hugging Face directory
    gguf: Path  # the GGUF it came from (transformers' reference loads this)


@pytest.fixture(scope="session")
def real_model() -> RealModel:
    directory, _ = resolve_model(None, DEFAULT_CACHE_DIR)
    return RealModel(directory, Path(DEFAULT_CACHE_DIR).expanduser() / "downloads" / DEFAULT_MODEL.file_name)


@pytest.fixture(scope="session")
def newcomer_env():
    """A context in which a started process sees no PDSERVE_MODEL (the suite's default is the embedded model)."""

    @contextlib.contextmanager
    def without_model_env() -> Iterator[None]:
        saved = os.environ.pop("PDSERVE_MODEL", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["PDSERVE_MODEL"] = saved

    return without_model_env
