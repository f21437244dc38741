"""The role flip's state machine (common/node/role_flip.py) and its admin route's checks
(common/node/role_routes.py) over a stand-in daemon: what is refused, what a failed swap leaves
(fenced, reported, retried), a drain that runs out, and who may call ``POST /admin/role`` keyless.
The flip against real processes is tests/test_role_flip_e2e.py."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from common.node.role_flip import FlipFailed, FlipRefused, RoleFlipper
from common.node.role_routes import add_role_routes
from common.request_id import make_request_id
from common.serving.errors import OpenAIError

KV = "127.0.0.1:14579"


class Engine:
    """Runs ``call`` at once on a stand-in LLMEngine; ``busy`` requests until ``abort_all``."""

    def __init__(self, busy: int = 0) -> None:
        self.busy, self.aborted = busy, 0
        self.llm = SimpleNamespace(is_idle=lambda: self.busy == 0)

    def call(self, fn):
        future: Future = Future()
        try:
            future.set_result(fn(self.llm))
        except Exception as exc:  # noqa: BLE001 - handed over as LLMEngine.call does
            future.set_exception(exc)
        return future

    def abort_all(self, error: str, code: str) -> int:
        ended, self.busy, self.aborted = self.busy, 0, self.aborted + self.busy
        return ended


class Daemon:
    def __init__(self, role: str = "prefill", busy: int = 0, tp: int = 1, fail_swaps: int = 0) -> None:
        self.config = SimpleNamespace(role=role, kv_addr=KV, tensor_parallel_size=tp, kv_rank_count=tp)
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.engine, self.heartbeater, self.key, self.transfer = Engine(busy), None, None, None
        self.fail_swaps, self.nudges = fail_swaps, 0

    def switch_role(self, role: str, connector: object) -> None:
        if self.fail_swaps:
            self.fail_swaps -= 1
            raise RuntimeError("the other half would not build")
        self.config.role = role

    def nudge(self) -> None:
        self.nudges += 1


def flipper(daemon: Daemon, drain_timeout_s: float = 5.0) -> RoleFlipper:
    return RoleFlipper(daemon, {"prefill": object, "decode": object}, drain_timeout_s)  # type: ignore[arg-type]


def sample(f: RoleFlipper, name: str, **labels: str) -> float:
    return f.daemon.metrics.registry.get_sample_value("pdserve:" + name, labels or None) or 0.0


def test_a_flip_moves_the_role_and_the_epoch_and_says_so() -> None:
    f = flipper(Daemon())
    result = f.flip("decode", 0)
    assert (result.role, result.epoch, result.aborted, f.role_state) == ("decode", 1, 0, "serving")
    assert f.daemon.nudges >= 1  # the draining state went out at once
    assert sample(f, "role_flips_total", **{"from": "prefill", "to": "decode", "outcome": "ok"}) == 1
    assert sample(f, "node_role_epoch") == 1
    assert (sample(f, "node_role", role="decode"), sample(f, "node_role", role="prefill")) == (1, 0)
    assert f.flip("decode", 1).epoch == 1  # the role it has, its epoch: nothing to do


@pytest.mark.parametrize("case, code", [("stale", "stale_role_epoch"), ("tp", "role_flip_unsupported"),
                                        ("draining", "role_flip_in_progress"), ("one_role", "role_flip_unsupported")])
def test_what_is_refused_before_anything_changes(case: str, code: str) -> None:
    f = flipper(Daemon(tp=2 if case == "tp" else 1))
    if case == "draining":
        f.role_state = "draining"
    if case == "one_role":
        f.connectors = {"prefill": object}
    with pytest.raises(FlipRefused) as refused:
        f.flip("decode", 3 if case == "stale" else 0)
    assert refused.value.code == code
    assert (f.role, f.epoch) == ("prefill", 0)
    assert sample(f, "role_flips_total", **{"from": "prefill", "to": "decode", "outcome": "refused"}) == 1


def test_a_failed_swap_fences_the_node_until_a_flip_succeeds() -> None:
    f = flipper(Daemon(fail_swaps=1))
    with pytest.raises(FlipFailed, match="fenced"):
        f.flip("decode", 0)
    assert (f.role_state, f.epoch) == ("fenced", 0)
    status, code, _ = f.admit(make_request_id(KV, "127.0.0.1:1"))  # serves nothing
    assert (status, code) == (503, "node_fenced")
    assert sample(f, "node_role", role="fenced") == 1 and sample(f, "node_role", role="prefill") == 0
    assert sample(f, "role_flips_total", **{"from": "prefill", "to": "decode", "outcome": "failed"}) == 1
    assert f.flip("decode", 0).epoch == 1 and f.role_state == "serving"  # tried again: unfenced
    assert f.admit(make_request_id("127.0.0.1:2", KV)) is None


def test_a_drain_that_runs_out_ends_the_rest() -> None:
    f = flipper(Daemon(role="decode", busy=3), drain_timeout_s=0.05)
    result = f.flip("prefill", 0)
    assert result.aborted == 3 and result.drain_s >= 0.05 and f.role == "prefill"


def test_the_gate_refuses_stale_legs_and_counts_the_rest() -> None:
    f = flipper(Daemon())
    assert f.admit(make_request_id(KV, "127.0.0.1:1")) is None  # a prefill leg at a prefill node
    assert f.in_flight == 1
    f.done()
    f.flip("decode", 0)
    status, code, message = f.admit(make_request_id(KV, "127.0.0.1:1"))
    assert (status, code) == (409, "stale_role") and "now a decode node (role epoch 1)" in message
    assert f.admit(make_request_id("127.0.0.1:1", KV)) is None and f.in_flight == 1


def test_a_request_admitted_before_a_flip_is_refused_before_the_engine() -> None:
    """Past the gate but not yet at the engine when the flip came (a slow body, a drain that ran out):
    its prepare hook refuses it rather than run it under the new role."""
    f = flipper(Daemon())
    f.check_admitted(0)
    f.flip("decode", 0)
    with pytest.raises(OpenAIError) as refused:
        f.check_admitted(0)
    assert (refused.value.status, refused.value.code) == (409, "node_draining")
    f.check_admitted(1)
    f.role_state = "draining"
    with pytest.raises(OpenAIError):
        f.check_admitted(1)


@pytest.mark.parametrize("client, insecure, status", [("127.0.0.1", False, 200), ("10.1.2.3", False, 403),
                                                      ("10.1.2.3", True, 200)])
def test_keyless_the_admin_call_is_taken_from_loopback_only(client: str, insecure: bool, status: int) -> None:
    f = flipper(Daemon())
    app = FastAPI()
    add_role_routes(app, f, None, insecure)
    r = TestClient(app, client=(client, 50000)).post("/admin/role", json={"role": "decode", "epoch": 0})
    assert r.status_code == status, r.text
    assert f.role == ("decode" if status == 200 else "prefill")
