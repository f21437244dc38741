"""A slow, lossy P-D link (50 ms each way, 1 % loss) changes no answer.

TCP hides the loss and the protocol waits out the latency: the transfer completes, the
tokens are the colocated node's, nothing fails and nothing is left allocated. The link is
impaired with ``tc netem`` where the kernel has sch_netem; where it has not (this CI's
kernel), P-D traffic goes through the bed's user-space relay with the same delay and loss.
"""

from __future__ import annotations

from contextlib import contextmanager

from mh_cluster import (LONG_PROMPT, PROMPTS, assert_nothing_leaked, colocated_text, complete, process_counts,
                        serve_pair, text_of, warm_pairs)

from helpers.cluster import metric, wait_idle
from helpers.netns import netem_unavailable

DELAY_MS, LOSS = 50, 0.01


@contextmanager
def impaired(bed, a, b):
    """50 ms and 1 % loss each way between hosts ``a`` and ``b`` while inside."""
    if netem_unavailable() is None:
        try:
            for src, dst in ((a, b), (b, a)):
                bed.netem(src, dst, f"delay {DELAY_MS}ms loss {LOSS:%}")
            yield
        finally:
            bed.clear_netem(a)
            bed.clear_netem(b)
    else:
        link = bed.delay_link(a, b, DELAY_MS, LOSS)
        try:
            yield
        finally:
            link.close()


def test_latency_and_loss_between_p_and_d_change_no_answer(cluster):
    bed, p1, d1 = cluster.bed, cluster.prefills[0], cluster.decodes[0]
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    bodies.append({"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    expected = [colocated_text(cluster, b) for b in bodies]
    # every pair, not only (p1, d1): the proxy's request at the end may land on any decode node,
    # and a link built then (a thread and ~5 sockets on d2, seen under xdist) is not a leak
    warm_pairs(cluster.prefills, cluster.decodes)
    counts = process_counts(cluster.members)
    transfers = metric(d1.url, "pdserve:kv_transfer_seconds_count")
    failures = metric(d1.url, "pdserve:kv_transfer_failures_total")
    with impaired(bed, p1.host, d1.host):
        for body, want in zip(bodies, expected):
            assert serve_pair(p1, d1, body) == want
    assert metric(d1.url, "pdserve:kv_transfer_seconds_count") == transfers + len(bodies)
    assert metric(d1.url, "pdserve:kv_transfer_failures_total") == failures
    for node in (p1, d1):
        wait_idle(node.url)
    assert text_of(complete(cluster.proxy.url, PROMPTS[0])) == expected[0]
    assert_nothing_leaked(cluster.members, counts)
