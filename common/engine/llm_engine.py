"""The synchronous engine: ``step()`` = receive transfers, schedule, run, postprocess.

Not thread-safe by design: exactly one thread (``AsyncLLMEngine``'s engine thread, or a
test) calls every method. Requests live in ``_requests`` from ``add_request`` until the
``RequestOutput`` that reports them finished has been returned by ``step()``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from common.engine.block_manager import BlockManager
from common.engine.config import CPU_KV_CACHE_GB, GPU_KV_CACHE_FRACTION, EngineConfig
from common.engine.kv_connector import KVConnectorBase
from common.engine.model_runner import ModelRunner
from common.engine.outputs import RequestOutput
from common.engine.protocol import EngineStats
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.kv_layout import DTYPES, KVLayout
from common.model.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from common.model.loader import load_model


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None):
        self.config = config
        self.connector = connector or KVConnectorBase()
        self.device = config.resolved_device()
        dtype = config.resolved_dtype()
        model_dir = Path(config.model) if config.model else Path(ensure_embedded_model())
        model, self.model_config = load_model(model_dir, self.device, DTYPES[dtype])
        self.model_name = config.served_model_name or (model_dir.name if config.model else EMBEDDED_MODEL_NAME)
        self.tokenizer = _load_tokenizer(model_dir)
        self.kv_layout: KVLayout = self.model_config.kv_layout(config.block_size, dtype)
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings, num_blocks * config.block_size
        )
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.runner = ModelRunner(model, self.kv_layout, num_blocks, self.device, config.seed)
        self.kv_caches: list[torch.Tensor] = self.runner.kv_caches
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            self.connector,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=eos,
        )
        self._requests: dict[str, Sequence] = {}
        self._finished_unreported: list[Sequence] = []  # aborted between steps
        # only hand the runner a per-layer hook when the connector really saves KV
        overrides_save = type(self.connector).save_kv_layer is not KVConnectorBase.save_kv_layer
        self._save_kv_layer = self.connector.save_kv_layer if overrides_save else None
        self._ids = itertools.count()
        self.last_step_num_tokens = 0  # tokens computed by the latest step (0: it only polled)

    def _default_num_blocks(self) -> int:
        per_block = self.kv_layout.bytes_per_block_per_layer() * self.kv_layout.num_layers
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * GPU_KV_CACHE_FRACTION
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
        params.validate()
        seq = Sequence(request_id, list(prompt_token_ids), params, kv_transfer_params=dict(kv_transfer_params or {}))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Finish the request with reason "abort" (reported by the next ``step``); unknown ids are ignored."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        self._finished_unreported.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_schedulable_work(self) -> bool:
        """True when ``step`` would compute something or report something right away."""
        return self.scheduler.has_schedulable_work() or bool(self._finished_unreported)

    def has_pending_transfers(self) -> bool:
        """Sequences parked for remote KV or held for a send: ``step`` must keep polling the connector."""
        return self.scheduler.has_pending_transfers()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.parked),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
        )

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched = self.scheduler.process_transfers(self.connector.get_finished())
        touched += self._finished_unreported
        self._finished_unreported = []
        batch = self.scheduler.schedule()
        self.last_step_num_tokens = batch.num_tokens
        if batch:
            result = self.runner.run(batch, self._save_kv_layer)
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens += n
            for seq, token_id, logprobs in zip(result.sampled_seqs, result.token_ids, result.logprobs):
                if logprobs is not None:
                    seq.logprobs.append(logprobs)
                self.scheduler.append_token(seq, token_id)
            self.connector.on_step_done(batch.seqs)
            touched += result.sampled_seqs
        outputs = []
        for seq in dict.fromkeys(touched):  # dedupe, keep order
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
            request_id=seq.request_id,
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            new_logprobs=logprobs,
            error=seq.error,
            kv_transfer_params=seq.kv_transfer_params,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
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
