"""The planner (``--planner``): keeps prefill and decode within their SLOs by moving nodes between roles.

Every ``--planner-interval-s`` the loop (proxy/planner_loop.py) hands :meth:`Planner.decide` one
:class:`Load` per group of nodes that can pair (same model and KV layout): each node's last
heartbeat and what the nodes' /metrics counted since the last look. From it the planner predicts
each role's figure at any node count, so it can ask what a flip would do to both roles:

    TTFT(k prefill nodes) = pending / (k x rate) + compute / (1 - rho) + transfer + hand-off
        rate     = the warm prefill nodes' measured prompt tokens per second (heartbeat EWMA)
        pending  = prompt tokens queued on the prefill nodes (heartbeats), shared by the k
        compute  = a mean prompt / rate;  rho = prompt tokens arriving per second / (k x rate)
        transfer, hand-off: the adaptive disaggregation policy's figures (proxy/disagg.py)
    ITL(m decode nodes)   = step(decoding / m),  step(n) = a + b x n
        decoding = sequences decoding on the decode nodes (heartbeats), shared by the m
        a, b     = fitted to (decodes on a node, its mean inter-token gap) samples from /metrics

A role is over when its figure passes its SLO (``--slo-ttft-ms``, ``--slo-itl-ms``). When one
role is over, the other role gives it one node, only if all of this holds: the giver keeps at
least one node; the giver's figure with one node fewer (its load shared by the rest) stays under
``1 - --planner-margin`` of its SLO, so the flip cannot make the giver over and start the flip
back (no 2 <-> 1 oscillation under a load neither count carries); the taker's figure gets
better; the same verdict held ``--planner-hysteresis`` looks in a row; and no action was taken
within ``--planner-cooldown-s``. The node given is the giver's least loaded warm node.

A node is cold for ``--planner-warmup-s`` after it appears in a role (a start or a flip): its
first steps (compilation, empty caches) measure nothing lasting, so its rate and inter-token
gaps are left out (its queue, which is real load, counts); the loop drops its /metrics deltas.

With ``--planner-action hook`` the planner never flips: it calls ``--planner-hook`` with the
node counts it wants (one more of the role over its SLO; one fewer of a role that keeps its SLO
with margin without it) and an orchestrator adds or removes nodes. With ``flip`` (the default)
it flips when a flip is allowed and calls the hook (if set) only when no flip is: the taker is
over but the giver cannot spare a node. This module decides only; it does no I/O.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

Role = Literal["P", "D"]
ROLE_NAMES = {"P": "prefill", "D": "decode"}
RHO_CAP = 0.95  # a role at or past its capacity is predicted as at 95 %: its queue term then dominates
MIN_FIT_SAMPLES = 3
FIXED_SHARE_PRIOR = 0.5  # with samples at one decode count only, half the step is taken as fixed cost
MAX_ITL_SAMPLES = 64


class PlannerOptions(BaseModel):
    """The planner's flags (part of ProxyConfig)."""

    planner: Literal["off", "observe", "on"] = Field(
        "off", description="Move nodes between prefill and decode to keep --slo-ttft-ms and --slo-itl-ms: off; "
        "observe (predict, log and export pdserve:planner_* metrics, act on nothing); on (flip a node's role "
        "through its POST /admin/role, or call --planner-hook; see --planner-action)."
    )
    slo_ttft_ms: float = Field(
        1000.0, gt=0, le=3_600_000, description="The planner's time-to-first-token target (predicted for the "
        "prefill role: queue, prompt compute, KV transfer, hand-off)."
    )
    slo_itl_ms: float = Field(
        100.0, gt=0, le=3_600_000, description="The planner's inter-token latency target (predicted for the "
        "decode role: its step time at the decodes each node would run)."
    )
    planner_interval_s: float = Field(5.0, ge=0.1, le=3600, description="How often the planner looks.")
    planner_margin: float = Field(
        0.2, ge=0, le=0.9, description="A role gives a node only if, without it, its predicted figure stays "
        "under (1 - margin) x its SLO."
    )
    planner_hysteresis: int = Field(
        2, ge=1, le=100, description="Consecutive looks that must reach the same verdict before it is acted on."
    )
    planner_cooldown_s: float = Field(
        30.0, ge=0, le=86_400, description="After an action (flip or hook call), the planner waits this long "
        "before the next."
    )
    planner_warmup_s: float = Field(
        10.0, ge=0, le=3600, description="A node's first seconds in a role (after it starts or flips) are cold: "
        "its measured rate and inter-token gaps are left out of the predictions."
    )
    planner_action: Literal["flip", "hook"] = Field(
        "flip", description="flip: move a node between roles in place, and call --planner-hook (if set) only when "
        "a role is over its SLO and no flip is allowed; hook: never flip, ask --planner-hook for the counts."
    )
    planner_hook: str | None = Field(
        None, max_length=4096, description="Called with the wanted node counts as JSON ({\"model\", \"prefill\", "
        "\"decode\", \"reason\", \"predicted\"}): an http(s):// URL gets it as a POST body, anything else is run as "
        "a command (split like a shell would, not through one) with it on stdin."
    )
    planner_flip_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Longest the planner waits for a node's POST /admin/role (its drain "
        "included) or for the hook."
    )

    @field_validator("planner_hook")
    @classmethod
    def _hook(cls, value: str | None) -> str | None:
        if value and not value.startswith(("http://", "https://")):
            try:
                if not shlex.split(value):
                    raise ValueError("--planner-hook names no command")
            except ValueError as exc:
                raise ValueError(f"--planner-hook is neither an http(s):// URL nor a command line: {exc}") from None
        return value

    @model_validator(mode="after")
    def _hook_for_hook_action(self) -> PlannerOptions:
        if self.planner_action == "hook" and not self.planner_hook:
            raise ValueError("--planner-action hook needs --planner-hook (a URL or a command)")
        return self


