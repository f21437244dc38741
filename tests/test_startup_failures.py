"""A start that cannot succeed is one line on stderr and exit 1, from a real process: a port taken
(found before the model loads), a checkpoint the loader refuses, --device cuda without CUDA."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import zygote
from helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def _pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/tmp"),
            "PDSERVE_MODEL": "embedded"}
    return zygote.run([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, timeout=180, env={**base, **(env or {})})


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line, after checking it is the only error and no traceback came with it."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and " error: " in lines[-1], proc.stderr
    assert sum(" error: " in line for line in lines) == 1, proc.stderr
    return lines[-1]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_a_taken_http_port_is_found_before_the_model_loads(command: str, taken_port: int, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc = _pdserve(command, "--port", str(taken_port), "--cache-dir", str(cache), "--device", "cpu")
    assert proc.returncode == 1
    assert _error_line(proc) == (f"pdserve {command}: error: --port: port {taken_port} on 127.0.0.1 is in use by "
                                 "another process; stop that process or choose another --port")
    assert not cache.exists()  # the embedded model was not even generated
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_taken_kv_port_is_one_line(command: str, taken_port: int, tmp_path: Path) -> None:
    proc = _pdserve(command, "--port", str(free_port()), "--kv-port", str(taken_port),
                    "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 1
    assert f"error: --kv-port: port {taken_port} on 127.0.0.1 is in use" in _error_line(proc)
    assert not (tmp_path / "cache").exists()


def test_a_taken_kv_events_port_is_one_line(taken_port: int, tmp_path: Path) -> None:
    proc = _pdserve("prefill", "--port", str(free_port()), "--kv-port", str(free_port()), "--proxy", "127.0.0.1:9",
                    "--kv-events-port", str(taken_port), "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 1
    assert f"error: --kv-events-port: port {taken_port} on 127.0.0.1 is in use" in _error_line(proc)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("flag", ["--port", "--registry-port"])
def test_a_taken_proxy_port_is_one_line(flag: str, taken_port: int) -> None:
    other = "--registry-port" if flag == "--port" else "--port"
    proc = _pdserve("proxy", flag, str(taken_port), other, str(free_port()))
    assert proc.returncode == 1
    assert proc.stderr == (f"pdserve proxy: error: {flag}: port {taken_port} on 127.0.0.1 is in use by another "
                           f"process; stop that process or choose another {flag}\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from common.model.embedded import ensure_embedded_model

    return Path(ensure_embedded_model(tmp_path_factory.mktemp("cache") / "models"))


def _broken(model_dir: Path, tmp_path: Path, how: str) -> Path:
    copy = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config = copy / "config.json"
    if how == "architecture":
        config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": ["GPT2LMHeadModel"]}))
    elif how == "no safetensors":
        for weights in copy.glob("*.safetensors"):
            weights.unlink()
    else:
        config.write_text('{"architectures": [')
    return copy


@pytest.mark.parametrize(("how", "expected"), [
    ("architecture", "unsupported architecture in "),
    ("no safetensors", "no *.safetensors files"),
    ("broken config.json", "config.json: Expecting value"),
])
def test_a_checkpoint_the_loader_refuses_is_one_line(model_dir: Path, tmp_path: Path, how: str,
                                                     expected: str) -> None:
    model = _broken(model_dir, tmp_path, how)
    proc = _pdserve("serve", "--port", str(free_port()), "--model", str(model), "--device", "cpu")
    assert proc.returncode == 1
    line = _error_line(proc)
    assert line.startswith("pdserve serve: error: ") and expected in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("command", "device"), [("serve", "cuda"), ("decode", "cuda:0")])
def test_cuda_without_a_gpu_is_one_line(command: str, device: str, tmp_path: Path) -> None:
    kv_port = ("--kv-port", str(free_port())) if command != "serve" else ()  # serve has no KV endpoint
    proc = _pdserve(command, "--port", str(free_port()), *kv_port,
                    "--cache-dir", str(tmp_path / "cache"), env={"PDSERVE_DEVICE": device})
    assert proc.returncode == 1
    assert _error_line(proc) == (f"pdserve {command}: error: --device {device}: CUDA is not available on this "
                                 "machine (use --device cpu or auto)")
    assert not (tmp_path / "cache").exists()  # refused before the embedded model was generated


def test_device_takes_a_cuda_index() -> None:
    from common.config import NodeConfig, load_config

    config = load_config(NodeConfig, [], "pdserve decode", fixed={"role": "decode"}, env={"PDSERVE_DEVICE": "cuda:1"})
    assert config.device == "cuda:1"
    proc = _pdserve("decode", "--device", "gpu0")
    assert proc.returncode == 2
    assert proc.stderr == "pdserve decode: error: --device: must be auto, cpu, cuda or cuda:N (got gpu0)\n"


def test_a_worker_rank_lost_during_start_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from common.engine.tp_group import RankLostError
    from common.node.startup import START_FAILED_EXIT_CODE, one_line_failures

    with pytest.raises(SystemExit) as exit_info, one_line_failures("pdserve serve"):
        raise RankLostError("tensor-parallel rank 1 (pid 7)\nexited with code 1")
    assert exit_info.value.code == START_FAILED_EXIT_CODE
    assert capsys.readouterr().err == "pdserve serve: error: tensor-parallel rank 1 (pid 7) exited with code 1\n"


def test_kv_ranks_that_do_not_cut_the_heads_are_one_line() -> None:
    """--kv-ranks 4 on the embedded model (2 KV heads, one rank): the slices would be half a head."""
    from helpers.ports import free_port_run

    proc = _pdserve("prefill", "--port", str(free_port()), "--kv-port", str(free_port_run(4)), "--kv-ranks", "4",
                    "--device", "cpu")
    assert proc.returncode == 1
    assert _error_line(proc).endswith("error: --kv-ranks 4: each of the 1 rank(s) holds 2 KV head(s), which do "
                                      "not cut into 4 equal slices")


def test_kv_ranks_not_a_multiple_of_the_tp_size_are_one_line() -> None:
    proc = _pdserve("prefill", "--tensor-parallel-size", "2", "--kv-ranks", "3", "--device", "cpu")
    assert proc.returncode != 0
    assert "--kv-ranks 3 must be a multiple of --tensor-parallel-size 2" in _error_line(proc)
