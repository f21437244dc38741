"""A node and the proxy take their start-up heap out of the cyclic GC before serving: in a fresh
process, what was built before ``freeze_startup_heap`` is never scanned again (a full collection
of it held the GIL for 137-174 ms in a serving node), and what is made afterwards is collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers.cluster import ROOT


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected() -> None:
    code = textwrap.dedent("""
        import gc, weakref
        from common.serving.http_server import freeze_startup_heap
        built = [[i] for i in range(100_000)]  # start-up tables
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        class Cycle: pass
        c = Cycle(); c.me = c; alive = weakref.ref(c); del c  # garbage made while serving
        gc.collect()
        print(frozen, alive() is None, len(built))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    frozen, collected, n = out.stdout.split()
    assert int(frozen) >= 100_000 and collected == "True" and n == "100000", out.stderr
