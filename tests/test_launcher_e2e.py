"""`pdserve up` / `pdserve down` for real: processes, ports, pids.json, logs.

The full round trip (issue 6's acceptance: up, one chat completion through the proxy,
/metrics on all three, down) runs the real daemons; refusals and `down` run against
stand-in processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.defaults import DEFAULT_MODEL_NAME
from helpers.ports import free_ports
from helpers.waiting import wait_until
from pdserve import launcher, launcher_cli

REPO = Path(__file__).resolve().parents[1]

# Stands in for a daemon: sleeps, and carries `-m <module>` in its argv like the real one,
# so `down` recognises it as ours. It says "ready" once its signal disposition is set.
SLEEPER = "import signal, sys, time\n{ignore}\nprint('ready', flush=True)\ntime.sleep(120)"


def launcher_cmd(*args: str) -> list[str]:
    """`pdserve <args>` via the installed console script when there is one."""
    script = Path(sys.executable).with_name("pdserve")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "pdserve.launcher_cli", *args]


def run_launcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_cmd(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def up_args(run_dir: Path, ports: list[int]) -> list[str]:
    names = ("--proxy-port", "--prefill-port", "--decode-port", "--registry-port",
             "--prefill-kv-port", "--decode-kv-port")
    args = ["up", "--run-dir", str(run_dir)]
    for name, port in zip(names, ports):
        args += [name, str(port)]
    return args


def fake_model(tmp_path: Path, config: str = "{}") -> str:
    """A directory `up` accepts as a model (it has a config.json); no daemon can load it."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(config)
    return str(model)


