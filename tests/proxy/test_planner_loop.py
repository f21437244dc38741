"""The planner's loop (proxy/planner_loop.py) against fake daemons on real sockets: what it reads
from /metrics, what it exports, and what it sends (a flip, a hook call) in each mode."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from proxy_fakes import ServerThread, stop_servers

from common.registry_client import RegistrationMessage
from proxy.config import ProxyConfig
from proxy.disagg import DisaggPolicy
from proxy.planner_loop import PlannerLoop, PlannerMetrics, parse_counters
from proxy.registry import ServiceRegistry


class FakeDaemon:
    """/metrics from ``counters``; POST /admin/role and POST /hook recorded and answered 200."""

    def __init__(self) -> None:
        self.counters = {"gap_sum": 0.0, "gaps": 0, "prompt_tokens": 0, "requests": 0}
        self.flips: list[tuple[dict, dict]] = []
        self.hooks: list[dict] = []
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            c = self.counters
            return PlainTextResponse(
                "# TYPE pdserve:inter_token_latency_seconds histogram\n"
                f'pdserve:inter_token_latency_seconds_count{{role="decode"}} {c["gaps"]}\n'
                f'pdserve:inter_token_latency_seconds_sum{{role="decode"}} {c["gap_sum"]}\n'
                "# TYPE pdserve:prompt_tokens counter\n"
                f'pdserve:prompt_tokens_total{{role="prefill"}} {c["prompt_tokens"]}\n'
                "# TYPE pdserve:request_success counter\n"
                f'pdserve:request_success_total{{role="prefill",finish_reason="length"}} {c["requests"]}\n')

        @app.post("/admin/role")
        async def role(request: Request) -> dict:
            body = await request.json()
            self.flips.append((body, dict(request.headers)))
            return {"role": body["role"], "epoch": body["epoch"] + 1, "flip_s": 0.01, "drain_s": 0.0}

        @app.post("/hook")
        async def hook(request: Request) -> dict:
            self.hooks.append(await request.json())
            return {}

        self.server = ServerThread(app).start()


@pytest.fixture(scope="module")
def daemons():
    nodes = [FakeDaemon() for _ in range(3)]  # one prefill, two decode
    yield nodes
    stop_servers([n.server for n in nodes])


def heartbeat(role: str, daemon: FakeDaemon, **figures) -> RegistrationMessage:
    return RegistrationMessage(type=role, http_address=daemon.server.address, zmq_address="127.0.0.1:9",
                               model="m", kv_fingerprint="fp", **figures)


def registry_with(daemons: list[FakeDaemon], pending: int = 6000, decoding: int = 0) -> ServiceRegistry:
    """Prompts queued on the one prefill node (6 s of them at 1,000 tokens/s), two idle decode nodes."""
    registry = ServiceRegistry(port=0)
    registry.register(heartbeat("P", daemons[0], prefill_tokens_per_s=1000.0, pending_prefill_tokens=pending))
    for d in daemons[1:]:
        registry.register(heartbeat("D", d, num_decoding=decoding))
    return registry


def make_loop(registry: ServiceRegistry, **flags) -> tuple[PlannerLoop, CollectorRegistry]:
    config = ProxyConfig(**{"planner": "on", "planner_interval_s": 0.1, "planner_hysteresis": 1,
                            "planner_cooldown_s": 60, "planner_warmup_s": 0, **flags})
    metrics = CollectorRegistry()
    return PlannerLoop(config, registry, PlannerMetrics(metrics), DisaggPolicy("auto"), None), metrics


def ticks(loop: PlannerLoop, n: int) -> None:
    async def run() -> None:
        async with httpx.AsyncClient() as loop.client:
            for _ in range(n):
                await loop.tick()
    asyncio.run(run())


def exported(metrics: CollectorRegistry) -> str:
    return generate_latest(metrics).decode()


def test_parse_counters_sums_every_label():
    text = ('pdserve:request_success_total{finish_reason="stop",role="prefill"} 2.0\n'
            'pdserve:request_success_total{finish_reason="length",role="prefill"} 3.0\n')
    assert parse_counters(text, 0.0, 0).requests == 5.0


def test_observe_exports_the_flip_and_sends_nothing(daemons):
    loop, metrics = make_loop(registry_with(daemons), planner="observe")
    ticks(loop, 3)
    text = exported(metrics)
    assert 'pdserve:planner_decisions_total{action="flip",from="decode",reason="over_ttft",to="prefill"} 3.0' in text
    assert 'pdserve:planner_actions_total{action="flip",outcome="observe"} 3.0' in text
    assert 'pdserve:planner_predicted_ttft_seconds{model="m"} 6.' in text  # 6 s queued + 20 ms hand-off prior
    assert not any(d.flips for d in daemons)


def test_on_flips_one_decode_node_and_waits_for_it_to_register_as_prefill(daemons):
    registry = registry_with(daemons)
    loop, metrics = make_loop(registry)
    ticks(loop, 3)
    flips = [(d, body) for d in daemons for body, _ in d.flips]
    assert len(flips) == 1, flips
    daemon, body = flips[0]
    assert daemon in daemons[1:] and body == {"role": "prefill", "epoch": 0}
    # until the node registers as prefill, nothing is decided (its decode entry is the role it left)
    assert 'reason="cooldown"' not in exported(metrics)
    registry.register(heartbeat("P", daemon, role_epoch=1, prefill_tokens_per_s=1000.0, pending_prefill_tokens=6000))
    ticks(loop, 2)  # still over, and the one decode node left is the last
    assert 'pdserve:planner_decisions_total{action="hold",from="",reason="last_node",to="prefill"} 2.0' in exported(
        metrics)
    assert len([b for d in daemons for b in d.flips]) == 1
    daemon.flips.clear()


def test_hook_command_gets_the_wanted_counts(daemons, tmp_path: Path):
    out = tmp_path / "wanted.json"
    command = shlex.join([sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())", str(out)])
    loop, metrics = make_loop(registry_with(daemons), planner_action="hook",
                              planner_hook=command)
    ticks(loop, 1)
    wanted = json.loads(out.read_text())
    assert (wanted["model"], wanted["prefill"], wanted["decode"], wanted["reason"]) == ("m", 2, 2, "over_ttft")
    assert 'pdserve:planner_actions_total{action="hook",outcome="ok"} 1.0' in exported(metrics)
    assert not any(d.flips for d in daemons)


def test_hook_url_when_no_flip_is_allowed(daemons):
    registry = ServiceRegistry(port=0)
    registry.register(heartbeat("P", daemons[0], prefill_tokens_per_s=1000.0, pending_prefill_tokens=6000))
    registry.register(heartbeat("D", daemons[1], num_decoding=1))  # the last decode node: no flip
    loop, _ = make_loop(registry, planner_hook=f"http://{daemons[2].server.address}/hook")
    ticks(loop, 1)
    assert [(h["prefill"], h["decode"], h["reason"]) for h in daemons[2].hooks] == [(2, 1, "last_node")]
    daemons[2].hooks.clear()


def test_decode_gaps_from_metrics_deltas_predict_itl(daemons):
    """Two looks: the gaps counted between them on the decode nodes are the ITL samples; 40 ms a
    gap at 30 decodes a node, over a 20 ms SLO, with a prefill node idle: flip it to decode. The
    prefill node is the last one, so it is held instead."""
    registry = registry_with(daemons, pending=0, decoding=30)
    loop, metrics = make_loop(registry, planner="observe", slo_itl_ms=20)
    ticks(loop, 1)
    for d in daemons[1:]:
        d.counters.update(gaps=d.counters["gaps"] + 100, gap_sum=d.counters["gap_sum"] + 4.0)
    ticks(loop, 1)
    text = exported(metrics)
    assert 'pdserve:planner_predicted_itl_seconds{model="m"} 0.04' in text
    assert 'pdserve:planner_decisions_total{action="hold",from="",reason="last_node",to="decode"} 1.0' in text


def test_the_proxy_runs_the_planner_and_exports_it(make_cluster):
    cluster = make_cluster(1, 2, planner="observe", planner_interval_s=0.1)
    deadline = time.monotonic() + 10
    while "pdserve:planner_predicted_ttft_seconds{" not in (text := httpx.get(f"{cluster.url}/metrics").text):
        assert time.monotonic() < deadline, "the planner exported nothing within 10 s"
        time.sleep(0.05)
    assert 'pdserve:planner_predicted_ttft_seconds{model="m"} -1.0' in text  # static fakes measure nothing
