"""load_config: precedence CLI > env > TOML > default, one-line errors with exit 2, --help."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import zygote

from common.config import NodeConfig, env_name, flag_name, load_config, routable_host
from common.options import used_by

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pdserve.toml"
    path.write_text(text)
    return str(path)


def test_defaults_follow_role() -> None:
    assert load_config(NodeConfig, [], "pdserve serve", env={}).port == 8000
    prefill = load_config(NodeConfig, [], "pdserve prefill", fixed={"role": "prefill"}, env={})
    decode = load_config(NodeConfig, [], "pdserve decode", fixed={"role": "decode"}, env={})
    assert (prefill.port, prefill.kv_port, prefill.role) == (8100, 14579, "prefill")
    assert (decode.port, decode.kv_port, decode.role) == (8200, 14580, "decode")
    assert decode.kv_addr == "127.0.0.1:14580"


def test_precedence_cli_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = 9000\nblock_size = 32\nmax_num_seqs = 8\n[decode]\nport = 9100\n")
    fixed = {"role": "decode"}
    base = load_config(NodeConfig, ["--config", path], "pdserve decode", fixed=fixed, env={})
    assert (base.port, base.block_size, base.max_num_seqs, base.heartbeat_interval_s) == (9100, 32, 8, 2.0)
    env = {"PDSERVE_PORT": "9200", "PDSERVE_BLOCK_SIZE": "64"}
    from_env = load_config(NodeConfig, ["--config", path], "pdserve decode", fixed=fixed, env=env)
    assert (from_env.port, from_env.block_size, from_env.max_num_seqs) == (9200, 64, 8)
    argv = ["--config", path, "--port", "9300", "--no-enable-chunked-prefill"]
    from_cli = load_config(NodeConfig, argv, "pdserve decode", fixed=fixed, env=env)
    assert (from_cli.port, from_cli.block_size, from_cli.enable_chunked_prefill) == (9300, 64, False)


def test_other_command_tables_are_ignored(tmp_path: Path) -> None:
    path = _write(tmp_path, "[prefill]\nport = 9100\n")
    assert load_config(NodeConfig, ["--config", path], "pdserve serve", env={}).port == 8000


def test_fixed_role_cannot_be_overridden() -> None:
    env = {"PDSERVE_ROLE": "decode"}
    cfg = load_config(NodeConfig, [], "pdserve prefill", fixed={"role": "prefill"}, env=env)
    assert cfg.role == "prefill"


def _run(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = (
        "import sys; from common.config import NodeConfig, load_config; "
        "load_config(NodeConfig, sys.argv[1:], 'pdserve decode', fixed={'role': 'decode'})"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--port", "70000"], None, "--port: must be between 1 and 65535 (got 70000)"),
        (["--block-size", "abc"], None, "--block-size: should be a valid integer"),
        (["--dtype", "int8"], None, "--dtype: should be 'auto', 'float32', 'bfloat16' or 'float16'"),
        (["--proxy", "nohost"], None, "--proxy: must be HOST:PORT"),
        (["--config", "/nonexistent/pdserve.toml"], None, "--config: file not found"),
        ([], {"PDSERVE_KV_TIMEOUT_S": "0"}, "PDSERVE_KV_TIMEOUT_S: must be > 0"),
        (["--bogus"], None, "unrecognized arguments: --bogus"),
    ],
)
def test_invalid_value_exits_2_with_one_line(args: list[str], env: dict | None, expected: str) -> None:
    proc = _run(args, env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pdserve decode: error: ")
    assert expected in lines[0]


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    proc = _run(["--config", _write(tmp_path, "prot = 1\n")])
    assert proc.returncode == 2
    assert "unknown key 'prot'" in proc.stderr and proc.stderr.count("\n") == 1


DAEMON_ONLY = [n for n, info in NodeConfig.model_fields.items() if not used_by(info, "serve")]


def test_the_daemons_own_options_are_known() -> None:
    assert {"kv_host", "kv_port", "proxy", "heartbeat_interval_s", "kv_lease_s", "kv_ranks"} <= set(DAEMON_ONLY)


def _serve(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | (env or {})
    return zygote.run([sys.executable, "-m", "pdserve.cli", "serve", *argv], cwd=ROOT, timeout=60, env=full_env)


@pytest.mark.parametrize("form", ["flag", "env", "top-level key", "[serve] key"])
def test_serve_refuses_a_daemon_option_in_every_form(tmp_path: Path, form: str) -> None:
    """One rule: a value serve would silently ignore (a colocated node has no KV endpoint and
    registers nowhere) is one line naming where it came from and who uses it, exit 2."""
    path = _write(tmp_path, {"top-level key": "kv_port = 15000\n", "[serve] key": "[serve]\nkv_port = 15000\n"}
                  .get(form, ""))
    argv = {"flag": ("--kv-port", "15000"), "env": ()}.get(form, ("--config", path))
    proc = _serve(tmp_path, *argv, env={"PDSERVE_KV_PORT": "15000"} if form == "env" else None)
    where = {"flag": "--kv-port", "env": "PDSERVE_KV_PORT (in the environment)",
             "top-level key": f"--config: top-level key 'kv_port' of {path}",
             "[serve] key": f"--config: key 'kv_port' in table [serve] of {path}"}[form]
    hint = "; set it in their own tables" if form == "top-level key" else ""
    assert proc.returncode == 2
    assert proc.stderr == (f"pdserve serve: error: {where} is not used by pdserve serve (only pdserve prefill "
                           f"and pdserve decode use it{hint})\n")


@pytest.mark.parametrize("name", DAEMON_ONLY)
def test_serve_neither_lists_nor_accepts_any_daemon_option(name: str) -> None:
    flag = flag_name(name)
    with pytest.raises(SystemExit) as exited:
        load_config(NodeConfig, [flag, "1"], "pdserve serve", env={})
    assert exited.value.code == 2
    with pytest.raises(SystemExit):
        load_config(NodeConfig, [], "pdserve serve", env={env_name(name): "1"})
    assert not re.search(rf"{flag}(?![\w-])", _help("serve"))  # the flag itself, not one it begins (--kv-host-bytes)


def test_one_daemon_refuses_the_others_option_and_reads_its_own(tmp_path: Path) -> None:
    path = _write(tmp_path, "[prefill]\nkv_ranks = 2\n[decode]\nkv_peers = '10.0.0.5:14579'\n")
    prefill = load_config(NodeConfig, ["--config", path], "pdserve prefill", fixed={"role": "prefill"}, env={})
    decode = load_config(NodeConfig, ["--config", path], "pdserve decode", fixed={"role": "decode"}, env={})
    assert (prefill.kv_ranks, decode.kv_peer_list) == (2, frozenset({"10.0.0.5:14579"}))
    with pytest.raises(SystemExit):
        load_config(NodeConfig, [], "pdserve decode", fixed={"role": "decode"}, env={"PDSERVE_KV_RANKS": "2"})
    assert "--kv-ranks" not in _help("decode") and "--kv-peers" not in _help("prefill")
    shared = _write(tmp_path, "kv_port = 15000\n")  # both daemons use it: a top-level key serves both
    assert load_config(NodeConfig, ["--config", shared], "pdserve decode", fixed={"role": "decode"},
                       env={}).kv_port == 15000


@functools.cache  # the same text for every test that reads it
def _help(command: str) -> str:
    proc = zygote.run([sys.executable, "-m", "pdserve.cli", command, "--help"], cwd=ROOT, timeout=60)
    assert proc.returncode == 0
    return proc.stdout


def test_bad_value_in_file_names_the_file(tmp_path: Path) -> None:
    proc = _run(["--config", _write(tmp_path, "port = 0\n")])
    assert proc.returncode == 2
    assert "port (in " in proc.stderr and "must be between 1 and 65535 (got 0)" in proc.stderr


def test_help_documents_every_option() -> None:
    proc = _run(["--help"])
    assert proc.returncode == 0
    for name, info in NodeConfig.model_fields.items():
        if name != "role" and used_by(info, "decode"):
            assert "--" + name.replace("_", "-") in proc.stdout, name
    assert "--config" in proc.stdout and "--no-enable-chunked-prefill" in proc.stdout


def test_model_must_be_a_model_directory(tmp_path: Path) -> None:
    missing = _run(["--model", str(tmp_path / "nonexistent")])
    assert missing.returncode == 2
    expected = (f"pdserve decode: error: --model: no such model directory or .gguf file "
                f"(got {tmp_path}/nonexistent)\n")
    assert missing.stderr == expected
    not_a_model = _run(["--model", str(tmp_path)])
    assert not_a_model.returncode == 2 and "no config.json" in not_a_model.stderr
    (tmp_path / "config.json").write_text("{}")
    assert load_config(NodeConfig, ["--model", str(tmp_path)], "pdserve serve", env={}).model == str(tmp_path)


def test_a_wildcard_bind_never_registers_loopback() -> None:
    """0.0.0.0 without --kv-host: the host's routable address, or a one-line refusal where it has none."""
    routable = routable_host()
    if routable is None:
        refused = _run(["--host", "0.0.0.0"])
        assert refused.returncode == 2 and "needs --kv-host" in refused.stderr
        assert refused.stderr.count("\n") == 1
    else:
        argv = ["--host", "0.0.0.0"]
        cfg = load_config(NodeConfig, argv, "pdserve decode", fixed={"role": "decode"}, env={})
        assert cfg.kv_host == routable and not cfg.kv_host.startswith("127.") and cfg.kv_host_chosen
        assert cfg.kv_addr == f"{routable}:14580"
    given = load_config(NodeConfig, ["--host", "0.0.0.0", "--kv-host", "node7"], "pdserve decode",
                        fixed={"role": "decode"}, env={})
    assert (given.kv_host, given.kv_host_chosen) == ("node7", False)
    colocated = load_config(NodeConfig, ["--host", "0.0.0.0"], "pdserve serve", env={})
    assert colocated.host == "0.0.0.0"  # transfers nothing, registers nowhere: never refused
    loopback = load_config(NodeConfig, [], "pdserve serve", env={})
    assert (loopback.kv_host, loopback.kv_host_chosen) == ("127.0.0.1", False)


def test_proxy_help_text_has_no_undefined_default(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.config import ProxyConfig

    with pytest.raises(SystemExit) as exited:
        load_config(ProxyConfig, ["--help"], "pdserve proxy", env={})
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0
    assert "Undefined" not in out and "--static-prefill" in out and "(default: [];" in out
