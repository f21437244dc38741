"""A tensor-parallel worker rank of a prefill or decode node: the engine's worker
(``common.engine.tp_worker``) with the KV transfer's commands served on it.

``python -m common.kv_transfer.tp_rank_main HOST PORT RANK``; a daemon's rank 0 starts its workers
with this module (``rank_main``) so that each opens its own KV endpoint at KV_START and moves its
own heads (``tp_ranks``, ``tp_endpoints.RankKVServer``).
"""

from __future__ import annotations

from common.engine import tp_worker
from common.kv_transfer.tp_endpoints import RankKVServer

if __name__ == "__main__":
    tp_worker.main(extension=RankKVServer)
