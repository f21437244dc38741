"""Across hosts, 2P2D answers exactly what a colocated node answers, in both dispatch orders.

Every daemon binds 0.0.0.0 and advertises its own address with --kv-host; the KV pair
between a prefill host and a decode host must be built on those addresses (loopback
on one host is the wrong one on the other). Afterwards no block, thread or socket is
left behind.
"""

from __future__ import annotations

import pytest
from mh_cluster import PROMPTS, assert_all_idle, complete, text_of


@pytest.mark.parametrize("proxy_name", ["proxy", "proxy2"], ids=["concurrent", "prefill_first"])
def test_greedy_parity_across_hosts_2p2d(cluster, proxy_name):
    proxy = getattr(cluster, proxy_name)
    expected = {p: text_of(complete(cluster.colocated.url, p)) for p in PROMPTS}
    # 4 prompts through a round-robin proxy: every (P, D) pair serves once and builds its KV pair
    for prompt in PROMPTS:
        assert text_of(complete(proxy.url, prompt)) == expected[prompt], prompt
    assert_all_idle(cluster)
    before = [node.counts() for node in cluster.daemons]
    for prompt in PROMPTS:  # the same again on the pairs now built: nothing may grow
        assert text_of(complete(proxy.url, prompt)) == expected[prompt], prompt
    assert_all_idle(cluster)
    after = [node.counts() for node in cluster.daemons]
    for node, (t0, f0), (t1, f1) in zip(cluster.daemons, before, after):
        assert t1 <= t0 and f1 <= f0 + 2, f"{node.name}: threads {t0}->{t1}, fds {f0}->{f1}"
