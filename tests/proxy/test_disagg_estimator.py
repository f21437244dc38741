"""``--disagg-policy auto``'s estimator, decided on fabricated heartbeats (proxy/disagg.py).

Each case names the figures a node would report and the path and reason label expected; the
reason is what ``pdserve:proxy_prefill_decisions_total`` counts and the debug log names.
"""

from __future__ import annotations

import pytest

from common.kv_transfer.config import TransferStats
from common.registry_client import RegistrationMessage, transfer_figures
from proxy.disagg import COST_TTL_S, Decision, DisaggPolicy

RATE = 2000.0  # prompt tokens/s
BYTES_PER_TOKEN = 4096.0  # the embedded model: 4 layers x (K, V) x 2 KV heads x 64 x fp32
FAST_LINK = 4e9  # bytes/s
SHORT = "What does the with statement do? " * 3  # ~28 tokens: 14 ms at RATE
LONG = "The for statement iterates over the items of a sequence, in order. " * 130  # ~2,500 tokens


def _node(kind: str, **figures) -> RegistrationMessage:
    port = 8100 if kind == "P" else 8200
    return RegistrationMessage(type=kind, http_address=f"127.0.0.1:{port}", zmq_address=f"127.0.0.1:{port + 6000}",
                               kv_bytes_per_token=BYTES_PER_TOKEN, **figures)


def _prefill(**figures) -> RegistrationMessage:
    return _node("P", **{"prefill_tokens_per_s": RATE, "pending_prefill_tokens": 0, **figures})


def _decode(**figures) -> RegistrationMessage:
    defaults = {"prefill_tokens_per_s": RATE, "pending_prefill_tokens": 0, "num_decoding": 0,
                "max_local_prefill_stall_ms": 50.0, "kv_transfer_bytes_per_s": FAST_LINK}
    return _node("D", **{**defaults, **figures})


