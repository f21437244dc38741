"""One decoder-only model covering Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Parameter names follow the Hugging Face checkpoints except for the packed projections
(``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up); ``packed_modules_mapping`` tells the
loader where each checkpoint tensor goes.

Built with a ``TPShard`` of size N, the model is one rank's part of a tensor-parallel model
(``tensor_parallel``): its heads, MLP columns and vocab rows, joined by collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from common.model.attention import AttentionBackend, write_kv
from common.model.attention_metadata import AttentionMetadata
from common.model.attn_backends.sdpa import SdpaBackend
from common.model.config import ModelConfig
from common.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, load_fused_ops
from common.model.tensor_parallel import TPShard, embed, logits, row_parallel, shard_sizes


@dataclass
class StepInputs:
    """What every layer of one forward shares: the kernels, the attention plan, cache slots, rotary angles."""

    backend: AttentionBackend
    plan: Any  # the backend's, built once per forward
    slots: torch.Tensor  # [n] flat cache slot of each new token
    cos: torch.Tensor  # [n, 1, head_dim / 2]
    sin: torch.Tensor
    fused: ModuleType | None = None  # the fused Triton ops when the engine chose them (layers.load_fused_ops)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPShard) -> None:
        super().__init__()
        self.tp = tp
        shard = shard_sizes(config, tp)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = config.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d**-0.5
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        # Qwen2 biases q/k/v only; Llama-style attention_bias covers the output too.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.bind_weight_loaders()

    def bind_weight_loaders(self) -> None:
        """Attach the packed parameters' loaders (again after ``to_empty``, which drops attributes)."""
        self.qkv_proj.weight.weight_loader = self._load_qkv  # type: ignore[attr-defined]
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.weight_loader = self._load_qkv  # type: ignore[attr-defined]

    def _load_qkv(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        param.data[offset : offset + loaded.shape[0]].copy_(loaded)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, step: StepInputs) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, step.fused), self.k_norm(k, step.fused)
        q, k = apply_rotary(q, step.cos, step.sin, step.fused), apply_rotary(k, step.cos, step.sin, step.fused)
        write_kv(kv_cache, k, v, step.slots)
        return row_parallel(self.o_proj, step.backend.forward(q, k, v, kv_cache, step.plan, self.scale), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPShard) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp)
        self.mlp = GatedMLP(config.hidden_size, shard_sizes(config, tp).intermediate_size, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, step: StepInputs) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden, step.fused), kv_cache, step)
        return hidden + self.mlp(self.post_attention_layernorm(hidden, step.fused), step.fused)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPShard) -> None:
        super().__init__()
        # the table given, not initialised: normal_ on the meta device goes through torch._refs, whose
        # first use imports torch._dynamo (2.7 s of CPU at every node's start, for values the loader overwrites)
        rows = shard_sizes(config, tp).vocab_rows
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )


class CausalLM(nn.Module):
    """A decoder over a paged KV cache; ``forward`` returns hidden states, ``compute_logits`` logits."""

    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPShard()
        self.attn_backend: AttentionBackend = SdpaBackend()  # the engine sets its choice at start,
        self.use_fused_ops = False  # and this one (attention.use_kernels)
        self.model = DecoderModel(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, shard_sizes(config, self.tp).vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device) -> None:
        """Turn a ``meta``-built model into uninitialised tensors on ``device``, ready to load."""
        # to_empty's empty_like on meta tensors goes through torch._refs, whose first use imports
        # torch.fx's symbolic shapes (1.6 s of CPU at every start); torch.empty takes the direct path
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        if self.config.tie_word_embeddings:
            self.tie_weights()  # the fresh tensors are separate; share the table again
        for layer in self.model.layers:
            layer.self_attn.bind_weight_loaders()
            layer.mlp.bind_weight_loaders()
        self.model.rotary_emb.reset_table(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        on_layer_done: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run the flat batch through every layer; returns the final-norm hidden states [n, hidden].

        Each layer writes its new K/V into ``kv_caches[i]`` before attending, and
        ``on_layer_done(i, kv_caches[i])`` runs once that layer's KV is in the cache.
        """
        device = input_ids.device
        cos, sin = self.model.rotary_emb(positions)
        plan = self.attn_backend.plan(attn_metadata, device)
        fused = load_fused_ops() if self.use_fused_ops else None
        step = StepInputs(self.attn_backend, plan, attn_metadata.slot_mapping.to(device), cos, sin, fused)
        hidden = embed(self.model.embed_tokens, input_ids, self.tp)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, kv_caches[i], step)
            if on_layer_done is not None:
                on_layer_done(i, kv_caches[i])
        return self.model.norm(hidden, fused)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] for the given hidden states."""
        return logits(self.lm_head, hidden, self.tp, self.config.vocab_size)
