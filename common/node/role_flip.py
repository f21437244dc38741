"""A daemon's in-place role flip, prefill <-> decode (issue 36): the model, the KV cache, the prefix
cache and the compiled graphs stay; only the connector and the role's rules change.

A flip's life (``RoleFlipper.flip``, on a worker thread of the ``POST /admin/role`` request,
common/node/role_routes.py):

1. **draining** — state ``draining``, and an immediate heartbeat says so: the proxies stop routing
   the node (proxy/registry.py leaves it out of ``groups()``). New requests get 409 ``node_draining``
   (the proxy runs them elsewhere); those already admitted go on.
2. **drain** — wait until the node holds nothing: no HTTP request in flight, nothing queued,
   running, parked for KV or held for a pull (``LLMEngine.is_idle``), at most ``--drain-timeout-s``.
   Then the rest are ended: open streams get an error event (code ``node_draining``, a 503: the proxy
   migrates them as a dead node's), engine requests are aborted, KV held for a pull is dropped (the
   decode node's pull fails and the proxy prefills again elsewhere).
3. **swap** (``flip_s`` starts) — on the engine thread, while it holds no request: the KV endpoint
   closes its half and builds the other on the same control plane and address, and the engine gets
   a fresh connector of the new role (``Daemon.switch_role``).
4. **serving** — epoch + 1, state ``serving``, and an immediate heartbeat with the new ``type`` and
   ``role_epoch`` (the registry moves the node to its new role at once); ``flip_s`` ends when every
   proxy was sent it.

A swap that fails leaves the node **fenced**: it serves nothing (503 ``node_fenced``), /health says
503 and the heartbeats ``role_state: fenced`` (the proxies route nothing to it); never half in each
role. A later flip with the same epoch may try again. One flip at a time; the epoch a caller names
must be the node's (409 ``stale_role_epoch`` otherwise), so two planners cannot flip it twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from common.engine.outputs import NODE_DRAINING
from common.metrics import PREFIX
from common.request_id import parse_tags
from common.serving.errors import OpenAIError

if TYPE_CHECKING:
    from common.engine.kv_connector import KVConnector
    from common.node.daemon import Daemon

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
STATES = ("serving", "draining", "fenced")
POLL_S = 0.005  # how often a drain looks again
SETTLE_S = 5.0  # after the drain's timeout, how long the aborted requests may take to let go of their blocks
BEAT_WAIT_S = 1.0  # how long a flip waits for its new-role heartbeat to be handed to every proxy
_FLIP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DRAIN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


class FlipRefused(Exception):
    """The flip was not started (409): stale epoch, one already running, or not supported here."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class FlipFailed(Exception):
    """The swap failed: the node is fenced (500)."""


@dataclass(frozen=True)
class FlipResult:
    role: str
    epoch: int
    flip_s: float  # the swap and the re-registration, the drain apart
    drain_s: float
    aborted: int  # requests still held when --drain-timeout-s ran out, ended for the proxy to migrate


class FlipMetrics:
    """``pdserve:role_flips_total{from,to,outcome}``, ``pdserve:role_flip_seconds``, ``pdserve:role_drain_seconds``,
    ``pdserve:node_role_epoch`` and ``pdserve:node_role{role}`` (1 for the node's role now; ``fenced`` too)."""

    def __init__(self, registry, role: str) -> None:
        self.flips = Counter(PREFIX + "role_flips", "Role flips (POST /admin/role) by outcome: ok, failed (the "
                             "node is fenced), refused (stale epoch, one already running, unsupported)",
                             ["from", "to", "outcome"], registry=registry)
        self.flip_seconds = Histogram(PREFIX + "role_flip_seconds", "A role flip's swap and re-registration, "
                                      "the drain apart", buckets=_FLIP_BUCKETS, registry=registry)
        self.drain_seconds = Histogram(PREFIX + "role_drain_seconds", "A role flip's drain: until the node held "
                                       "nothing, or --drain-timeout-s", buckets=_DRAIN_BUCKETS, registry=registry)
        self.epoch = Gauge(PREFIX + "node_role_epoch", "The node's role epoch: +1 per flip", registry=registry)
        self.role = Gauge(PREFIX + "node_role", "1 for the node's role now (fenced: a flip failed)", ["role"],
                          registry=registry)
        for a in ROLES:  # a fresh node exports zeros, not nothing
            self.flips.labels(a, ROLES[1 - ROLES.index(a)], "ok")
        self.show(role, 0, "serving")

    def show(self, role: str, epoch: int, state: str) -> None:
        self.epoch.set(epoch)
        for name in (*ROLES, "fenced"):
            now = name == "fenced" if state == "fenced" else name == role
            self.role.labels(name).set(1 if now else 0)


