"""Daemons that can flip role in place (``pdserve prefill|decode``, pdserve/daemon.py), and the signed
``POST /admin/role`` that flips them (common/node/role_routes.py). ``helpers.cluster.start`` runs
``python -m prefill_node``, a daemon that carries its own role only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from common.cluster_auth import ClusterKey, admin_headers
from helpers.cluster import ROOT, Proc, metric, node_env
from helpers.ports import free_port


def start_flippable(role: str, tmp: Path, *args: str, name: str) -> Proc:
    """``pdserve <role>`` on free ports with ``args``, logging to ``tmp/<name>.log``; not waited for."""
    port, kv_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", role, "--port", str(port), "--kv-port", str(kv_port), *args]
    log = tmp / f"{name}.log"
    env = node_env()
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
    return Proc(name, popen, port, log, kv_port, list(args), cmd)


def role_epoch(node: Proc) -> int:
    return int(metric(node.url, "pdserve:node_role_epoch"))


def flip(node: Proc, key: ClusterKey, role: str, epoch: int | None = None, timeout: float = 120) -> httpx.Response:
    """``POST /admin/role`` signed with the cluster key; ``epoch`` None: the node's current one."""
    body = json.dumps({"role": role, "epoch": role_epoch(node) if epoch is None else epoch}).encode()
    headers = {**admin_headers(key, body), "Content-Type": "application/json"}
    return httpx.post(node.url + "/admin/role", content=body, headers=headers, timeout=timeout)
