"""`pdserve up --tensor-parallel-size 2` for real, and its flags' refusals.

The round trip: the launcher starts proxy + prefill + decode with two ranks each (every daemon
spawns one ``common.kv_transfer.tp_rank_main``), a greedy completion through the proxy gives the text a
colocated single-rank ``pdserve serve`` gives, and ``pdserve down`` leaves none of the five
processes (nor the workers) behind.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from helpers import cluster
from helpers.ports import free_port_run, free_ports
from helpers.procs import children, gone
from helpers.waiting import wait_until
from pdserve import launcher
from pdserve.launcher_cli import main as launcher_main

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def run_launcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # five processes share the machine's cores
    return subprocess.run([sys.executable, "-m", "pdserve.launcher_cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def complete(base_url: str) -> str:
    reply = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------- flags, no process

@pytest.mark.parametrize("args, says", [
    (("--prefill-tp", "2", "--decode-tp", "3"), "must divide one another (got 2 and 3)"),
    (("--prefill-tp", "4", "--decode-tp", "6"), "must divide one another (got 4 and 6)"),
    (("--tensor-parallel-size", "0"), "argument --tensor-parallel-size: must be between 1 and 64"),
    (("--decode-tp", "65"), "argument --decode-tp: must be between 1 and 64"),
    (("--prefill-tp", "two"), "argument --prefill-tp: not a number"),
])
def test_up_refuses_bad_tp_sizes_in_one_line(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        launcher_main(["up", "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and says in err
    if "divide" in says:
        assert "each decode rank reads whole KV ranks of the prefill node" in err
    assert not (tmp_path / "run").exists()


def test_tp_sizes_reach_the_daemons_with_a_kv_port_per_rank():
    options = launcher.UpOptions(prefill_tp=2, decode_tp=2, prefill_kv_port=20000, decode_kv_port=20002)
    specs = {s.name: s for s in launcher.process_specs(options, ())}
    for name, first in (("prefill", 20000), ("decode", 20002)):
        args = specs[name].args
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--kv-port") + 1] == str(first)
        assert specs[name].ports[1:] == (first, first + 1)


@pytest.mark.parametrize("prefill_tp, decode_tp, kv_ranks", [(2, 1, 2), (1, 2, 2), (1, 4, 4), (4, 2, 4)])
def test_unequal_tp_sizes_start_with_as_many_prefill_kv_ranks_as_the_larger(prefill_tp, decode_tp, kv_ranks):
    """A smaller prefill TP presents the decode TP's count of KV ranks (--kv-ranks), each on its own port."""
    assert launcher.tp_mismatch(prefill_tp, decode_tp) is None
    options = launcher.UpOptions(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_kv_port=20000,
                                 decode_kv_port=20000 + kv_ranks)
    prefill = {s.name: s for s in launcher.process_specs(options, ())}["prefill"]
    assert prefill.args[prefill.args.index("--kv-ranks") + 1] == str(kv_ranks)
    assert prefill.args[prefill.args.index("--tensor-parallel-size") + 1] == str(prefill_tp)
    assert prefill.ports[1:] == tuple(range(20000, 20000 + kv_ranks))


def test_decode_kv_port_moves_past_prefill_ranks_only_when_they_reach_it():
    default_prefill, default_decode = launcher.ROLE_KV_PORTS["prefill"], launcher.ROLE_KV_PORTS["decode"]
    assert launcher.auto_decode_kv_port(default_prefill, 1, 1) == default_decode  # TP 1: as before
    assert launcher.auto_decode_kv_port(default_prefill, 2, 2) == default_prefill + 2
    assert launcher.auto_decode_kv_port(20000, 4, 4) == default_decode  # far away: untouched


def test_up_refuses_overlapping_kv_ranks_and_a_taken_rank_port(tmp_path):
    options = launcher.UpOptions(run_dir=tmp_path / "a", prefill_tp=2, decode_tp=2,
                                 **dict(zip(launcher.PORT_FLAGS, free_ports(6))))
    overlap = replace(options, decode_kv_port=options.prefill_kv_port + 1)
    with pytest.raises(launcher.LaunchError, match="same port"):
        launcher.up(overlap)

    kv = free_port_run(4)
    options = replace(options, run_dir=tmp_path / "b", prefill_kv_port=kv, decode_kv_port=kv + 2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", kv + 3))  # decode's rank 1
        squatter.listen()
        with pytest.raises(launcher.LaunchError, match=f"port already in use: {kv + 3} \\(decode\\)"):
            launcher.up(options)
    assert not (tmp_path / "b" / "pids.json").exists()


# ---------------------------------------------------------------------------- real processes

@pytest.mark.slow
def test_up_with_two_ranks_answers_as_one_rank_and_down_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    kv = free_port_run(4)  # prefill's two ranks, then decode's two
    proxy, prefill, decode, registry = free_ports(4)
    up = ["up", "--run-dir", str(run_dir), "--tensor-parallel-size", "2", "--timeout", "120",
          "--proxy-port", str(proxy), "--prefill-port", str(prefill), "--decode-port", str(decode),
          "--registry-port", str(registry), "--prefill-kv-port", str(kv), "--decode-kv-port", str(kv + 2)]
    colocated = cluster.start("both", tmp_path, wait=False)  # the reference, loading meanwhile
    try:
        started = run_launcher(*up, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        entries = json.loads((run_dir / "pids.json").read_text())
        assert [e["name"] for e in entries] == ["proxy", "prefill", "decode"]
        by_name = {e["name"]: e for e in entries}
        assert by_name["prefill"]["ports"] == [prefill, kv, kv + 1]
        assert by_name["decode"]["ports"] == [decode, kv + 2, kv + 3]

        pids = [e["pid"] for e in entries]
        for name in ("prefill", "decode"):
            workers = [c for c in children(by_name[name]["pid"]) if "common.kv_transfer.tp_rank_main" in cmdline(c)]
            assert len(workers) == 1, f"{name}: {workers}"
            pids += workers

        colocated.wait_ready()
        assert complete(f"http://127.0.0.1:{proxy}") == complete(colocated.url)
        # rank 1 of decode pulled from rank 1 of prefill: its own endpoint, at kv-port + 1
        decode_log = Path(by_name["decode"]["log"]).read_text()
        assert f"ranks 1..1 at 127.0.0.1:{kv + 3}" in decode_log
        assert re.search(rf"tp-rank-1 INFO consumer: pair \S+ to 127.0.0.1:{kv + 1} ", decode_log), decode_log

        stopped = run_launcher("down", "--run-dir", str(run_dir))
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.count("pdserve: stopped ") == 3, stopped.stdout  # none needed a SIGKILL
        # `down` waits for every group; this is a safety margin
        wait_until(lambda: all(gone(pid) for pid in pids), f"every one of {pids} gone", 10, step=0.05)
        assert not (run_dir / "pids.json").exists()
    finally:
        launcher.down(run_dir, grace=5.0, quiet=True)
        colocated.stop()
