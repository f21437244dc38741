"""The planner's decisions (proxy/planner.py): fake node figures in, decisions out; no processes."""

from __future__ import annotations

from proxy.planner import Load, NodeView, Planner, PlannerOptions, predict_itl, predict_ttft, step_fit

RATE = 1000.0  # prompt tokens/s of every prefill node


def options(**overrides) -> PlannerOptions:
    values = dict(planner="on", slo_ttft_ms=1000, slo_itl_ms=50, planner_margin=0.2, planner_hysteresis=2,
                  planner_cooldown_s=30, planner_warmup_s=5)
    return PlannerOptions(**{**values, **overrides})


def prefill(i: int, pending: int = 0, warm: bool = True, rate: float | None = RATE) -> NodeView:
    return NodeView("P", f"p{i}:1", warm, 0, rate, pending, 0, 0)


def decode(i: int, decoding: int = 0, warm: bool = True) -> NodeView:
    return NodeView("D", f"d{i}:1", warm, 0, None, 0, decoding, decoding)


# 10 ms a step plus 1 ms per sequence: 20 decodes on one node -> 30 ms, 40 -> 50 ms
ITL_SAMPLES = ((4.0, 0.014), (8.0, 0.018), (16.0, 0.026))


def long_prompts(n_prefill: int, n_decode: int, pending: int = 3000) -> Load:
    """Prompts queue on the prefill nodes; the decode nodes have little to do."""
    return Load(tuple(prefill(i, pending // n_prefill) for i in range(n_prefill))
                + tuple(decode(i, 1) for i in range(n_decode)),
                prompt_tokens_per_s=800.0, mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)


def long_answers(n_prefill: int, n_decode: int, decoding: int = 120) -> Load:
    """Many decodes, a trickle of short prompts."""
    return Load(tuple(prefill(i) for i in range(n_prefill))
                + tuple(decode(i, decoding // n_decode) for i in range(n_decode)),
                prompt_tokens_per_s=50.0, mean_prompt_tokens=20, itl_samples=ITL_SAMPLES)


def looks(planner: Planner, load: Load, start: float, n: int, step: float = 1.0) -> list:
    return [planner.decide(load, start + i * step) for i in range(n)]


def test_predictions_share_the_load_over_the_nodes():
    load = long_prompts(1, 3)
    # pending 3000 / 1000 + (0.5 s compute) / (1 - 0.8)
    assert abs(predict_ttft(load, 1) - (3.0 + 0.5 / 0.2)) < 1e-9
    assert abs(predict_ttft(load, 2) - (1.5 + 0.5 / 0.6)) < 1e-9
    assert all(abs(x - y) < 1e-9 for x, y in zip(step_fit(ITL_SAMPLES), (0.01, 0.001)))
    answers = long_answers(1, 2, decoding=40)
    assert abs(predict_itl(answers, 2) - 0.030) < 1e-9
    assert abs(predict_itl(answers, 1) - 0.050) < 1e-9
    assert predict_itl(long_answers(1, 2, decoding=0), 2) == 0.0


def test_flips_a_decode_node_to_prefill_when_prompts_queue():
    planner = Planner(options())
    first, second = looks(planner, long_prompts(1, 3), 100.0, 2)
    assert (first.action, first.reason) == ("hold", "hysteresis")
    assert (second.action, second.reason, second.source, second.target) == ("flip", "over_ttft", "D", "P")
    assert second.node.role == "D" and second.wanted == {"prefill": 2, "decode": 2}
    assert second.predicted.ttft_s > 1.0


def test_flips_a_prefill_node_to_decode_when_decodes_pile_up():
    planner = Planner(options())
    decisions = looks(planner, long_answers(3, 1), 100.0, 2)
    assert (decisions[-1].action, decisions[-1].source, decisions[-1].target) == ("flip", "P", "D")
    assert decisions[-1].reason == "over_itl"


def test_gives_the_least_loaded_warm_node():
    load = Load((prefill(0, 3000),) + (decode(0, 5), decode(1, 1, warm=False), decode(2, 2)),
                prompt_tokens_per_s=800.0, mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)
    planner = Planner(options(planner_hysteresis=1))
    assert planner.decide(load, 100.0).node.address == "d2:1"


def test_never_the_last_node_of_a_role():
    planner = Planner(options(planner_hysteresis=1))
    decision = planner.decide(long_prompts(1, 1), 100.0)
    assert (decision.action, decision.reason) == ("hold", "last_node")


def test_cooldown_after_an_action_and_hysteresis_reset_by_a_calm_look():
    planner = Planner(options())
    assert planner.decide(long_prompts(1, 3), 100.0).reason == "hysteresis"
    calm = Load((prefill(0),) + tuple(decode(i) for i in range(3)), itl_samples=ITL_SAMPLES)
    assert planner.decide(calm, 101.0).action == "none"  # a calm look between: the streak restarts
    assert planner.decide(long_prompts(1, 3), 102.0).reason == "hysteresis"
    assert planner.decide(long_prompts(1, 3), 103.0).action == "flip"
    planner.acted(103.0)
    # still over right after (the flipped node is cold, say): the cool-down holds it
    later = looks(planner, long_prompts(2, 2, pending=6000), 104.0, 5)
    assert {(d.action, d.reason) for d in later} == {("hold", "cooldown")}
    assert planner.decide(long_prompts(2, 2, pending=6000), 134.0).action == "flip"


def test_no_two_one_oscillation_when_neither_count_carries_the_load():
    """Three nodes; prefill needs two and decode needs two: whichever role has one node is over,
    and taking a node from the other would put that one over. The planner holds instead of
    flipping back and forth."""
    heavy = Load((prefill(0, 3000),) + (decode(0, 40), decode(1, 40)), prompt_tokens_per_s=800.0,
                 mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)
    # prefill over (ttft 5.5 s); decode at 30 ms with two nodes, 90 ms with one (slo 50 ms)
    planner = Planner(options(planner_hysteresis=1, planner_cooldown_s=0))
    decisions = looks(planner, heavy, 100.0, 10)
    assert {(d.action, d.reason) for d in decisions} == {("hold", "giver_would_break")}
    other_way = Load((prefill(0), prefill(1)) + (decode(0, 80),), prompt_tokens_per_s=800.0,
                     mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)
    decisions = looks(planner, other_way, 200.0, 10)
    assert {(d.action, d.reason) for d in decisions} == {("hold", "giver_would_break")}


def test_margin_keeps_a_giver_that_would_end_near_its_slo():
    # decode with one node fewer: 72 decodes on two, 10 ms + 1 ms x 36 = 46 ms: under the 50 ms SLO,
    # past 80 % of it
    load = Load((prefill(0, 3000),) + (decode(0, 24), decode(1, 24), decode(2, 24)), prompt_tokens_per_s=800.0,
                mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)
    assert Planner(options(planner_hysteresis=1)).decide(load, 0.0).reason == "giver_would_break"
    assert Planner(options(planner_hysteresis=1, planner_margin=0.0)).decide(load, 0.0).action == "flip"


def test_cold_nodes_figures_do_not_count():
    """A node just flipped to prefill measured a slow rate in its first steps: left out, the role's
    rate is its warm peers'. With every giver cold, nothing is flipped."""
    cold_slow = Load((prefill(0, 0), prefill(1, 0, warm=False, rate=10.0)) + (decode(0, 1), decode(1, 1)),
                     prompt_tokens_per_s=100.0, mean_prompt_tokens=100, itl_samples=ITL_SAMPLES)
    assert abs(predict_ttft(cold_slow, 2) - (0.1 / (1 - 0.05))) < 1e-9
    assert Planner(options(planner_hysteresis=1)).decide(cold_slow, 0.0).action == "none"
    only_cold = Load((prefill(0, 3000),) + (decode(0, 1, warm=False), decode(1, 1, warm=False)),
                     prompt_tokens_per_s=800.0, mean_prompt_tokens=500, itl_samples=ITL_SAMPLES)
    assert Planner(options(planner_hysteresis=1)).decide(only_cold, 0.0).reason == "cold"
    # a role whose only rates are cold ones has no prediction: no flip toward or away from it
    unmeasured = Load((prefill(0, 3000, warm=False, rate=10.0),) + (decode(0), decode(1)),
                      prompt_tokens_per_s=800.0, mean_prompt_tokens=500)
    decision = Planner(options(planner_hysteresis=1)).decide(unmeasured, 0.0)
    assert decision.action == "none" and decision.predicted.ttft_s is None


def test_hook_action_asks_for_counts_instead_of_flipping():
    planner = Planner(options(planner_action="hook", planner_hook="true", planner_hysteresis=1))
    decision = planner.decide(long_prompts(1, 3), 0.0)
    assert (decision.action, decision.wanted, decision.reason) == ("hook", {"prefill": 2, "decode": 3}, "over_ttft")
    planner.acted(0.0)
    idle = Load((prefill(0), prefill(1)) + (decode(0), decode(1), decode(2)), itl_samples=ITL_SAMPLES)
    spare = planner.decide(idle, 100.0)
    assert spare.action == "hook" and spare.reason == "spare" and sum(spare.wanted.values()) == 4


def test_flip_action_calls_the_hook_only_when_no_flip_is_allowed():
    planner = Planner(options(planner_hook="https://orchestrator.example/scale", planner_hysteresis=1))
    assert planner.decide(long_prompts(1, 3), 0.0).action == "flip"
    decision = Planner(planner.options).decide(long_prompts(1, 1), 0.0)
    assert (decision.action, decision.reason, decision.wanted) == ("hook", "last_node", {"prefill": 2, "decode": 1})
    idle = Load((prefill(0), prefill(1)) + (decode(0), decode(1)), itl_samples=ITL_SAMPLES)
    assert Planner(planner.options).decide(idle, 0.0).action == "none"  # flip mode never scales down


def test_both_over_asks_the_hook_for_the_worse_role():
    both = Load((prefill(0, 3000),) + (decode(0, 100),), prompt_tokens_per_s=800.0, mean_prompt_tokens=500,
                itl_samples=ITL_SAMPLES)
    decision = Planner(options(planner_hook="true", planner_hysteresis=1)).decide(both, 0.0)
    assert decision.action == "hook" and decision.reason == "both_over"
    assert Planner(options(planner_hysteresis=1)).decide(both, 0.0).action == "hold"
