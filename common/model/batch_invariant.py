"""Batch-invariant matmuls (``--batch-invariant``): each row's result independent of its batch.

A BLAS picks its kernel, its split over threads and so its order of summation by the shape of
the call: ``F.linear`` of one row (a gemv) rounds differently from the same row among 4, and
among 2 to 3, and with two threads the split of the rows over the threads changes the result
again. So a token's hidden state, and in the end its logits, depended on how many other tokens
shared its step. Two ways out, chosen at start by checking on the model's own weights:

- on CPU in float32, oneDNN's matmul on the weight packed once in its blocked layout
  (:func:`packed_linear`): its kernel sums each output over the input axis in one order
  whatever the number of rows, except that for a single row it may split that axis over the
  threads, so the rows are padded to a multiple of a small tile (4). It is also 2-4x faster
  than MKL's sgemm/sgemv on this machine's AMD CPU, so the mode costs little here;
- elsewhere (CUDA, other dtypes, no oneDNN, or the check fails), fixed tiles of ``tile`` rows
  (the last one padded with zeros): one batched matmul of ``[tiles, tile, in] @ [in, out]``,
  whose every batch element has the same shape whatever the batch (:func:`tiled_linear`).

Which tile gives identical rows depends on the library and the thread count, so
:func:`choose_packed_tile` and :func:`choose_tile` check at start, and
:func:`make_batch_invariant` refuses to start when no tile passes.

The other ops of the forward pass were checked row by row (``tests/common/model/
test_batch_invariant.py``): the embedding, RMSNorm's mean over the last dim, rotary,
SiLU-and-mul, softmax and log-softmax over the vocabulary already give each row the same bits
whatever the batch; attention does not (``attn_backends/invariant.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILES = (16, 32, 64, 128)  # tried in order; the smallest costs least in decode steps of few rows
PACKED_TILES = (4, 8, 16)  # the oneDNN path's row multiples, tried in order
_CHECK_ROWS = (1, 2, 3, 5, 7, 9, 16, 17, 33, 100)  # batch sizes the start-up check compares
# warm_packed_linears' bound: a product of more multiply-adds (~1 ms and up on this machine's CPU)
# takes longer than its kernel's build, so its first call pays at most twice
WARM_MAX_MACS = 2**26


class BatchInvariantError(RuntimeError):
    """No tile size gives batch-invariant matmuls on this machine's BLAS; the message says what to do."""


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on fixed tiles of ``tile`` rows of ``x`` [..., in]."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, -n % tile)).view(-1, tile, rows.shape[1])
    out = torch.bmm(padded, weight.t().expand(padded.shape[0], -1, -1)).view(-1, weight.shape[0])[:n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`packed_linear` can run here (oneDNN's CPU matmul, float32)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout, for :func:`packed_linear` (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), tile)


def padded_rows(n: int, tile: int) -> int:
    """``n`` rows rounded up to a multiple of ``tile``; past 64 rows, to a sixteenth of the power of
    two above ``n``: oneDNN builds a kernel per shape (1-3 ms each), so prefill chunks reuse a few."""
    step = max(tile, 1 << max(n.bit_length() - 4, 0)) if n > 64 else tile
    return -(-n // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  tile: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with oneDNN on ``packed`` (:func:`pack_weight`), the rows of
    ``x`` [..., in] padded with zeros to :func:`padded_rows`."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = padded_rows(n, tile)
    if padded != n:
        rows = F.pad(rows, (0, 0, 0, padded - n))
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:n].view(*x.shape[:-1], out_features)


class ProductLinear(nn.Linear):
    """An ``nn.Linear`` that computes its product its own way (same parameters); ``matmul`` is the
    product without the bias (a tensor-parallel rank's partial product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, None)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(ProductLinear):
    """The default path's linear on CPU in float32: oneDNN on the weight packed once, 1.4x (one
    row) to 3.5x (16 rows) faster than ``F.linear``'s MKL on this machine's AMD CPU. Past 64 rows
    the rows are padded as :func:`padded_rows` says, so prompts of many lengths share a few of
    oneDNN's per-shape kernels. The packed copy is made once: a weight changed in place
    afterwards is not seen, and an untied weight is gone (:func:`pack_linears`)."""

    packed: torch.Tensor

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(x, self.packed, bias, self.out_features, 1)


class InvariantLinear(ProductLinear):
    """An ``nn.Linear`` whose rows do not depend on their batch: :func:`packed_linear` when its
    weight was packed at start, the fixed-tile Triton matmul (``invariant_matmul``) on a GPU,
    else fixed row tiles (:func:`tiled_linear`); same parameters. The packed copy is made once:
    a weight changed in place afterwards is not seen."""

    tile: int
    packed: torch.Tensor | None
    triton: bool
    large_from: int | None  # the Triton matmul's rows from which it runs its large tiles (None: never)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, bias, self.out_features, self.tile)
        if self.triton:
            from common.model.invariant_matmul import invariant_linear

            return invariant_linear(x, self.weight, bias, self.large_from)
        return tiled_linear(x, self.weight, bias, self.tile)


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`PackedLinear` where oneDNN can
    run it (:func:`packs_weights`); returns how many. A weight only its linear uses is dropped
    once packed (nothing reads it after start: SmolLM2's node holds 0.5 GB less); one tied to
    another module (the LM head to the embedding) stays."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears or not packs_weights(device, linears[0].weight.dtype):
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for linear in linears:
        linear.__class__ = PackedLinear
        linear.packed = pack_weight(linear.weight, 1)
        if id(linear.weight) not in shared:
            linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return len(linears)


def packed_row_counts(max_rows: int, tile: int) -> list[int]:
    """The row counts :func:`packed_linear` pads ``1..max_rows`` rows to: oneDNN's shapes."""
    return sorted({padded_rows(n, tile) for n in range(1, max_rows + 1)})


@torch.inference_mode()
def warm_packed_linears(linears: list[tuple[nn.Module, int]]) -> int:
    """Run the packed linears of ``(linear, most rows a step gives it)`` once at each row count
    :func:`padded_rows` can give them (zeros in, the result dropped), one linear per shape: oneDNN
    builds a kernel per shape on its first call (0.2-0.8 ms here), which otherwise the first step
    of each new row count pays, i.e. the first requests. Counts past :data:`WARM_MAX_MACS` are
    left to their first step, where the product itself takes longer than the build. Returns how
    many (shape, row count) kernels it ran."""
    most: dict[tuple[int, int, bool, int], tuple[nn.Module, int]] = {}
    for linear, max_rows in linears:
        if getattr(linear, "packed", None) is None:
            continue
        key = (linear.in_features, linear.out_features, linear.bias is not None, getattr(linear, "tile", 1))
        if max_rows > most.get(key, (None, 0))[1]:
            most[key] = (linear, max_rows)
    ran = 0
    for (in_features, out_features, _, tile), (linear, max_rows) in most.items():
        for n in packed_row_counts(min(max_rows, WARM_MAX_MACS // (in_features * out_features)), tile):
            packed_linear(torch.zeros(n, in_features), linear.packed, linear.bias, out_features, tile)
            ran += 1
    return ran


def rows_invariant(fn, x: torch.Tensor) -> bool:
    """Whether ``fn`` gives every slice of rows of ``x`` the same bits as the whole of ``x`` does."""
    whole = fn(x)
    for m in _CHECK_ROWS:
        for offset in (0, 3, x.shape[0] - m):
            if 0 <= offset and offset + m <= x.shape[0] and not torch.equal(
                    fn(x[offset : offset + m].clone()), whole[offset : offset + m]):
                return False
    return True


def choose_tile(sizes: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> int:
    """The first tile of :data:`TILES` whose :func:`tiled_linear` gives identical rows for every
    checked batch size and offset, on random ``[size, size]`` weights (the model's widths)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, max(sizes), generator=gen).to(device, dtype)
    weights = [torch.randn(s, s, generator=gen).to(device, dtype) for s in sizes]
    for tile in TILES:
        if all(rows_invariant(lambda rows: tiled_linear(rows, w, None, tile), x[:, : w.shape[1]]) for w in weights):
            return tile
    raise BatchInvariantError(
        f"--batch-invariant: no row tile of {', '.join(map(str, TILES))} gives this machine's matmuls the same "
        f"result for every batch size ({device}, {torch.get_num_threads()} threads); run without --batch-invariant")


def choose_packed_tile(weights: list[torch.Tensor]) -> int | None:
    """The first tile of :data:`PACKED_TILES` whose :func:`packed_linear` gives identical rows for
    every checked batch size and offset, on each of ``weights`` (one per shape the model has);
    None when none does."""
    gen = torch.Generator().manual_seed(0)
    for tile in PACKED_TILES:
        packed = [(pack_weight(w, tile), w.shape[0], torch.randn(130, w.shape[1], generator=gen)) for w in weights]
        if all(rows_invariant(lambda rows: packed_linear(rows, p, None, out, tile), x) for p, out, x in packed):
            return tile
    return None


def bmm_invariant(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm`` of ``[b, m, k] @ [b, k, n]`` gives each batch element the same bits
    whatever ``b`` (the invariant attention's matmuls)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(130, m, k, generator=gen).to(device, dtype)
    b = torch.randn(130, k, n, generator=gen).to(device, dtype)
    return rows_invariant(lambda idx: torch.bmm(a[idx], b[idx]), torch.arange(130, device=device))


def triton_rows_invariant(weights: list[torch.Tensor]) -> bool:
    """Whether the Triton matmul (``invariant_matmul``) gives identical rows for every checked
    batch size and offset on each of ``weights`` (one per shape the model has)."""
    from common.model.invariant_matmul import invariant_linear

    gen = torch.Generator().manual_seed(0)
    return all(rows_invariant(lambda rows: invariant_linear(rows, w, None),
                              torch.randn(130, w.shape[1], generator=gen).to(w.device, w.dtype)) for w in weights)


def make_batch_invariant(model: nn.Module, device: torch.device, triton: bool = False) -> str:
    """Turn every ``nn.Linear`` of ``model`` into an :class:`InvariantLinear` (same parameters),
    and say how its products run: ``packed`` (oneDNN, when :func:`choose_packed_tile` finds a
    tile), ``triton`` (asked for with ``triton`` and passing :func:`triton_rows_invariant`), else
    ``tiles of N`` (:func:`choose_tile`). BatchInvariantError when none passes, or when the torch
    attention (``triton`` False) would run on batched matmuls that are not batch-count invariant
    here. Called again (a Triton warm-up failed), it re-chooses for the linears it turned."""
    from common.model.attn_backends.invariant import KEY_BLOCK, QUERY_TILE

    config = model.config
    dtype = next(model.parameters()).dtype
    linears = [m for m in model.modules() if type(m) in (nn.Linear, InvariantLinear)]
    one_per_shape = list({tuple(m.weight.shape): m.weight for m in linears}.values())  # the split depends on it
    packed_tile = choose_packed_tile(one_per_shape) if packs_weights(device, dtype) else None
    use_triton = packed_tile is None and triton and triton_rows_invariant(one_per_shape)
    large_from = None
    if use_triton:
        from common.model.invariant_matmul import LARGE_FROM, large_tiles_agree

        large_from = LARGE_FROM if large_tiles_agree(one_per_shape) else None
    tile = packed_tile or (0 if use_triton else
                           choose_tile(tuple(sorted({config.hidden_size, config.intermediate_size})), device, dtype))
    rows = QUERY_TILE * (config.num_heads // config.num_kv_heads)
    for shape in () if triton else ((rows, config.head_dim, KEY_BLOCK), (rows, KEY_BLOCK, config.head_dim)):
        if not bmm_invariant(shape, device, dtype):
            raise BatchInvariantError(
                f"--batch-invariant: this machine's batched matmul ({device}, {torch.get_num_threads()} threads) "
                f"gives a [{shape[0]}, {shape[1]}] @ [{shape[1]}, {shape[2]}] product different bits in batches of "
                "different sizes, so attention cannot be made invariant here; run without --batch-invariant")
    for linear in linears:
        linear.__class__ = InvariantLinear  # a subclass adding no parameters: they and their tying stay as they are
        linear.tile, linear.triton, linear.large_from = tile, use_triton, large_from
        linear.packed = pack_weight(linear.weight, tile) if packed_tile else None
    if use_triton:
        return "triton" + (f" (large tiles from {large_from} rows)" if large_from is not None else "")
    return "packed" if packed_tile else f"tiles of {tile}"
