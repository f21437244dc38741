"""The synchronous engine: ``step()`` = receive transfers, schedule, run, postprocess.

The connector's two halves (``kv_connector``): the scheduler side lives in the
``Scheduler``; the worker side is given the batch's ``KVConnectorMetadata`` before the
forward (``issue``) and during it (``save_kv_layer``). What the postprocess decided (a
first token to hand over, a discard) is issued at the end of the same step, so a hand-over
never waits for the next step or the async loop's poll interval.

Outputs leave only as return values: ``step()`` returns everything it produced. A caller
that wants a peer's first token out before the step's compute calls ``poll_transfers()``
first and sends what it returns; the ``step()`` after it then returns only the rest.

Not thread-safe by design: exactly one thread (``AsyncLLMEngine``'s engine thread, or a
test) calls every method. Requests live in ``_requests`` from ``add_request`` until the
``RequestOutput`` that reports them finished has been returned by ``step()``.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from common.engine.block_hash import root_hash
from common.engine.block_manager import BlockManager
from common.engine.config import CPU_KV_CACHE_GB, EngineConfig
from common.engine.cuda_graph import graph_memory
from common.engine.gpu_memory import DEFAULT_GPU_MEMORY_UTILIZATION, activation_reserve, kv_cache_budget
from common.engine.kv_connector import KVConnector, KVConnectorMetadata, no_connector
from common.engine.kv_file_tier import FileTier
from common.engine.kv_tiers import KVTiers
from common.engine.model_runner import ModelRunner
from common.engine.outputs import KV_TRANSFER_FAILED, RequestOutput
from common.engine.parallel import RANK_MAIN, load_model_on_ranks
from common.engine.protocol import EngineStats
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.engine.structured_output import RESPONSE_FORMAT_PARAM
from common.engine.step_meter import StepMeter
from common.kv_layout import DTYPES, KVLayout
from common.model.attention import choose_kernels
from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC
from common.model.sources import resolve_model

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None, rank_main: str = RANK_MAIN):
        """``rank_main``: the module each tensor-parallel worker rank runs (``parallel``)."""
        self.config = config
        self.connector = connector or no_connector()
        self.kv_worker = self.connector.worker
        self.device = config.resolved_device()
        dtype = config.resolved_dtype()
        # A node resolved --model to a directory already (common/node/node.py: its default is the real
        # model); an engine built directly, as the tests build theirs, defaults to the embedded one.
        model_dir, default_name = resolve_model(config.model or EMBEDDED_MODEL_SPEC, DEFAULT_CACHE_DIR)
        model, self.model_config = load_model_on_ranks(config, model_dir, self.device, DTYPES[dtype], rank_main)
        self.model_name = config.served_model_name or default_name
        self.tokenizer = _load_tokenizer(model_dir)
        self.kv_layout: KVLayout = self.model_config.kv_layout(config.block_size, dtype)
        num_blocks = config.num_kv_blocks or self._default_num_blocks(model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings, num_blocks * config.block_size
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(
            model, self.kv_layout, num_blocks, self.device, config.seed,
            choose_kernels(config.attention_backend, config.fused_ops, self.device, config.batch_invariant),
            config.enforce_eager, config.max_num_seqs, self.max_model_len, eos, config.max_num_batched_tokens,
        )
        self.kv_caches: list[torch.Tensor] = self.runner.kv_caches
        self.scheduler = Scheduler(
            self.block_manager,
            self.connector.scheduler,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=eos,
            cache_root=root_hash(str(model_dir), self.kv_layout.fingerprint()),
            fair_share=config.fair_share == "on",
            max_tokens_in_flight_per_client=config.max_tokens_in_flight_per_client,
        )
        self.kv_tiers = self._build_tiers()
        if self.kv_tiers is not None:
            self.scheduler.tiers = self.kv_tiers
            self.block_manager.on_evict = self.kv_tiers.offload_many
            self.kv_tiers.prefill_tokens_per_s = lambda: self.step_meter.prefill_tokens_per_s
        self._requests: dict[str, Sequence] = {}
        self._finished_unreported: list[Sequence] = []  # aborted between steps
        self._ids = itertools.count()
        self.last_step_num_tokens = 0  # tokens computed by the latest step (0: it only polled)
        self.step_meter = StepMeter()  # prefill tokens/s and step records (the local-prefill stall bound)

    def _build_tiers(self) -> KVTiers | None:
        """The KV tiers the flags ask for (``kv_tiers``); None when none is. A file tier whose
        directory is unusable stays off with a warning and its error counted."""
        cfg = self.config
        if cfg.kv_host_bytes <= 0 and cfg.kv_disk_dir is None and cfg.kv_peer_fetch == "off":
            return None  # the peer tier's fetcher comes with the daemon's KV endpoint (``kv_tiers.peer``)
        file_tier = None
        if cfg.kv_disk_dir is not None:
            layout = self.kv_layout
            # the chain's root names model, layout and block size: nodes of one model share the folder
            file_tier = FileTier(cfg.kv_disk_dir, self.scheduler.cache_root.hex(), cfg.kv_disk_bytes,
                                 layout.block_shape(), layout.torch_dtype)
            file_tier.start()
        return KVTiers(self.kv_caches, cfg.kv_host_bytes, file_tier, cfg.kv_offload_on_finish,
                       always_load=cfg.kv_tier_load == "always")

    def _default_num_blocks(self, model: torch.nn.Module) -> int:
        per_block = self.kv_layout.bytes_per_block_per_layer() * self.kv_layout.num_layers
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            mc, cfg = self.model_config, self.config
            reserve = activation_reserve(mc.hidden_size, mc.intermediate_size, mc.vocab_size,
                                         cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                         torch.empty((), dtype=self.kv_layout.torch_dtype).element_size())
            # counted first: the graphs are captured after the cache is allocated
            reserve += graph_memory(model, self.kv_layout, cfg, mc.max_position_embeddings)
            budget = kv_cache_budget(total, free, torch.cuda.memory_reserved(self.device),
                                     cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION, reserve)
        else:
            budget = CPU_KV_CACHE_GB * 2**30
        return max(1, int(budget // per_block))

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request; ValueError for a duplicate id, an empty or too long prompt, bad params."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        check_prompt(prompt_token_ids, self.max_model_len)
        params.validate(self.model_config.vocab_size)
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       kv_transfer_params=dict(kv_transfer_params or {}),
                       grammar=params.grammar.matcher() if params.grammar is not None else None)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Finish the request (every choice of it, or only choice ``index``) with reason "abort",
        reported by the next ``step``; unknown ids are ignored."""
        for seq in [s for s in self._requests.values() if (s.group_id or s.request_id) == request_id]:
            if not seq.is_finished and index in (None, seq.index):
                self.scheduler.finish(seq, "abort")
                self._finished_unreported.append(seq)

    def peer_blocks(self, hashes: list[bytes]) -> tuple[int, bytes]:
        """The peer tier's serving side: how many leading ``hashes`` the pool holds cached, then the
        host tier, and their KV copied out (``KVTiers.read_blocks``). On the engine thread, between steps."""
        if self.kv_tiers is None:
            return 0, b""
        blocks = self.block_manager.cached_blocks(hashes)
        return self.kv_tiers.read_blocks(blocks, hashes[len(blocks):])

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_schedulable_work(self) -> bool:
        """True when ``step`` would compute, report or hand the worker side something right away."""
        return (self.scheduler.has_schedulable_work() or bool(self._finished_unreported)
                or self.connector.scheduler.has_pending() or (self.kv_tiers is not None and self.kv_tiers.has_news))

    def is_idle(self) -> bool:
        """Nothing held: no request queued, running, parked for KV or held for a send."""
        return not (self._requests or self.has_schedulable_work() or self.has_pending_transfers())

    def set_connector(self, connector: KVConnector) -> None:
        """Swap both connector halves (a daemon's role flip); only while :meth:`is_idle`, on the
        engine thread: the scheduler, the KV cache and the compiled graphs stay."""
        if not self.is_idle():
            raise RuntimeError("the connector can only be swapped while the engine holds no request")
        self.connector, self.kv_worker = connector, connector.worker
        self.scheduler.connector = connector.scheduler

    def has_pending_transfers(self) -> bool:
        """Sequences parked for remote KV or held for a send: ``step`` must keep polling the connector."""
        return self.scheduler.has_pending_transfers()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.parked) + len(s.loading),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prefill_tokens_per_s=self.step_meter.prefill_tokens_per_s,
            pending_prefill_tokens=sum(q.num_uncomputed_tokens for q in (*s.waiting, *s.running) if q.is_prefill),
            num_decoding=sum(1 for q in s.running if not q.is_prefill),
            max_local_prefill_stall_ms=self.config.max_local_prefill_stall_ms,
            kv_tiers=self.kv_tiers.stats() if self.kv_tiers is not None else None,
        )

    # ---- the loop -----------------------------------------------------------------------
    def poll_transfers(self) -> list[RequestOutput]:
        """Apply the transfers the worker side finished (a peer's first token landed, a transfer
        failed); the outputs they produce. ``step`` starts with this too."""
        landed = self.scheduler.process_transfers(self.kv_worker.get_finished())
        return self._outputs(landed + self._adopt_forked())

    def step(self) -> list[RequestOutput]:
        landed = self.poll_transfers()
        touched = self._finished_unreported
        self._finished_unreported = []
        cap = self.step_meter.stall_token_cap(self.config.max_local_prefill_stall_ms, self.config.block_size)
        batch = self.scheduler.schedule(cap)
        self.last_step_num_tokens = batch.num_tokens
        meta = batch.kv_connector_metadata
        if meta:
            self.kv_worker.issue(meta)
        if batch:
            started = time.perf_counter()
            result = self.runner.run(batch, self._layer_hook(meta))
            self._record_step(batch, cap, time.perf_counter() - started)
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens += n
            for seq, token_id, logprobs in zip(result.sampled_seqs, result.token_ids, result.logprobs):
                if logprobs is not None:
                    seq.logprobs.append(logprobs)
                if seq in result.choice_firsts:  # before choice 0's token: if that ends it, its blocks are shared
                    self.scheduler.fork(seq, result.choice_firsts[seq])
                self.scheduler.append_token(seq, token_id)
            touched += result.sampled_seqs + self._adopt_forked()
        tail = self.scheduler.take_kv_metadata()  # e.g. a first token to hand over: it goes now
        if tail:
            self.kv_worker.issue(tail)
        return landed + self._outputs(touched)

    def _adopt_forked(self) -> list[Sequence]:
        """Track the choices the scheduler just forked and copy their prompt's tail block now,
        before any later allocation or write can touch the block copied from."""
        forked, copies = self.scheduler.take_forked()
        for seq in forked:
            self._requests[seq.request_id] = seq
        if copies:
            self.runner.copy_blocks(copies)
        return forked

    def _record_step(self, batch, cap: int | None, seconds: float) -> None:
        prompt = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.is_prefill)
        decodes = len(batch.seqs) - sum(1 for seq in batch.seqs if seq.is_prefill)
        self.step_meter.record(decodes, prompt, cap if decodes else None, seconds)

    def _layer_hook(self, meta: KVConnectorMetadata):
        """The runner's per-layer hook when some row saves KV this step, else None."""
        if not meta.saves:
            return None
        worker = self.kv_worker
        return lambda layer_idx, kv_layer: worker.save_kv_layer(layer_idx, kv_layer, meta)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        for seq in dict.fromkeys(seqs):  # dedupe, keep order
            out = self._make_output(seq)
            if out is not None:
                outputs.append(out)
        return outputs

    def _make_output(self, seq: Sequence) -> RequestOutput | None:
        new = seq.output_token_ids[seq.num_emitted_tokens :]
        if not new and not seq.is_finished:
            return None
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.logprobs[seq.num_emitted_tokens :]
            logprobs += [{}] * (len(new) - len(logprobs))  # e.g. the first token from a remote prefill
        seq.num_emitted_tokens = len(seq.output_token_ids)
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.group_id or seq.request_id,
            index=seq.index,
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=logprobs,
            error=seq.error,
            **_error_origin(seq),
            kv_transfer_params=seq.kv_transfer_params,
        )

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run ``prompts`` to completion together; returns each one's output token ids."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, all_params):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
        return [tokens[rid] for rid in ids]


def _error_origin(seq: Sequence) -> dict[str, str]:
    """Whose fault a sequence's error is, for its output: the request's (``error_param``, the field
    at fault) when its grammar could not be followed; the prefill end's (``error_code``
    ``kv_transfer_failed``) when it failed before its prompt was computed, which only a decode node
    waiting for its prompt's KV does; {} otherwise (the node's)."""
    if seq.finish_reason != "error":
        return {}
    if seq.grammar is not None and seq.grammar.failed:
        logger.warning("request %s: the grammar engine gave up: %s", seq.request_id, seq.grammar.detail)
        grammar = seq.params.grammar
        return {"error_param": grammar.param if grammar is not None else RESPONSE_FORMAT_PARAM}
    if seq.num_computed_tokens < seq.num_prompt_tokens:
        return {"error_code": KV_TRANSFER_FAILED}
    return {}


def check_prompt(prompt_token_ids: list[int], max_model_len: int) -> None:
    """ValueError for an empty prompt or one that leaves no room for a token."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model serves at most "
            f"{max_model_len - 1} prompt tokens (max_model_len {max_model_len})"
        )


def _load_tokenizer(model_dir: Path):
    """The model's tokenizer, or None for a weights-only checkpoint (tests' random models)."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from common.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)
