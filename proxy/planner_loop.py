"""The planner's loop in the proxy: look, decide (proxy/planner.py), export, act.

Every ``--planner-interval-s``, for each group of nodes that can pair (registry.groups(): serving
nodes only, a draining one is left out):
1. look: each node's last heartbeat (queue, prefill rate, decodes), and its /metrics (GETs are
   open on the daemons) read for what it did since the last look: prompt tokens and requests
   finished (the prefill role's load; prompt tokens the prefix cache had are no load), inter-token gaps (the decode role's step time at the
   decodes its heartbeats report). A node is cold for ``--planner-warmup-s`` after it first
   appears in a role (a role epoch of its own): its rate and its gaps are left out.
2. decide: :meth:`Planner.decide`; the transfer and hand-off of a mean prompt are the adaptive
   disaggregation policy's (proxy/disagg.py).
3. export: ``pdserve:planner_decisions_total{action,from,to,reason}`` (every look that is not
   within SLO), the predicted TTFT and ITL of each group, ``pdserve:planner_actions_total``.
4. act (``--planner on`` only; ``observe`` stops at 3): a flip is ``POST /admin/role`` to the chosen
   node with the role epoch its heartbeat named, signed with the cluster key when there is one
   (common.cluster_auth.admin_headers), awaited (its drain included) so flips go one at a time; a
   hook call gets the wanted counts as JSON. Either starts the cool-down, whatever its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import time
from collections import deque
from dataclasses import dataclass, replace

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from common.cluster_auth import ClusterKey, admin_headers
from proxy.config import ProxyConfig
from proxy.disagg import DisaggPolicy, transfer_s
from proxy.planner import MAX_ITL_SAMPLES, ROLE_NAMES, Decision, Load, NodeView, Planner, PlannerOptions
from proxy.registry import Group, GroupKey, Node, ServiceRegistry

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
MIN_GAPS = 4  # an interval with fewer inter-token gaps on a node says too little of its step time
ITL_SAMPLE_TTL_S = 300.0
_ITL = "pdserve:inter_token_latency_seconds"


@dataclass
class _Counters:
    """What one node's /metrics had counted at one look."""

    at: float
    gap_sum: float = 0.0
    gaps: float = 0.0
    prompt_tokens: float = 0.0  # computed ones: the prefix cache's hits taken off
    requests: float = 0.0
    decoding: int = 0


def parse_counters(text: str, at: float, decoding: int) -> _Counters:
    """The counters the planner reads from a node's Prometheus text (every label summed)."""
    counters = _Counters(at, decoding=decoding)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _ITL + "_sum":
                counters.gap_sum += sample.value
            elif sample.name == _ITL + "_count":
                counters.gaps += sample.value
            elif sample.name == "pdserve:prompt_tokens_total":
                counters.prompt_tokens += sample.value
            elif sample.name == "pdserve:prefix_cache_hits_total":
                counters.prompt_tokens -= sample.value
            elif sample.name == "pdserve:request_success_total":
                counters.requests += sample.value
    return counters


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pdserve:planner_decisions", "The planner's looks that were not within SLO, by what it decided "
            "(flip, hook, hold), the role a node would leave and join, and why.",
            ["action", "from", "to", "reason"], registry=registry)
        self.actions = Counter(
            "pdserve:planner_actions", "What the planner carried out (flip, hook), by outcome (ok, refused, "
            "failed, observe: --planner observe acts on nothing).", ["action", "outcome"], registry=registry)
        self.ttft = Gauge("pdserve:planner_predicted_ttft_seconds", "The planner's predicted time to first token "
                          "of each group's prefill role (-1: not measured yet).", ["model"], registry=registry)
        self.itl = Gauge("pdserve:planner_predicted_itl_seconds", "The planner's predicted inter-token latency of "
                         "each group's decode role (-1: not measured yet).", ["model"], registry=registry)


