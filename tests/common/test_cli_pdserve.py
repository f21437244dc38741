"""The ``pdserve`` command line, and a real ``pdserve serve`` driven by the openai client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import zygote
from helpers.ports import free_port
from helpers.serve_process import serving

ROOT = Path(__file__).resolve().parents[2]


def _pdserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "pdserve.cli", *args], timeout=timeout, cwd=ROOT)


def test_help_lists_subcommands() -> None:
    proc = _pdserve("--help")
    assert proc.returncode == 0
    for command in ("serve", "prefill", "decode", "proxy", "up", "down"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.M), command


def test_no_command_prints_usage_and_exits_2() -> None:
    proc = _pdserve()
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: pdserve <command>") and proc.stdout == ""


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    proc = _pdserve("--version")
    assert proc.returncode == 0 and proc.stdout == f"pdserve {version('pdserve')}\n"


def test_unknown_command_exits_2() -> None:
    proc = _pdserve("serveit")
    assert proc.returncode == 2 and "unknown command 'serveit'" in proc.stderr


@pytest.mark.parametrize(("command", "port"), [("serve", 8000), ("prefill", 8100), ("decode", 8200)])
def test_node_help_shows_role_defaults(command: str, port: int) -> None:
    proc = _pdserve(command, "--help")
    assert proc.returncode == 0
    assert f"(default: {port};" in " ".join(proc.stdout.split())
    assert "--role" not in proc.stdout and ("--kv-timeout-s" in proc.stdout) == (command != "serve")


def test_bad_flag_value_is_one_line_and_exit_2() -> None:
    proc = _pdserve("decode", "--port", "70000")
    assert proc.returncode == 2
    assert proc.stderr == "pdserve decode: error: --port: must be between 1 and 65535 (got 70000)\n"


def test_serve_with_a_missing_model_is_one_line_and_exit_2() -> None:
    proc = _pdserve("serve", "--model", "/nonexistent")
    assert proc.returncode == 2
    assert proc.stderr == "pdserve serve: error: --model: no such model directory or .gguf file (got /nonexistent)\n"


@pytest.mark.parametrize("command", ["prefill", "decode", "serve", "proxy"])
def test_help_answers_before_torch_is_imported(command: str) -> None:
    code = (
        "import sys\n"
        "from pdserve.cli import main\n"
        "try:\n"
        f"    main([{command!r}, '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "--port" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == "NO-TORCH"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``pdserve serve`` on the embedded model, as its own process."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--cache-dir", cache,
            "--device", "cpu", "--num-kv-blocks", "256", "--max-model-len", "1024"]
    with serving(argv, port, log, cwd=ROOT) as url:
        yield url


def test_openai_client_against_a_real_node(served: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "pdserve-tiny"
    first = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0)
    second = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == 8 or first.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=0)


def _metric(text: str, name: str) -> float:
    match = re.search(rf'^pdserve:{name}{{role="both"}} (\S+)$', text, re.M)
    assert match, name
    return float(match.group(1))


def test_closing_a_stream_early_frees_the_request(served: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    before = _metric(httpx.get(served + "/metrics").text, "generation_tokens_total")
    stream = client.completions.create(
        model="pdserve-tiny", prompt="Once upon a time", max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(served + "/metrics").text
        if _metric(text, "num_requests_running") == 0 and _metric(text, "kv_cache_usage_perc") == 0:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    assert 'pdserve:request_errors_total{kind="aborted",role="both"} 1.0' in text
    assert _metric(text, "generation_tokens_total") - before < 900
