"""`pdserve up --planner`: more daemons per role, and the planner's flags handed to the proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from helpers.ports import free_port_run, free_ports

from common.cluster_auth import ClusterKey, admin_headers
from pdserve import launcher, launcher_cli

REPO = Path(__file__).resolve().parents[1]


def run_up(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.launcher_cli", "up", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_each_node_of_a_role_gets_the_next_ports():
    options = launcher.UpOptions(prefill_nodes=2, decode_nodes=3, prefill_port=9100, decode_port=9200,
                                 prefill_kv_port=15000, decode_kv_port=15100)
    specs = launcher.process_specs(options, ())
    assert [s.name for s in specs] == ["proxy", "prefill", "prefill-1", "decode", "decode-1", "decode-2"]
    assert [s.ports for s in specs[1:]] == [(9100, 15000), (9101, 15001), (9200, 15100), (9201, 15101),
                                           (9202, 15102)]


def test_planner_flags_go_to_the_proxy_before_its_pass_through(monkeypatch):
    seen = {}

    def fake_up(options: launcher.UpOptions) -> dict:
        seen["options"] = options
        raise launcher.LaunchError("stop here")

    monkeypatch.setattr(launcher, "up", fake_up)
    code = launcher_cli.main(["up", "--planner", "on", "--slo-ttft-ms", "500", "--slo-itl-ms", "40",
                              "--decode-nodes", "2", "--proxy-arg=--planner-interval-s=1"])
    options = seen["options"]
    assert code == 1 and options.decode_nodes == 2 and options.prefill_nodes == 1 and options.flippable
    modules = [(s.module, s.args[:1]) for s in launcher.process_specs(options, ())]
    assert modules == [("proxy", ("--host",)), ("pdserve.cli", ("prefill",)), ("pdserve.cli", ("decode",)),
                       ("pdserve.cli", ("decode",))]  # pdserve prefill|decode: the daemons that can flip
    assert options.proxy_args == ("--planner", "on", "--slo-ttft-ms", "500.0", "--slo-itl-ms", "40.0",
                                  "--planner-interval-s=1")


def test_bad_planner_options_are_one_line_before_anything_starts():
    for args, error in ((("--planner", "on", "--tensor-parallel-size", "2"), "tensor parallelism"),
                        (("--prefill-nodes", "0"), "must be between 1 and 16"),
                        (("--slo-itl-ms", "-5"), "--slo-itl-ms"),
                        (("--planner", "sometimes"), "invalid choice")):
        result = run_up(*args, timeout=60)
        assert result.returncode == 2 and error in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # usage line + the error


def test_up_with_the_planner_on_three_daemons(tmp_path):
    run_dir = tmp_path / "run"
    proxy_port, registry_port = free_ports(2)
    decode_ports, decode_kv = free_port_run(2), free_port_run(2)
    args = ["--run-dir", str(run_dir), "--proxy-port", str(proxy_port), "--registry-port", str(registry_port),
            "--prefill-port", str(free_ports(1)[0]), "--prefill-kv-port", str(free_ports(1)[0]),
            "--decode-port", str(decode_ports), "--decode-kv-port", str(decode_kv), "--decode-nodes", "2",
            "--planner", "on", "--slo-ttft-ms", "2000", "--proxy-arg=--planner-interval-s=0.2"]
    try:
        result = run_up(*args, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        entries = json.loads((run_dir / "pids.json").read_text())
        assert [e["name"] for e in entries] == ["proxy", "prefill", "decode", "decode-1"]
        url = f"http://127.0.0.1:{proxy_port}"
        assert httpx.get(f"{url}/ready", timeout=5).json()["nodes"] == {"P": 1, "D": 2}
        reply = httpx.post(f"{url}/v1/completions", json={"model": "pdserve-tiny", "prompt": "hi", "max_tokens": 4},
                           timeout=30)
        assert reply.status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert "pdserve:planner_predicted_ttft_seconds" in text
        # the daemons can flip (pdserve decode): the planner's call, signed with up's cluster key
        body = json.dumps({"role": "prefill", "epoch": 0}).encode()
        headers = {"content-type": "application/json", **admin_headers(ClusterKey.load(run_dir / "cluster.key"), body)}
        flip = httpx.post(f"http://127.0.0.1:{decode_ports + 1}/admin/role", content=body, headers=headers, timeout=60)
        assert flip.status_code == 200 and flip.json()["role"] == "prefill", flip.text
    finally:
        launcher.down(run_dir, quiet=True)
