"""Run a pdserve module whose engine step raises once a request asks for ``CRASH_MAX_TOKENS``
tokens: ``python tests/helpers/crashing_node.py decode_node --port ...``.

A test hook for what no honest input can do any more (a bug, a CUDA error): the engine
thread dying, seen from outside the process.
"""

from __future__ import annotations

import runpy
import sys

from common.engine.llm_engine import LLMEngine

CRASH_MAX_TOKENS = 13

_step = LLMEngine.step


def _crashing_step(self: LLMEngine):
    queued = (*self.scheduler.waiting, *self.scheduler.running)
    if any(seq.params.max_tokens == CRASH_MAX_TOKENS for seq in queued):
        raise RuntimeError("injected engine failure (tests/helpers/crashing_node.py)")
    return _step(self)


if __name__ == "__main__":
    LLMEngine.step = _crashing_step  # type: ignore[method-assign]
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
