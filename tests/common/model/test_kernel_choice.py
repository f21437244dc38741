"""Which kernels an engine runs (``choose_kernels``) and what it runs when their warm-up fails.

Pure decisions: a ``torch.device("cuda")`` needs no GPU, and whether triton is installed is the
one fact read from the machine (``triton_available``), set here both ways.
"""

from __future__ import annotations

import logging

import pytest
import torch

from common.model import attention
from common.model.attention import (
    BATCH_INVARIANT,
    PLAIN,
    KernelChoice,
    TritonStartError,
    choose_kernels,
    warm_up_fallback,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def triton_installed(monkeypatch):
    def set_installed(installed: bool) -> None:
        monkeypatch.setattr(attention, "triton_available", lambda: installed)

    return set_installed


def test_auto_is_triton_for_cuda_when_installed(triton_installed):
    triton_installed(True)
    assert choose_kernels("auto", "auto", CUDA) == KernelChoice("triton", True, ())
    assert choose_kernels("auto", "auto", CPU) == PLAIN


def test_auto_without_triton_is_plain_with_a_warning(triton_installed, caplog):
    triton_installed(False)
    with caplog.at_level(logging.WARNING, logger="common.model.attention"):
        assert choose_kernels("auto", "auto", CUDA) == PLAIN
    assert "triton is not installed" in caplog.text


def test_off_and_sdpa_turn_triton_off_on_cuda(triton_installed):
    triton_installed(True)
    assert choose_kernels("sdpa", "off", CUDA) == PLAIN
    assert choose_kernels("auto", "off", CUDA) == KernelChoice("triton", False, ())
    assert choose_kernels("sdpa", "auto", CUDA) == KernelChoice("sdpa", True, ())


def test_named_choices_are_kept_and_remembered_as_required(triton_installed):
    triton_installed(True)
    assert choose_kernels("triton", "auto", CPU) == KernelChoice("triton", False, ("--attention-backend triton",))
    assert choose_kernels("sdpa", "on", CPU) == KernelChoice("sdpa", True, ("--fused-ops on",))


@pytest.mark.parametrize(("backend", "fused", "named"), [
    ("triton", "auto", "--attention-backend triton"), ("auto", "on", "--fused-ops on")])
def test_naming_triton_without_it_installed_stops_the_start(triton_installed, backend, fused, named):
    triton_installed(False)
    with pytest.raises(TritonStartError, match=named):
        choose_kernels(backend, fused, CUDA)


def test_failed_warm_up_of_an_auto_choice_falls_back_to_plain():
    error = RuntimeError("Failed to find C compiler")
    assert warm_up_fallback(KernelChoice("triton", True), error) == PLAIN
    assert warm_up_fallback(KernelChoice("sdpa", True), error) == PLAIN


def test_batch_invariant_keeps_triton_attention_where_it_runs_else_takes_the_torch_path(triton_installed):
    triton_installed(True)
    assert choose_kernels("auto", "auto", CUDA, batch_invariant=True) == KernelChoice("triton", True, invariant=True)
    assert choose_kernels("sdpa", "auto", CUDA, batch_invariant=True) == BATCH_INVARIANT
    assert choose_kernels("auto", "auto", torch.device("cpu"), batch_invariant=True) == BATCH_INVARIANT
    # its failed warm-up falls back to the torch path, still invariant
    assert warm_up_fallback(KernelChoice("triton", True, invariant=True), RuntimeError("no cc")) == BATCH_INVARIANT


def test_failed_warm_up_of_a_named_choice_stops_with_the_cause_and_the_flags():
    error = RuntimeError("Failed to find C compiler")
    with pytest.raises(TritonStartError) as stop:
        warm_up_fallback(KernelChoice("triton", True, ("--attention-backend triton",)), error)
    msg = str(stop.value)
    assert "--attention-backend triton" in msg and "Failed to find C compiler" in msg
    assert "C compiler" in msg and "--attention-backend auto" in msg
    assert stop.value.__cause__ is error


def test_failed_warm_up_without_triton_is_not_hidden():
    error = torch.cuda.OutOfMemoryError("out of memory")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        warm_up_fallback(PLAIN, error)
