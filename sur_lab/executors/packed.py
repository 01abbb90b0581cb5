"""Packed refresh: all selected positions advance through the model together, layer by layer (section 3.3,
appendix 13.2), plus the execution controls of appendix 13.3 (direct sequential, one-shot sparse).

The packed executor gathers the B selected token embeddings into one ``[1, B, hidden]`` buffer and runs the model's
own decoder layers on it (input norm, Q/K/V projections, Qwen3's Q/K norms, RoPE at the absolute positions U through
the model's rotary embedding, output projection, residuals, post-attention norm, MLP). Two things are swapped in for
the duration of the traversal, nothing else:

* the cache passed to each layer is :class:`IndexedWriteCache`, whose ``update`` writes the fresh K/V rows at U into
  the output cache *before* attention (Eq. 21) and returns that layer's complete K/V rows ``[0, u_B]``;
* the attention function is ours, chosen per call: the per-refresh plan is passed to each layer as its
  ``attention_mask`` and the model's dispatching attention (:mod:`sur_lab.attention`, installed once per model) hands
  a call carrying a plan to it and every other call to the model's own function. Packed row r attends to keys
  ``0..u_r`` of the mixed cache, fresh rows at selected positions and reused Shift rows in the gaps (Eq. 22), with
  one of four backends chosen by name:

  ``"sdpa"``    ``torch.nn.functional.scaled_dot_product_attention`` with an explicit ``[B, u_B + 1]`` mask built
                once per refresh (boolean ``j <= u_r``, stored in SDPA's additive form); GQA through
                ``enable_gqa=True`` on the CPU (no copy) and ``repeat_kv`` on accelerators, where a masked GQA
                call would fall back to the math kernel (transformers does the same). ``sdpa_split=True``
                (registered as ``"packed-sdpa-split"``, CPU only; the default ``"packed"``'s fallback) splits the keys
                instead: key segment ``[k0, k1)`` is attended only by the packed rows with ``u_r >= k0`` (the rows
                that can see any of it; a segment is a complete-prefix tile for every later row, Eq. 23-24), with
                the GQA group folded into the query rows so each K/V segment is read once per KV head and query
                block, and the per-segment outputs are merged exactly by their log-sum-exp. Attention work follows
                M(U) instead of ``B * (u_B + 1)``; the boundaries minimise a cost model of torch's CPU flash kernel
                (:func:`split_segments`: work, calls, the kernel's per-query-block key re-reads, long calls), so
                a compact support runs as a few calls of at most ~1.5K keys and a call may take extra rows to
                reach a larger flash query block (``scripts/attention_paths.py`` times the paths on one layer).
  ``"flex"``    ``torch.nn.attention.flex_attention`` with ``mask_mod(q, kv) = kv <= U[q]`` and a ``BlockMask`` built
                in O(B) from the tile counts of Eq. 23-24 (no B x N evaluation). Compiled with ``torch.compile`` by
                default; the first call per shape compiles (seconds to minutes on a CPU, cached on disk by inductor
                afterwards) and is excluded from benchmark timings. ``flex_compile=False`` runs the eager reference
                (materializes the B x N scores: slow, for tests only).
  ``"cpp"``     the one-pass C++ CPU kernel of :mod:`sur_lab.executors.kernels.onepass` (registered as
                ``"packed-cpp"``): each K/V tile is read once for every packed row that sees it (one score GEMM and
                one ``P V`` GEMM over all those rows, online softmax, GQA folded into the rows), with a tile plan built
                once per refresh (the 64-key tiles of Eq. 23-24 at row granularity). Compiled on first use and cached
                in the model cache folder; where it cannot run (no compiler, a failed build, tensors off the CPU) the
                ``"sdpa"`` path with ``sdpa_split=True`` runs instead, after one warning line. The default
                ``"packed"`` uses this backend.
  ``"triton"``  the indexed-attention kernel of :mod:`sur_lab.executors.kernels` with one plan per refresh reused across layers
                (FP16/BF16/FP32, head dim 64 or 128). On a CPU it runs only under ``TRITON_INTERPRET=1`` set before
                the kernels were imported; otherwise the kernel module falls back to its PyTorch SDPA reference.
                ``fused_scatter=True`` also writes K/V with the kernel module's indexed scatter.

The input Shift cache is never modified; exactly one complete output clone is made. The in-place forms
(``inplace=True``, registered as ``"<name>-inplace"``: ``"packed-inplace"``, ``"packed-sdpa-inplace"``, ...) are for a
Shift cache the caller gives up: the fresh K/V are written at U into that cache itself, no output clone is made, every
other row keeps its bits, and the result is bitwise that of the cloning path (the same arithmetic on the same
values); the input is consumed and returned. In real arithmetic the
layer-major schedule equals the interval-wise reference (``"sequential"`` in :mod:`sur_lab.executors`); in float64 the
two agree to ~1e-15, in low precision they differ by reduction order (appendix 13.5).

Controls (appendix 13.3), both registered executors:

* ``"direct-sequential"``: one output clone updated in place interval by interval (R traversals), each interval's
  layers attending to views of rows ``[0, b)`` of that one cache, so nothing is re-assembled between intervals.
* ``"one-shot"``: one ordinary model forward (``model(input_ids=..., cache=..., attention_mask=4-D)``) of all
  selected tokens, appended to a gathered cache of the unselected rows ``[0, u_B] \\ U`` with a custom 4-D mask; the
  new rows are scattered back into the output clone. It pays a gather and an append copy (its cache-assembly cost).

Threads: a refresh writes only its own output cache (or, in place, the Shift cache it was given) and reads the model;
it switches nothing that another forward reads (no config field, no module attribute), so several threads may refresh,
prefill and answer on one model at once (``docs/threads.md``). The compiled flex function is created once per process
under a lock.

Scope (as in the paper): Llama/Mistral/Qwen2/Qwen3 layers and their mixture-of-experts relatives (Qwen2-MoE,
Qwen3-MoE, Mixtral, GLM-4.5) of transformers in evaluation mode, full attention, fixed RoPE, batch size one, one
device. Anything else raises :class:`~sur_lab.models.UnsupportedModelError` before any work.
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import DynamicCache

from sur_lab.attention import RoutedMask, install_router, native_implementation
from sur_lab.budget import Support
from sur_lab.cache_ops import (
    KV,
    cache_length,
    clone_cache,
    from_tensors,
    layer_kv,
    num_layers,
    scatter_rows_,
    to_tensors,
)
from sur_lab.edits import EditedContext
from sur_lab.executors import INPLACE_SUFFIX, check_support, register_executor
from sur_lab.forward import check_context_length
from sur_lab.models import (
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    UnsupportedModelError,
    check_supported,
    rotary_embedding,
)

#: Decoder families whose native layers the packed executor drives (appendix 13.2 names Llama and Qwen3; Mistral
#: and Qwen2 share the Llama layer, Qwen2 with its sliding window disabled). The MoE families' MLPs route each packed
#: row on its own (top-k per token, no capacity limit: :data:`sur_lab.models.MOE_MODEL_TYPES`), and GLM-4.5's partial
#: rotary is applied by its own attention module at the positions U, so packed traversal stays exact for them too.
PACKED_MODEL_TYPES = SUPPORTED_MODEL_TYPES
#: Attention backends of the packed executor, by name.
PACKED_BACKENDS = ("sdpa", "flex", "triton", "cpp")
#: FlexAttention tile size (query rows and K/V positions), flex's own default.
FLEX_BLOCK_SIZE = 128
#: Cost model of the key-split path (:func:`split_segments`), in units of one folded query row times one key (all KV
#: heads; the GQA group is folded into the rows). Calibrated on this project's 2-core CPU with SmolLM2's heads (9/3,
#: d_h 64, FP32, one thread; 20th percentiles of ``scripts/attention_paths.py``-style timings): one row-key costs
#: ~5 ns, one extra flash call plus its log-sum-exp merge ~0.08 ms (:data:`SPLIT_CALL_COST`), and CPU flash
#: re-reads every key of a call once per block of query rows at ~32 row-keys per key (:data:`SPLIT_BLOCK_COST`).
#: It models one torch thread (the benchmarks' setting); with more, each call also splits its query blocks over the
#: threads, which the model does not see (the split stays exact, only possibly not the fastest one).
SPLIT_CALL_COST = 16384
#: Cost of one key in one query-row block of the CPU flash kernel (its K/V block packing), in row-keys.
SPLIT_BLOCK_COST = 32
#: Keys per call beyond which CPU flash slows down (its K/V no longer stay in cache): each key past it costs
#: :data:`SPLIT_LONG_EXTRA` more, so long segments are cut at :data:`SPLIT_KEY_STEP` multiples.
SPLIT_LONG_KEYS = 1536
SPLIT_LONG_EXTRA = 0.25
#: Extra cost of a call with a mask (some attending row cannot see all its keys): CPU flash adds the mask to every
#: score, ~9-15 % of the call; so an interval's own keys can go to a small masked call of their own.
SPLIT_MASK_EXTRA = 0.12
#: Segment boundaries of the key split are considered just after every this many packed rows, at each interval's
#: first position and just after its last, and at multiples of :data:`SPLIT_KEY_STEP` keys.
SPLIT_GRANULE = 8
SPLIT_KEY_STEP = 512
#: Query-row blocks of torch's CPU flash kernel, by query length, largest first: (minimum rows, block rows, cost of a
#: row relative to smaller blocks). Its 256-row blocks run ~1.3x slower per row-key (their score tile leaves cache).
FLASH_Q_BLOCKS = ((768, 256, 1.3), (192, 64, 1.0), (0, 32, 1.0))

__all__ = [
    "FLASH_Q_BLOCKS",
    "FLEX_BLOCK_SIZE",
    "FLEX_RECOMPILE_LIMIT",
    "PACKED_BACKENDS",
    "PACKED_MODEL_TYPES",
    "SPLIT_BLOCK_COST",
    "SPLIT_CALL_COST",
    "SPLIT_GRANULE",
    "SPLIT_KEY_STEP",
    "SPLIT_LONG_EXTRA",
    "SPLIT_LONG_KEYS",
    "SPLIT_MASK_EXTRA",
    "IndexedWriteCache",
    "KeySegment",
    "as_support",
    "check_packed_model",
    "check_packed_backend",
    "causal_pair_count",
    "flex_block_mask",
    "packed_causal_mask",
    "refresh_direct_sequential",
    "refresh_one_shot",
    "refresh_packed",
    "split_cost",
    "split_segments",
]


# ----------------------------------------------------------------------------------------------------------- checks


def check_packed_model(lm: LoadedModel) -> None:
    """Refuse a model whose layers the packed executor does not drive, before any work.

    Covered: ``lm.spec.model_type`` in :data:`PACKED_MODEL_TYPES`, the configuration accepted by
    :func:`sur_lab.models.check_supported` (full attention in every layer, exact RoPE, token-local MoE),
    transformers' own decoder-layer and attention classes for that family with their class ``forward`` (no subclass,
    no instance-level patch), evaluation mode, parameters on a single device.

    Raises:
        UnsupportedModelError: naming the offending field (``model_type``, ``layer_types``, ``sliding_window``,
            the layer class, ``training``, devices).
    """
    model_type = lm.spec.model_type
    if model_type not in PACKED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"lm.spec.model_type={model_type!r}: the packed executor drives {', '.join(PACKED_MODEL_TYPES)} layers only"
        )
    config = lm.model.config
    if getattr(config, "model_type", model_type) != model_type:
        raise UnsupportedModelError(f"config.model_type={config.model_type!r} differs from spec {model_type!r}")
    check_supported(config)  # full attention everywhere, exact RoPE, token-local MoE (re-checked: configs are mutable)
    if lm.model.training:
        raise UnsupportedModelError("model.training=True: the packed executor runs models in evaluation mode only")
    inner = getattr(lm.model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or getattr(inner, "embed_tokens", None) is None:
        raise UnsupportedModelError(f"{type(lm.model).__name__} has no .model.layers / .model.embed_tokens")
    native = f"transformers.models.{model_type}.modeling_{model_type}"
    for index, layer in enumerate(layers[: config.num_hidden_layers]):
        attn = getattr(layer, "self_attn", None)
        for module in (layer, attn):
            if module is None or type(module).__module__ != native:
                raise UnsupportedModelError(
                    f"layer {index}: {type(module).__name__} is not transformers' native {model_type} module; "
                    "custom layer forwards are not supported"
                )
            if "forward" in vars(module):
                raise UnsupportedModelError(
                    f"layer {index}: {type(module).__name__}.forward is patched on the instance"
                )
        if getattr(attn, "sliding_window", None) is not None:
            raise UnsupportedModelError(f"layer {index}: sliding_window={attn.sliding_window}; full attention only")
    devices = {p.device for p in lm.model.parameters()}
    if len(devices) != 1:
        raise UnsupportedModelError(f"parameters span devices {sorted(map(str, devices))}; one device only")


def check_packed_backend(lm: LoadedModel, backend: str, *, fused_scatter: bool = False) -> None:
    """Validate a backend name (and the Triton kernel's dtype and head-dim limits) before any work.

    Raises:
        ValueError: naming ``backend`` when it is not in :data:`PACKED_BACKENDS`, ``fused_scatter`` when it is asked
            for a backend other than ``"triton"``, or the model's dtype / head dim when the Triton kernel does not
            take them (FP16, BF16, FP32; head dim 64 or 128).
    """
    if backend not in PACKED_BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {', '.join(PACKED_BACKENDS)}")
    if fused_scatter and backend != "triton":
        raise ValueError(f"fused_scatter=True needs backend='triton', got backend={backend!r}")
    if backend == "triton":
        # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
        from sur_lab.executors.kernels.indexed_attention import (
            SUPPORTED_DTYPES,
            SUPPORTED_HEAD_DIMS,
        )

        if lm.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"backend='triton' takes float16, bfloat16 or float32 models; the model is {lm.dtype}")
        if lm.spec.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"backend='triton' takes head_dim 64 or 128; the model has head_dim {lm.spec.head_dim}")


def as_support(positions: Support | np.ndarray | torch.Tensor | Sequence[int], edit: EditedContext) -> Support:
    """Validate suffix-local positions against an edit and return them as a :class:`~sur_lab.budget.Support`.

    Args:
        positions: a ``Support`` or ``[B]`` integer suffix-local positions (tokens), strictly increasing, each in
            ``[0, S)``.
        edit: the edit whose suffix length S they index.

    Raises:
        ValueError: naming ``positions`` when not 1-D integers, outside the suffix ``[0, S)``, unsorted or duplicated,
            or a ``Support`` whose ``suffix_len`` differs from the edit's.
    """
    suffix_len = edit.suffix_len
    if isinstance(positions, Support):
        if positions.suffix_len != suffix_len:
            raise ValueError(f"positions.suffix_len={positions.suffix_len}; the edit's suffix has {suffix_len} tokens")
        return positions
    if isinstance(positions, torch.Tensor):
        positions = positions.detach().cpu().numpy()
    arr = np.asarray(positions)
    if arr.ndim != 1:
        raise ValueError(f"positions must be 1-D [B]; got shape {arr.shape}")
    if arr.size == 0:
        return Support(np.zeros(0, dtype=np.int64), suffix_len)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"positions must be integers (suffix-local token indices); got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= suffix_len:
        raise ValueError(f"positions must lie in the suffix [0, {suffix_len}); got {arr.min()}..{arr.max()}")
    if np.any(np.diff(arr) <= 0):
        raise ValueError("positions must be sorted and strictly increasing (no duplicates)")
    return Support(arr.astype(np.int64), suffix_len)


def causal_pair_count(absolute_positions: np.ndarray | Sequence[int]) -> int:
    """M(U) = sum over u in U of (u + 1): causal query-key pairs per head of packed attention (appendix 13.2)."""
    return int(np.sum(np.asarray(absolute_positions, dtype=np.int64) + 1))


def _check_cache(lm: LoadedModel, cache: DynamicCache) -> None:
    if num_layers(cache) != lm.spec.num_layers:
        raise ValueError(f"cache has {num_layers(cache)} layers; the model has {lm.spec.num_layers}")
    k, _ = layer_kv(cache, 0)
    if k.shape[0] != 1:
        raise ValueError(f"cache batch size must be 1; got keys of shape {tuple(k.shape)}")
    if k.device != lm.device:
        raise ValueError(f"cache is on {k.device}; the model is on {lm.device}")


# ------------------------------------------------------------------------------------------ cache and attention


class IndexedWriteCache:
    """The cache handed to each decoder layer during a packed traversal (Eq. 21).

    ``update`` writes the layer's fresh K/V ``[1, H_kv, B, d_h]`` at the absolute rows ``positions`` of the output
    cache, in place, and returns views of that layer's rows ``[0, kv_end)``: fresh rows at selected positions, reused
    rows elsewhere, nothing past the last selected position (no packed row can see it). It implements only the one
    method transformers' attention modules call on a cache; no other code path sees it.

    Args:
        layers: per-layer ``(K, V)`` tensors ``[1, H_kv, N, d_h]`` of the output cache (written in place).
        positions: ``[B]`` int64 absolute rows U on the cache's device.
        kv_end: rows returned to attention, ``u_B + 1`` (tokens).
        write: ``(k_cache, v_cache, k_new, v_new) -> None`` in-place writer (``index_copy_`` or the fused scatter).
    """

    def __init__(self, layers: Sequence[KV], positions: torch.Tensor, kv_end: int, write: Callable[..., None]):
        self.layers = list(layers)
        self.positions = positions
        self.kv_end = int(kv_end)
        self._write = write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Write fresh K/V at U for layer ``layer_idx``; return the layer's ``(K, V)`` rows ``[0, kv_end)`` (views)."""
        k, v = self.layers[layer_idx]
        self._write(k, v, key_states, value_states)
        return k[:, :, : self.kv_end], v[:, :, : self.kv_end]


def packed_causal_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean ``[1, 1, B, kv_len]`` mask, True where key j is visible to packed row r: ``j <= u_r`` (Eq. 22)."""
    return (torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None])[None, None]


def flex_block_mask(positions: torch.Tensor, kv_len: int, *, block_size: int = FLEX_BLOCK_SIZE):
    """FlexAttention ``BlockMask`` for packed rows at absolute ``positions``, built in O(B) (Eq. 23-24).

    Query tile t (rows ``t*block_size ..``) gets K/V blocks ``[0, n_full)`` as full blocks (visible to every row, no
    ``mask_mod``) and ``[n_full, n_total)`` as partial blocks, where ``n_full = floor((u_min + 1) / block_size)`` and
    ``n_total = ceil((u_max + 1) / block_size)`` come from the kernel plan builder; the ``mask_mod`` applies
    ``kv <= U[q]`` inside partial blocks. Equals ``create_block_mask(mask_mod, None, None, B, kv_len)`` (tested)
    without evaluating the mask on a B x kv_len grid.

    Args:
        positions: ``[B]`` int64 sorted unique absolute positions, all ``< kv_len``.
        kv_len: keys the attention sees (tokens).
        block_size: query and K/V tile size (power of two >= 16).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` with ``seq_lengths = (B, kv_len)``.

    Raises:
        ValueError: naming ``positions`` (see :func:`sur_lab.executors.kernels.build_indexed_attention_plan`) or ``kv_len``.
    """
    # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
    from sur_lab.executors.kernels import build_indexed_attention_plan

    plan = build_indexed_attention_plan(positions, block_m=block_size, block_n=block_size)
    if plan.max_position >= kv_len:
        raise ValueError(f"kv_len={kv_len} must exceed the largest position {plan.max_position}")
    device = plan.device
    num_kv_blocks = -(-kv_len // block_size)
    n_full, n_total = plan.n_full.long(), plan.n_total.long()  # [T]
    blocks = torch.arange(num_kv_blocks, device=device)
    # Unused trailing index entries must still name valid blocks.
    partial_idx = (n_full[:, None] + blocks[None, :]).clamp_max(num_kv_blocks - 1)
    full_idx = blocks[None, :].expand(plan.num_tiles, -1)
    # mask_mod may be evaluated on the padding rows of the last query tile: pad the lookup with u_B, never read past.
    table = torch.full((plan.num_tiles * block_size,), plan.max_position, dtype=torch.int64, device=device)
    table[: plan.num_rows] = plan.positions

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001 - flex's signature
        return kv_idx <= table[q_idx]

    as_int = lambda t: t.to(torch.int32)[None, None].contiguous()  # noqa: E731 - [1, 1, T, ...] as flex expects
    return BlockMask.from_kv_blocks(
        as_int(n_total - n_full),
        as_int(partial_idx),
        as_int(n_full),
        as_int(full_idx),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(plan.num_rows, kv_len),
    )


_COMPILED_FLEX: Callable | None = None
_COMPILED_FLEX_LOCK = threading.Lock()
#: Compiled flex graphs kept per process (one per shape); dynamo's default of 8 would send a ninth shape (e.g. a
#: Replay sweep over several budgets) to the eager path, which materializes the scores.
FLEX_RECOMPILE_LIMIT = 64


def _flex_attention(compiled: bool) -> Callable:
    """The flex_attention callable: compiled once per process or eager.

    Compiled with ``dynamic=False``: one graph per (B, kv_len) shape, kept in the process for up to
    :data:`FLEX_RECOMPILE_LIMIT` shapes and on disk by inductor's FX graph cache (on by default; later processes load
    it instead of compiling). Dynamic shapes would share one graph across B, but torch 2.13's CPU flex template fails
    to compile with them (``CppCompileError``: an undeclared ``cur_qSplitSize``), so they are not used.
    """
    global _COMPILED_FLEX

    if not compiled:
        return flex_attention
    with _COMPILED_FLEX_LOCK:  # two threads' first refreshes would otherwise wrap (and compile) it twice
        if _COMPILED_FLEX is None:
            graph = torch.compile(flex_attention, dynamic=False)

            def call(*args: Any, **kwargs: Any) -> torch.Tensor:
                with torch._dynamo.config.patch(recompile_limit=max(FLEX_RECOMPILE_LIMIT,
                                                                    torch._dynamo.config.recompile_limit)):
                    return graph(*args, **kwargs)

            _COMPILED_FLEX = call
        return _COMPILED_FLEX


@dataclass(frozen=True, eq=False)
class _PackedAttention(RoutedMask):
    """Per-refresh attention metadata, passed to every layer in place of ``attention_mask`` (built once, reused);
    the model's router (:mod:`sur_lab.attention`) calls it instead of the model's own attention function."""

    backend: str
    mask: torch.Tensor | None = None  # sdpa: [1, 1, B, kv_len] additive (0 where j <= u_r, -inf elsewhere)
    segments: tuple[tuple[KeySegment, torch.Tensor | None], ...] | None = None  # split sdpa: (segment, mask)
    block_mask: Any = None  # flex: BlockMask
    flex: Callable | None = None
    plan: Any = None  # triton: IndexedAttentionPlan; cpp: OnePassPlan

    def __call__(self, module: torch.nn.Module, query, key, value, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return _packed_attention_forward(module, query, key, value, self, **kwargs)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """``[1, Hq, B, d]`` x ``[1, Hkv, kv_len, d]`` -> ``[1, Hq, B, d]`` packed causal attention (Eq. 22)."""
        if self.backend == "sdpa":
            if self.segments is None:
                return _sdpa(query, key, value, self.mask, scale)
            return _split_sdpa(query, key, value, self.segments, scale)
        if self.backend == "flex":
            with warnings.catch_warnings():
                # The eager (uncompiled) path warns that it materializes scores: that is why it is the test path.
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                return self.flex(query, key, value, block_mask=self.block_mask, scale=scale, enable_gqa=True)
        if self.backend == "cpp":
            # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
            from sur_lab.executors.kernels.onepass import _attend

            return _attend(query, key, value, self.plan, scale)
        # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
        from sur_lab.executors.kernels import indexed_attention

        return indexed_attention(query, key, value, self.plan, scale=scale)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float):
    group = query.shape[1] // key.shape[1]
    if query.device.type == "cpu" or group == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    # On accelerators a masked enable_gqa call selects the math kernel; repeating K/V heads keeps the fused one.
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def _has_cpu_flash() -> bool:
    """Whether this torch has the CPU flash-attention op that returns the log-sum-exp (torch >= 2.2)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _split_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Sequence[tuple[KeySegment, torch.Tensor | None]],
    scale: float,
) -> torch.Tensor:
    """Key-split packed attention on a CPU: one flash call per key segment, merged by log-sum-exp.

    The GQA group is folded into the query rows in (row, group) order, ``[1, H_kv, B * g, d]``, so rows ``a..B-1``
    of every query head sharing a KV head form one contiguous block and each K/V segment is read once per KV head
    and query block. A segment's call starts at its ``call_row`` (rows before its ``row`` are padding that puts the
    call in a larger flash query block; their outputs are dropped). CPU flash returns each partial output in the
    query dtype (so BF16/FP16 partials are rounded before the merge; the split then errs up to ~2x the single
    call) and its log-sum-exp in FP32. Partial outputs are merged in FP32 (FP64 for FP64 inputs): with ``w = sigmoid(lse_s - lse) = exp(lse_s - logaddexp(lse, lse_s))``, ``o <- o + w (o_s - o)``
    (one ``lerp_``) and ``lse <- logaddexp(lse, lse_s)``, the exact log-sum-exp merge of two normalised partials.
    """
    _, num_heads, rows, dim = query.shape
    num_kv = key.shape[1]
    group = num_heads // num_kv
    folded = query.reshape(1, num_kv, group, rows, dim).transpose(2, 3).reshape(1, num_kv, rows * group, dim)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = lse = None
    last = len(segments) - 1
    for index, ((row, k0, k1, call_row), mask) in enumerate(segments):
        o, l = flash(folded[:, :, call_row * group :], key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=mask,
                     scale=scale)
        if call_row != row:  # drop the padding rows
            o, l = o[:, :, (row - call_row) * group :], l[:, :, (row - call_row) * group :]
        if o.dtype != acc:  # CPU flash returns the query dtype and an FP32 log-sum-exp; cast only what differs
            o = o.to(acc)
        if l.dtype != acc:
            l = l.to(acc)
        if out is None:  # the first segment starts at row 0 and initialises every row
            out, lse = o, l
            continue
        tail = lse[:, :, row * group :]
        out[:, :, row * group :].lerp_(o, (l - tail).sigmoid_()[..., None])
        if index != last:
            torch.logaddexp(tail, l, out=tail)
    return out.to(query.dtype).reshape(1, num_kv, rows, group, dim).transpose(2, 3).reshape(1, num_heads, rows, dim)


class KeySegment(NamedTuple):
    """One call of the key-split path: keys ``[key_start, key_end)`` attended by packed rows ``row..B-1``.

    ``call_row <= row``: the call runs rows ``call_row..B-1`` (the extra rows put it in a larger CPU flash query
    block, which reads each key fewer times; their outputs are discarded).
    """

    row: int
    key_start: int
    key_end: int
    call_row: int


def _per_key_cost(rows: np.ndarray) -> np.ndarray:
    """Cost of one key for calls of ``rows`` folded query rows: the rows (weighted by their flash block size's
    factor) plus :data:`SPLIT_BLOCK_COST` per query block (:data:`FLASH_Q_BLOCKS`)."""
    rows = np.asarray(rows, dtype=np.int64)
    block = np.full(rows.shape, FLASH_Q_BLOCKS[-1][1], dtype=np.int64)
    factor = np.full(rows.shape, FLASH_Q_BLOCKS[-1][2])
    for minimum, size, weight in reversed(FLASH_Q_BLOCKS[:-1]):
        block, factor = np.where(rows >= minimum, size, block), np.where(rows >= minimum, weight, factor)
    return rows * factor + SPLIT_BLOCK_COST * -(-rows // block)


def _call_rows(rows: np.ndarray, total: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest call size >= ``rows`` (folded, multiples of ``group``): ``rows`` itself or the first multiple of
    ``group`` at or above a larger flash block threshold, when that is <= ``total``; with its per-key cost."""
    rows = np.asarray(rows, dtype=np.int64)
    best, best_cost = rows, _per_key_cost(rows)
    for minimum, _, _ in FLASH_Q_BLOCKS[:-1]:
        padded = np.where(rows < minimum, -(-minimum // group) * group, rows)
        ok = padded <= total
        cost = np.where(ok, _per_key_cost(np.where(ok, padded, rows)), np.inf)
        better = cost < best_cost
        best, best_cost = np.where(better, padded, best), np.where(better, cost, best_cost)
    return best, best_cost


def _split_candidates(u: np.ndarray, granule: int, key_step: int) -> np.ndarray:
    """Candidate segment boundaries (keys), ``0`` first and ``u_B + 1`` last (:func:`split_segments`)."""
    b, end = u.size, int(u[-1]) + 1
    starts = np.flatnonzero(np.diff(u) > 1) + 1  # interval starts after the first
    rows = np.union1d(np.arange(granule, b, granule), starts)  # all in [1, B)
    keys = np.concatenate(([0, u[0]], u[rows - 1] + 1, u[starts], np.arange(key_step, end, key_step)))
    keys = np.unique(keys[keys < end])
    if keys.size > 256:  # keep the DP cheap for huge supports: 256 evenly spread candidates, key 0 included
        keys = np.unique(keys[np.linspace(0, keys.size - 1, 256).round().astype(np.int64)])
    return np.append(keys, end)


def _segment_cost(u: np.ndarray, k0: np.ndarray, k1: np.ndarray, group: int, call_cost: float) -> np.ndarray:
    """Modelled cost of calls over keys ``[k0, k1)`` (arrays), each run by the rows that see ``k0`` (padded)."""
    first = np.searchsorted(u, k0, side="left")
    rows = (u.size - first) * group
    length = k1 - k0
    effective = length + SPLIT_LONG_EXTRA * np.maximum(0, length - SPLIT_LONG_KEYS)
    masked = u[np.minimum(first, u.size - 1)] < k1 - 1  # the first attending row misses some key of the call
    effective = effective * np.where(masked, 1 + SPLIT_MASK_EXTRA, 1.0)
    return call_cost + effective * _call_rows(rows, u.size * group, group)[1]


def split_cost(
    positions: Sequence[int] | np.ndarray,
    segments: Sequence[KeySegment | tuple[int, int, int]],
    *,
    group: int = 1,
    call_cost: float = SPLIT_CALL_COST,
) -> float:
    """Modelled cost of a key split (what :func:`split_segments` minimises), in folded row-keys.

    Per call: ``call_cost`` plus, per key (keys past :data:`SPLIT_LONG_KEYS` weighted ``1 + SPLIT_LONG_EXTRA``,
    all keys of a masked call ``1 + SPLIT_MASK_EXTRA`` more), the call's folded query rows (weighted by their flash
    query-block size) plus :data:`SPLIT_BLOCK_COST` per CPU flash query block (:data:`FLASH_Q_BLOCKS`). A call's
    rows are implied by its keys: the rows that see its first key, padded to a flash block threshold when that is
    cheaper (the ``row`` / ``call_row`` that :func:`split_segments` returns; given ones are not read). The model is
    of one torch thread: with more, calls also split their work across threads.

    Args:
        positions: ``[B]`` sorted unique absolute positions U (tokens).
        segments: ``(row, key_start, key_end[, call_row])`` in key order, covering keys ``[0, u_B]`` exactly.
        group: query heads per KV head, >= 1.
        call_cost: cost of one call in folded row-keys, >= 0.

    Returns:
        The summed modelled cost (folded row-keys; ~5 ns each on the calibration machine).

    Raises:
        ValueError: naming ``segments`` when they are empty, do not start at key 0, leave a gap, overlap, are
            empty intervals, or do not end at ``u_B + 1``; ``group`` when < 1; ``call_cost`` when negative.
    """
    u = np.asarray(positions, dtype=np.int64)
    if group < 1:
        raise ValueError(f"group={group} must be >= 1")
    if call_cost < 0:
        raise ValueError(f"call_cost={call_cost} must be >= 0")
    k0 = np.asarray([seg[1] for seg in segments], dtype=np.int64)
    k1 = np.asarray([seg[2] for seg in segments], dtype=np.int64)
    if (
        k0.size == 0
        or k0[0] != 0
        or np.any(k1 <= k0)
        or np.any(k0[1:] != k1[:-1])
        or u.size == 0
        or k1[-1] != int(u[-1]) + 1
    ):
        raise ValueError("segments must cover keys [0, u_B] in order, without gaps, overlaps or empty segments")
    return float(np.sum(_segment_cost(u, k0, k1, group, call_cost)))


def split_segments(
    positions: Sequence[int] | np.ndarray,
    *,
    group: int = 1,
    call_cost: float = SPLIT_CALL_COST,
    granule: int = SPLIT_GRANULE,
    key_step: int = SPLIT_KEY_STEP,
) -> list[KeySegment]:
    """Key segments of the key-split SDPA path, covering keys ``[0, u_B]`` (Eq. 22-24 on a CPU).

    Segment ``(row, k0, k1, call_row)`` is attended by packed rows ``row..B-1``, the rows with ``u_r >= k0`` (every
    row that can see any of its keys); rows whose ``u_r < k1 - 1`` are masked inside it. Its call runs rows
    ``call_row..B-1`` (see :class:`KeySegment`). Boundaries are chosen among the keys just after every
    ``granule``-th selected position, each interval's first position and the key after its last, and multiples of
    ``key_step``, by dynamic programming to minimise :func:`split_cost` (calls, row-keys, query-block re-reads,
    long calls, masks; so an interval's own keys often get a small masked call and the gap before it an unmasked
    one). A compact support gives one segment per ~:data:`SPLIT_LONG_KEYS` keys. O(C^2) in the C candidates (at
    most 256, evenly thinned beyond that).

    Args:
        positions: ``[B]`` sorted unique absolute positions U (tokens), B >= 1.
        group: query heads per KV head (the folded rows per packed row), >= 1.
        call_cost: cost of one call in folded row-keys (:data:`SPLIT_CALL_COST`), >= 0.
        granule: candidate row spacing (rows), >= 1.
        key_step: candidate key spacing (keys), >= 1.

    Returns:
        Segments in key order; the first has ``row = 0`` and ``key_start = 0``, the last ends at ``u_B + 1``.

    Raises:
        ValueError: naming ``positions`` when empty, not 1-D, or not strictly increasing non-negative integers,
            ``group``, ``granule`` or ``key_step`` when < 1, ``call_cost`` when negative.
    """
    u = np.asarray(positions, dtype=np.int64)
    if u.ndim != 1 or u.size == 0 or u[0] < 0 or np.any(np.diff(u) <= 0):
        raise ValueError("positions must be a non-empty 1-D strictly increasing array of non-negative positions")
    for name, value in (("group", group), ("granule", granule), ("key_step", key_step)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if call_cost < 0:
        raise ValueError(f"call_cost={call_cost} must be >= 0")
    keys = _split_candidates(u, granule, key_step)
    pair_cost = _segment_cost(u, keys[:, None], keys[None, :], group, call_cost)  # [i, j]: a call over keys i..j
    best = np.full(keys.size, np.inf)
    prev = np.zeros(keys.size, dtype=np.int64)
    best[0] = 0.0
    for j in range(1, keys.size):
        costs = best[:j] + pair_cost[:j, j]
        i = int(np.argmin(costs))
        best[j], prev[j] = costs[i], i
    chain, j = [], keys.size - 1
    while j:
        chain.append(j)
        j = int(prev[j])
    chain.append(0)
    chain.reverse()
    starts = keys[chain[:-1]]
    rows = np.searchsorted(u, starts, side="left")
    call = u.size - _call_rows((u.size - rows) * group, u.size * group, group)[0] // group
    return [KeySegment(int(r), int(k0), int(keys[j]), int(c)) for r, k0, j, c in zip(rows, starts, chain[1:], call)]


def _packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Packed attention with transformers' attention-function signature: returns ``([1, B, Hq, d], None)`` like
    ``sdpa_attention_forward``; called by the model's router for a call whose ``attention_mask`` is a packed plan."""
    if not isinstance(attention_mask, _PackedAttention):
        raise RuntimeError("the packed attention serves packed refreshes only (attention_mask must be a packed plan); "
                           "it cannot serve an ordinary forward")
    if sliding_window is not None:
        raise UnsupportedModelError(f"sliding_window={sliding_window}: packed attention covers full attention only")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = attention_mask.attend(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


def _make_attention(
    backend: str,
    positions: torch.Tensor,
    kv_len: int,
    dtype: torch.dtype,
    *,
    flex_compile: bool,
    plan: Any = None,
    sdpa_split: bool = False,
    num_kv_groups: int = 1,
) -> _PackedAttention:
    if backend == "cpp":
        # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
        from sur_lab.executors.kernels import onepass

        if positions.device.type == "cpu" and positions.numel() and onepass.onepass_available():
            if dtype in onepass.ONEPASS_DTYPES:  # read at call time: a kernel built without a dtype lists it not
                return _PackedAttention("cpp", plan=onepass.build_onepass_plan(positions, group=num_kv_groups))
            _warn_kernel_dtype(dtype)
        backend, sdpa_split = "sdpa", True  # the fallback: the key split on a CPU, one masked call elsewhere
    if backend == "sdpa":
        if sdpa_split and positions.device.type == "cpu" and positions.numel() and _has_cpu_flash():
            # Module attributes read at call time: tests lower the call cost to force several segments.
            segments = split_segments(positions.numpy(), group=num_kv_groups, call_cost=SPLIT_CALL_COST)
            return _PackedAttention("sdpa", segments=_segment_masks(positions, segments, dtype, num_kv_groups))
        # SDPA turns a boolean mask into an additive one on every call; doing it once here saves 2 ops per layer.
        return _PackedAttention("sdpa", mask=_additive_mask(positions, 0, kv_len, dtype)[None, None])
    if backend == "flex":
        block_mask = flex_block_mask(positions, kv_len)
        return _PackedAttention("flex", block_mask=block_mask, flex=_flex_attention(flex_compile))
    return _PackedAttention("triton", plan=plan)


_KERNEL_DTYPE_WARNED: set[torch.dtype] = set()


def _warn_kernel_dtype(dtype: torch.dtype) -> None:
    """One ``RuntimeWarning`` per process and dtype: the one-pass kernel has no ``dtype`` path, so packed attention
    runs the key split in that dtype (the cache is never up-cast to a dtype the kernel has)."""
    if dtype in _KERNEL_DTYPE_WARNED:
        return
    _KERNEL_DTYPE_WARNED.add(dtype)
    warnings.warn(f"sur_lab: the one-pass C++ attention kernel has no {str(dtype).removeprefix('torch.')} path; "
                  "packed attention falls back to the key-split SDPA path in that dtype", RuntimeWarning, stacklevel=3)


def _segment_masks(
    positions: torch.Tensor, segments: Sequence[KeySegment], dtype: torch.dtype, group: int
) -> tuple[tuple[KeySegment, torch.Tensor | None], ...]:
    """Each segment with its additive ``[1, 1, (B - call_row) * group, k1 - k0]`` mask in (row, group) order, or
    None when every row of the call sees the whole segment; built once per refresh. Padding rows (before ``row``)
    get 0 (their outputs are discarded; a finite row keeps the kernel off all-masked rows)."""
    out = []
    for seg in segments:
        row, k0, k1, call_row = seg
        if int(positions[row]) >= k1 - 1:  # every attending row sees the whole segment
            out.append((seg, None))
            continue
        additive = _additive_mask(positions[call_row:], k0, k1, dtype)
        additive[: row - call_row] = 0  # padding rows (their own positions would hide every key from some)
        out.append((seg, additive.repeat_interleave(group, dim=0)[None, None]))
    return tuple(out)


def _additive_mask(positions: torch.Tensor, k0: int, k1: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, k1 - k0]`` additive mask of keys ``k0..k1-1``: 0 where ``j <= u_r``, -inf elsewhere (Eq. 22).

    One comparison and one in-place fill (no boolean negation, no second buffer).
    """
    hidden = torch.arange(k0, k1, device=positions.device)[None, :] > positions[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, -math.inf)


def _run_layers_(
    lm: LoadedModel,
    layers: Sequence[KV],
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_end: int,
    attention: _PackedAttention,
    write: Callable[..., None],
) -> None:
    """One layer-major traversal of ``token_ids`` ``[B]`` at absolute ``positions`` ``[B]``; writes K/V in place.

    The model's own embedding, rotary embedding (positions U) and decoder layers are called; the final norm and LM
    head are not (the output is the cache).
    """
    inner = lm.model.model
    hidden = inner.embed_tokens(token_ids[None])  # [1, B, hidden]: the packed hidden-state buffer
    position_ids = positions[None]
    position_embeddings = rotary_embedding(lm.model)(hidden, position_ids=position_ids)
    cache = IndexedWriteCache(layers, positions, kv_end, write)
    install_router(lm.model)  # once per model: `attention` reaches our function, every other call the model's own
    for layer in inner.layers[: lm.model.config.num_hidden_layers]:
        hidden = layer(
            hidden,
            attention_mask=attention,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )


def _index_copy_writer(positions: torch.Tensor) -> Callable[..., None]:
    def write(k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        k.index_copy_(2, positions, k_new if k_new.dtype == k.dtype else k_new.to(k.dtype))
        v.index_copy_(2, positions, v_new if v_new.dtype == v.dtype else v_new.to(v.dtype))

    return write


def _fused_writer(plan: Any) -> Callable[..., None]:
    # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
    from sur_lab.executors.kernels import indexed_scatter_kv

    def write(k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        indexed_scatter_kv(k, v, k_new, v_new, plan)

    return write


def _validate(lm: LoadedModel, shift: DynamicCache, edit: EditedContext, positions) -> Support:
    check_packed_model(lm)
    support = as_support(positions, edit)
    check_support(edit, support, shift)
    _check_cache(lm, shift)
    return support


# ------------------------------------------------------------------------------------------------------ executors


@torch.no_grad()
def refresh_packed(
    lm: LoadedModel,
    shift: DynamicCache,
    edit: EditedContext,
    positions: Support | np.ndarray | torch.Tensor | Sequence[int],
    *,
    backend: str = "sdpa",
    fused_scatter: bool = False,
    flex_compile: bool = True,
    sdpa_split: bool = False,
    inplace: bool = False,
) -> DynamicCache:
    """Packed refresh: recompute the selected suffix positions in one layer-major traversal (appendix 13.2).

    Args:
        lm: a model accepted by :func:`check_packed_model`.
        shift: Shift cache of ``p ⊕ s`` (``p + S`` rows, ``[1, H_kv, p + S, d_h]`` per layer); not modified.
        edit: the edit (its edited token ids are gathered at U).
        positions: a ``Support`` or ``[B]`` suffix-local positions, strictly increasing in ``[0, S)``.
        backend: ``"sdpa"``, ``"flex"``, ``"triton"`` or ``"cpp"`` (module docstring).
        fused_scatter: write fresh K/V with the kernel module's indexed scatter instead of ``index_copy_``
            (``backend="triton"`` only).
        flex_compile: compile ``flex_attention`` (``backend="flex"``); False runs the eager reference.
        sdpa_split: ``backend="sdpa"`` on a CPU only (elsewhere one masked call runs): split the keys into
            segments attended only by the rows that can see them, so attention work follows M(U) (appendix 13.2)
            rather than ``B * (u_B + 1)``; see :func:`split_segments` and the module docstring. Equal to the single
            masked call up to the reduction order of the log-sum-exp merge.
        inplace: write into ``shift`` itself, with no output clone: the input is consumed (its rows at U are
            overwritten; every other row keeps its bits) and returned. Bitwise equal to ``inplace=False``.

    Returns:
        A new cache of ``p + S`` rows (``shift`` itself when ``inplace``): rows at ``p + positions`` recomputed with
        each selected position attending to its full causal history (fresh K/V at selected positions, Shift K/V in
        the gaps); every other row bitwise that of ``shift``. B = 0 returns a plain copy (``shift`` when
        ``inplace``).

    Raises:
        UnsupportedModelError: see :func:`check_packed_model`.
        ValueError: see :func:`as_support` (``positions``), :func:`check_packed_backend` (``backend``),
            :func:`sur_lab.executors.check_support` (``cache``), batch/device/layer mismatches of ``shift``; all
            raised before the clone and before any forward.

    Source: section 3.3, appendix 13.2, Eq. 21-22 (Eq. 23-24 for the flex and Triton tile plans).
    """
    support = _validate(lm, shift, edit, positions)
    check_packed_backend(lm, backend, fused_scatter=fused_scatter)
    if sdpa_split and backend != "sdpa":
        raise ValueError(f"sdpa_split=True needs backend='sdpa', got backend={backend!r}")
    out = shift if inplace else clone_cache(shift)  # the one output clone (none in place); written below
    if support.size == 0:
        return out
    device = lm.device
    absolute = torch.from_numpy(support.absolute(edit.prefix_len)).to(device)
    kv_end = int(absolute[-1]) + 1
    check_context_length(lm, kv_end)  # the traversal computes rows up to the last selected position
    plan = None
    if backend == "triton":
        # optional dependency: sur_lab.executors.kernels imports Triton (extra) when installed, ~0.4 s
        from sur_lab.executors.kernels import build_indexed_attention_plan

        plan = build_indexed_attention_plan(absolute)  # once per refresh, reused by every layer
    # Compiled flex gets the full cache length so its graph does not change with the last selected position.
    kv_len = cache_length(out) if backend == "flex" else kv_end
    attention = _make_attention(
        backend,
        absolute,
        kv_len,
        lm.dtype,
        flex_compile=flex_compile,
        plan=plan,
        sdpa_split=sdpa_split,
        num_kv_groups=lm.spec.gqa_group,
    )
    write = _fused_writer(plan) if fused_scatter else _index_copy_writer(absolute)
    token_ids = edit.edited_ids.to(device)[absolute]
    _run_layers_(lm, to_tensors(out), token_ids, absolute, kv_len, attention, write)
    return out


@torch.no_grad()
def refresh_direct_sequential(
    lm: LoadedModel,
    shift: DynamicCache,
    edit: EditedContext,
    positions: Support | np.ndarray | torch.Tensor | Sequence[int],
    *,
    inplace: bool = False,
) -> DynamicCache:
    """Direct sequential control: one output clone refreshed in place, one traversal per interval (appendix 13.3).

    For each maximal interval ``[a, b)`` in order, the interval's tokens run through the model's layers (SDPA,
    causal mask) writing their K/V into the output cache in place and attending to views of its rows ``[0, p + b)``;
    earlier intervals' fresh rows are visible to later ones, as in the reference ``"sequential"`` executor, but no
    prefix copy is made and nothing is written back.

    Args and Raises: as :func:`refresh_packed` (no backend); ``inplace=True`` refreshes ``shift`` itself (consumed,
    returned, no clone; bitwise equal to the cloning path).

    Returns:
        A new cache of ``p + S`` rows equal to the sequential executor's up to reduction order.
    """
    support = _validate(lm, shift, edit, positions)
    out = shift if inplace else clone_cache(shift)
    layers = to_tensors(out)
    device = lm.device
    ids = edit.edited_ids.to(device)
    p = edit.prefix_len
    if support.intervals:
        check_context_length(lm, p + support.intervals[-1][1])  # rows up to the last interval's end
    for a, b in support.intervals:
        rows = torch.arange(p + a, p + b, device=device)
        attention = _make_attention("sdpa", rows, p + b, lm.dtype, flex_compile=False)
        _run_layers_(lm, layers, ids[p + a : p + b], rows, p + b, attention, _index_copy_writer(rows))
    return out


@torch.no_grad()
def refresh_one_shot(
    lm: LoadedModel,
    shift: DynamicCache,
    edit: EditedContext,
    positions: Support | np.ndarray | torch.Tensor | Sequence[int],
    *,
    inplace: bool = False,
) -> DynamicCache:
    """One-shot sparse control: all selected tokens in one ordinary model forward with a custom 4-D mask.

    The unselected rows ``[0, u_B] \\ U`` of the Shift cache are gathered into a fresh ``DynamicCache`` (keys keep
    their RoPE: nothing moves), the B selected tokens are forwarded at ``position_ids = U`` through the model's normal
    ``forward`` with a 4-D mask in which row r sees gathered row g iff ``g < u_r`` and new row r' iff ``r' <= r``, and
    the B appended K/V rows are scattered at U into one clone of the Shift cache (appendix 13.3, "one-shot sparse").

    Args and Raises: as :func:`refresh_packed` (no backend); additionally ``UnsupportedModelError`` when the model's
    attention implementation is neither ``"sdpa"`` nor ``"eager"`` (the mask format is chosen for these two).
    ``inplace=True`` scatters into ``shift`` itself (consumed, returned, no clone; bitwise equal to the cloning path).

    Returns:
        A new cache of ``p + S`` rows equal to the sequential executor's up to reduction order.
    """
    support = _validate(lm, shift, edit, positions)
    implementation = native_implementation(lm.model.config)
    if implementation not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"one-shot builds masks for 'sdpa' or 'eager' attention; the model uses {implementation!r}"
        )
    out = shift if inplace else clone_cache(shift)
    if support.size == 0:
        return out
    device = lm.device
    absolute = torch.from_numpy(support.absolute(edit.prefix_len)).to(device)
    kv_end = int(absolute[-1]) + 1
    keep = torch.ones(kv_end, dtype=torch.bool, device=device)
    keep[absolute] = False
    gathered_rows = keep.nonzero().squeeze(1)  # [kv_end - B], sorted
    work = from_tensors([(k[:, :, gathered_rows], v[:, :, gathered_rows]) for k, v in to_tensors(out)])
    b = absolute.numel()
    visible_old = gathered_rows[None, :] < absolute[:, None]  # [B, kv_end - B]
    visible_new = torch.ones(b, b, dtype=torch.bool, device=device).tril()  # new row r' visible iff r' <= r
    mask = torch.cat((visible_old, visible_new), dim=1)[None, None]
    if implementation == "eager":
        # eager attention adds the mask to the scores, so it must be additive (0 / dtype minimum).
        mask = torch.zeros(mask.shape, dtype=lm.dtype, device=device).masked_fill(~mask, torch.finfo(lm.dtype).min)
    # MoE heads compute a load-balancing loss when config.output_router_logits is set, and that loss reads the mask as
    # a 2-D padding mask: it fails on our 4-D one. It is a training quantity; switch it off for this forward.
    check_context_length(lm, kv_end)
    takes_flag = "output_router_logits" in inspect.signature(lm.model.forward).parameters
    extra = {"output_router_logits": False} if takes_flag else {}
    lm.model(
        input_ids=edit.edited_ids.to(device)[absolute][None],
        position_ids=absolute[None],
        attention_mask=mask,
        cache=work,
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )
    for layer, (k, v) in enumerate(to_tensors(work)):
        scatter_rows_(out, layer, absolute, k[:, :, -b:], v[:, :, -b:])
    return out


def _register(name: str, fn: Callable[..., DynamicCache] = None, **options: Any) -> None:
    """Register ``name`` (input kept) and ``name + "-inplace"`` (input consumed) for ``fn`` with ``options``."""
    fn = fn or refresh_packed
    for suffix, inplace in (("", False), (INPLACE_SUFFIX, True)):

        def executor(lm: LoadedModel, shift: DynamicCache, edit: EditedContext, support: Support, inplace=inplace):
            return fn(lm, shift, edit, support, inplace=inplace, **options)

        full = name + suffix
        executor.__name__ = f"refresh_{full.replace('-', '_')}"
        consumed = " in place (consumes the input cache)" if inplace else ""
        executor.__doc__ = f"Registered executor {full!r}: :func:`{fn.__name__}` with {options}{consumed}."
        register_executor(full)(executor)


# The default: the one-pass C++ kernel on a CPU (faster than the key split at every support the benchmark times:
# scripts/attention_paths.py, scripts/bench_packed_refresh.py), the key split where it cannot be built, one masked
# SDPA call elsewhere.
_register("packed", backend="cpp")
_register("packed-sdpa", backend="sdpa")
_register("packed-sdpa-split", backend="sdpa", sdpa_split=True)
_register("packed-flex", backend="flex")
_register("packed-flex-eager", backend="flex", flex_compile=False)
_register("packed-cpp", backend="cpp")
_register("packed-triton", backend="triton")
_register("packed-triton-fused", backend="triton", fused_scatter=True)
_register("direct-sequential", refresh_direct_sequential)
_register("one-shot", refresh_one_shot)
