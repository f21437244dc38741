"""``pdserve up --batch-invariant`` starts both daemons with ``--batch-invariant`` (the proxy needs nothing)."""

from __future__ import annotations

import pytest

from pdserve import launcher, launcher_cli


@pytest.mark.parametrize("flag", [True, False])
def test_up_passes_batch_invariant_to_both_daemons(monkeypatch: pytest.MonkeyPatch, tmp_path, flag: bool) -> None:
    seen = []

    def fake_up(options: launcher.UpOptions) -> dict:
        seen.append(options)
        raise launcher.LaunchError("stopped by the test")

    monkeypatch.setattr(launcher, "up", fake_up)
    args = ["up", "--run-dir", str(tmp_path), "--model", "embedded", "--node-arg=--max-num-seqs=8"]
    assert launcher_cli.main(args + (["--batch-invariant"] if flag else [])) == 1
    options = seen[0]
    for daemon_args in (options.prefill_args, options.decode_args):
        assert ("--batch-invariant" in daemon_args) is flag and "--max-num-seqs=8" in daemon_args
    assert "--batch-invariant" not in options.proxy_args
    proxy, prefill, decode = launcher.process_specs(options, ("--model", "embedded"))
    assert ("--batch-invariant" in prefill.args) is flag and ("--batch-invariant" in decode.args) is flag
