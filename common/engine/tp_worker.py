"""A tensor-parallel worker: rank 1..N-1 of a node, started by rank 0 (``common.engine.parallel``).

``python -m common.engine.tp_worker HOST PORT RANK``: join rank 0's store and group, load
this rank's shard, build its KV cache when rank 0 says how many blocks (INIT), then run each
step rank 0 broadcasts until STOP. It leaves as soon as rank 0 is gone: its stdin (a pipe
from rank 0) reaches EOF, or a collective fails. Exit codes: 0 after STOP, 1 otherwise.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from common.engine.model_runner import ModelRunner
from common.engine.parallel import COPY, INIT, KV_ISSUE, KV_POLL, KV_START, STEP, STOP, receive
from common.kv_transfer.tp_endpoints import open_rank_endpoint, serve_kv_command
from common.engine.tp_group import RankLostError, TPGroup
from common.kv_layout import DTYPES
from common.model.attention import BATCH_INVARIANT, choose_kernels
from common.model.loader import load_model
from common.model.tensor_parallel import TPShard

log = logging.getLogger("pdserve.tp_worker")


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


def serve(host: str, port: int, rank: int) -> None:
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
    kernels = (BATCH_INVARIANT if setup["batch_invariant"]
               else choose_kernels(setup["attention_backend"], setup["fused_ops"], device))
    runner = ModelRunner(model, config.kv_layout(values[1], dtype), values[0], device, setup["seed"], kernels,
                         enforce_eager=True)
    log.info("rank %d ready on %s: %d KV blocks", rank, device, values[0])
    follower = None  # this rank's KV endpoint, on a prefill or decode node (KV_START)

    def open_endpoint(spec: bytes):
        return open_rank_endpoint(spec, rank, setup["size"], config.num_kv_heads, runner.kv_layout,
                                  str(device), runner.kv_caches)

    while True:
        op, values, payload = receive(group)
        if op == STEP:
            runner.follow_step(payload, values[:7], values[7], follower.step_hook() if follower else None)
        elif op == COPY:
            runner.copy_blocks([tuple(p) for p in payload.view(-1, 2).tolist()])
        elif op in (KV_START, KV_ISSUE, KV_POLL):
            follower = serve_kv_command(group, op, payload, follower, open_endpoint)
        elif op == STOP:
            if follower is not None:
                follower.close()
            group.close()
            return


def main(argv: list[str] | None = None) -> None:
    host, port, rank = (argv or sys.argv[1:])[:3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 drains, then stops us
    _exit_when_rank0_is_gone()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    try:
        serve(host, int(port), int(rank))
    except RankLostError as exc:
        log.error("stopping: %s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