class RoleFlipper:
    """The node's role, its epoch and its state; ``flip`` changes the role (module docstring).
    ``connectors`` makes a fresh engine connector for each role."""

    def __init__(self, daemon: Daemon, connectors: dict[str, Callable[[], KVConnector]],
                 drain_timeout_s: float, on_role: Callable[[], None] = lambda: None) -> None:
        self.daemon, self.connectors, self.drain_timeout_s = daemon, connectors, drain_timeout_s
        self.on_role = on_role  # the app's rules follow the role (ServingContext.set_role)
        self.epoch, self.role_state = 0, "serving"
        # what heartbeats say, set with the two above: a heartbeat read mid-flip must never pair the
        # old role with the new epoch (the registry would keep the node in its old role)
        self.beat = (daemon.config.role, 0, "serving")
        self.fence_reason: str | None = None
        self.in_flight = 0  # requests past the gate (role_routes.RoleGate), not yet answered
        self._lock = threading.Lock()  # the state and in_flight move together: no request slips past a drain
        self.metrics = FlipMetrics(daemon.metrics.registry, daemon.config.role)

    @property
    def role(self) -> str:
        return self.daemon.config.role

    # ---- the gate's side (event loop) --------------------------------------------------------
    def admit(self, request_id: str | None) -> tuple[int, str, str] | None:
        """None: the request may run (counted in ``in_flight`` until ``done``); else the refusal's
        (status, code, message)."""
        with self._lock:
            if self.role_state == "fenced":
                return 503, "node_fenced", f"this node is fenced: a role flip failed ({self.fence_reason}); it " \
                                           "serves nothing until a flip succeeds or it is restarted"
            leg = self._leg_role(request_id)
            if leg is not None and leg != self.role:
                return 409, "stale_role", f"this node is now a {self.role} node (role epoch {self.epoch}); the " \
                                          f"request was a {leg} leg: route it to a {leg} node"
            if self.role_state == "draining":
                return 409, "node_draining", f"this {self.role} node is draining for a role flip (role epoch " \
                                             f"{self.epoch}); send the request to another node"
            self.in_flight += 1
            return None

    def check_admitted(self, epoch: int | None) -> None:
        """The prepare hook's check, before a request reaches the engine: one admitted at ``epoch`` may
        run only if the node still serves that epoch's role (a flip's drain ran out while it was on its
        way, or the node flipped since): else 409, and the proxy runs it elsewhere."""
        if self.role_state != "serving" or (epoch is not None and epoch != self.epoch):
            raise OpenAIError(f"this {self.role} node is changing role (role epoch {self.epoch}); send the request "
                              "to another node", status=409, type="conflict_error", code="node_draining")

    def done(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def release_refused(self, request_id: str | None, signature: str | None) -> None:
        """A decode leg refused here (draining, or this node is now prefill): tell its prefill node to
        drop the KV it holds for it, which nobody will pull (the proxy runs the request on another pair),
        so that node's own drain or cache is not held until the lease ends. With a cluster key only for
        an id the proxy signed; keyless only to a prefill node --kv-peers or the registry vouches for."""
        tags, daemon = parse_tags(request_id), self.daemon
        if request_id is None or tags is None or tags.local_prefill or tags.decode_addr != daemon.config.kv_addr:
            return
        if daemon.key is not None and daemon.key.check_id(request_id, signature, "decode") is not None:
            return
        if daemon.transfer is not None and (daemon.key is not None or daemon.vouched_prefill(tags.prefill_addr)):
            daemon.transfer.release_remote(request_id, tags.prefill_addr, connect=True)

    def _leg_role(self, request_id: str | None) -> str | None:
        """Which role's leg a tagged id is at this node: the slot that names this node's KV address."""
        tags = parse_tags(request_id)
        own = self.daemon.config.kv_addr
        if tags is None:
            return None
        return "prefill" if tags.prefill_addr == own else "decode" if tags.decode_addr == own else None

    # ---- the flip (a worker thread) ------------------------------------------------------------
    def flip(self, role: str, epoch: int) -> FlipResult:
        """Drain, swap, re-register (module docstring); FlipRefused before anything changed,
        FlipFailed when the node is left fenced."""
        old = self.role
        try:
            noop = self._begin(role, epoch)
        except FlipRefused:
            self.metrics.flips.labels(old, role, "refused").inc()
            raise
        if noop:
            return FlipResult(role, epoch, 0.0, 0.0, 0)
        logger.info("role flip %s -> %s (epoch %d): draining (at most %g s)", old, role, epoch, self.drain_timeout_s)
        self.daemon.nudge()
        start = time.monotonic()
        drained, aborted = self._drained(start + self.drain_timeout_s), 0
        swap_start = time.monotonic()
        try:
            # after the drain ran out, a request past the gate may still be on its way to the engine (its
            # prepare hook refuses it: check_admitted): the swap is tried again until the engine is idle
            settle = time.monotonic() + SETTLE_S
            while not self.daemon.engine.call(lambda llm: self._swap(llm, role)).result(timeout=SETTLE_S + 30):
                if drained or time.monotonic() >= settle:
                    raise RuntimeError(f"the engine still held requests {SETTLE_S:g} s after the drain ended them")
                aborted += self._end_the_rest(old)
                time.sleep(4 * POLL_S)  # the ended streams leave the engine at its next step
                swap_start = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - whatever broke, the node must not serve half of each role
            logger.exception("role flip %s -> %s failed", old, role)
            self._fence(old, role, f"{type(exc).__name__}: {exc}")
        drain_s = swap_start - start
        self.metrics.drain_seconds.observe(drain_s)
        with self._lock:
            self.epoch, self.role_state, self.fence_reason = epoch + 1, "serving", None
            self.beat = (role, self.epoch, self.role_state)
        self.metrics.show(role, self.epoch, self.role_state)
        self.on_role()
        self._announce()
        flip_s = time.monotonic() - swap_start
        self.metrics.flips.labels(old, role, "ok").inc()
        self.metrics.flip_seconds.observe(flip_s)
        logger.info("role flip %s -> %s done: role epoch %d, flip %.3f s, drain %.3f s, %d request(s) ended at "
                    "the drain's timeout", old, role, self.epoch, flip_s, drain_s, aborted)
        return FlipResult(role, self.epoch, flip_s, drain_s, aborted)

    def _begin(self, role: str, epoch: int) -> bool:
        """Check the request and enter ``draining``; True: nothing to do (already that role, that epoch)."""
        cfg = self.daemon.config
        with self._lock:
            if self.role_state == "draining":
                raise FlipRefused(f"a role flip is already in progress on this node (it is a {self.role} node "
                                  f"draining at role epoch {self.epoch})", "role_flip_in_progress")
            if epoch != self.epoch:
                raise FlipRefused(f"stale role epoch {epoch}: this node is a {self.role} node at role epoch "
                                  f"{self.epoch}", "stale_role_epoch", "epoch")
            if cfg.tensor_parallel_size > 1 or cfg.kv_rank_count > 1:
                raise FlipRefused("role flips are not supported with tensor parallelism or --kv-ranks above 1 "
                                  "yet: restart the node in the other role", "role_flip_unsupported", "role")
            if role == self.role and self.role_state == "serving":
                return True
            if role not in self.connectors:
                raise FlipRefused(f"this daemon carries only the {self.role} role (started as python -m "
                                  f"{self.role}_node); start it with `pdserve {self.role}` to flip it in place",
                                  "role_flip_unsupported", "role")
            self.role_state = "draining"
            self.beat = (self.role, self.epoch, self.role_state)
        self.metrics.show(self.role, self.epoch, self.role_state)
        return False

    def _drained(self, deadline: float) -> bool:
        """Wait until the node holds nothing (no request past the gate, an idle engine); False at ``deadline``."""
        engine = self.daemon.engine
        while True:
            if self.in_flight == 0 and engine.call(lambda llm: llm.is_idle()).result(timeout=SETTLE_S + 30):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def _end_the_rest(self, role: str) -> int:
        """The drain ran out: end what is left, for the proxy to run elsewhere; how many were ended."""
        why = f"the node stopped serving this request: it is changing role from {role} (--drain-timeout-s)"
        ended = self.daemon.engine.abort_all(why, NODE_DRAINING)
        if role == "prefill":  # KV awaiting a pull: the decode node's pull fails, the proxy re-prefills
            ended += self.daemon.transfer.producer.discard_all(why)  # type: ignore[union-attr]
        logger.warning("role flip: --drain-timeout-s (%g s) ran out; %d request(s) ended for the proxy to migrate",
                       self.drain_timeout_s, ended)
        return ended

    def _swap(self, llm, role: str) -> bool:
        """On the engine thread: the connector and the rules of ``role``; False (nothing done) while
        the engine holds a request."""
        if not llm.is_idle():
            return False
        self.daemon.switch_role(role, self.connectors[role]())
        return True

    def _fence(self, old: str, role: str, reason: str) -> None:
        with self._lock:
            self.role_state, self.fence_reason = "fenced", reason
            self.beat = (self.role, self.epoch, self.role_state)
        self.metrics.show(self.role, self.epoch, self.role_state)
        self.metrics.flips.labels(old, role, "failed").inc()
        self.daemon.nudge()
        logger.error("role flip %s -> %s failed: %s; the node is fenced (serves nothing)", old, role, reason)
        raise FlipFailed(f"the role flip from {old} to {role} failed ({reason}); the node is fenced: it serves "
                         f"nothing until a flip succeeds (POST /admin/role with epoch {self.epoch}) or it is restarted")

    def _announce(self) -> None:
        """A heartbeat with the new role to every proxy, now; waits (briefly) until it went out."""
        beats = self.daemon.heartbeater
        if beats is None:
            return
        before = beats.beats_sent
        beats.nudge()
        deadline = time.monotonic() + BEAT_WAIT_S
        while beats.beats_sent < before + len(beats.addresses) and time.monotonic() < deadline:
            time.sleep(0.001)