def start_sleeper(module: str, ignore_sigterm: bool = False) -> subprocess.Popen:
    """A stand-in that has set its SIGTERM disposition when this returns."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_sigterm else ""
    code = SLEEPER.format(ignore=ignore)
    proc = subprocess.Popen([sys.executable, "-c", code, "-m", module], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline() == "ready\n", f"sleeper exited with {proc.wait()}"
    return proc


@pytest.fixture
def sleepers():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def write_pids(run_dir: Path, procs: list[tuple[str, str, subprocess.Popen]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    entries = [{"name": n, "module": m, "pid": p.pid, "port": 1} for n, m, p in procs]
    (run_dir / "pids.json").write_text(json.dumps(entries))


def test_down_with_nothing_running_says_so(tmp_path):
    result = run_launcher("down", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0
    assert "nothing running" in result.stdout


def test_down_stops_every_group_and_is_idempotent(tmp_path, sleepers):
    run_dir = tmp_path / "run"
    sleepers += [start_sleeper("proxy"), start_sleeper("prefill_node"),
                 start_sleeper("decode_node", ignore_sigterm=True)]
    write_pids(run_dir, list(zip(("proxy", "prefill", "decode"),
                                 ("proxy", "prefill_node", "decode_node"), sleepers)))

    stopped = launcher.down(run_dir, grace=1.0, quiet=True)

    assert {e["name"] for e in stopped} == {"proxy", "prefill", "decode"}
    assert [e["name"] for e in stopped if e.get("killed")] == ["decode"]
    assert all(proc.wait(timeout=5) is not None for proc in sleepers)
    assert not (run_dir / "pids.json").exists()
    assert launcher.down(run_dir, quiet=True) == []


def test_down_leaves_reused_pids_alone(tmp_path, sleepers):
    """A pid in a stale pids.json now running something else is not ours to kill."""
    run_dir = tmp_path / "run"
    sleepers.append(start_sleeper("something_else"))
    write_pids(run_dir, [("proxy", "proxy", sleepers[0])])

    assert launcher.down(run_dir, grace=1.0, quiet=True) == []
    assert sleepers[0].poll() is None


def test_up_refuses_a_taken_port(tmp_path):
    run_dir = tmp_path / "run"
    ports = free_ports(6)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports[2]))
        squatter.listen()
        result = run_launcher(*up_args(run_dir, ports), "--model", fake_model(tmp_path))
    assert result.returncode == 1
    assert f"port already in use: {ports[2]} (decode)" in result.stderr
    assert not (run_dir / "pids.json").exists()
    assert not list((run_dir / "logs").glob("*.log"))  # nothing was started


def test_up_refuses_while_processes_from_pids_json_live(tmp_path, sleepers):
    run_dir = tmp_path / "run"
    sleepers.append(start_sleeper("proxy"))
    write_pids(run_dir, [("proxy", "proxy", sleepers[0])])

    result = run_launcher(*up_args(run_dir, free_ports(6)), "--model", fake_model(tmp_path))

    assert result.returncode == 1
    assert f"already running from {run_dir}: proxy (pid {sleepers[0].pid})" in result.stderr
    assert sleepers[0].poll() is None


STUB_DAEMON = """
import argparse, http.server, time
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
started = time.monotonic()
READY_AFTER = {ready_after}

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = self.path == "/ready" and time.monotonic() - started > READY_AFTER
        self.send_response(200 if ready or self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
"""


def test_up_waits_for_ready_prints_how_to_use_it_and_down_stops_all(tmp_path, monkeypatch,
                                                                    capsys):
    """The launcher's happy path against stand-ins that serve /ready after 0.5 s."""
    (tmp_path / "stub_daemon.py").write_text(STUB_DAEMON.format(ready_after=0.5))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    real_specs = launcher.process_specs
    monkeypatch.setattr(launcher, "process_specs", lambda options, model_args: [
        launcher.ProcessSpec(s.name, "stub_daemon", s.port, s.ports, s.args)
        for s in real_specs(options, model_args)])
    run_dir = tmp_path / "run"
    ports = free_ports(6)
    try:
        assert launcher_cli.main([*up_args(run_dir, ports), "--model", fake_model(tmp_path)]) == 0
        out = capsys.readouterr().out
        entries = json.loads((run_dir / "pids.json").read_text())
        assert [(e["name"], e["port"]) for e in entries] == list(
            zip(("proxy", "prefill", "decode"), ports[:3]))
        assert all(launcher.is_alive(e["pid"]) for e in entries)
        assert f"curl -s http://127.0.0.1:{ports[0]}/v1/chat/completions" in out
        assert f'"model": "{DEFAULT_MODEL_NAME}"' in out  # the stand-ins list no model
        assert all((run_dir / "logs" / f"{n}.log").exists() for n in ("proxy", "prefill", "decode"))

        # The command it prints works from this shell as printed, whatever PATH holds.
        stop = re.search(r"^Stop with: (.*)$", out, re.M).group(1)
        assert stop.endswith(f"down --run-dir {run_dir}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(tmp_path)))}
        stopped = subprocess.run(stop, shell=True, cwd=Path.cwd(), env=env, capture_output=True,
                                 text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.count("pdserve: stopped ") == 3
        assert not any(launcher.is_alive(e["pid"]) for e in entries)
    finally:
        launcher.down(run_dir, grace=2.0, quiet=True)


# `pdserve up` in its own process, with stand-ins for the three processes (a signal test
# must not depend on how fast real daemons become ready).
STUBBED_LAUNCHER = """
import sys
from pdserve import launcher, launcher_cli
real = launcher.process_specs
launcher.process_specs = lambda options, model_args: [
    launcher.ProcessSpec(s.name, "stub_daemon", s.port, s.ports, s.args) for s in real(options, model_args)]
sys.exit(launcher_cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_start_up_stops_every_child(tmp_path, sig):
    (tmp_path / "stub_daemon.py").write_text(STUB_DAEMON.format(ready_after=1e9))  # never ready
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(tmp_path)))}
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBED_LAUNCHER, *up_args(run_dir, free_ports(6)), "--model",
         fake_model(tmp_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def started() -> bool:
            assert proc.poll() is None, proc.communicate()
            return len(launcher.read_pids(run_dir)) >= 3

        wait_until(started, "the three stand-ins started", 60, step=0.05)
        children = launcher.read_pids(run_dir)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig.value
        assert f"{sig.name} received; stopped what had started" in err
        assert not any(launcher.is_alive(e["pid"]) for e in children)
        assert not (run_dir / "pids.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        launcher.down(run_dir, grace=2.0, quiet=True)


@pytest.mark.parametrize("value", ["0", "65536", "http"])
def test_up_refuses_a_port_it_cannot_wait_for_in_one_line(tmp_path, value):
    result = run_launcher("up", "--run-dir", str(tmp_path / "run"), "--proxy-port", value)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--proxy-port" in result.stderr
    assert not (tmp_path / "run").exists()


def test_up_refuses_a_missing_model_in_one_line(tmp_path):
    result = run_launcher("up", "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr == (f"pdserve up: error: argument --model: no such model directory or .gguf file "
                             f"(got {tmp_path / 'nope'}) (see --help)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "error"), [
    (["--proxy-arg=--disagg-policy=sometimes"],
     "--proxy-arg: --disagg-policy: should be 'always', 'never' or 'auto' (got sometimes) (see pdserve proxy --help)"),
    (["--proxy-arg", "--migration-limit 500"],
     "--proxy-arg: --migration-limit: must be between 0 and 100 (got 500) (see pdserve proxy --help)"),
    (["--proxy-arg=--port=9999"], "--proxy-arg: --port is set by pdserve up (use --proxy-port)"),
    (["--node-arg=--kv-peers=10.0.0.5:14579"],
     "--node-arg: --kv-peers is not used by pdserve prefill (only pdserve decode uses it) "
     "(see pdserve prefill --help)"),
    (["--decode-arg=--tensor-parallel-size=2"],
     "--decode-arg: --tensor-parallel-size is set by pdserve up (use --tensor-parallel-size, --prefill-tp or "
     "--decode-tp)"),
    (["--prefill-arg=--no-such-option"],
     "--prefill-arg: unrecognized arguments: --no-such-option (see pdserve prefill --help)"),
])
def test_up_refuses_a_pass_through_option_its_process_would_refuse_in_one_line(tmp_path, args, error):
    result = run_launcher("up", "--run-dir", str(tmp_path / "run"), "--model", fake_model(tmp_path), *args)
    assert result.returncode == 2
    assert result.stderr == f"pdserve up: error: {error}\n"
    assert not (tmp_path / "run").exists()  # checked before anything started


def test_up_help_shows_the_pass_through() -> None:
    out = run_launcher("up", "--help").stdout
    assert all(f"--{name}-arg OPTION" in out for name in ("proxy", "node", "prefill", "decode"))
    assert "--proxy-arg=--disagg-policy=always --proxy-arg='--migration-limit 0'" in out


def test_pass_through_options_go_after_ups_own_flags() -> None:
    options = launcher.UpOptions(proxy_args=("--policy", "least_loaded"), prefill_args=("--kv-lease-s=60",),
                                 decode_args=("--max-num-seqs", "8"))
    proxy, prefill, decode = launcher.process_specs(options, ("--model", "m"))
    assert proxy.args[-2:] == ("--policy", "least_loaded") and "--registry-port" in proxy.args
    assert prefill.args[-1] == "--kv-lease-s=60" and decode.args[-2:] == ("--max-num-seqs", "8")


def test_up_reports_a_process_that_dies_and_stops_the_rest(tmp_path):
    """A model directory no daemon can load: some process exits; up names it, cleans up."""
    run_dir = tmp_path / "run"
    result = run_launcher(*up_args(run_dir, free_ports(6)), "--model", fake_model(tmp_path),
                          "--timeout", "60", timeout=120)
    assert result.returncode == 1
    assert "failed to start" in result.stderr
    assert "--- last lines of" in result.stderr
    assert not (run_dir / "pids.json").exists()
    assert launcher.down(run_dir, quiet=True) == []


@pytest.mark.slow
def test_up_chat_metrics_down(tmp_path):
    import httpx
    from openai import OpenAI

    run_dir = tmp_path / "run"
    ports = free_ports(6)
    try:
        # the proxy's and the daemons' own options through the pass-through: with --disagg-policy never
        # the decode node prefills every prompt itself, so the prefill node never sees one
        passed = ("--proxy-arg=--disagg-policy=never", "--proxy-arg", "--migration-limit 0",
                  "--proxy-arg=--policy=least_loaded", "--node-arg=--max-num-seqs=8", "--decode-arg=--kv-lease-s=20")
        result = run_launcher(*up_args(run_dir, ports), "--timeout", "240", *passed, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"http://127.0.0.1:{ports[0]}" in result.stdout
        assert "pdserve down" in result.stdout
        entries = json.loads((run_dir / "pids.json").read_text())
        assert [e["name"] for e in entries] == ["proxy", "prefill", "decode"]

        client = OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="pdserve-tiny", max_tokens=8,
            messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content is not None
        assert reply.usage.completion_tokens >= 1

        for port in ports[:3]:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert metrics.status_code == 200
            assert "pdserve:" in metrics.text
        prompts = {port: _prompt_tokens(port) for port in ports[1:3]}
        assert prompts == {ports[1]: 0.0, ports[2]: reply.usage.prompt_tokens}
        argv = {e["name"]: Path(f"/proc/{e['pid']}/cmdline").read_bytes().split(b"\0") for e in entries}
        assert [b"--migration-limit", b"0"] == argv["proxy"][argv["proxy"].index(b"--migration-limit"):][:2]
        assert b"--max-num-seqs=8" in argv["prefill"] and b"--kv-lease-s=20" in argv["decode"]

        stopped = run_launcher("down", "--run-dir", str(run_dir))
        assert stopped.returncode == 0
        assert stopped.stdout.count("pdserve: ") == 3
        assert not any(launcher.is_alive(e["pid"]) for e in entries)
        assert not (run_dir / "pids.json").exists()
    finally:
        launcher.down(run_dir, grace=5.0, quiet=True)


def _prompt_tokens(port: int) -> float:
    """A node's ``pdserve:prompt_tokens_total`` (0 before its first finished request)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:prompt_tokens_total{"))
