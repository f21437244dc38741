"""--attention-backend and --fused-ops: flag, env and TOML reach the engine config; bad values stop the start."""

from __future__ import annotations

import pytest

from common.config import NodeConfig, load_config
from common.engine.config import EngineConfig


def engine_config(argv: list[str], env: dict[str, str] | None = None, prog: str = "pdserve decode") -> EngineConfig:
    """What the engine is handed: the node's own config (nothing is copied)."""
    return load_config(NodeConfig, argv, prog, env=env or {})


def test_every_engine_option_is_a_node_option():
    """The node config is an engine config: each engine field is a flag, an env var and a TOML key."""
    assert issubclass(NodeConfig, EngineConfig)
    assert set(EngineConfig.model_fields) <= set(NodeConfig.model_fields)


def test_defaults_are_auto():
    cfg = engine_config([])
    assert (cfg.attention_backend, cfg.fused_ops) == ("auto", "auto")


def test_flags_reach_the_engine_config():
    cfg = engine_config(["--attention-backend", "sdpa", "--fused-ops", "off"])
    assert (cfg.attention_backend, cfg.fused_ops) == ("sdpa", "off")


def test_env_reaches_the_engine_config_and_flags_win():
    env = {"PDSERVE_ATTENTION_BACKEND": "triton", "PDSERVE_FUSED_OPS": "on"}
    assert (engine_config([], env).attention_backend, engine_config([], env).fused_ops) == ("triton", "on")
    assert engine_config(["--fused-ops", "off"], env).fused_ops == "off"


def test_toml_reaches_the_engine_config_per_command(tmp_path):
    path = tmp_path / "pdserve.toml"
    path.write_text('attention_backend = "sdpa"\n[prefill]\nfused_ops = "off"\n')
    prefill = engine_config(["--config", str(path)], prog="pdserve prefill")
    decode = engine_config(["--config", str(path)], prog="pdserve decode")
    assert (prefill.attention_backend, prefill.fused_ops) == ("sdpa", "off")
    assert (decode.attention_backend, decode.fused_ops) == ("sdpa", "auto")


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--attention-backend", "flash"], {}, "--attention-backend"),
    ([], {"PDSERVE_FUSED_OPS": "yes"}, "PDSERVE_FUSED_OPS"),
])
def test_a_bad_value_is_one_line_naming_the_option(capsys, argv, env, named):
    with pytest.raises(SystemExit) as stop:
        load_config(NodeConfig, argv, "pdserve serve", env=env)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and named in err and ("flash" in err or "yes" in err)


@pytest.mark.parametrize("field", ["attention_backend", "fused_ops"])
def test_engine_config_refuses_a_bad_value(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: "maybe"})
