"""`pdserve up`'s pass-through: any option of the proxy or the daemons, checked before anything starts.

``up`` sets a few options itself (ports, the registry address, tensor-parallel sizes, the model,
a fresh cluster key); ``--proxy-arg``, ``--node-arg`` (both daemons), ``--prefill-arg`` and
``--decode-arg`` append anything else to that process's command line, after ``up``'s own flags.
Each list is parsed here by the command's own loader (the same flags, bounds and "not used by"
rule as ``pdserve proxy|prefill|decode``), so a typo, a bad value, another command's option or
an option ``up`` sets is one line before anything starts instead of a process failing in its log.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Iterable

from common.config import NodeConfig, load_config
from common.options import fields_given

# field -> how to set it with `pdserve up` instead
SET_BY_UP = {
    "proxy": {"host": "up binds everything to 127.0.0.1", "port": "use --proxy-port",
              "registry_port": "use --registry-port", "cluster_key_file": "up makes a fresh key per run"},
    "node": {"port": "use --prefill-port / --decode-port", "kv_port": "use --prefill-kv-port / --decode-kv-port",
             "proxy": "up registers the daemons with the proxy it starts",
             "tensor_parallel_size": "use --tensor-parallel-size, --prefill-tp or --decode-tp",
             "kv_ranks": "up sets it from --prefill-tp and --decode-tp", "model": "use --model",
             "cluster_key_file": "up makes a fresh key per run"},
}


class PassThroughError(ValueError):
    """A pass-through option the command would refuse, or one ``up`` sets itself."""


def split_args(values: Iterable[str]) -> tuple[str, ...]:
    """``--proxy-arg=--policy=least_loaded`` and ``--proxy-arg='--policy least_loaded'`` alike."""
    tokens: list[str] = []
    for value in values:
        try:
            tokens += shlex.split(value)
        except ValueError as exc:  # an unclosed quote
            raise PassThroughError(f"cannot split {value!r} into options: {exc}") from None
    return tuple(tokens)


def check(flag: str, command: str, args: tuple[str, ...]) -> None:
    """Parse ``args`` as ``pdserve <command>`` would; PassThroughError naming ``flag`` if it refuses."""
    if not args:
        return
    cls, fixed, set_by_up = _target(command)
    prog = f"pdserve {command}"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            load_config(cls, list(args), prog, fixed=fixed, env={})  # up's environment is checked by each process
    except SystemExit as exc:
        if exc.code == 0:  # --help: the command's options were printed
            raise
        reason = errors.getvalue().strip().removeprefix(f"{prog}: error: ").removesuffix(" (see --help)")
        raise PassThroughError(f"{flag}: {reason} (see {prog} --help)") from None
    for name in sorted(fields_given(cls, list(args), prog, fixed) & set(set_by_up)):
        raise PassThroughError(f"{flag}: --{name.replace('_', '-')} is set by pdserve up ({set_by_up[name]})")


def _target(command: str) -> tuple[type, dict, dict[str, str]]:
    if command == "proxy":
        from proxy.config import ProxyConfig  # only when the proxy is given options

        return ProxyConfig, {}, SET_BY_UP["proxy"]
    return NodeConfig, {"role": command}, SET_BY_UP["node"]