CASES = {
    "short prompt, idle decode": (_prefill(), _decode(), SHORT, "local", "cheaper_local"),
    # over one bounded step (~1.25 s against 50 ms): kept off a decode node that has decodes to stall...
    "long prompt, decodes running": (_prefill(), _decode(num_decoding=2), LONG, "remote", "stall_bound"),
    "long prompt, prefill queued on the decode node": (_prefill(), _decode(pending_prefill_tokens=16), LONG,
                                                       "remote", "stall_bound"),
    # ...and off an idle one too: a request arriving (at least one per 10 s assumed) would wait
    # ~0.6 s of it, more than the 20 ms hand-off local saves
    "long prompt, idle decode node": (_prefill(), _decode(), LONG, "remote", "stall_bound"),
    # a prompt just over the bound (~110 tokens, 56 ms) on an idle one stalls no one: local saves the hand-off
    "prompt just over the bound, idle decode node": (_prefill(), _decode(), SHORT * 4, "local", "cheaper_local"),
    # 8 decodes would each wait ~14 ms: 112 ms of their time for ~20 ms of this request's
    "short prompt, busy decode batch": (_prefill(), _decode(num_decoding=8), SHORT, "remote", "busy_decode"),
    "nothing measured yet": (_prefill(prefill_tokens_per_s=None), _decode(prefill_tokens_per_s=None), SHORT,
                             "remote", "no_figures"),
    # a prefill node twice as fast is worth its 20 ms hand-off on a fast link...
    "medium prompt, faster prefill node": (_prefill(prefill_tokens_per_s=2 * RATE), _decode(), SHORT * 3,
                                           "remote", "cheaper_remote"),
    # ...not when moving its ~85 tokens of KV (340 KB) takes 340 ms
    "medium prompt, faster prefill node, slow link": (_prefill(prefill_tokens_per_s=2 * RATE),
                                                      _decode(kv_transfer_bytes_per_s=1e6), SHORT * 3,
                                                      "local", "cheaper_local"),
    # the prefill node's queue counts: 10,000 tokens ahead of this prompt there
    "medium prompt, queued prefill node": (_prefill(prefill_tokens_per_s=2 * RATE, pending_prefill_tokens=10_000),
                                           _decode(), SHORT * 3, "local", "cheaper_local"),
    "decode node measured nothing: borrows the prefill rate": (_prefill(), _decode(prefill_tokens_per_s=None),
                                                               SHORT, "local", "cheaper_local"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_decides_by_the_reported_figures(case: str) -> None:
    prefill, decode, prompt, path, reason = CASES[case]
    decision = DisaggPolicy("auto").decide(prefill, decode, prompt)
    assert (decision.path, decision.reason) == (path, reason), decision


def test_a_tie_goes_local_on_an_idle_decode_node_and_remote_on_a_busy_one() -> None:
    """Equal estimates (both hand-offs measured at 20 ms, the same rate on both nodes): local
    costs no transfer and leaves the prefill node to long prompts, unless running decodes
    would wait for it."""
    policy, p, d = DisaggPolicy("auto"), _prefill(), _decode()
    for path in ("remote", "local"):  # first tokens 20 ms after their predicted 14 ms of compute
        policy.observe_ttft(Decision(path, "cheaper_" + path, compute_s=0.014), p, d, 0.034)
    tie = policy.decide(p, d, SHORT)
    assert tie.est_local_s == pytest.approx(tie.est_remote_s)
    assert (tie.path, tie.reason) == ("local", "cheaper_local")
    busy = policy.decide(p, _decode(num_decoding=1), SHORT)
    assert (busy.path, busy.reason) == ("remote", "busy_decode")


def test_a_long_prompt_the_decode_node_has_cached_is_prefilled_there() -> None:
    policy, p, d = DisaggPolicy("auto"), _prefill(), _decode(num_decoding=1)
    first = policy.decide(p, d, LONG)
    assert (first.path, first.reason) == ("remote", "stall_bound")
    policy.sent(first, p, d, LONG)  # the decode node now holds its KV (received), and so does P
    again = policy.decide(p, d, LONG + " And then?")
    assert (again.path, again.reason) == ("local", "cheaper_local")
    assert again.est_local_s is not None and again.est_local_s < 0.05


def test_the_hand_off_cost_is_learned_from_measured_first_tokens() -> None:
    policy, p, d = DisaggPolicy("auto"), _prefill(prefill_tokens_per_s=2 * RATE), _decode()
    prompt = SHORT * 3
    decision = policy.decide(p, d, prompt)
    assert decision.reason == "cheaper_remote"
    for _ in range(20):  # each remote first token came 300 ms after the request: the hand-off is slow
        policy.observe_ttft(decision, p, d, 0.3)
    later = policy.decide(p, d, prompt)
    assert (later.path, later.reason) == ("local", "cheaper_local")
    assert later.est_remote_s == pytest.approx(0.3, rel=0.05)


def test_a_first_token_mostly_spent_computing_does_not_price_the_hand_off() -> None:
    """A long prompt came back faster than its predicted compute (the rate from short steps
    undersells long ones): the hand-off learned from short prompts stays, so a short prompt
    still sees that local saves it."""
    policy, p, d = DisaggPolicy("auto"), _prefill(), _decode()
    for _ in range(10):  # short remote prompts: 14 ms predicted, first token at 74 ms
        policy.observe_ttft(Decision("remote", "cheaper_remote", compute_s=0.014), p, d, 0.074)
    for _ in range(10):  # long remote prompts: 1.25 s predicted, first token at 1.0 s
        policy.observe_ttft(Decision("remote", "stall_bound", compute_s=1.25), p, d, 1.0)
    short = policy.decide(p, d, SHORT)
    assert short.est_remote_s == pytest.approx(short.est_local_s + 0.06, abs=0.005)
    assert (short.path, short.reason) == ("local", "cheaper_local")
    busy = policy.decide(p, _decode(num_decoding=1), SHORT)  # 14 ms of one decode's time for 60 ms saved
    assert (busy.path, busy.reason) == ("local", "cheaper_local")


@pytest.mark.parametrize(("mode", "path"), [("always", "remote"), ("never", "local")])
def test_fixed_policies_ignore_the_figures(mode: str, path: str) -> None:
    assert DisaggPolicy(mode).decide(_prefill(), _decode(), LONG) == Decision(path, "policy")


def test_heartbeats_carry_the_transfer_figures() -> None:
    from common.kv_layout import KVLayout

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    figures = transfer_figures(layout, None)
    assert figures == {"kv_bytes_per_token": BYTES_PER_TOKEN}  # no rate before a transfer landed
    wire = {"type": "D", "http_address": "h:1", "zmq_address": "h:2", "unknown_key": 1,
            **transfer_figures(layout, 3e9)}
    msg = RegistrationMessage.from_dict(wire)
    assert (msg.kv_bytes_per_token, msg.kv_transfer_bytes_per_s) == (BYTES_PER_TOKEN, 3e9)


def test_the_transfer_rate_weighs_bytes_over_first_byte_to_done() -> None:
    stats = TransferStats()
    assert stats.recv_bytes_per_s is None
    stats.transfer_rate(8_000_000, 0.004)  # 2 GB/s
    assert stats.recv_bytes_per_s == pytest.approx(2e9)
    stats.transfer_rate(0, 0.5)  # nothing moved (a fully cached prompt): not a rate
    assert stats.recv_bytes_per_s == pytest.approx(2e9)
    for _ in range(50):
        stats.transfer_rate(4_000_000, 0.004)  # 1 GB/s from now on
    assert stats.recv_bytes_per_s == pytest.approx(1e9, rel=0.01)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_slow_first_token_does_not_keep_auto_off_a_path() -> None:
    """A path is measured only when taken: the first local first token came 50 ms late (a cold
    start), which prices local above remote for a short prompt. Once that sample is older
    than COST_TTL_S the path is back at its prior, taken and measured again; among other
    samples, one slow one does not move the median."""
    clock = _Clock()
    policy, p, d = DisaggPolicy("auto", clock=clock), _prefill(), _decode()
    assert policy.decide(p, d, SHORT).path == "local"
    policy.observe_ttft(Decision("local", "cheaper_local", compute_s=0.014), p, d, 0.064)
    slow = policy.decide(p, d, SHORT)
    assert (slow.path, slow.reason) == ("remote", "cheaper_remote")
    assert slow.est_local_s == pytest.approx(slow.est_remote_s + 0.03, abs=0.002)
    clock.now += COST_TTL_S + 1
    again = policy.decide(p, d, SHORT)
    assert (again.path, again.reason) == ("local", "cheaper_local")
    for ttft in (0.030, 0.031, 0.029, 0.134, 0.030):  # ~16 ms of fixed cost, and one pause
        policy.observe_ttft(Decision("local", "cheaper_local", compute_s=0.014), p, d, ttft)
    steady = policy.decide(p, d, SHORT)
    assert steady.est_local_s == pytest.approx(steady.est_remote_s - 0.004, abs=0.001)
    assert steady.path == "local"


def test_a_burst_decided_on_one_heartbeat_counts_what_it_sent() -> None:
    """16 clients start together on an idle cluster: every decision sees the same heartbeat (D
    idle). The first prompt goes local; after it, D runs it and has its prefill queued, so the
    next ones go remote (busy_decode) instead of all queueing on D, and the prefill node's
    queue grows with each one sent there. A new heartbeat starts again from its own figures."""
    clock = _Clock()
    policy, p, d = DisaggPolicy("auto", clock=clock), _prefill(), _decode()
    decisions = []
    for i in range(16):  # distinct prompts: no prefix of one is cached for the next
        prompt = f"Question {i:02}. {SHORT}"
        decision = policy.decide(p, d, prompt)
        policy.sent(decision, p, d, prompt)
        decisions.append(decision)
    assert [(x.path, x.reason) for x in decisions[:3]] == [
        ("local", "cheaper_local"), ("remote", "busy_decode"), ("remote", "busy_decode")]
    assert sum(x.local for x in decisions) <= 2
    first, second = decisions[0], decisions[1]
    assert second.est_local_s == pytest.approx(first.est_local_s + first.prefill_s)  # queued behind the first
    assert second.stall_s == pytest.approx(first.prefill_s)  # the first one decodes there now
    remote = [x for x in decisions if not x.local]
    assert remote[-1].est_remote_s == pytest.approx(remote[0].est_remote_s + (len(remote) - 1) * remote[0].prefill_s)
    clock.now += 0.01  # P computed 10 ms of that queue meanwhile
    assert policy.decide(p, d, "Question 99. " + SHORT).est_remote_s == pytest.approx(
        remote[0].est_remote_s + len(remote) * remote[0].prefill_s - 0.01)
    fresh = policy.decide(_prefill(), _decode(), "Question 99. " + SHORT)  # the next heartbeat: both nodes idle again
    assert (fresh.path, fresh.reason) == ("local", "cheaper_local")
    assert fresh.est_local_s == pytest.approx(first.est_local_s)


def test_a_prompt_over_the_bound_goes_local_only_while_nothing_would_wait_for_it() -> None:
    """The field's case (256-token prompts, a decode node whose bound they exceed): at one client
    the heartbeat still counts the request that just ended, so the prompt went remote by
    stall_bound on an idle node and paid the hand-off every time. With this proxy's own in-flight
    count it goes local; with decodes in flight it does not, and on an idle node that requests
    keep arriving at (2/s over the last 10 s) neither: each would wait for that prefill."""
    prompt = SHORT * 4  # ~110 tokens: 56 ms at RATE, over a 50 ms bound
    p, stale = _prefill(), _decode(num_decoding=1)
    policy = DisaggPolicy("auto")
    assert (policy.decide(p, stale, prompt).path, policy.decide(p, stale, prompt).reason) == ("remote", "stall_bound")
    in_flight = {stale.http_address: 0}
    policy.in_flight = in_flight.get
    idle = policy.decide(p, stale, prompt)
    assert (idle.path, idle.reason, idle.stall_s) == ("local", "cheaper_local", 0)
    in_flight[stale.http_address] = 3
    busy = policy.decide(p, stale, prompt)
    assert (busy.path, busy.reason) == ("remote", "stall_bound")
    assert busy.stall_s == pytest.approx(3 * busy.prefill_s)

    clock = _Clock()
    policy = DisaggPolicy("auto", clock=clock)
    for i in range(20):  # short prompts, one every 0.5 s, each done before the next
        clock.now += 0.5
        d = _decode()
        short = f"Question {i:02}. {SHORT}"
        policy.sent(policy.decide(p, d, short), p, d, short)
    long_one = policy.decide(p, _decode(), LONG)  # ~1.25 s: 2.5 arrivals expected meanwhile
    assert (long_one.path, long_one.reason) == ("remote", "stall_bound")
    assert policy.decide(p, _decode(), prompt).path == "local"  # 0.11 arrivals x 28 ms < the 20 ms saved


def test_the_local_cost_learns_from_every_local_first_token() -> None:
    """Local first tokens come ~2 ms after their ~14 ms of compute; one came 200 ms late (a pause).
    Learning only first tokens not mostly spent computing kept just the slow one, and local was
    priced 200 ms dearer than it is: every one counts, so the median stays ~2 ms."""
    policy, p, d = DisaggPolicy("auto"), _prefill(), _decode()
    policy.observe_ttft(Decision("local", "cheaper_local", compute_s=0.014), p, d, 0.214)
    for _ in range(4):
        policy.observe_ttft(Decision("local", "cheaper_local", compute_s=0.014), p, d, 0.016)
    decision = policy.decide(p, d, SHORT)
    assert decision.est_local_s == pytest.approx(decision.prefill_s + 0.002)
    assert (decision.path, decision.reason) == ("local", "cheaper_local")


def test_an_arrival_is_counted_as_waiting_for_all_of_a_local_prefill() -> None:
    """Requests arrive at 2/s, the remote hand-off is measured at 120 ms and a prompt of ~0.3 s comes
    to an idle decode node: 0.6 arrivals expected meanwhile, each waiting for the whole of it (0.18 s
    in all) outweigh the 0.12 s local saves: remote. (Counted as waiting half of it, 0.09 s, it went
    local, and in the open-loop run such prompts doubled TTFT p99 at 2 requests/s.)"""
    clock = _Clock()
    policy, p = DisaggPolicy("auto", clock=clock), _prefill()
    for i in range(20):
        clock.now += 0.5
        d = _decode()
        short = f"Question {i:02}. {SHORT}"
        policy.sent(policy.decide(p, d, short), p, d, short)
        policy.observe_ttft(Decision("remote", "cheaper_remote", compute_s=0.014), p, d, 0.134)
    medium = LONG[:2160]  # 600 tokens: 0.3 s at RATE
    decision = policy.decide(p, _decode(), medium)
    assert decision.est_remote_s - decision.est_local_s == pytest.approx(0.12, abs=0.001)
    assert (decision.path, decision.reason) == ("remote", "stall_bound")
