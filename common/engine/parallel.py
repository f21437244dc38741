"""Tensor parallelism across processes: the engine's process is rank 0, ``N - 1`` workers
(``python -m common.engine.tp_worker``, or the module the caller names) are the other ranks.

Start (``load_model_on_ranks``, called by the engine in place of ``load_model``):
1. the split is checked against the model's config before anything starts (one line when
   the heads do not divide);
2. rank 0 hosts a ``TCPStore`` on a free loopback port and puts the workers' setup in it (model
   directory, dtype, each rank's device, kernels, seed);
3. it spawns the workers, each with a pipe on its stdin: a worker exits when the pipe reaches
   EOF, which happens when rank 0's process ends however it ends, so no worker outlives it;
4. every rank joins the group (``tp_group.TPGroup``) and loads only its shard.

Each step (``Leader.send``): rank 0 broadcasts a fixed-size header (what to do, the sizes of
the step's packed inputs) and then the packed int64 inputs the runner already builds (token
ids, positions, slot mapping, sample rows, query starts, sequence lengths, block tables). The
workers run the same forward on their shard; rank 0 samples from the all-gathered logits.
Other commands: INIT (the cache's block count, once), COPY (block copies of a forked
choice), STOP, and an extension's: an op from ``FIRST_EXTENSION_OP`` on carries ``values[0]``
bytes (``Leader.send_bytes``), and the workers hand it to the extension their entry module
installed (``tp_worker.RankExtension``). The engine knows no extension: the caller names the
module the workers run (``rank_main``: ``common.engine.tp_worker``, or the KV transfer's
``common.kv_transfer.tp_rank_main``, which serves its KV commands on every rank).

A worker that dies is noticed at once by a thread waiting on its process: the other workers
are stopped and the group is marked lost, so the next step raises :class:`RankLostError`
(the engine thread then dies and the node exits 3); a node calls :func:`exit_on_rank_loss`
so that an idle node exits at once too. A worker that hangs fails rank 0's next collective
after ``TP_TIMEOUT_S``.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from common.engine.config import EngineConfig, EngineConfigError
from common.engine.tp_group import RankLostError, TPGroup
from common.model.config import ModelConfig
from common.model.llama import CausalLM
from common.model.loader import load_model
from common.model.tensor_parallel import TPShard, check_split

log = logging.getLogger(__name__)

TP_TIMEOUT_S = 60.0  # a collective (or the group's start) that takes longer means a rank hung
STOP_WAIT_S = 10.0  # how long close() waits for a worker to exit before it kills it
HEADER = 10  # int64s: [op, 7 packed sizes, block-table width, 0]
INIT, STEP, COPY, STOP = 1, 2, 3, 4
FIRST_EXTENSION_OP = 16  # this op and those above are an extension's; their payload: ``values[0]`` bytes
RANK_MAIN = "common.engine.tp_worker"  # what the workers run (``python -m``) unless the caller names another


def rank_devices(device: torch.device, size: int) -> list[str]:
    """Each rank's device: ``cuda:(index + rank)`` from the engine's ``cuda:index``, or the CPU."""
    if device.type != "cuda":
        return ["cpu"] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise EngineConfigError(f"--tensor-parallel-size {size} from --device cuda:{first} needs CUDA devices "
                                f"{first}..{first + size - 1}; this machine has {count}")
    return [f"cuda:{first + r}" for r in range(size)]


def load_model_on_ranks(
    config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype, rank_main: str = RANK_MAIN,
) -> tuple[CausalLM, ModelConfig]:
    """``load_model`` at ``--tensor-parallel-size 1``; otherwise start the workers (``python -m
    rank_main``) and load rank 0's shard, whose collectives (``model.tp.comm``) are a :class:`Leader`."""
    size = config.tensor_parallel_size
    if size == 1:
        return load_model(model_dir, device, dtype)
    check_split(ModelConfig.from_dir(model_dir), size)
    devices = rank_devices(device, size)
    threads = max(1, torch.get_num_threads() // size)  # on a CPU the ranks share its cores
    if device.type == "cpu":
        torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=TP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
    store.set("setup", json.dumps({
        "model": str(model_dir), "dtype": str(dtype).removeprefix("torch."), "devices": devices,
        "size": size, "seed": config.seed, "attention_backend": config.attention_backend,
        "fused_ops": config.fused_ops, "batch_invariant": config.batch_invariant, "timeout_s": TP_TIMEOUT_S, "cpu_threads": threads,
    }))
    procs = [_spawn(rank_main, rank, store.port) for rank in range(1, size)]
    try:
        leader = Leader(store, size, torch.device(devices[0]), procs)
    except Exception:
        _kill(procs)
        raise
    atexit.register(leader.close)
    try:
        return load_model(model_dir, devices[0], dtype, TPShard(0, size, leader))
    except Exception:
        leader.close()
        raise


def _spawn(rank_main: str, rank: int, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", rank_main, "127.0.0.1", str(port), str(rank)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE)  # its stdin's EOF = rank 0 is gone


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


class Leader(TPGroup):
    """Rank 0 of the group: the model's collectives, plus the commands it sends the workers and
    the workers' processes (watched, and stopped by :meth:`close`)."""

    def __init__(self, store: dist.Store, size: int, device: torch.device, procs: list[subprocess.Popen]):
        self.procs = procs
        self.lost: str | None = None  # why the group cannot run any more
        self.on_lost: Callable[[str], None] = lambda reason: None  # after the other workers are stopped
        self._closing = False
        self._lock = threading.Lock()
        super().__init__(store, 0, size, device, TP_TIMEOUT_S)
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            if self._closing or self.lost is not None:
                return
            self.lost = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        log.critical("%s; this node cannot run its model any more", self.lost)
        _kill(self.procs)
        self.on_lost(self.lost)

    def send(self, op: int, values: Sequence[int] = (), payload: torch.Tensor | None = None) -> None:
        """Broadcast one command (``values`` in its header, then ``payload``, an int64 CPU tensor)."""
        if self.lost is not None:
            raise RankLostError(self.lost)
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = op
        header[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        self.broadcast(header)
        if payload is not None:
            self.broadcast(payload)

    def send_bytes(self, op: int, data: bytes) -> None:
        """Broadcast one command whose payload is ``data`` (an extension's)."""
        self.send(op, [len(data)], torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None)

    def close(self) -> None:
        """Stop the workers (STOP, then a kill after ``STOP_WAIT_S``) and drop the group; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.lost is None and any(p.poll() is None for p in self.procs):
            try:
                self.send(STOP)
            except RankLostError:
                pass  # they are stopped below either way
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
        _kill(self.procs)
        super().close()


def receive(group: TPGroup) -> tuple[int, list[int], torch.Tensor | None]:
    """A worker's next command from rank 0: ``(op, header values, payload)``; waits as long as the
    node idles, and raises RankLostError at once when rank 0 is gone."""
    header = group.broadcast(torch.zeros(HEADER, dtype=torch.int64), idle=True).tolist()
    op, values = header[0], header[1:]
    payload = None
    if op == STEP:
        payload = group.broadcast(torch.empty(sum(values[:7]), dtype=torch.int64))
    elif op == COPY:
        payload = group.broadcast(torch.empty(2 * values[0], dtype=torch.int64))
    elif op >= FIRST_EXTENSION_OP and values[0]:
        payload = group.broadcast(torch.empty(values[0], dtype=torch.uint8))
    return op, values, payload


def exit_on_rank_loss(leader: Leader | None, exit_code: int) -> None:
    """Make a node's process exit with ``exit_code`` as soon as one of its workers dies, even
    while it idles (no step would notice); its other workers are stopped first."""
    if leader is None:
        return

    def leave(reason: str) -> None:
        log.critical("exiting: %s; restart this node", reason)
        logging.shutdown()
        os._exit(exit_code)

    leader.on_lost = leave
