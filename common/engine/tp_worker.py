"""A tensor-parallel worker: rank 1..N-1 of a node, started by rank 0 (``common.engine.parallel``).

``python -m common.engine.tp_worker HOST PORT RANK``: join rank 0's store and group, load
this rank's shard, build its KV cache when rank 0 says how many blocks (INIT), then run each
step rank 0 broadcasts until STOP. It leaves as soon as rank 0 is gone: its stdin (a pipe
from rank 0) reaches EOF, or a collective fails. Exit codes: 0 after STOP, 1 otherwise.

An upper layer adds to a rank without the engine knowing it: its own entry module calls
``main(argv, extension)`` with a :class:`RankExtension` that serves the commands from
``parallel.FIRST_EXTENSION_OP`` on and hooks each step's forward (the KV transfer's is
``common.kv_transfer.tp_rank_main``); rank 0 is told to start that module (``rank_main``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.engine.model_runner import LayerHook, ModelRunner
from common.engine.parallel import COPY, FIRST_EXTENSION_OP, INIT, STEP, STOP, receive
from common.engine.tp_group import RankLostError, TPGroup
from common.kv_layout import DTYPES
from common.model.attention import choose_kernels
from common.model.config import ModelConfig
from common.model.loader import load_model
from common.model.tensor_parallel import TPShard

log = logging.getLogger("pdserve.tp_worker")


@dataclass(frozen=True)
class WorkerRank:
    """What an extension may use of its rank: its place in the group, its device, its model's
    config and its runner (KV cache and layout)."""

    rank: int
    size: int
    group: TPGroup
    device: torch.device
    model_config: ModelConfig
    runner: ModelRunner


class RankExtension:
    """What an upper layer adds to a worker rank: the commands rank 0 sends beyond the engine's own
    (op >= ``FIRST_EXTENSION_OP``, ``Leader.send_bytes``) and a hook into each step's forward. This
    one adds nothing (a node that moves no KV)."""

    def __init__(self, worker: WorkerRank) -> None:
        self.worker = worker

    def command(self, op: int, payload: bytes) -> None:
        """One extension command and its payload (empty if it carried none)."""
        raise RuntimeError(f"command {op} from rank 0: nothing on this rank serves it")

    def step_hook(self) -> LayerHook | None:
        """The per-layer hook of the step about to run (None: none)."""
        return None

    def close(self) -> None:
        """At STOP, before the group closes."""


def _exit_when_rank0_is_gone() -> None:
    """Rank 0 holds our stdin's write end; EOF means its process ended, however it ended. On
    Linux the kernel also kills us when rank 0 dies (``PR_SET_PDEATHSIG``): a worker that was
    stopped (SIGSTOP) or hung could not read the EOF."""
    if sys.platform.startswith("linux"):
        import ctypes

        parent = os.getppid()  # (in a container rank 0 may well be pid 1)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # rank 0 died before the line above took effect
            os._exit(1)

    def watch() -> None:
        while os.read(0, 1):  # the raw fd: a buffered reader's lock would hold up interpreter exit
            pass
        os._exit(1)

    threading.Thread(target=watch, name="rank0-watch", daemon=True).start()


def serve(host: str, port: int, rank: int, extension: Callable[[WorkerRank], RankExtension] = RankExtension) -> None:
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=60))
    setup = json.loads(store.get("setup"))
    device = torch.device(setup["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(setup["cpu_threads"])
    group = TPGroup(store, rank, setup["size"], device, setup["timeout_s"])
    dtype = setup["dtype"]
    model, config = load_model(setup["model"], device, DTYPES[dtype], TPShard(rank, setup["size"], group))
    op, values, _ = receive(group)
    if op != INIT:
        raise RuntimeError(f"expected INIT from rank 0, got command {op}")
    kernels = choose_kernels(setup["attention_backend"], setup["fused_ops"], device, setup["batch_invariant"])
    runner = ModelRunner(model, config.kv_layout(values[1], dtype), values[0], device, setup["seed"], kernels,
                         enforce_eager=True)
    log.info("rank %d ready on %s: %d KV blocks", rank, device, values[0])
    added = extension(WorkerRank(rank, setup["size"], group, device, config, runner))
    while True:
        op, values, payload = receive(group)
        if op == STEP:
            runner.follow_step(payload, values[:7], values[7], added.step_hook())
        elif op == COPY:
            runner.copy_blocks([tuple(p) for p in payload.view(-1, 2).tolist()])
        elif op >= FIRST_EXTENSION_OP:
            added.command(op, bytes(payload.numpy()) if payload is not None else b"")
        elif op == STOP:
            added.close()
            group.close()
            return


def main(argv: list[str] | None = None, extension: Callable[[WorkerRank], RankExtension] = RankExtension) -> None:
    """``HOST PORT RANK`` (``argv``, else the command line's); ``extension``: what the caller's entry
    module adds to this rank."""
    host, port, rank = (argv or sys.argv[1:])[:3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 drains, then stops us
    _exit_when_rank0_is_gone()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    try:
        serve(host, int(port), int(rank), extension)
    except RankLostError as exc:
        log.error("stopping: %s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