class PlannerLoop:
    """Runs the planner over every group; ``run()`` until cancelled."""

    def __init__(self, options: PlannerOptions, registry: ServiceRegistry, metrics: PlannerMetrics,
                 disagg: DisaggPolicy, key: ClusterKey | None, client: httpx.AsyncClient | None = None) -> None:
        self.options, self.registry, self.metrics, self.disagg, self.key = options, registry, metrics, disagg, key
        self._planners: dict[GroupKey, Planner] = {}
        self._first_seen: dict[tuple[str, str, int], float] = {}
        self._counters: dict[tuple[str, str, int], _Counters] = {}
        self._itl: dict[GroupKey, deque[tuple[float, float, float]]] = {}
        self._mean_prompt: dict[GroupKey, float] = {}
        self._last: dict[GroupKey, tuple[str, str]] = {}
        self._moved: dict[str, tuple[str, int, float]] = {}  # address -> the role and epoch a flip gave it, when
        self.client = client  # run() opens its own when None

    async def run(self) -> None:
        logger.info("planner %s: TTFT SLO %g ms, ITL SLO %g ms, every %g s, action %s%s", self.options.planner,
                    self.options.slo_ttft_ms, self.options.slo_itl_ms, self.options.planner_interval_s,
                    self.options.planner_action, f", hook {self.options.planner_hook}" if self.options.planner_hook
                    else "")
        async with contextlib.AsyncExitStack() as stack:
            if self.client is None:
                self.client = await stack.enter_async_context(httpx.AsyncClient(trust_env=False))
            while True:
                try:
                    await self.tick()
                except Exception:  # noqa: BLE001 - the planner must outlive any one bad look
                    logger.exception("planner: look failed; trying again next interval")
                await asyncio.sleep(self.options.planner_interval_s)

    async def tick(self) -> None:
        busy = {n.group for n in self.registry.nodes() if getattr(n.info, "role_state", None) not in (None, "serving")}
        for group in self.registry.groups():
            key = (group.model, group.kv_fingerprint)
            group, settling = self._current(group)
            load = await self.look(group)
            if key in busy or settling:  # a flip drains, failed, or has not re-registered yet: one at a time
                continue
            planner = self._planners.setdefault(key, Planner(self.options))
            decision = planner.decide(load, time.monotonic())
            logger.debug("planner (%s) look: %s -> %s", group.model, load, decision)
            self.export(group, decision)
            if decision.action in ("flip", "hook"):
                await self.act(planner, group, decision)

    def _current(self, group: Group) -> tuple[Group, bool]:
        """``group`` without the entries of a role a node has left (an address listed in both roles
        keeps its higher role epoch; one this planner flipped keeps only its new role), and whether a
        node this planner flipped is still to re-register in its new role."""
        epoch = {}
        for n in group.prefills + group.decodes:
            epoch[n.info.http_address] = max(epoch.get(n.info.http_address, 0), _epoch(n))
        now, settling = time.monotonic(), False
        for address, (role, moved_epoch, at) in list(self._moved.items()):
            registered = any(n.info.http_address == address and n.info.type == role and _epoch(n) >= moved_epoch
                             for n in group.prefills + group.decodes)
            if registered or now - at > self.options.planner_flip_timeout_s:
                if not registered:
                    logger.warning("planner: %s flipped to %s (epoch %d) but has not registered so within %g s",
                                   address, ROLE_NAMES[role], moved_epoch, self.options.planner_flip_timeout_s)
                del self._moved[address]
            else:
                settling = True

        def live(n: Node) -> bool:
            moved = self._moved.get(n.info.http_address)
            return _epoch(n) == epoch[n.info.http_address] and (moved is None or n.info.type == moved[0])

        return replace(group, prefills=tuple(filter(live, group.prefills)),
                       decodes=tuple(filter(live, group.decodes))), settling

    # -- look ---------------------------------------------------------------------

    async def look(self, group: Group) -> Load:
        key = (group.model, group.kv_fingerprint)
        nodes = list(group.prefills + group.decodes)
        texts = await asyncio.gather(*(self._scrape(n) for n in nodes))
        now = time.monotonic()
        views, tokens, requests, seconds = [], 0.0, 0.0, 0.0
        itl = self._itl.setdefault(key, deque(maxlen=MAX_ITL_SAMPLES))
        for node, text in zip(nodes, texts):
            epoch = _epoch(node)
            node_key = (node.info.type, node.info.http_address, epoch)
            warm = now - self._first_seen.setdefault(node_key, now) >= self.options.planner_warmup_s
            views.append(NodeView(node.info.type, node.info.http_address, warm, epoch,
                                  node.info.prefill_tokens_per_s if warm else None,
                                  node.info.pending_prefill_tokens or 0, node.info.num_decoding or 0, node.info.load))
            if text is None:
                continue
            new = parse_counters(text, now, node.info.num_decoding or 0)
            old = self._counters.get(node_key)
            self._counters[node_key] = new
            if old is None or new.gaps < old.gaps or new.requests < old.requests:
                continue  # a first look, or a restarted node: nothing to subtract from
            if node.info.type == "P":  # load counts from every node, warm or not
                tokens += max(new.prompt_tokens - old.prompt_tokens, 0.0)
                requests += new.requests - old.requests
                seconds = max(seconds, new.at - old.at)
            elif warm and new.gaps - old.gaps >= MIN_GAPS:
                decoding = max((old.decoding + new.decoding) / 2, 1.0)
                itl.append((now, decoding, (new.gap_sum - old.gap_sum) / (new.gaps - old.gaps)))
        self._forget(now, itl)
        if requests > 0:
            self._mean_prompt[key] = tokens / requests
        mean_prompt = self._mean_prompt.get(key, 0.0)
        return Load(tuple(views), tokens / seconds if seconds > 0 else 0.0, mean_prompt,
                    tuple((n, t) for _, n, t in itl), *self._handoff(group, mean_prompt), model=group.model)

    def _handoff(self, group: Group, tokens: float) -> tuple[float, float]:
        """A mean prompt's KV transfer (beyond its compute) and hand-off, as the disagg policy prices
        them, averaged over the group's pairs."""
        pairs = [(p.info, d.info) for p in group.prefills for d in group.decodes][:64]
        if not pairs:
            return 0.0, 0.0
        transfer = handoff = 0.0
        for prefill, decode in pairs:
            compute = tokens / prefill.prefill_tokens_per_s if prefill.prefill_tokens_per_s else 0.0
            transfer += transfer_s(tokens, compute, prefill, decode)
            handoff += self.disagg.handoff_s(prefill, decode)
        return transfer / len(pairs), handoff / len(pairs)

    def _forget(self, now: float, itl: deque[tuple[float, float, float]]) -> None:
        while itl and now - itl[0][0] > ITL_SAMPLE_TTL_S:
            itl.popleft()
        if len(self._first_seen) > 4 * self.registry.max_nodes:  # nodes come and go: keep the tables bounded
            live = {(n.info.type, n.info.http_address, _epoch(n)) for n in self.registry.nodes()}
            for table in (self._first_seen, self._counters):
                for stale in [k for k in table if k not in live]:
                    del table[stale]

    async def _scrape(self, node: Node) -> str | None:
        try:
            response = await self.client.get(f"http://{node.info.http_address}/metrics", timeout=SCRAPE_TIMEOUT_S)
            return response.text if response.status_code == 200 else None
        except httpx.HTTPError as exc:
            logger.debug("planner: /metrics of %s unread: %s", node.info.http_address, exc)
            return None

    # -- export and act -------------------------------------------------------------

    def export(self, group: Group, decision: Decision) -> None:
        model = group.model or ""
        self.metrics.ttft.labels(model).set(-1 if decision.predicted.ttft_s is None else decision.predicted.ttft_s)
        self.metrics.itl.labels(model).set(-1 if decision.predicted.itl_s is None else decision.predicted.itl_s)
        if decision.action == "none":
            self._last.pop((group.model, group.kv_fingerprint), None)
            return
        source, target = (ROLE_NAMES.get(r or "", "") for r in (decision.source, decision.target))
        self.metrics.decisions.labels(decision.action, source, target, decision.reason).inc()
        verdict = (decision.action, decision.reason)
        if self._last.get((group.model, group.kv_fingerprint)) != verdict:
            self._last[(group.model, group.kv_fingerprint)] = verdict
            logger.info("planner (%s) %s %s: %s -> %s%s, predicted TTFT %s, ITL %s", model or "-", decision.action,
                        decision.reason, source or "-", target or "-",
                        f" node {decision.node.address}" if decision.node else "",
                        _ms(decision.predicted.ttft_s), _ms(decision.predicted.itl_s))

    async def act(self, planner: Planner, group: Group, decision: Decision) -> None:
        if self.options.planner != "on":
            self.metrics.actions.labels(decision.action, "observe").inc()
            return
        planner.acted(time.monotonic())
        outcome = await (self._flip(decision) if decision.action == "flip" else self._hook(group, decision))
        self.metrics.actions.labels(decision.action, outcome).inc()
        planner.acted(time.monotonic())  # the cool-down runs from the action's end (a flip's drain can be long)

    async def _flip(self, decision: Decision) -> str:
        node, role = decision.node, ROLE_NAMES[decision.target or "P"]
        body = json.dumps({"role": role, "epoch": node.epoch or 0}).encode()
        headers = {"content-type": "application/json", **(admin_headers(self.key, body) if self.key else {})}
        url = f"http://{node.address}/admin/role"
        try:
            response = await self.client.post(url, content=body, headers=headers,
                                               timeout=self.options.planner_flip_timeout_s)
        except httpx.HTTPError as exc:
            logger.warning("planner: flip of %s to %s failed: %s", node.address, role, exc)
            return "failed"
        if response.status_code == 200:
            answer = response.json()
            self._moved[node.address] = (decision.target or "P", int(answer.get("epoch") or 0), time.monotonic())
            logger.info("planner: %s is now %s (epoch %s): flip %.3f s, drain %.3f s", node.address,
                        answer.get("role"), answer.get("epoch"), answer.get("flip_s", 0.0), answer.get("drain_s", 0.0))
            return "ok"
        logger.warning("planner: flip of %s to %s answered %d: %s", node.address, role, response.status_code,
                       response.text[:300])
        return "refused" if response.status_code == 409 else "failed"

    async def _hook(self, group: Group, decision: Decision) -> str:
        hook = self.options.planner_hook or ""
        payload = json.dumps({"model": group.model, **(decision.wanted or {}), "reason": decision.reason,
                              "predicted": {"ttft_s": decision.predicted.ttft_s, "itl_s": decision.predicted.itl_s}})
        timeout = self.options.planner_flip_timeout_s
        try:
            if hook.startswith(("http://", "https://")):
                response = await self.client.post(hook, content=payload,
                                                   headers={"content-type": "application/json"}, timeout=timeout)
                ok, detail = response.is_success, f"HTTP {response.status_code}"
            else:
                proc = await asyncio.create_subprocess_exec(*shlex.split(hook), stdin=asyncio.subprocess.PIPE,
                                                            stdout=asyncio.subprocess.DEVNULL,
                                                            stderr=asyncio.subprocess.PIPE)
                try:
                    _, err = await asyncio.wait_for(proc.communicate(payload.encode()), timeout)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    raise
                ok, detail = proc.returncode == 0, f"exit {proc.returncode} {err.decode(errors='replace')[-300:]}"
        except (OSError, httpx.HTTPError, TimeoutError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        logger.log(logging.INFO if ok else logging.WARNING, "planner: hook %s with %s: %s", hook, payload,
                   "ok" if ok else detail)
        return "ok" if ok else "failed"


def _epoch(node: Node) -> int:
    return getattr(node.info, "role_epoch", None) or 0


def _ms(seconds: float | None) -> str:
    return "unmeasured" if seconds is None else f"{seconds * 1000:.1f} ms"


def start_planner(config: ProxyConfig, registry: ServiceRegistry, metrics_registry: CollectorRegistry,
                  disagg: DisaggPolicy) -> asyncio.Task | None:
    """The planner's task when ``--planner`` is not off (cancel it to stop)."""
    if config.planner == "off":
        return None
    # httpx logs every request at INFO: a line per node per look would bury the proxy's own log
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    loop = PlannerLoop(config, registry, PlannerMetrics(metrics_registry), disagg,
                       ClusterKey.optional(config.cluster_key_file))
    return asyncio.ensure_future(loop.run())
