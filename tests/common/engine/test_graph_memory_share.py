"""Two daemons starting at once on one GPU: each counts only its own memory.

``pdserve up`` starts the prefill and decode daemons together on one GPU. A daemon sets the
CUDA graphs' memory aside before it sizes its KV cache, measured by ``reserved_during`` around
a trial capture; the KV cache is what ``kv_cache_budget`` leaves of its share. A fake GPU here
holds each process's allocator bytes, and the two daemons' start-up steps run in every order,
with the other daemon's steps also inside the trial capture.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from common.engine.cuda_graph import reserved_during
from common.engine.gpu_memory import GiB, GpuMemoryError, kv_cache_budget, split_share

TOTAL, WEIGHTS, GRAPHS, ACTIVATIONS = 80 * GiB, 16 * GiB, GiB // 2, GiB
CONTEXT = GiB // 2  # each process's CUDA context: device memory outside its allocator


class FakeGpu:
    def __init__(self) -> None:
        self.held: dict[str, int] = {}  # process -> bytes its caching allocator reserved

    def alloc(self, process: str, n: int) -> None:
        self.held[process] = self.held.get(process, 0) + n

    def reserved(self, process: str) -> int:
        return self.held.get(process, 0)

    def free(self) -> int:
        return TOTAL - sum(self.held.values()) - CONTEXT * len(self.held)


def test_another_process_allocating_during_the_capture_does_not_count():
    gpu = FakeGpu()
    gpu.alloc("us", WEIGHTS)

    def capture() -> None:
        gpu.alloc("us", GRAPHS)
        gpu.alloc("other daemon", 20 * GiB)  # its weights land meanwhile

    assert reserved_during(capture, lambda: gpu.reserved("us")) == GRAPHS


def test_the_measure_waits_for_the_work_before_reading():
    gpu, queued = FakeGpu(), []
    sync = lambda: [f() for f in queued] and queued.clear()  # noqa: E731  (a stream: work lands on sync)
    taken = reserved_during(lambda: queued.append(lambda: gpu.alloc("us", GRAPHS)), lambda: gpu.reserved("us"),
                            sync)
    assert taken == GRAPHS


def test_memory_given_back_meanwhile_is_not_negative():
    gpu = FakeGpu()
    gpu.alloc("us", WEIGHTS)
    assert reserved_during(lambda: gpu.alloc("us", -GiB), lambda: gpu.reserved("us")) == 0


class Daemon:
    """One daemon's start-up, LLMEngine's order, a step at a time: weights, free memory, trial
    capture (freed after), KV budget and cache, the real graphs."""

    def __init__(self, name: str, gpu: FakeGpu, reader: Callable[[str], int]) -> None:
        self.name, self.gpu, self.reader = name, gpu, reader
        self.graphs = self.kv = self.free = 0
        self.during_trial: Callable[[], None] = lambda: None
        self.steps = [self.load, self.read_free, self.trial, self.size_kv, self.capture]

    def load(self) -> None:
        self.gpu.alloc(self.name, WEIGHTS)

    def read_free(self) -> None:
        self.free = self.gpu.free()

    def trial(self) -> None:
        def run() -> None:
            self.gpu.alloc(self.name, GRAPHS)
            self.during_trial()

        self.graphs = reserved_during(run, lambda: self.reader(self.name))
        self.gpu.alloc(self.name, -GRAPHS)  # empty_cache after the trial

    def size_kv(self) -> None:
        self.kv = kv_cache_budget(TOTAL, self.free, self.gpu.reserved(self.name), split_share(2),
                                  ACTIVATIONS + self.graphs)
        self.gpu.alloc(self.name, self.kv)

    def capture(self) -> None:
        self.gpu.alloc(self.name, GRAPHS)


def start_both(order: tuple[str, ...], nested: dict[str, bool], reader_of: Callable[[FakeGpu], Callable]):
    """Run both start-ups in ``order``; ``nested[x]``: the other daemon's next step runs inside x's trial."""
    gpu = FakeGpu()
    daemons = {name: Daemon(name, gpu, reader_of(gpu)) for name in ("prefill", "decode")}
    todo = {name: list(d.steps) for name, d in daemons.items()}
    busy: set[str] = set()  # a process runs one step at a time

    def step(name: str) -> None:
        if todo[name] and name not in busy:
            busy.add(name)
            todo[name].pop(0)()
            busy.discard(name)

    for name, other in (("prefill", "decode"), ("decode", "prefill")):
        if nested[name]:
            daemons[name].during_trial = lambda other=other: step(other)
    for name in order:
        step(name)
    return gpu, daemons


ORDERS = sorted(set(itertools.permutations(["prefill"] * 5 + ["decode"] * 5)))
NESTINGS = [{"prefill": a, "decode": b} for a in (False, True) for b in (False, True)]


def test_both_daemons_get_the_same_cache_in_every_start_order():
    own = lambda gpu: gpu.reserved  # noqa: E731  (torch.cuda.memory_reserved: this process's allocator)
    share = split_share(2) * TOTAL
    want_kv = int(share - WEIGHTS - ACTIVATIONS - GRAPHS)
    for order, nested in itertools.product(ORDERS, NESTINGS):
        gpu, daemons = start_both(order, nested, own)
        assert [(d.graphs, d.kv) for d in daemons.values()] == [(GRAPHS, want_kv)] * 2, (order, nested)
        assert gpu.free() >= 0


def test_measuring_the_device_instead_breaks_some_start_orders():
    """The old measure (the drop in the device's free memory) counts the other daemon's loads."""
    device_wide = lambda gpu: lambda process: TOTAL - gpu.free()  # noqa: E731
    broken = 0
    for order, nested in itertools.product(ORDERS, NESTINGS):
        try:
            _, daemons = start_both(order, nested, device_wide)
        except GpuMemoryError:
            broken += 1
            continue
        broken += any(d.graphs > GRAPHS for d in daemons.values())
    assert broken > 0


@pytest.mark.parametrize("share", [0.6, 0.9])
def test_shares_that_do_not_fit_together_are_refused_with_numbers(share):
    gpu = FakeGpu()
    first = kv_cache_budget(TOTAL, gpu.free(), WEIGHTS, share, ACTIVATIONS)
    gpu.alloc("first", WEIGHTS + first)
    gpu.alloc("second", WEIGHTS)
    with pytest.raises(GpuMemoryError, match="another process holds"):
        kv_cache_budget(TOTAL, gpu.free(), WEIGHTS, share, ACTIVATIONS)