@dataclass(frozen=True)
class NodeView:
    """One node as the planner sees it: its heartbeat's figures and whether it is past its cold start."""

    role: Role
    address: str
    warm: bool
    epoch: int | None = None
    prefill_tokens_per_s: float | None = None
    pending_prefill_tokens: int = 0
    num_decoding: int = 0
    load: int = 0  # requests held (running + waiting)


@dataclass(frozen=True)
class Load:
    """A group's load at one look. ``prompt_tokens_per_s`` and ``mean_prompt_tokens`` come from the
    prefill nodes' /metrics deltas; ``itl_samples`` are (decodes on a node, its mean inter-token gap)
    from warm decode nodes; ``transfer_s`` and ``handoff_s`` are the disagg policy's figures for a
    mean prompt."""

    nodes: tuple[NodeView, ...]
    prompt_tokens_per_s: float = 0.0
    mean_prompt_tokens: float = 0.0
    itl_samples: tuple[tuple[float, float], ...] = ()
    transfer_s: float = 0.0
    handoff_s: float = 0.0
    model: str | None = None

    def of(self, role: Role) -> list[NodeView]:
        return [n for n in self.nodes if n.role == role]


@dataclass(frozen=True)
class Prediction:
    ttft_s: float | None  # None: no prefill rate measured on a warm node
    itl_s: float | None  # None: decodes run but no gaps measured yet


def predict_ttft(load: Load, k: int) -> float | None:
    """The prefill role's predicted time to first token with ``k`` nodes sharing its load."""
    prefills = load.of("P")
    rates = [n.prefill_tokens_per_s for n in prefills if n.warm and n.prefill_tokens_per_s]
    if not rates or k < 1:
        return None
    rate = sum(rates) / len(rates)
    capacity = k * rate
    rho = min(load.prompt_tokens_per_s / capacity, RHO_CAP)
    pending = sum(n.pending_prefill_tokens for n in prefills)
    compute = max(load.mean_prompt_tokens, 1.0) / rate
    return pending / capacity + compute / (1.0 - rho) + load.transfer_s + load.handoff_s


def step_fit(samples: tuple[tuple[float, float], ...]) -> tuple[float, float] | None:
    """(a, b) of step(n) = a + b x n, least squares over the samples (both kept >= 0). With every
    sample at one decode count the split is not measurable: ``FIXED_SHARE_PRIOR`` of it is fixed."""
    if not samples:
        return None
    ns = [n for n, _ in samples]
    ts = [t for _, t in samples]
    mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
    spread = sum((n - mean_n) ** 2 for n in ns)
    if len(samples) >= MIN_FIT_SAMPLES and spread > 1e-9:
        b = max(sum((n - mean_n) * (t - mean_t) for n, t in samples) / spread, 0.0)
        a = mean_t - b * mean_n
        if a >= 0:
            return a, b
        return 0.0, mean_t / max(mean_n, 1e-9)  # no fixed part measured: all of it per sequence
    a = FIXED_SHARE_PRIOR * mean_t
    return a, (mean_t - a) / max(mean_n, 1.0)


def predict_itl(load: Load, m: int) -> float | None:
    """The decode role's predicted inter-token latency with ``m`` nodes sharing its decodes."""
    decoding = sum(n.num_decoding for n in load.of("D"))
    if decoding == 0 or m < 1:
        return 0.0 if m >= 1 else None
    fit = step_fit(load.itl_samples)
    if fit is None:
        return None
    a, b = fit
    return a + b * decoding / m


@dataclass(frozen=True)
class Decision:
    """What one look decided. ``action``: flip (``node`` leaves ``source`` for ``target``), hook (call
    it with ``wanted``), hold (a role is over but nothing may be done: ``reason`` says why) or none."""

    action: Literal["flip", "hook", "hold", "none"]
    reason: str
    predicted: Prediction
    source: Role | None = None
    target: Role | None = None
    node: NodeView | None = None
    wanted: dict[str, int] | None = None


@dataclass
class _Streak:
    verdict: tuple | None = None
    looks: int = 0


