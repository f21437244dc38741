"""An engine thread that dies takes the node down for a supervisor to restart (issue 22,
finding 3): /ready and /health stop answering 200 and the process exits non-zero, instead
of answering every later request with a 500 while it reports itself healthy."""

from __future__ import annotations

import subprocess
import sys

import httpx

from common.request_id import LOCAL_PREFILL, make_request_id
from helpers.cluster import ROOT, Proc
from helpers.crashing_node import CRASH_MAX_TOKENS
from helpers.ports import free_port
from helpers.waiting import wait_for

ENGINE_DEAD_EXIT_CODE = 3


def _start_crashing_decode(tmp) -> Proc:
    port, kv_port = free_port(), free_port()
    log = tmp / "decode-crashing.log"
    cmd = [sys.executable, str(ROOT / "tests/helpers/crashing_node.py"), "decode_node",
           "--port", str(port), "--kv-port", str(kv_port)]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PDSERVE_MODEL": "embedded"}
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
    proc = Proc("decode-crashing", popen, port, log, kv_port)
    proc.wait_ready()
    return proc


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None  # the server has stopped


def test_dead_engine_takes_ready_down_and_exits_non_zero(tmp_path):
    decode = _start_crashing_decode(tmp_path)
    try:
        body = {"model": "pdserve-tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        rid = make_request_id(LOCAL_PREFILL, decode.kv_addr)
        ok = httpx.post(decode.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
        assert ok.status_code == 200, ok.text
        crash = dict(body, max_tokens=CRASH_MAX_TOKENS)
        rid = make_request_id(LOCAL_PREFILL, decode.kv_addr, "crash")
        bad = httpx.post(decode.url + "/v1/completions", json=crash, headers={"X-Request-Id": rid}, timeout=60)
        assert bad.status_code >= 500 or '"error"' in bad.text, bad.text
        # the engine was marked dead before the request was failed: from now on no 200 (503, or
        # nothing once the server has stopped)
        assert _status(decode.url + "/ready") != 200
        assert _status(decode.url + "/health") != 200
        assert wait_for(lambda: decode.popen.poll() is not None, 60), "the node kept running with a dead engine"
        assert decode.popen.returncode == ENGINE_DEAD_EXIT_CODE, decode.log_tail()
        assert "engine thread stopped" in decode.log.read_text()
    finally:
        decode.kill()