@dataclass
class Planner:
    """One group's planner: its state is the verdict streak and when it last acted."""

    options: PlannerOptions
    last_action_at: float = float("-inf")
    _streak: _Streak = field(default_factory=_Streak)

    def slo_s(self, role: Role) -> float:
        return (self.options.slo_ttft_ms if role == "P" else self.options.slo_itl_ms) / 1000

    def pressure(self, load: Load, role: Role, count: int) -> float | None:
        """The role's predicted figure with ``count`` nodes, as a share of its SLO."""
        figure = predict_ttft(load, count) if role == "P" else predict_itl(load, count)
        return None if figure is None else figure / self.slo_s(role)

    def decide(self, load: Load, now: float) -> Decision:
        counts = {"P": len(load.of("P")), "D": len(load.of("D"))}
        predicted = Prediction(predict_ttft(load, counts["P"]), predict_itl(load, counts["D"]))
        pressure = {r: self.pressure(load, r, counts[r]) for r in ("P", "D")}
        over = [r for r in ("P", "D") if (pressure[r] or 0.0) > 1.0]
        if len(over) == 2:
            taker: Role = max(over, key=lambda r: pressure[r] or 0.0)
            return self._refused("both_over", counts, taker, now, predicted)
        if not over:
            return self._gate_idle(load, counts, pressure, now, predicted)
        taker = over[0]
        giver: Role = "D" if taker == "P" else "P"
        reason = "over_ttft" if taker == "P" else "over_itl"
        if self.options.planner_action == "hook":
            return self._gate((reason, taker), now, predicted, self._ask(counts, taker, +1, reason))
        if counts[giver] <= 1:
            return self._refused("last_node", counts, taker, now, predicted)
        giver_after = self.pressure(load, giver, counts[giver] - 1)
        if giver_after is None or giver_after > 1.0 - self.options.planner_margin:
            return self._refused("giver_would_break", counts, taker, now, predicted)
        taker_after = self.pressure(load, taker, counts[taker] + 1)
        if taker_after is None or taker_after >= (pressure[taker] or 0.0):
            return self._refused("no_gain", counts, taker, now, predicted)
        warm = [n for n in load.of(giver) if n.warm]
        if not warm:
            return self._refused("cold", counts, taker, now, predicted)
        node = min(warm, key=lambda n: (n.pending_prefill_tokens if giver == "P" else n.num_decoding, n.load,
                                        n.address))
        flip = Decision("flip", reason, predicted, giver, taker, node,
                        {"prefill": counts["P"] + (1 if taker == "P" else -1),
                         "decode": counts["D"] + (1 if taker == "D" else -1)})
        return self._gate((reason, taker), now, predicted, flip)

    def acted(self, now: float) -> None:
        """The loop carried out (or tried) an action: the cool-down starts, the streak too."""
        self.last_action_at = now
        self._streak = _Streak()

    def _ask(self, counts: dict[str, int], role: Role, delta: int, reason: str) -> Decision:
        wanted = {"prefill": counts["P"] + (delta if role == "P" else 0),
                  "decode": counts["D"] + (delta if role == "D" else 0)}
        return Decision("hook", reason, Prediction(None, None), target=role if delta > 0 else None,
                        source=role if delta < 0 else None, wanted=wanted)

    def _refused(self, why: str, counts: dict[str, int], taker: Role, now: float,
                 predicted: Prediction) -> Decision:
        """No flip is allowed: with a hook, ask for one more node of the taker's role instead."""
        if self.options.planner_hook:
            return self._gate((why, taker), now, predicted, self._ask(counts, taker, +1, why))
        self._streak = _Streak()
        return Decision("hold", why, predicted, target=taker)

    def _gate_idle(self, load: Load, counts: dict[str, int], pressure: dict[Role, float | None], now: float,
                   predicted: Prediction) -> Decision:
        """Nothing is over. An orchestrator (hook action) may take back a node a role can spare."""
        if self.options.planner_action != "hook" or not self.options.planner_hook:
            self._streak = _Streak()
            return Decision("none", "within_slo", predicted)
        spare = [(after, r) for r in ("P", "D") if counts[r] > 1
                 and (after := self.pressure(load, r, counts[r] - 1)) is not None
                 and after <= 1.0 - self.options.planner_margin]
        if not spare:
            self._streak = _Streak()
            return Decision("none", "within_slo", predicted)
        _, role = min(spare)
        return self._gate(("spare", role), now, predicted, self._ask(counts, role, -1, "spare"))

    def _gate(self, verdict: tuple, now: float, predicted: Prediction, decision: Decision) -> Decision:
        """``decision`` once its verdict held ``--planner-hysteresis`` looks and the cool-down is over;
        else a hold saying which of the two it waits for."""
        if verdict != self._streak.verdict:
            self._streak = _Streak(verdict, 0)
        self._streak.looks += 1
        target = decision.target or decision.source
        if now - self.last_action_at < self.options.planner_cooldown_s:
            return Decision("hold", "cooldown", predicted, target=target)
        if self._streak.looks < self.options.planner_hysteresis:
            return Decision("hold", "hysteresis", predicted, target=target)
        return Decision(decision.action, decision.reason, predicted, decision.source, decision.target,
                        decision.node, decision.wanted)
